"""Training loops as users write them (issue 43): gradient accumulation and LoRA under a cap.

The models and batches come from bench_regime.py (transformers configs, random init, fixed
seed, SDPA, bf16 autocast over fp32 weights); the store, the timing, the report and the table
from rows.py, as for bench_regime.py. Each step runs `--accum` micro-batches of the batch
(`(loss / accum).backward()` each), `clip_grad_norm_(..., 1.0)`, the step and `zero_grad`: the
loop as users write it.

Rows, per family (`--families`, default qwen2,llama):

    ideal      the full batch in one pass, no offload, no cap: the peak the caps are shares of
    teraio     teraio.offload(model, optimizer, store=store, gpu_memory=cap): default arguments,
               with accumulation 2 and 4 (same total batch)
    hf_ckpt    model.gradient_checkpointing_enable(use_reentrant=False), the same accumulation

at each `--fractions` share of the ideal peak (65% and 50%). With `--lora`, the Llama-3.2-3B
shape (`--lora-family`: another of bench_regime.py's) through `peft` (rank 16, alpha 32, every
linear layer of the decoder): LoRA without a cap,
then teraio and LoRA + checkpointing at the same shares of LoRA's own peak; each row says
whether full fine-tuning's training state (parameters, gradients and AdamW's moments, fp32) fits
its cap (`full_state_bytes`).

    python3 benches/torch/bench_loops.py run --family qwen2 --mode teraio --accum 2 --cap-bytes 41600000000
    python3 benches/torch/bench_loops.py table --families qwen2 --lora --out-dir /tmp/loops
    python3 benches/torch/bench_loops.py table --tiny --out-dir /tmp/loops-cpu   # CPU smoke run

`table` runs each row in its own process under `--deadline-s` (rows left are recorded as
skipped), writes OUT/results.jsonl and prints summarize.py's table: one per family and
accumulation ("qwen2 accum 2"), each with the ideal row, so that teraio is set against
checkpointing at the same loop. ms/iter is the median of the steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from functools import partial
from typing import Any, Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import baselines  # noqa: E402  (beside this script)
import bench_regime as regime  # noqa: E402
import rows  # noqa: E402

MODES = ["ideal", "teraio", "hf_ckpt"]
LORA_FAMILY = "llama3b"
LORA_RANK = 16


def lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """The model with LoRA adapters on every linear layer of the decoder (peft's "all-linear":
    the output head left out); the base weights frozen."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def base(
    args: argparse.Namespace,
    family: str,
    mode: str,
    accum: int,
    lora_rank: int,
    cap: Optional[int],
    fraction: Optional[float],
) -> dict[str, Any]:
    """The fields that name a row (summarize.py's `family` is the table it goes in: see
    `Table.record`)."""
    names = {"model_family": family + ("-tiny" if args.tiny else ""), "dtype": "autocast"}
    return rows.fields(args, names, mode, cap, fraction, accum=accum, lora_rank=lora_rank)


def row_base(args: argparse.Namespace) -> dict[str, Any]:
    """The fields that name the row of a `run` command."""
    return base(
        args, args.family, args.mode, args.accum, args.lora_rank, rows.cap_of(args), args.cap_fraction
    )


def accumulating_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trained: list[torch.nn.Parameter],
    accum: int,
    clip: float,
    autocast: Callable[[], Any],
    forward_context: Callable[[], Any] = contextlib.nullcontext,
    after_step: Callable[[], None] = lambda: None,
) -> Callable[[torch.Tensor], float]:
    """The loop as users write it, one batch a call: `accum` micro-batches, each
    `(loss / accum).backward()`, then `clip_grad_norm_` (where `clip`), the step, `after_step()`
    and `zero_grad`; returns the batch's loss."""

    def step(tokens: torch.Tensor) -> float:
        total = 0.0
        for part in tokens.chunk(accum):
            with forward_context(), autocast():
                loss = model(input_ids=part, labels=part).loss / accum
            loss.backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(trained, clip)
        optimizer.step()
        after_step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def run_in(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    device, result, cap = rows.start(args, row_base(args), clip=args.clip)
    if args.batch % args.accum:
        raise ValueError(f"--batch {args.batch} is not a multiple of --accum {args.accum}")
    model = regime.build_model(args.family, "autocast", device, args.tiny)
    vocab = model.config.vocab_size
    result["params"] = sum(p.numel() for p in model.parameters())
    result["vocab"] = vocab
    # Full fine-tuning's training state: fp32 parameters, gradients and AdamW's two moments.
    result["full_state_bytes"] = regime.model_state_bytes(model)
    if cap is not None:
        result["full_state_fits_cap"] = result["full_state_bytes"] <= cap
    if args.mode == "hf_ckpt":
        # Before peft wraps it: the transformers model's own switch, every decoder layer.
        baselines.enable_hf_checkpointing(model)
    if args.lora_rank:
        model = lora(model, args.lora_rank)
    trained = [p for p in model.parameters() if p.requires_grad]
    result["trained_params"] = sum(p.numel() for p in trained)
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    batches = regime.make_batches(args.steps, args.batch, args.seq, vocab)

    outer: Any = contextlib.nullcontext()
    handle = None
    if args.mode == "teraio":
        import teraio

        store = rows.make_store(args, scratch)
        result["arguments"] = "defaults"
        outer = teraio.offload(model, optimizer, store=store, gpu_memory=cap)
        handle = outer
    # A CPU "device" has no allocator to ask: the ideal row's peak is estimated (bench_regime).
    saved = regime.SavedBytes(model) if args.mode == "ideal" and device.type != "cuda" else None
    forward_context = saved.context if saved is not None else contextlib.nullcontext
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16)

    step = accumulating_step(model, optimizer, trained, args.accum, args.clip, autocast, forward_context)
    steps = rows.Steps(f"{args.family} {args.mode} accum {args.accum}", device)
    rows.train(result, steps, batches, step, outer, args, f"{args.family}-{args.mode}-accum{args.accum}")
    rows.finish(result, steps, args.warmup)
    if saved is not None:
        result["peak_estimate_bytes"] = regime.model_state_bytes(model) + sum(saved.seen.values())
    if handle is not None:
        rows.add_report(result, handle)
    return result


