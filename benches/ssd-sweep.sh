#!/usr/bin/env bash
# "How many SSDs per GPU do I need?" — predicted % of ideal for Llama3-8B and Llama3-70B training
# (fp32, AdamW, the paper's hardware: one GPU of 2x H100 NVL 94 GB, 2-stage pipeline, SSDs of
# 6.7/6.5 GB/s each) as the SSD count per GPU and the host-memory cap vary; then the fewest SSDs
# per GPU that reach 90% of ideal. Host caps follow the paper's Fig. 9 (8B: none, 64 GB; 70B:
# none, 512 GB, 1024 GB per server, i.e. half per GPU).
# Usage: benches/ssd-sweep.sh [WORK_DIR]
set -euo pipefail
work_dir="${1:-/tmp/teraio-ssd-sweep}"
mkdir -p "$work_dir"
cd "$(dirname "$0")/.."
cargo build --release -q -p teraio-cli --bin teraio
bin="${CARGO_TARGET_DIR:-target}/release/teraio"
counts="1 2 3 4 6 8 12 16"

sweep() { # model seq batch host_caps...
  local model=$1 seq=$2 batch=$3; shift 3
  local trace="$work_dir/$model-s$seq-b$batch.json"
  "$bin" trace --model "$model" --gpu h100-nvl --stages 2 --seq "$seq" --batch "$batch" -o "$trace" >/dev/null
  echo
  echo "-- $model, seq $seq, batch $batch per GPU: predicted % of ideal (teraio planner + simulator) --"
  printf "%-14s" "host cap/GPU"; for n in $counts; do printf "%8s" "${n} SSD"; done; printf "%14s\n" "90% needs"
  for host in "$@"; do
    printf "%-14s" "$host"
    local need="> 16"
    for n in $counts; do
      pct=$("$bin" sim "$trace" --ssd "${n}x6.7/6.5GB/s" --host-mem "$host" --policies teraio --json \
        | python3 -c 'import json,sys; r=json.load(sys.stdin)["rows"]; print("%.1f" % [x for x in r if x["policy"]=="teraio"][0]["percent_of_ideal"])')
      printf "%8s" "$pct"
      if [[ "$need" == "> 16" ]] && awk "BEGIN{exit !($pct >= 90)}"; then need="$n"; fi
    done
    printf "%14s\n" "$need"
  done
}

sweep llama3-8b 4096 8 0GiB 32GiB
sweep llama3-8b 8192 4 0GiB 32GiB
sweep llama3-70b 2048 2 0GiB 256GiB 512GiB
