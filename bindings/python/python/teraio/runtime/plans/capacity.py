"""Where a whole model's parameters, gradients and optimizer state live: the capacity plan.

When they do not fit the GPU budget (`teraio.offload` decides; see `whole_model`), every
parameter gets a home tier for each of its three kinds of bytes:

- parameter (fp32 master or whatever its dtype is): read in the forward pass, again where
  backward recomputes or uses it, read and written in the step: the most traffic per byte;
- gradient: written once in backward, read once in the step;
- optimizer state (e.g. AdamW's `exp_avg`, `exp_avg_sq`): read and written once, in the step.

With the step on the CPU, host memory may also hold compute copies (`compute_copy_room`): a
bf16 copy of parameters that autocast reads in bf16 anyway, and the bf16 gradients on their way
to the fp32 gradient buffers. They take what the plan leaves of the cap, never the plan's room.

Host memory (pinned, at most `host_capacity_bytes`) takes them in that order of traffic per byte;
what does not fit goes to the SSD store. The step runs in windows of at most `window_bytes`
(parameter + gradient + state, on the GPU at once; a larger single parameter is a window of its
own). Everything is decided before the first iteration, from sizes alone; the runtime checks the
plan against the store's free space and says how much is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ...planning import format_bytes as _gib
from ..movers.tiers import HOST, SSD

PARAMETER = "parameter"
GRADIENT = "gradient"
STATE = "optimizer_state"
#: Saved activations (the checkpointed blocks' inputs): moved, never placed.
ACTIVATION = "activation"

#: Kinds in the order host memory takes them (traffic per byte, highest first).
KINDS = (PARAMETER, GRADIENT, STATE)


@dataclass(frozen=True)
class SlotSize:
    """One parameter's bytes of each kind (state: the optimizer's per-parameter tensors)."""

    name: str
    parameter: int
    gradient: int
    state: int

    def of(self, kind: str) -> int:
        return {PARAMETER: self.parameter, GRADIENT: self.gradient, STATE: self.state}[kind]

    @property
    def total(self) -> int:
        return self.parameter + self.gradient + self.state


@dataclass
class CapacityPlan:
    """Per parameter (in `SlotSize` order) the tier of each kind, and the step's windows."""

    tiers: list[dict[str, str]]
    windows: list[list[int]]
    host_bytes: dict[str, int] = field(default_factory=dict)
    ssd_bytes: dict[str, int] = field(default_factory=dict)
    window_bytes: int = 0

    @property
    def ssd_total(self) -> int:
        return sum(self.ssd_bytes.values())

    @property
    def host_total(self) -> int:
        return sum(self.host_bytes.values())


class CapacityError(ValueError):
    """The host cap and the store together cannot hold the model's state; `store_full`: the
    store is there but too small (else there is no store for what host memory cannot hold)."""

    def __init__(self, message: str, store_full: bool) -> None:
        super().__init__(message)
        self.store_full = store_full


