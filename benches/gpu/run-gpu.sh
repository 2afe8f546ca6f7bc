#!/usr/bin/env bash
# GPU correctness tests and the GPU benchmark in one go, on the GPU machine (see docs/gpu.md).
#
#   benches/gpu/run-gpu.sh probe   # environment report + small round trips + tiny bench (~1 min)
#   benches/gpu/run-gpu.sh full    # round trips 1 B .. 4 GiB on both paths + the 4 GiB benchmark
#   benches/gpu/run-gpu.sh bench   # the 4 GiB benchmark alone
#   benches/gpu/run-gpu.sh checksums   # bounce-path gets with checksums on and off against an
#                                      # O_DIRECT -> pinned -> cudaMemcpy peer, 5 rounds of 4 GiB
#
# Expects the release binaries built elsewhere in $BIN (default target-gpubin: gpu_roundtrip,
# gpu_bench) and the kvikio wheels in .whl/ (both carried by the device tool). Sets up cuFile's
# compatibility mode for a machine without nvidia-fs: a cufile.json copy with allow_compat_mode,
# and a udev record for the block device that holds the test files. Logs go to $OUT.
set -u -o pipefail
MODE=${1:-full}
OUT=${OUT:-/tmp/teraio-gpu-out}
BIN=${BIN:-target-gpubin}
WORK=${WORK:-/var/tmp/teraio-gpu}
mkdir -p "$OUT" "$WORK"
log() { echo "== $*"; }

log "environment"
nvidia-smi -L 2>&1 | head -4
uname -r
df -hT "$WORK" | tail -1
grep -c processor /proc/cpuinfo
lsmod 2>/dev/null | grep -i nvidia_fs || echo "nvidia_fs: not loaded"

# libcufile from the nvidia-cufile wheel.
CUFILE_DIR=$(python3 - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("nvidia.cufile") or importlib.util.find_spec("nvidia")
for root in (spec.submodule_search_locations or []):
    for dirpath, _, files in os.walk(root):
        if any(f.startswith("libcufile.so") for f in files):
            print(dirpath); raise SystemExit
PY
)
if [ -n "$CUFILE_DIR" ]; then
    export LD_LIBRARY_PATH="$CUFILE_DIR:${LD_LIBRARY_PATH:-}"
    export TERAIO_CUFILE_LIB=$(ls "$CUFILE_DIR"/libcufile.so* | grep -v rdma | head -1)
fi
echo "libcufile: ${TERAIO_CUFILE_LIB:-not found}"

. benches/gpu/cufile-compat.sh

# kvikio from the carried wheels.
KVIKIO=ok
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/kvikio-install.log" 2>&1 || KVIKIO="install failed (see kvikio-install.log)"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
echo "kvikio: $KVIKIO"

if [ "$MODE" = probe ]; then
    RT_MAX=64MiB; BENCH_BYTES=256MiB
else
    RT_MAX=4GiB; BENCH_BYTES=4GiB
fi

if [ "$MODE" = checksums ]; then
    log "checksum pairs: bounce get, checksums on and off, against O_DIRECT -> pinned -> cudaMemcpy"
    "$BIN/gpu_bench" "$WORK/bench.dev" --bytes "$BENCH_BYTES" --threads 8 --rounds "${ROUNDS:-5}" \
        --checksum-pairs 2>&1 | tee "$OUT/checksum-pairs.log"
    rc=${PIPESTATUS[0]}
    rm -f "$WORK/bench.dev"
    exit "$rc"
fi

RT="not run"
: > "$OUT/roundtrip.log"
if [ "$MODE" != bench ]; then
    log "GPU round trips up to $RT_MAX"
    RT=FAIL
    "$BIN/gpu_roundtrip" "$WORK" --max-bytes "$RT_MAX" 2>&1 | tee "$OUT/roundtrip.log" && RT=PASS
    rm -f "$WORK"/roundtrip-*.dev
fi

log "benchmark: $BENCH_BYTES"
"$BIN/gpu_bench" "$WORK/bench.dev" --bytes "$BENCH_BYTES" --depths 8,32 --region-out "$WORK/region" 2>&1 | tee "$OUT/bench.log"
if [ "$KVIKIO" = ok ] && [ -f "$WORK/region" ]; then
    KVIKIO_NTHREADS=8 python3 benches/gpu/kvikio_bench.py "$WORK/bench.dev" \
        "$(python3 -c "import re,sys; u={'':1,'KIB':2**10,'MIB':2**20,'GIB':2**30}; m=re.fullmatch(r'(\d+)(\w*)','$BENCH_BYTES'); print(int(m[1])*u[m[2].upper()])")" \
        "$(cat "$WORK/region")" 3 2>&1 | tee "$OUT/kvikio.log" || echo "kvikio run failed (see kvikio.log)"
fi
rm -f "$WORK/bench.dev"

log "summary"
echo "round trips: $RT ($(grep -c '^  ok' "$OUT/roundtrip.log") sizes ok, $(grep -c FAIL "$OUT/roundtrip.log") failed)"
python3 benches/gpu/summary.py "$OUT/bench.log" "$OUT/kvikio.log"
grep "path auto" "$OUT/bench.log" || true
