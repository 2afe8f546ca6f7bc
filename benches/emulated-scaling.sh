#!/usr/bin/env bash
# Emulated SSD arrays: `teraio bench --emulate` on N files in tmpfs (buffered), each
# file standing in for one SSD of the given bandwidth; prints aggregate GB/s against the sum of
# the emulated devices for N = 1, 2, 4, 8, and the host's own limit (the same files, not emulated).
# Usage: benches/emulated-scaling.sh [PER_DEVICE_RATE] [DIR]    (default 0.5GB/s, /dev/shm/teraio-emu)
set -euo pipefail
rate="${1:-0.5GB/s}"
dir="${2:-/dev/shm/teraio-emu}"
cd "$(dirname "$0")/.."
cargo build --release -q -p teraio-cli
bin="${CARGO_TARGET_DIR:-target}/release/teraio"
mkdir -p "$dir"
gbps() { python3 -c 'import json,sys; print("%.3f" % json.load(sys.stdin)["report"]["gb_per_s"])'; }
run() { # devices rw [extra args]
  local n=$1 rw=$2; shift 2
  rm -f "$dir"/d*
  local targets=()
  for i in $(seq 0 $((n - 1))); do targets+=("$dir/d$i"); done
  "$bin" bench "${targets[@]}" --buffered --rw "$rw" --data-size 1GiB --object-size 64MiB \
    --request-size 1MiB --stripe-unit 1MiB --file-size $((1536 / n + 64))MiB \
    --runtime 4s --warmup 1s --no-progress --json "$@" | gbps
}
per=$(python3 -c "import sys; t='$rate'.split('@')[0]; r=t.replace('GB/s',''); print(float(r.split('/')[0]))")
printf "%-8s %-6s %14s %12s %10s\n" devices rw "emulated sum" "teraio GB/s" "of sum"
for rw in read write; do
  for n in 1 2 4 8; do
    got=$(run "$n" "$rw" --emulate "$rate")
    sum=$(python3 -c "print(round($n * $per, 3))")
    printf "%-8s %-6s %14s %12s %9.1f%%\n" "$n" "$rw" "$sum" "$got" "$(python3 -c "print(100 * $got / ($n * $per))")"
  done
done
printf "%-8s %-6s %14s %12s\n" 4 read "host limit" "$(run 4 read)"
rm -rf "$dir"
