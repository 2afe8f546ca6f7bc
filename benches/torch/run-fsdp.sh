#!/bin/bash
# FSDP2 with teraio offload on the 2-GPU machine (nvidia-h200-x2), in one call:
#   benches/torch/run-fsdp.sh                       # each of $FAMILIES: the five 50% configurations
#   BIG=1 FAMILIES= benches/torch/run-fsdp.sh       # the model FSDP2 alone cannot hold
#                                                   # (BIG_STORE_GIB: each rank's store, 40;
#                                                   # BIG_CONFIGS: "big_teraio big_fsdp", or
#                                                   # big_teraio_host: its shards in host memory)
#   CONFIGS="fsdp fsdp_teraio": only those configurations per family (fsdp_teraio needs fsdp's peak);
#   PROFILE_STEP="N ...": rank 0 records these steps of each configuration with torch.profiler (timeline.py's
#   summary in the log, the gzipped timeline in $OUT); PY_OVERLAY=DIR: DIR's teraio *.py files over
#   the wheel's; TERAIO_OPTIONS="name=value,...": more teraio.offload options for the teraio rows;
#   BUDGET_SHARE=0.7: the capped rows' budget as a share of FSDP2's per-rank peak (default 0.5);
#   NO_TRIAL=1: teraio's block plan runs as chosen, without its A/B trial (a probe)
# bench_fsdp.py starts both ranks itself (NCCL) and trains $STEPS steps each (its docstring lists
# the configurations; teraio gets one store per rank: $STORE_DIR/rank<r>/dev0). RESULT lines
# (results-fsdp.jsonl), the log and rank 0's profiled traces (gzipped) go to $OUT.
# Needs .whl-py/ (ignored by git; carry it): the teraio wheel built on the dev machine
# (`maturin build --release --strip -m bindings/python/Cargo.toml -o .whl-py`).
# CPU smoke run of the same script: python3 benches/torch/bench_fsdp.py --device cpu --tiny
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/teraio-fsdp-out}
STORE_DIR=${STORE_DIR:-/root/teraio-fsdp}  # a real file system: the store uses O_DIRECT (not tmpfs)
# 30 steps, the first 20 left out of ms/iter: teraio measures, plans and runs its A/B trial in
# those, so ms/iter is the speed a long run settles at, for every configuration alike.
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-20}
FAMILIES=${FAMILIES-llama qwen2 llama-wide}
BIG=${BIG:-0}
DEADLINE=${DEADLINE:-540}  # seconds for all the runs together
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl-py/teraio-*.whl || exit 1
if [ -n "${PY_OVERLAY:-}" ]; then
  [ -d "$PY_OVERLAY" ] || { echo "PY_OVERLAY=$PY_OVERLAY is not a folder" >&2; exit 2; }
  (cd "$PY_OVERLAY" && find . -name '*.py' -exec cp --parents {} /tmp/site/teraio/ \;) || exit 1
fi
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# NVLink multicast stays off (NCCL, PyTorch's symmetric memory, NVSHMEM): on the shared GPU hosts a
# program that uses it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RESULTS="$OUT/results-fsdp.jsonl"
rm -f "$RESULTS"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
  "gpus", torch.cuda.device_count())'
status=0
: > "$OUT/fsdp.log"
runs=()
extra=""
[ -n "${CONFIGS:-}" ] && extra="--configs $CONFIGS"
[ -n "${PROFILE_STEP:-}" ] && extra="$extra --profile-step $PROFILE_STEP"
[ -n "${TERAIO_OPTIONS:-}" ] && extra="$extra --teraio-options $TERAIO_OPTIONS"
[ -n "${BUDGET_SHARE:-}" ] && extra="$extra --budget-share $BUDGET_SHARE"
[ -n "${NO_TRIAL:-}" ] && extra="$extra --no-trial"
for family in $FAMILIES; do runs+=("--family $family $extra"); done
[ "$BIG" = 1 ] && runs+=("--configs ${BIG_CONFIGS:-big_teraio big_fsdp} --big-store-gib ${BIG_STORE_GIB:-40}")
for run in "${runs[@]}"; do
  left=$((DEADLINE - SECONDS))
  [ "$left" -gt 30 ] || { echo "no time left for: $run"; status=1; continue; }
  echo "== $run (${left}s left)" | tee -a "$OUT/fsdp.log"
  # shellcheck disable=SC2086  # $run is a list of arguments
  timeout -k 10 "$left" python3 benches/torch/bench_fsdp.py --device cuda --steps "$STEPS" --warmup "$WARMUP" $run \
    --store-dir "$STORE_DIR" --out "$RESULTS" --trace-dir "$OUT" >> "$OUT/fsdp.log" 2>&1 || status=$?
  rm -rf "$STORE_DIR"
done
gzip -f "$OUT"/trace-*.json 2>/dev/null
# Many traces: one archive (what comes back from the machine is limited in files).
ls "$OUT"/*.json.gz > /dev/null 2>&1 && tar -C "$OUT" -czf "$OUT/traces.tgz" $(cd "$OUT" && ls ./*.json.gz) && rm -f "$OUT"/*.json.gz
grep -v RESULT "$OUT/fsdp.log" | grep -vE "^W[0-9]+ " | grep -E "^==|Error|error|iteration:|peak GPU|per iteration|plan:|host time in teraio" \
  | tail -80 | cut -c1-300
python3 - "$RESULTS" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    name = f"{r['family']:10} {r['config']:17}"
    if not r["ok"]:
        print(f"{name} FAILED: " + "; ".join(x.get("error", "")[:200] for x in r["ranks"]))
        continue
    peaks = ", ".join(f"{p / 2**30:.2f}" if p else "-" for p in r["peak_bytes_per_rank"])
    # Without an FSDP2 row to compare with (the big model: FSDP2 alone does not fit), no ratio.
    speed = f"speed vs fsdp {r['speed_vs_fsdp']:.2f}" if "speed_vs_fsdp" in r else "no fsdp row to compare"
    losses = (f"losses bitwise {r['losses_bitwise_equal']} (max diff {r.get('max_abs_loss_diff', 0):.2e})"
              if "losses_bitwise_equal" in r else "no fsdp losses to compare")
    print(f"{name} {r['ms_per_iter']:8.1f} ms/iter  {speed}  peak GiB/rank [{peaks}]  {losses}")
    for rank in r["ranks"]:
        if rank.get("predicted_ms_per_iter") is not None:
            tiers = ", ".join(f"{t} {v['offloaded'] / 2**30:.2f} GiB out" for t, v in rank["tiers"].items())
            own, group = rank.get("own_predicted_ms"), rank.get("group_predicted_ms")
            ranks = f" (alone {own:.1f}, the ranks {group:.1f})" if own is not None and group is not None else ""
            print(f"    rank {rank['rank']}: plan settled at {rank['settled_ms_per_iter']:.1f} ms/iter over "
                  f"{rank['settled_steps']} steps, predicted {rank['predicted_ms_per_iter']:.1f}{ranks}; {tiers}")
        if rank.get("host_step"):
            print(f"    rank {rank['rank']}: host shards stepped by {rank['host_step']}")
PY
echo "took ${SECONDS}s"
exit $status
