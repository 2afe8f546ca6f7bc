#!/bin/bash
# The GPU machine's checks and benchmark in one call (docs/python.md):
#   benches/torch/run-gpu.sh probe        # setup check: CUDA tests + a small run of each mode (~2 min)
#   benches/torch/run-gpu.sh full         # CUDA tests + ideal, teraio, save_on_cpu, torchtune at the cap
#                                         #   (half the ideal peak), batch 8 with and without teraio (~7 min;
#                                         #   NOTESTS=1 leaves the tests out)
#   benches/torch/run-gpu.sh rerun        # full without the two baselines, plus DeepSpeed ZeRO-Infinity (NVMe)
#   benches/torch/run-gpu.sh final [CAP]  # CUDA tests, teraio at CAP GiB, DeepSpeed ZeRO-3 with CPU offload
#   benches/torch/run-gpu.sh deepspeed [CAP]
#   benches/torch/run-gpu.sh tune         # CUDA tests, ideal, teraio at the cap: reserve 3 vs 1 GiB (~6 min)
#   benches/torch/run-gpu.sh tune2 [CAP]  # teraio without optimizer-state offload, with half the disk per
#                                         #   direction, and on an emulated 4 x 2.5 GB/s SSD array in tmpfs
#                                         #   with 4 GiB of host memory (~4 min)
#   benches/torch/run-gpu.sh emulated [CAP]  # the CUDA and store tests, then only the emulated run
#   benches/torch/run-gpu.sh sweep        # ideal, then teraio at the cap with 2, 4 and 1 GiB of
#                                         #   device-to-host copies in flight (~5 min)
#   benches/torch/run-gpu.sh one [CAP]   # teraio at the cap, 15 steps (TESTS=1: all Python tests
#                                         #   first; EXTRA="--reserve-gib 1.5": more bench_llama options)
#   benches/torch/run-gpu.sh variants [CAP]  # teraio: default, prefetch slack 4, op times x0.87, both
#   benches/torch/run-gpu.sh baselines [CAP]  # save_on_cpu, torchtune, batch 8 without and with teraio
#   benches/torch/run-gpu.sh diagnose     # a torch.profiler timeline of a planned step, inflight/allocator variants
#   benches/torch/run-gpu.sh compare      # all Python tests, ideal, then teraio at the cap once per
#                                         #   VARIANTS entry (';'-separated bench_llama options; ~7 min;
#                                         #   NOTESTS=1: no tests; CAP=22.53: no ideal run, that cap)
# Needs .whl-py/ (ignored by git; carry it): the teraio wheel built on the dev machine
# (`maturin build --release --strip -m bindings/python/Cargo.toml -o .whl-py`), torchtune 0.6.1,
# and .whl-py/ds/: DeepSpeed 0.19.8 (built with `pip wheel --no-deps`) and its dependencies.
# Logs and RESULT lines go to $OUT; the table is printed last (summarize.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/teraio-gpu-out}
mkdir -p "$OUT"
what=${1:-full}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl-py/teraio-*.whl .whl-py/torchtune-*.whl || exit 1
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export CUBLAS_WORKSPACE_CONFIG=:4096:8
export TERAIO_TEST_DIR=/root/teraio-test
B=benches/torch
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'
df -hT /root | tail -1; free -g | head -2

if { [ "$what" = probe ] || [ "$what" = full ] || [ "$what" = tune ]; } && [ -z "${NOTESTS:-}" ]; then
  WORK=/root/teraio-work; mkdir -p "$WORK"
  . benches/gpu/cufile-compat.sh   # for the tests of the cuFile path
  python3 -c 'import teraio; print(teraio.gpu_probe())'
  echo "== CUDA tests (pytest, bindings/python/tests)"
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider bindings/python/tests 2>&1 | tee "$OUT/pytest.log" | tail -40
fi

