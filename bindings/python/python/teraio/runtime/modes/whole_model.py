"""Whole-model offload: parameters, gradients and optimizer state live in host memory and on the
SSD store, and come to the GPU only while they are used.

`teraio.offload` switches to this mode when the model's parameters, gradients and optimizer
state do not fit the GPU budget (`whole_model="auto"`, see `needs_whole_model`). The model and the
training loop stay as they are; the optimizer object stays the user's, and its arithmetic is
torch's own (its `step` is called per window), so losses match training without offload.

Units. The model's repeated blocks (`blocks.find_blocks`: transformer layers) are units, and so
is every other module that owns parameters directly (embeddings, final norm, head). Each unit's
`forward` is wrapped on the instance:

- entering a unit brings its parameters in (their storage grows back and the bytes are copied up
  from their tier; `untyped_storage().resize_`, so the `Parameter` objects the model and the
  optimizer hold stay the same) and prefetches the next units of the recorded order, up to
  `pull_forward_bytes` ahead;
- leaving it (in the forward pass) releases the parameters again, except those autograd saved
  for backward (seen by a `saved_tensors_hooks` pack hook): those stay until their gradient is in;
- with activation checkpointing (every block by default in this mode: `checkpoint` None or
  "all"; "off" to leave activations to the user), backward's recomputation of a block enters the
  unit again, so its parameters come back exactly when backward needs them, and are released once
  their gradients are accumulated;
- what checkpointing keeps of a block, its inputs, waits for backward in pinned host memory
  (`checkpoint_inputs`, "host" on CUDA by default; `movers/saved.py`): copied out as
  `torch.utils.checkpoint` saves them, and back when backward enters the recomputation of the
  block after it. The last block's stay (backward starts there). So the activations the GPU
  holds do not grow with the number of blocks, and a larger batch fits the budget.

Gradients. A post-accumulate-grad hook on each parameter marks its gradient complete; a unit's
complete gradients move to their tier together (one batch of copies) when backward enters the next
unit, or ends (an autograd engine callback), and are dropped from the GPU (`param.grad = None`);
gradient accumulation over micro-batches adds the held gradient back on the GPU.

Residency. After the first and the second iteration, the GPU memory the iteration's peak left
unused (less the reserve the allocator's behaviour asks for) keeps the largest parameters resident
for good (`_keep_resident`).

The step. `optimizer.step` is replaced on the instance by a streamed step: for one window of
parameters at a time, their parameter, gradient and state bytes come in (the next window's reads
are issued first, so they overlap), `param.grad` is set for the window only, the user's optimizer
steps (torch optimizers skip parameters whose `grad` is None), and the updated parameters and
state go back to their tiers. The step's GPU memory is bounded by two windows.

The step on the CPU (`update="cpu"`, or "auto" where `capacity.choose_update_site` finds it
cheaper; `cpu_update.py`). With every kind in host memory, each parameter's fp32 master is its
pinned host buffer and its optimizer state CPU memory; `optimizer.step()` queues a CPU
instance of the user's optimizer on a worker thread, unit by unit in forward order, and each
unit's entry in the next forward waits for its own update (`_acquire`). Only parameters (in)
and gradients (out) cross the link. Parameters kept resident on the GPU are read again from
their updated master. Where the step runs at `optimizer.step()`, the GPU updates the units the
next forward pass enters last meanwhile, their masters, gradients and moments streamed from
pinned host memory (`gpu_step_share`, `_gpu_share`): as many as end with the worker's share.

Compute copies (`compute_copies="on"`, or "auto" where `capacity.choose_compute_copies` finds
they pay; with the CPU step). Under bf16 autocast a Linear reads a bf16 cast of its fp32 weight
and bias, and autograd widens their bf16 gradients back to fp32. Where every forward pass of the
first iteration runs under bf16 autocast on the device, each parameter of an exact
`torch.nn.Linear` that no other module shares (a tied head stays fp32; frozen LoRA base layers
qualify) gets a pinned bf16 copy in host memory beside its master, rounded from it on the update
worker right after the parameter's CPU update. From the second iteration the GPU reads the copy
(half the bytes) and sends the bf16 gradient out; the host widens it into the fp32 gradient
buffer (adding, over micro-batches, as autograd adds fp32 gradients), so the update sees the
fp32 gradient torch would have made: the same bits. A lone micro-batch's bf16 gradient is read
by the CPU step's kernel as it is; in a loop that accumulates, the worker widens each one as it
arrives, beside backward (`_queue_folds`), except the micro-batch that ends a step (as the last
step's count of backward passes says): it adds its gradients to the sums on the device
(`_sum_on_device`), so that the step's updates do not wait behind its folds on the worker. Each
unit's sums are read back ahead of its backward, as its parameters are, and leave in fp32 with
their norms taken, which a clip uses: torch takes the norms on the device (a host norm's bits
differ). Where a step ends sooner than expected, a clip reads the sums back. The `Parameter`
objects stay the ones the model and the optimizer hold; while the copies are on, a copied
parameter's `.data` is a bf16 tensor (its storage released and grown like any other), its fp32
`.data` comes back at exit and at `load_state_dict`, and `model.state_dict()` gives the fp32
masters.
A forward pass without bf16 autocast after that raises (`compute_copies="off"` streams fp32).
The copies take host memory beside the plan's (`capacity.compute_copy_room`); without room they
stay off, and the report says why.

The step in backward (`step_in_backward=True`, or "auto", the default, below). A parameter's
gradient is complete when its post-accumulate-grad hook runs; the parameter is then still on the
GPU, where backward used it.
With the step on the GPU, its optimizer state is read in ahead of it (with the parameters of the
next units backward recomputes), and the optimizer steps the parameters whose gradients are
complete when backward enters the next unit, and at the end of backward (an autograd engine
callback): gradients never leave the GPU and parameters are not read in again for the step.
With the step on the CPU, each unit's gradients go out as without the option and its update is
queued on the worker behind their copies (`_queue_cpu_updates`: the worker waits for their CUDA
event), so the CPU step runs beside the rest of backward. A clip or a second backward before
`optimizer.step()` raises: the update has already run. "auto" turns the CPU step in backward on
from iteration `IN_BACKWARD_AUTO_FROM` where the iterations before it took one backward per step,
clipped nothing and kept the hyperparameters through backward (`_decide_in_backward`); once on,
a clip that scales nothing stands and turns it off again, and the changes it cannot honour raise.

Data moves through the movers (`runtime/movers/tiers.py`: pinned host buffers allocated at start-up
under the host cap; the store through the engine's GPU path) and where each kind lives is the
capacity plan's (`runtime/plans/capacity.py`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import resource
import statistics
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from ... import blocks as bk
from ... import ids, timing
from ...head import LossHead
from ...machine import RESERVE_EXTRA_BYTES, measure_cpu_update, reserve_from_allocator, resolve_link
from ...options import OffloadOptions
from ...planning import format_bytes, parse_bandwidth, parse_size
from ...schedule_record import ScheduleRecorder
from ..errors import NoPlanFitsError, NoSpaceError, PlannerError
from ..movers.copy import flat_bytes
from ..movers.saved import SavedStats, SavedTensorMover
from ..movers.tiers import GPU, HOST, SSD, HostTier, SsdTier, Transfer
from ..plans import capacity as cp
from ..report import Report, check_prediction
from ..session import Budget, Session
from . import cpu_update

#: Whole-model mode starts when parameters + gradients + optimizer state exceed this share of the
#: GPU budget: a step with all of them resident peaks higher still (AdamW's foreach update holds
#: temporaries about the parameters' size: 1.25x for fp32 AdamW), and the allocator's reserve
#: (10% at least) must fit beside it...
WHOLE_MODEL_SHARE = 0.7
#: ...and parameters + gradients alone exceed this share. Below it the block plan trains: it keeps
#: them on the GPU and moves the optimizer state out between steps, stepping it in windows where
#: it cannot all come back. Where parameters and gradients take about 40% of the budget, the
#: block plan trains markedly faster than whole-model mode, which moves the parameters and
#: gradients over the link every iteration (docs/benchmarks.md, "Training as users train").
WHOLE_MODEL_WEIGHTS_SHARE = 0.45

#: Default step window: this share of the GPU budget (parameter + gradient + state bytes).
WINDOW_SHARE = 0.125

#: The gradient norm taken as each gradient leaves the GPU (torch's default for clip_grad_norm_);
#: a call asking for another norm type reads the gradients back.
GRAD_NORM_TYPE = 2.0

#: GPU gradients waiting for an SSD write, at most (the tier's writes run behind backward).
MAX_GRADIENT_WRITES_BYTES = 1 << 30

#: Checkpointed blocks' inputs in flight to the host before the forward pass waits for them (their
#: GPU memory is held until their copy is done).
INPUTS_IN_FLIGHT_BYTES = 1 << 30

#: The kinds of the compute copies' bytes (`compute_copies`), counted as parameter and gradient.
PARAMETER_COPY = (cp.PARAMETER, "copy")
GRADIENT_COPY = (cp.GRADIENT, "copy")
#: The dtype of the compute copies: autocast's bf16 (fp16 autocast rounds differently from a
#: stored copy only in name, but its gradients come with loss scaling: left to fp32).
COPY_DTYPE = torch.bfloat16

#: Why `update="auto"` with `step_in_backward=True` steps on the GPU: in backward both sites
#: overlap their work with backward, their costs are close, and the update-site model does not
#: tell them apart reliably across models and machines (docs/benchmarks.md, "Capacity", has
#: shapes where each wins). So "auto" keeps the GPU step, and the CPU step is the user's choice.
IN_BACKWARD_AUTO = (
    "step_in_backward=True with update='auto' steps on the GPU, where backward leaves each "
    "parameter; update='cpu' runs the CPU step in backward instead"
)

#: The iteration recorded for the prediction (0-based): the first after the residency decisions
#: that follow iterations 0 and 1 (`_keep_resident`).
RECORDED_ITERATION = 2
#: Iterations the report gives one by one (`WholeModelReport.wait_ms_by_iteration` and its
#: kin), from the first: where a run's iterations change pace, it is early.
ITERATIONS_REPORTED = 64
#: `step_in_backward="auto"` decides from the loop's iterations before this one (the recorded
#: iteration, so that the prediction replays the schedule the run keeps).
IN_BACKWARD_AUTO_FROM = RECORDED_ITERATION

#: `gpu_step_share="auto"`: bytes per element the GPU's share of the step moves each way (in:
#: the fp32 master, the gradient, bf16 for a compute copy's, and Adam's two fp32 moments; out:
#: the master, its bf16 copy and the moments), for its rate before one has been measured.
SHARE_BYTES_PER_ELEMENT = 15
#: ...and the worker's slowdown beside the share's copies, for its rate measured at a step
#: without a share: the engine's kernel took 447 ms beside copies both ways over the host link
#: against 360 ms beside an idle thread (docs/benchmarks.md, "The CPU step beside other work").
SHARE_CPU_SLOWDOWN = 447 / 360
#: The first step the GPU's share may take part in: step 0 creates the optimizer state (its
#: worker time is not the worker's rate) and step 1 measures that rate; the share then runs in
#: the recorded iteration's step, which the prediction replays.
SHARE_FROM_STEP = RECORDED_ITERATION

#: Python's thread switch interval while the CPU step runs (`sys.setswitchinterval`; Python's
#: default is 5 ms), restored at exit. The worker's optimizer takes the GIL back after each torch
#: op it calls; while the loop's thread runs Python (the forward pass's hooks), each take waits
#: up to one interval. On the H100 machine a fused AdamW step of 1.6G parameters in 24 units on a
#: worker thread took 314 ms beside an idle thread, 848 ms beside one running Python at 5 ms,
#: and 377 ms at 0.5 ms (benches/torch/probe_cpu_step.py).
CPU_STEP_SWITCH_INTERVAL_S = 0.0005


def state_bytes_estimate(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Optimizer state bytes: as they are if the optimizer has stepped, else what its kind will
    allocate (Adam, AdamW and their relatives: two tensors per parameter; SGD with momentum: one)."""
    present = sum(_nbytes(v) for p in list(optimizer.state) for _, v in _state_tensors(optimizer, p))
    if present:
        return present
    per_param = 0
    name = type(optimizer).__name__.lower()
    if "adam" in name or "lamb" in name:
        per_param = 2
    elif any(group.get("momentum", 0) for group in optimizer.param_groups):
        per_param = 1
    return per_param * sum(_nbytes(p) for p in _trained(optimizer))


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(parameters + gradients, parameters + gradients + optimizer state) in bytes: what the
    training state takes on the GPU without offload."""
    params = sum(_nbytes(p) for _, p in _named_unique_parameters(model))
    grads = sum(_nbytes(p) for p in _trained(optimizer))
    return params + grads, params + grads + state_bytes_estimate(model, optimizer)


def needs_whole_model(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, gpu_memory_bytes: int
) -> bool:
    """Whether parameters + gradients + optimizer state exceed `WHOLE_MODEL_SHARE` of the budget
    and parameters + gradients exceed `WHOLE_MODEL_WEIGHTS_SHARE` of it."""
    weights, everything = model_state_bytes(model, optimizer)
    return (
        everything > WHOLE_MODEL_SHARE * gpu_memory_bytes
        and weights > WHOLE_MODEL_WEIGHTS_SHARE * gpu_memory_bytes
    )


@dataclass
class WholeModelReport(Report):
    """What whole-model offload did (per-iteration figures: median over the steps after the
    first): the `Report` fields, then whole-model mode's."""

    mode: str = field(init=False, default="whole-model")
    step_ms: Optional[float]
    #: {"in"|"out": {tier: {kind: bytes}}} per iteration (median iteration's counts).
    bytes_per_iteration: dict[str, dict[str, dict[str, int]]]
    #: Where each kind lives: {tier: {kind: bytes}}.
    placement: dict[str, dict[str, int]]
    pinned_host_bytes: int
    peak_host_rss_bytes: int
    #: GPU bytes of streamed parameters, gradients and state the runtime held at once in the step.
    peak_step_window_bytes: int
    window_bytes: int
    windows: int
    units: int
    checkpointed_blocks: int
    #: Host time blocked waiting for transfers, per iteration (ms): before a unit's forward or
    #: recomputation, and inside the step.
    wait_ms_per_iteration: dict[str, float] = field(default_factory=dict)
    #: The same waits, and the hooks' host time (waits included, "hooks"), of each iteration in
    #: turn (the first `ITERATIONS_REPORTED`): where an iteration's time went up, which wait
    #: took it.
    wait_ms_by_iteration: list[dict[str, float]] = field(default_factory=list)
    #: The CUDA caching allocator's retries in each iteration (the first `ITERATIONS_REPORTED`):
    #: each found no free range for a request, synchronized the device and released its cache
    #: (a wait the others do not show).
    allocator_retries_by_iteration: list[int] = field(default_factory=list)
    # `host_ms_per_iteration` (Report): medians over the iterations after the first, "hooks"
    # (forward and backward, the step in backward included) and "step" (the streamed step).
    #: Units whose parameters were not prefetched in time and were fetched on demand.
    on_demand_fetches: int = 0
    #: Parameters the first two iterations' unused memory kept on the GPU for good (their GPU
    #: bytes: a compute copy's in bf16).
    resident_parameter_bytes: int = 0
    #: Where the state went at exit: "gpu", or "cpu" where it did not fit `gpu_memory`.
    returned_to: str = "gpu"
    #: The optimizer stepped each parameter in backward (`step_in_backward`) at the end.
    step_in_backward: bool = False
    #: Why the step ran in backward or not: the option, or what "auto" found in the loop.
    step_in_backward_reason: str = ""
    # `predicted_iteration_ms` (Report): the simulator's replay of the recorded iteration
    # (`RECORDED_ITERATION`) at the planned bandwidths (`machine`), with that iteration's loop
    # host time as an op of it (`ModelOffload._loop_host_ms`): None before that iteration ran.
    #: The replay's figures: compute and stall time, bytes per tier, the CPU step's jobs
    #: (`cpu_update_ms`, `cpu_jobs`), the bandwidths it assumed.
    prediction: dict[str, Any] = field(default_factory=dict)
    #: Where the measurement and the prediction differ by more than the tolerance.
    warnings: list[str] = field(default_factory=list)
    #: Parameters, gradients and optimizer state together: what training without offload holds
    #: on the GPU before any activation.
    model_state_bytes: int = 0
    #: Where the optimizer stepped ("gpu" or "cpu": `OffloadOptions.update`) and why.
    update: str = "gpu"
    update_reason: str = ""
    #: The CPU step's time in its worker thread per iteration (ms, median; it overlaps the next
    #: forward pass), and the model's per-iteration cost of each site (`choose_update_site`).
    cpu_update_ms: Optional[float] = None
    #: The worker's time of each iteration's CPU step in turn (ms, the first
    #: `ITERATIONS_REPORTED`; the folds of a loop that accumulates included).
    cpu_update_ms_by_iteration: list[float] = field(default_factory=list)
    #: What ran the CPU step: "teraio" (the engine's Adam/AdamW kernel, bitwise torch's fused
    #: CPU kernel) or "torch" (the optimizer's own CPU step), and why ("" for the GPU step).
    cpu_step_kernel: str = ""
    #: The GPU's share of the CPU step after backward (`OffloadOptions.gpu_step_share`): the
    #: elements it updated at each step (the first `ITERATIONS_REPORTED`; 0: none), its time on
    #: the training thread (ms, median over the steps that shared) and the setting.
    gpu_step_share_elements_by_iteration: list[int] = field(default_factory=list)
    gpu_step_share_ms: Optional[float] = None
    gpu_step_share: str = "off"
    update_model_ms: dict[str, Optional[float]] = field(default_factory=dict)
    #: The least this placement and update site must move per iteration, shaped as
    #: `bytes_per_iteration`: each parameter off the GPU read in once, each gradient out once,
    #: and for a step on the GPU what it reads and writes back (`ModelOffload.minimum_bytes`).
    minimum_bytes_moved: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    #: The causal-LM loss as it ran (`OffloadOptions.loss_head`, `teraio.head`).
    loss_head: str = ""
    #: The compute copies (`OffloadOptions.compute_copies`): their dtype ("bfloat16") or "off",
    #: why, how many parameters and their elements, and the pinned host bytes they take.
    compute_copies: str = "off"
    compute_copies_reason: str = ""
    compute_copy_parameters: int = 0
    compute_copy_elements: int = 0
    compute_copy_bytes: int = 0
    #: Where the checkpointed blocks' inputs waited for backward (`OffloadOptions.checkpoint_inputs`:
    #: "host" or "gpu"), the pinned bytes their host buffers took (in `pinned_host_bytes` too),
    #: and the saves left on the GPU for want of host memory (cumulative).
    checkpoint_inputs: str = "gpu"
    checkpoint_inputs_pinned_bytes: int = 0
    checkpoint_inputs_kept_for_room: int = 0
    #: Tokens per iteration (the integer tensors, token ids, the model's forward passes took with
    #: gradients on; None for a model fed no such tensor), tokens per second at the measured
    #: iteration, and the model FLOPs rate they make: 6 x parameters x tokens per second (no
    #: attention, no recomputation), in TFLOPS.
    tokens_per_iteration: Optional[int] = None
    tokens_per_s: Optional[float] = None
    model_tflops: Optional[float] = None
    #: Options that would change this run's speed, each with why (`step_in_backward_hint`).
    hints: list[str] = field(default_factory=list)
    #: The largest micro-batch the loop ran (sequences; None where its forward takes no token
    #: ids), and the largest the budget holds, estimated (`ModelOffload.batch_fit`; None
    #: without an estimate), with how it was made.
    batch: Optional[int] = None
    largest_batch: Optional[int] = None
    largest_batch_note: str = ""

    def _share_line(self) -> str:
        shared = [n for n in self.gpu_step_share_elements_by_iteration if n]
        if not shared:
            return f"  GPU's share of the CPU step ({self.gpu_step_share}): none"
        return (
            f"  GPU's share of the CPU step ({self.gpu_step_share}): {len(shared)} of "
            f"{len(self.gpu_step_share_elements_by_iteration)} steps, {statistics.median(shared) / 1e6:.1f}M "
            f"elements each (median), {self.gpu_step_share_ms or 0:.1f} ms on the training thread"
        )

    def __str__(self) -> str:
        def gib(value: Optional[int]) -> str:
            return "-" if value is None else format_bytes(value)

        ms = "-" if self.measured_iteration_ms is None else f"{self.measured_iteration_ms:.1f} ms"
        step = f"step {self.step_ms or 0:.1f} ms in {self.windows} windows of <= {gib(self.window_bytes)}"
        lines = [
            f"teraio whole-model offload: {self.steps} steps, {self.units} units, "
            f"{self.checkpointed_blocks} blocks checkpointed",
            f"  iteration: {ms} (median after the first); "
            + (
                f"step in backward on the CPU, unit by unit, {self.cpu_update_ms or 0:.1f} ms in its worker "
                "(overlapping backward and the next forward pass)"
                if self.step_in_backward and self.update == "cpu"
                else "step in backward, unit by unit"
                if self.step_in_backward
                else f"step on the CPU, {self.cpu_update_ms or 0:.1f} ms in its worker (overlapping "
                "the next forward pass)"
                if self.update == "cpu"
                else step
            ),
            f"  update on the {self.update.upper()}: {self.update_reason}",
            f"  step in backward: {self.step_in_backward_reason}",
            *([f"  CPU step kernel: {self.cpu_step_kernel}"] if self.cpu_step_kernel else []),
            *([self._share_line()] if self.cpu_step_kernel else []),
            *(
                [
                    f"  throughput: {self.tokens_per_iteration} tokens per iteration, "
                    f"{self.tokens_per_s:.0f} tokens/s, {self.model_tflops:.1f} TFLOPS "
                    "(6 x parameters x tokens)"
                ]
                if self.tokens_per_s is not None and self.model_tflops is not None
                else []
            ),
            f"  peak GPU memory {gib(self.peak_gpu_bytes)} (budget {gib(self.gpu_memory_bytes)}), "
            f"step windows {gib(self.peak_step_window_bytes)}",
            *(
                [
                    f"  batch {self.batch}; the largest that fits: "
                    + ("unknown" if self.largest_batch is None else str(self.largest_batch))
                    + f" ({self.largest_batch_note})"
                ]
                if self.largest_batch_note
                else []
            ),
            f"  without offload: parameters, gradients and optimizer state alone take "
            f"{gib(self.model_state_bytes)}, {self.model_state_bytes / max(self.gpu_memory_bytes, 1):.2f}x "
            "the budget",
            f"  pinned host {gib(self.pinned_host_bytes)}, peak host RSS {gib(self.peak_host_rss_bytes)}; "
            f"parameters kept on the GPU {gib(self.resident_parameter_bytes)}",
            f"  loss head: {self.loss_head}",
            f"  compute copies: {self.compute_copies} ({self.compute_copies_reason})"
            + (
                f", {self.compute_copy_parameters} parameters, {gib(self.compute_copy_bytes)} pinned"
                if self.compute_copy_parameters
                else ""
            ),
        ]
        if self.checkpoint_inputs == HOST:
            lines.append(
                f"  checkpointed blocks' inputs: off the GPU ({gib(self.checkpoint_inputs_pinned_bytes)} of "
                "pinned host buffers, the rest through the store), "
                f"{self.checkpoint_inputs_kept_for_room} saves kept on the GPU for want of room"
            )
        for tier, kinds in self.placement.items():
            lines.append(f"  on {tier}: " + ", ".join(f"{k} {gib(v)}" for k, v in kinds.items()))
        for direction, tiers in self.bytes_per_iteration.items():
            for tier, kinds in tiers.items():
                if any(kinds.values()):
                    least = self.minimum_bytes_moved.get(direction, {}).get(tier, {})
                    moved = ", ".join(
                        f"{k} {gib(v)} (least {gib(least.get(k, 0))})" for k, v in kinds.items() if v
                    )
                    lines.append(f"  {direction} per iteration, {tier}: {moved}")
        if self.peak_gpu_bytes is not None and self.peak_gpu_bytes > self.gpu_memory_bytes:
            lines.append(
                f"  WARNING: peak GPU memory {gib(self.peak_gpu_bytes)} is above gpu_memory: this mode "
                "moves parameters, gradients and optimizer state; activations are only reduced by "
                "checkpointing the blocks (none found, or checkpoint='off')"
                if self.checkpointed_blocks == 0
                else f"  WARNING: peak GPU memory {gib(self.peak_gpu_bytes)} is above gpu_memory"
            )
        if self.wait_ms_per_iteration:
            waits = ", ".join(f"{k} {v:.1f} ms" for k, v in self.wait_ms_per_iteration.items())
            lines.append(f"  host waits per iteration: {waits}; on-demand fetches {self.on_demand_fetches}")
        if self.predicted_iteration_ms is None:
            lines.append(f"  predicted: none (the prediction replays iteration {RECORDED_ITERATION + 1})")
        else:
            p = self.prediction
            lines.append(
                f"  predicted {self.predicted_iteration_ms:.1f} ms (the simulator's replay of iteration "
                f"{RECORDED_ITERATION + 1}: GPU work {p['compute_ms']:.1f} ms, waits "
                f"{p['stall_ms']:.1f} ms"
                + (f", CPU step {p['cpu_update_ms']:.1f} ms on its worker" if p.get("cpu_jobs") else "")
                + "; the loop's host time between iterations "
                f"{p['outside_span_ms']:.1f} ms), measured {ms}: {self.prediction_error_percent:+.1f}%; "
                f"that iteration ran {p['recorded_span_ms']:.1f} ms, "
                f"{p['recorded_waits_ms']:.1f} ms of it waits; host link {_rate(p['host_link_bytes_per_s'])} "
                f"one way, {_rate(p['host_link_duplex_bytes_per_s'])} each way both at once"
            )
        lines.extend(f"  WARNING: {w}" for w in self.warnings)
        lines.extend(f"  hint: {h}" for h in self.hints)
        if self.host_ms_per_iteration and self.measured_iteration_ms:
            total = sum(self.host_ms_per_iteration.values())
            parts = ", ".join(f"{name} {v:.1f} ms" for name, v in self.host_ms_per_iteration.items())
            lines.append(
                f"  host time in teraio per iteration: {total:.1f} ms "
                f"({total / self.measured_iteration_ms:.0%} of the iteration: {parts})"
            )
        return "\n".join(lines)


