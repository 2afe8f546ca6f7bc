"""Where one step of the plain loop goes, with teraio and without: GPU kernel time by phase and kind.

`run` trains bench_regime.py's model (bf16 autocast, SDPA, AdamW, batch 4 x 2048) in the plain
loop (forward with labels, backward, step, zero_grad), without teraio (`--mode ideal`) or under
`teraio.offload` with default arguments at `--cap-bytes` (`--mode teraio`), prints each step's
time and peak, records step `--profile-step` with torch.profiler (`timeline.profiled`: the
gzipped chrome trace in `--out-dir`, and its summary); then teraio's report and the median step
after the first four:

    python3 benches/torch/profile_loop.py run --family llama --mode ideal --steps 10 --profile-step 8
    python3 benches/torch/profile_loop.py run --family llama --mode teraio --cap-bytes 30598567168 \\
        --steps 16 --profile-step 14

`compare` prints, for each trace side by side, the compute stream's kernel time per phase
(forward, backward, step: the host range that launched each kernel) and kind of kernel (matrix
products, attention, softmax, copies and casts, other elementwise, reductions, foreach), the copy
streams' time, and the kernels whose time differs most between the first two traces:

    python3 benches/torch/profile_loop.py compare /tmp/trace-llama-ideal-0.json.gz \\
        /tmp/trace-llama-teraio-30598567168.json.gz
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("forward", "backward", "step")


def kernel_kind(name: str) -> str:
    """A kernel's kind, from its name."""
    lowered = name.lower()
    for kind, marks in (
        ("attention", ("flash", "fmha", "attention", "sdpa")),
        ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90")),
        ("foreach", ("multi_tensor",)),
        ("softmax", ("softmax",)),
        ("reduce", ("reduce",)),
        ("copy", ("copy", "cast")),
        ("elementwise", ("elementwise", "vectorized", "unrolled")),
    ):
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def kernel_times(path: str) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """From a chrome trace of `run`: ms per (phase, kind) and per (phase, kernel name); copies on
    other streams count as (phase, "copy stream N")."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as handle:
        events = json.load(handle)["traceEvents"]
    phases = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in PHASES]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "correlation" in e.get("args", {})
    }
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    streams = collections.Counter(e["args"].get("stream") for e in gpu if e["cat"] == "kernel")
    compute = streams.most_common(1)[0][0]
    by_kind: dict[tuple[str, str], float] = collections.defaultdict(float)
    by_name: dict[tuple[str, str], float] = collections.defaultdict(float)
    for event in gpu:
        launch = launches.get(event["args"].get("correlation"))
        at = launch["ts"] if launch else event["ts"]
        phase = next((p["name"] for p in phases if p["ts"] <= at <= p["ts"] + p["dur"]), "before")
        stream = event["args"].get("stream")
        if stream != compute:
            kind = f"copy stream {stream}"
        else:
            kind = kernel_kind(event["name"]) if event["cat"] == "kernel" else event["cat"]
        by_kind[(phase, kind)] += event["dur"] / 1e3
        if event["cat"] == "kernel":
            by_name[(phase, event["name"][:90])] += event["dur"] / 1e3
    return by_kind, by_name


def compare_main(args: argparse.Namespace) -> int:
    tables = [kernel_times(path) for path in args.traces]
    names = [os.path.basename(path).replace(".json.gz", "") for path in args.traces]
    width = max(12, *(len(n) for n in names))
    print(f"{'phase, kind':34s}" + "".join(f"{n:>{width + 2}s}" for n in names))
    keys = sorted(set().union(*(set(kinds) for kinds, _ in tables)))
    for key in keys:
        print(
            f"{key[0] + ', ' + key[1]:34s}" + "".join(f"{k.get(key, 0.0):{width + 2}.2f}" for k, _ in tables)
        )
    totals = [
        sum(v for (_, kind), v in kinds.items() if not kind.startswith("copy stream")) for kinds, _ in tables
    ]
    print(f"{'compute stream, all':34s}" + "".join(f"{t:{width + 2}.2f}" for t in totals))
    if len(tables) >= 2:
        first, second = tables[0][1], tables[1][1]
        changes = [(second.get(k, 0.0) - first.get(k, 0.0), k) for k in set(first) | set(second)]
        more = sorted((c for c in changes if c[0] > 0), reverse=True)[: args.top]
        less = sorted(c for c in changes if c[0] < 0)[: args.top]
        print(f"kernels that differ most, {names[0]} -> {names[1]} (ms):")
        for delta, (phase, name) in more + less:
            print(f"  {delta:+8.2f}  {phase:8s} {name}")
    return 0


def run_main(args: argparse.Namespace) -> int:
    import torch

    sys.path.insert(0, HERE)
    import teraio

    from bench_regime import build_model, make_batches
    from rows import set_cap
    from timeline import profiled

    device = torch.device("cuda")
    set_cap(args, device)
    model = build_model(args.family, "autocast", device, tiny=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(args.steps, args.batch, args.seq, model.config.vocab_size)
    directory = tempfile.mkdtemp(prefix="teraio-profile-", dir=args.store_dir or None)
    store: Optional[Any] = None
    session: Any = contextlib.nullcontext()
    if args.mode == "teraio":
        store = teraio.Store.create(
            [os.path.join(directory, "dev0")], file_size_bytes=16 << 30, durable=False, force=True
        )
        session = teraio.offload(model, optimizer, store=store, gpu_memory=args.cap_bytes)
    times = []
    trace = os.path.join(args.out_dir, f"trace-{args.family}-{args.mode}-{args.cap_bytes}.json")
    try:
        with session as run:
            for step, tokens in enumerate(batches):
                tokens = tokens.to(device)
                torch.cuda.synchronize()
                with profiled(step == args.profile_step, trace):
                    started = time.perf_counter()
                    with torch.profiler.record_function("forward"):
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            loss = model(input_ids=tokens, labels=tokens).loss
                    with torch.profiler.record_function("backward"):
                        loss.backward()
                    with torch.profiler.record_function("step"):
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    loss.item()
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - started) * 1e3)
                peak = torch.cuda.max_memory_allocated() / 2**30
                print(f"step {step}: {times[-1]:.1f} ms, peak {peak:.2f} GiB", flush=True)
        if run is not None:
            print(run.report())
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(directory, ignore_errors=True)
    counted = sorted(times[4:])
    if counted:
        print(f"== {args.mode}: median {counted[len(counted) // 2]:.1f} ms over {len(counted)} steps")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="train and profile one step")
    one.add_argument("--family", default="llama")
    one.add_argument("--mode", choices=("ideal", "teraio"), default="ideal")
    one.add_argument("--cap-bytes", type=int, default=0)
    one.add_argument("--steps", type=int, default=12)
    one.add_argument("--profile-step", type=int, default=10)
    one.add_argument("--batch", type=int, default=4)
    one.add_argument("--seq", type=int, default=2048)
    one.add_argument("--out-dir", default=".")
    one.add_argument("--store-dir", default="", help="where teraio's store file goes (default: temp dir)")
    many = commands.add_parser("compare", help="kernel time per phase and kind, trace by trace")
    many.add_argument("traces", nargs="+")
    many.add_argument("--top", type=int, default=8, help="kernels listed each way")
    args = parser.parse_args(argv)
    return run_main(args) if args.command == "run" else compare_main(args)


if __name__ == "__main__":
    sys.exit(main())
