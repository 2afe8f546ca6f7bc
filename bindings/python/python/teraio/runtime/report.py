"""What an offload run did (`teraio.offload(...).report()`): `Report`, the fields every mode's
report has, the tensor plan's section (`TensorReport`), and the check of a measured iteration
against its prediction that every report makes.

The block plan's section is `modes.block.BlockReport` and the whole-model mode's
`modes.whole_model.WholeModelReport`; both are `Report`s. Each is built with `prediction_fields`
or `check_prediction`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from ..planning import format_bytes
from .movers.tiers import HOST, SSD

#: The report flags a measured iteration this far (as a share) from the prediction.
PREDICTION_TOLERANCE = 0.10


def check_prediction(
    measured_ms: Optional[float], predicted_ms: Optional[float]
) -> tuple[Optional[float], str]:
    """(measured - predicted) / predicted in percent (None without both), and a warning where it
    is past `PREDICTION_TOLERANCE` ("" otherwise)."""
    if not predicted_ms or measured_ms is None:
        return None, ""
    error = (measured_ms - predicted_ms) / predicted_ms * 100
    if abs(error) <= PREDICTION_TOLERANCE * 100:
        return error, ""
    return error, (
        f"measured {measured_ms:.1f} ms is {abs(error):.0f}% {'above' if error > 0 else 'below'} the "
        f"predicted {predicted_ms:.1f} ms (tolerance {PREDICTION_TOLERANCE:.0%}): the plan's model of "
        "this machine is off"
    )


def prediction_fields(measured_ms: Optional[float], predicted_ms: Optional[float]) -> dict[str, Any]:
    """The fields every mode's report has for its iteration: measured, predicted and
    `check_prediction`'s error and warning."""
    error, warning = check_prediction(measured_ms, predicted_ms)
    return {
        "measured_iteration_ms": measured_ms,
        "predicted_iteration_ms": predicted_ms,
        "prediction_error_percent": error,
        "prediction_warning": warning,
    }


