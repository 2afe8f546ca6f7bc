"""The lifetime planner (Rust, `teraio-planner`) from Python."""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence, Union

from . import _native

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: Union[int, float, str]) -> int:
    """Bytes from an int or a string such as `"24GiB"`, `"1.5 GB"`, `"4096"`."""
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {value!r}: use a number of bytes or e.g. '24GiB', '1.5GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def plan(
    trace: Union[str, dict[str, Any]],
    *,
    gpu_memory: Union[int, str],
    ssd_read_bandwidth: Union[float, str] = 6.5e9,
    ssd_write_bandwidth: Optional[Union[float, str]] = None,
    host_memory: Union[int, str] = 0,
    host_link_bandwidth: Union[float, str] = 25e9,
    ssd_latency_us: float = 20.0,
    host_latency_us: float = 10.0,
    reserve: Union[int, str] = 0,
    prefetch_slack: float = 1.0,
    movable_kinds: Optional[Sequence[str]] = None,
    ssd_shared: bool = False,
    ssd_via_host_link: bool = False,
    tier_preference: str = "ssd",
) -> dict[str, Any]:
    """Plans migrations for a trace (docs/trace.md) so that it fits in `gpu_memory`.

    Bandwidths are bytes per second (or strings like `"6.5GB/s"`). `movable_kinds` restricts the
    plan to tensor kinds the runtime can move (e.g. `["activation"]`); the others keep their
    memory. `ssd_shared`: the SSD's reads and writes share its time (one disk serves one request
    after another); the two bandwidths are then what each direction gets alone.
    `ssd_via_host_link`: SSD transfers also cross the host link (staged in pinned host memory,
    as `teraio.offload` does), so SSD bytes take host-link bandwidth too. `tier_preference`:
    which tier a period goes to when both can take it: "ssd" (the paper), "host", or "auto"
    (plan both ways and keep the plan the simulator predicts faster).
    Returns `{"plan": <plan, docs/planner.md>, "prediction": {...}}` where the prediction
    holds the simulated iteration time, stalls, peak and bytes per tier.
    """
    trace_json = trace if isinstance(trace, str) else json.dumps(trace)
    result = _native.plan(
        trace_json,
        **_hardware(
            gpu_memory,
            ssd_read_bandwidth,
            ssd_write_bandwidth,
            host_memory,
            host_link_bandwidth,
            ssd_latency_us,
            host_latency_us,
            ssd_shared,
            ssd_via_host_link,
        ),
        reserve_bytes=parse_size(reserve),
        prefetch_slack=prefetch_slack,
        movable_kinds=list(movable_kinds) if movable_kinds is not None else None,
        tier_preference=tier_preference,
    )
    return json.loads(result)


def simulate(
    trace: Union[str, dict[str, Any]],
    plan_doc: Union[str, dict[str, Any]],
    *,
    gpu_memory: Union[int, str],
    ssd_read_bandwidth: Union[float, str] = 6.5e9,
    ssd_write_bandwidth: Optional[Union[float, str]] = None,
    host_memory: Union[int, str] = 0,
    host_link_bandwidth: Union[float, str] = 25e9,
    ssd_latency_us: float = 20.0,
    host_latency_us: float = 10.0,
    ssd_shared: bool = False,
    ssd_via_host_link: bool = False,
) -> dict[str, Any]:
    """Replays `trace` under a plan (the `"plan"` of `plan()`'s result) on the given hardware and
    returns the simulator's report (iteration time, stalls, peak, bytes per tier): how a plan made
    for one machine does on another, e.g. with a slower link than it was planned for."""
    result = _native.simulate_plan(
        trace if isinstance(trace, str) else json.dumps(trace),
        plan_doc if isinstance(plan_doc, str) else json.dumps(plan_doc),
        **_hardware(
            gpu_memory,
            ssd_read_bandwidth,
            ssd_write_bandwidth,
            host_memory,
            host_link_bandwidth,
            ssd_latency_us,
            host_latency_us,
            ssd_shared,
            ssd_via_host_link,
        ),
    )
    return json.loads(result)


def _hardware(
    gpu_memory: Union[int, str],
    ssd_read_bandwidth: Union[float, str],
    ssd_write_bandwidth: Optional[Union[float, str]],
    host_memory: Union[int, str],
    host_link_bandwidth: Union[float, str],
    ssd_latency_us: float,
    host_latency_us: float,
    ssd_shared: bool,
    ssd_via_host_link: bool,
) -> dict[str, Any]:
    """The native planner's and simulator's machine arguments, sizes and bandwidths parsed."""
    read = _bandwidth(ssd_read_bandwidth)
    return {
        "gpu_memory_bytes": parse_size(gpu_memory),
        "ssd_read_bytes_per_s": read,
        "ssd_write_bytes_per_s": read if ssd_write_bandwidth is None else _bandwidth(ssd_write_bandwidth),
        "host_memory_bytes": parse_size(host_memory),
        "host_link_bytes_per_s": _bandwidth(host_link_bandwidth),
        "ssd_latency_us": ssd_latency_us,
        "host_latency_us": host_latency_us,
        "ssd_shared": ssd_shared,
        "ssd_via_host_link": ssd_via_host_link,
    }


def validate_trace(trace: Union[str, dict[str, Any]]) -> None:
    """Raises PlannerError naming the first broken rule of docs/trace.md."""
    _native.validate_trace(trace if isinstance(trace, str) else json.dumps(trace))


def _bandwidth(value: Union[float, str]) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    if text.lower().endswith("/s"):
        text = text[:-2]
    return float(parse_size(text))
