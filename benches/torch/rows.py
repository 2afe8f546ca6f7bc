"""What bench_regime.py, bench_loops.py and bench_trainer.py share: one row's run (the cap, the
store, the timed steps, the fields every row has, the `RESULT {json}` line) and the table (rows
one process each under a deadline, OUT/results.jsonl, the printed summary).

Each script keeps what makes it one: its rows' identifying fields (`base`), its loop (the step
function given to `train`, or the Hugging Face Trainer) and the order of its table.
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
from collections.abc import Callable
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import summarize  # noqa: E402  (beside this script)

GIB = 1 << 30
STORE_FILE = "teraio-regime.dev"
#: A `--tiny` row's store: its model is tiny, and 32 GiB would fill a small disk.
TINY_STORE_GIB = 0.25


# -- one row, in its own process ----------------------------------------------------------------


def fields(
    args: argparse.Namespace,
    names: dict[str, Any],
    mode: str,
    cap: Optional[int],
    fraction: Optional[float],
    **after_mode: Any,
) -> dict[str, Any]:
    """The fields that name a row: the script's `names` (its family and dtype), the mode, the
    script's `after_mode`, the batch and the cap."""
    return {
        **names,
        "mode": mode,
        **after_mode,
        "batch": args.batch,
        "seq": args.seq,
        "cap_bytes": cap,
        "cap_fraction": fraction,
    }


def start(
    args: argparse.Namespace, base: dict[str, Any], **extra: Any
) -> tuple[torch.device, dict[str, Any], Optional[int]]:
    """A row's device (`--tiny`: the CPU), its first fields (`base`, the fields that name it,
    then the run's settings) and its cap, set (`set_cap`)."""
    device = torch.device("cpu" if args.tiny else "cuda")
    result = {**base, "steps": args.steps, "warmup": args.warmup, "attention": "sdpa", **extra}
    return device, result, set_cap(args, device)


def make_store(args: argparse.Namespace, scratch: str) -> Any:
    """One store file, as a user makes it: under `--store-dir` it stays for the next row (the
    runtime caches its bandwidth measurement beside it); else in the row's scratch folder."""
    import teraio

    directory = args.store_dir or os.path.join(scratch, "store")
    os.makedirs(directory, exist_ok=True)
    gib = min(args.store_gib, TINY_STORE_GIB) if args.tiny else args.store_gib
    return teraio.Store.create(
        [os.path.join(directory, STORE_FILE)],
        file_size_bytes=int(gib * GIB),
        durable=False,
        force=True,  # a second row reformats the first one's file
    )


def cap_of(args: argparse.Namespace) -> Optional[int]:
    """`--cap-bytes`, None without one."""
    return int(args.cap_bytes) if args.cap_bytes else None


def set_cap(args: argparse.Namespace, device: torch.device) -> Optional[int]:
    """`--cap-bytes` (None without one), set as the CUDA allocator's limit
    (`set_per_process_memory_fraction`); the teraio mode must have one."""
    cap = cap_of(args)
    if args.mode == "teraio" and cap is None:
        raise RuntimeError("teraio mode needs --cap-bytes (the GPU memory it must fit in)")
    if cap is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    return cap


def oom_error(error: BaseException) -> str:
    return "CUDA out of memory: " + str(error).split("\n")[0]


