#!/bin/bash
# FSDP2 with teraio offload on the 2-GPU machine (nvidia-h200-x2), in one call:
#   benches/torch/run-fsdp.sh
# bench_fsdp.py starts both ranks itself (NCCL) and trains, 12 steps each: FSDP2 alone, FSDP2 with
# CPUOffloadPolicy, FSDP2 inside teraio.offload at 50% of the first run's per-rank peak (one store
# per rank: $STORE_DIR/rank<r>/dev0). RESULT lines (results-fsdp.jsonl) and the log go to $OUT.
# Needs .whl-py/ (ignored by git; carry it): the teraio wheel built on the dev machine
# (`maturin build --release --strip -m bindings/python/Cargo.toml -o .whl-py`).
# CPU smoke run of the same script: python3 benches/torch/bench_fsdp.py --device cpu --tiny
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/teraio-fsdp-out}
STORE_DIR=${STORE_DIR:-/root/teraio-fsdp}  # a real file system: the store uses O_DIRECT (not tmpfs)
STEPS=${STEPS:-12}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl-py/teraio-*.whl || exit 1
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
timeout -k 10 500 python3 benches/torch/bench_fsdp.py --device cuda --steps "$STEPS" \
  --store-dir "$STORE_DIR" --out "$RESULTS" > "$OUT/fsdp.log" 2>&1
status=$?
grep -v RESULT "$OUT/fsdp.log" | grep -vE "^W[0-9]+ " | tail -40 | cut -c1-300
rm -rf "$STORE_DIR"
python3 - "$RESULTS" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if not r["ok"]:
        print(f"{r['config']:18} FAILED: " + "; ".join(x.get("error", "") for x in r["ranks"]))
        continue
    peaks = ", ".join(f"{p / 2**30:.2f}" if p else "-" for p in r["peak_bytes_per_rank"])
    print(f"{r['config']:18} {r['ms_per_iter']:8.1f} ms/iter  speed vs fsdp {r.get('speed_vs_fsdp', 0):.2f}  "
          f"peak GiB/rank [{peaks}]  losses bitwise {r.get('losses_bitwise_equal')} "
          f"(max diff {r.get('max_abs_loss_diff', 0):.2e})")
PY
echo "took ${SECONDS}s"
exit $status