def place(
    sizes: list[SlotSize],
    *,
    host_capacity_bytes: int,
    ssd_capacity_bytes: Optional[int],
    window_bytes: int,
) -> CapacityPlan:
    """The capacity plan (see the module docstring). `ssd_capacity_bytes` None: no store.

    Raises `CapacityError` naming what is missing when host memory and the store cannot hold
    everything."""
    assert window_bytes > 0, window_bytes
    tiers = [{kind: HOST for kind in KINDS} for _ in sizes]
    host = {kind: sum(s.of(kind) for s in sizes) for kind in KINDS}
    ssd = {kind: 0 for kind in KINDS}
    overflow = sum(host.values()) - host_capacity_bytes
    # Least traffic per byte leaves host memory first; within a kind, the last parameters first
    # (their step window comes first, so their reads start the step's pipeline from the SSD).
    for kind in reversed(KINDS):
        for index in reversed(range(len(sizes))):
            if overflow <= 0:
                break
            nbytes = sizes[index].of(kind)
            if nbytes == 0:
                continue
            tiers[index][kind] = SSD
            host[kind] -= nbytes
            ssd[kind] += nbytes
            overflow -= nbytes
    total_ssd = sum(ssd.values())
    if total_ssd and ssd_capacity_bytes is None:
        need = sum(host.values()) + total_ssd
        raise CapacityError(
            f"the model's parameters, gradients and optimizer state ({_gib(need)}) exceed host_memory "
            f"({_gib(host_capacity_bytes)}) by {_gib(total_ssd)}, and there is no store for the rest: "
            "pass store=teraio.Store.create(...) or raise host_memory",
            store_full=False,
        )
    if ssd_capacity_bytes is not None and total_ssd:
        # A rewritten object needs room for its new version before the old one is freed.
        largest = max(s.of(kind) for s, t in zip(sizes, tiers) for kind in KINDS if t[kind] == SSD)
        if total_ssd + largest > ssd_capacity_bytes:
            raise CapacityError(
                f"the store has {_gib(ssd_capacity_bytes)} free; the plan needs {_gib(total_ssd + largest)} "
                f"on it ({_gib(total_ssd)} of state that host_memory={_gib(host_capacity_bytes)} cannot "
                f"hold, plus {_gib(largest)} to rewrite the largest object): add devices, grow the "
                "store's files or raise host_memory",
                store_full=True,
            )
    windows: list[list[int]] = []
    totals: list[int] = []
    for index, size in enumerate(sizes):
        if windows and totals[-1] + size.total <= window_bytes:
            windows[-1].append(index)
            totals[-1] += size.total
        else:
            windows.append([index])
            totals.append(size.total)
    plan = CapacityPlan(tiers, windows, host, ssd, window_bytes)
    assert overflow <= 0 or not any(host.values()), "host memory over its cap"
    assert sorted(i for w in windows for i in w) == list(range(len(sizes)))
    return plan


#: Where the optimizer step runs (`choose_update_site`).
GPU_UPDATE = "gpu"
CPU_UPDATE = "cpu"


@dataclass(frozen=True)
class UpdateSite:
    """Where the step runs, why, and the model's per-iteration cost of each site (seconds;
    None where the site cannot run)."""

    site: str
    reason: str
    gpu_step_s: Optional[float] = None
    cpu_step_s: Optional[float] = None


def choose_update_site(
    sizes: list[SlotSize],
    plan: CapacityPlan,
    *,
    requested: str,
    host_link_bytes_per_s: float,
    cpu_update_bytes_per_s: Optional[float],
    cpu_refusal: Optional[str] = None,
    in_backward: bool = False,
) -> UpdateSite:
    """Where the optimizer step runs ("auto" `requested`: the cheaper by this model).

    Both sites move every gradient out once and read the parameters in for forward and
    recomputation. On top of that the GPU step moves, per iteration, each parameter in and out
    again, each gradient back in and the optimizer state both ways: (2 P + G + 2 S) bytes over
    the host link. The CPU step moves nothing more over the link; it reads and writes
    (P + G + S) bytes in host memory at `cpu_update_bytes_per_s` (measured). The CPU step needs
    all three kinds in host memory (`cpu_refusal`: why it cannot run otherwise, e.g. an
    optimizer without a CPU implementation). The model leaves out the CPU step's overlap with
    the next forward pass, and the compute copies (`compute_copy_room`), which only the CPU
    step has and which halve its parameter and gradient traffic: both favour the CPU step, so
    the model favours the GPU where the two are close.

    `in_backward` (`step_in_backward`): the GPU step updates each parameter where backward left
    it, so it moves no gradient and reads no parameter again: (P + 2 S) bytes; the CPU step
    still sends each gradient out, (G) bytes over the link, beside its host-memory work. The
    `sizes` count every trained parameter's gradient either way."""
    params = sum(s.parameter for s in sizes if s.gradient or s.state)
    grads = sum(s.gradient for s in sizes)
    state = sum(s.state for s in sizes)
    if in_backward:
        gpu_s = (params + 2 * state) / host_link_bytes_per_s
    else:
        gpu_s = (2 * params + grads + 2 * state) / host_link_bytes_per_s
    refusal = cpu_refusal
    if refusal is None and plan.ssd_total:
        refusal = (
            f"the plan puts {_gib(plan.ssd_total)} of the model's state on the store (host_memory "
            f"holds {_gib(plan.host_total)}); the CPU step needs it all in host memory"
        )
    cpu_s = None
    if refusal is None and cpu_update_bytes_per_s:
        cpu_s = (params + grads + state) / cpu_update_bytes_per_s
        if in_backward:
            cpu_s += grads / host_link_bytes_per_s
    if requested == GPU_UPDATE:
        return UpdateSite(GPU_UPDATE, "update='gpu'", gpu_s, cpu_s)
    if requested == CPU_UPDATE:
        if refusal is not None:
            raise ValueError(f"teraio.offload(update='cpu'): {refusal}; use update='gpu' (or 'auto') instead")
        return UpdateSite(CPU_UPDATE, "update='cpu'", gpu_s, cpu_s)
    assert requested == "auto", requested
    if refusal is not None:
        return UpdateSite(GPU_UPDATE, f"the CPU step cannot run: {refusal}", gpu_s, None)
    assert cpu_s is not None, "auto needs the CPU step's measured rate"
    if cpu_s < gpu_s:
        return UpdateSite(
            CPU_UPDATE,
            f"the CPU step ({cpu_s * 1e3:.0f} ms) is cheaper than streaming the step's bytes through "
            f"the GPU ({gpu_s * 1e3:.0f} ms)",
            gpu_s,
            cpu_s,
        )
    return UpdateSite(
        GPU_UPDATE,
        f"streaming the step through the GPU ({gpu_s * 1e3:.0f} ms) is cheaper than the CPU step "
        f"({cpu_s * 1e3:.0f} ms)",
        gpu_s,
        cpu_s,
    )