class Steps:
    """Each step's loss, time and (CUDA) allocator peaks."""

    def __init__(self, label: str, device: torch.device) -> None:
        self.label = label
        self.device = device
        self.losses: list[float] = []
        self.step_ms: list[float] = []
        self.peaks: list[tuple[int, int]] = []
        #: The CUDA allocator's retries in each step: each one freed the cache and synchronized
        #: the device, tens of ms where gigabytes are mapped again.
        self.alloc_retries: list[int] = []
        self._retries = self._retries_now()

    def _retries_now(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def reset_peaks(self) -> None:
        """At the first timed step: the peaks are those of the timed steps."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def done(self, step: int, loss: Optional[float], ms: float) -> None:
        """A step has ended: its peak is read here, after the step, because teraio resets the
        allocator's peak when the next iteration starts."""
        if loss is not None:
            self.losses.append(loss)
        self.step_ms.append(ms)
        if self.device.type == "cuda":
            self.peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
            retries = self._retries_now()
            self.alloc_retries.append(retries - self._retries)
            self._retries = retries
        shown = self.losses[-1] if self.losses else float("nan")
        print(f"  [{self.label}] step {step}: loss {shown:.6f} {ms:.0f} ms", flush=True)


def train(
    result: dict[str, Any],
    steps: Steps,
    batches: list[torch.Tensor],
    step: Callable[[torch.Tensor], float],
    outer: Any,
    args: argparse.Namespace,
    label: str,
) -> None:
    """The timed loop: `step(tokens)` trains on one batch and returns its loss as a float (so
    that its time ends once the compute stream is done), inside `outer` (teraio's handle, or
    nothing); the first `--warmup` steps are left out of the peaks. Step `--profile-step` runs
    under torch.profiler: its timeline's summary is printed and its trace written to
    `--trace-dir`/`label`-stepN.json.gz (timeline.profiled). Out of memory is recorded in
    `result`."""
    from timeline import profiled

    warmup = args.warmup
    profile_step = getattr(args, "profile_step", -1)
    trace_path = os.path.join(getattr(args, "trace_dir", "."), f"{label}-step{profile_step}.json")
    index = 0
    try:
        with outer:
            for index, tokens in enumerate(batches):
                if index == warmup:
                    steps.reset_peaks()
                tokens = tokens.to(steps.device, non_blocking=True)
                started = time.perf_counter()
                with profiled(index == profile_step, trace_path):
                    loss = step(tokens)
                steps.done(index, loss, (time.perf_counter() - started) * 1e3)
    except torch.cuda.OutOfMemoryError as error:
        result.update(oom=True, oom_step=index, error=oom_error(error))


def finish(result: dict[str, Any], steps: Steps, warmup: int) -> None:
    """The losses, step times, ms/iter (the median after `warmup`) and peaks into `result`."""
    result["losses"] = steps.losses
    result["step_ms"] = steps.step_ms
    if steps.alloc_retries:
        result["alloc_retries"] = steps.alloc_retries
    timed = steps.step_ms[warmup:]
    if timed and not result.get("oom"):
        result["ms_per_iter"] = statistics.median(timed)
    window = steps.peaks[warmup:] or steps.peaks
    if window:
        result["peak_allocated_bytes"] = max(p[0] for p in window)
        result["peak_reserved_bytes"] = max(p[1] for p in window)


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def add_report(result: dict[str, Any], handle: Any) -> None:
    """The runtime's report (whatever fields this version has) into `result`, and printed."""
    with contextlib.suppress(Exception):  # a report is extra: a failed one must not hide the run
        report = handle.report()
        values = report.as_dict() if hasattr(report, "as_dict") else dict(getattr(report, "__dict__", {}))
        result.update(teraio_report=jsonable(values), teraio_report_text=str(report))
        print(result["teraio_report_text"], flush=True)


def run_main(
    run_in: Callable[[argparse.Namespace, str], dict[str, Any]],
    args: argparse.Namespace,
    base: dict[str, Any],
    name: str,
) -> int:
    """Runs one row, `run_in(args, scratch)`, and prints its `RESULT {json}` line: `base` (the
    fields that name the row), then what the run found, or the error that stopped it. The
    scratch folder (`teraio-NAME-*` in the temp dir) is removed afterwards, whatever stopped the
    run (a store that cannot be made on a full disk included)."""
    scratch = tempfile.mkdtemp(prefix=f"teraio-{name}-")
    try:
        result = run_in(args, scratch)
    except torch.cuda.OutOfMemoryError as error:  # before the first step: model, store, optimizer
        result = {"oom": True, "oom_step": -1, "error": oom_error(error)}
    except Exception as error:  # a row that says what stopped the run
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"[:600]}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("RESULT " + json.dumps({**base, **result}), flush=True)
    return 0


# -- the table ------------------------------------------------------------------------------------


def run_command(script: str, args: argparse.Namespace, family: str, mode: str) -> list[str]:
    """The `run` command of `script` for one row, with the options every script shares."""
    command = [sys.executable, os.path.abspath(script), "run", "--family", family, "--mode", mode]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    command += ["--seq", str(args.seq), "--store-gib", str(args.store_gib)]
    if args.store_dir:
        command += ["--store-dir", args.store_dir]
    if args.tiny:
        command.append("--tiny")
    return command


class Table:
    """Runs the rows one process each, under a deadline, and appends them to results.jsonl."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        os.makedirs(args.out_dir, exist_ok=True)
        self.results_path = os.path.join(args.out_dir, "results.jsonl")
        open(self.results_path, "w").close()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def run(self, label: str, base: dict[str, Any], command: list[str], mode: str) -> dict[str, Any]:
        """Runs `command` (a `run` command) as the row `label`, logged to OUT/label.log, and
        prints its progress line; `base` names the row. Not written: see `write`."""
        args = self.args
        left = args.deadline_s - self.elapsed()
        if left < args.min_run_s:
            result = {
                **base,
                "skipped": f"out of time ({self.elapsed():.0f} s of {args.deadline_s:.0f} used)",
            }
        else:
            cap, fraction = base.get("cap_bytes"), base.get("cap_fraction")
            if cap is not None:
                command = command + ["--cap-bytes", str(cap), "--cap-fraction", str(fraction)]
            log_path = os.path.join(args.out_dir, label + ".log")
            # teraio's warm-up and profiled iterations (offload everything, then profile and
            # plan) take most of its row: it gets its own limit.
            limit = args.teraio_timeout_s if mode == "teraio" else args.timeout_s
            timeout = min(limit, left)
            why = "the row's limit" if timeout == limit else "the table's deadline"
            started = time.monotonic()
            with open(log_path, "w") as log:
                try:
                    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
                    code: Optional[int] = done.returncode
                except subprocess.TimeoutExpired:
                    code = None
            wall = time.monotonic() - started
            found = [json.loads(line[7:]) for line in open(log_path) if line.startswith("RESULT ")]
            if found:
                result = {**base, **found[-1]}
            elif code is None:
                result = {**base, "timeout": True, "error": f"killed after {timeout:.0f} s ({why})"}
            else:
                tail = open(log_path).read()[-400:]
                result = {**base, "error": f"exit code {code} without a result: {tail}"}
            result["wall_s"] = round(wall, 1)
            result["log"] = os.path.basename(log_path)
        self.progress(label, result)
        return result

    def progress(self, label: str, result: dict[str, Any]) -> None:
        print(f"[{self.elapsed():5.0f} s] {label}: {brief(result)}", flush=True)

    def write(self, result: dict[str, Any]) -> dict[str, Any]:
        """One line of results.jsonl."""
        with open(self.results_path, "a") as f:
            f.write(json.dumps(result) + "\n")
        return result

    def finish(self) -> int:
        """Removes the store file the teraio rows shared under `--store-dir` (32 GiB of the disk),
        writes OUT/summary.md (with the teraio reports) and prints the table (summarize.py)."""
        if self.args.store_dir:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.args.store_dir, STORE_FILE))
        with open(os.path.join(self.args.out_dir, "summary.md"), "w") as f:
            with contextlib.redirect_stdout(f):
                summarize.main([self.results_path, "--reports"])
        summarize.main([self.results_path])
        return 0


def brief(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return "skipped: " + result["skipped"]
    if result.get("oom_at_larger_cap"):
        return f"not run: out of memory at {100 * result['oom_at_larger_cap']:.0f}% already"
    if result.get("oom"):
        return f"OUT OF MEMORY at step {result.get('oom_step')}"
    if "ms_per_iter" not in result:
        return "failed: " + str(result.get("error", "?"))[:200]
    peak = result.get("peak_allocated_bytes")
    text = f"{result['ms_per_iter']:.0f} ms/iter"
    if peak:
        text += f", peak {peak / GIB:.1f} GiB"
    if "peak_estimate_bytes" in result:
        text += f", peak estimate {result['peak_estimate_bytes'] / 2**20:.0f} MiB"
    return text + f" ({result.get('wall_s', 0):.0f} s)"


# -- the command line -----------------------------------------------------------------------------


def parsers(
    doc: str, common: argparse.ArgumentParser, families: list[str], modes: list[str], run_help: str
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The script's parser with its `run` and `table` commands; `common` (from
    `common_arguments`, with the script's own options added) goes to both. Returns
    (parser, run, table) for the script to add its own options to."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", parents=[common], help=run_help)
    one.add_argument("--family", choices=sorted(families), required=True)
    one.add_argument("--mode", choices=modes, required=True)
    one.add_argument("--cap-bytes", type=int, default=0, help="set_per_process_memory_fraction, bytes")
    one.add_argument("--cap-fraction", type=float, default=None, help="the cap's share of the ideal peak")
    one.add_argument(
        "--profile-step",
        type=int,
        default=-1,
        help="record this step with torch.profiler: a summary in the output, the trace in --trace-dir",
    )
    one.add_argument("--trace-dir", default=".", help="where --profile-step's trace goes")
    many = commands.add_parser("table", parents=[common], help="the whole table, one process per row")
    return parser, one, many


def common_arguments(batch_help: Optional[str] = None) -> argparse.ArgumentParser:
    """The options of both commands every script has."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--steps", type=int, default=8)
    common.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    common.add_argument("--batch", type=int, default=4, help=batch_help)
    common.add_argument("--seq", type=int, default=2048)
    common.add_argument("--store-dir", default="", help="where teraio's store file goes (default: temp dir)")
    common.add_argument("--store-gib", type=float, default=32.0)
    common.add_argument("--tiny", action="store_true", help="CPU, 2 small layers (tests of this script)")
    return common


