"""DeepSpeed ZeRO-Infinity (ZeRO-3, parameters and optimizer state offloaded to NVMe) on the same
Llama-shaped model, batch and GPU memory cap as bench_llama.py. ZeRO-3 does not offload
activations, so the model runs with Hugging Face gradient checkpointing (what ZeRO-Infinity users
do to fit activations). Single process, no launcher (RANK/WORLD_SIZE set here).

    python3 benches/torch/bench_deepspeed.py --cap-gib 25.5 --nvme-dir /root/ds-nvme --steps 6 [--device cpu]

Prints `RESULT {json}` like bench_llama.py, or the error that stopped it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_llama import GIB, build_model, make_batches


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    import deepspeed

    os.makedirs(args.nvme_dir, exist_ok=True)
    offload: dict[str, Any] = {"device": args.device, "pin_memory": True}
    if args.device == "nvme":
        offload["nvme_path"] = args.nvme_dir
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": dict(offload),
            "offload_optimizer": dict(offload),
        },
        "aio": {
            "block_size": 1048576,
            "queue_depth": 16,
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 1000,
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model()
    model.gradient_checkpointing_enable()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batches = make_batches(args.steps, args.batch, args.seq)
    losses, times_ms = [], []
    for step, tokens in enumerate(batches):
        if step == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        tokens = tokens.cuda()
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        torch.cuda.synchronize()
        times_ms.append((time.perf_counter() - started) * 1e3)
        print(
            f"  [deepspeed-{args.device}] step {step}: loss {losses[-1]:.6f} {times_ms[-1]:.0f} ms",
            flush=True,
        )
    measured = times_ms[args.warmup :] or times_ms
    return {
        "mode": f"deepspeed-{args.device}",
        "batch": args.batch,
        "steps": args.steps,
        "ms_per_iter": statistics.median(measured),
        "step_ms": times_ms,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "losses": losses,
        "warmup": args.warmup,
        "note": "ZeRO-3 + gradient checkpointing",
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--cap-gib", type=float, required=True)
    parser.add_argument("--device", choices=["nvme", "cpu"], default="nvme")
    parser.add_argument("--nvme-dir", default="/root/ds-nvme")
    args = parser.parse_args()
    try:
        result = run(args)
    except Exception as error:  # report what stopped it
        traceback.print_exc()
        result = {
            "mode": f"deepspeed-{args.device}",
            "batch": args.batch,
            "error": f"{type(error).__name__}: {error}"[:800],
        }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
