"""The Hugging Face `Trainer` under a cap: teraio's callback against `gradient_checkpointing=True`.

bench_regime.py's model shapes (its `FAMILIES` and `build_model`: random init, fixed seed, SDPA),
trained by `transformers.Trainer` with `bf16=True` (autocast over fp32 weights), AdamW
(`--optim`, default `adamw_torch`: the optimizer of bench_regime.py's rows), max_grad_norm 1.0,
a constant learning rate:

    ideal    the Trainer as it is, no cap
    teraio   Trainer(callbacks=[teraio.integrations.transformers.OffloadCallback(store=store,
             gpu_memory=cap)]): default arguments
    hf_ckpt  TrainingArguments(gradient_checkpointing=True, use_reentrant=False)

Two commands, as bench_regime.py's (both from rows.py). `run` trains one mode in this process
and prints one `RESULT {json}` line (out of memory is a row with "oom": true):

    python3 benches/torch/bench_trainer.py run --family qwen2 --mode ideal
    python3 benches/torch/bench_trainer.py run --family qwen2 --mode teraio --cap-bytes 41600000000

`table`: per family, `ideal`, then `teraio` and `hf_ckpt` at each cap (fractions of the ideal
row's peak allocated memory, `torch.cuda.set_per_process_memory_fraction`), each in its own
process under a time limit; rows go to OUT/results.jsonl and the table is printed (summarize.py).

    python3 benches/torch/bench_trainer.py table --families qwen2,llama --out-dir /tmp/trainer

A step's time runs from the end of the previous step (`on_step_end`, after a device
synchronize) to the end of this one: data loading, forward, backward, clipping and the optimizer
step as the Trainer runs them. ms/iter is the median after the warm-up steps; peaks are the CUDA
allocator's over those steps. Losses are each step's `training_step` loss.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_regime  # noqa: E402  (beside this script: the model shapes)
import rows  # noqa: E402

MODES = ["ideal", "teraio", "hf_ckpt"]
LOOP = "HF Trainer"


def make_dataset(args: argparse.Namespace, vocab: int) -> list[dict[str, torch.Tensor]]:
    """bench_regime.py's batches as rows, in order: `--batch` rows a step."""
    batches = bench_regime.make_batches(args.steps, args.batch, args.seq, vocab)
    return [{"input_ids": row, "labels": row} for tokens in batches for row in tokens]


def trainer_callbacks(warmup: int, steps: rows.Steps) -> Any:
    """A TrainerCallback that records each step's time and (CUDA) peak into `steps`."""
    import transformers

    class Timing(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup:
                steps.reset_peaks()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if steps.device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            # The loss was recorded by `training_step`.
            steps.done(state.global_step - 1, None, (now - self.last) * 1e3)
            self.last = now

    return Timing()


def base(
    args: argparse.Namespace, family: str, mode: str, cap: Optional[int], fraction: Optional[float]
) -> dict[str, Any]:
    """The fields that name a row."""
    names = {"family": f"{family}{'-tiny' if args.tiny else ''} ({LOOP})", "loop": LOOP, "dtype": "autocast"}
    return rows.fields(args, names, mode, cap, fraction)


def row_base(args: argparse.Namespace) -> dict[str, Any]:
    """The fields that name the row of a `run` command."""
    return base(args, args.family, args.mode, rows.cap_of(args), args.cap_fraction)


def run_in(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    import transformers

    device, result, cap = rows.start(args, row_base(args), optim=args.optim)
    family = args.family + ("-tiny" if args.tiny else "")
    model = bench_regime.build_model(args.family, "autocast", device, args.tiny)
    vocab = model.config.vocab_size
    result["params"] = sum(p.numel() for p in model.parameters())
    result["vocab"] = vocab
    steps = rows.Steps(f"{family} {args.mode}", device)

    class Recording(transformers.Trainer):
        def training_step(self, *a: Any, **k: Any) -> Any:
            loss = super().training_step(*a, **k)
            steps.losses.append(loss.item())
            return loss

    callbacks: list[Any] = [trainer_callbacks(args.warmup, steps)]
    offload = None
    extra: dict[str, Any] = {}
    if args.mode == "hf_ckpt":
        extra = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    elif args.mode == "teraio":
        from teraio.integrations.transformers import OffloadCallback

        store = rows.make_store(args, scratch)
        result["arguments"] = "defaults"
        offload = OffloadCallback(store=store, gpu_memory=cap)
        callbacks.insert(0, offload)
    training = transformers.TrainingArguments(
        output_dir=os.path.join(scratch, "out"),
        use_cpu=device.type == "cpu",
        bf16=True,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        optim=args.optim,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **extra,
    )
    trainer = Recording(
        model=model, args=training, train_dataset=make_dataset(args, vocab), callbacks=callbacks
    )
    try:
        with offload if offload is not None else contextlib.nullcontext():
            trainer.train()
    except torch.cuda.OutOfMemoryError as error:
        result.update(oom=True, oom_step=len(steps.step_ms), error=rows.oom_error(error))
    rows.finish(result, steps, args.warmup)
    if offload is not None and offload.run is not None:
        rows.add_report(result, offload)
    return result


# -- the table --------------------------------------------------------------------------------


def table_main(args: argparse.Namespace) -> int:
    families = rows.split(args.families)
    fractions = [float(f) for f in rows.split(args.fractions)]
    for name in families:
        if name not in bench_regime.FAMILIES:
            raise SystemExit(f"unknown family {name!r}: one of {', '.join(bench_regime.FAMILIES)}")
    table = rows.Table(args)

    def row(
        family: str, mode: str, cap: Optional[int] = None, fraction: Optional[float] = None
    ) -> dict[str, Any]:
        label = f"{family}-trainer-{mode}" + (f"-{round(100 * fraction)}" if fraction else "")
        command = rows.run_command(__file__, args, family, mode) + ["--optim", args.optim]
        return table.write(table.run(label, base(args, family, mode, cap, fraction), command, mode))

    # Every family's ideal row first, then the caps from the largest: a deadline cuts the rows of
    # the smallest cap last.
    peaks: dict[str, int] = {}
    for family in families:
        ideal = row(family, "ideal")
        peak = ideal.get("peak_allocated_bytes")
        if peak:
            peaks[family] = peak
        else:
            print(f"== {family}: the ideal row gave no peak (no CUDA, or it failed), so no capped rows")
    for fraction in fractions:
        for family, peak in peaks.items():
            for mode in ("teraio", "hf_ckpt"):
                row(family, mode, int(fraction * peak), fraction)
    return table.finish()


def main(argv: Optional[list[str]] = None) -> int:
    common = rows.common_arguments()
    common.add_argument("--optim", default="adamw_torch", help="TrainingArguments(optim=...)")
    parser, _, many = rows.parsers(
        __doc__, common, list(bench_regime.FAMILIES), MODES, "one mode in this process"
    )
    rows.table_arguments(many, "qwen2,llama", deadline_s=330.0, timeout_s=90.0, teraio_timeout_s=150.0)
    return rows.main(parser, argv, "trainer", run_in, row_base, table_main)


if __name__ == "__main__":
    sys.exit(main())
