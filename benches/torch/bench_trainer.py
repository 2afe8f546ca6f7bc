"""The Hugging Face `Trainer` under a cap: teraio's callback against `gradient_checkpointing=True`.

bench_regime.py's model shapes (its `FAMILIES` and `build_model`: random init, fixed seed, SDPA),
trained by `transformers.Trainer` with `bf16=True` (autocast over fp32 weights), AdamW
(`--optim`, default `adamw_torch`: the optimizer of bench_regime.py's rows), max_grad_norm 1.0,
a constant learning rate:

    ideal    the Trainer as it is, no cap
    teraio   Trainer(callbacks=[teraio.integrations.transformers.OffloadCallback(store=store,
             gpu_memory=cap)]): default arguments
    hf_ckpt  TrainingArguments(gradient_checkpointing=True, use_reentrant=False)

Two commands, as bench_regime.py's. `run` trains one mode in this process and prints one
`RESULT {json}` line (out of memory is a row with "oom": true):

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
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_regime  # noqa: E402  (beside this script: the model shapes and the store)
import summarize  # noqa: E402

GIB = 1 << 30
MODES = ["ideal", "teraio", "hf_ckpt"]
LOOP = "HF Trainer"


def make_dataset(args: argparse.Namespace, vocab: int) -> list[dict[str, torch.Tensor]]:
    """bench_regime.py's batches as rows, in order: `--batch` rows a step."""
    batches = bench_regime.make_batches(args.steps, args.batch, args.seq, vocab)
    return [{"input_ids": row, "labels": row} for tokens in batches for row in tokens]


