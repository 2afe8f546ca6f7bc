#!/usr/bin/env bash
# What checking every get's crc32c costs: `teraio bench` with --verify-checksums on and off,
# alternated in one run (ROUNDS pairs per workload), on the same temporary store of 4 files.
# Prints GB/s per run and the median on/off ratio per workload.
#   benches/checksum-cost.sh [TERAIO_BINARY]      # default: target/release/teraio
#   ROUNDS=3 RUNTIME=8s DATA=2GiB DIR=/tmp benches/checksum-cost.sh
set -euo pipefail
cd "$(dirname "$0")/.."
teraio=${1:-target/release/teraio}
rounds=${ROUNDS:-3}
runtime=${RUNTIME:-8s}
data=${DATA:-2GiB}
dir=${DIR:-${TMPDIR:-/tmp}/teraio-checksum-cost}
mkdir -p "$dir"
targets=("$dir/d0" "$dir/d1" "$dir/d2" "$dir/d3")
trap 'rm -rf "$dir"' EXIT

gbps() {  # workload-args... -> GB/s of one run
  "$teraio" bench "${targets[@]}" --force --runtime "$runtime" --data-size "$data" --json "$@" 2>/dev/null |
    python3 -c 'import json, sys; print("%.3f" % json.load(sys.stdin)["report"]["gb_per_s"])'
}

for workload in "--rw read" "--rw randrw --read-percent 70 --request-size 256KiB --queue-depth 8"; do
  on=(); off=()
  for ((i = 0; i < rounds; i++)); do
    # shellcheck disable=SC2086
    on+=("$(gbps $workload --verify-checksums on)")
    # shellcheck disable=SC2086
    off+=("$(gbps $workload --verify-checksums off)")
  done
  python3 - "$workload" "${on[*]}" "${off[*]}" <<'PY'
import statistics, sys
workload, on, off = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
ratios = [a / b for a, b in zip(on, off)]
print(f"{workload}: checksums on {on} GB/s, off {off} GB/s; on/off per pair {[round(r, 3) for r in ratios]}, "
      f"median {statistics.median(ratios):.3f} (cost {100 * (1 - statistics.median(ratios)):.1f}%)")
PY
done