class _Slot:
    """One parameter: where its kinds live and what is on the GPU now."""

    __slots__ = (
        "index",
        "name",
        "param",
        "nbytes",
        "tiers",
        "resident",
        "fetch",
        "write",
        "release_pending",
        "saved",
        "grad_held",
        "incoming_grad",
        "incoming_sum",
        "incoming_state",
        "units",
        "update",
        "stale",
        "full",
        "low",
        "copied",
        "fold",
        "folding",
    )

    def __init__(self, index: int, name: str, param: torch.nn.Parameter, tiers: dict[str, str]) -> None:
        self.index = index
        self.name = name
        self.param = param
        self.nbytes = int(param.untyped_storage().nbytes())
        self.tiers = tiers
        self.resident = True  # the GPU storage holds the bytes (or a queued read will)
        self.fetch: Optional[Transfer] = None  # a read in flight into the storage
        self.write: Optional[Transfer] = None  # an SSD write reading the storage
        self.release_pending = False  # release once `write` is done (`_poll`)
        self.saved = False  # autograd saved it in this forward pass: keep until its gradient
        self.grad_held = False  # a gradient of this iteration is in its tier
        self.incoming_grad: Optional[tuple[torch.Tensor, Transfer]] = None  # read for the step
        # The held gradient read back in backward to add this micro-batch's to (`_sum_on_device`).
        self.incoming_sum: Optional[tuple[torch.Tensor, Transfer]] = None
        self.incoming_state: Optional[list[Transfer]] = None  # state reads for a step in backward
        self.units: list[int] = []
        # The CPU step (update="cpu"): its update of this parameter's master, if not done yet,
        # and whether the GPU copy of a parameter kept resident is older than its master.
        self.update: Optional[concurrent.futures.Future[float]] = None
        self.stale = False
        # Compute copies: the fp32 `.data` (`full`) and the bf16 one (`low`, a candidate's only),
        # whether `.data` is `low` now, and the bf16 gradient in host memory not yet widened
        # into the fp32 buffer: None, "copy" (the step's first) or "add" (a later micro-batch).
        self.full = param.data
        self.low: Optional[torch.Tensor] = None  # set where the copies went on
        self.copied = False
        self.fold: Optional[str] = None
        # A loop that accumulates: that fold queued on the CPU step's worker (`_queue_folds`).
        self.folding: Optional[concurrent.futures.Future[float]] = None


@dataclass
class _Unit:
    name: str
    module: torch.nn.Module
    slots: list[int]