def table_arguments(
    many: argparse.ArgumentParser, families: str, deadline_s: float, timeout_s: float, teraio_timeout_s: float
) -> None:
    """The `table` options every script has, with its defaults."""
    many.add_argument("--families", default=families)
    many.add_argument("--fractions", default="0.65,0.5", help="caps, as fractions of the ideal peak")
    many.add_argument("--out-dir", required=True)
    many.add_argument("--deadline-s", type=float, default=deadline_s, help="no row starts after this")
    many.add_argument("--timeout-s", type=float, default=timeout_s, help="limit per row")
    many.add_argument("--teraio-timeout-s", type=float, default=teraio_timeout_s, help="limit per teraio row")
    many.add_argument("--min-run-s", type=float, default=25.0, help="no row starts with less time left")


def main(
    parser: argparse.ArgumentParser,
    argv: Optional[list[str]],
    name: str,
    run_in: Callable[[argparse.Namespace, str], dict[str, Any]],
    row_base: Callable[[argparse.Namespace], dict[str, Any]],
    table_main: Callable[[argparse.Namespace], int],
    check_run: Optional[Callable[[argparse.Namespace], Optional[str]]] = None,
) -> int:
    """Parses the command line and runs its command: one row (`run_main`) or the table.
    `check_run` says what is wrong with a `run` command's arguments, if anything."""
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    if args.command != "run":
        return table_main(args)
    problem = check_run(args) if check_run is not None else None
    if problem:
        parser.error(problem)
    return run_main(run_in, args, row_base(args), name)


def split(text: str) -> list[str]:
    """A comma-separated option as a list, empty items left out."""
    return [item for item in text.split(",") if item]