def trainer_callbacks(device: torch.device, warmup: int, record: dict[str, Any]) -> Any:
    """A TrainerCallback that records each step's time and (CUDA) peak into `record`."""
    import transformers

    class Timing(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record["last"] = time.perf_counter()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup and device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()
                # After the step: teraio resets the allocator's peak when the next iteration's
                # forward begins, so each step's peak is read here.
                record["peaks"].append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
            now = time.perf_counter()
            record["step_ms"].append((now - record["last"]) * 1e3)
            record["last"] = now
            print(
                f"  [{record['label']}] step {state.global_step - 1}: loss "
                f"{record['losses'][-1] if record['losses'] else float('nan'):.6f} "
                f"{record['step_ms'][-1]:.0f} ms",
                flush=True,
            )

    return Timing()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One row; the Trainer's output folder and (without --store-dir) the store file live in a
    scratch folder removed afterwards, whatever stopped the run (a store that cannot be made on a
    full disk included)."""
    scratch = tempfile.mkdtemp(prefix="teraio-trainer-")
    try:
        return run_in(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_in(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    import transformers

    device = torch.device("cpu" if args.tiny else "cuda")
    family = args.family + ("-tiny" if args.tiny else "")
    result: dict[str, Any] = {
        "family": f"{family} ({LOOP})",
        "loop": LOOP,
        "dtype": "autocast",
        "mode": args.mode,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "optim": args.optim,
        "attention": "sdpa",
    }
    if args.cap_fraction is not None:
        result["cap_fraction"] = args.cap_fraction
    cap = int(args.cap_bytes) if args.cap_bytes else None
    if cap is not None:
        result["cap_bytes"] = cap
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    if args.mode == "teraio" and cap is None:
        raise RuntimeError("teraio mode needs --cap-bytes (the GPU memory it must fit in)")
    model = bench_regime.build_model(args.family, "autocast", device, args.tiny)
    vocab = model.config.vocab_size
    result["params"] = sum(p.numel() for p in model.parameters())
    result["vocab"] = vocab
    record: dict[str, Any] = {"label": f"{family} {args.mode}", "losses": [], "step_ms": [], "peaks": []}

    class Recording(transformers.Trainer):
        def training_step(self, *a: Any, **k: Any) -> Any:
            loss = super().training_step(*a, **k)
            record["losses"].append(loss.item())
            return loss

    callbacks: list[Any] = [trainer_callbacks(device, args.warmup, record)]
    offload = None
    extra: dict[str, Any] = {}
    if args.mode == "hf_ckpt":
        extra = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    elif args.mode == "teraio":
        from teraio.integrations.transformers import OffloadCallback

        store_dir = args.store_dir or os.path.join(scratch, "store")
        store, _ = bench_regime.make_store(argparse.Namespace(**{**vars(args), "store_dir": store_dir}))
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
        result.update(
            oom=True,
            oom_step=len(record["step_ms"]),
            error="CUDA out of memory: " + str(error).split("\n")[0],
        )
    result["losses"] = record["losses"]
    result["step_ms"] = record["step_ms"]
    timed = record["step_ms"][args.warmup :]
    if timed and not result.get("oom"):
        result["ms_per_iter"] = statistics.median(timed)
    window = record["peaks"][args.warmup :] or record["peaks"]
    if window:
        result["peak_allocated_bytes"] = max(p[0] for p in window)
        result["peak_reserved_bytes"] = max(p[1] for p in window)
    if offload is not None and offload.run is not None:
        with contextlib.suppress(Exception):  # a report is extra: a failed one must not hide the run
            result.update(bench_regime.teraio_report(offload))
            print(result["teraio_report_text"], flush=True)
    return result


def run_main(args: argparse.Namespace) -> int:
    try:
        result = run(args)
    except torch.cuda.OutOfMemoryError as error:  # before the first step
        result = {"oom": True, "oom_step": -1, "error": "CUDA out of memory: " + str(error).split("\n")[0]}
    except Exception as error:  # a row that says what stopped the run
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"[:600]}
    family = args.family + ("-tiny" if args.tiny else "")
    base = {
        "family": f"{family} ({LOOP})",
        "loop": LOOP,
        "dtype": "autocast",
        "mode": args.mode,
        "batch": args.batch,
        "seq": args.seq,
        "cap_bytes": int(args.cap_bytes) if args.cap_bytes else None,
        "cap_fraction": args.cap_fraction,
    }
    print("RESULT " + json.dumps({**base, **result}), flush=True)
    return 0


# -- the table --------------------------------------------------------------------------------


def run_command(args: argparse.Namespace, family: str, mode: str) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "run", "--family", family, "--mode", mode]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    command += ["--seq", str(args.seq), "--store-gib", str(args.store_gib), "--optim", args.optim]
    if args.store_dir:
        command += ["--store-dir", args.store_dir]
    if args.tiny:
        command.append("--tiny")
    return command


def table_main(args: argparse.Namespace) -> int:
    families = [f for f in args.families.split(",") if f]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    for name in families:
        if name not in bench_regime.FAMILIES:
            raise SystemExit(f"unknown family {name!r}: one of {', '.join(bench_regime.FAMILIES)}")
    os.makedirs(args.out_dir, exist_ok=True)
    results_path = os.path.join(args.out_dir, "results.jsonl")
    open(results_path, "w").close()
    started = time.monotonic()

    def row(
        family: str, mode: str, cap: Optional[int] = None, fraction: Optional[float] = None
    ) -> dict[str, Any]:
        label = f"{family}-trainer-{mode}" + (f"-{round(100 * fraction)}" if fraction else "")
        base = {
            "family": f"{family}{'-tiny' if args.tiny else ''} ({LOOP})",
            "loop": LOOP,
            "dtype": "autocast",
            "mode": mode,
            "batch": args.batch,
            "seq": args.seq,
            "cap_bytes": cap,
            "cap_fraction": fraction,
        }
        left = args.deadline_s - (time.monotonic() - started)
        if left < args.min_run_s:
            result = {**base, "skipped": f"out of time ({time.monotonic() - started:.0f} s used)"}
        else:
            command = run_command(args, family, mode)
            if cap is not None:
                command += ["--cap-bytes", str(cap), "--cap-fraction", str(fraction)]
            limit = min(args.teraio_timeout_s if mode == "teraio" else args.timeout_s, left)
            log_path = os.path.join(args.out_dir, label + ".log")
            began = time.monotonic()
            with open(log_path, "w") as log:
                try:
                    code: Optional[int] = subprocess.run(
                        command, stdout=log, stderr=subprocess.STDOUT, timeout=limit
                    ).returncode
                except subprocess.TimeoutExpired:
                    code = None
            found = [json.loads(line[7:]) for line in open(log_path) if line.startswith("RESULT ")]
            if found:
                result = {**base, **found[-1]}
            elif code is None:
                result = {**base, "timeout": True, "error": f"killed after {limit:.0f} s"}
            else:
                result = {
                    **base,
                    "error": f"exit code {code} without a result: {open(log_path).read()[-400:]}",
                }
            result["wall_s"] = round(time.monotonic() - began, 1)
            result["log"] = os.path.basename(log_path)
        with open(results_path, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"[{time.monotonic() - started:5.0f} s] {label}: {bench_regime.brief(result)}", flush=True)
        return result

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
    if args.store_dir:  # the store file the teraio rows shared
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.store_dir, bench_regime.STORE_FILE))
    with open(os.path.join(args.out_dir, "summary.md"), "w") as f:
        with contextlib.redirect_stdout(f):
            summarize.main([results_path, "--reports"])
    summarize.main([results_path])
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--steps", type=int, default=8)
    common.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    common.add_argument("--batch", type=int, default=4)
    common.add_argument("--seq", type=int, default=2048)
    common.add_argument("--optim", default="adamw_torch", help="TrainingArguments(optim=...)")
    common.add_argument("--store-dir", default="", help="where teraio's store file goes (default: temp dir)")
    common.add_argument("--store-gib", type=float, default=32.0)
    common.add_argument("--tiny", action="store_true", help="CPU, 2 small layers (tests of this script)")

    one = commands.add_parser("run", parents=[common], help="one mode in this process")
    one.add_argument("--family", choices=sorted(bench_regime.FAMILIES), required=True)
    one.add_argument("--mode", choices=MODES, required=True)
    one.add_argument("--cap-bytes", type=int, default=0, help="set_per_process_memory_fraction, bytes")
    one.add_argument("--cap-fraction", type=float, default=None, help="the cap's share of the ideal peak")

    many = commands.add_parser("table", parents=[common], help="the whole table, one process per row")
    many.add_argument("--families", default="qwen2,llama")
    many.add_argument("--fractions", default="0.65,0.5", help="caps, as fractions of the ideal peak")
    many.add_argument("--out-dir", required=True)
    many.add_argument("--deadline-s", type=float, default=330.0, help="no row starts after this")
    many.add_argument("--timeout-s", type=float, default=90.0, help="limit per row")
    many.add_argument("--teraio-timeout-s", type=float, default=150.0, help="limit per teraio row")
    many.add_argument("--min-run-s", type=float, default=25.0, help="no row starts with less time left")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    if args.command == "run":
        return run_main(args)
    return table_main(args)


if __name__ == "__main__":
    sys.exit(main())
