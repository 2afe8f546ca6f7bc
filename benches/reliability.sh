#!/usr/bin/env bash
# Long reliability runs (the short versions run in CI): SIGKILL and power-cut crash campaigns,
# the fault campaign, the model property test and metadata fuzzing, with larger counts.
# Usage: benches/reliability.sh [scale]   (scale 1 = about 10 minutes on the 2-core dev machine)
set -euo pipefail
cd "$(dirname "$0")/.."
scale=${1:-1}
export TERAIO_CRASH_ITERATIONS=$((150 * scale)) TERAIO_CRASH_SECONDS=$((240 * scale))
export TERAIO_FAULT_ROUNDS=$((600 * scale))
export TERAIO_MODEL_CASES=$((300 * scale))
export TERAIO_FUZZ_CASES=$((1000 * scale))
cargo test --release -p teraio-e2e --test crash --test faults --test model --test fuzz --test concurrency -- --nocapture 2>&1 \
  | grep -E "crash test|fault campaign|puts and|acknowledged|test result|panicked|FAILED"
