"""The lifetime planner (Rust, `teraio-planner`) from Python."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence, Union

from . import _native

#: The planner's error (a broken trace, a schedule the replay cannot pair up).
PlannerError = _native.PlannerError


def parse_size(value: Union[int, float, str]) -> int:
    """Bytes from an int, a float of bytes (`5.5e9`) or a string such as `"24GiB"`, `"2G"` (powers
    of 1024), `"1.5GB"` (powers of 1000), `"53.86GiB"` or `"4096"`, rounded down to whole bytes:
    the one parser the engine, the planner and the CLI use too (teraio-units)."""
    return _native.parse_size(value)


def format_bytes(nbytes: int) -> str:
    """A byte count for people: GiB from 1 GiB up, else MiB, else KiB or bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.2f} {unit}"
    return f"{nbytes} B"


def plan(
    trace: Union[str, dict[str, Any]],
    *,
    gpu_memory: Union[int, float, str],
    ssd_read_bandwidth: Union[float, str] = 6.5e9,
    ssd_write_bandwidth: Optional[Union[float, str]] = None,
    host_memory: Union[int, float, str] = 0,
    host_link_bandwidth: Union[float, str] = 25e9,
    ssd_latency_us: float = 20.0,
    host_latency_us: float = 10.0,
    reserve: Union[int, float, str] = 0,
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
    Returns what `teraio plan --json` prints (the planner's `plan_and_predict`, docs/planner.md):
    `{"plan": <plan file>, "prediction": {...}}`, where the prediction holds the planner's numbers
    (`fits`, `unplanned_peak_bytes`, `planned_peak_bytes`, `planning_time_ms`, ...) beside the
    simulated replay (`iteration_time_us`, `stall_time_us`, `peak_gpu_bytes`, bytes per tier,
    `outcome`, ...).
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
    gpu_memory: Union[int, float, str],
    ssd_read_bandwidth: Union[float, str] = 6.5e9,
    ssd_write_bandwidth: Optional[Union[float, str]] = None,
    host_memory: Union[int, float, str] = 0,
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
    gpu_memory: Union[int, float, str],
    ssd_read_bandwidth: Union[float, str],
    ssd_write_bandwidth: Optional[Union[float, str]],
    host_memory: Union[int, float, str],
    host_link_bandwidth: Union[float, str],
    ssd_latency_us: float,
    host_latency_us: float,
    ssd_shared: bool,
    ssd_via_host_link: bool,
) -> dict[str, Any]:
    """The native planner's and simulator's machine arguments, sizes and bandwidths parsed."""
    read = parse_bandwidth(ssd_read_bandwidth)
    return {
        "gpu_memory_bytes": parse_size(gpu_memory),
        "ssd_read_bytes_per_s": read,
        "ssd_write_bytes_per_s": read
        if ssd_write_bandwidth is None
        else parse_bandwidth(ssd_write_bandwidth),
        "host_memory_bytes": parse_size(host_memory),
        "host_link_bytes_per_s": parse_bandwidth(host_link_bandwidth),
        "ssd_latency_us": ssd_latency_us,
        "host_latency_us": host_latency_us,
        "ssd_shared": ssd_shared,
        "ssd_via_host_link": ssd_via_host_link,
    }


def validate_trace(trace: Union[str, dict[str, Any]]) -> None:
    """Raises PlannerError naming the first broken rule of docs/trace.md."""
    _native.validate_trace(trace if isinstance(trace, str) else json.dumps(trace))


def parse_bandwidth(value: Union[float, str]) -> float:
    """Bytes per second from a number or a string such as `"6.5GB/s"` or `"4x6.5GB/s"`."""
    if isinstance(value, (int, float)):
        return float(value)
    return _native.parse_bandwidth(value)


def replay_schedule(
    trace: dict[str, Any], schedule: dict[str, Any], hardware: dict[str, Any]
) -> dict[str, Any]:
    """The simulator's replay of a recorded schedule (`teraio.schedule_record`) on `hardware`."""
    report = _native.replay_schedule(json.dumps(trace), json.dumps(schedule), json.dumps(hardware))
    return json.loads(report)
