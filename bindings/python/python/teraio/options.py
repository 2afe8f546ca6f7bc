"""`teraio.OffloadOptions`: every setting of `teraio.offload` in one documented object.

The defaults are meant to be used as they are: "auto" values are measured on the machine (the
host link, the store's bandwidth: `teraio.machine`, cached with the store), bounded by what it has
(pinned host memory: a share of MemAvailable) or taken from the allocator's behaviour in the
profiled iteration (the reserve). Any field can also be passed to `teraio.offload` as a keyword.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

Size = Union[int, float, str]
Bandwidth = Union[float, str]


@dataclass
class OffloadOptions:
    """Settings of `teraio.offload` (see docs/python.md, "`teraio.offload`").

    Machine (measured or bounded when "auto"):
        host_memory: pinned host memory the runtime may hold ("auto": MemAvailable at the start
            less a margin, split between the ranks on the host: `machine.default_host_memory`);
            more than MemAvailable is refused.
        ssd_bandwidth / ssd_write_bandwidth: the store's read / write bandwidth the planner
            assumes ("auto": measured once per store through the engine, cached next to its
            first device, times `machine.PLAN_SHARE`).
        host_link_bandwidth: host <-> GPU bandwidth the planner assumes ("auto": pinned copies
            measured once per store and GPU (per process without a store), times
            `machine.PLAN_SHARE` of the slower direction).
        ssd_shared: the store's reads and writes share its devices' time (None: True when the
            SSD bandwidth was measured, since the measurement is each direction alone).
        reserve: GPU memory the plan leaves free for the allocator ("auto": from the profiled
            iteration's reserved-minus-allocated peak, `machine.reserve_from_allocator`).

    Plan:
        granularity: "auto" (default: "block" for a model with repeated blocks, a `ModuleList` of
            one class such as transformer layers; else "tensor"), "block" or "tensor". "block":
            per block keep, host memory or recompute, planned from times and sizes measured in
            three iterations with every block checkpointed (`teraio.runtime.modes.block`); never
            kept where it measures slower than checkpointing every block. "tensor": per saved tensor, planned
            from a profiled iteration by the lifetime planner (the options below marked "tensor").
        recompute: per-tensor recomputation of cheap saved activations: "auto", "on", "off".
        whole_model: "auto" (default: on when the parameters, gradients and optimizer state
            exceed `WHOLE_MODEL_SHARE` (`teraio.runtime.modes.whole_model`) of `gpu_memory`
            and the parameters and gradients `WHOLE_MODEL_WEIGHTS_SHARE`), "on" or "off". In
            whole-model mode parameters, gradients and optimizer state live in host memory (up to
            `host_memory`) and on the store, and come to the GPU only while used (docs/python.md,
            "Whole-model offload").
        step_window: whole-model mode: parameter + gradient + state bytes the streamed optimizer
            step holds on the GPU per window ("auto": `WINDOW_SHARE` of `gpu_memory`).
        step_in_backward: whole-model mode: update each parameter in backward, as soon as its
            gradient is complete, instead of at `optimizer.step()`: "auto" (default: with the
            step on the CPU, from the third iteration on where the first two showed a loop that
            the step in backward leaves exact: one backward per `optimizer.step()`, no
            `clip_grad_norm_`, the optimizer's hyperparameters unchanged between backward and
            the step; the CPU step then runs beside backward. A later clip whose coefficient is
            1 (it scales nothing) is answered from the gradients' norms and turns it off from
            the next iteration; a clip that would scale, a second backward or a
            `zero_grad()` before `optimizer.step()`, or hyperparameters changed in between
            raise, saying so: the update has run. The report says whether it went on and
            why), True (from the first iteration: on the GPU, where backward left the parameter
            (no gradient moves, no parameter is read in again; what `update="auto"` gives), or
            with `update="cpu"` on the CPU, each unit's update queued behind its gradients'
            copies out; the loop then must not clip gradients nor accumulate them over backward
            passes (both raise), and every backward updates the model: `optimizer.step()` only
            ends the iteration) or False (at `optimizer.step()`). The update is the optimizer's
            own, so losses match the default's. Under FSDP2 with `CPUOffloadPolicy` it is the
            host shards' step (`runtime/modes/host_step.py`): the same three settings, "auto"
            from the second step where the first showed one backward per step, no clip and
            unchanged hyperparameters.
        update: whole-model mode: where the optimizer step runs: "auto" (default: on the CPU where
            parameters, gradients and optimizer state all live in host memory, the optimizer
            can step on the CPU and `capacity.choose_update_site`'s model says it is faster than
            streaming them through the GPU; else on the GPU; on a CPU "device" always "gpu"),
            "gpu" (the streamed step, or the step in backward on the GPU) or "cpu" (gradients go out to host
            memory, where the fp32 master and the optimizer state stay; a CPU copy of the
            user's optimizer class updates them with its param_groups' hyperparameters read at
            each step; an error where the plan puts any of them on the store).
        compute_copies: whole-model mode with the step on the CPU: "on" (where every forward
            pass of the first iteration runs under bf16 autocast, each parameter of an exact
            `torch.nn.Linear` not shared with another module gets a pinned bf16 copy in host
            memory, rounded from its fp32 master by each CPU update; the GPU reads the copy,
            half the bytes, and sends its bf16 gradient back, which the update reads as fp32:
            the same bits as autocast's own casts; needs room in `host_memory` beside the plan),
            "auto" (default: "on" where the engine's Adam/AdamW kernel runs the CPU step, which
            converts in its own pass; with torch's step, where `capacity.choose_compute_copies`
            finds that halving the link's bytes outweighs the conversions; on a CPU "device"
            off) or "off" (parameters and gradients cross the link in fp32).
        gpu_step_share: whole-model mode with the CPU step at `optimizer.step()` (a loop that
            clips or accumulates gradients, or `step_in_backward=False`): the share of the
            step's elements the GPU updates while the CPU step's worker updates the rest, taken
            from the units the next forward pass enters last: "auto" (default: on CUDA where
            the engine's Adam/AdamW kernel runs the CPU step, from the third step on (the first
            makes the state, the second measures the worker), as many as end together with the
            worker's share at the measured rates, the next forward pass's compute counted; none
            where the worker ends within that forward pass),
            "off", or a fraction in [0, 1]. Their fp32 masters, gradients and Adam moments come
            up from pinned host memory, torch's fused AdamW of the device updates them, and
            they go back; on CUDA its rounding differs from the CPU kernel's.
        cpu_update_bandwidth: the CPU step's rate the choice of `update` assumes, in parameter +
            gradient + state bytes per second ("auto": measured once per process on a 256 MiB
            AdamW step, `machine.measure_cpu_update`).
        checkpoint: whole-block recomputation (activation checkpointing of the repeated blocks,
            e.g. transformer layers): None (the default: "off", and "all" in whole-model mode),
            "off", "auto" (plans with 0, 1/4, 1/2, 3/4 and all blocks checkpointed and keeps the
            fastest prediction; in whole-model mode: "all"), or "all". "auto" is
            opt-in: a plan with part of the blocks checkpointed has met plan mismatches and run
            out of memory on the GPU (benches/results/2026-11-24-h100/qwen2-65-defaults-oom.log).
        checkpoint_inputs: whole-model mode: where the inputs of the checkpointed blocks (what
            `torch.utils.checkpoint` keeps for backward's recomputation: a block's hidden states)
            wait for backward: "host" (copied to pinned host memory as they are saved, and back one
            block ahead of the recomputation that needs them; the last block's stay, as backward
            starts with it; the buffers take host memory beside the plan's; a save with no room
            left there goes to the store, or, without one or with it full, stays on the GPU and is
            counted in the report), "gpu" (they stay), or "auto"
            (default: "host" on CUDA, "gpu" on a CPU device). On the host they take no GPU memory,
            so a larger batch fits the budget.
        tier_preference: "auto", "host" or "ssd".
        offload_optimizer_state / offload_parameters: what else the plan may move.
        prefetch_slack: earlier prefetches where memory has room (multiple of transfer time).
        op_time_scale: multiplies the (calibrated) op times before planning.
        calibrate: scale the profiled op times to an unprofiled iteration (default False:
            opt-in, because the calibration iteration times blocks that may wait on offload
            I/O and counts the wait as compute:
            benches/results/2026-11-24-h100/qwen2-65-checkpoint-off.log). Without it the
            report's ideal is labelled as an
            estimate from raw profiled op times. None: on CUDA only.
        if_no_fit: "raise" (default: a clear error before the planned iterations when no plan
            fits the budget) or "run" (train anyway, waiting for transfers as needed).
        frozen_compute_copies: the block plan: "auto" (default: where the first iteration's
            forward runs under bf16 or fp16 autocast, the frozen fp32 weights held only by
            `torch.nn.Linear` modules in the repeated blocks, such as LoRA's base weights, are
            held on the device in that dtype, their fp32 values in CPU memory; the same bits,
            half their device memory and no saved casts; `state_dict()` returns the fp32 values
            from CPU memory, and leaving puts them back; `runtime/movers/frozen.py`) or "off".
        loss_head: the block plan and whole-model mode: "chunked" (default: a Hugging Face causal
            LM's loss runs as `teraio.head.causal_lm_loss`, the same bits without the full-size
            fp32 copies of the logits; it computes the logits' gradient in forward while the
            loop's `loss.backward()` gives the loss a gradient of 1, and reads that gradient on
            the host in backward, one synchronization) or "model" (the model's own loss, as it is).
        fp32_outputs: with `loss_head="chunked"`, on a model Accelerate prepared for mixed
            precision (the Trainer's): "loss_only" (default: a training forward whose loss the
            head computed returns the loss in fp32 and every other output, the logits among them,
            in the model's dtype, without Accelerate's fp32 copy of them) or "all" (Accelerate's
            fp32 copy of every output, as without teraio).

    Runtime:
        warmup_steps: iterations before the profiled one (None: 1, or 2 under DDP).
        min_bytes: saved tensors smaller than this stay on the GPU.
        max_inflight_bytes: device-to-host bytes in flight before a save waits.
        copy_streams / pull_forward_bytes: prefetch streams and early issue (docs/python.md).
        sync_each_step: synchronize the device after each step.
        trace_path / plan_path: where to write the trace and the plan (JSON).
    """

    host_memory: Size = "auto"
    ssd_bandwidth: Bandwidth = "auto"
    ssd_write_bandwidth: Optional[Bandwidth] = "auto"
    host_link_bandwidth: Bandwidth = "auto"
    ssd_shared: Optional[bool] = None
    reserve: Optional[Size] = "auto"
    granularity: str = "auto"
    recompute: str = "auto"
    checkpoint: Optional[str] = None
    checkpoint_inputs: str = "auto"
    whole_model: str = "auto"
    step_window: Size = "auto"
    step_in_backward: Union[bool, str] = "auto"
    update: str = "auto"
    compute_copies: str = "auto"
    gpu_step_share: Union[str, float] = "auto"
    cpu_update_bandwidth: Bandwidth = "auto"
    tier_preference: str = "auto"
    offload_optimizer_state: bool = True
    offload_parameters: bool = False
    prefetch_slack: float = 1.0
    op_time_scale: float = 1.0
    calibrate: Optional[bool] = False
    if_no_fit: str = "raise"
    frozen_compute_copies: str = "auto"
    loss_head: str = "chunked"
    fp32_outputs: str = "loss_only"
    warmup_steps: Optional[int] = None
    min_bytes: int = 1 << 20
    max_inflight_bytes: Size = 2 << 30
    copy_streams: int = 2
    pull_forward_bytes: Size = 512 << 20
    sync_each_step: bool = False
    trace_path: Optional[str] = None
    plan_path: Optional[str] = None

    def __post_init__(self) -> None:
        choices = {
            "granularity": ("auto", "block", "tensor"),
            "recompute": ("auto", "on", "off"),
            "checkpoint": (None, "auto", "off", "all"),
            "checkpoint_inputs": ("auto", "host", "gpu"),
            "whole_model": ("auto", "on", "off"),
            "update": ("auto", "gpu", "cpu"),
            "compute_copies": ("auto", "on", "off"),
            "tier_preference": ("auto", "host", "ssd"),
            "if_no_fit": ("raise", "run"),
            "loss_head": ("chunked", "model"),
            "fp32_outputs": ("loss_only", "all"),
            "frozen_compute_copies": ("auto", "off"),
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                listed = ", ".join(repr(a) for a in allowed)
                raise ValueError(f"{name} must be one of {listed}, not {value!r}")
        if self.step_in_backward not in (True, False, "auto"):
            raise ValueError(f"step_in_backward must be True, False or 'auto', not {self.step_in_backward!r}")
        share = self.gpu_step_share
        if share not in ("auto", "off") and (
            isinstance(share, (bool, str)) or not isinstance(share, (int, float)) or not 0 <= share <= 1
        ):
            raise ValueError(f"gpu_step_share must be 'auto', 'off' or a fraction in [0, 1], not {share!r}")
        if self.copy_streams < 1:
            raise ValueError(f"copy_streams must be >= 1, got {self.copy_streams}")

    def replace(self, **changes: object) -> OffloadOptions:
        """A copy with `changes`; an unknown name is a TypeError listing the valid ones."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(
                f"unknown teraio.offload option(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}"
            )
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def options_table() -> str:
    """The fields of `OffloadOptions` as a Markdown table (docs/runtime.md holds it): name,
    default and what it sets, from the dataclass and its docstring (one entry per field, or one
    for several as "a / b: ...")."""
    entries = _field_docs()
    rows = ["| field | default | what it sets |", "|---|---|---|"]
    done: set[str] = set()
    for item in dataclasses.fields(OffloadOptions):
        if item.name in done:
            continue
        names, text = entries[item.name]
        done.update(names)
        defaults = {_default_text(n) for n in names}
        default = (
            " / ".join(f"`{_default_text(n)}`" for n in names) if len(defaults) > 1 else f"`{defaults.pop()}`"
        )
        rows.append(f"| {' / '.join(f'`{n}`' for n in names)} | {default} | {text} |")
    return "\n".join(rows) + "\n"


def _default_text(name: str) -> str:
    default = OffloadOptions.__dataclass_fields__[name].default
    return "None" if default is None else repr(default).replace("'", '"')


def _field_docs() -> dict[str, tuple[list[str], str]]:
    """Each field's entry in the class docstring: the fields it names and its text on one line."""
    entries: list[tuple[list[str], list[str]]] = []
    current: list[str] = []
    for line in (OffloadOptions.__doc__ or "").splitlines():
        head = line[8:] if line.startswith(" " * 8) and not line.startswith(" " * 9) else None
        if head is not None and ": " in head:
            names, text = head.split(": ", 1)
            if all(name.isidentifier() for name in names.split(" / ")):
                current = [text.strip()]
                entries.append((names.split(" / "), current))
                continue
        if current and line.startswith(" " * 12):
            current.append(line.strip())
        else:
            current = []
    found = {name: (names, " ".join(text)) for names, text in entries for name in names}
    missing = [f.name for f in dataclasses.fields(OffloadOptions) if f.name not in found]
    if missing:
        raise AssertionError(f"OffloadOptions' docstring has no entry for {', '.join(missing)}")
    return found