# -- the table --------------------------------------------------------------------------------


class Table(rows.Table):
    """The rows; an ideal row goes in the table of every accumulation (see `record`)."""

    def row(
        self,
        family: str,
        mode: str,
        accum: int,
        lora_rank: int = 0,
        ideal_peak: Optional[int] = None,
        fraction: Optional[float] = None,
    ) -> dict[str, Any]:
        args = self.args
        cap = int(fraction * ideal_peak) if fraction and ideal_peak else None
        label = f"{family}{'-lora' if lora_rank else ''}-{mode}-accum{accum}" + (
            f"-{round(100 * fraction)}" if fraction else ""
        )
        command = rows.run_command(__file__, args, family, mode)
        command += ["--accum", str(accum), "--lora-rank", str(lora_rank), "--clip", str(args.clip)]
        return self.run(label, base(args, family, mode, accum, lora_rank, cap, fraction), command, mode)

    def record(self, result: dict[str, Any], group: str) -> None:
        """One line of results.jsonl; `group` is its table's title (summarize.py's `family`)."""
        self.write({**result, "family": group})


def peak_of(result: dict[str, Any]) -> Optional[int]:
    return result.get("peak_allocated_bytes") or result.get("peak_estimate_bytes")


def table_main(args: argparse.Namespace) -> int:
    families = rows.split(args.families)
    fractions = [float(f) for f in rows.split(args.fractions)]
    accums = [int(a) for a in rows.split(args.accums)]
    for name in families + ([args.lora_family] if args.lora else []):
        if name not in regime.FAMILIES:
            raise SystemExit(f"unknown family {name!r}: one of {', '.join(regime.FAMILIES)}")
    for accum in accums:
        if accum < 1 or args.batch % accum:
            raise SystemExit(f"--accums: {accum} does not divide --batch {args.batch}")
    table = Table(args)
    for family in families:
        ideal = table.row(family, "ideal", 1)
        peak = peak_of(ideal)
        for accum in accums:
            table.record(ideal, f"{family} accum {accum}")
        if not peak:
            print(f"== {family}: the ideal run gave no peak, so no capped rows", flush=True)
            continue
        for fraction in fractions:
            for accum in accums:
                for mode in ("teraio", "hf_ckpt"):
                    table.record(table.row(family, mode, accum, 0, peak, fraction), f"{family} accum {accum}")
    if args.lora:
        group = f"{args.lora_family} lora r{LORA_RANK}"
        ideal = table.row(args.lora_family, "ideal", 1, LORA_RANK)
        table.record(ideal, group)
        peak = peak_of(ideal)
        if peak:
            for fraction in fractions:
                for mode in ("teraio", "hf_ckpt"):
                    table.record(table.row(args.lora_family, mode, 1, LORA_RANK, peak, fraction), group)
    return table.finish()


def accum_problem(args: argparse.Namespace) -> Optional[str]:
    if args.accum < 1 or args.batch % args.accum:
        return f"--accum {args.accum} must divide --batch {args.batch}"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    common = rows.common_arguments(batch_help="the total batch of a step")
    common.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_'s max norm (0: no clipping)")
    parser, one, many = rows.parsers(__doc__, common, list(regime.FAMILIES), MODES, "one row in this process")
    one.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    one.add_argument("--lora-rank", type=int, default=0, help="LoRA through peft at this rank (0: none)")
    rows.table_arguments(many, "qwen2,llama", deadline_s=420.0, timeout_s=120.0, teraio_timeout_s=200.0)
    many.add_argument("--accums", default="2,4", help="micro-batches per step, each a row per mode")
    many.add_argument("--lora", action="store_true", help=f"the LoRA rows (rank {LORA_RANK})")
    many.add_argument("--lora-family", default=LORA_FAMILY, help="the model of the LoRA rows")
    return rows.main(parser, argv, "loops", run_in, row_base, table_main, check_run=accum_problem)


if __name__ == "__main__":
    sys.exit(main())
