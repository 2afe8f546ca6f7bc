#!/bin/bash
# Data-parallel training with teraio offload on the 2-GPU machine, in one call:
#   benches/torch/run-ddp.sh
# 1. reference:  one GPU, global batch 8, no cap (fits in an H200's 141 GB)
# 2. ddp-plain:  2 GPUs (torchrun, NCCL), 4 rows per rank, no cap
# 3. ddp-teraio: the same under a 22.5 GiB cap per rank, 48 GiB of host memory and one store per
#                rank ($STORE_DIR/rank<r>/dev0)
# 4. compare_ddp.py: ms/iter, peaks, loss differences, bitwise check, per-rank GB/s and stalls.
# Needs .whl-py/ (ignored by git; carry it): the teraio wheel built on the dev machine
# (`maturin build --release --strip -m bindings/python/Cargo.toml -o .whl-py`); python3, torch and
# transformers are the machine's. Logs and the RESULT lines (results-ddp.jsonl) go to $OUT.
# About 3-4 minutes; each step has its own timeout (100 + 90 + 190 s at most). The first
# ddp-teraio steps pin host memory for both ranks (the machine's memory grows as it is used).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/teraio-ddp-out}
STORE_DIR=${STORE_DIR:-/root/teraio-ddp}  # a real file system: the store uses O_DIRECT (not tmpfs)
STEPS=${STEPS:-12}
WARMUP=${WARMUP:-3}
CAP=${CAP:-22.5}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl-py/teraio-*.whl || exit 1
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export CUBLAS_WORKSPACE_CONFIG=:4096:8
# NVLink multicast stays off (NCCL, PyTorch's symmetric memory, NVSHMEM): on the shared GPU hosts a
# program that uses it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=benches/torch
RESULTS="$OUT/results-ddp.jsonl"
rm -f "$RESULTS"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
  "transformers", transformers.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
df -hT /root | tail -1; free -g | head -2
COMMON=(--global-batch 8 --seq 2048 --steps "$STEPS" --warmup "$WARMUP" --out "$RESULTS")
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)

echo "== reference: 1 GPU, global batch 8, no cap"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 100 python3 $B/bench_ddp.py --mode reference "${COMMON[@]}" \
  > "$OUT/ddp-1-reference.log" 2>&1
grep -E "step|checksum|Error" "$OUT/ddp-1-reference.log" | tail -4 | cut -c1-300

echo "== ddp-plain: 2 GPUs, 4 rows per rank, no cap"
timeout -k 10 90 "${TORCHRUN[@]}" $B/bench_ddp.py --mode ddp-plain "${COMMON[@]}" > "$OUT/ddp-2-plain.log" 2>&1
grep -E "step|checksum|Error" "$OUT/ddp-2-plain.log" | tail -4 | cut -c1-300

echo "== ddp-teraio: 2 GPUs, 4 rows per rank, cap $CAP GiB and host 48 GiB per rank, store per rank"
timeout -k 10 190 "${TORCHRUN[@]}" $B/bench_ddp.py --mode ddp-teraio "${COMMON[@]}" --cap-gib "$CAP" \
  --host-gib 48 --reserve-gib 3 --store-dir "$STORE_DIR" --store-gib 24 > "$OUT/ddp-3-teraio.log" 2>&1
grep -v RESULT "$OUT/ddp-3-teraio.log" | grep -vE "^W[0-9]+ |^\*+$" | tail -24 | cut -c1-300
rm -rf "$STORE_DIR"

echo "== compare (took ${SECONDS}s)"
python3 $B/compare_ddp.py "$RESULTS" | tee "$OUT/summary-ddp.md"