def compute_copy_room(plan: CapacityPlan, host_capacity_bytes: int, copy_bytes: int) -> Optional[str]:
    """Why host memory cannot hold `copy_bytes` of compute copies beside the plan (None: it can).
    The copies take only what the plan leaves of `host_capacity_bytes`: the plan's kinds keep
    their tiers (moving state to the store would stop the CPU step the copies serve)."""
    spare = host_capacity_bytes - plan.host_total
    if copy_bytes <= spare:
        return None
    return (
        f"host_memory ({_gib(host_capacity_bytes)}) holds the plan's {_gib(plan.host_total)} and has "
        f"{_gib(max(spare, 0))} left, less than the {_gib(copy_bytes)} the compute copies take: raise "
        "host_memory to stream them"
    )


#: Host memory bytes the compute copies' conversions touch per byte of fp32 copied parameter and
#: gradient (rounding: read 4, write 2 per element; widening: read 2, write 4), in the units of
#: the CPU step's measured rate (parameter + gradient + state bytes per second).
CONVERSION_TOUCH = 1.5


def choose_compute_copies(
    *,
    copied_bytes: int,
    copied_gradient_bytes: int,
    cpu_step_s: Optional[float],
    cpu_update_bytes_per_s: Optional[float],
    host_link_bytes_per_s: float,
    converted_in_step: bool = False,
) -> tuple[bool, str]:
    """Whether the compute copies pay ("auto"): they halve, for the copied parameters, the
    link's fp32 reads in forward and recomputation (2 x `copied_bytes`) and the gradients out
    (`copied_gradient_bytes`). Where the CPU step's kernel reads the bf16 gradients and writes
    the copies in its own pass (`converted_in_step`) they add nothing, so they go on. Otherwise
    their conversions are passes of their own (`CONVERSION_TOUCH` times those bytes at
    `cpu_update_bytes_per_s`); the iteration is taken as bound by the slower of the CPU step and
    that link traffic (the two overlap), so the copies go on where the link is the bound and
    halving it beats the longer CPU step (`cpu_step_s` and `cpu_update_bytes_per_s` are needed
    only then)."""
    link_s = (2 * copied_bytes + copied_gradient_bytes) / host_link_bytes_per_s
    if converted_in_step:
        return True, (
            f"they halve {link_s * 1e3:.0f} ms of link traffic, and the CPU step's kernel converts "
            "in its own pass (no pass of their own)"
        )
    assert cpu_step_s is not None and cpu_update_bytes_per_s is not None
    convert_s = CONVERSION_TOUCH * (copied_bytes + copied_gradient_bytes) / cpu_update_bytes_per_s
    with_copies = max(cpu_step_s + convert_s, link_s / 2)
    without = max(cpu_step_s, link_s)
    figures = (
        f"the CPU step {cpu_step_s * 1e3:.0f} ms, plus {convert_s * 1e3:.0f} ms of conversions with them; "
        f"the link {link_s * 1e3:.0f} ms of the bytes they halve"
    )
    bound = f"{with_copies * 1e3:.0f} ms with them, {without * 1e3:.0f} ms without"
    if with_copies < without:
        return True, f"they shorten the bound ({bound}): {figures}"
    return False, f"they would not shorten the bound ({bound}): {figures}; compute_copies='on' forces them"


