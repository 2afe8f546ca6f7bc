"""Where checkpointing every block under teraio differs in speed from Hugging Face's checkpointing:
the accumulating loop of bench_loops.py (bf16 autocast, SDPA, AdamW, clip 1.0), one process per
variant, each adding one of the things teraio's checkpoint-every-block side does to a plain loop.

    hf            model.gradient_checkpointing_enable(use_reentrant=False)
    hf_head       hf, with teraio's loss head (`teraio.head.LossHead`)
    hf_sync       hf, the host waiting for the step's GPU work after each step (as a runtime that
                  reads the iteration's CUDA events there does)
    blocks        each decoder layer's forward under teraio's `blocks.Checkpointer` (non-reentrant
                  checkpoint with autocast's weight cache off inside the block)
    blocks_cache  blocks with autocast's cache left on
    teraio        teraio.offload with default arguments under the cap (its report says which side
                  of its A/B trial ran when)

    python3 benches/torch/probe_checkpointing.py --family llama --accum 2 --variants hf,blocks,teraio \
        --cap-bytes 30598522905

Prints each variant's step times and median; `--tiny` runs on the CPU (a test of the script).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from typing import Any

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import baselines
import bench_loops as loops
import bench_regime as regime
import rows

VARIANTS = ("hf", "hf_head", "hf_sync", "blocks", "blocks_cache", "teraio")


def run_variant(args: argparse.Namespace, scratch: str) -> None:
    device = torch.device("cpu" if args.tiny else "cuda")
    variant = args.mode = args.variant
    rows.set_cap(args, device)
    model = regime.build_model(args.family, "autocast", device, args.tiny)
    outer: Any = contextlib.nullcontext()
    if variant.startswith("hf"):
        baselines.enable_hf_checkpointing(model)
    if variant == "hf_head":
        from teraio.head import LossHead

        outer = LossHead(model)
    if variant.startswith("blocks"):
        from teraio import blocks

        if variant == "blocks_cache":
            blocks.autocast_cache_off = contextlib.nullcontext  # type: ignore[assignment]
        found = blocks.find_blocks(model)
        blocks.Checkpointer(found).apply({name for name, _ in found})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant == "teraio":
        import teraio

        outer = teraio.offload(
            model, optimizer, store=rows.make_store(args, scratch), gpu_memory=args.cap_bytes
        )
    batches = regime.make_batches(args.steps, args.batch, args.seq, model.config.vocab_size)
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16)
    sync = variant == "hf_sync" and device.type == "cuda"
    after_step = torch.cuda.current_stream().synchronize if sync else lambda: None
    step = loops.accumulating_step(
        model, optimizer, list(model.parameters()), args.accum, 1.0, autocast, after_step=after_step
    )
    steps, result = rows.Steps(variant, device), {}
    rows.train(result, steps, batches, step, outer, args, f"probe-{variant}")
    if result.get("oom"):
        print(f"{variant}: out of memory at step {result['oom_step']}", flush=True)
        return
    times = steps.step_ms
    timed = times[args.warmup :]
    print(
        f"{variant}: median {statistics.median(timed):.1f} ms over {len(timed)} steps; "
        f"steps {' '.join(f'{t:.0f}' for t in times)}",
        flush=True,
    )
    if variant == "teraio":
        print(outer.report(), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="llama", choices=sorted(regime.FAMILIES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", default="", help=argparse.SUPPRESS)  # one, in its own process
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=9)
    parser.add_argument(
        "--cap-bytes",
        type=int,
        default=0,
        help="the allocator's cap and teraio's gpu_memory (teraio needs it)",
    )
    parser.add_argument("--store-dir", default="", help="where teraio's store file goes (default: temp dir)")
    parser.add_argument("--store-gib", type=float, default=8.0)
    parser.add_argument("--tiny", action="store_true", help="CPU, 2 small layers (tests of this script)")
    args = parser.parse_args()
    if args.variant:
        scratch = tempfile.mkdtemp(prefix="teraio-probe-")
        try:
            run_variant(args, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return 0
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: {variant!r} is not one of {', '.join(VARIANTS)}")
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
