"""Where the block plan's iterations go: one model, one cap, one plan variant, per-step figures and
an optional torch.profiler timeline of one step.

    python3 benches/torch/probe_block_plan.py --family qwen2 --cap-bytes 41600000000
    python3 benches/torch/probe_block_plan.py --family qwen2 --cap-bytes 41600000000 \
        --plan ckpt --no-guard --profile-step 6 --out-dir /tmp/probe

`--plan`: `auto` (what `teraio.offload` chooses), `ckpt` (every block recomputed, the optimizer
state resident), `ckpt-state` (every block recomputed, all optimizer state to host memory between
steps, back at the step), `no-state` (the fastest plan that moves no optimizer state), `no-host`
(the fastest that copies no activations). `--no-guard`: the plan stays even where it measures
slower than checkpointing (and no memory replan). Per step it prints the wall time, the allocator's
retries and device allocations, and the block runtime's phase times; with `--profile-step` the
GPU's busy time per stream, its longest idle gaps on the compute stream with the host op that
launched the work after each gap, and the host's costliest calls. `--memory-history`: the
allocator records where each allocation was made; where a step runs out of memory, the live
bytes are printed by the Python line that allocated them (`live_by_line`), with the plan's bound
and each block's counted bytes beside them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def forced_choose(kind: str) -> Any:
    """A replacement for `blockwise.choose` that picks the `kind` variant (see the module doc)."""
    from teraio import blockwise as bw

    real = bw.choose

    def choose(
        measured: Any, link: Any, limit: int, state_sizes: list[int], host: int, has_store: bool
    ) -> Any:
        n = len(measured.blocks)
        if kind == "ckpt":
            plan = bw.Plan([bw.RECOMPUTE] * n)
        elif kind == "ckpt-state":
            plan = bw.Plan([bw.RECOMPUTE] * n, state_host_bytes=sum(state_sizes))
        elif kind == "no-state":
            return real(measured, link, limit, [], host, False)
        elif kind == "no-host":
            return real(measured, link, limit, state_sizes, 0, has_store)
        else:
            raise ValueError(kind)
        plan.predicted_ms, plan.predicted_peak_bytes = bw.predict(measured, plan, link)
        return plan, []

    return choose


def live_by_line(snapshot: dict[str, Any], top: int = 30) -> list[tuple[int, int, str]]:
    """Live allocated bytes (and block count) by the innermost Python frame outside torch's own
    modules (checkpointing and autocast stay visible: their file names are kept), largest first."""
    totals: dict[str, list[int]] = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames") or []
            where = "?"
            for frame in frames:
                name = frame["filename"]
                if "/torch/" in name and "checkpoint" not in name and "amp" not in name:
                    continue
                if name.startswith("??") or name.endswith(".cpp") or name.endswith(".h"):
                    continue
                where = f"{name.split('site-packages/')[-1]}:{frame['line']} {frame['name']}"
                break
            entry = totals.setdefault(where, [0, 0])
            entry[0] += block["size"]
            entry[1] += 1
    ranked = sorted(((b, n, w) for w, (b, n) in totals.items()), reverse=True)
    return ranked[:top]


def main() -> None:
    import teraio
    from teraio import blockwise as bw

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--cap-bytes", type=int, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--plan", default="auto", choices=["auto", "ckpt", "ckpt-state", "no-state", "no-host"]
    )
    parser.add_argument("--no-guard", action="store_true")
    parser.add_argument("--profile-step", type=int, default=-1)
    parser.add_argument("--out-dir", default="")
    parser.add_argument("--memory-history", action="store_true")
    args = parser.parse_args()
    from bench_regime import build_model, make_batches
    from timeline import profiled

    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_bytes / total), 0)
    model = build_model(args.family, "autocast", device, tiny=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(args.steps, args.batch, args.seq, model.config.vocab_size)
    if args.plan != "auto":
        bw.choose = forced_choose(args.plan)
    directory = tempfile.mkdtemp(prefix="teraio-probe-", dir="/root")
    store = teraio.Store.create(
        [os.path.join(directory, "dev0")], file_size_bytes=16 << 30, durable=False, force=True
    )
    print(f"== {args.family} cap {args.cap_bytes / 2**30:.2f} GiB plan {args.plan} guard {not args.no_guard}")
    if args.memory_history:
        torch.cuda.memory._record_memory_history(max_entries=300000)
    run: Any = None
    try:
        with teraio.offload(model, optimizer, store=store, gpu_memory=args.cap_bytes) as run:
            if args.no_guard:
                run._check_plan = lambda: None
            before = torch.cuda.memory_stats()
            for step, tokens in enumerate(batches):
                tokens = tokens.to(device)
                torch.cuda.synchronize()
                started = time.perf_counter()
                trace = os.path.join(
                    args.out_dir or directory, f"trace-{args.family}-{args.plan}-s{step}.json"
                )
                with profiled(step == args.profile_step, trace):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(input_ids=tokens, labels=tokens).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    value = loss.item()
                wall = (time.perf_counter() - started) * 1e3
                stats = torch.cuda.memory_stats()
                delta = {
                    k: stats.get(k, 0) - before.get(k, 0)
                    for k in (
                        "num_alloc_retries",
                        "num_device_alloc",
                        "num_device_free",
                        "num_sync_all_streams",
                    )
                }
                before = stats
                run._collect(wait=True)
                phases = run._iterations[-1] if run._iterations else {}
                hook = run._hook_s_at_end
                host_ms = (hook[-1] - (hook[-2] if len(hook) > 1 else 0.0)) * 1e3 if hook else 0.0
                print(
                    f"step {step}: loss {value:.5f} wall {wall:.0f} ms; phases "
                    + ", ".join(f"{k} {v:.0f}" for k, v in phases.items())
                    + f"; host in teraio {host_ms:.0f} ms; "
                    f"peak {run._peaks[-1] / 2**30:.2f} GiB, "
                    f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB; allocator {delta}",
                    flush=True,
                )
        print(run.report())
    except torch.OutOfMemoryError:
        if not args.memory_history:
            raise
        snapshot = torch.cuda.memory._snapshot()
        plan = run.plan if run is not None else None
        print(
            f"OUT OF MEMORY at step {run.step if run else '?'}: "
            f"allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB"
        )
        if plan is not None:
            print(f"  plan {plan.actions}\n  bound {plan.predicted_peak_bytes / 2**30:.2f} GiB")
            measured = run.measured
            print(
                f"  measured peak (no state) {measured.peak_bytes / 2**30:.2f} GiB, "
                f"state {measured.state_bytes / 2**30:.2f} GiB"
            )
            for block in measured.blocks:
                print(
                    f"  {block.name}: saved {block.saved_bytes / 2**20:.0f} MiB, "
                    f"selective {block.selective_bytes / 2**20:.0f} MiB"
                )
        for nbytes, count, where in live_by_line(snapshot):
            print(f"  {nbytes / 2**20:10.1f} MiB {count:6d} blocks  {where}")
        raise
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
