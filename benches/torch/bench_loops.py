"""Training loops as users write them (issue 43): gradient accumulation and LoRA under a cap.

The models, batches, store and report come from bench_regime.py (transformers configs, random
init, fixed seed, SDPA, bf16 autocast over fp32 weights). Each step runs `--accum` micro-batches
of the batch (`(loss / accum).backward()` each), `clip_grad_norm_(..., 1.0)`, the step and
`zero_grad`: the loop as users write it.

Rows, per family (`--families`, default qwen2,llama):

    ideal      the full batch in one pass, no offload, no cap: the peak the caps are shares of
    teraio     teraio.offload(model, optimizer, store=store, gpu_memory=cap): default arguments,
               with accumulation 2 and 4 (same total batch)
    hf_ckpt    model.gradient_checkpointing_enable(use_reentrant=False), the same accumulation

at each `--fractions` share of the ideal peak (65% and 50%). With `--lora`, the Llama-3.2-3B
shape through `peft` (rank 16, alpha 32, every linear layer of the decoder): LoRA without a cap,
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
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from functools import partial
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import baselines  # noqa: E402  (beside this script)
import bench_regime as regime  # noqa: E402
import summarize  # noqa: E402

MODES = ["ideal", "teraio", "hf_ckpt"]
LORA_FAMILY = "llama3b"
LORA_RANK = 16
TINY_STORE_GIB = 0.25


def lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """The model with LoRA adapters on every linear layer of the decoder (peft's "all-linear":
    the output head left out); the base weights frozen."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        # The CPU smoke run's model is tiny: so is its store (32 GiB would fill a small disk).
        args.store_gib = min(args.store_gib, TINY_STORE_GIB)
    result: dict[str, Any] = {
        "model_family": args.family + ("-tiny" if args.tiny else ""),
        "dtype": "autocast",
        "mode": args.mode,
        "accum": args.accum,
        "lora_rank": args.lora_rank,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "attention": "sdpa",
        "clip": args.clip,
    }
    if args.batch % args.accum:
        raise ValueError(f"--batch {args.batch} is not a multiple of --accum {args.accum}")
    cap = int(args.cap_bytes) if args.cap_bytes else None
    if cap is not None:
        result["cap_bytes"] = cap
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    if args.mode == "teraio" and cap is None:
        raise RuntimeError("teraio mode needs --cap-bytes (the GPU memory it must fit in)")
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
    store_dir = None
    if args.mode == "teraio":
        import teraio

        store, store_dir = regime.make_store(args)
        result["arguments"] = "defaults"
        outer = teraio.offload(model, optimizer, store=store, gpu_memory=cap)
        handle = outer
    # A CPU "device" has no allocator to ask: the ideal row's peak is estimated (bench_regime).
    saved = regime.SavedBytes(model) if args.mode == "ideal" and device.type != "cuda" else None
    forward_context = saved.context if saved is not None else contextlib.nullcontext
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16)
    losses: list[float] = []
    times_ms: list[float] = []
    peaks: list[tuple[int, int]] = []
    step = 0
    try:
        with outer:
            for step, tokens in enumerate(batches):
                if step == args.warmup and device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                tokens = tokens.to(device, non_blocking=True)
                started = time.perf_counter()
                total = 0.0
                for part in tokens.chunk(args.accum):
                    with forward_context(), autocast():
                        loss = model(input_ids=part, labels=part).loss / args.accum
                    loss.backward()
                    total += loss.item()
                if args.clip:
                    torch.nn.utils.clip_grad_norm_(trained, args.clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(total)
                times_ms.append((time.perf_counter() - started) * 1e3)
                if device.type == "cuda":
                    peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
                print(
                    f"  [{args.family} {args.mode} accum {args.accum}] step {step}: "
                    f"loss {losses[-1]:.6f} {times_ms[-1]:.0f} ms",
                    flush=True,
                )
    except torch.cuda.OutOfMemoryError as error:
        result.update(oom=True, oom_step=step, error="CUDA out of memory: " + str(error).split("\n")[0])
    finally:
        if store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)
    result["losses"] = losses
    result["step_ms"] = times_ms
    timed = times_ms[args.warmup :]
    if timed and not result.get("oom"):
        result["ms_per_iter"] = statistics.median(timed)
    window = peaks[args.warmup :] or peaks
    if window:
        result["peak_allocated_bytes"] = max(p[0] for p in window)
        result["peak_reserved_bytes"] = max(p[1] for p in window)
    if saved is not None:
        result["peak_estimate_bytes"] = regime.model_state_bytes(model) + sum(saved.seen.values())
    if handle is not None:
        with contextlib.suppress(Exception):  # a report is extra: a failed one must not hide the run
            result.update(regime.teraio_report(handle))
            print(result["teraio_report_text"], flush=True)
    return result


def run_main(args: argparse.Namespace) -> int:
    try:
        result = run(args)
    except torch.cuda.OutOfMemoryError as error:  # before the first step: model, store, optimizer
        result = {"oom": True, "oom_step": -1, "error": "CUDA out of memory: " + str(error).split("\n")[0]}
    except Exception as error:  # a row that says what stopped the run
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"[:600]}
    base = {
        "model_family": args.family + ("-tiny" if args.tiny else ""),
        "dtype": "autocast",
        "mode": args.mode,
        "accum": args.accum,
        "lora_rank": args.lora_rank,
        "batch": args.batch,
        "seq": args.seq,
        "cap_bytes": int(args.cap_bytes) if args.cap_bytes else None,
        "cap_fraction": args.cap_fraction,
    }
    print("RESULT " + json.dumps({**base, **result}), flush=True)
    return 0


# -- the table --------------------------------------------------------------------------------