if [ "$what" = probe ]; then
  timeout 120 python3 $B/bench_llama.py --mode ideal --steps 3 --warmup 1 --batch 1 --seq 512 | tee "$OUT/probe-ideal.log" | tail -3
  timeout 150 python3 $B/bench_llama.py --mode teraio --steps 5 --warmup 3 --batch 1 --seq 512 --cap-gib 16.5 \
    --host-gib 8 --out-dir "$OUT" | tee "$OUT/probe-teraio.log" | tail -12
  timeout 90 python3 $B/bench_llama.py --mode torchtune --steps 2 --warmup 1 --batch 1 --seq 512 --cap-gib 16.5 \
    | tee "$OUT/probe-torchtune.log" | tail -3
  python3 $B/summarize.py "$OUT"/probe-*.log
  exit 0
fi

if [ "$what" = tune ]; then
  timeout 90 python3 $B/bench_llama.py --mode ideal --steps 15 > "$OUT/t-1-ideal.log" 2>&1; tail -1 "$OUT/t-1-ideal.log" | cut -c1-200
  CAP=$(python3 -c "
import json
r=[json.loads(l[7:]) for l in open('$OUT/t-1-ideal.log') if l.startswith('RESULT ')][0]
print(round(r['peak_bytes']/2**30/2, 2) if 'peak_bytes' in r else 22.5)")
  echo "== cap = half of the ideal peak: $CAP GiB"; echo "$CAP" > "$OUT/cap.txt"
  for reserve in 3 1; do
    timeout 150 python3 $B/bench_llama.py --mode teraio --steps 15 --cap-gib "$CAP" --reserve-gib $reserve \
      --out-dir "$OUT" > "$OUT/t-2-teraio-r$reserve.log" 2>&1
    grep -v RESULT "$OUT/t-2-teraio-r$reserve.log" | tail -11
  done
  cat "$OUT"/t-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
  exit 0
fi

# The store in tmpfs (pages allocated up front, 64 GiB of the 125 GiB of RAM); objects are rewritten
# each iteration, and a rewrite needs room for the new copy before the old one is freed.
emulated() {
  df -h /dev/shm | tail -1
  timeout 280 python3 $B/bench_llama.py --mode teraio --steps 8 --warmup 3 --cap-gib "$1" \
    --host-gib 4 --store-dir /dev/shm/teraio-emu --store-devices 4 --store-gib 64 --emulate 2.5GB/s@20us \
    --out-dir "$OUT" > "$OUT/t-5-teraio-emulated.log" 2>&1
  grep -v RESULT "$OUT/t-5-teraio-emulated.log" | tail -14
  rm -rf /dev/shm/teraio-emu
}

if [ "$what" = emulated ]; then
  WORK=/root/teraio-work; mkdir -p "$WORK"
  . benches/gpu/cufile-compat.sh > /dev/null
  timeout 120 python3 -m pytest -q -p no:cacheprovider bindings/python/tests/test_cuda.py bindings/python/tests/test_store.py \
    2>&1 | tail -3
  emulated "${2:-22.53}"
  grep '^RESULT' "$OUT/t-5-teraio-emulated.log" > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
  exit 0
fi

if [ "$what" = sweep ]; then
  timeout 90 python3 $B/bench_llama.py --mode ideal --steps 15 > "$OUT/s-1-ideal.log" 2>&1; tail -1 "$OUT/s-1-ideal.log" | cut -c1-200
  CAP=$(python3 -c "
import json
r=[json.loads(l[7:]) for l in open('$OUT/s-1-ideal.log') if l.startswith('RESULT ')][0]
print(round(r['peak_bytes']/2**30/2, 2) if 'peak_bytes' in r else 22.5)")
  echo "== cap = half of the ideal peak: $CAP GiB"; echo "$CAP" > "$OUT/cap.txt"
  for inflight in ${INFLIGHTS:-2 4 1}; do
    timeout 150 python3 $B/bench_llama.py --mode teraio --steps ${STEPS:-15} --cap-gib "$CAP" --max-inflight-gib $inflight \
      > "$OUT/s-2-teraio-i$inflight.log" 2>&1
    grep -v RESULT "$OUT/s-2-teraio-i$inflight.log" | tail -12
  done
  cat "$OUT"/s-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
  exit 0
fi

if [ "$what" = one ]; then
  CAP=${2:-22.53}
  if [ -n "${TESTS:-}" ]; then
    WORK=/root/teraio-work; mkdir -p "$WORK"; . benches/gpu/cufile-compat.sh > /dev/null
    timeout 120 python3 -m pytest -q -p no:cacheprovider bindings/python/tests 2>&1 | tail -2
  fi
  timeout 150 python3 $B/bench_llama.py --mode teraio --steps 15 --cap-gib "$CAP" ${EXTRA:-} > "$OUT/o-1.log" 2>&1
  grep -v RESULT "$OUT/o-1.log" | grep -E "iteration:|peak|phases|stalls|step 1[0-4]:" | tail -9
  exit 0
fi

if [ "$what" = compare ]; then
  WORK=/root/teraio-work; mkdir -p "$WORK"; . benches/gpu/cufile-compat.sh > /dev/null
  if [ -z "${NOTESTS:-}" ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider bindings/python/tests 2>&1 | tee "$OUT/pytest.log" | tail -3
  fi
  if [ -z "${CAP:-}" ]; then
    timeout 90 python3 $B/bench_llama.py --mode ideal --steps 15 > "$OUT/c-0-ideal.log" 2>&1
    tail -1 "$OUT/c-0-ideal.log" | cut -c1-200
    CAP=$(python3 -c "
import json
r=[json.loads(l[7:]) for l in open('$OUT/c-0-ideal.log') if l.startswith('RESULT ')][0]
print(round(r['peak_bytes']/2**30/2, 2) if 'peak_bytes' in r else 22.5)")
  fi
  echo "== cap = half of the ideal peak: $CAP GiB"; echo "$CAP" > "$OUT/cap.txt"
  n=0
  IFS=';' read -ra variants <<< "${VARIANTS:-;--reserve-gib 2;--offload-parameters;--tier-preference host}"
  for variant in "${variants[@]}"; do
    n=$((n + 1))
    [ $SECONDS -gt 500 ] && { echo "== variant $n skipped: out of time"; continue; }
    timeout $((590 - SECONDS)) python3 $B/bench_llama.py --mode teraio --steps ${STEPS:-20} --cap-gib "$CAP" $variant \
      > "$OUT/c-$n.log" 2>&1
    echo "== variant $n: ${variant:-default}"
    grep -v RESULT "$OUT/c-$n.log" | grep -E "iteration:|peak GPU|per iteration|phases|host time|stalls|Error" | tail -12
  done
  cat "$OUT"/c-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
  exit 0
fi

if [ "$what" = diagnose ]; then
  # Where the planned iterations lose time: one teraio run with a torch.profiler timeline of a
  # planned step (kineto-b4.json.gz; benches/torch/gpu_gaps.py reads it), then runs that vary
  # the device-to-host bytes in flight and the allocator's garbage collection.
  WORK=/root/teraio-work; mkdir -p "$WORK"; . benches/gpu/cufile-compat.sh > /dev/null
  CAP=${CAP:-22.53}
  n=0
  for variant in "--kineto-step 12 --out-dir $OUT" "--max-inflight-gib 4" \
    "--allocator-settings garbage_collection_threshold:0.9" "--max-inflight-gib 1"; do
    n=$((n + 1))
    [ $SECONDS -gt 480 ] && { echo "== variant $n skipped: out of time"; continue; }
    timeout $((590 - SECONDS)) python3 $B/bench_llama.py --mode teraio --steps 16 --cap-gib "$CAP" $variant \
      > "$OUT/d-$n.log" 2>&1
    echo "== variant $n: $variant"
    grep -v RESULT "$OUT/d-$n.log" | grep -E "iteration:|peak GPU|phases|host time|stalls|Error" | tail -6
  done
  cat "$OUT"/d-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
  (cd "$OUT" && tar czf logs.tgz d-*.log && rm -f d-*.log trace-b4.json plan-b4.json)
  exit 0
fi

if [ "$what" = variants ]; then
  CAP=${2:-22.53}
  n=0
  for variant in "" "--prefetch-slack 4" "--op-time-scale 0.87" "--op-time-scale 0.87 --prefetch-slack 4"; do
    n=$((n + 1))
    timeout 150 python3 $B/bench_llama.py --mode teraio --steps 15 --cap-gib "$CAP" $variant > "$OUT/v-$n.log" 2>&1
    echo "== variant $n: ${variant:-default}"; grep -v RESULT "$OUT/v-$n.log" | grep -E "iteration:|phases|stalls" | tail -3
  done
  cat "$OUT"/v-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
  exit 0
fi

if [ "$what" = baselines ]; then
  CAP=${2:-22.53}
  timeout 120 python3 $B/bench_llama.py --mode save_on_cpu --steps 8 --warmup 2 --cap-gib "$CAP" > "$OUT/b-3-save_on_cpu.log" 2>&1
  tail -2 "$OUT/b-3-save_on_cpu.log" | cut -c1-300
  timeout 120 python3 $B/bench_llama.py --mode torchtune --steps 8 --warmup 2 --cap-gib "$CAP" > "$OUT/b-4-torchtune.log" 2>&1
  tail -2 "$OUT/b-4-torchtune.log" | cut -c1-300
  timeout 60 python3 $B/bench_llama.py --mode ideal --steps 2 --warmup 1 --batch 8 > "$OUT/b8-1-ideal.log" 2>&1
  tail -1 "$OUT/b8-1-ideal.log" | cut -c1-300
  timeout 170 python3 $B/bench_llama.py --mode teraio --steps 7 --warmup 3 --batch 8 --gpu-memory-gib 74 --host-gib 96 \
    > "$OUT/b8-2-teraio.log" 2>&1
  grep -v RESULT "$OUT/b8-2-teraio.log" | tail -12
  cat "$OUT"/b-*.log "$OUT"/b8-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
  exit 0
fi

if [ "$what" = tune2 ]; then
  CAP=${2:-22.53}
  timeout 150 python3 $B/bench_llama.py --mode teraio --steps 15 --cap-gib "$CAP" --no-state-offload \
    --out-dir "$OUT" > "$OUT/t-3-teraio-nostate.log" 2>&1
  grep -v RESULT "$OUT/t-3-teraio-nostate.log" | tail -11
  timeout 150 python3 $B/bench_llama.py --mode teraio --steps 15 --cap-gib "$CAP" --ssd-share 0.45 \
    --out-dir "$OUT" > "$OUT/t-4-teraio-ssdshare.log" 2>&1
  grep -v RESULT "$OUT/t-4-teraio-ssdshare.log" | tail -11
  emulated "$CAP"
  cat "$OUT"/t-*.log | grep '^RESULT' > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
  exit 0
fi

if [ "$what" = full ] || [ "$what" = rerun ]; then
  # rerun: everything but the save_on_cpu / torchtune baselines (their first step alone pins
  # ~35 GiB of host memory, ~30 s each), to fit one call with the DeepSpeed attempt.
  echo "== ideal (no cap)"
  timeout 90 python3 $B/bench_llama.py --mode ideal --steps 20 > "$OUT/b4-1-ideal.log" 2>&1; tail -2 "$OUT/b4-1-ideal.log"
  CAP=$(python3 -c "
import json,sys
r=[json.loads(l[7:]) for l in open('$OUT/b4-1-ideal.log') if l.startswith('RESULT ')][0]
print(round(r['peak_bytes']/2**30/2, 2) if 'peak_bytes' in r else 22.5)")
  echo "== cap = half of the ideal peak: $CAP GiB"
  timeout 150 python3 $B/bench_llama.py --mode teraio --steps 20 --cap-gib "$CAP" --out-dir "$OUT" > "$OUT/b4-2-teraio.log" 2>&1
  grep -v RESULT "$OUT/b4-2-teraio.log" | tail -14
  if [ "$what" = full ]; then
    timeout 120 python3 $B/bench_llama.py --mode save_on_cpu --steps 8 --warmup 2 --cap-gib "$CAP" > "$OUT/b4-3-save_on_cpu.log" 2>&1
    tail -2 "$OUT/b4-3-save_on_cpu.log"
    timeout 120 python3 $B/bench_llama.py --mode torchtune --steps 8 --warmup 2 --cap-gib "$CAP" > "$OUT/b4-4-torchtune.log" 2>&1
    tail -2 "$OUT/b4-4-torchtune.log"
  fi
  echo "== batch 8: without offload, then with teraio"
  timeout 60 python3 $B/bench_llama.py --mode ideal --steps 2 --warmup 1 --batch 8 > "$OUT/b8-1-ideal.log" 2>&1
  tail -1 "$OUT/b8-1-ideal.log" | cut -c1-300
  timeout 150 python3 $B/bench_llama.py --mode teraio --steps 7 --warmup 3 --batch 8 --gpu-memory-gib 74 --host-gib 96 \
    --out-dir "$OUT" > "$OUT/b8-2-teraio.log" 2>&1
  grep -v RESULT "$OUT/b8-2-teraio.log" | tail -12
  echo "$CAP" > "$OUT/cap.txt"
  if [ "$what" = rerun ] && [ $SECONDS -lt 400 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ds-site .whl-py/ds/*.whl
    (ls /usr/include/libaio.h; ldconfig -p | grep -i libaio) 2>&1 | head -3
    PYTHONPATH=/tmp/ds-site:/tmp/site timeout $((540 - SECONDS)) python3 $B/bench_deepspeed.py --device nvme \
      --cap-gib "$CAP" --steps 5 > "$OUT/ds-nvme.log" 2>&1
    grep -E "Error|error|step" "$OUT/ds-nvme.log" | tail -6 | cut -c1-400
  fi
  cat "$OUT"/b4-*.log "$OUT"/b8-*.log "$OUT"/ds-*.log 2>/dev/null | grep '^RESULT' > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
fi

if [ "$what" = final ]; then
  # CUDA tests, teraio at the cap of the earlier ideal run (CAP, GiB), DeepSpeed with CPU offload.
  CAP=${2:-22.53}
  echo "== CUDA tests (pytest, bindings/python/tests)"
  timeout 90 python3 -m pytest -q -s -p no:cacheprovider bindings/python/tests 2>&1 | tee "$OUT/pytest.log" \
    | grep -E "passed|failed|FAILED|Error|^\[|peak GPU|offloaded per" | tail -20
  timeout 150 python3 $B/bench_llama.py --mode teraio --steps 20 --cap-gib "$CAP" --out-dir "$OUT" > "$OUT/b4-2-teraio.log" 2>&1
  grep -v RESULT "$OUT/b4-2-teraio.log" | tail -9
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ds-site .whl-py/ds/*.whl
  if [ $SECONDS -lt 330 ]; then
    PYTHONPATH=/tmp/ds-site:/tmp/site timeout $((520 - SECONDS)) python3 $B/bench_deepspeed.py --device cpu \
      --cap-gib "$CAP" --steps 5 > "$OUT/ds-cpu.log" 2>&1
    grep -E "Error|error|step" "$OUT/ds-cpu.log" | tail -6 | cut -c1-400
  fi
  cat "$OUT"/b4-*.log "$OUT"/ds-*.log 2>/dev/null | grep '^RESULT' > "$OUT/results.jsonl"
  python3 $B/summarize.py "$OUT/results.jsonl" | tee "$OUT/summary.md"
fi

if [ "$what" = deepspeed ]; then
  CAP=${2:-25.5}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ds-site .whl-py/ds/*.whl || exit 1
  export PYTHONPATH=/tmp/ds-site:/tmp/site
  (ls /usr/include/libaio.h; ldconfig -p | grep -i libaio) 2>&1 | head -3
  timeout 300 python3 $B/bench_deepspeed.py --device nvme --cap-gib "$CAP" --steps 6 > "$OUT/ds-nvme.log" 2>&1
  grep -E "RESULT|Error|error" "$OUT/ds-nvme.log" | tail -8
  if grep -q '"error"' "$OUT/ds-nvme.log"; then
    timeout 240 python3 $B/bench_deepspeed.py --device cpu --cap-gib "$CAP" --steps 6 > "$OUT/ds-cpu.log" 2>&1
    grep -E "RESULT|Error" "$OUT/ds-cpu.log" | tail -5
  fi
  python3 $B/summarize.py "$OUT"/ds-*.log | tee "$OUT/summary-ds.md"
fi
