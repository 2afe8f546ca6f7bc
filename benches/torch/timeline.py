"""GPU timelines of one training step: `profiled` records a step with torch.profiler and writes
its chrome trace (gzipped); `summarize_trace` prints where the GPU's time went: busy time per
stream, the compute stream's longest gaps, the host op that launched the work after each gap, the
copy streams' idle time (the next copy queued late by the host, or queued in time and waiting for
an event), busy shares per tenth of the span, and the host's CUDA calls. Used by
probe_block_plan.py and bench_capacity.py (`--profile-step`)."""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def profiled(enabled: bool, path: str) -> Iterator[None]:
    """Records the body with torch.profiler (CPU and CUDA) when `enabled`, then writes `path`.gz
    and prints the summary; otherwise does nothing."""
    if not enabled:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    # TIMELINE_STACK=1: Python frames too (python_function events), which say what held the host
    # in a gap, at some cost in host time.
    stack = os.environ.get("TIMELINE_STACK") == "1"
    with torch.profiler.profile(activities=activities, with_stack=stack) as profiler:
        yield
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    profiler.export_chrome_trace(path)
    summarize_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)


def summarize_trace(path: str, top: int = 12) -> None:
    """Busy time per GPU stream, the compute stream's longest gaps and what launched the work
    after each, from a chrome trace written by torch.profiler."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print("trace: no GPU events")
        return
    by_stream: dict[Any, list[tuple[float, float, dict[str, Any]]]] = collections.defaultdict(list)
    for e in gpu:
        by_stream[e["args"].get("stream")].append((e["ts"], e["ts"] + e["dur"], e))
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    print(f"trace: GPU span {(end - start) / 1e3:.1f} ms")
    for stream, spans in sorted(by_stream.items(), key=lambda kv: -sum(b - a for a, b, _ in kv[1])):
        kinds = collections.Counter()
        for a, b, e in spans:
            kinds[
                e["cat"]
                + (":" + e["name"].split(" ")[1] if e["cat"] == "gpu_memcpy" and " " in e["name"] else "")
            ] += b - a
        busy = ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in kinds.most_common(4))
        print(f"  stream {stream}: {len(spans)} events, {busy}")
    compute = max(by_stream, key=lambda s: sum(1 for _, _, e in by_stream[s] if e["cat"] == "kernel"))
    spans = sorted(by_stream[compute], key=lambda x: x[0])
    gaps = []
    last = spans[0][1]
    for a, b, e in spans[1:]:
        if a - last > 200:
            gaps.append((a - last, last, e))
        last = max(last, b)
    total = sum(g for g, _, _ in gaps)
    print(f"  compute stream {compute}: {len(gaps)} gaps over 0.2 ms, {total / 1e3:.1f} ms in all")
    runtime = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    ops = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")
        ),
        key=lambda e: e["ts"],
    )

    def enclosing(ts: float) -> str:
        names = [e["name"] for e in ops if e["ts"] <= ts <= e["ts"] + e["dur"]]
        return " > ".join(names[-4:]) if names else "?"

    # Each gap is the host's (the work after it launched after the stream went idle) or the
    # GPU's (launched in time, then waiting: an event, another stream). For the host's, the
    # launching thread's longest outermost ops inside the gap say what held it.
    late_total = 0.0
    for gap, at, e in gaps:
        launch = runtime.get(e["args"].get("correlation"))
        if launch is not None:
            late_total += min(gap, max(0.0, launch["ts"] - at))
    print(
        f"  of the gaps: {late_total / 1e3:.1f} ms the host launched the next work late, "
        f"{(total - late_total) / 1e3:.1f} ms it was queued and waited on the GPU"
    )
    for gap, at, e in sorted(gaps, key=lambda g: -g[0])[:top]:
        launch = runtime.get(e["args"].get("correlation"))
        where = enclosing(launch["ts"]) if launch else "?"
        late = min(gap, max(0.0, launch["ts"] - at)) if launch else 0.0
        print(
            f"    gap {gap / 1e3:6.2f} ms at +{(at - start) / 1e3:7.1f} ms "
            f"before {e['name'][:50]!r} (host late {late / 1e3:.2f} ms): launched in {where[:160]}"
        )
        if launch is not None and late > 0:
            middle = (at + launch["ts"]) / 2
            chain = [
                o["name"]
                for o in ops
                if o.get("tid") == launch.get("tid") and o["ts"] <= middle <= o["ts"] + o["dur"]
            ]
            print(
                f"      host thread {launch.get('tid')} in the gap: {_held_by(ops, launch, at)}; "
                f"at its middle: {' > '.join(chain[-5:])[:240] or 'no op'}"
            )
    for stream in by_stream:
        if stream != compute:
            _copy_stream_gaps(stream, by_stream[stream], runtime)
    _busy_strip(by_stream, compute, start, end)
    host = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime":
            host[e["name"]] += e["dur"]
    print("  host CUDA calls: " + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in host.most_common(8)))


def _held_by(ops: list[dict[str, Any]], launch: dict[str, Any], since: float, most: int = 4) -> str:
    """The launching thread's outermost ops overlapping `since` .. the launch, longest first (by
    their time inside that window)."""
    end = launch["ts"]
    inside = [
        e for e in ops if e.get("tid") == launch.get("tid") and e["ts"] < end and e["ts"] + e["dur"] > since
    ]
    outer: list[dict[str, Any]] = []
    for e in sorted(inside, key=lambda e: (e["ts"], -e["dur"])):
        if not outer or e["ts"] >= outer[-1]["ts"] + outer[-1]["dur"]:
            outer.append(e)

    def within(e: dict[str, Any]) -> float:
        return min(end, e["ts"] + e["dur"]) - max(since, e["ts"])

    outer.sort(key=lambda e: -within(e))
    return ", ".join(f"{e['name'][:60]} {within(e) / 1e3:.2f} ms" for e in outer[:most]) or "no op recorded"


def _copy_stream_gaps(
    stream: Any, spans: list[tuple[float, float, dict[str, Any]]], runtime: dict[Any, Any]
) -> None:
    """A copy stream's idle time between copies, split by why: the host queued the next copy
    after the stream went idle, or the copy was queued in time and waited (for the event it was
    ordered after: compute, or a write of the same key)."""
    spans = sorted((s for s in spans if s[2]["cat"] == "gpu_memcpy"), key=lambda x: x[0])
    if len(spans) < 2:
        return
    late = waited = 0.0
    last = spans[0][1]
    for a, b, e in spans[1:]:
        gap = a - last
        if gap > 200:
            launch = runtime.get(e["args"].get("correlation"))
            queued = launch["ts"] if launch else last
            late_part = min(gap, max(0.0, queued - last))
            late += late_part
            waited += gap - late_part
        last = max(last, b)
    print(
        f"  copy stream {stream}: idle between copies {(late + waited) / 1e3:.1f} ms: "
        f"next copy queued late by the host {late / 1e3:.1f} ms, queued and waiting {waited / 1e3:.1f} ms"
    )


def _busy_strip(
    by_stream: dict[Any, list[tuple[float, float, dict[str, Any]]]], compute: Any, start: float, end: float
) -> None:
    """Busy share of each stream in each tenth of the span (where in the step each one idles)."""
    bins = 10
    width = (end - start) / bins
    for stream, spans in sorted(by_stream.items(), key=lambda kv: kv[0] != compute):
        busy = [0.0] * bins
        for a, b, _ in spans:
            for i in range(int((a - start) // width), min(bins - 1, int((b - start) // width)) + 1):
                lo, hi = start + i * width, start + (i + 1) * width
                busy[i] += max(0.0, min(b, hi) - max(a, lo))
        label = "compute" if stream == compute else f"stream {stream}"
        print(f"  busy % per tenth, {label:>10}: " + " ".join(f"{100 * x / width:3.0f}" for x in busy))