class ModelOffload(Session):
    """Whole-model offload around an unchanged training loop (see the module docstring). Made by
    `teraio.offload` when the model's state does not fit; use it the same way."""

    def __init__(self, model: Module, optimizer: Optimizer, options: OffloadOptions, budget: Budget) -> None:
        super().__init__(model, optimizer, options, budget)
        # Before the state moves to the tiers (where the optimizer's own tensors are placeholders).
        self.model_state_bytes = model_state_bytes(model, optimizer)[1]
        self.recorder = ScheduleRecorder(self.device)
        # A Hugging Face causal LM's loss in chunks: its fp32 logits would be the iteration's
        # largest tensor (8 x 2048 tokens of a 128K vocabulary: 7.8 GiB).
        self.loss_head = LossHead(model, options.loss_head == "chunked", options.fp32_outputs == "loss_only")
        named = _named_unique_parameters(model)
        _refuse_shared_storage(named)
        _refuse_foreign_parameters(named, optimizer)
        trained = {id(p) for p in _trained(optimizer)}
        state_per_param = self._state_bytes_per_param([p for _, p in named], trained)
        sizes = [
            cp.SlotSize(
                name, _nbytes(p), _nbytes(p) if id(p) in trained else 0, state_per_param.get(id(p), 0)
            )
            for name, p in named
        ]
        # Optimizer state bytes per parameter (as planned: before the first step, an estimate).
        self._state_bytes = [size.state for size in sizes]
        window = options.step_window
        window_bytes = int(WINDOW_SHARE * self.gpu_memory_bytes) if window == "auto" else parse_size(window)
        ssd_free = (
            None if self.store is None else sum(int(d["free_bytes"]) for d in self.store.info()["devices"])
        )
        self.plan = self._place(sizes, window_bytes, ssd_free)
        # The bandwidths the prediction assumes (measured once, cached with the store).
        self.link = resolve_link(self.device, self.store, options, self.machine)
        self.update_site = self._choose_update_site(sizes, [p for _, p in named if id(p) in trained])
        self.machine["update"] = f"{self.update_site.site}: {self.update_site.reason}"
        # Gradients leave the GPU for their tier unless the step in backward runs on the GPU,
        # where they are used as backward leaves them: then no tier holds them.
        self.moves_gradients = not (
            options.step_in_backward is True and self.update_site.site == cp.GPU_UPDATE
        )
        if not self.moves_gradients:
            sizes = [dataclasses.replace(size, gradient=0) for size in sizes]
            self.plan = self._place(sizes, window_bytes, ssd_free)
        # The CPU step: made at `__enter__`, once the masters are in their host buffers.
        self.cpu_update: Optional[cpu_update.CpuUpdate] = None
        self._cpu_worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # Python's switch interval before the CPU step shortened it (`CPU_STEP_SWITCH_INTERVAL_S`).
        self._switch_interval: Optional[float] = None
        # The worker's time in the CPU step, this iteration's so far: the last step's updates
        # and, in a loop that accumulates, this iteration's folds (which run while the training
        # thread closes the last iteration, hence the lock).
        self._cpu_update_s = 0.0
        self._cpu_update_lock = threading.Lock()
        self._cpu_update_ms: list[float] = []
        self._updates_pending = False
        # The GPU's share of the CPU step after backward (`gpu_step_share`, `_gpu_share`): the
        # elements it updated at each step, its time there, the last step's CPU jobs (future,
        # elements) and both sides' measured seconds per element; the first forward pass's
        # compute marks (`_end_forward_mark`) and their sum in the last iteration; whether its
        # copies out may still be in flight.
        self._share_setting = options.gpu_step_share
        self._share_elements: list[int] = []
        self._share_ms: list[float] = []
        self._cpu_jobs: list[tuple[concurrent.futures.Future[float], int]] = []
        self._cpu_s_per_element: Optional[float] = None
        self._gpu_s_per_element: Optional[float] = None
        self._forward_marks: list[list[Any]] = []
        self._forward_s: Optional[float] = None
        self._share_writes_pending = False
        # The record's name and bytes of each tensor of the GPU's share it read, and why the
        # share was turned off ("": it was not).
        self._share_records: dict[Any, tuple[str, int]] = {}
        self._share_refusal = ""
        # Step in backward on the CPU: this backward has queued updates (`_queue_cpu_updates`).
        self._updating_in_backward = False
        self._original_state_dict: Optional[Callable[..., Any]] = None
        # The instance forward (None: the class's) of each module whose forward is wrapped.
        self._instance_forwards: dict[torch.nn.Module, Optional[Callable[..., Any]]] = {}
        streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if self.cuda else None
        self.host = HostTier(self.device, self.host_memory_bytes, streams)
        self.ssd: dict[str, SsdTier] = {}
        if self.store is not None:
            self.ssd = {
                cp.PARAMETER: SsdTier(self.device, self.store, ids.base("model_parameters")),
                cp.GRADIENT: SsdTier(self.device, self.store, ids.base("model_gradients")),
                cp.STATE: SsdTier(self.device, self.store, ids.base("model_optimizer_state")),
                cp.ACTIVATION: SsdTier(self.device, self.store, ids.base("model_activations")),
            }
        self.slots = [_Slot(i, name, p, self.plan.tiers[i]) for i, (name, p) in enumerate(named)]
        self._slot_of = {id(slot.param): slot for slot in self.slots}
        # Compute copies: the candidates now; on at the first step, where the first iteration ran
        # under bf16 autocast (`_enable_copies`).
        self._copy_slots = [self.slots[i] for i in _copy_candidates(model, named)]
        self.compute_copies: Optional[torch.dtype] = None
        self._copies_reason = self._copies_refusal()
        self._autocast_bf16: Optional[bool] = None  # every forward pass of iteration 0 so far
        self.compute_copy_bytes = 0
        # Parameters whose release waits for an SSD write (`_release`, `_poll`).
        self._releasing: list[_Slot] = []
        self.pull_forward_bytes = parse_size(options.pull_forward_bytes)
        self.step_in_backward = options.step_in_backward is True
        # step_in_backward="auto": the loop's shape until it is decided (`_decide_in_backward`),
        # the indices of the parameters this backward updated, a pending reason to turn it off
        # at the next `optimizer.step()`, and why it is on or off (the report's).
        self._in_backward_auto = options.step_in_backward == "auto"
        self._backwards_since_step = 0
        # Backward passes the last `optimizer.step()` closed (its micro-batches; 0 before one).
        self._backwards_per_step = 0
        self._hyperparameters_at_backward: Optional[list[dict[str, Any]]] = None
        self._loop_changed_hyperparameters = False
        self._updated_in_backward: set[int] = set()
        self._in_backward_off = ""
        self.step_in_backward_reason = (
            f"step_in_backward={options.step_in_backward}"
            if not self._in_backward_auto
            else f"auto: off, the step runs on the GPU ({self.update_site.reason})"
            if self.update_site.site != cp.CPU_UPDATE
            else f"auto: decided at the end of iteration {IN_BACKWARD_AUTO_FROM} (off until then)"
        )
        # Parameters whose gradient is complete, waiting (until backward enters the next unit or
        # ends) for their update (step in backward) or to move it out (a unit's as one batch).
        self._ready: list[_Slot] = []
        self._gradients: list[_Slot] = []
        # The backward pass whose end is watched for those (its graph task id), and with the step
        # in backward the one that updated the model in this iteration.
        self._watched_task: Optional[int] = None
        self._stepping_task: Optional[int] = None
        # Resident parameters by storage address: what the pack hook recognises.
        self._slot_at = {slot.param.untyped_storage().data_ptr(): slot for slot in self.slots}
        self.units = self._find_units()
        self.blocks = bk.find_blocks(model) if (options.checkpoint or "all") != "off" else []
        self.checkpointer = bk.Checkpointer(self.blocks)
        # The checkpointed blocks' inputs: on the host (their saves go through `self.inputs`)
        # or kept on the GPU. Host buffers get what host_memory leaves beside the plan
        # (`__enter__`, `_enable_copies`).
        inputs = options.checkpoint_inputs
        if inputs == "auto":
            inputs = HOST if self.cuda else GPU
        self.checkpoint_inputs = inputs if self.blocks else GPU
        self._block_position = {id(module): p for p, (_, module) in enumerate(self.blocks)}
        self.saved_stats = SavedStats()
        self.inputs = SavedTensorMover(
            self.device,
            0,
            self.saved_stats,
            options.min_bytes,
            set(),
            on_full="keep",
            streams=streams,
            spill=self.ssd.get(cp.ACTIVATION),
        )
        self.inputs.window = INPUTS_IN_FLIGHT_BYTES
        self.inputs.on_moved = self._record_input_out
        self._inputs_block: Optional[int] = None  # the block whose inputs are being saved
        # The mover's bytes out and in per tier at the last iteration's end.
        self._saved_moved: dict[tuple[str, str], int] = {}
        # Bytes of each optimizer-state tensor moved out: (("optimizer_state", name), slot) -> n.
        self._state_nbytes: dict[Any, int] = {}
        self._seen_state: set[tuple[int, str]] = set()
        # Optimizer state whose SSD write is in flight: released once written.
        self._state_writes: list[tuple[Transfer, torch.Tensor, int, int]] = []
        self._gradient_writes: list[tuple[Transfer, int]] = []
        # The units entered in the first iteration, in order (forward, then recomputation in
        # backward): later iterations prefetch along it.
        self._order: list[int] = []
        self._order_in_backward: list[bool] = []  # whether each entry was backward's
        self._recorded: Optional[list[int]] = None
        self._position = 0
        self._saved_hooks: Any = None
        self._original_step: Optional[Callable[..., Any]] = None
        self._original_zero_grad: Optional[Callable[..., Any]] = None
        # Each held gradient's norm (taken as it left the GPU) and the clip coefficient of this
        # iteration, if `clip_grad_norm_` was called (`_take_over_clipping`).
        self._grad_norms: dict[int, torch.Tensor] = {}
        # (coefficient, foreach, the held gradients it scales)
        self._clip: Optional[tuple[torch.Tensor, Optional[bool], set[int]]] = None
        # Whether the loop has clipped, or accumulated gradients over backward passes (the
        # report's hint for the step in backward).
        self._loop_clipped = False
        self._loop_accumulated = False
        self._counts = _Counts()
        self._iterations: list[_Counts] = []
        self._step_started = 0.0
        # Host times (`time.perf_counter`) in the recorded iteration: its start, the first unit's
        # entry, and the end of the CPU step's wait for the gradients' copies (`_loop_host_ms`).
        self._recorded_marks: dict[str, float] = {}
        self._step_ms: list[float] = []
        self._retries_seen = 0  # the allocator's retries at the last iteration's end
        self._window_bytes = 0  # GPU bytes of streamed tensors the step holds now
        self.peak_step_window_bytes = 0
        self.on_demand_fetches = 0
        #: Where the model's state went at exit: "gpu" (where it was), or "cpu" when it did not fit.
        self.returned_to = "gpu"
        #: Parameters kept on the GPU after the first two iterations (`_keep_resident`).
        self.resident_parameter_bytes = 0
        self.steps = 0

    # -- set-up --------------------------------------------------------------------------------

    def _state_bytes_per_param(self, params: list[torch.nn.Parameter], trained: set[int]) -> dict[int, int]:
        present = {id(p): sum(_nbytes(v) for _, v in _state_tensors(self.optimizer, p)) for p in params}
        if any(present.values()):
            return present
        total = sum(_nbytes(p) for p in params if id(p) in trained)
        share = state_bytes_estimate(self.model, self.optimizer) / total if total else 0
        return {id(p): int(share * _nbytes(p)) for p in params if id(p) in trained}

    def _place(self, sizes: list[cp.SlotSize], window_bytes: int, ssd_free: Optional[int]) -> cp.CapacityPlan:
        try:
            return cp.place(
                sizes,
                host_capacity_bytes=self.host_memory_bytes,
                ssd_capacity_bytes=ssd_free,
                window_bytes=window_bytes,
            )
        except cp.CapacityError as error:
            kind = NoSpaceError if error.store_full else NoPlanFitsError
            raise kind(f"teraio.offload: {error}") from None

    def _choose_update_site(
        self, sizes: list[cp.SlotSize], trained: list[torch.nn.Parameter]
    ) -> cp.UpdateSite:
        """Where the optimizer steps (`options.update`, `capacity.choose_update_site`), at
        `optimizer.step()` or, with `step_in_backward`, as backward completes each unit's
        gradients. `sizes` count every trained parameter's gradient, as the CPU step moves them.
        With `step_in_backward` "auto" keeps the GPU step (`IN_BACKWARD_AUTO`)."""
        requested = self.options.update
        if self.options.step_in_backward is True and requested == "auto":
            requested = cp.GPU_UPDATE
        refusal = None
        if not self.cuda and self.options.update == "auto":
            refusal = 'the device is the CPU, where the "gpu" step already runs'
        else:
            refusal = cpu_update.refusal(self.optimizer, trained)
        given = self.options.cpu_update_bandwidth
        rate: Optional[float] = None
        if given != "auto":
            rate = parse_bandwidth(given)
        elif self.options.update == "auto" and refusal is None and not self.plan.ssd_total:
            rate = measure_cpu_update(kernel=cpu_update.kernel_refusal(self.optimizer) is None)
            self.machine["cpu_update_bytes_per_s"] = rate
        site = cp.choose_update_site(
            sizes,
            self.plan,
            requested=requested,
            host_link_bytes_per_s=min(self.link.d2h, self.link.h2d),
            cpu_update_bytes_per_s=rate,
            cpu_refusal=refusal,
            in_backward=self.options.step_in_backward is True,
        )
        if requested != self.options.update:
            site = dataclasses.replace(site, reason=IN_BACKWARD_AUTO)
        return site

    def _copies_refusal(self) -> str:
        """Why the compute copies cannot be on, as far as the set-up tells ("" : they may)."""
        if self.options.compute_copies == "off":
            return "compute_copies='off'"
        if self.update_site.site != cp.CPU_UPDATE:
            return "the step runs on the GPU, which reads and writes the fp32 parameters"
        if not self._copy_slots:
            return "no parameter is an exact torch.nn.Linear's own"
        return ""

    def _check_autocast(self) -> None:
        """A unit's forward: the first iteration's say whether the copies can be on; once they
        are, a forward pass without bf16 autocast would get bf16 weights: it raises."""
        kind = self.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        if self.compute_copies is not None:
            if dtype != self.compute_copies:
                raise RuntimeError(
                    "teraio.offload (whole-model): this forward pass runs "
                    + ("without autocast" if dtype is None else f"under {dtype} autocast")
                    + f", but the first iteration ran under {self.compute_copies} autocast and the Linear "
                    f"layers' weights are {self.compute_copies} compute copies now: run every forward "
                    f"pass under torch.autocast({kind!r}, dtype={self.compute_copies}), or pass "
                    "compute_copies='off'"
                )
        elif self.steps == 0 and self._autocast_bf16 is not False:
            self._autocast_bf16 = dtype == COPY_DTYPE

    def _enable_copies(self, stepped: list[_Slot]) -> None:
        """At the first CPU step: the compute copies go on where the first iteration ran under
        bf16 autocast and host memory has room (else the report says why not). The copies of
        `stepped` are made by their update; the others' now."""
        if self._copies_reason:
            return
        if not self._autocast_bf16:
            self._copies_reason = (
                "the first iteration's forward pass did not run under bf16 autocast on the device, "
                "so the layers read the fp32 weights"
            )
            return
        need = sum(
            _numel_bytes(slot.param, COPY_DTYPE) * (1 + slot.param.requires_grad) for slot in self._copy_slots
        )
        # The checkpointed blocks' inputs took their host buffers in the first iteration.
        refusal = cp.compute_copy_room(self.plan, self.host_memory_bytes - self.inputs.used_bytes, need)
        if refusal is not None:
            self._copies_reason = refusal
            return
        reason = "compute_copies='on'"
        if self.options.compute_copies == "auto":
            worth, reason = self._copies_pay()
            if not worth:
                self._copies_reason = reason
                return
        self.compute_copies = COPY_DTYPE
        self._copies_reason = f"the forward pass runs under bf16 autocast; {reason}"
        self.inputs.capacity_bytes = max(0, self.inputs.capacity_bytes - need)
        for slot in self._copy_slots:
            nbytes = _numel_bytes(slot.param, COPY_DTYPE)
            self.host.reserve((PARAMETER_COPY, slot.index), nbytes)
            if slot.param.requires_grad:
                self.host.reserve((GRADIENT_COPY, slot.index), nbytes)
            self.compute_copy_bytes += nbytes * (1 + slot.param.requires_grad)
            low = torch.empty(slot.param.shape, dtype=COPY_DTYPE, device=self.device)
            low.untyped_storage().resize_(0)
            slot.low = low
        self._copies_on(skip={slot.index for slot in stepped})

    def _copies_pay(self) -> tuple[bool, str]:
        """`capacity.choose_compute_copies` at the planned link and the CPU step's rate (as the
        update site's choice took it, or measured now). On a CPU "device" no link is saved."""
        if not self.cuda:
            return False, 'the device is the CPU: no host link to save (compute_copies="on" forces them)'
        kernel = self.cpu_update is not None and self.cpu_update.kernel is not None
        rate: Optional[float] = None
        total: Optional[int] = None
        if not kernel:  # the kernel converts in its pass: no rate to weigh the copies against
            given = self.options.cpu_update_bandwidth
            rate = self.machine.get("cpu_update_bytes_per_s")
            if rate is None:
                rate = parse_bandwidth(given) if given != "auto" else measure_cpu_update()
            sizes = self._state_bytes
            total = sum(
                slot.nbytes * (1 + slot.param.requires_grad) + sizes[slot.index] for slot in self.slots
            )
        copied = sum(slot.nbytes for slot in self._copy_slots)
        return cp.choose_compute_copies(
            copied_bytes=copied,
            copied_gradient_bytes=sum(slot.nbytes for slot in self._copy_slots if slot.param.requires_grad),
            cpu_step_s=None if total is None or rate is None else total / rate,
            cpu_update_bytes_per_s=rate,
            host_link_bytes_per_s=min(self.link.d2h, self.link.h2d),
            converted_in_step=kernel,
        )

    def _copies_on(self, skip: Optional[set[int]] = None) -> None:
        """Each copied parameter's `.data` becomes its bf16 tensor (its fp32 GPU storage goes;
        its master is current in host memory), and its host copy is rounded from the master
        (those in `skip`: by their queued update)."""
        if self.cuda:
            self.host.flush()
            self.host.d2h.synchronize()  # the masters written at the start or after a load
        for slot in self._copy_slots:
            assert slot.low is not None and not slot.copied
            kept = slot.tiers[cp.PARAMETER] == GPU
            self._drop_gpu_storage(slot)
            slot.param.data = slot.low
            slot.copied = True
            if skip is None or slot.index not in skip:
                self._round_copy(slot)
            if kept:
                # Kept on the GPU: its copy comes up at its next use (`_acquire`).
                slot.param.untyped_storage().resize_(_numel_bytes(slot.param, COPY_DTYPE))
                slot.resident = True
                self._slot_at[slot.param.untyped_storage().data_ptr()] = slot
                slot.stale = True

    def _drop_gpu_storage(self, slot: _Slot) -> None:
        """Releases the parameter's GPU storage where it is resident, before its `.data` changes
        dtype (its bytes are current in host memory)."""
        if slot.resident:
            self._join(slot)
            self._slot_at.pop(slot.param.untyped_storage().data_ptr(), None)
            slot.param.untyped_storage().resize_(0)
            slot.resident = False

    def _round_copy(self, slot: _Slot) -> None:
        """The host copy of the parameter, rounded from its master (as autocast's cast rounds)."""
        key = slot.index
        self.host.convert((PARAMETER_COPY, key), COPY_DTYPE, (cp.PARAMETER, key), slot.full.dtype)

    def _widen(self, slot: _Slot, fold: str) -> None:
        """The bf16 gradient in host memory into the fp32 gradient buffer: `float(bf16)` (the
        step's first) or added to it, as autograd adds an fp32 parameter's gradients."""
        key = slot.index
        self.host.convert(
            (cp.GRADIENT, key), slot.full.dtype, (GRADIENT_COPY, key), COPY_DTYPE, add=fold == "add"
        )

    def _fold(self, slot: _Slot) -> None:
        """Widens the parameter's bf16 gradient now, once its copy to host memory is done (or
        waits for the worker's fold of it)."""
        self._await_fold(slot)
        fold, slot.fold = slot.fold, None
        if fold is not None:
            self.host.wait_written((GRADIENT_COPY, slot.index))
            self._widen(slot, fold)

    def _await_fold(self, slot: _Slot) -> None:
        """Waits for the worker's fold of the parameter's bf16 gradient, if one is queued: it
        reads the bf16 buffer the next gradient overwrites and writes the fp32 one."""
        folding, slot.folding = slot.folding, None
        self._await_job(folding)

    def _queue_folds(self, slots: list[_Slot]) -> None:
        """A loop that accumulates gradients (seen so far): the bf16 gradients of `slots`, whose
        copies out are issued, are widened into their fp32 buffers on the CPU step's worker once
        those copies are done, beside backward; otherwise the next micro-batch's backward would
        widen them on the training thread, and the step the last ones ahead of the update."""
        # A first micro-batch's gradients that the next backward adds to on the device stay bf16.
        kept = "copy" if self._next_backward_sums_on_device() else None
        folds = [(slot, slot.fold) for slot in slots if slot.fold is not None and slot.fold != kept]
        if not folds or self._cpu_worker is None:
            return
        events = self._copies_out_events([(GRADIENT_COPY, slot.index) for slot, _ in folds])
        future = self._cpu_worker.submit(self._run_folds, folds, events)
        self.recorder.cpu_job(future, waits_for=[(cp.GRADIENT, slot.index) for slot, _ in folds], produces=[])
        for slot, _ in folds:
            slot.fold = None
            slot.folding = future

    def _run_folds(self, folds: list[tuple[_Slot, str]], copies_out: list[Any]) -> float:
        """Runs `_queue_folds`' job on the worker; returns its seconds there, the wait for the
        gradients' copies left out (as `_run_cpu_update`)."""
        for event in copies_out:
            event.synchronize()
        started = time.perf_counter()
        for slot, fold in folds:
            self._widen(slot, fold)
        elapsed = time.perf_counter() - started
        self._add_worker_time(elapsed)
        return elapsed

    def _copies_off(self) -> None:
        """Each copied parameter's fp32 `.data` again (exit, a load): pending gradients widened,
        the bf16 GPU storage released; a parameter kept on the GPU reads its master back."""
        self._await_updates()
        for slot in self._copy_slots:
            self._fold(slot)
            if not slot.copied:
                continue
            self._drop_gpu_storage(slot)
            slot.param.data = slot.full
            slot.copied = False
            slot.stale = False
            if slot.tiers[cp.PARAMETER] == GPU:
                slot.param.untyped_storage().resize_(slot.nbytes)
                self._counts.add("in", HOST, cp.PARAMETER, slot.nbytes)
                slot.fetch = self.host.read((cp.PARAMETER, slot.index), flat_bytes(slot.param))
                slot.resident = True
                self._slot_at[slot.param.untyped_storage().data_ptr()] = slot

    def _param_kind(self, slot: _Slot) -> Any:
        return PARAMETER_COPY if slot.copied else cp.PARAMETER

    def _make_cpu_update(self) -> None:
        """The CPU optimizer over the host buffers, with the user's optimizer's state (at the
        start, and after a load inside the session, which gave the state back)."""
        trained = [slot for slot in self.slots if slot.param.requires_grad]
        self.cpu_update = cpu_update.CpuUpdate(
            self.optimizer,
            {id(s.param): self.host.buffers[(cp.PARAMETER, s.index)] for s in trained},
            {id(s.param): self.host.buffers[(cp.GRADIENT, s.index)] for s in trained},
        )

    def _start_cpu_update(self) -> None:
        """The CPU step over the host buffers the parameters and gradients now live in."""
        self._make_cpu_update()
        self._cpu_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="teraio-cpu-step")
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, CPU_STEP_SWITCH_INTERVAL_S))
        self._original_state_dict = self.optimizer.state_dict

        def state_dict() -> dict[str, Any]:
            self._await_updates()  # the state as the last step left it
            assert self._original_state_dict is not None
            return self._original_state_dict()

        self.optimizer.state_dict = state_dict  # type: ignore[method-assign]

    def _find_units(self) -> list[_Unit]:
        """The blocks and every other module owning parameters directly, in registration order."""
        blocks = bk.find_blocks(self.model)
        block_ids = {id(block) for _, block in blocks}
        units: list[_Unit] = []
        for name, module in self.model.named_modules():
            if id(module) in block_ids:
                params = list(module.parameters())
            elif _inside(name, blocks):
                continue
            else:
                params = list(module.parameters(recurse=False))
            if not params:
                continue
            slots = sorted({self._slot_of[id(p)].index for p in params})
            for index in slots:
                self.slots[index].units.append(len(units))
            units.append(_Unit(name or type(module).__name__, module, slots))
        missing = [slot.name for slot in self.slots if not slot.units]
        assert not missing, f"parameters in no unit: {missing[:5]}"
        return units

    def __enter__(self) -> ModelOffload:
        try:
            return self._enter()
        except BaseException as error:
            # Undone as at exit: hooks, wrapped forwards, the optimizer's methods, clipping, the
            # worker, the switch interval; the state comes back from where it had gone.
            try:
                self.__exit__(type(error), error, error.__traceback__)
            except Exception as undo:
                error.add_note(f"teraio.offload could not undo its set-up after this error: {undo!r}")
            raise

    def _enter(self) -> ModelOffload:
        for slot in self.slots:
            for kind in (cp.PARAMETER, cp.GRADIENT):
                gradient = kind == cp.GRADIENT
                if gradient and (not slot.param.requires_grad or not self.moves_gradients):
                    continue
                if slot.tiers[kind] == HOST:
                    self.host.reserve((kind, slot.index), slot.nbytes)
        self._move_out_at_start()
        self.inputs.capacity_bytes = max(0, self.host_memory_bytes - self.plan.host_total)
        if self.update_site.site == cp.CPU_UPDATE:
            self._start_cpu_update()
        for index, unit in enumerate(self.units):
            self._instance_forwards.setdefault(unit.module, unit.module.__dict__.get("forward"))
            unit.module.forward = self._wrapped_forward(index, unit.module.forward)  # type: ignore[method-assign]
        self.checkpointer.apply({name for name, _ in self.blocks})
        if self.checkpoint_inputs == HOST:
            # Backward starts with the last block: its inputs stay.
            for position, (_, module) in enumerate(self.blocks[:-1]):
                self._instance_forwards.setdefault(module, module.__dict__.get("forward"))
                module.forward = self._inputs_to_host(position, module.forward)  # type: ignore[method-assign]
        for slot in self.slots:
            if slot.param.requires_grad:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._gradient_ready))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self.inputs.unpack)
        self._saved_hooks.__enter__()
        self._original_step = self.optimizer.step
        self._original_zero_grad = self.optimizer.zero_grad
        # What the instance had (an LR scheduler's wrapper of `step`) comes back at exit.
        self._instance_methods = {
            k: self.optimizer.__dict__[k] for k in ("step", "zero_grad") if k in self.optimizer.__dict__
        }
        self.optimizer.step = _optimizer_method(self._streamed_step, self.optimizer)  # type: ignore[method-assign]
        self.optimizer.zero_grad = _optimizer_method(self._zero_grad, self.optimizer)  # type: ignore[method-assign]
        self._take_over_clipping(self._owns, self._clip_grad_norm)
        self._install_peak()
        self._install_cache_off()
        self._hooks.append(self.model.register_forward_pre_hook(self._count_tokens, with_kwargs=True))
        self._install_checkpoint_hooks()
        self._begin_iteration()
        self.loss_head.__enter__()
        return self

    # -- checkpoints ---------------------------------------------------------------------------

    def _install_checkpoint_hooks(self) -> None:
        """`model.state_dict()` / `optimizer.state_dict()` hold each tensor's true bytes: those
        off the GPU are read from their tier into CPU tensors, one at a time (no copy of the
        whole model on the GPU). A load brings everything back, lets torch copy into it, and
        sends it out again (it needs the state to fit where the model was)."""

        # A function, not a bound method: torch marks the hooks it is given with an attribute.
        def model_state_dict(*args: Any) -> None:
            self._model_state_dict(*args)

        self._hooks.append(self.model.register_state_dict_post_hook(model_state_dict))
        self._hooks.append(self.optimizer.register_state_dict_post_hook(self._optimizer_state_dict))
        self._hooks.append(self.model.register_load_state_dict_pre_hook(self._before_load))
        self._hooks.append(self.model.register_load_state_dict_post_hook(self._after_model_load))
        self._hooks.append(self.optimizer.register_load_state_dict_pre_hook(self._before_load))
        self._hooks.append(self.optimizer.register_load_state_dict_post_hook(self._after_optimizer_load))

    def _from_tier(self, slot: _Slot, kind: Any, like: torch.Tensor) -> torch.Tensor:
        """The tensor's true value as a CPU tensor: a view of its host-tier buffer (no copy: the
        checkpoint of a model in host memory takes no second copy of it; like torch's own
        `state_dict()`, it is the live value, which the next step changes), or read from the
        store into a new tensor."""
        # A parameter kept on the GPU and updated on the CPU has its master in host memory.
        kept = kind == cp.PARAMETER and slot.tiers[cp.PARAMETER] == GPU
        tier = self.host if kept else self._tier(slot, kind)
        key = (kind, slot.index)
        if isinstance(tier, HostTier):
            nbytes = like.numel() * like.element_size()
            buffer = tier.buffers[key]
            assert buffer.numel() >= nbytes, (key, buffer.numel(), nbytes)
            tier.wait_written(key)
            return buffer[:nbytes].view(like.dtype).view(like.shape)
        host = torch.empty(like.shape, dtype=like.dtype)
        tier.read_to_host(key, flat_bytes(host))
        return host

    def _model_state_dict(
        self, module: Module, state_dict: dict[str, Any], prefix: str, metadata: Any
    ) -> None:
        if module is not self.model:
            return
        self._await_updates()  # the masters as the last step left them
        self._drain_writes()
        by_param = {id(slot.param): slot for slot in self.slots}
        for name, param in self.model.named_parameters(prefix=prefix, remove_duplicate=False):
            slot = by_param.get(id(param))
            # A compute copy or an outdated GPU copy is not the parameter: its master is.
            if slot is not None and name in state_dict and (not slot.resident or slot.copied or slot.stale):
                state_dict[name] = self._from_tier(slot, cp.PARAMETER, slot.full if slot.copied else param)

    def _optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        self._drain_writes()
        by_param = {id(slot.param): slot for slot in self.slots}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        packed = dict(state_dict["state"])
        for index, values in state_dict["state"].items():
            slot = by_param.get(id(params[index]))
            if slot is None:
                continue
            away = dict(_state_tensors(optimizer, slot.param, resident=False))
            if away:
                # A new dict: torch's packed state shares the optimizer's own per-parameter dicts.
                packed[index] = {
                    k: self._from_tier(slot, (cp.STATE, k), v) if k in away else v for k, v in values.items()
                }
        state_dict["state"] = packed
        return state_dict

    def _before_load(self, *args: Any) -> None:
        if not self._fits_back():
            raise ValueError(
                "teraio.offload (whole-model): load_state_dict inside the session brings the model's "
                "parameters and optimizer state back to the GPU, and they do not fit gpu_memory="
                f"{format_bytes(self.gpu_memory_bytes)}: load the checkpoint before teraio.offload"
            )
        self._bring_everything_back()

    def _after_model_load(self, *args: Any) -> None:
        self._out_again()

    def _after_optimizer_load(self, optimizer: Optimizer) -> None:
        # A CPU tensor the load kept as it was may sit in torch.load's storage, which cannot be
        # released: the state takes a copy of its own.
        for state in optimizer.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not value.untyped_storage().resizable():
                    state[key] = value.clone()
        self._out_again()

    def _out_again(self) -> None:
        """After a load: what `_bring_everything_back` brought back goes to its tiers again (the
        parameters the plan keeps on the GPU stay). With the CPU step, a kept parameter's master
        is written too, and the CPU optimizer takes the state again (`_make_cpu_update`)."""
        for slot in self.slots:
            if slot.tiers[cp.PARAMETER] != GPU:
                slot.write = self._write(slot, cp.PARAMETER, flat_bytes(slot.param))
            elif self.cpu_update is not None:
                self._counts.add("out", HOST, cp.PARAMETER, slot.nbytes)
                self.host.write((cp.PARAMETER, slot.index), flat_bytes(slot.param))
            self._send_out_all_but_parameter(slot)
        self._drain_writes()
        if self.cpu_update is not None:
            if self.cuda:
                self.host.flush()
                self.host.d2h.synchronize()  # the masters are in host memory before a step
            self._make_cpu_update()
        if self.compute_copies is not None:
            self._copies_on()

    def _owns(self, parameters: list[torch.Tensor]) -> bool:
        """Whether a `clip_grad_norm_` list holds this model's parameters: their gradients have
        left the GPU when backward returns, so `_clip_grad_norm` clips them instead of torch."""
        return any(id(p) in self._slot_of for p in parameters)

    def _clip_grad_norm(
        self,
        listed: list[torch.Tensor],
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
        foreach: Optional[bool],
    ) -> torch.Tensor:
        """torch's `clip_grad_norm_` (torch/nn/utils/clip_grad.py) over held gradients: each one's
        norm is the one taken as it left (norm type 2, torch's default) or is read back for the
        call, the total and the coefficient are torch's arithmetic, and the step scales each
        gradient as it brings it back. After a step in backward that "auto" turned on, the
        parameters it updated count with the norms their gradients left with: a clip that scales
        nothing stands (and turns the step in backward off from the next iteration), one that
        would scale raises."""
        if self.step_in_backward and not self._in_backward_auto:
            raise RuntimeError(
                "teraio.offload(step_in_backward=True): clip_grad_norm_ after backward, which has "
                "already updated the model with the unclipped gradients (use step_in_backward=False "
                "to clip)"
            )
        norm_type = float(norm_type)
        self._loop_clipped = True
        self._await_updates()
        self._gradients_complete()  # what backward left (nothing unless it failed)
        self._apply_pending_clip()  # a second call sees the gradients the first one scaled
        grads: list[torch.Tensor] = []  # each gradient's dtype and device (held ones: empty)
        norms: list[torch.Tensor] = []
        foreign: list[torch.Tensor] = []
        held: set[int] = set()
        updated = self._updated_in_backward if self.step_in_backward else set()
        for param in listed:
            slot = self._slot_of.get(id(param))
            if slot is not None and slot.index in updated:
                if norm_type != GRAD_NORM_TYPE or foreach is not None or slot.index not in self._grad_norms:
                    raise RuntimeError(
                        f"{self._in_backward_name()}: backward has already updated the model: "
                        f"clip_grad_norm_(norm_type={norm_type}, foreach={foreach}) needs the gradients "
                        "it used, which are gone (pass step_in_backward=False for a loop that clips)"
                    )
                grads.append(torch.empty(0, dtype=slot.full.dtype, device=param.device))
                norms.append(self._grad_norms[slot.index])
            elif slot is not None and slot.grad_held:
                held.add(slot.index)
                # torch groups by the gradient's dtype: the master's (a compute copy's is bf16).
                grads.append(torch.empty(0, dtype=slot.full.dtype, device=param.device))
                reuse = norm_type == GRAD_NORM_TYPE and foreach is None and slot.index in self._grad_norms
                norms.append(
                    self._grad_norms[slot.index]
                    if reuse
                    else _norm(self._read_gradient(slot), norm_type, foreach)
                )
            elif param.grad is not None:
                grads.append(param.grad)
                norms.append(_norm(param.grad, norm_type, foreach))
                foreign.append(param.grad)
        if not grads:
            return torch.tensor(0.0)
        # torch groups the gradients by device and dtype and stacks the norms group by group.
        groups = _group_tensors_by_device_and_dtype([grads], with_indices=True)
        ordered = [norms[i] for _, (_, indices) in groups.items() for i in indices]
        first_device = grads[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in ordered]), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if updated:
            if bool(clip_coef < 1.0):
                raise RuntimeError(
                    f"{self._in_backward_name()}: backward has already updated the model with these "
                    f"gradients unclipped; this clip_grad_norm_ would scale them by {float(clip_coef):.6g} "
                    "(pass step_in_backward=False for a loop that clips)"
                )
            self._in_backward_off = (
                "the loop clipped gradients (that clip scaled nothing, so the update in backward stood)"
            )
        for grad in foreign:
            _scale(grad, clip_coef.to(grad.device), foreach)
        self._clip = (clip_coef, foreach, held)
        return total

    def _apply_pending_clip(self) -> None:
        """Scales every held gradient in its tier by the pending clip coefficient (before another
        clip, or before a later backward adds to it), as torch would have in place. A gradient a
        later backward has left on the parameter (not added yet) stays there."""
        if self._clip is None:
            return
        for slot in self.slots:
            if slot.grad_held and slot.index in self._clip[2] and slot.copied:
                # Scaled in host memory, as the CPU step scales (the same product per element).
                self._fold(slot)
                self.host.buffers[(cp.GRADIENT, slot.index)].view(slot.full.dtype).mul_(self._clip[0].cpu())
                self._grad_norms.pop(slot.index, None)
            elif slot.grad_held and slot.index in self._clip[2]:
                fresh = slot.param.grad
                grad = self._scaled(slot, self._read_gradient(slot))
                self._tier(slot, cp.GRADIENT).discard((cp.GRADIENT, slot.index))
                slot.grad_held = False
                slot.param.grad = grad
                self._move_gradient_out(slot)
                slot.param.grad = fresh
        self._clip = None

    def _scaled(self, slot: _Slot, grad: torch.Tensor) -> torch.Tensor:
        """`grad` scaled by the pending clip coefficient if the clip covered the parameter."""
        if self._clip is not None and slot.index in self._clip[2]:
            coef, foreach, _ = self._clip
            _scale(grad, coef.to(grad.device), foreach)
        return grad

    def __exit__(self, *exc: object) -> None:
        self.loss_head.__exit__()
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        self._remove_hooks()
        self.checkpointer.apply(set())
        # Each wrapped module's forward as it was: its class's, or an instance's own.
        for module, forward in self._instance_forwards.items():
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward
        self._instance_forwards.clear()
        self._give_back_clipping()
        self._await_updates()
        if self._original_step is not None:
            self.optimizer.__dict__.pop("step", None)
            self.optimizer.__dict__.pop("zero_grad", None)
            self.optimizer.__dict__.update(getattr(self, "_instance_methods", {}))
        if self._original_state_dict is not None:
            self.optimizer.__dict__.pop("state_dict", None)
        if self._cpu_worker is not None:
            self._cpu_worker.shutdown()
            self._cpu_worker = None
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        self._bring_everything_back()
        self.inputs.close()
        self.host.close()
        for tier in self.ssd.values():
            tier.close()

    @property
    def _state_in_tiers(self) -> bool:
        """Whether optimizer state moves through the tiers: not where the optimizer steps on
        the CPU (`update_site`), whose state stays in CPU memory."""
        return self.update_site.site != cp.CPU_UPDATE

    def _send_out_all_but_parameter(self, slot: _Slot) -> None:
        """The slot's gradient and optimizer state to their tiers, and its GPU memory released
        (the parameter's own write is the caller's)."""
        if slot.param.grad is not None:
            self._move_gradient_out(slot)
        # The CPU step copies the state it finds to CPU memory (`CpuUpdate`) instead.
        for name, value in _state_tensors(self.optimizer, slot.param) if self._state_in_tiers else []:
            if self._state_out(slot, name, value):
                value.untyped_storage().resize_(0)
        self._release(slot, wait=True)

    def _move_out_at_start(self) -> None:
        for slot in self.slots:
            slot.write = self._write(slot, cp.PARAMETER, flat_bytes(slot.param))
            self._send_out_all_but_parameter(slot)
        self._drain_writes()
        self._counts = _Counts()

    def _bring_everything_back(self) -> None:
        """After training: parameters, gradients and state back on the GPU as they were, where
        they fit `gpu_memory`; else into (unpinned) CPU memory, with a warning, so that nothing
        is lost and the caller decides where the model goes next."""
        self._drain_writes()
        self._copies_off()
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        try:
            if self._fits_back():
                for slot in self.slots:
                    self._back_to_gpu(slot)
                if self.cpu_update is not None:
                    self.cpu_update.give_back(self.device)
                if self.cuda:
                    torch.cuda.current_stream(self.device).synchronize()
                return
        except torch.cuda.OutOfMemoryError:
            pass  # the device holds more than this run's state: the rest goes to CPU memory
        self.returned_to = "cpu"
        warnings.warn(
            "teraio.offload (whole-model): the model's parameters, gradients and optimizer state "
            f"do not fit gpu_memory={format_bytes(self.gpu_memory_bytes)} (or the device); what was "
            "not back on it is left in CPU memory (model.to(device) once there is room)",
            stacklevel=3,
        )
        if self.cpu_update is not None:
            self.cpu_update.give_back(None)
        for slot in self.slots:
            self._move_to_cpu(slot)

    def _back_to_gpu(self, slot: _Slot) -> None:
        self._acquire(slot)
        self._join(slot)
        for name, value in _state_tensors(self.optimizer, slot.param, resident=False):
            self._read(slot, (cp.STATE, name), value).join()
        if slot.grad_held:
            slot.param.grad = self._read_gradient(slot)
            slot.grad_held = False

    def _fits_back(self) -> bool:
        """Whether the model's whole state fits the budget (other memory on the device is the
        caller's: an out-of-memory error while bringing it back sends the rest to CPU memory)."""
        if not self.cuda:
            return True  # CPU "device": it is CPU memory either way
        params = sum(slot.nbytes * (1 + slot.grad_held) for slot in self.slots)
        state = sum(self._state_nbytes.values())
        if self.cpu_update is not None:
            state += self.cpu_update.state_bytes()
        return params + state <= self.gpu_memory_bytes

    def _move_to_cpu(self, slot: _Slot) -> None:
        def fetched(kind: Any, like: torch.Tensor) -> torch.Tensor:
            host = torch.empty(like.shape, dtype=like.dtype)
            self._tier(slot, kind).read_to_host((kind, slot.index), flat_bytes(host))
            return host

        param = slot.param
        if slot.resident:
            self._join(slot)
            param.data = param.data.cpu()
        else:
            param.data = fetched(cp.PARAMETER, param)
        state = self.optimizer.state.get(param, {})
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[name] = value.cpu() if _nbytes(value) else fetched((cp.STATE, name), value)
        if slot.grad_held:
            param.grad = fetched(cp.GRADIENT, param)
            slot.grad_held = False
        elif param.grad is not None:
            param.grad = param.grad.cpu()
        # Its host tier copies go now, so that host memory never holds the state twice.
        kinds = (cp.PARAMETER, cp.GRADIENT, PARAMETER_COPY, GRADIENT_COPY, *((cp.STATE, n) for n in state))
        for kind in kinds:
            self.host.release((kind, slot.index))

    # -- tiers ---------------------------------------------------------------------------------

    def _tier(self, slot: _Slot, kind: Any) -> Any:
        base = kind[0] if isinstance(kind, tuple) else kind
        return self.host if slot.tiers[base] == HOST else self.ssd[base]

    def _write(self, slot: _Slot, kind: Any, source: torch.Tensor) -> Transfer:
        """Writes `source` as `kind` of the parameter to its tier; a parameter's GPU memory goes
        at its `_release`, the others' with the write."""
        tier = self._tier(slot, kind)
        self._counts.add("out", tier.name, kind, source.numel())
        self.recorder.wrote(_recorded(kind, slot.index), tier.name, leaves=kind != cp.PARAMETER)
        return tier.write((kind, slot.index), source)

    def _read(self, slot: _Slot, kind: Any, tensor: torch.Tensor) -> Transfer:
        """Grows `tensor`'s storage back (on the compute stream) and reads its bytes into it."""
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            if kind == cp.PARAMETER:
                storage.resize_(slot.nbytes)
            elif kind == PARAMETER_COPY:
                storage.resize_(_numel_bytes(tensor, COPY_DTYPE))
            else:
                storage.resize_(self._state_nbytes[(kind, slot.index)])
        return self._read_into(slot, kind, flat_bytes(tensor))

    def _read_into(self, slot: _Slot, kind: Any, target: torch.Tensor) -> Transfer:
        tier = self._tier(slot, kind)
        self._counts.add("in", tier.name, kind, target.numel())
        self.recorder.read(_recorded(kind, slot.index), tier.name)
        return tier.read((kind, slot.index), target)

    def _record_use(self, slot: _Slot, kind: Any, write: bool = False) -> None:
        """The running op used `kind` of the parameter (for the recorded iteration)."""
        if not self.recorder.recording:
            return
        if isinstance(kind, tuple):
            nbytes, name, base = self._state_nbytes[(kind, slot.index)], f"{slot.name}.{kind[1]}", kind[0]
        else:
            # A compute copy's parameter and gradient cross the link in its dtype; a gradient
            # summed on the device crosses it in fp32, in and out (the larger counts).
            summed = kind == cp.GRADIENT and self._copies_summed_on_device()
            nbytes = _numel_bytes(slot.param, COPY_DTYPE) if slot.copied and not summed else slot.nbytes
            name, base = slot.name + (".grad" if kind == cp.GRADIENT else ""), kind
        self.recorder.use((kind, slot.index), name, base, nbytes, write)

    def _drain_writes(self) -> None:
        for transfer, _ in self._gradient_writes:
            transfer.join()
        self._gradient_writes.clear()
        self._finish_state_writes(0)
        for slot in self._pending_releases():
            self._release(slot, wait=True)

    # -- parameters ----------------------------------------------------------------------------

    def _acquire(self, slot: _Slot, wait: bool = True) -> bool:
        """Makes the parameter's storage resident (a read is queued if it was released). Where
        the CPU step has not updated its master yet: waits for it, or (not `wait`: a prefetch)
        leaves it for later and returns False."""
        if slot.update is not None:
            if not wait and not slot.update.done():
                if slot.stale or not slot.resident:
                    # The read comes once the update is done; for the record it is wanted now.
                    kind = self._param_kind(slot)
                    tier = HOST if slot.stale else self._tier(slot, kind).name
                    self.recorder.wanted(_recorded(kind, slot.index), tier)
                return False
            self._await_update(slot)
        if slot.stale:
            # Kept on the GPU, updated on the CPU: the new master comes up over the old copy.
            slot.stale = False
            kind = self._param_kind(slot)
            target = flat_bytes(slot.param)
            self._counts.add("in", HOST, kind, target.numel())
            self.recorder.read(_recorded(kind, slot.index), HOST)
            slot.fetch = self.host.read((kind, slot.index), target)
            return True
        if slot.release_pending:
            # Its release waited for a write, which goes on: kept after all.
            self.recorder.returned((cp.PARAMETER, slot.index), slot.tiers[cp.PARAMETER])
        slot.release_pending = False
        if slot.resident:
            return True
        slot.fetch = self._read(slot, self._param_kind(slot), slot.param)
        slot.resident = True
        self._slot_at[slot.param.untyped_storage().data_ptr()] = slot
        return True

    def _join(self, slot: _Slot) -> None:
        fetch, slot.fetch = slot.fetch, None
        if fetch is not None:
            fetch.join()

    def _release(self, slot: _Slot, wait: bool = False) -> None:
        """Drops the parameter's GPU storage (its bytes are current in its tier); with an SSD
        write still reading it, later (`_poll`) unless `wait`."""
        if slot.tiers[cp.PARAMETER] == GPU or not slot.resident:
            return
        if slot.write is not None:
            if not wait and not slot.write.done():
                if not slot.release_pending:
                    slot.release_pending = True
                    self._releasing.append(slot)
                return
            slot.write.join()
            slot.write = None
        # A read in flight into this storage must land first (the SSD tier's engine writes it).
        self._join(slot)
        self._slot_at.pop(slot.param.untyped_storage().data_ptr(), None)
        slot.param.untyped_storage().resize_(0)
        slot.resident = False
        slot.release_pending = False
        self.recorder.left((cp.PARAMETER, slot.index), slot.tiers[cp.PARAMETER])

    def _enter_unit(self, index: int) -> None:
        with torch.profiler.record_function("teraio.enter_unit"):
            self._enter_unit_traced(index)

    def _enter_unit_traced(self, index: int) -> None:
        if self.recorder.recording and "first_entry" not in self._recorded_marks:
            self._recorded_marks["first_entry"] = time.perf_counter()
        self._gradients_complete()  # the unit backward left
        self.recorder.wait()
        self._end_forward_mark()
        started = time.perf_counter()
        self._poll()
        if torch._C._current_graph_task_id() == -1:
            self._check_autocast()
        if self._recorded is None:
            self._order.append(index)
            self._order_in_backward.append(torch._C._current_graph_task_id() != -1)
        self._position += 1
        slots = [self.slots[i] for i in self.units[index].slots]
        if self._recorded is not None and any(not slot.resident for slot in slots):
            self.on_demand_fetches += 1
        with self.host.batched():
            for slot in slots:
                self._acquire(slot)
        self._prefetch_ahead(index)
        for slot in slots:
            self._join(slot)
        self._counts.wait_s["units"] += time.perf_counter() - started
        backward = torch._C._current_graph_task_id() != -1
        position = self._block_position.get(id(self.units[index].module))
        if backward and position and self.inputs.held(position - 1):
            # Backward recomputes block `position` now and block `position - 1` next.
            self.inputs.prefetch(position - 1)
            for key, _, tier in self.inputs.saves_of(position - 1) if self.recorder.recording else ():
                self.recorder.read((cp.ACTIVATION, key), tier)
        self.recorder.begin(f"{'backward' if backward else 'forward'} {self.units[index].name}")
        if not backward and self._backwards_since_step == 0:
            self._forward_marks.append([timing.mark(self.device), None])
        if backward and position is not None and self.recorder.recording:
            # The recomputation reads the block's inputs (unpacked just before it entered).
            for key, nbytes, _ in self.inputs.saves_of(position):
                self.recorder.use((cp.ACTIVATION, key), f"inputs {key}", cp.ACTIVATION, nbytes)
        for slot in slots:
            self._record_use(slot, cp.PARAMETER)

    def _end_forward_mark(self) -> None:
        """The unit of the step's first forward pass that ran since the last mark ends here (its
        compute, without the waits before it, is what `_gpu_share` weighs the GPU's share
        against)."""
        if self._forward_marks and self._forward_marks[-1][1] is None:
            self._forward_marks[-1][1] = timing.mark(self.device)

    def _horizon(self) -> list[list[_Slot]]:
        """The parameters of the next units in the recorded order, unit by unit,
        `pull_forward_bytes` of them (counting those already resident, which need no read; at
        least one parameter unless 0)."""
        budget = self.pull_forward_bytes
        if self._recorded is None or budget == 0:
            return []
        ahead = 0
        units: list[list[_Slot]] = []
        for index in self._recorded[self._position : self._position + len(self.units)]:
            unit: list[_Slot] = []
            units.append(unit)
            for i in self.units[index].slots:
                slot = self.slots[i]
                if ahead > 0 and ahead + _gpu_bytes(slot) > budget:
                    return units
                unit.append(slot)
                ahead += _gpu_bytes(slot)
        return units

    def _prefetch_ahead(self, current: Optional[int] = None) -> None:
        """Issues the reads of the parameters in the horizon, a unit's as one batch (one event
        for compute to wait for). In backward, also those of what it uses beside them
        (`_read_ahead`): with the step there on the GPU, the optimizer state of the parameters
        it steps, up to `pull_forward_bytes` of state (twice the parameters' bytes under Adam:
        read ahead for the whole parameter horizon, it runs out of memory at a few GiB of
        `pull_forward_bytes`; counted with the parameters' bytes, it leaves the parameter reads
        behind); in a loop that accumulates, the held gradients this micro-batch adds to on the
        device (`_sum_on_device`)."""
        horizon = self._horizon()
        for unit in horizon:
            with self.host.batched():
                for slot in unit:
                    self._acquire(slot, wait=False)
        if torch._C._current_graph_task_id() == -1:
            return
        if self.moves_gradients:
            self._read_ahead(current, horizon, self._fetch_held_sum, self._held_sum_bytes)
        else:
            self._read_ahead(current, horizon, self._fetch_state, lambda slot: self._state_bytes[slot.index])

    def _read_ahead(
        self,
        current: Optional[int],
        horizon: list[list[_Slot]],
        fetch: Callable[[_Slot], None],
        nbytes: Callable[[_Slot], int],
    ) -> None:
        """In backward: `fetch` for unit `current`'s parameters, then for those of the horizon's
        units this backward enters (not the next forward pass's), a unit's as one batch, up to
        `pull_forward_bytes` of their `nbytes` (at least one parameter's; one of none needs no
        read)."""
        if current is not None:
            with self.host.batched():
                for i in self.units[current].slots:
                    fetch(self.slots[i])
        ahead = 0
        for unit, in_backward in zip(horizon, self._order_in_backward[self._position :]):
            if not in_backward:
                return
            with self.host.batched():
                for slot in unit:
                    size = nbytes(slot)
                    if not size:
                        continue
                    if ahead > 0 and ahead + size > self.pull_forward_bytes:
                        return
                    ahead += size
                    fetch(slot)

    def _leave_unit(self, index: int) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # recomputation in backward: the parameters stay until their gradients
        soon = {slot.index for unit in self._horizon() for slot in unit}
        for i in self.units[index].slots:
            if not self.slots[i].saved and i not in soon:
                self._release(self.slots[i])

    def _wrapped_forward(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            self._enter_unit(index)
            self._counts.host_s += time.perf_counter() - started
            output = forward(*args, **kwargs)
            started = time.perf_counter()
            self._leave_unit(index)
            self._counts.host_s += time.perf_counter() - started
            return output

        return run

    def _inputs_to_host(self, position: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        """Block `position`'s checkpointed forward with the inputs `torch.utils.checkpoint` saves
        (before the block runs: its own saves go to checkpoint's hooks) sent to the host."""

        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return forward(*args, **kwargs)
            self.inputs.begin_block(position)
            self._inputs_block = position
            try:
                return forward(*args, **kwargs)
            finally:
                self._inputs_block = None

        return run

    def _count_tokens(self, module: Module, args: Any, kwargs: dict[str, Any]) -> None:
        """A training forward pass of the model: its token ids (the first integer tensor it takes)
        count toward the iteration's tokens."""
        if not torch.is_grad_enabled():
            return
        counts = self._counts
        if self.cuda and self.steps == 1 and counts.start_bytes is None:
            # Read on the iteration `batch_fit` estimates from only.
            counts.start_bytes = int(torch.cuda.memory_allocated(self.device))
        for value in (*args, *kwargs.values()):
            if (
                isinstance(value, torch.Tensor)
                and not value.is_floating_point()
                and value.dtype != torch.bool
            ):
                counts.tokens += value.numel()
                counts.batch = max(counts.batch, value.shape[0] if value.dim() > 1 else 1)
                return

    def _record_input_out(self, key: tuple[int, int, int], nbytes: int, tier: str) -> None:
        """A block's input left the GPU: the running op made it (for the recorded iteration)."""
        if self.recorder.recording:
            self.recorder.use((cp.ACTIVATION, key), f"inputs {key}", cp.ACTIVATION, nbytes, write=True)
            self.recorder.wrote((cp.ACTIVATION, key), tier)

    def _pack(self, tensor: torch.Tensor) -> Any:
        started = time.perf_counter()
        # Autograd saves parameters as they are or as views (a Linear's `weight.t()`).
        slot = self._slot_at.get(tensor.untyped_storage().data_ptr())
        if slot is not None:
            slot.saved = True
        packed = self.inputs.pack(tensor) if slot is None and self._inputs_block is not None else tensor
        self._counts.host_s += time.perf_counter() - started
        return packed

    # -- gradients -----------------------------------------------------------------------------

    def _gradient_ready(self, param: torch.Tensor) -> None:
        started = time.perf_counter()
        slot = self._slot_of[id(param)]
        # A unit the forward pass did not enter: its last CPU update reads the buffers this
        # gradient goes to.
        self._await_update(slot)
        task = torch._C._current_graph_task_id()
        if task != self._watched_task:
            self._end_forward_mark()
            self._watched_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            self._backwards_since_step += 1
            watching = self.step_in_backward or self.steps < IN_BACKWARD_AUTO_FROM
            if self._backwards_since_step == 1 and self._in_backward_auto and watching:
                self._hyperparameters_at_backward = cpu_update.hyperparameters(self.optimizer)
        self._record_use(slot, cp.PARAMETER)
        if self.step_in_backward:
            self._one_backward_per_step(task)
        if self.moves_gradients:
            self._record_use(slot, cp.GRADIENT, write=True)
            self._gradients.append(slot)
        else:
            self._await_step(slot)
        self._counts.host_s += time.perf_counter() - started

    def _backward_ended(self) -> None:
        started = time.perf_counter()
        try:
            self._gradients_complete()  # still this backward's (`_backward_count`)
        finally:
            self._watched_task = None
        self._drop_held_sums()
        self.inputs.end_iteration()  # every saved input is used: the next forward saves anew
        self._counts.host_s += time.perf_counter() - started

    def _gradients_complete(self) -> None:
        """Backward is done with the gradients marked complete so far: the step in backward
        updates their parameters, otherwise they move out."""
        if self._ready:
            self._step_ready()
        if self._gradients:
            self._gradients_out()

    def _gradients_out(self) -> None:
        """Moves the complete gradients out (the host tier's copies as one batch) and releases
        their parameters: backward is done with a parameter once its gradient is accumulated.
        With the step in backward on the CPU, their update is queued behind the copies."""
        ready, self._gradients = self._gradients, []
        with torch.profiler.record_function("teraio.gradient_out"):
            with self.host.batched():
                for slot in ready:
                    self._move_gradient_out(slot)
            for slot in ready:
                slot.saved = False
                self._release(slot)
            if self.step_in_backward:
                self._queue_cpu_updates(ready)
            elif self._loop_accumulated:
                self._queue_folds(ready)

    def _move_gradient_out(self, slot: _Slot) -> None:
        self._loop_accumulated |= slot.grad_held  # this backward adds to a held gradient
        if slot.copied:
            self._move_gradient_copy_out(slot)
            return
        grad = slot.param.grad
        assert grad is not None
        if slot.grad_held:
            # This backward adds to gradients a clip may have scaled: scale the held ones first.
            self._apply_pending_clip()
            # Accumulation over micro-batches: held + new, the sum autograd would have made.
            grad = grad + self._take_held_sum(slot)
        grad = grad.contiguous()
        self._grad_norms[slot.index] = _norm(grad, GRAD_NORM_TYPE, None)
        transfer = self._write(slot, cp.GRADIENT, flat_bytes(grad))
        slot.grad_held = True
        slot.param.grad = None
        if slot.tiers[cp.GRADIENT] == SSD:
            # The engine reads the GPU memory until done; bound how much of it waits.
            self._gradient_writes = [(t, n) for t, n in self._gradient_writes if not t.done()]
            self._gradient_writes.append((transfer, slot.nbytes))
            while sum(n for _, n in self._gradient_writes) > MAX_GRADIENT_WRITES_BYTES:
                self._gradient_writes.pop(0)[0].join()

    def _move_gradient_copy_out(self, slot: _Slot) -> None:
        """A copied parameter's bf16 gradient goes out as it is (half the bytes); the host widens
        it into the fp32 gradient buffer (`_fold`) before anything reads that."""
        grad = slot.param.grad
        assert grad is not None
        self._await_fold(slot)  # a fold still reading the buffer this gradient goes to
        if slot.grad_held:
            self._apply_pending_clip()
            self._grad_norms.pop(slot.index, None)
            if self._sum_on_device(slot):
                # The first micro-batch's bf16 gradient, which no fold widened, as float(bf16):
                # exactly as the host widens it (an fp32 sum is returned as it is).
                held = self._take_held_sum(slot).to(slot.full.dtype)
                slot.fold = None  # the sum below supersedes the bf16 gradient in host memory
                held.add_(grad)  # held + float(grad): autograd's fp32 sum, bitwise
                # The clip's norm of the sum, as torch takes it on the device.
                self._grad_norms[slot.index] = _norm(held, GRAD_NORM_TYPE, None)
                self._write(slot, cp.GRADIENT, flat_bytes(held))
                slot.param.grad = None
                return
            # Widened on the host: a clip reads the sum back to take its norm on the device.
            self._fold(slot)  # the previous micro-batch's, before this one takes its buffer
            fold = "add"
        else:
            fold = "copy"
            # torch's norm of the fp32 gradient autograd would have made: float(bf16) exactly.
            self._grad_norms[slot.index] = _norm(grad.float(), GRAD_NORM_TYPE, None)
        self._write(slot, GRADIENT_COPY, flat_bytes(grad.contiguous()))
        slot.fold = fold
        slot.grad_held = True
        slot.param.grad = None

    def _one_backward_per_step(self, task: int) -> None:
        """Step in backward: the backward pass `task` updates the model; a second one before
        `optimizer.step()` raises."""
        if self._stepping_task is None:
            self._stepping_task = task
        elif task != self._stepping_task:
            raise RuntimeError(
                f"{self._in_backward_name()}: a second backward before optimizer.step(): "
                "the first one has already updated the model, so gradients cannot accumulate over "
                "backward passes (use step_in_backward=False to accumulate)"
            )

    def _in_backward_name(self) -> str:
        """Who turned the step in backward on, for its errors."""
        if not self._in_backward_auto:
            return "teraio.offload(step_in_backward=True)"
        return (
            f"teraio.offload(step_in_backward='auto', the default; on from iteration "
            f"{IN_BACKWARD_AUTO_FROM + 1}, since the loop's first iterations neither clipped nor "
            "accumulated gradients)"
        )

    def _await_step(self, slot: _Slot) -> None:
        """Step in backward on the GPU: the parameter's gradient is complete; it is updated when
        backward enters the next unit or ends."""
        slot.saved = False
        self._fetch_state(slot)
        self._ready.append(slot)

    def _fetch_state(self, slot: _Slot) -> None:
        """Issues the reads of the parameter's optimizer state for a step in backward (once)."""
        if slot.incoming_state is not None or not slot.param.requires_grad:
            return
        self._finish_state_writes(self.plan.window_bytes, slot=slot)
        slot.incoming_state = []
        for name, value in _state_tensors(self.optimizer, slot.param, resident=False):
            slot.incoming_state.append(self._read(slot, (cp.STATE, name), value))
            self._account(_nbytes(value))

    def _step_ready(self) -> None:
        """Step in backward: the optimizer steps the parameters whose gradients are complete (the
        others' `grad` is None, which torch optimizers skip); they and their state go back."""
        ready, self._ready = self._ready, []
        if not ready:
            return
        started = time.perf_counter()
        self.recorder.wait()
        with torch.profiler.record_function("teraio.step_in_backward"):
            with self.host.batched():
                for slot in ready:
                    self._fetch_state(slot)
                    if slot.write is not None:
                        slot.write.join()  # the step changes the parameter: its last write must be done
                        slot.write = None
                    # Backward may not have needed it (a bias: its gradient needs no parameter).
                    self._acquire(slot)
            for slot in ready:
                self._join(slot)
                for transfer in slot.incoming_state or []:
                    transfer.join()
                slot.incoming_state = None
                self._account(slot.nbytes * (2 if slot.tiers[cp.PARAMETER] != GPU else 1))
            assert self._original_step is not None
            self.recorder.begin("step in backward")
            self._original_step()
            self._record_step_uses(ready)
            self._write_back(ready)
        waits = self._counts.wait_s
        waits["step in backward"] = waits.get("step in backward", 0.0) + time.perf_counter() - started

    def _read_gradient(self, slot: _Slot) -> torch.Tensor:
        """The held fp32 gradient, read back to the device."""
        grad, transfer = self._issue_gradient_read(slot)
        transfer.join()
        return grad

    def _issue_gradient_read(self, slot: _Slot) -> tuple[torch.Tensor, Transfer]:
        """Issues the read of the held fp32 gradient into new device memory, once the host has
        widened the last bf16 one into it."""
        self._fold(slot)
        like = slot.full if slot.copied else slot.param
        grad = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        return grad, self._read_into(slot, cp.GRADIENT, flat_bytes(grad))

    def _sum_on_device(self, slot: _Slot) -> bool:
        """Whether the running backward adds the parameter's gradient to its held one on the
        device, which reads the held one back: an fp32 gradient always (autograd's sum); a
        compute copy's bf16 gradient in the micro-batch that ends a step, as the last step's
        did (`_copies_summed_on_device`). Otherwise the host widens it into the held sum
        (`_fold`)."""
        if not slot.grad_held:
            return False
        if not slot.copied:
            return True
        return self._copies_summed_on_device() and self._backward_count() >= self._backwards_per_step

    def _copies_summed_on_device(self) -> bool:
        """Whether the last micro-batch of a step adds the compute copies' gradients to their
        held sums on the device: where the loop accumulates. Widened on the host, that
        micro-batch's gradients hold the step's updates back (one worker: folds, then updates),
        and a clip would read every sum back after backward for its norm (a host norm's bits
        differ from torch's). Added on the device, each unit's sums are read back beside
        backward, and leave with their norms taken."""
        return self._backwards_per_step > 1

    def _backward_count(self) -> int:
        """The running backward's number since the last `optimizer.step()` (1: the first), also
        before its first gradient has arrived; outside backward the number of the last one."""
        task = torch._C._current_graph_task_id()
        return self._backwards_since_step + (task != -1 and task != self._watched_task)

    def _next_backward_sums_on_device(self) -> bool:
        """Whether the next backward is expected to end the step (`_sum_on_device`): then a
        step's first micro-batch's bf16 gradients are not widened on the host at all; that
        backward reads them back as they are (half the bytes of an fp32 sum) and widens them on
        the device, and the step's updates do not queue behind their folds on the worker."""
        return self._copies_summed_on_device() and self._backward_count() + 1 >= self._backwards_per_step

    def _issue_held_sum_read(self, slot: _Slot) -> tuple[torch.Tensor, Transfer]:
        """Issues the read of the held gradient the running backward adds to on the device: a
        compute copy's bf16 gradient that no fold has widened (`_next_backward_sums_on_device`)
        as it is, else the held fp32 sum."""
        if slot.fold != "copy":
            return self._issue_gradient_read(slot)
        held = torch.empty(slot.param.shape, dtype=COPY_DTYPE, device=self.device)
        return held, self._read_into(slot, GRADIENT_COPY, flat_bytes(held))

    def _held_sum_bytes(self, slot: _Slot) -> int:
        """The bytes `_fetch_held_sum` reads for the parameter (0: none)."""
        if not self._sum_on_device(slot):
            return 0
        return _numel_bytes(slot.param, COPY_DTYPE) if slot.fold == "copy" else slot.full.nbytes

    def _fetch_held_sum(self, slot: _Slot) -> None:
        """Issues the read of the held gradient the running backward adds to on the device
        (`_sum_on_device`), ahead of its use (once)."""
        if slot.incoming_sum is not None or not self._sum_on_device(slot):
            return
        self._apply_pending_clip()  # the held sums as a clip before this backward scaled them
        slot.incoming_sum = self._issue_held_sum_read(slot)

    def _take_held_sum(self, slot: _Slot) -> torch.Tensor:
        """The held gradient on the device: read ahead (`_fetch_held_sum`), or now; a compute
        copy's unwidened bf16 gradient is returned in bf16."""
        if slot.incoming_sum is None:
            slot.incoming_sum = self._issue_held_sum_read(slot)
        (held, transfer), slot.incoming_sum = slot.incoming_sum, None
        transfer.join()
        return held

    def _drop_held_sums(self) -> None:
        """Drops the held gradients read ahead that no gradient was added to (a parameter the
        backward that read them left without one): the held ones may change before the next."""
        for slot in self.slots:
            if slot.incoming_sum is not None:
                slot.incoming_sum[1].join()
                slot.incoming_sum = None

    def _zero_grad(self, set_to_none: bool = True) -> None:
        assert self._original_zero_grad is not None
        if self.step_in_backward and self._in_backward_auto and self._stepping_task is not None:
            raise RuntimeError(
                f"{self._in_backward_name()}: the last backward has already updated the model: "
                "optimizer.zero_grad() before optimizer.step() would skip a step that has run "
                "(pass step_in_backward=False for a loop that skips steps)"
            )
        self._original_zero_grad(set_to_none=set_to_none)
        self._clip = None
        self._drop_held_sums()
        for slot in self.slots:
            if slot.grad_held:
                slot.grad_held = False
                self._tier(slot, cp.GRADIENT).discard((cp.GRADIENT, slot.index))
            self._await_fold(slot)  # it writes the buffer the next gradient starts from
            if slot.fold is not None:
                slot.fold = None
                self.host.discard((GRADIENT_COPY, slot.index))

    # -- the step ------------------------------------------------------------------------------

    def _streamed_step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        if closure is not None:
            raise ValueError("teraio.offload (whole-model): optimizer.step(closure) is not supported")
        with torch.profiler.record_function("teraio.streamed_step"):
            return self._streamed_step_traced()

    def _streamed_step_traced(self) -> Any:
        started = time.perf_counter()
        self._gradients_complete()  # what backward left (nothing unless it failed)
        self._drop_held_sums()
        self._check_loop_at_step()
        self._stepping_task = None
        self._updating_in_backward = False
        self._updated_in_backward = set()
        for slot in self.slots:  # gradients set outside backward (e.g. by hand) move out too
            if slot.param.grad is not None:
                self._move_gradient_out(slot)
        result = self._cpu_step() if self.cpu_update is not None else self._gpu_step()
        for slot in self.slots:
            slot.saved = False
            self._release(slot)
        self._clip = None
        self._position = 0
        self._decide_in_backward()
        self._prefetch_ahead()  # the next forward pass's first units
        elapsed = time.perf_counter() - started
        self._counts.wait_s["step"] += elapsed
        self._step_ms.append(elapsed * 1e3)
        self._end_iteration()
        return result

    def _check_loop_at_step(self) -> None:
        """At `optimizer.step()`: what the loop did since the last one, for
        `step_in_backward="auto"` (more than one backward; the hyperparameters changed since
        backward began, where an update in backward would have used the old ones)."""
        if self._backwards_since_step > 1:
            self._loop_accumulated = True
        self._backwards_per_step, self._backwards_since_step = self._backwards_since_step, 0
        before, self._hyperparameters_at_backward = self._hyperparameters_at_backward, None
        if before is None or before == cpu_update.hyperparameters(self.optimizer):
            return
        self._loop_changed_hyperparameters = True
        if self.step_in_backward:
            raise RuntimeError(
                f"{self._in_backward_name()}: backward has already updated the model with the "
                "optimizer's hyperparameters as it began: the loop changed them before "
                "optimizer.step() (step a scheduler after optimizer.step(), or pass "
                "step_in_backward=False)"
            )

    def _decide_in_backward(self) -> None:
        """`step_in_backward="auto"`, at the end of `optimizer.step()`: on for the iterations from
        `IN_BACKWARD_AUTO_FROM` where the loop's iterations before it were of the shape the
        step in backward leaves exact (`_loop_refusal`); off again after a clip that scaled
        nothing (`_clip_grad_norm`)."""
        if not self._in_backward_auto:
            return
        if self.step_in_backward:
            if self._in_backward_off:
                self.step_in_backward = False
                self.step_in_backward_reason = (
                    f"auto: on from iteration {IN_BACKWARD_AUTO_FROM + 1}, off from iteration "
                    f"{self.steps + 2}: {self._in_backward_off}"
                )
            return
        if self.steps + 1 != IN_BACKWARD_AUTO_FROM or self.cpu_update is None:
            return
        refusal = self._loop_refusal()
        if refusal:
            self.step_in_backward_reason = f"auto: off, {refusal}"
            return
        self.step_in_backward = True
        self.step_in_backward_reason = (
            f"auto: on from iteration {IN_BACKWARD_AUTO_FROM + 1}: the loop's first iterations took one "
            "backward per optimizer.step(), clipped no gradients and kept the hyperparameters "
            "through backward, so each unit's CPU update runs beside backward"
        )

    def _loop_refusal(self) -> str:
        """Why the loop so far rules out the step in backward ("": it does not)."""
        if self._loop_clipped:
            return "the loop clips gradients (clip_grad_norm_ needs every gradient before any update)"
        if self._loop_accumulated:
            return "the loop runs more than one backward per optimizer.step()"
        if self._loop_changed_hyperparameters:
            return "the loop changes the optimizer's hyperparameters between backward and optimizer.step()"
        return ""

    def _gpu_step(self) -> Any:
        """The streamed step: window by window, parameters, gradients and state in, the user's
        optimizer steps on the GPU, parameters and state out."""
        windows = [w for w in self.plan.windows if any(self.slots[i].grad_held for i in w)]
        assert self._original_step is not None
        result = None
        pending = self._fetch_window(windows[0]) if windows else []
        for position, window in enumerate(windows):
            with torch.profiler.record_function("teraio.step_window"):
                following = self._fetch_window(windows[position + 1]) if position + 1 < len(windows) else []
                # Finished store transfers are collected (their failures raised) between waits.
                self._poll_tiers()
                self.recorder.wait()
                for transfer in pending:
                    transfer.join()
                    self._poll_tiers()
                stepped = []
                for i in window:
                    slot = self.slots[i]
                    self._join(slot)
                    if slot.incoming_grad is not None:
                        grad, transfer = slot.incoming_grad
                        transfer.join()
                        slot.param.grad = self._scaled(slot, grad)
                        slot.incoming_grad = None
                        slot.grad_held = False
                        stepped.append(slot)
                self.recorder.begin("step window")
                result = self._original_step()
                self._record_step_uses(stepped)
                self._write_back(stepped)
                self._poll_tiers()
            pending = following
        return result

    def _cpu_step(self) -> None:
        """The CPU step (`cpu_update`): once the gradients are in host memory, a worker thread
        updates the masters unit by unit, in the order the next forward pass enters the units,
        whose entry waits for its own (`_acquire`): the update overlaps that forward pass.
        Hyperparameters and the clip coefficient are taken now, so a scheduler stepping after
        `optimizer.step()` sets the next step's. With the step in backward the units' updates
        were queued in backward (`_queue_cpu_updates`); what is left here are gradients set by
        hand, and at the first step the compute copies' choice."""
        # The record's last op ends where the step begins: the step's waits for the gradients'
        # copies are the replay's (their lone departures before the CPU jobs), not the op's.
        self.recorder.wait()
        stepped = [slot for slot in self.slots if slot.grad_held]
        if stepped or not self.step_in_backward:
            self._await_updates()  # a step with no forward pass since the last one
        if not self.step_in_backward:
            self._close_cpu_iteration()
        if self.step_in_backward and self.compute_copies is None and not self._copies_reason:
            # Once, at the first step: the copies are rounded from current masters (`_copies_on`).
            self._await_updates()
            self._enable_copies([])
        if not stepped:
            return
        if self.cuda:
            self.host.flush()
            self.host.d2h.synchronize()  # the gradients are in host memory
            self.host.h2d.synchronize()  # and no read of a master is in flight
        if self.recorder.recording:
            self._recorded_marks["copies_done"] = time.perf_counter()
        assert self.cpu_update is not None
        if self.compute_copies is None:
            self._enable_copies(stepped)
        self.cpu_update.sync_hyperparameters()
        clip = None
        if self._clip is not None:
            coef, _, held = self._clip
            clip = (coef.to("cpu"), {id(self.slots[i].param) for i in held})
        if self._may_share():
            self._pin_moments(stepped)
        groups = self._update_groups(stepped)
        share = self._gpu_share(groups)
        for group in groups[: len(groups) - len(share)]:
            self._submit_cpu_update(group, clip, [])
            job = group[0].update
            assert job is not None
            self._cpu_jobs.append((job, sum(slot.param.numel() for slot in group)))
        if share:
            self._step_share(share)
            if self.recorder.recording:
                # The share's time is the record's (its ops and transfers), not the loop's.
                self._recorded_marks["copies_done"] = time.perf_counter()

    def _gpu_share(self, groups: list[list[_Slot]]) -> list[list[_Slot]]:
        """The groups the GPU updates at this step (`gpu_step_share`): the last ones of the next
        forward pass's order, whose units it enters after the worker's; "auto": as many
        elements as `balanced_share` gives, with the worker's rate measured at the last step,
        the GPU's measured at the last step that shared (before one did, estimated from the
        link's rate, `SHARE_BYTES_PER_ELEMENT`, with the worker's slowed by
        `SHARE_CPU_SLOWDOWN`), and the last iteration's first forward pass's compute."""
        self._measure_step_rates()
        setting = self._share_setting
        elements = [sum(slot.param.numel() for slot in group) for group in groups]
        total = sum(elements)
        target = 0.0
        if self._may_share() and not self.step_in_backward and self.steps >= SHARE_FROM_STEP:
            if setting != "auto":
                target = float(setting) * total
            elif self._cpu_s_per_element is not None:
                cpu_s, gpu_s = self._cpu_s_per_element, self._gpu_s_per_element
                if gpu_s is None:  # neither has been measured beside the other yet
                    gpu_s = SHARE_BYTES_PER_ELEMENT / (self.link.duplex or min(self.link.d2h, self.link.h2d))
                    cpu_s *= SHARE_CPU_SLOWDOWN
                target = balanced_share(total, cpu_s, gpu_s, self._forward_s or 0.0)
        share: list[list[_Slot]] = []
        taken = 0
        for group, size in zip(reversed(groups), reversed(elements)):
            if taken + size > target:
                break
            share.append(group)
            taken += size
        self._share_elements.append(taken)
        return share[::-1]

    def _may_share(self) -> bool:
        """Whether the GPU's share may take part in this loop's steps: the kernel runs the CPU
        step, at `optimizer.step()` for good (the loop clips or accumulates, or the option
        says so), and the setting shares (on CUDA for "auto")."""
        setting = self._share_setting
        kernel = self.cpu_update is not None and self.cpu_update.kernel is not None
        after_backward = self.options.step_in_backward is False or bool(self._loop_refusal())
        return kernel and after_backward and setting != "off" and (self.cuda or setting != "auto")

    def _pin_moments(self, slots: list[_Slot]) -> None:
        """Moves the moments of `slots` into host-tier buffers (`_share_moments`) ahead of any
        share: pinning is slow (cudaHostRegister), so it happens at the first step, not inside
        a measured one. Where the host tier has no room for them, the share stays off."""
        try:
            for slot in slots:
                self._share_moments(slot)
        except MemoryError as full:
            self._share_setting = "off"
            self._share_refusal = f"off: the moments did not fit the host tier ({full})"

    def _measure_step_rates(self) -> None:
        """The worker's seconds per element in the last step's updates (all done by now), and
        the last iteration's first forward pass's compute (`_forward_marks`)."""
        if self._cpu_jobs:
            seconds = sum(job.result() for job, _ in self._cpu_jobs)
            elements = sum(n for _, n in self._cpu_jobs)
            self._cpu_s_per_element = seconds / elements if elements else None
            self._cpu_jobs = []
        marks = [(start, end) for start, end in self._forward_marks if end is not None]
        if marks:
            self._forward_s = sum(timing.elapsed_ms(start, end) for start, end in marks) / 1e3
        self._forward_marks = []

    def _step_share(self, groups: list[list[_Slot]]) -> None:
        """The GPU's share of the step (`_gpu_share`), group by group on the training thread
        while the worker updates the groups before them: each parameter's fp32 master, gradient
        (a compute copy's lone bf16 one as it is, widened here as the kernel widens it) and
        Adam moments come up from host memory, the next group's reads issued before this one's
        update; the device's fused AdamW updates them (`CpuUpdate.device_step`, after the
        clip's scale), and the master, its compute copy and the moments go back."""
        started = time.perf_counter()
        assert self.cpu_update is not None
        limit = self.plan.window_bytes
        if self.cuda:
            free = self.gpu_memory_bytes - int(torch.cuda.memory_allocated(self.device))
            limit = max(limit, free // 2)
        pending = self._share_reads(groups[0])
        for position, group in enumerate(groups):
            following = None
            if position + 1 < len(groups):
                nbytes = sum(_share_bytes(slot) for slot in group + groups[position + 1])
                if nbytes <= limit:
                    following = self._share_reads(groups[position + 1])
            self.recorder.wait()
            for _, _, transfers in pending:
                for transfer in transfers:
                    transfer.join()
            self.recorder.begin("step share")
            params, updated = [], []
            for slot, (master, grad, exp_avg, exp_avg_sq), _ in pending:
                grad = self._scaled(slot, grad.to(master.dtype))
                params.append(slot.param)
                updated.append((master, grad, exp_avg, exp_avg_sq))
            self.cpu_update.device_step(params, updated)
            self._share_writes([(slot, tensors) for slot, tensors, _ in pending])
            pending = (
                following
                if following is not None
                else (self._share_reads(groups[position + 1]) if position + 1 < len(groups) else [])
            )
        self._share_writes_pending = True
        elapsed = time.perf_counter() - started
        self._share_ms.append(elapsed * 1e3)
        shared = sum(slot.param.numel() for group in groups for slot in group)
        self._gpu_s_per_element = elapsed / shared

    def _share_reads(self, group: list[_Slot]) -> list[_ShareRead]:
        """Issues the reads of the group's masters, gradients and moments into new device
        memory (the host tier's as one batch)."""
        reads = []
        with self.host.batched():
            for slot in group:
                self._await_fold(slot)
                moments = self._share_moments(slot)
                master = torch.empty(slot.full.shape, dtype=slot.full.dtype, device=self.device)
                transfers = [self._share_read(slot, (cp.PARAMETER, slot.index), "master", master)]
                grad, transfer = self._issue_held_sum_read(slot)
                transfers.append(transfer)
                tensors = [master, grad]
                for name, value in moments:
                    target = torch.empty(value.shape, dtype=value.dtype, device=self.device)
                    transfers.append(self._share_read(slot, ((cp.STATE, name), slot.index), name, target))
                    tensors.append(target)
                reads.append((slot, tuple(tensors), transfers))
        return reads

    def _share_moments(self, slot: _Slot) -> list[tuple[str, torch.Tensor]]:
        """The parameter's Adam moments, moved once into host-tier buffers (pinned, where the
        GPU's copies run at the link's rate), which the CPU step updates in place as before."""
        assert self.cpu_update is not None
        state = self.cpu_update.state_of(
            slot.param, lambda name, like: self.host.zeros_like(((cp.STATE, name), slot.index), like)
        )
        moments = []
        for name in ("exp_avg", "exp_avg_sq"):
            key = ((cp.STATE, name), slot.index)
            value = state[name]
            if key not in self.host.buffers or self.host.buffers[key].data_ptr() != value.data_ptr():
                state[name] = value = self.host.adopt(key, value)
                self._state_nbytes[key] = _nbytes(value)
            moments.append((name, value))
        return moments

    def _share_read(self, slot: _Slot, key: Any, name: str, target: torch.Tensor) -> Transfer:
        """A read of the GPU's share from the host tier. The record holds the master and the
        moments as optimizer state (the master's fp32 bytes: the record's parameter is the
        copy the forward pass reads)."""
        nbytes = _nbytes(target)
        self._counts.add("in", HOST, cp.PARAMETER if name == "master" else cp.STATE, nbytes)
        record = ((cp.STATE, name), slot.index)
        self._share_records.setdefault(record, (f"{slot.name}.{name}", nbytes))
        self.recorder.read(record, HOST)
        return self.host.read(key, flat_bytes(target))

    def _share_writes(self, updated: list[tuple[_Slot, tuple[torch.Tensor, ...]]]) -> None:
        """After the device step of `updated`: its uses for the record, and each master, its
        copy and the moments back to host memory (one batch); a parameter kept on the GPU is
        read again at its next use, as after a CPU update."""
        recording = self.recorder.recording
        with self.host.batched():
            for slot, (master, _, exp_avg, exp_avg_sq) in updated:
                if recording:
                    self._record_use(slot, cp.GRADIENT)
                    for name in ("master", "exp_avg", "exp_avg_sq"):
                        record = ((cp.STATE, name), slot.index)
                        label, nbytes = self._share_records[record]
                        self.recorder.use(record, label, cp.STATE, nbytes, write=True)
                writes = [((cp.PARAMETER, slot.index), "master", master)]
                if slot.copied:
                    writes.append(((PARAMETER_COPY, slot.index), "copy", master.to(COPY_DTYPE)))
                for name, moment in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                    writes.append((((cp.STATE, name), slot.index), name, moment))
                for key, name, source in writes:
                    kind = cp.STATE if name.startswith("exp_") else cp.PARAMETER
                    self._counts.add("out", HOST, kind, _nbytes(source))
                    if name != "copy":
                        self.recorder.wrote(((cp.STATE, name), slot.index), HOST)
                    self.host.write(key, flat_bytes(source))
                if slot.tiers[cp.PARAMETER] == GPU:
                    # As after a CPU update: kept on the GPU, read again at its next use.
                    slot.stale = True
                    self.recorder.left((cp.PARAMETER, slot.index), HOST)
                slot.grad_held = False
                slot.fold = None

    def _close_cpu_iteration(self) -> None:
        """The worker's time in the CPU step of the iteration whose updates are all done."""
        with self._cpu_update_lock:
            spent, self._cpu_update_s = self._cpu_update_s, 0.0
        if spent:
            self._cpu_update_ms.append(spent * 1e3)

    def _add_worker_time(self, seconds: float) -> None:
        """A job's time on the worker, into the iteration's (`_close_cpu_iteration`)."""
        with self._cpu_update_lock:
            self._cpu_update_s += seconds

    def _queue_cpu_updates(self, slots: list[_Slot]) -> None:
        """Step in backward on the CPU: the update of `slots` (a unit's complete gradients, whose
        copies out are issued) goes to the worker, which starts once those copies are done. The
        hyperparameters are the optimizer's as backward starts (the scheduler's step after the
        last `optimizer.step()`), as with the step in backward on the GPU."""
        if self.cpu_update is None or not slots:
            return
        if not self._updating_in_backward:
            # The first unit of this backward: the last iteration's updates are all done.
            self._updating_in_backward = True
            self._await_updates()
            self._close_cpu_iteration()
            self.cpu_update.sync_hyperparameters()
        self._updated_in_backward.update(slot.index for slot in slots)
        kinds = [GRADIENT_COPY if slot.fold is not None else cp.GRADIENT for slot in slots]
        copies_out = self._copies_out_events([(kind, slot.index) for kind, slot in zip(kinds, slots)])
        self._submit_cpu_update(slots, None, copies_out)

    def _copies_out_events(self, keys: list[Any]) -> list[Any]:
        """The CUDA events of the host tier's last copies into `keys` (each once), for a worker's
        job to wait for; none on a CPU device, whose copies are done when asked for."""
        if not self.cuda:
            return []
        self.host.flush()  # the copies are issued (inside an outer batch too): their events
        written = (self.host.written_event(key) for key in keys)
        return list({id(e): e for e in written if e is not None}.values())

    def _submit_cpu_update(self, group: list[_Slot], clip: Any, copies_out: list[Any]) -> None:
        """Queues the CPU update of `group` on the worker (after `copies_out`, CUDA events of the
        copies that bring its gradients to host memory)."""
        assert self._cpu_worker is not None
        # The worker widens the bf16 gradients (their copies are done) and rounds the copies.
        folds = [(slot, slot.fold) for slot in group if slot.fold is not None]
        # Folds queued earlier ran before it (one worker, in order); it raises their failures.
        folded = list({id(s.folding): s.folding for s in group if s.folding is not None}.values())
        for slot in group:
            slot.fold = None
            slot.folding = None
        future = self._cpu_worker.submit(
            self._run_cpu_update,
            [slot.param for slot in group],
            clip,
            folds,
            [slot for slot in group if slot.copied],
            copies_out,
            folded,
        )
        # For the record: the job reads the gradients that left for good and writes the
        # parameters, which their next read waits for (`_acquire`).
        self.recorder.cpu_job(
            future,
            waits_for=[(cp.GRADIENT, slot.index) for slot in group],
            produces=[(cp.PARAMETER, slot.index) for slot in group],
        )
        for slot in group:
            slot.update = future
            slot.grad_held = False
            if slot.tiers[cp.PARAMETER] == GPU:
                # Its GPU copy is outdated: for the record, dropped here and read back at
                # its next use (`_acquire`).
                slot.stale = True
                self.recorder.left((cp.PARAMETER, slot.index), HOST)
        self._updates_pending = True

    def _update_groups(self, stepped: list[_Slot]) -> list[list[_Slot]]:
        """`stepped` by unit, in the order the forward pass first enters them (the rest last)."""
        left = {slot.index: slot for slot in stepped}
        groups = []
        for unit in dict.fromkeys(self._recorded or self._order):
            group = [left.pop(i) for i in self.units[unit].slots if i in left]
            if group:
                groups.append(group)
        if left:
            groups.append(list(left.values()))
        return groups

    def _run_cpu_update(
        self,
        params: list[torch.Tensor],
        clip: Any,
        folds: list[tuple[_Slot, str]],
        copies: list[_Slot],
        copies_out: list[Any],
        folded: list[concurrent.futures.Future[float]],
    ) -> float:
        """Runs one group's update on the worker; returns its seconds there, the wait for the
        gradients' copies left out (the replay waits for those copies itself)."""
        for done in folded:
            done.result()
        for event in copies_out:
            event.synchronize()  # the gradients are in host memory (the wait is not the step's)
        started = time.perf_counter()
        assert self.cpu_update is not None
        # The kernel reads a lone bf16 gradient as it is and writes the copies as it updates.
        kernel = self.cpu_update.kernel is not None
        low_grads = {}
        for slot, fold in folds:
            if kernel and fold == "copy":
                low_grads[id(slot.param)] = self.host.buffers[(GRADIENT_COPY, slot.index)]
            else:
                self._widen(slot, fold)
        if kernel:
            out = {id(slot.param): self.host.buffers[(PARAMETER_COPY, slot.index)] for slot in copies}
            self.cpu_update.step(params, clip, low_grads, out)
        else:
            self.cpu_update.step(params, clip)
            for slot in copies:
                self._round_copy(slot)
        elapsed = time.perf_counter() - started
        self._add_worker_time(elapsed)
        return elapsed

    def _cpu_step_kernel(self) -> str:
        """`WholeModelReport.cpu_step_kernel`."""
        if self.cpu_update is None:
            return ""
        if self.cpu_update.kernel is not None:
            return (
                f"teraio (Adam/AdamW on {self.cpu_update.kernel.threads} threads, bitwise torch's fused CPU "
                "kernel; reads bf16 gradients and writes the compute copies in its pass)"
            )
        return f"torch ({self.cpu_update.kernel_refusal})"

    def _await_update(self, slot: _Slot) -> None:
        future, slot.update = slot.update, None
        self._await_job(future)

    def _await_job(self, future: Optional[concurrent.futures.Future[Any]]) -> None:
        """Waits for a job of the CPU step's worker (raising its failure); the wait counts as the
        CPU step's."""
        if future is None:
            return
        started = time.perf_counter()
        future.result()
        waits = self._counts.wait_s
        waits["cpu step"] = waits.get("cpu step", 0.0) + time.perf_counter() - started

    def _await_updates(self) -> None:
        """Waits for every update the CPU step has queued, and for the GPU share's copies out
        (which the worker and the state's readers read in host memory)."""
        if self._share_writes_pending:
            self._share_writes_pending = False
            if self.cuda:
                self.host.flush()
                self.host.d2h.synchronize()
        if not self._updates_pending:
            return
        self._updates_pending = False
        for slot in self.slots:
            self._await_update(slot)

    def _fetch_window(self, window: list[int]) -> list[Transfer]:
        """Issues the reads of a window's parameters, gradients and optimizer state (the host
        tier's as one batch)."""
        transfers: list[Transfer] = []
        with self.host.batched():
            for i in window:
                slot = self.slots[i]
                if not slot.grad_held:
                    continue
                self._finish_state_writes(self.plan.window_bytes, slot=slot)
                if slot.write is not None:
                    slot.write.join()  # the step changes the parameter: its last write must be done
                    slot.write = None
                if slot.tiers[cp.PARAMETER] != GPU:
                    self._acquire(slot)
                    self._account(slot.nbytes)
                grad = torch.empty_like(slot.param, memory_format=torch.contiguous_format)
                slot.incoming_grad = (grad, self._read_into(slot, cp.GRADIENT, flat_bytes(grad)))
                self._account(slot.nbytes)
                for name, value in _state_tensors(self.optimizer, slot.param, resident=False):
                    transfers.append(self._read(slot, (cp.STATE, name), value))
                    self._account(_nbytes(value))
        return transfers

    def _record_step_uses(self, stepped: list[_Slot]) -> None:
        """The running op (a step) read these parameters' gradients and wrote the parameters and
        their optimizer state (a gradient that never moved is left out of the record)."""
        if not self.recorder.recording:
            return
        for slot in stepped:
            self._record_use(slot, cp.GRADIENT)
            self._record_use(slot, cp.PARAMETER, write=True)
            for name, _ in _state_tensors(self.optimizer, slot.param):
                if ((cp.STATE, name), slot.index) in self._state_nbytes:
                    self._record_use(slot, (cp.STATE, name), write=True)

    def _account(self, nbytes: int) -> None:
        self._window_bytes += nbytes
        self.peak_step_window_bytes = max(self.peak_step_window_bytes, self._window_bytes)

    def _write_back(self, slots: list[_Slot]) -> None:
        """After their step: gradients dropped, parameters and state back to their tiers (the
        host tier's copies as one batch; their GPU memory is released once it is issued)."""
        released: list[torch.Tensor] = []
        moved: list[_Slot] = []
        with self.host.batched():
            for slot in slots:
                slot.param.grad = None
                self._window_bytes -= slot.nbytes
                for name, value in _state_tensors(self.optimizer, slot.param):
                    new = (slot.index, name) not in self._seen_state
                    if self._state_out(slot, name, value):
                        released.append(value)
                    if not new:
                        self._window_bytes -= self._state_nbytes[((cp.STATE, name), slot.index)]
                if slot.tiers[cp.PARAMETER] != GPU:
                    slot.write = self._write(slot, cp.PARAMETER, flat_bytes(slot.param))
                    if slot.tiers[cp.PARAMETER] == HOST:
                        slot.write = None  # the allocator keeps the memory until the copy has read it
                    moved.append(slot)
        for value in released:
            value.untyped_storage().resize_(0)
        for slot in moved:
            self._release(slot)
            self._window_bytes -= slot.nbytes

    def _state_out(self, slot: _Slot, name: str, value: torch.Tensor) -> bool:
        """Writes one optimizer-state tensor to its tier. True: a host write, the caller releases
        the tensor once the batch is issued; an SSD write releases it once the engine has read
        it."""
        self._seen_state.add((slot.index, name))
        kind = (cp.STATE, name)
        nbytes = _nbytes(value)
        self._state_nbytes[(kind, slot.index)] = nbytes
        if slot.tiers[cp.STATE] == HOST:
            self.host.reserve((kind, slot.index), nbytes)
        transfer = self._write(slot, kind, flat_bytes(value))
        if slot.tiers[cp.STATE] == HOST:
            return True
        self._state_writes.append((transfer, value, nbytes, slot.index))
        return False

    def _finish_state_writes(self, keep_bytes: int, slot: Optional[_Slot] = None) -> None:
        """Releases optimizer state whose SSD write is done; waits for the oldest while more than
        `keep_bytes` wait, and for every write of `slot` (the step is about to change it)."""
        still = []
        for transfer, value, nbytes, index in self._state_writes:
            if slot is not None and index == slot.index:
                transfer.join()  # still resident: the step uses it as it is
                continue
            if transfer.done():
                value.untyped_storage().resize_(0)
            else:
                still.append((transfer, value, nbytes, index))
        while still and sum(n for _, _, n, _ in still) > keep_bytes:
            transfer, value, _, _ = still.pop(0)
            transfer.join()
            value.untyped_storage().resize_(0)
        self._state_writes = still

    def _poll_tiers(self) -> None:
        for tier in self.ssd.values():
            tier.poll()

    def _poll(self) -> None:
        self._poll_tiers()
        if self._state_writes:
            self._finish_state_writes(self.plan.window_bytes)
        for slot in self._pending_releases():
            if slot.write is not None and slot.write.done():
                self._release(slot)

    def _pending_releases(self) -> list[_Slot]:
        """The parameters whose release waits for their SSD write (drops the others)."""
        self._releasing = [slot for slot in self._releasing if slot.release_pending]
        return list(self._releasing)

    # -- iterations and the report ---------------------------------------------------------------

    def _begin_iteration(self) -> None:
        self._position = 0
        # The last iteration's first forward pass's marks, consumed at its step if it shared:
        # a run that never shares (the GPU step, the step in backward) would keep them all.
        self._forward_marks = []
        self._step_started = time.perf_counter()
        if self.steps == RECORDED_ITERATION:
            self.recorder.start()
            self._recorded_marks = {"start": self._step_started}
        if self.cuda and self.steps <= 1:
            # The iterations `_keep_resident` measures start from an empty cache: their reserved
            # peak is then what they made, not the parameters' GPU memory the cache still held
            # from before the session (a model moved to the GPU first), which would read as
            # allocator slack and shrink the room kept for resident parameters.
            torch.cuda.empty_cache()
        self._peak.arm()

    def _end_iteration(self) -> None:
        self.recorder.finish()
        self.inputs.end_iteration()
        moved = {
            (direction, tier): counter[tier]
            for direction, counter in (
                ("out", self.saved_stats.offloaded_bytes),
                ("in", self.saved_stats.prefetched_bytes),
            )
            for tier in (HOST, SSD)
        }
        for (direction, tier), now in moved.items():
            before = self._saved_moved.get((direction, tier), 0)
            if now > before:
                self._counts.add(direction, tier, cp.ACTIVATION, now - before)
        self._saved_moved = moved
        retries = self._allocator_retries()
        self._counts.allocator_retries, self._retries_seen = retries - self._retries_seen, retries
        if self.cuda and self.steps == 1:
            # The iteration `batch_fit` reads, before `_keep_resident` makes more parameters
            # resident.
            self._counts.peak_bytes = self._peak_bytes()
            stats = torch.cuda.memory_stats(self.device)
            self._counts.split_peak_bytes = int(stats.get("inactive_split_bytes.all.peak", 0))
        if self._recorded is None:
            self._recorded = list(self._order)
            self._keep_resident(first=True)
        elif self.steps == 1:
            self._keep_resident(first=False)
        self._iterations.append(self._counts)
        self._counts = _Counts()
        if self.options.sync_each_step and self.cuda:
            torch.cuda.synchronize(self.device)
        self._step_times_ms.append((time.perf_counter() - self._step_started) * 1e3)
        if self.cuda:
            self._peaks.append(self._peak_bytes())
        self.steps += 1
        self._begin_iteration()

    def _keep_resident(self, first: bool) -> None:
        """After the first and the second iteration: the GPU memory the iteration left unused
        (its peak, plus the reserve the allocator's behaviour asks for) keeps parameters resident
        for good, largest first: each saves its reads in forward, recomputation and the step,
        and its write after it. After the first, room is also kept for what it had not done yet
        (the step in backward's state reads: no state existed before its step); the second did
        all of it, so its own peak is the measure (the first alone can leave much of the
        budget unused)."""
        if not self.cuda:
            return
        peak = int(torch.cuda.max_memory_allocated(self.device))
        reserved = int(torch.cuda.max_memory_reserved(self.device))
        reserve = reserve_from_allocator(self.gpu_memory_bytes, reserved, peak)
        spare = self.gpu_memory_bytes - reserve - peak - self._unreached_bytes(first)
        for size, slot in sorted(((_gpu_bytes(s), s) for s in self.slots), key=lambda pair: -pair[0]):
            if slot.tiers[cp.PARAMETER] == GPU or size > spare:
                continue
            spare -= size
            self._acquire(slot)
            self._join(slot)
            slot.tiers[cp.PARAMETER] = GPU
            self.resident_parameter_bytes += size

    def _retries_warning(self) -> str:
        """A warning where the CUDA allocator retried after the first iteration ("": it did
        not): its waits are in no other figure of the report."""
        later = [c.allocator_retries for c in self._iterations[1:]]
        if not any(later):
            return ""
        return (
            f"the CUDA caching allocator retried {sum(later)} times in iterations 2 to {len(later) + 1} "
            "(each synchronizes the device and releases its cache): its free memory is fragmented; "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids that"
        )

    def _loop_host_ms(self, span_ms: float) -> float:
        """The recorded iteration's host time outside what the replay models (ms): the loop's
        own between iterations (`optimizer.step()`'s return, zero_grad, the next batch, launching
        the first op). With the CPU step at `optimizer.step()`, the time from the iteration's
        start to the first unit's entry, and from the end of the step's wait for the gradients'
        copies (or of the GPU's share of the step, whose ops and transfers the record holds) to
        the iteration's end: the replay models both that wait (the jobs wait for the
        copies) and the first unit's wait for its update. Otherwise (the GPU step, or the CPU
        step in backward, whose `optimizer.step()` waits for no copies) the wall time outside the
        GPU span (`span_ms`, which the step's waits fall inside)."""
        wall_ms = self._step_times_ms[RECORDED_ITERATION]
        marks = self._recorded_marks
        if "copies_done" in marks and "first_entry" in marks:
            end = marks["start"] + wall_ms / 1e3
            return max(0.0, (marks["first_entry"] - marks["start"]) + (end - marks["copies_done"])) * 1e3
        return max(0.0, wall_ms - span_ms)

    def _unreached_bytes(self, first: bool) -> int:
        """GPU memory an iteration may hold that the measured one need not have reached: writes to
        the store hold GPU memory until the engine has read it, up to their bounds; and where
        `first` (the first iteration, before any step) with the step in backward on the GPU, the
        state later iterations read in backward (the recomputed unit's, and up to
        `pull_forward_bytes` read ahead)."""
        in_flight = 0
        if any(slot.tiers[cp.GRADIENT] == SSD for slot in self.slots):
            in_flight += MAX_GRADIENT_WRITES_BYTES
        if any(slot.tiers[cp.STATE] == SSD for slot in self.slots):
            in_flight += self.plan.window_bytes
        if not self.moves_gradients and first:
            again = [unit for unit in set(self._order) if self._order.count(unit) > 1]
            in_flight += self.pull_forward_bytes + max(
                (sum(self._state_bytes[i] for i in self.units[unit].slots) for unit in again), default=0
            )
        return in_flight

    def batch_fit(self) -> Optional[cp.BatchFit]:
        """The largest micro-batch this budget holds, estimated from the second iteration (the
        first with every kind of traffic; `capacity.largest_batch`): None before it ran, on a CPU
        device, or for a model fed no token ids. What the estimate counts as held at any batch:
        the memory allocated as the iteration began, the largest unit's parameters and gradients
        (on the GPU together in its backward), and the store writes in flight. Usable: the budget
        less the split blocks the allocator held but could not hand out whole at that iteration's
        peak and `RESERVE_EXTRA_BYTES`, the margin every plan keeps; not the planning reserve's
        10% share, which is headroom for the allocator's behaviour at the batch that was
        measured. With expandable segments the allocator counts no split blocks, and the partly
        used pages it cannot release are not counted either: the margin alone covers them."""
        if not self.cuda or len(self._iterations) < 2:
            return None
        counts = self._iterations[1]
        if not counts.batch or counts.start_bytes is None or counts.peak_bytes is None:
            return None
        unit_bytes = max(
            sum(self.slots[i].nbytes * (2 if self.slots[i].param.requires_grad else 1) for i in unit.slots)
            for unit in self.units
        )
        margin = counts.split_peak_bytes + RESERVE_EXTRA_BYTES
        return cp.largest_batch(
            batch=counts.batch,
            peak_bytes=counts.peak_bytes,
            start_bytes=counts.start_bytes,
            held_bytes=unit_bytes + self._unreached_bytes(first=False),
            usable_bytes=self.gpu_memory_bytes - margin,
        )

    def suggest_batch(self) -> int:
        """The largest micro-batch (sequences of the length trained) that the GPU budget holds, as
        estimated by `batch_fit`: call it after two training iterations. The plan keeps the
        layout it chose for the batch the loop gives; a larger batch is the loop's to make (a new
        `teraio.offload` session plans for it). Raises RuntimeError where there is no estimate
        (before the second iteration, on a CPU device, for a model fed no token ids, or where the
        peak did not grow with the batch)."""
        fit = self.batch_fit()
        if fit is None:
            raise RuntimeError(
                "suggest_batch() needs two training iterations on a GPU with token ids as the model's "
                f"input (this session ran {len(self._iterations)} on {self.device})"
            )
        if fit.largest is None:
            raise RuntimeError(f"suggest_batch(): {fit.reason}")
        return fit.largest

    def predict(
        self,
        *,
        host_link_bandwidth: Optional[Any] = None,
        ssd_bandwidth: Optional[Any] = None,
        ssd_write_bandwidth: Optional[Any] = None,
    ) -> Optional[dict[str, Any]]:
        """The recorded iteration (`RECORDED_ITERATION`) replayed in the simulator at the planned
        bandwidths (`self.link`), or at those given (bytes/s or text such as "4x6.5GB/s": what
        more SSDs or another link would do to this schedule). The link moves each way at its
        duplex rate while both directions are busy: the measured one, or for a link given here
        the measured ratio of duplex to one way. None before that iteration ran. Returns the
        replay's figures in ms and bytes, with the bandwidths assumed."""
        record = self.recorder.result()
        if record is None:
            return None
        planned = min(self.link.d2h, self.link.h2d)
        link = planned if host_link_bandwidth is None else parse_bandwidth(host_link_bandwidth)
        # Both directions at once: the measured share of the one-way rate, at any link.
        duplex = None if self.link.duplex is None else min(self.link.duplex, planned) * link / planned
        read = self.link.ssd_read if ssd_bandwidth is None else parse_bandwidth(ssd_bandwidth)
        write = self.link.ssd_write if ssd_bandwidth is None else read
        write = write if ssd_write_bandwidth is None else parse_bandwidth(ssd_write_bandwidth)
        # The loop's own host time between iterations, which no bandwidth changes, is an op of
        # its own after the last: the transfers and CPU jobs issued after the last op run
        # through it, as the worker and the copy engines do while the loop runs (reads issued
        # there for the next forward pass are no longer at its first op: not urgent).
        outside_ms = self._loop_host_ms(record.span_ms)
        gap = {"name": "the loop's host time between iterations", "duration_us": outside_ms * 1e3}
        with_gap = dataclasses.replace(record, trace={**record.trace, "ops": [*record.trace["ops"], gap]})
        sim = with_gap.replay(
            host_link_bytes_per_s=link,
            ssd_read_bytes_per_s=read,
            ssd_write_bytes_per_s=write,
            ssd_shared=self.link.ssd_shared,
            host_link_duplex_bytes_per_s=duplex,
        )
        compute_ms = sim["compute_time_us"] / 1e3 - outside_ms
        return {
            "iteration_ms": sim["iteration_time_us"] / 1e3,
            "compute_ms": compute_ms,
            "stall_ms": sim["stall_time_us"] / 1e3,
            # The same iteration as it ran: its GPU span, and its waits (span less the ops).
            "recorded_span_ms": record.span_ms,
            "recorded_waits_ms": record.span_ms - compute_ms,
            "outside_span_ms": outside_ms,
            "ops": len(record.trace["ops"]),
            "host_read_bytes": sim["host_read_bytes"],
            "host_written_bytes": sim["host_written_bytes"],
            "ssd_read_bytes": sim["ssd_read_bytes"],
            "ssd_written_bytes": sim["ssd_written_bytes"],
            "demand_fetches": sim["demand_fetches"],
            "unmodelled_transfers": record.unmodelled_transfers,
            # The CPU step's jobs the replay ran on its worker (update="cpu"; 0 otherwise).
            "cpu_update_ms": record.cpu_update_ms,
            "cpu_jobs": len(record.schedule.get("cpu_jobs", [])),
            "unmodelled_job_tensors": record.unmodelled_job_tensors,
            "host_link_bytes_per_s": link,
            "host_link_duplex_bytes_per_s": duplex,
            "ssd_read_bytes_per_s": read,
            "ssd_write_bytes_per_s": write,
            "ssd_shared": self.link.ssd_shared,
            "recorded_iteration": RECORDED_ITERATION,
        }

    def minimum_bytes(self) -> dict[str, dict[str, dict[str, int]]]:
        """The least an iteration must move with the current placement (parameters kept on the
        GPU move nothing) and update site, shaped as `WholeModelReport.bytes_per_iteration`:
        forward reads each parameter once and backward sends each gradient out once; a step on
        the GPU also reads each gradient back and moves the parameters it updates and their
        optimizer state both ways (the step in backward keeps the gradients on the GPU)."""
        counts = _Counts()
        on_gpu = self.update_site.site == cp.GPU_UPDATE
        for slot in self.slots:
            moved_param = slot.tiers[cp.PARAMETER] != GPU
            # A compute copy crosses the link in its dtype, and so does its gradient.
            crossing = _numel_bytes(slot.param, COPY_DTYPE) if slot.low is not None else slot.nbytes
            if moved_param:
                counts.add("in", slot.tiers[cp.PARAMETER], cp.PARAMETER, crossing)
            if not slot.param.requires_grad:
                continue
            if self.moves_gradients:
                counts.add("out", slot.tiers[cp.GRADIENT], cp.GRADIENT, crossing)
            if not on_gpu:
                continue
            if not self.step_in_backward:
                counts.add("in", slot.tiers[cp.GRADIENT], cp.GRADIENT, slot.nbytes)
                if moved_param:
                    counts.add("in", slot.tiers[cp.PARAMETER], cp.PARAMETER, slot.nbytes)
            if moved_param:
                counts.add("out", slot.tiers[cp.PARAMETER], cp.PARAMETER, slot.nbytes)
            for direction in ("in", "out"):
                counts.add(direction, slot.tiers[cp.STATE], cp.STATE, self._state_bytes[slot.index])
        return counts.moved()

    def report(self) -> WholeModelReport:
        later = self._iterations[1:] or self._iterations
        middle = later[len(later) // 2] if later else _Counts()
        times = self._step_times_ms[1:] or self._step_times_ms
        measured = statistics.median(times) if times else None
        try:
            prediction = self.predict()
        except PlannerError as failure:  # a schedule the replay cannot pair up: say so
            prediction, failure_text = (
                None,
                f"no prediction: the recorded schedule does not replay ({failure})",
            )
        else:
            failure_text = ""
        predicted = prediction["iteration_ms"] if prediction else None
        tokens = middle.tokens or None
        tokens_per_s = tokens / measured * 1e3 if tokens and measured else None
        parameters = sum(slot.param.numel() for slot in self.slots)
        error, warning = check_prediction(measured, predicted)
        warning = warning or failure_text
        hint = step_in_backward_hint(
            update=self.update_site.site,
            step_in_backward=self.step_in_backward,
            steps=self.steps,
            refusal=self._loop_refusal(),
            cpu_wait_ms=middle.wait_s.get("cpu step", 0.0) * 1e3,
            iteration_ms=measured,
        )
        fit = self.batch_fit()
        reported = self._iterations[:ITERATIONS_REPORTED]
        return WholeModelReport(
            batch=max((counts.batch for counts in self._iterations), default=0) or None,
            largest_batch=fit.largest if fit else None,
            largest_batch_note=fit.reason if fit else "",
            steps=self.steps,
            measured_iteration_ms=measured,
            step_times_ms=list(self._step_times_ms),
            step_ms=statistics.median(self._step_ms[1:] or self._step_ms) if self._step_ms else None,
            peak_gpu_bytes=max(self._peaks[1:] or self._peaks) if self._peaks else None,
            gpu_memory_bytes=self.gpu_memory_bytes,
            model_state_bytes=self.model_state_bytes,
            bytes_per_iteration=middle.moved(),
            placement={HOST: dict(self.plan.host_bytes), SSD: dict(self.plan.ssd_bytes)},
            pinned_host_bytes=self.host.peak_bytes + self.inputs.peak_bytes,
            peak_host_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            peak_step_window_bytes=self.peak_step_window_bytes,
            window_bytes=self.plan.window_bytes,
            windows=len(self.plan.windows),
            units=len(self.units),
            checkpointed_blocks=len(self.blocks),
            wait_ms_per_iteration={k: v * 1e3 for k, v in middle.wait_s.items()},
            wait_ms_by_iteration=[
                {**{k: v * 1e3 for k, v in c.wait_s.items()}, "hooks": c.host_s * 1e3} for c in reported
            ],
            allocator_retries_by_iteration=[c.allocator_retries for c in reported],
            host_ms_per_iteration=(
                {
                    "hooks": statistics.median(c.host_s for c in later) * 1e3,
                    "step": statistics.median(c.wait_s["step"] for c in later) * 1e3,
                }
                if later
                else {}
            ),
            on_demand_fetches=self.on_demand_fetches,
            resident_parameter_bytes=self.resident_parameter_bytes,
            returned_to=self.returned_to,
            step_in_backward=self.step_in_backward,
            step_in_backward_reason=self.step_in_backward_reason,
            predicted_iteration_ms=predicted,
            prediction_error_percent=error,
            prediction=prediction or {},
            warnings=[w for w in (warning, self._retries_warning()) if w],
            machine=dict(self.machine),
            loss_head=self.loss_head.describe(),
            update=self.update_site.site,
            update_reason=self.update_site.reason,
            cpu_step_kernel=self._cpu_step_kernel(),
            cpu_update_ms=statistics.median(self._cpu_update_ms[1:] or self._cpu_update_ms)
            if self._cpu_update_ms
            else None,
            cpu_update_ms_by_iteration=self._cpu_update_ms[:ITERATIONS_REPORTED],
            gpu_step_share_elements_by_iteration=self._share_elements[:ITERATIONS_REPORTED],
            gpu_step_share_ms=statistics.median(self._share_ms) if self._share_ms else None,
            gpu_step_share=self._share_refusal or str(self._share_setting),
            minimum_bytes_moved=self.minimum_bytes(),
            compute_copies="off" if self.compute_copies is None else str(self.compute_copies).split(".")[-1],
            compute_copies_reason=self._copies_reason or "decided at the first step",
            compute_copy_parameters=sum(slot.low is not None for slot in self._copy_slots),
            compute_copy_elements=sum(s.param.numel() for s in self._copy_slots if s.low is not None),
            compute_copy_bytes=self.compute_copy_bytes,
            checkpoint_inputs=self.checkpoint_inputs,
            checkpoint_inputs_pinned_bytes=self.inputs.peak_bytes,
            hints=[hint] if hint else [],
            checkpoint_inputs_kept_for_room=self.saved_stats.kept_for_room,
            tokens_per_iteration=tokens,
            tokens_per_s=tokens_per_s,
            model_tflops=6 * parameters * tokens_per_s / 1e12 if tokens_per_s else None,
            update_model_ms={
                "gpu": None if self.update_site.gpu_step_s is None else self.update_site.gpu_step_s * 1e3,
                "cpu": None if self.update_site.cpu_step_s is None else self.update_site.cpu_step_s * 1e3,
            },
        )


#: The hint for the step in backward appears where the forward pass waits at least this share
#: of the iteration for the CPU step.
HINT_WAIT_SHARE = 0.1


def step_in_backward_hint(
    *,
    update: str,
    step_in_backward: bool,
    steps: int,
    refusal: str,
    cpu_wait_ms: float,
    iteration_ms: Optional[float],
) -> Optional[str]:
    """The report's hint to let the step run in backward (None: none): where the CPU step runs
    after backward and the next forward pass waits for it (`HINT_WAIT_SHARE` of the iteration or
    more), and the loop, as far as it ran (more than `RECORDED_ITERATION` steps), did nothing
    that rules the step in backward out (`refusal`, `ModelOffload._loop_refusal`: "" for none)."""
    if update != cp.CPU_UPDATE or step_in_backward or steps <= RECORDED_ITERATION:
        return None
    if refusal or not iteration_ms or cpu_wait_ms < HINT_WAIT_SHARE * iteration_ms:
        return None
    return (
        f"the forward pass waited {cpu_wait_ms:.0f} ms per iteration for the CPU step, which runs "
        "after backward; this loop has neither clipped nor accumulated gradients, so "
        "step_in_backward='auto' (the default) would run each unit's update beside backward "
        "instead (it goes on where the loop's first iterations allow it)"
    )


class _Counts:
    """Bytes moved and host waits in one iteration."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str, str], int] = {}
        self.wait_s = {"units": 0.0, "step": 0.0}
        # Host time in the runtime's hooks (unit entry and exit, saved tensors, gradients, the
        # step in backward at its end); the step's own is `wait_s["step"]`.
        self.host_s = 0.0
        self.tokens = 0  # `ModelOffload._count_tokens`
        # The largest micro-batch (sequences) of a training forward pass, the GPU memory allocated
        # as the iteration's first one began, the iteration's allocated peak and its peak of split
        # blocks the allocator held but could not hand out whole (on a GPU): what
        # `ModelOffload.batch_fit` estimates from.
        self.batch = 0
        self.start_bytes: Optional[int] = None
        self.peak_bytes: Optional[int] = None
        self.split_peak_bytes = 0
        # The CUDA allocator's retries in the iteration (`Session._allocator_retries`).
        self.allocator_retries = 0

    def add(self, direction: str, tier: str, kind: Any, nbytes: int) -> None:
        base = kind[0] if isinstance(kind, tuple) else kind
        key = (direction, tier, base)
        self.bytes[key] = self.bytes.get(key, 0) + nbytes

    def moved(self) -> dict[str, dict[str, dict[str, int]]]:
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (direction, tier, kind), nbytes in sorted(self.bytes.items()):
            out.setdefault(direction, {}).setdefault(tier, {})[kind] = nbytes
        return out


def _uses_foreach(tensor: torch.Tensor, foreach: Optional[bool]) -> bool:
    """torch's clip_grad_norm_ choice between the foreach kernels and per-tensor ops (the same
    bits either way: both work tensor by tensor)."""
    device = tensor.device
    if (foreach is None and _has_foreach_support([tensor], device)) or (
        foreach and _device_has_foreach_support(device)
    ):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


def _norm(tensor: torch.Tensor, norm_type: float, foreach: Optional[bool]) -> torch.Tensor:
    if _uses_foreach(tensor, foreach):
        return torch._foreach_norm([tensor], norm_type)[0]
    return torch.linalg.vector_norm(tensor, norm_type)


def _scale(tensor: torch.Tensor, coef: torch.Tensor, foreach: Optional[bool]) -> None:
    if _uses_foreach(tensor, foreach):
        torch._foreach_mul_([tensor], coef)
    else:
        tensor.mul_(coef)


def _recorded(kind: Any, index: int) -> tuple[Any, int]:
    """The record's key of `kind` of parameter `index`: a compute copy's transfers are its
    parameter's or gradient's, whose bytes they carry across the link."""
    return ({PARAMETER_COPY: cp.PARAMETER, GRADIENT_COPY: cp.GRADIENT}.get(kind, kind), index)


def _rate(bytes_per_s: Optional[float]) -> str:
    return "the same" if bytes_per_s is None else f"{bytes_per_s / 1e9:.1f} GB/s"


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes())


def _numel_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    return tensor.numel() * dtype.itemsize


def balanced_share(total: int, cpu_s: float, gpu_s: float, forward_s: float) -> float:
    """The elements of a step's `total` the GPU's share takes (`gpu_step_share="auto"`): the
    worker updates the other total - s in cpu_s (total - s) seconds (`cpu_s`, `gpu_s`: seconds
    per element), while the training thread updates s in gpu_s s and then runs the next
    forward pass, `forward_s` of compute, whose units wait for the worker's; both end together
    at s = (cpu_s total - forward_s) / (cpu_s + gpu_s), and none is taken where the worker
    alone finishes within the forward pass."""
    return max(0.0, (cpu_s * total - forward_s) / (cpu_s + gpu_s))


#: A parameter of the GPU's share: its device tensors (master, gradient, exp_avg, exp_avg_sq) and
#: the reads filling them.
_ShareRead = tuple[_Slot, tuple[torch.Tensor, ...], list[Transfer]]


def _share_bytes(slot: _Slot) -> int:
    """GPU bytes the GPU's share of the step holds for the parameter: its fp32 master, gradient
    and two moments."""
    return 4 * _numel_bytes(slot.param, slot.full.dtype)


def _gpu_bytes(slot: _Slot) -> int:
    """The GPU memory the parameter takes while resident: in its compute copy's dtype where it
    has one (`.data` is the copy), else its own."""
    return _numel_bytes(slot.param, slot.param.dtype)


def _copy_candidates(model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]]) -> list[int]:
    """The parameters (indices into `named`) that may have compute copies: the fp32 weight and
    bias of an exact `torch.nn.Linear` (autocast lowers its one op to bf16) that no other module
    holds (a head tied to an embedding is read by the embedding in fp32)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    chosen = []
    for index, (_, param) in enumerate(named):
        held = owners.get(id(param), [])
        if len(held) != 1 or param.dtype != torch.float32:
            continue
        module, name = held[0]
        if type(module) is torch.nn.Linear and name in ("weight", "bias"):
            chosen.append(index)
    return chosen


def _state_tensors(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, resident: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's per-parameter tensors of `param` (not its scalar `step`) whose storage is
    (`resident`) or is not on the GPU now."""
    return [
        (name, value)
        for name, value in optimizer.state.get(param, {}).items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and (_nbytes(value) > 0) == resident
    ]


def _named_unique_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    seen: set[int] = set()
    named = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    return named


def _refuse_shared_storage(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Two parameters over one storage cannot be released one at a time."""
    owners: dict[int, str] = {}
    for name, param in named:
        pointer = param.untyped_storage().data_ptr()
        if pointer in owners:
            raise ValueError(
                f"teraio.offload (whole-model): parameters {owners[pointer]} and {name} share one "
                "storage; give each its own tensor"
            )
        owners[pointer] = name


def _refuse_foreign_parameters(
    named: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer
) -> None:
    """The streamed step calls the optimizer once per window: a parameter the model does not own
    would keep its gradient through every call and be stepped once per window."""
    owned = {id(p) for _, p in named}
    foreign = [p for p in _trained(optimizer) if id(p) not in owned]
    if foreign:
        shape = tuple(foreign[0].shape)
        raise ValueError(
            f"teraio.offload (whole-model): the optimizer holds {len(foreign)} parameter(s) the model "
            f"does not own (the first of shape {shape}); register them on the model (e.g. as an "
            "nn.Parameter attribute) or leave them out of this optimizer"
        )


def _trained(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def _inside(name: str, blocks: list[tuple[str, torch.nn.Module]]) -> bool:
    return any(name.startswith(block + ".") for block, _ in blocks)


def _optimizer_method(call: Callable[..., Any], optimizer: Optimizer) -> Any:
    """`call` as a method of `optimizer`: an LR scheduler made inside the session wraps
    `optimizer.step` by rebinding its function to the optimizer, which a method of the session
    would not survive."""

    def method(_optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return types.MethodType(method, optimizer)