class Table:
    """The rows, one process each, under a deadline; appended to OUT/results.jsonl."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        os.makedirs(args.out_dir, exist_ok=True)
        self.results_path = os.path.join(args.out_dir, "results.jsonl")
        open(self.results_path, "w").close()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

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
        base = {
            "model_family": family + ("-tiny" if args.tiny else ""),
            "dtype": "autocast",
            "mode": mode,
            "accum": accum,
            "lora_rank": lora_rank,
            "batch": args.batch,
            "seq": args.seq,
            "cap_bytes": cap,
            "cap_fraction": fraction,
        }
        left = args.deadline_s - self.elapsed()
        if left < args.min_run_s:
            result = {
                **base,
                "skipped": f"out of time ({self.elapsed():.0f} s of {args.deadline_s:.0f} used)",
            }
        else:
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "run",
                "--family",
                family,
                "--mode",
                mode,
                "--accum",
                str(accum),
                "--lora-rank",
                str(lora_rank),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--clip",
                str(args.clip),
                "--store-gib",
                str(args.store_gib),
            ]
            if args.store_dir:
                command += ["--store-dir", args.store_dir]
            if args.tiny:
                command.append("--tiny")
            if cap is not None:
                command += ["--cap-bytes", str(cap), "--cap-fraction", str(fraction)]
            log_path = os.path.join(args.out_dir, label + ".log")
            limit = args.teraio_timeout_s if mode == "teraio" else args.timeout_s
            timeout = min(limit, left)
            started = time.monotonic()
            with open(log_path, "w") as log:
                try:
                    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
                    code: Optional[int] = done.returncode
                except subprocess.TimeoutExpired:
                    code = None
            found = [json.loads(line[7:]) for line in open(log_path) if line.startswith("RESULT ")]
            if found:
                result = {**base, **found[-1]}
            elif code is None:
                result = {**base, "timeout": True, "error": f"killed after {timeout:.0f} s"}
            else:
                result = {
                    **base,
                    "error": f"exit code {code} without a result: {open(log_path).read()[-400:]}",
                }
            result["wall_s"] = round(time.monotonic() - started, 1)
            result["log"] = os.path.basename(log_path)
        print(f"[{self.elapsed():5.0f} s] {label}: {regime.brief(result)}", flush=True)
        return result

    def record(self, result: dict[str, Any], group: str) -> None:
        """One line of results.jsonl; `group` is its table's title (summarize.py's `family`)."""
        with open(self.results_path, "a") as f:
            f.write(json.dumps({**result, "family": group}) + "\n")


def peak_of(result: dict[str, Any]) -> Optional[int]:
    return result.get("peak_allocated_bytes") or result.get("peak_estimate_bytes")


def table_main(args: argparse.Namespace) -> int:
    families = [f for f in args.families.split(",") if f]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    accums = [int(a) for a in args.accums.split(",") if a]
    for name in families + ([LORA_FAMILY] if args.lora else []):
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
        group = f"{LORA_FAMILY} lora r{LORA_RANK}"
        ideal = table.row(LORA_FAMILY, "ideal", 1, LORA_RANK)
        table.record(ideal, group)
        peak = peak_of(ideal)
        if peak:
            for fraction in fractions:
                for mode in ("teraio", "hf_ckpt"):
                    table.record(table.row(LORA_FAMILY, mode, 1, LORA_RANK, peak, fraction), group)
    if args.store_dir:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.store_dir, regime.STORE_FILE))
    with open(os.path.join(args.out_dir, "summary.md"), "w") as f:
        with contextlib.redirect_stdout(f):
            summarize.main([table.results_path, "--reports"])
    summarize.main([table.results_path])
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--steps", type=int, default=8)
    common.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    common.add_argument("--batch", type=int, default=4, help="the total batch of a step")
    common.add_argument("--seq", type=int, default=2048)
    common.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_'s max norm (0: no clipping)")
    common.add_argument("--store-dir", default="", help="where teraio's store file goes (default: temp dir)")
    common.add_argument("--store-gib", type=float, default=32.0)
    common.add_argument("--tiny", action="store_true", help="CPU, 2 small layers (tests of this script)")

    one = commands.add_parser("run", parents=[common], help="one row in this process")
    one.add_argument("--family", choices=sorted(regime.FAMILIES), required=True)
    one.add_argument("--mode", choices=MODES, required=True)
    one.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    one.add_argument("--lora-rank", type=int, default=0, help="LoRA through peft at this rank (0: none)")
    one.add_argument("--cap-bytes", type=int, default=0, help="set_per_process_memory_fraction, bytes")
    one.add_argument("--cap-fraction", type=float, default=None, help="the cap's share of the ideal peak")

    many = commands.add_parser("table", parents=[common], help="the whole table, one process per row")
    many.add_argument("--families", default="qwen2,llama")
    many.add_argument("--fractions", default="0.65,0.5", help="caps, as fractions of the ideal peak")
    many.add_argument("--accums", default="2,4", help="micro-batches per step, each a row per mode")
    many.add_argument("--lora", action="store_true", help=f"the LoRA rows ({LORA_FAMILY}, rank {LORA_RANK})")
    many.add_argument("--out-dir", required=True)
    many.add_argument("--deadline-s", type=float, default=420.0, help="no row starts after this")
    many.add_argument("--timeout-s", type=float, default=120.0, help="limit per row")
    many.add_argument("--teraio-timeout-s", type=float, default=200.0, help="limit per teraio row")
    many.add_argument("--min-run-s", type=float, default=25.0, help="no row starts with less time left")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    if args.command == "run":
        if args.accum < 1 or args.batch % args.accum:
            parser.error(f"--accum {args.accum} must divide --batch {args.batch}")
        return run_main(args)
    return table_main(args)


if __name__ == "__main__":
    sys.exit(main())
