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
import socket
import statistics
import sys
import time
import traceback
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_llama import GIB, build_model, make_batches

#: DeepSpeed's asynchronous I/O settings for NVMe offload (1 MiB blocks, 16 requests in flight).
AIO = {"block_size": 1048576, "queue_depth": 16, "single_submit": False, "overlap_events": True}


def init_single_process() -> None:
    """The environment deepspeed.initialize reads for one rank started without a launcher."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:  # a free port: rows run one after another
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")


def zero_config(
    *,
    stage: int,
    batch: int,
    offload_param: Optional[str] = None,
    offload_optimizer: Optional[str] = None,
    nvme_dir: Optional[str] = None,
    bf16: bool = False,
    param_buffer_elements: Optional[int] = None,
) -> dict[str, Any]:
    """A ZeRO config with AdamW (lr 1e-4, weight decay 0.01). `offload_param` and
    `offload_optimizer` are "cpu", "nvme" or None; NVMe swap files go under `nvme_dir`.
    `param_buffer_elements` sets `offload_param.buffer_size`, which must exceed the largest
    parameter's element count (DeepSpeed's default, 1e8, is below a 151936 x 1536 embedding)."""
    zero: dict[str, Any] = {"stage": stage}
    for key, device in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
        if device is None:
            continue
        offload: dict[str, Any] = {"device": device, "pin_memory": True}
        if device == "nvme":
            offload["nvme_path"] = nvme_dir
        zero[key] = offload
    if param_buffer_elements is not None and "offload_param" in zero:
        zero["offload_param"]["buffer_size"] = int(param_buffer_elements)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if "nvme" in (offload_param, offload_optimizer):
        config["aio"] = dict(AIO)
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def run(args: argparse.Namespace) -> dict[str, Any]:
    init_single_process()
    torch.backends.cuda.matmul.allow_tf32 = False
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    import deepspeed

    os.makedirs(args.nvme_dir, exist_ok=True)
    config = zero_config(
        stage=3,
        batch=args.batch,
        offload_param=args.device,
        offload_optimizer=args.device,
        nvme_dir=args.nvme_dir,
    )
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
