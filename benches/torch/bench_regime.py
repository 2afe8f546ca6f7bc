"""Training as users train: teraio against activation checkpointing and the offloaders at a cap.

Models from transformers configs (random init, fixed seed: nothing is downloaded) with their real
vocabularies, SDPA attention, AdamW, and either bf16 autocast over fp32 master weights
(`--dtype autocast`, the default) or pure bf16 weights (`--dtype bf16`):

    llama    Llama-3.2-1B shape: vocab 128256, tied embeddings, hidden 2048, 16 layers, GQA 32/8
    llama3b  Llama-3.2-3B shape: vocab 128256, tied embeddings, hidden 3072, 28 layers, GQA 24/8
             (the capacity benchmark's larger model: 3.2B parameters, 51 GB of training state)
    qwen2    Qwen2-1.5B shape: vocab 151936, tied embeddings, hidden 1536, 28 layers, GQA 12/2
    mistral  Mistral-7B-v0.3 vocabulary (32768) and layout, scaled to hidden 2048 and 20 layers
    neox     Pythia-1.4B shape (GPT-NeoX): vocab 50304, hidden 2048, 24 layers

Modes (what a user already has, and teraio as a user writes it):

    ideal        no offload, no checkpointing, no cap
    teraio       teraio.offload(model, optimizer, store=store, gpu_memory=cap): default arguments
    hf_ckpt      model.gradient_checkpointing_enable(use_reentrant=False): every decoder layer
    sac          torch's selective activation checkpointing per decoder layer: matmul and
                 attention outputs saved, everything else (norms, rotary, activations,
                 elementwise) recomputed (`sac_policy`)
    save_on_cpu  torch.autograd.graph.save_on_cpu(pin_memory=True)
    torchtune    torchtune.training.OffloadActivations (0.6.1; streams and pinned memory on)

Two commands. `run` trains one mode in this process and prints one `RESULT {json}` line (an
out-of-memory error is a row with "oom": true, not a crash):

    python3 benches/torch/bench_regime.py run --family qwen2 --mode ideal
    python3 benches/torch/bench_regime.py run --family qwen2 --mode teraio --cap-bytes 41600000000

`table` makes the whole table in one call: per family, `ideal` twice (its run-to-run spread is
the yardstick for loss agreement), then every mode at each cap (fractions of the first ideal
run's peak allocated memory, `torch.cuda.set_per_process_memory_fraction`), each in its own
process under a time limit; rows go to OUT/results.jsonl and the table is printed
(summarize.py). Rows that do not fit the deadline are recorded as skipped.

    python3 benches/torch/bench_regime.py table --families llama,qwen2 --out-dir /tmp/regime
    python3 benches/torch/bench_regime.py table --tiny --out-dir /tmp/regime-cpu   # CPU, tiny

ms/iter is the median of the steps after the warm-up ones (each step ends at `loss.item()`, which
waits for the compute stream); peaks are the CUDA allocator's over those steps.
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
from functools import partial
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STORE_FILE = "teraio-regime.dev"
sys.path.insert(0, HERE)
import baselines  # noqa: E402  (beside this script)
import summarize  # noqa: E402

GIB = 1 << 30
MODES = ["ideal", "teraio", "hf_ckpt", "sac", "save_on_cpu", "torchtune"]

#: family -> (transformers config class, model class, config arguments). Rope and norm settings
#: are left at the classes' defaults: they change neither memory nor time.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
    "llama3b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128256,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            use_sliding_window=False,
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            vocab_size=32768,
            hidden_size=2048,
            intermediate_size=7168,
            num_hidden_layers=20,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
            max_position_embeddings=32768,
            # A sliding window would make SDPA take an explicit mask (no flash kernel); at 2048
            # tokens it would not change the result.
            sliding_window=None,
        ),
    ),
    "neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=24,
            num_attention_heads=16,
            tie_word_embeddings=False,
            max_position_embeddings=2048,
        ),
    ),
}

#: `--tiny` (CPU tests of this script): two small layers and a small vocabulary (bf16 matmuls
#: with a real one take seconds per step on a CPU).
TINY = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)


def build_model(family: str, dtype: str, device: torch.device, tiny: bool, seed: int = 0) -> torch.nn.Module:
    import transformers

    config_name, model_name, kwargs = FAMILIES[family]
    kwargs = dict(kwargs)
    if tiny:
        kwargs.update(TINY)
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = 2
        if "head_dim" in kwargs:
            kwargs["head_dim"] = 16
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(seed)
    with device:
        model = getattr(transformers, model_name)(config)
    if dtype == "bf16":
        model.to(torch.bfloat16)
    model.train()
    return model


def make_batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(steps)]


class SavedBytes:
    """Bytes autograd saves in one forward pass (distinct storages, parameters left out): with the
    model state, an estimate of the peak where the allocator cannot tell (a CPU device)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def context(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def model_state_bytes(model: torch.nn.Module) -> int:
    """Parameters, their gradients and AdamW's two moments."""
    return sum(4 * p.numel() * p.element_size() for p in model.parameters())


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def teraio_report(handle: Any) -> dict[str, Any]:
    """The runtime's report, whatever fields this version has."""
    report = handle.report()
    fields = report.as_dict() if hasattr(report, "as_dict") else dict(getattr(report, "__dict__", {}))
    return {"teraio_report": jsonable(fields), "teraio_report_text": str(report)}


def make_store(args: argparse.Namespace) -> tuple[Any, Optional[str]]:
    """One store file, as a user makes it: under `--store-dir` it stays for the next run (the
    runtime caches its bandwidth measurement beside it); else in a temp dir removed afterwards."""
    import teraio

    if args.store_dir:
        os.makedirs(args.store_dir, exist_ok=True)
        directory, removed = args.store_dir, None
    else:
        directory = tempfile.mkdtemp(prefix="teraio-regime-")
        removed = directory
    store = teraio.Store.create(
        [os.path.join(directory, STORE_FILE)],
        file_size_bytes=int(args.store_gib * GIB),
        durable=False,
        force=True,  # a second run reformats the first one's file
    )
    return store, removed


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.tiny else "cuda")
    result: dict[str, Any] = {
        "family": args.family + ("-tiny" if args.tiny else ""),
        "dtype": args.dtype,
        "mode": args.mode,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
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
    if args.mode == "torchtune" and device.type != "cuda":
        raise RuntimeError("torchtune's OffloadActivations needs CUDA (it makes CUDA streams)")
    if args.mode == "teraio" and cap is None:
        raise RuntimeError("teraio mode needs --cap-bytes (the GPU memory it must fit in)")
    model = build_model(args.family, args.dtype, device, args.tiny)
    vocab = model.config.vocab_size
    result["params"] = sum(p.numel() for p in model.parameters())
    result["vocab"] = vocab
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(args.steps, args.batch, args.seq, vocab)

    forward_context: Callable[[], Any] = contextlib.nullcontext
    outer: Any = contextlib.nullcontext()
    handle = None
    store_dir = None
    saved: Optional[SavedBytes] = None
    if args.mode == "ideal" and device.type != "cuda":
        saved = SavedBytes(model)
        forward_context = saved.context
    elif args.mode == "hf_ckpt":
        baselines.enable_hf_checkpointing(model)
    elif args.mode == "sac":
        baselines.enable_selective_checkpointing(model)
    elif args.mode == "save_on_cpu":

        def forward_context() -> Any:
            return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")

    elif args.mode == "torchtune":
        offloader = baselines.load_torchtune_offloader()

        def forward_context() -> Any:
            return offloader(use_pin_memory=True, use_streams=True)

    elif args.mode == "teraio":
        import teraio

        store, store_dir = make_store(args)
        # As a user writes it: the store and the memory to fit in, nothing tuned (or whole-model
        # mode forced, to compare with what the default chooses).
        result["arguments"] = (
            "defaults" if args.whole_model == "auto" else f"whole_model={args.whole_model!r}"
        )
        outer = teraio.offload(model, optimizer, store=store, gpu_memory=cap, whole_model=args.whole_model)
        handle = outer

    autocast: Callable[[], Any] = contextlib.nullcontext
    if args.dtype == "autocast":
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
                with forward_context(), autocast():
                    loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                times_ms.append((time.perf_counter() - started) * 1e3)
                if device.type == "cuda":
                    # After the step: teraio resets the allocator's peak when the next iteration
                    # starts, so each step's peak is read here.
                    peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
                print(
                    f"  [{result['family']} {args.dtype} {args.mode}] step {step}: "
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
    if args.mode in ("hf_ckpt", "sac"):
        result["checkpointed_layers"] = baselines.checkpointed_layers(model)
    if args.mode == "sac":
        result["sac_decisions"] = dict(baselines.SAC_DECISIONS)
    if saved is not None:
        result["peak_estimate_bytes"] = model_state_bytes(model) + sum(saved.seen.values())
    if handle is not None:
        with contextlib.suppress(Exception):  # a report is extra: a failed one must not hide the run
            result.update(teraio_report(handle))
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
        "family": args.family + ("-tiny" if args.tiny else ""),
        "dtype": args.dtype,
        "mode": args.mode,
        "batch": args.batch,
        "seq": args.seq,
        "cap_bytes": int(args.cap_bytes) if args.cap_bytes else None,
        "cap_fraction": args.cap_fraction,
    }
    print("RESULT " + json.dumps({**base, **result}), flush=True)
    return 0


# -- the table --------------------------------------------------------------------------------


def run_args(args: argparse.Namespace, family: str, mode: str) -> list[str]:
    out = [
        sys.executable,
        os.path.abspath(__file__),
        "run",
        "--family",
        family,
        "--mode",
        mode,
        "--dtype",
        args.dtype,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--store-gib",
        str(args.store_gib),
    ]
    if args.store_dir:
        out += ["--store-dir", args.store_dir]
    if args.tiny:
        out.append("--tiny")
    return out


class Table:
    """Runs the rows one process each, under a deadline, and appends them to results.jsonl."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        os.makedirs(args.out_dir, exist_ok=True)
        self.results_path = os.path.join(args.out_dir, "results.jsonl")
        open(self.results_path, "w").close()
        #: (family, mode) -> the largest cap fraction at which it ran out of memory.
        self.oom_at: dict[tuple[str, str], float] = {}

    def capped(
        self,
        family: str,
        mode: str,
        ideal_peak: int,
        fraction: float,
        extra: tuple[str, ...] = (),
        tag: str = "",
    ) -> dict[str, Any]:
        """A row at `fraction` of the ideal peak. A baseline that ran out of memory at a larger
        cap is not run again at a smaller one (teraio always is)."""
        cap = int(fraction * ideal_peak)
        larger = self.oom_at.get((family, mode))
        if mode != "teraio" and larger is not None and larger > fraction:
            return self.record(
                f"{family}-{self.args.dtype}-{mode}-{round(100 * fraction)}",
                {**self.base(family, mode, cap, fraction), "oom": True, "oom_at_larger_cap": larger},
            )
        result = self.row(family, mode, cap, fraction, tag=tag, extra=extra)
        if result.get("oom"):
            self.oom_at[(family, mode)] = max(fraction, self.oom_at.get((family, mode), 0.0))
        return result

    def base(self, family: str, mode: str, cap: Optional[int], fraction: Optional[float]) -> dict[str, Any]:
        args = self.args
        return {
            "family": family + ("-tiny" if args.tiny else ""),
            "dtype": args.dtype,
            "mode": mode,
            "batch": args.batch,
            "seq": args.seq,
            "cap_bytes": cap,
            "cap_fraction": fraction,
        }

    def record(self, label: str, result: dict[str, Any]) -> dict[str, Any]:
        with open(self.results_path, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"[{self.elapsed():5.0f} s] {label}: {brief(result)}", flush=True)
        return result

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def row(
        self,
        family: str,
        mode: str,
        cap: Optional[int] = None,
        fraction: Optional[float] = None,
        tag: str = "",
        extra: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        args = self.args
        label = f"{family}-{args.dtype}-{mode}" + (f"-{round(100 * fraction)}" if fraction else "") + tag
        base = self.base(family, mode, cap, fraction)
        left = args.deadline_s - self.elapsed()
        if left < args.min_run_s:
            result = {
                **base,
                "skipped": f"out of time ({self.elapsed():.0f} s of {args.deadline_s:.0f} used)",
            }
        else:
            command = run_args(args, family, mode) + list(extra)
            if cap is not None:
                command += ["--cap-bytes", str(cap), "--cap-fraction", str(fraction)]
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
        return self.record(label, result)


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


def table_main(args: argparse.Namespace) -> int:
    families = [f for f in args.families.split(",") if f]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    modes = [m for m in args.modes.split(",") if m]
    late = [m for m in args.late_modes.split(",") if m in modes]
    whole_at = {float(f) for f in args.whole_model_at.split(",") if f}
    for name in families:
        if name not in FAMILIES:
            raise SystemExit(f"unknown family {name!r}: one of {', '.join(FAMILIES)}")
    for mode in modes:
        if mode not in MODES or mode == "ideal":
            raise SystemExit(f"unknown mode {mode!r} for the capped rows: one of {', '.join(MODES[1:])}")
    table = Table(args)
    caps: dict[str, int] = {}
    # Every family's ideal runs and first modes come before the slow offloaders (`--late-modes`),
    # so that a deadline cuts the rows that matter least.
    for family in families:
        peaks = []
        for i in range(args.ideal_runs):
            r = table.row(family, "ideal", tag=f"-{i + 1}")
            peaks.append(r.get("peak_allocated_bytes") or r.get("peak_estimate_bytes"))
        if peaks and peaks[0]:
            caps[family] = peaks[0]
        else:
            print(f"== {family}: the first ideal run gave no peak, so no capped rows", flush=True)
            continue
        for fraction in fractions:
            for mode in modes:
                if mode not in late:
                    table.capped(family, mode, caps[family], fraction)
            if fraction in whole_at:
                table.capped(
                    family, "teraio", caps[family], fraction, ("--whole-model", "on"), "-whole-model"
                )
    for family in families:
        if family not in caps:
            continue
        for fraction in fractions:
            for mode in late:
                table.capped(family, mode, caps[family], fraction)
    if args.store_dir:  # the store file the teraio rows shared (32 GiB of the disk)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.store_dir, STORE_FILE))
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
    common.add_argument(
        "--dtype",
        choices=["autocast", "bf16"],
        default="autocast",
        help="bf16 autocast over fp32 weights, or bf16 weights",
    )
    common.add_argument("--steps", type=int, default=8)
    common.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    common.add_argument("--batch", type=int, default=4)
    common.add_argument("--seq", type=int, default=2048)
    common.add_argument("--store-dir", default="", help="where teraio's store file goes (default: temp dir)")
    common.add_argument("--store-gib", type=float, default=32.0)
    common.add_argument("--tiny", action="store_true", help="CPU, 2 small layers (tests of this script)")

    one = commands.add_parser("run", parents=[common], help="one mode in this process")
    one.add_argument("--family", choices=sorted(FAMILIES), required=True)
    one.add_argument("--mode", choices=MODES, required=True)
    one.add_argument("--cap-bytes", type=int, default=0, help="set_per_process_memory_fraction, bytes")
    one.add_argument("--cap-fraction", type=float, default=None, help="the cap's share of the ideal peak")
    one.add_argument(
        "--whole-model", choices=("auto", "on", "off"), default="auto", help="teraio mode's option"
    )

    many = commands.add_parser("table", parents=[common], help="the whole table, one process per row")
    many.add_argument("--families", default="llama,qwen2")
    many.add_argument("--fractions", default="0.65,0.5", help="caps, as fractions of the ideal peak")
    many.add_argument("--modes", default="teraio,hf_ckpt,sac,save_on_cpu,torchtune")
    many.add_argument(
        "--late-modes",
        default="save_on_cpu,torchtune",
        help="modes run after every family's other rows (slow: they pin all activations)",
    )
    many.add_argument("--ideal-runs", type=int, default=2)
    many.add_argument(
        "--whole-model-at", default="", help="fractions with one more teraio row, whole_model='on'"
    )
    many.add_argument("--out-dir", required=True)
    many.add_argument("--deadline-s", type=float, default=480.0, help="no row starts after this")
    many.add_argument("--timeout-s", type=float, default=120.0, help="limit per row")
    many.add_argument("--teraio-timeout-s", type=float, default=240.0, help="limit per teraio row")
    many.add_argument("--min-run-s", type=float, default=25.0, help="no row starts with less time left")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    if args.command == "run":
        return run_main(args)
    return table_main(args)


if __name__ == "__main__":
    sys.exit(main())
