#!/bin/bash
# The GPU machine's PyTorch checks and benchmarks, one mode per call (docs/benchmarks.md):
#   run-gpu.sh tests          # the Python tests on CUDA, the docs' examples included (~3 min):
#                             #   their programs (`python`, `python cuda`) and `sh cuda` blocks;
#                             #   the CPU shell blocks (cargo builds) run in CI
#   run-gpu.sh examples       # the docs' examples alone, as in `tests`
#   run-gpu.sh regime         # the users' regime table (bench_regime.py), one family per call:
#                             #   qwen2 in bf16 autocast with SDPA, ideal twice, then teraio (default
#                             #   arguments), HF checkpointing, selective checkpointing, save_on_cpu,
#                             #   torchtune at 65% and 50% of the ideal peak (rows the deadline cuts
#                             #   are recorded as skipped); then the fp32 flagship's ideal, HF
#                             #   checkpointing and teraio (default arguments) rows (~9 min).
#                             #   FAMILIES=llama FLAGSHIP=0: the second family; DTYPE=bf16: bf16
#                             #   weights; MODES=save_on_cpu,torchtune: only those after the ideal;
#                             #   STEPS (8) and WARMUP (3): steps per row, and those left out of its time;
#                             #   WHOLE_AT=0.5: one more teraio row there with whole_model='on'
#   run-gpu.sh trainer        # the Hugging Face Trainer (bench_trainer.py): teraio's callback next to
#                             #   Trainer(gradient_checkpointing=True) at 65% and 50% of the Trainer's
#                             #   no-offload peak, Qwen2-1.5B and Llama-3.2-1B shapes, bf16 autocast,
#                             #   SDPA; every ideal row first, then the 65% rows, then the 50% ones
#                             #   (~6 min; DEADLINE (330 s): no row starts after it, cut rows are
#                             #   recorded as skipped). FAMILIES (qwen2,llama), STEPS (13), WARMUP (9:
#                             #   teraio's measuring iterations and A/B trial left out of the time),
#                             #   OPTIM (adamw_torch; the Trainer's own default on CUDA: adamw_torch_fused)
#   run-gpu.sh loops          # training loops as users write them (bench_loops.py): per family in
#                             #   FAMILIES (qwen2), the full batch without offload, then teraio (default
#                             #   arguments) and HF checkpointing with gradient accumulation 2 and 4
#                             #   (batch 4 x 2048, clip_grad_norm_ 1.0) at 65% and 50% of its peak;
#                             #   LORA=1: then LoRA via peft (rank 16, every linear layer) on the
#                             #   Llama-3.2-3B shape, teraio and LoRA + checkpointing at 65% and 50% of
#                             #   LoRA's peak; rows past DEADLINE (420 s) are recorded as skipped (~8 min).
#                             #   FAMILIES=qwen2,llama: both families; FAMILIES= LORA=1: the LoRA rows
#                             #   alone; STEPS (13), WARMUP (9) as for `trainer`
#   run-gpu.sh flagship       # the fp32 0.85B Llama at half its ideal peak: ideal, teraio with the
#                             #   machine's measured figures and with default arguments, HF
#                             #   checkpointing; batch 8 with teraio (~6 min)
#   run-gpu.sh baselines [CAP]  # the flagship's other offloaders at CAP GiB: save_on_cpu, torchtune,
#                             #   DeepSpeed (ZeRO-Infinity on NVMe, else ZeRO-3 with CPU offload)
#   run-gpu.sh probe          # where the block plan's steps go (probe_block_plan.py): per-step times,
#                             #   allocator counts and a profiler timeline summary per VARIANTS entry
#   run-gpu.sh diagnose       # where planned flagship steps lose time: a torch.profiler timeline of a
#                             #   planned step and copy/allocator variants; VARIANTS=';--reserve-gib 2'
#                             #   (';'-separated bench_llama.py options) runs those variants instead
#   run-gpu.sh sweep          # emulated SSD arrays (tmpfs, each device paced like an SSD): whole-model
#                             #   offload of the capacity model with 16 GiB of host memory over
#                             #   DEVICES="1 2 4 8" x 6.5 GB/s (MODE=teraio_ssd_step_in_bwd: with the step in
#                             #   backward), after the reference row (REFERENCE=0: none); prints % of
#                             #   ideal per device count next to the simulator's replay of each row's
#                             #   recorded iteration (summarize.py --array); WHAT=flagship: the
#                             #   flagship on 4 x 2.5 GB/s
#   run-gpu.sh run CMD...     # one command in this set-up (the wheel, PY_OVERLAY, the allocator's
#                             #   settings), e.g. a bench script's `run` with --profile-step
#   run-gpu.sh link           # the host link one way and both ways at once (probe_link.py, ~10 s)
#   run-gpu.sh ab             # one call's A/B of whole-model rows: this tree's teraio ("new") against the
#                             #   same package with OLD_PY's *.py files ("old": another commit's teraio
#                             #   modules, e.g. `git show REV:bindings/python/python/teraio/whole_model.py`;
#                             #   carry the folder), ROUNDS (2) rounds of AB_MODES (teraio_step_in_bwd
#                             #   teraio) rows, STEPS (8) steps, 3 left out
#   run-gpu.sh capacity       # bench_capacity.py's table: Qwen2-1.5B shape under a 12 GiB cap, 10 steps.
#                             #   MODES picks the rows (default zero_offload,zero_infinity, ~9 min: the
#                             #   teraio rows run in calls of their own; any of reference, teraio,
#                             #   teraio_ssd, zero_infinity, zero_offload); FAMILY (qwen2; llama3b: the
#                             #   Llama-3.2-3B shape), STEPS, WARMUP, BATCH, ACCUMULATE (micro-batches
#                             #   per step, 1), CLIP (clip_grad_norm_'s max norm; none), CAP_GIB,
#                             #   DEADLINE (s, default 540: no row starts after it, and a row takes no
#                             #   step that would end past it); REFERENCE=a results.jsonl of an earlier
#                             #   call with a reference row, for the losses. On the H100 a ZeRO-Offload
#                             #   row took 114 s (1.16 s/iter, the rest building the model and cpu_adam)
#                             #   and ZeRO-Infinity had not finished its setup after 132 s: for its 10
#                             #   steps, run MODES=zero_infinity alone. PROFILE_STEP=N: a timeline of step N
#                             #   per row (summary in the log, trace in logs.tgz); ZI_STEPS=N: the
#                             #   zero_infinity row takes N steps (its set-up ~3 min, ~33 s per step);
#                             #   TERAIO_OPTIONS="name=value,...": more teraio.offload options for its rows
# PY_OVERLAY=DIR (any mode): DIR's teraio *.py files over the wheel's.
# Needs .whl-py/ (ignored by git; carry it): the teraio wheel built on the dev machine
# (`maturin build --release --strip -m bindings/python/Cargo.toml -o .whl-py`), torchtune 0.6.1
# (`pip download --no-deps torchtune==0.6.1 -d .whl-py`), and for `baselines` .whl-py/ds/: DeepSpeed
# 0.19.8 and its dependencies (hjson, pydantic, pydantic-core for cp312, annotated-types,
# typing-inspection, typing-extensions) with Debian's libaio1 and libaio-dev .debs (for
# `baselines` and `capacity`); .whl-py/extra/: peft and accelerate where the machine lacks them
# (`pip download --no-deps peft accelerate -d .whl-py/extra`), for `loops` and `trainer`. Every
# mode runs with expandable_segments. Logs and RESULT lines go to $OUT (results.jsonl; logs.tgz where there are many); the table is printed last (summarize.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/teraio-gpu-out}
mkdir -p "$OUT"
what=${1:-tests}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl-py/teraio-*.whl .whl-py/torchtune-*.whl || exit 1
# .whl-py/extra/*.whl (optional): pure-Python packages the machine may lack (peft, accelerate),
# installed where it lacks them.
for wheel in .whl-py/extra/*.whl; do
  [ -e "$wheel" ] || continue
  module=$(basename "$wheel" | cut -d- -f1)
  python3 -c "import $module" 2> /dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$wheel" || exit 1
done
# PY_OVERLAY=DIR: DIR's *.py files (a teraio package tree, no compiled module) replace the wheel's,
# so a change to the Python runtime runs on the GPU without rebuilding the wheel.
if [ -n "${PY_OVERLAY:-}" ]; then
  [ -d "$PY_OVERLAY" ] || { echo "PY_OVERLAY=$PY_OVERLAY is not a folder" >&2; exit 2; }
  (cd "$PY_OVERLAY" && find . -name '*.py' -exec cp --parents {} /tmp/site/teraio/ \;) || exit 1
fi
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export CUBLAS_WORKSPACE_CONFIG=:4096:8
export TERAIO_TEST_DIR=/root/teraio-test
B=benches/torch
WORK=/root/teraio-work
mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'
df -hT /root | tail -1; free -g | head -2

# The flagship's cap: half of the peak of an ideal run whose log is $1.
half_peak() {
  python3 -c "
import json
r=[json.loads(l[7:]) for l in open('$1') if l.startswith('RESULT ')][0]
print(round(r['peak_bytes']/2**30/2, 2) if 'peak_bytes' in r else 22.53)"
}

# One bench_llama.py run: flagship NAME TIMEOUT ARGS...; its log is $OUT/f-NAME.log.
flagship() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 $B/bench_llama.py "$@" > "$OUT/f-$name.log" 2>&1
  echo "== flagship $name: $(grep -E 'iteration:|^RESULT' "$OUT/f-$name.log" | tail -2 | cut -c1-220)"
}

# DeepSpeed from .whl-py/ds/ into /tmp/ds-site (put it first on PYTHONPATH: its typing-extensions
# is newer than the image's), with libaio from the .debs for its async_io op (ZeRO-Infinity's NVMe
# swapping), JIT-built on first use. TORCH_CUDA_ARCH_LIST: the image's list holds "9.0a", which
# DeepSpeed's op builder cannot parse.
install_deepspeed() {
  ls .whl-py/ds/*.whl > /dev/null 2>&1 || { echo "no .whl-py/ds/*.whl: DeepSpeed rows will fail"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ds-site \
    .whl-py/ds/*.whl || return 1
  if ls .whl-py/ds/libaio*.deb > /dev/null 2>&1; then
    local debs
    debs=$(mktemp -d)
    for deb in .whl-py/ds/libaio*.deb; do dpkg -x "$deb" "$debs"; done
    cp "$debs"/usr/include/libaio.h /usr/include/
    cp -a "$debs"/usr/lib/x86_64-linux-gnu/libaio.so* /usr/lib/x86_64-linux-gnu/
    ldconfig
    rm -rf "$debs"
  fi
  export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
  (ls /usr/include/libaio.h; ldconfig -p | grep -i libaio) 2>&1 | head -3
  PYTHONPATH=/tmp/ds-site:/tmp/site python3 -c 'import deepspeed; print("deepspeed", deepspeed.__version__)'
}

summary() {
  python3 $B/summarize.py "$OUT/results.jsonl" --reports > "$OUT/summary-full.md"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
}

case "$what" in
tests)
  . benches/gpu/cufile-compat.sh   # for the tests of the cuFile path
  python3 -c 'import teraio; print(teraio.gpu_probe())'
  # PYTEST_ARGS: other pytest arguments (e.g. one file and -x); TESTS_TIMEOUT: seconds (400).
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
  TERAIO_EXAMPLES=gpu timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -rfE -p no:cacheprovider \
    ${PYTEST_ARGS:-bindings/python/tests} 2>&1 | tee "$OUT/pytest.log" | tail -40
  ;;

examples)
  # The tests' cuFile set-up: compatibility mode, and its log in $OUT (libcufile writes
  # cufile.log into the working directory otherwise, which the examples must leave clean).
  . benches/gpu/cufile-compat.sh
  TERAIO_EXAMPLES=gpu timeout 400 python3 -m pytest -q -rs -p no:cacheprovider \
    bindings/python/tests/test_docs_examples.py 2>&1 | tee "$OUT/examples.log" | tail -40
  ;;

probe)
  # probe_block_plan.py once per ';'-separated VARIANTS entry (its options after --family and
  # --cap-bytes; default: the chosen plan and checkpointing every block, each with a timeline of
  # step 6), on FAMILY (qwen2) at CAP_BYTES (65% of its ideal peak: 41596000000).
  variants=("--profile-step 6 --no-guard" "--plan ckpt --profile-step 6")
  [ -n "${VARIANTS:-}" ] && IFS=';' read -ra variants <<< "$VARIANTS"
  for variant in "${variants[@]}"; do
    [ $SECONDS -gt "${PROBE_DEADLINE:-500}" ] && { echo "== probe $variant skipped: out of time"; continue; }
    # shellcheck disable=SC2086
    timeout $((590 - SECONDS)) python3 $B/probe_block_plan.py --family "${FAMILY:-qwen2}" \
      --cap-bytes "${CAP_BYTES:-41596000000}" --out-dir "$OUT" $variant 2>&1 | grep -v Warning
  done
  ;;

regime)
  # The table first (no row starts after its deadline; a killed row's teardown takes ~15 s more),
  # then the fp32 flagship's rows in what is left of the call's 9 minutes.
  deadline=${DEADLINE:-$([ "${FLAGSHIP:-1}" = 1 ] && echo 350 || echo 480)}
  timeout $((deadline + 45)) python3 $B/bench_regime.py table --families "${FAMILIES:-qwen2}" \
    --dtype "${DTYPE:-autocast}" --modes "${MODES:-teraio,hf_ckpt,sac,save_on_cpu,torchtune}" \
    --fractions 0.65,0.5 --whole-model-at "${WHOLE_AT:-}" --steps "${STEPS:-8}" --warmup "${WARMUP:-3}" \
    --store-dir /root/teraio-regime \
    --deadline-s "$deadline" --out-dir "$OUT/regime" 2>&1 | grep -E '^\[|^==' | tee "$OUT/regime-progress.log"
  cp "$OUT/regime/results.jsonl" "$OUT/results.jsonl"
  if [ "${FLAGSHIP:-1}" = 1 ]; then
    CAP=22.53   # half of the flagship's ideal peak (45.1 GiB allocated on the H100, every run so far)
    [ $SECONDS -lt 460 ] && flagship ideal 60 --mode ideal --steps 8 --warmup 3
    [ $SECONDS -lt 480 ] && flagship hf_ckpt 45 --mode hf_ckpt --steps 6 --warmup 2 --cap-gib $CAP
    [ $SECONDS -lt 470 ] && flagship teraio-defaults $((560 - SECONDS)) --mode teraio --user-defaults \
      --steps 8 --warmup 4 --cap-gib $CAP
    cat "$OUT"/f-*.log 2>/dev/null | grep '^RESULT' | cut -c8- >> "$OUT/results.jsonl"
  fi
  (cd "$OUT" && tar czf logs.tgz regime $(ls f-*.log 2>/dev/null) && rm -rf f-*.log regime)
  summary
  ;;

trainer)
  deadline=${DEADLINE:-330}
  timeout $((deadline + 200)) python3 $B/bench_trainer.py table --families "${FAMILIES:-qwen2,llama}" \
    --fractions 0.65,0.5 --steps "${STEPS:-13}" --warmup "${WARMUP:-9}" --optim "${OPTIM:-adamw_torch}" \
    --store-dir /root/teraio-trainer \
    --deadline-s "$deadline" --out-dir "$OUT/trainer" 2>&1 | grep -E '^\[|^==' | tee "$OUT/trainer-progress.log"
  cp "$OUT/trainer/results.jsonl" "$OUT/results.jsonl"
  (cd "$OUT" && tar czf logs.tgz trainer && rm -rf trainer)
  summary
  ;;

loops)
  # No row starts after the deadline; a killed row's teardown takes ~15 s more.
  deadline=${DEADLINE:-420}
  lora=$([ "${LORA:-0}" = 1 ] && echo --lora)
  # shellcheck disable=SC2086
  timeout $((deadline + 45)) python3 $B/bench_loops.py table --families "${FAMILIES-qwen2}" $lora \
    --fractions 0.65,0.5 --accums 2,4 --steps "${STEPS:-13}" --warmup "${WARMUP:-9}" \
    --store-dir /root/teraio-loops \
    --deadline-s "$deadline" --out-dir "$OUT/loops" 2>&1 | grep -E '^\[|^==' | tee "$OUT/loops-progress.log"
  cp "$OUT/loops/results.jsonl" "$OUT/results.jsonl"
  (cd "$OUT" && tar czf logs.tgz loops && rm -rf loops)
  summary
  ;;

flagship)
  flagship ideal 90 --mode ideal --steps 15
  CAP=$(half_peak "$OUT/f-ideal.log")
  echo "== cap = half of the ideal peak: $CAP GiB"
  flagship teraio 150 --mode teraio --steps 15 --cap-gib "$CAP"
  flagship teraio-defaults 150 --mode teraio --user-defaults --steps 15 --cap-gib "$CAP"
  flagship hf_ckpt 90 --mode hf_ckpt --steps 8 --warmup 2 --cap-gib "$CAP"
  [ $SECONDS -lt 400 ] && flagship b8-teraio $((560 - SECONDS)) --mode teraio --steps 7 --warmup 3 --batch 8 \
    --gpu-memory-gib 74 --host-gib 96
  cat "$OUT"/f-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  summary
  ;;

baselines)
  CAP=${2:-22.53}
  flagship save_on_cpu 120 --mode save_on_cpu --steps 8 --warmup 2 --cap-gib "$CAP"
  flagship torchtune 120 --mode torchtune --steps 8 --warmup 2 --cap-gib "$CAP"
  if install_deepspeed; then
    PYTHONPATH=/tmp/ds-site:/tmp/site timeout $((480 - SECONDS)) python3 $B/bench_deepspeed.py --device nvme \
      --cap-gib "$CAP" --steps 5 > "$OUT/f-ds-nvme.log" 2>&1
    if grep -q '"error"' "$OUT/f-ds-nvme.log" && [ $SECONDS -lt 360 ]; then
      PYTHONPATH=/tmp/ds-site:/tmp/site timeout $((560 - SECONDS)) python3 $B/bench_deepspeed.py --device cpu \
        --cap-gib "$CAP" --steps 5 > "$OUT/f-ds-cpu.log" 2>&1
    fi
  fi
  cat "$OUT"/f-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  summary
  ;;

diagnose)
  # Where the planned iterations lose time: one teraio run with a torch.profiler timeline of a
  # planned step (kineto-b4.json.gz; benches/torch/gpu_gaps.py reads it), then runs that vary
  # the device-to-host bytes in flight and the allocator's garbage collection.
  . benches/gpu/cufile-compat.sh > /dev/null
  CAP=${CAP:-22.53}
  n=0
  variants=("--kineto-step 12 --out-dir $OUT" "--max-inflight-gib 4" \
    "--allocator-settings garbage_collection_threshold:0.9" "--max-inflight-gib 1")
  [ -n "${VARIANTS:-}" ] && IFS=';' read -ra variants <<< "$VARIANTS"
  for variant in "${variants[@]}"; do
    n=$((n + 1))
    [ $SECONDS -gt 480 ] && { echo "== variant $n skipped: out of time"; continue; }
    # shellcheck disable=SC2086
    flagship "d$n" $((590 - SECONDS)) --mode teraio --steps 16 --cap-gib "$CAP" $variant
    echo "   variant $n: $variant"
  done
  cat "$OUT"/f-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  summary
  (cd "$OUT" && tar czf logs.tgz f-*.log && rm -f f-*.log trace-b4.json plan-b4.json)
  ;;

run)
  shift
  "$@"
  ;;

link)
  python3 $B/probe_link.py | tee "$OUT/link.md"
  ;;

ab)
  [ -d "${OLD_PY:-}" ] || { echo "ab: OLD_PY must name a folder of teraio/*.py files" >&2; exit 2; }
  rm -rf /tmp/site-old && cp -r /tmp/site /tmp/site-old && cp "$OLD_PY"/*.py /tmp/site-old/teraio/
  for round in $(seq "${ROUNDS:-2}"); do
    for v in new old; do
      for mode in ${AB_MODES:-teraio_step_in_bwd teraio}; do
        site=/tmp/site; [ $v = old ] && site=/tmp/site-old
        log=$OUT/ab-$round-$v-$mode.log
        PYTHONPATH=$site timeout 150 python3 $B/bench_capacity.py run --mode "$mode" --steps "${STEPS:-8}" --warmup 3 \
          --work-dir /root/ab-work --time-budget-s 120 > "$log" 2>&1
        rm -rf /root/ab-work
        grep '^RESULT' "$log" | cut -c8- | sed "s/^{/{\"ab_round\": $round, \"ab_variant\": \"$v\", /" >> "$OUT/results.jsonl"
        grep -q '^RESULT' "$log" || tail -5 "$log"
      done
    done
  done
  python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); t = r['teraio_report']
    print(r['ab_round'], r['ab_variant'], r['mode'], round(r['ms_per_iter']), 'host', round(t['host_ms_per_iteration']),
          'resident', t['resident_parameter_bytes'], 'peak', t['peak_gpu_bytes'], 'loss', r['losses'][-1])
" "$OUT/results.jsonl"
  ;;

capacity)
  # Stores and swap folders under one work dir on the disk, each removed after its row (the
  # ZeRO-Infinity swap folder takes ~25 GB of the ~64 GB free).
  modes=${MODES:-zero_offload,zero_infinity}
  [[ $modes == *zero_* ]] && install_deepspeed
  deadline=${DEADLINE:-540}
  df -h /root | tail -1
  PYTHONPATH=/tmp/ds-site:/tmp/site timeout $((deadline - SECONDS + 40)) python3 $B/bench_capacity.py table \
    --family "${FAMILY:-qwen2}" --modes "$modes" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" \
    --batch "${BATCH:-1}" --accumulate "${ACCUMULATE:-1}" ${CLIP:+--clip "$CLIP"} \
    --cap-gib "${CAP_GIB:-12}" --work-dir /root/teraio-capacity \
    --out-dir "$OUT/capacity" --deadline-s $((deadline - SECONDS)) --timeout-s $((deadline - SECONDS)) \
    --teraio-timeout-s $((deadline - SECONDS)) ${REFERENCE:+--reference-from "$REFERENCE"} \
    ${PROFILE_STEP:+--profile-step "$PROFILE_STEP"} ${ZI_STEPS:+--zero-infinity-steps "$ZI_STEPS"} \
    ${TERAIO_OPTIONS:+--teraio-options "$TERAIO_OPTIONS"} --record-out "$OUT" \
    2>&1 | tee "$OUT/capacity.log"
  rm -rf /root/teraio-capacity
  cp "$OUT/capacity/results.jsonl" "$OUT/results.jsonl"
  cp "$OUT/capacity/capacity.md" "$OUT/capacity.md"
  (cd "$OUT" && tar czf logs.tgz capacity && rm -rf capacity)
  ;;

sweep)
  # Emulated SSD arrays in tmpfs (no O_DIRECT; each device paced like an SSD).
  df -h /dev/shm | tail -1
  if [ "${WHAT:-capacity}" = flagship ]; then
    # The store's pages are allocated up front (64 GiB of the 125 GiB of RAM); objects are rewritten
    # each iteration, and a rewrite needs room for the new copy before the old one is freed.
    flagship emulated 400 --mode teraio --steps 8 --warmup 3 --cap-gib "${CAP:-22.53}" --host-gib 4 \
      --store-dir /dev/shm/teraio-emu --store-devices 4 --store-gib 64 --emulate 2.5GB/s@20us --out-dir "$OUT"
    rm -rf /dev/shm/teraio-emu
    grep '^RESULT' "$OUT/f-emulated.log" | cut -c8- > "$OUT/results.jsonl"
    summary
  else
    # bench_capacity.py's teraio_ssd row with host memory bounded to 16 GiB, the store on DEVICES
    # devices at 6.5 GB/s and 20 us; the reference row (the ideal) first, in the same call.
    if [ "${REFERENCE:-1}" = 1 ]; then
      timeout 170 python3 $B/bench_capacity.py run --mode reference --steps "${STEPS:-8}" --warmup "${WARMUP:-2}" \
        --work-dir /dev/shm/teraio-array > "$OUT/array-reference.log" 2>&1
      grep '^RESULT' "$OUT/array-reference.log" | cut -c8- >> "$OUT/results.jsonl"
    fi
    for n in ${DEVICES:-1 2 4 8}; do
      rm -rf /dev/shm/teraio-array
      timeout 170 python3 $B/bench_capacity.py run --mode "${MODE:-teraio_ssd}" --steps "${STEPS:-8}" --warmup "${WARMUP:-2}" \
        --ssd-host-memory 16GiB --store-devices "$n" --store-gib 16 --emulate 6.5GB/s@20us \
        --work-dir /dev/shm/teraio-array --time-budget-s 150 --record-out "$OUT/record-$n.json" > "$OUT/array-$n.log" 2>&1
      grep '^RESULT' "$OUT/array-$n.log" | cut -c8- | sed "s/^{/{\"devices\": $n, /" >> "$OUT/results.jsonl"
      grep -v '^RESULT' "$OUT/array-$n.log" | tail -12
      rm -rf /dev/shm/teraio-array
    done
    python3 $B/summarize.py --array "$OUT/results.jsonl" | tee "$OUT/array-table.md"
  fi
  ;;

*)
  echo "unknown mode $what: tests, regime, trainer, loops, flagship, baselines, probe, diagnose, link, ab, capacity or sweep" >&2
  exit 2
  ;;
esac