#: `largest_batch` extrapolates from an iteration whose peak grew at least this share with the batch.
MIN_GROWN_SHARE = 0.5


@dataclass(frozen=True)
class BatchFit:
    """The largest micro-batch the GPU budget holds, estimated from one measured iteration at
    `batch` sequences (`largest_batch`); None where the iteration's peak did not grow above what
    it holds at any batch (`reason` says why)."""

    batch: int
    largest: Optional[int]
    per_sample_bytes: int
    fixed_bytes: int
    usable_bytes: int
    reason: str


def largest_batch(
    *, batch: int, peak_bytes: int, start_bytes: int, held_bytes: int, usable_bytes: int
) -> BatchFit:
    """The GPU peak modelled as fixed + batch x per-sample bytes, from one iteration at `batch`.

    Fixed: what the iteration held as its first forward pass began (`start_bytes`: resident and
    prefetched parameters, the step's state on the GPU), plus `held_bytes`, what the runtime holds
    above that at any batch (one unit's parameters and gradients, writes in flight). The rest of
    the peak grows with the batch: activations, their gradients and every temporary. The largest
    batch keeps the modelled peak within `usable_bytes` (the budget less the allocator's margin).
    It is an estimate, off by about a sequence either way where the split is: parameters kept
    resident to fill memory the batch left (in `start_bytes`) shrink at a larger batch, and the
    largest unit's parameters may be resident already or not all on the GPU at the peak.

    Where less than `MIN_GROWN_SHARE` of the peak grew, there is no estimate: at a batch that
    small the peak falls where parameters dominate (a tied embedding's backward), not where the
    activations do at a larger batch, so its growth per sequence understates theirs (on the
    Llama-3.2-3B shape under 16 GiB on the H100, batch 1 grew 0.47 GiB a sequence, batches 8
    and 12 0.91-0.98 GiB)."""
    assert batch > 0, batch
    grows = peak_bytes - start_bytes - held_bytes
    fixed = peak_bytes - max(grows, 0)
    if grows <= 0 or grows < MIN_GROWN_SHARE * peak_bytes:
        return BatchFit(
            batch,
            None,
            0,
            fixed,
            usable_bytes,
            f"of the iteration's peak ({_gib(peak_bytes)}) {_gib(max(grows, 0))} grew with the batch "
            f"beyond what any batch holds ({_gib(start_bytes)} at its start and {_gib(held_bytes)} of one "
            "unit's parameters, gradients and writes): too little to extrapolate, no estimate; "
            f"measure a larger batch than {batch}",
        )
    per_sample = grows // batch
    largest = max(0, (usable_bytes - fixed) * batch // grows)
    return BatchFit(
        batch,
        largest,
        per_sample,
        fixed,
        usable_bytes,
        f"an estimate from the iteration at batch {batch}: {_gib(fixed)} at any batch, "
        f"{_gib(per_sample)} per sequence, {_gib(usable_bytes)} usable (gpu_memory less the "
        "allocator's margin); every temporary counted as growing with the batch",
    )
