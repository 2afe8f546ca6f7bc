"""Where the block plan's iterations go: one model, one cap, one plan variant, per-step figures and
an optional torch.profiler timeline of one step.

    python3 benches/torch/probe_block_plan.py --family qwen2 --cap-bytes 41600000000
    python3 benches/torch/probe_block_plan.py --family qwen2 --cap-bytes 41600000000 \
        --plan ckpt --no-guard --profile-step 6 --out-dir /tmp/probe

`--plan`: `auto` (what `teraio.offload` chooses), `ckpt` (every block recomputed, the optimizer
state resident), `ckpt-state` (every block recomputed, all optimizer state to host memory between
steps, back at the step), `no-state` (the fastest plan that moves no optimizer state), `no-host`
(the fastest that copies no activations), `layout:r13k3` (in block order: 13 recomputed, then 3
kept; letters h host, r recomputed, s selective, k kept; with the optimizer state it needs moved,
as the planner would move it; each forced plan also prints the measured times and every "c
recomputed, the rest kept" layout's prediction). `--no-guard`:
the plan stays even where it measures slower than checkpointing (and no memory replan). Per step
it prints the wall time, the allocator's retries and device allocations, and the block runtime's
phase times; with `--profile-step` the GPU's busy time per stream, its longest idle gaps on the
compute stream with the host op that launched the work after each gap, and the host's costliest
calls. On running out of memory it prints the allocator's free memory by stream, pool and segment
(`print_segments`). `--peak-steps K ...`: the allocator records steps K; each one's peak is printed with the
bytes live then by the Python line that allocated them (`StepPeak`); where one runs out of memory,
its peak up to then, with the plan's bound and each block's counted bytes beside it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def forced_choose(kind: str) -> Any:
    """A replacement for `plans.block.choose` that picks the `kind` variant (see the module doc)."""
    from teraio.runtime.plans import block as bw

    real = bw.choose

    def choose(
        measured: Any,
        link: Any,
        limit: int,
        state_sizes: list[int],
        host: int,
        has_store: bool,
        step_window: int = 0,
        step_held: int = 0,
    ) -> Any:
        n = len(measured.blocks)
        print_predictions(measured, link, limit, state_sizes, host, has_store, step_window, step_held)
        if kind == "auto":
            return real(measured, link, limit, state_sizes, host, has_store, step_window, step_held)
        if kind == "ckpt":
            plan = bw.Plan([bw.RECOMPUTE] * n)
        elif kind == "ckpt-state":
            plan = bw.Plan([bw.RECOMPUTE] * n, state_host_bytes=sum(state_sizes))
        elif kind == "no-state":
            return real(measured, link, limit, [], host, False, step_window, step_held)
        elif kind == "no-host":
            return real(measured, link, limit, state_sizes, 0, has_store, step_window, step_held)
        elif kind.startswith("layout:"):
            actions = parse_layout(kind.removeprefix("layout:"), n)
            fitted = bw.fit_layout(
                measured, link, limit, actions, 1, state_sizes, host, has_store, step_window, step_held
            )
            if fitted is None:
                print(f"  layout {kind}: does not fit even with the state moved; run without moving state")
            plan = fitted or bw.Plan(actions)
        else:
            raise ValueError(kind)
        if not plan.predicted_ms:
            plan.predicted_ms, plan.predicted_peak_bytes = bw.predict(measured, plan, link)
        print(
            f"  forced plan: predicted {plan.predicted_ms:.1f} ms, bound "
            f"{plan.predicted_peak_bytes / 2**30:.2f} GiB, state out {plan.state_out_bytes / 2**30:.2f} GiB, "
            f"restore at {plan.state_restore_at}, step window {plan.step_window_bytes / 2**30:.2f} GiB",
            flush=True,
        )
        return plan, []

    return choose


def print_predictions(
    measured: Any,
    link: Any,
    limit: int,
    state_sizes: list[int],
    host: int,
    has_store: bool,
    step_window: int,
    step_held: int,
) -> None:
    """The measured times the plan is made of, and each "c recomputed, the rest kept" layout's
    prediction with the state it must move (no host or selective blocks)."""
    from teraio.runtime.plans import block as bw

    print(
        f"  measured: checkpoint-all {measured.checkpoint_all_ms:.1f} ms (pre {measured.pre_forward_ms:.1f}, "
        f"head {measured.head_backward_ms:.1f}, tail {measured.tail_backward_ms:.1f}, "
        f"step {measured.step_ms:.1f}); peak {measured.peak_bytes / 2**30:.2f} GiB, step peak "
        f"{measured.step_peak_bytes / 2**30:.2f} GiB, state {measured.state_bytes / 2**30:.2f} GiB, "
        f"limit {limit / 2**30:.2f} GiB; link d2h {link.d2h / 1e9:.1f} h2d {link.h2d / 1e9:.1f} GB/s",
        flush=True,
    )
    for block in measured.blocks:
        print(
            f"    {block.name}: saved {block.saved_bytes / 2**20:.0f} MiB, forward {block.forward_ms:.2f}, "
            f"recompute {block.recompute_ms:.2f}, backward {block.backward_ms:.2f} ms"
        )
    n = len(measured.blocks)
    for recomputed in range(n + 1):
        actions = [bw.RECOMPUTE] * recomputed + [bw.KEEP] * (n - recomputed)
        plan = bw.fit_layout(
            measured, link, limit, actions, 1, state_sizes, host, has_store, step_window, step_held
        )
        if plan is None:
            continue
        print(
            f"    r{recomputed}k{n - recomputed}: predicted {plan.predicted_ms:.1f} ms, bound "
            f"{plan.predicted_peak_bytes / 2**30:.2f} GiB, state out {plan.state_out_bytes / 2**30:.2f} GiB, "
            f"restore at {plan.state_restore_at}",
            flush=True,
        )


def parse_layout(spec: str, blocks: int) -> list[str]:
    """`r13k3` -> 13 RECOMPUTE then 3 KEEP; the counts must add up to `blocks`."""
    from teraio.runtime.plans import block as bw

    action = {"h": bw.HOST, "r": bw.RECOMPUTE, "s": bw.SELECTIVE, "k": bw.KEEP}
    parts = re.findall(r"([hrsk])(\d+)", spec)
    if not parts or "".join(f"{a}{c}" for a, c in parts) != spec:
        raise ValueError(f"layout {spec!r}: expected letters h/r/s/k each followed by a count")
    actions = [action[a] for a, c in parts for _ in range(int(c))]
    if len(actions) != blocks:
        raise ValueError(f"layout {spec!r} names {len(actions)} blocks; the model has {blocks}")
    return actions


def print_measured(run: Any) -> None:
    """A block plan's bound beside what it was made of (`teraio.runtime.plans.block.Measurement`)."""
    plan, measured = run.plan, run.measured
    if plan is not None:
        print(f"  plan {plan.actions}\n  bound {plan.predicted_peak_bytes / 2**30:.2f} GiB")
    print(
        f"  measured peak (no state) {measured.peak_bytes / 2**30:.2f} GiB, step peak "
        f"{measured.step_peak_bytes / 2**30:.2f} GiB, state {measured.state_bytes / 2**30:.2f} GiB"
    )
    for block in measured.blocks:
        print(
            f"  {block.name}: saved {block.saved_bytes / 2**20:.0f} MiB, "
            f"selective {block.selective_bytes / 2**20:.0f} MiB"
        )


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost Python frame outside torch's own modules (checkpointing, autocast and FSDP
    stay visible), as "file:line function"; "?" where none was recorded."""
    for frame in frames or []:
        name = frame["filename"]
        if not name.endswith(".py"):
            continue  # C++ frames (the allocator's own)
        if "/torch/" in name and not any(k in name for k in ("checkpoint", "amp", "fsdp")):
            continue
        return f"{name.split('site-packages/')[-1]}:{frame['line']} {frame['name']}"
    return "?"


class StepPeak:
    """Where one step's peak of allocated bytes stood, by allocating line: `begin()` before the
    step (what is live then is "before the step"), `end()` after it; recording runs in between."""

    def begin(self) -> None:
        self._before = {
            block["address"]: block["size"]
            for segment in torch.cuda.memory._snapshot()["segments"]
            for block in segment["blocks"]
            if block["state"] in ("active_allocated", "active_pending_free")
        }
        torch.cuda.memory._record_memory_history(None)  # an empty trace for this step
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")

    def end(self, title: str, top: int = 25) -> None:
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(None)
        live: dict[int, tuple[int, str]] = {a: (n, "live before the step") for a, n in self._before.items()}
        total = before = sum(n for n, _ in live.values())
        peak, peak_at = total, -1
        # The allocator's own work in the step: pages mapped and unmapped (an unmap mid-step is a
        # retry: it released cached blocks, after synchronizing, to satisfy an allocation), with
        # the bytes allocated beyond the step's start when it came.
        segment_events: list[tuple[int, dict[str, Any], int]] = []
        for index, event in enumerate(trace):
            if event["action"] == "alloc":
                total += event["size"]
                if total > peak:
                    peak, peak_at = total, index
            elif event["action"] == "free_completed":
                total -= event["size"]
            elif event["action"] != "free_requested":
                segment_events.append((index, event, total - before))
        live_at_peak = dict(live)
        for event in trace[: peak_at + 1]:
            if event["action"] == "alloc":
                live_at_peak[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            elif event["action"] == "free_completed":
                live_at_peak.pop(event["addr"], None)
        totals: dict[str, int] = {}
        for nbytes, where in live_at_peak.values():
            totals[where] = totals.get(where, 0) + nbytes
        asking = _where(trace[peak_at].get("frames", [])) if peak_at >= 0 else "-"
        print(f"== {title}: peak {peak / 2**30:.2f} GiB at the allocation from {asking}", flush=True)
        for where, nbytes in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {nbytes / 2**20:10.1f} MiB  {where}", flush=True)
        for index, event, allocated in segment_events[:40]:
            print(
                f"  event {index}/{len(trace)} {event['action']} {event['size'] / 2**20:.1f} MiB "
                f"(allocated then {allocated / 2**30:.2f} GiB more than before the step) "
                f"from {_where(event.get('frames', []))}",
                flush=True,
            )


def print_segments(title: str, top: int = 12) -> None:
    """The allocator's memory not handed out, by segment: what a failed allocation could not use.
    Per stream and pool: mapped bytes, allocated bytes, free blocks and the largest of them; then
    the segments holding the most free bytes."""
    segments = torch.cuda.memory._snapshot()["segments"]
    by_pool: dict[tuple[int, str], list[int]] = {}
    for segment in segments:
        free = [b["size"] for b in segment["blocks"] if b["state"] == "inactive"]
        row = by_pool.setdefault((segment["stream"], segment["segment_type"]), [0, 0, 0, 0, 0, 0])
        row[0] += 1
        row[1] += segment["total_size"]
        row[2] += segment["allocated_size"]
        row[3] += sum(free)
        row[4] += len(free)
        row[5] = max([row[5], *free])
    stats = torch.cuda.memory_stats()
    keys = ("reserved_bytes", "allocated_bytes", "active_bytes", "inactive_split_bytes")
    print(
        f"== allocator at {title}: "
        + ", ".join(
            f"{k} {stats.get(k + '.all.current', 0) / 2**30:.2f} GiB "
            f"(peak {stats.get(k + '.all.peak', 0) / 2**30:.2f})"
            for k in keys
        ),
        flush=True,
    )
    for (stream, pool), row in sorted(by_pool.items()):
        print(
            f"  stream {stream:#x} {pool}: {row[0]} segments, {row[1] / 2**30:.2f} GiB mapped, "
            f"{row[2] / 2**30:.2f} GiB allocated, {row[3] / 2**30:.2f} GiB free in {row[4]} blocks "
            f"(largest {row[5] / 2**20:.1f} MiB)",
            flush=True,
        )
    ranked = sorted(segments, key=lambda s: s["total_size"] - s["allocated_size"], reverse=True)
    for segment in ranked[:top]:
        blocks = segment["blocks"]
        print(
            f"  segment {segment['address']:#x} stream {segment['stream']:#x} {segment['segment_type']}: "
            f"{segment['total_size'] / 2**20:.1f} MiB, {segment['allocated_size'] / 2**20:.1f} allocated, "
            f"{len(blocks)} blocks, free sizes MiB "
            + str(
                sorted(
                    (round(b["size"] / 2**20, 1) for b in blocks if b["state"] == "inactive"), reverse=True
                )[:12]
            ),
            flush=True,
        )


def main() -> None:
    import teraio
    from teraio.runtime.plans import block as bw

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--cap-bytes", type=int, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--plan", default="auto", help="see the module doc")
    parser.add_argument("--no-guard", action="store_true")
    parser.add_argument("--whole-model", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--profile-step", type=int, default=-1)
    parser.add_argument("--segments", action="store_true", help="print_segments after every step")
    parser.add_argument("--reserve", default="auto", help="teraio.offload's reserve (a size or auto)")
    parser.add_argument("--out-dir", default="")
    parser.add_argument(
        "--peak-steps",
        type=int,
        nargs="*",
        default=[],
        help="where these steps' peaks stood, by allocating line (StepPeak; recording slows them)",
    )
    args = parser.parse_args()
    from bench_regime import build_model, make_batches
    from timeline import profiled

    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_bytes / total), 0)
    model = build_model(args.family, "autocast", device, tiny=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(args.steps, args.batch, args.seq, model.config.vocab_size)
    bw.choose = forced_choose(args.plan)
    directory = tempfile.mkdtemp(prefix="teraio-probe-", dir="/root")
    store = teraio.Store.create(
        [os.path.join(directory, "dev0")], file_size_bytes=16 << 30, durable=False, force=True
    )
    print(f"== {args.family} cap {args.cap_bytes / 2**30:.2f} GiB plan {args.plan} guard {not args.no_guard}")
    peaks = StepPeak()
    run: Any = None

    def on_out_of_memory(device: int, asked: int, allocated: int, free: int) -> None:
        step = run.step if run is not None else "-"
        print_segments(f"a failed allocation of {asked / 2**30:.2f} GiB in step {step}")

    # Called by the allocator when it fails, with its lock released, before the error unwinds
    # (the memory visualizer's documented way to snapshot at the failure).
    torch._C._cuda_attach_out_of_memory_observer(on_out_of_memory)
    try:
        with teraio.offload(
            model,
            optimizer,
            store=store,
            gpu_memory=args.cap_bytes,
            whole_model=args.whole_model,
            reserve=args.reserve,
        ) as run:
            if args.no_guard:
                run._check_plan = lambda: None
            before = torch.cuda.memory_stats()
            for step, tokens in enumerate(batches):
                tokens = tokens.to(device)
                torch.cuda.synchronize()
                if step in args.peak_steps:
                    peaks.begin()
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
                if step in args.peak_steps:
                    peaks.end(f"step {step}")
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
                if args.segments:
                    print_segments(f"the end of step {step}", top=3)
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
        if run is not None and run.step in args.peak_steps:
            peaks.end(f"step {run.step} up to the failure")
            print_measured(run)
        raise
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
