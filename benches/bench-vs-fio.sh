#!/usr/bin/env bash
# teraio vs fio on the same files, in one run: for each workload and device count, `teraio bench
# --compare-fio` formats the files as a teraio store, writes the data set, runs the timed teraio
# phase, then runs fio's twin job (fio-configs/<workload>.fio) on the same files for the same
# runtime and warm-up. Prints teraio/fio ratios (>= 1.00: teraio is at least as fast).
#
# Usage: benches/bench-vs-fio.sh            (4 GiB of data, 10 s runs, 2 s warm-up)
# Environment: DIR (where the device files go; a disk file system, not tmpfs), DATA, RUNTIME,
# WARMUP, DEVICE_COUNTS ("1 4"), CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${DIR:-${TMPDIR:-/tmp}/teraio-vs-fio}
DATA=${DATA:-4GiB}
RUNTIME=${RUNTIME:-10s}
WARMUP=${WARMUP:-2s}
DEVICE_COUNTS=${DEVICE_COUNTS:-"1 4"}
TARGET_DIR=${CARGO_TARGET_DIR:-target}

cargo build --release -p teraio-cli >&2
BIN="$TARGET_DIR/release/teraio"
command -v fio >/dev/null || { echo "fio is not installed (apt-get install fio)" >&2; exit 1; }
command -v jq >/dev/null || { echo "jq is not installed (apt-get install jq)" >&2; exit 1; }

# name | teraio flags
WORKLOADS=(
  "seq-read-4m-qd32|--rw read --request-size 4MiB --queue-depth 32"
  "seq-write-4m-qd32|--rw write --request-size 4MiB --queue-depth 32"
  "rand-read-4k-qd128|--rw randread --request-size 4KiB --queue-depth 128"
)

mkdir -p "$DIR"
RESULTS=$(mktemp)
trap 'rm -rf "$DIR" "$RESULTS"' EXIT
echo "host: $(nproc) cores, $(uname -r), fio $(fio --version), files in $DIR ($(df -h --output=source,fstype "$DIR" | tail -1 | tr -s ' '))" >&2
for devices in $DEVICE_COUNTS; do
  rm -f "$DIR"/d*
  targets=()
  for ((i = 0; i < devices; i++)); do targets+=("$DIR/d$i"); done
  # Precondition: write every device file in full once, so neither tool ever touches
  # never-written (unwritten-extent) blocks, which read as zeros without I/O and cost extent
  # conversion on the first write. Each file holds its share of the data set plus room for
  # teraio's metadata and the objects a put replaces.
  data_bytes=$(numfmt --from=iec "${DATA%iB}")
  file_bytes=$(( data_bytes / devices + 1536 * 1024 * 1024 ))
  fio --name=precondition --ioengine=io_uring --direct=1 --rw=write --bs=4m --iodepth=16 \
    --directory="$DIR" --filename_format='d$jobnum' --numjobs="$devices" --size="$file_bytes" \
    --output-format=terse > /dev/null
  for entry in "${WORKLOADS[@]}"; do
    name=${entry%%|*}
    flags=${entry#*|}
    echo "== $name on $devices device file(s)" >&2
    # shellcheck disable=SC2086
    "$BIN" bench "${targets[@]}" $flags --data-size "$DATA" --runtime "$RUNTIME" --warmup "$WARMUP" \
      --compare-fio --force --json --no-progress > "$DIR/out.json"
    jq -r --arg name "$name" --arg devices "$devices" '[
        $name, $devices,
        (.report.gb_per_s | tostring), (.fio | ((.read_bytes_per_s + .write_bytes_per_s) / 1e9) | tostring),
        (.report.aggregate | (.read.iops + .write.iops) | tostring), (.fio | (.read_iops + .write_iops) | tostring),
        (.report.aggregate | (if .read.ops > 0 then .read else .write end).latency.p99_us | tostring),
        (.fio.p99_us | tostring),
        (.report.cpu.cores_busy | tostring), (.fio.cores_busy | tostring),
        (.teraio_over_fio | tostring)] | @tsv' "$DIR/out.json" >> "$RESULTS"
  done
done

printf '\n%-20s %7s %11s %9s %11s %11s %12s %9s %11s %9s %10s\n' \
  workload devices "teraio GB/s" "fio GB/s" "teraio IOPS" "fio IOPS" "teraio p99us" "fio p99us" "teraio cpu" "fio cpu" teraio/fio
while IFS=$'\t' read -r name devices tgb fgb tiops fiops tp99 fp99 tcpu fcpu ratio; do
  printf '%-20s %7s %11.3f %9.3f %11.0f %11.0f %12.0f %9.0f %11.2f %9.2f %10.3f\n' \
    "$name" "$devices" "$tgb" "$fgb" "$tiops" "$fiops" "$tp99" "$fp99" "$tcpu" "$fcpu" "$ratio"
done < "$RESULTS"
echo "(IOPS: device requests per second; p99: device request latency; cpu: cores busy;"
echo " teraio/fio: teraio GB/s over fio GB/s on the same files in the same run)"
