"""Op times that add up to the real iteration.

The profiler times each op with CUDA events around it and a Python callback per op. When the host
is the bottleneck (short bf16 kernels), the GPU waits for the next launch inside those events,
so every op looks longer by about the same host latency, and the sum of op times overstates the
iteration (in bf16 runs, by up to nearly twice). Long, GPU-bound ops are timed
right: their start event waits for the work queued before them.

So the model is: true time = profiled time - a per-op overhead `c`, never below `FLOOR_SHARE` of
the profiled time. `c` is solved from a region measured without per-op events (the forward passes
of the model's repeated blocks in an unprofiled iteration, or its whole forward pass): the
region's calibrated op times add up to its measured time. The same `c` then applies to every op.
Where that model cannot reach the measurement (it would need more than the floor allows, or the
measurement is longer than the profile), op times are scaled by one factor instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: An op keeps at least this share of its profiled time.
FLOOR_SHARE = 0.05


@dataclass
class Calibration:
    """How profiled op times become calibrated ones: `max(d - overhead_us, FLOOR_SHARE * d) *
    scale`. `region_profiled_us` / `region_measured_us`: what it was fitted on."""

    overhead_us: float = 0.0
    scale: float = 1.0
    region: str = ""
    region_profiled_us: float = 0.0
    region_measured_us: float = 0.0
    method: str = "none"

    def apply(self, duration_us: float) -> float:
        return max(duration_us - self.overhead_us, FLOOR_SHARE * duration_us) * self.scale

    def describe(self) -> str:
        if self.method == "none":
            return "profiled op times, not calibrated"
        fitted = (
            f"fitted on {self.region}: {self.region_measured_us / 1e3:.1f} ms measured without "
            f"per-op events against {self.region_profiled_us / 1e3:.1f} ms profiled"
        )
        if self.method == "overhead":
            return f"profiled op times less a per-op overhead of {self.overhead_us:.1f} us, {fitted}"
        return f"profiled op times scaled by {self.scale:.3f}, {fitted}"


def fit(durations_us: Sequence[float], measured_us: float, region: str = "") -> Calibration:
    """The calibration under which `durations_us` (a region's profiled op times) add up to
    `measured_us` (the same region measured without per-op events)."""
    total = float(sum(durations_us))
    result = Calibration(region=region, region_profiled_us=total, region_measured_us=measured_us)
    if total <= 0.0 or measured_us <= 0.0:
        return result
    if measured_us >= total or measured_us <= FLOOR_SHARE * total:
        result.scale = measured_us / total
        result.method = "scale"
        return result

    def calibrated(overhead: float) -> float:
        return sum(max(d - overhead, FLOOR_SHARE * d) for d in durations_us)

    low, high = 0.0, max(durations_us)
    for _ in range(100):
        middle = (low + high) / 2
        if calibrated(middle) > measured_us:
            low = middle
        else:
            high = middle
    result.overhead_us = (low + high) / 2
    result.method = "overhead"
    return result