@dataclass
class Report:
    """What an offload run did, whichever mode ran it: the fields every mode's report fills. Each
    mode's report adds its own section (`TensorReport`, `modes.block.BlockReport`,
    `modes.whole_model.WholeModelReport`); `as_dict` gives all of them flat."""

    #: The mode that ran: "tensor", "block" or "whole-model" (each mode's report sets its own).
    mode: str = field(init=False, default="")
    #: Iterations run, and each one's wall time from its forward to the end of its step, ms.
    steps: int
    step_times_ms: list[float]
    #: The median iteration the report counts (the mode's section says which), ms.
    measured_iteration_ms: Optional[float]
    #: The mode's prediction of that iteration, ms, and (measured - predicted) / predicted,
    #: percent (`check_prediction`); None where there is none.
    predicted_iteration_ms: Optional[float]
    prediction_error_percent: Optional[float]
    #: The allocator's peak over the counted iterations, and the budget (`gpu_memory`).
    peak_gpu_bytes: Optional[int]
    gpu_memory_bytes: int
    #: Host time in teraio per counted iteration, ms, by where it was spent ("hooks", ...).
    host_ms_per_iteration: dict[str, float]
    #: What the runtime assumed about the machine and where each figure came from.
    machine: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TensorReport(Report):
    """The tensor plan's report: predicted against measured iteration, stalls, traffic, peak."""

    mode: str = field(init=False, default="tensor")
    planned_steps: int
    ideal_iteration_ms: Optional[float]
    predicted_percent_of_ideal: Optional[float]
    predicted_peak_bytes: Optional[int]
    unplanned_peak_bytes: Optional[int]
    bytes_per_iteration: dict[str, dict[str, int]]
    stalls: dict[str, Any]
    plan_summary: dict[str, Any] = field(default_factory=dict)
    #: Optimizer state moved between steps, per iteration: {"offloaded"|"prefetched": {tier: bytes}}.
    state_bytes_per_iteration: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Parameters moved between the passes, per iteration (same shape).
    parameter_bytes_per_iteration: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Median of the planned iterations, ms: {"forward"|"backward"|"step": {"measured", "profiled"}},
    #: and "between" (from one step's end to the next forward pass; the profile has no ops there).
    phases_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    # `host_ms_per_iteration` (Report): the saved-tensor hooks (and of that, waits for
    # device-to-host copies in flight and for SSD reads/writes), before and after the step. Host
    # time the GPU did not wait for costs nothing; a blocked host that lets the GPU run dry does.
    #: Saved activations dropped at the save and recomputed in backward, per planned iteration.
    recomputed_bytes_per_iteration: int = 0
    #: How `ideal_iteration_ms` was made: an estimate from calibrated op times (see
    #: teraio.calibration) unless a measured ideal was given; and the raw profiled sum.
    ideal_source: str = ""
    profiled_ops_ms: Optional[float] = None
    #: Says when `prediction_error_percent` is past `PREDICTION_TOLERANCE`.
    prediction_warning: str = ""
    #: Blocks run under activation checkpointing in the planned iterations, and the candidates.
    checkpointed_blocks: list[str] = field(default_factory=list)
    checkpoint_summary: dict[str, Any] = field(default_factory=dict)
    #: Time in teraio's hooks per planned iteration as a percent of the ideal iteration.
    host_percent_of_ideal: Optional[float] = None
    #: FSDP2's host shards (`CPUOffloadPolicy`): who stepped them, how many elements, the
    #: kernel's median step (`runtime.modes.host_step`). Empty: no host shards.
    host_step: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        def ms(value: Optional[float]) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        def gib(value: Optional[int]) -> str:
            if value is None:
                return "-"
            return format_bytes(value)

        rank = self.machine.get("rank")
        where = f" (rank {rank} of {self.machine.get('world_size')})" if rank is not None else ""
        lines = [
            f"teraio offload{where}: {self.steps} steps, {self.planned_steps} with the plan",
            f"  iteration: measured {ms(self.measured_iteration_ms)} (median of planned steps), "
            f"predicted {ms(self.predicted_iteration_ms)}, "
            f"ideal {ms(self.ideal_iteration_ms)} (estimate: {self.ideal_source or 'profiled op times'}; "
            f"raw profiled ops {ms(self.profiled_ops_ms)})",
            f"  peak GPU memory: measured {gib(self.peak_gpu_bytes)}, "
            f"planned {gib(self.predicted_peak_bytes)}, "
            f"without offload {gib(self.unplanned_peak_bytes)}, budget {gib(self.gpu_memory_bytes)}",
        ]
        for direction, tiers in self.bytes_per_iteration.items():
            lines.append(
                f"  {direction} per iteration: host {gib(tiers.get(HOST, 0))}, ssd {gib(tiers.get(SSD, 0))}"
                " (activations)"
            )
        if self.recomputed_bytes_per_iteration:
            lines.append(
                f"  recomputed per iteration: {gib(self.recomputed_bytes_per_iteration)} "
                f"({self.plan_summary.get('recomputed_tensors', 0)} saved tensors, not moved)"
            )
        for label, moved in (
            ("optimizer state", self.state_bytes_per_iteration),
            ("parameters", self.parameter_bytes_per_iteration),
        ):
            for direction, tiers in moved.items():
                if label == "parameters" and not any(tiers.values()):
                    continue
                host, ssd = gib(tiers.get(HOST, 0)), gib(tiers.get(SSD, 0))
                lines.append(f"  {direction} per iteration: host {host}, ssd {ssd} ({label})")
        if self.phases_ms:
            lines.append(
                "  phases: "
                + ", ".join(
                    f"{name} {v['measured']:.1f} ms (profiled ops {v['profiled']:.1f} ms)"
                    for name, v in self.phases_ms.items()
                )
            )
        if self.host_ms_per_iteration:
            lines.append(
                "  host time in teraio per iteration: "
                + ", ".join(f"{name} {v:.1f} ms" for name, v in self.host_ms_per_iteration.items())
            )
        unplanned_steps = self.step_times_ms[: self.steps - self.planned_steps]
        if unplanned_steps:
            planning = self.plan_summary.get("planning_s")
            lines.append(
                "  steps before the plan: "
                + ", ".join(f"{v:.0f} ms" for v in unplanned_steps)
                + (f"; planning took {planning:.1f} s" if planning is not None else "")
            )
        if self.prediction_warning:
            lines.append(f"  WARNING: {self.prediction_warning}")
        if self.checkpointed_blocks or self.checkpoint_summary:
            lines.append(
                f"  activation checkpointing: {len(self.checkpointed_blocks)} of "
                f"{self.checkpoint_summary.get('blocks', 0)} blocks"
            )
        if self.host_percent_of_ideal is not None:
            lines.append(f"  host time in hooks: {self.host_percent_of_ideal:.1f}% of the ideal iteration")
        if self.plan_summary.get("fits") is False:
            lines.append(f"  plan: does not fit the budget ({self.plan_summary.get('outcome')})")
        if self.host_step:
            lines.append("  " + host_step_line(self.host_step))
        lines.append("  stalls: " + ", ".join(f"{k} {v}" for k, v in self.stalls.items()))
        return "\n".join(lines)


def host_step_line(host_step: dict[str, Any]) -> str:
    """The report's line on FSDP2's host shards (`Report.host_step`)."""
    line = f"host shards (FSDP2 CPUOffloadPolicy): {host_step['elements']:,} elements"
    line += f" stepped by {host_step['by']}"
    if host_step.get("step_ms") is not None:
        line += f", {host_step['step_ms']:.1f} ms per step (median of {host_step['steps']})"
    if host_step.get("in_backward"):
        line += f"; in backward: {host_step['in_backward']} ({host_step['steps_in_backward']} steps"
        if host_step.get("wait_ms") is not None:
            line += f", the step waited {host_step['wait_ms']:.1f} ms for it"
        line += ")"
    return line
