"""Block-granular activation offload: per repeated block (transformer layer) keep, host or recompute.

`teraio.offload` runs this plan (granularity "block", the default for models with repeated blocks,
`teraio.blocks.find_blocks`). It exists for the regime where kernels are short (bf16 autocast,
flash attention): there, per-tensor hooks and per-op profiling cost as much as the kernels they
manage, and the tool users compare with is activation checkpointing. So the plan has the grain
of checkpointing, and its inputs are measured without per-op instrumentation:

- iteration 0 (sizes): every block runs under `torch.utils.checkpoint`; when backward recomputes
  a block, the storages its recomputation leaves alive (what autograd saved; the block's inputs,
  its output and the parameters left out) are counted: the bytes the block would keep.
- iteration 1 (times): every block checkpointed again, timed with CUDA events: each block's
  forward (from its first forward pre-hook, before FSDP's, which waits for the block's
  all-gather), its whole recomputation and its backward (from the gradient hook on its output to
  the next one), the head and the step.
- iteration 2 (checkpointing as it runs): the same with recomputation stopping early, as
  `torch.utils.checkpoint` does by default (once backward has every tensor it needs, the rest of
  the block is not run again): each block's recomputation is its backward span less its backward.
  So the iteration with every block checkpointed, the baseline, is measured as it runs. Its head
  is timed again, and the lesser of the two is kept.
  In this iteration the first blocks after block 0 (`SELECTIVE_PROBES`) run selectively
  checkpointed instead (`teraio.selective`), where iteration 1's peak leaves room for what they
  keep: their backward spans, forwards and allocations give selective recomputation's time, the
  time it adds to the forward and the bytes the allocator holds for it, which the other blocks get
  in proportion to their own (blocks of one class run the same ops). What a selective block keeps
  is counted exactly in iteration 0: every output of the ops the policy keeps.
- the plan (`choose`): per block one of KEEP, HOST (its saved tensors are copied to pinned host
  memory as they are saved and prefetched back ahead of its backward, at most `window` bytes in
  flight each way), SELECTIVE (matrix products and attention kept, the rest recomputed) or
  RECOMPUTE (checkpointed); and which optimizer-state tensors leave the GPU between steps (host
  memory, then the store). Every layout "the first h blocks to the host, the next c recomputed,
  the next s selective, the rest kept" is predicted by `predict` (a replay of the two copy queues
  over the measured times) and bounded in memory from the measured peak; the fastest that fits
  wins.
- planned iterations: an A/B trial, measured rather than predicted (single iterations in this
  regime vary by 10%, and the first planned ones run slower than later ones, whatever their
  layout): the plan runs half of `TRIAL_STEPS` iterations, checkpointing every block (where that
  fits with all the optimizer state on the GPU) `TRIAL_STEPS`, and the plan the other half, so
  that a drift in the iterations' times weighs on both sides alike; the side with the faster
  median stays (ranks under FSDP2 run both sides at the same steps and keep the same side: the
  one whose slowest rank is faster). A peak that comes within half the reserve of the budget
  checkpoints one more kept block, and so does an iteration in which the allocator had to retry
  (release its cache and map anew). Both are counted in the report, which counts the iterations
  after the trial.
- under FSDP2 over several ranks, the ranks' iteration: the ranks exchange their predictions,
  cut at FSDP's collectives, once when they plan; the ranks' iteration is the measured one plus,
  per segment, the largest change any rank's plan makes to it (`_exchange_predictions`,
  `block_plan.across_ranks`).

While measuring, the optimizer state stays on the GPU where step 0's peak (every block
checkpointed) plus all of the state fits the budget, so that the measuring iterations run as
planned ones do; else it leaves the GPU between steps (as in the tensor plan), so that they need no
more memory than checkpointing with the state away. Its copies out are issued when the next forward
reaches the first block, not at the end of the step: copies in one direction run in the order they
were issued, whatever their stream, and issued at the step they would hold up the training
loop's `loss.item()` until all of them were done (gigabytes of state: a stall of the order of
100 ms).
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ... import ids, machine, selective, sharded
from ... import optimizer_state_dict as osd
from ...blocks import autocast_cache_off, find_blocks
from ...head import LossHead
from ...machine import Link
from ...options import OffloadOptions
from ...planning import format_bytes, parse_size
from ...timing import elapsed_ms as _ms
from ...timing import mark
from ..errors import NoPlanFitsError
from ..movers.copy import pinned_size
from ..movers.frozen import FrozenCopies, frozen_linear_parameters
from ..movers.saved import SavedStats, SavedTensorMover
from ..movers.tiers import HOST, SSD
from ..plans import block as block_plan
from ..plans.block import (
    KEEP,
    RECOMPUTE,
    RESERVE_MIN_SHARE,
    SELECTIVE,
    SELECTIVE_PROBES,
    STEP_WINDOWS_HELD,
    BlockCost,
    Measurement,
    Plan,
)
from ..report import Report, host_step_line, prediction_fields
from ..session import Budget, Session
from . import host_step
from .state import StateExecutor, host_then_store, movable_state


class _LiveOutputs(TorchDispatchMode):
    """Records (weakly) every tensor the ops inside it make, and the bytes a selective checkpoint
    of the same ops would keep (`selective.kept_bytes`)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[Any] = []
        self.selective_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.selective_bytes += selective.kept_bytes(func, out)
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.refs.append(weakref.ref(value))
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a block's inputs or output (tuples, lists, dicts, model outputs)."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


# -- the runtime -----------------------------------------------------------------------------------


@dataclass
class BlockReport(Report):
    """What a block-plan run did (`teraio.offload(...).report()` with granularity "block"): the
    `Report` fields, then the block plan's."""

    mode: str = field(init=False, default="block")
    planned_steps: int
    prediction_warning: str
    checkpoint_all_ms: Optional[float]
    #: How `checkpoint_all_ms` was measured: the A/B trial's median iteration, or (no trial) the
    #: sum of the spans the measuring iterations timed, not one whole iteration.
    checkpoint_all_source: str
    ideal_estimate_ms: Optional[float]
    predicted_peak_bytes: Optional[int]
    reserve_bytes: int
    actions: dict[str, str]
    #: Per iteration counted (`planned_steps`: those after the A/B trial where it ran, else all with
    #: a plan). Saved activations: {"offloaded"|"prefetched": {tier: bytes}}.
    bytes_per_iteration: dict[str, dict[str, int]]
    #: Saved bytes recomputed per planned iteration: all of a recomputed block's, and what a
    #: selective block does not keep.
    recomputed_bytes_per_iteration: int
    state_bytes_per_iteration: dict[str, dict[str, int]]
    stalls: dict[str, Any]
    # `host_ms_per_iteration` (Report): pack/unpack, the gradient hooks, before and after the
    # step: {"hooks": the median over the planned iterations}.
    #: Its mean, with the one-time work of installing and switching plans.
    host_ms_mean: float
    choice: dict[str, Any] = field(default_factory=dict)
    host_peak_bytes: int = 0
    #: How selective checkpointing was measured (`BlockOffload._take_selective`): the probe
    #: blocks, its recomputation and added forward as shares of a whole block's, what it keeps as
    #: a share of what the block saves, and the factor the allocator's count put on step 0's.
    selective: dict[str, Any] = field(default_factory=dict)
    #: How the loss ran (`teraio.head`).
    loss_head: str = ""
    #: Under FSDP2 with several ranks (`BlockOffload._ranks_prediction`): this rank's predicted
    #: iteration alone ("own_predicted_ms"), the ranks' ("group_predicted_ms", the prediction
    #: above), what this rank is predicted to wait for the others ("predicted_wait_ms", and per
    #: rank waited for: "waits_for"), each rank's own prediction, measured parts and predicted
    #: segments (`block_plan.segments`, for both sides of the A/B trial). Empty otherwise.
    ranks: dict[str, Any] = field(default_factory=dict)
    #: Frozen Linear weights held in autocast's dtype (`movers.frozen`): {"dtype", "parameters",
    #: "saved_bytes": device bytes less than in fp32}; empty where none were.
    frozen_copies: dict[str, Any] = field(default_factory=dict)
    #: FSDP2's host shards (`CPUOffloadPolicy`): who stepped them, how many elements, the
    #: kernel's median step (`runtime.modes.host_step`). Empty: no host shards.
    host_step: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        def ms(value: Optional[float]) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        counts = {
            a: sum(1 for v in self.actions.values() if v == a) for a in (KEEP, HOST, SELECTIVE, RECOMPUTE)
        }
        lines = [
            f"teraio offload (block plan): {self.steps} steps, {self.planned_steps} counted "
            "(with the plan as chosen)",
            f"  iteration: measured {ms(self.measured_iteration_ms)} (median of the steps with the "
            f"plan as chosen), predicted {ms(self.predicted_iteration_ms)}, "
            f"checkpointing every block {ms(self.checkpoint_all_ms)} "
            f"(measured: {self.checkpoint_all_source}), ideal {ms(self.ideal_estimate_ms)} "
            "(estimate: checkpointing every block less its measured recomputation)",
            f"  peak GPU memory: measured {_size(self.peak_gpu_bytes)}, "
            f"bound {_size(self.predicted_peak_bytes)}, "
            f"budget {_size(self.gpu_memory_bytes)} (reserve {_size(self.reserve_bytes)})",
            f"  blocks: {counts[KEEP]} kept, {counts[HOST]} to host memory, {counts[SELECTIVE]} "
            f"selectively recomputed, {counts[RECOMPUTE]} recomputed",
            "  per iteration: activations to host "
            f"{format_bytes(self.bytes_per_iteration['offloaded'][HOST])}, "
            f"recomputed {format_bytes(self.recomputed_bytes_per_iteration)}; optimizer state out "
            + ", ".join(
                f"{t} {format_bytes(b)}"
                for t, b in self.state_bytes_per_iteration.get("offloaded", {}).items()
            ),
            f"  host time in teraio per iteration: {self.host_ms_per_iteration.get('hooks', 0.0):.1f} ms "
            f"(median; mean {self.host_ms_mean:.1f} ms with installing and switching plans)",
            f"  stalls: {self.stalls}",
            f"  choice: {self.choice}",
            f"  selective checkpointing as measured: {self.selective or 'not measured'}",
            f"  loss head: {self.loss_head}",
            f"  machine: {self.machine}",
        ]
        if self.frozen_copies:
            lines.insert(
                -2,
                f"  frozen weights: {self.frozen_copies['parameters']} held in "
                f"{self.frozen_copies['dtype']} ({format_bytes(self.frozen_copies['saved_bytes'])} "
                "less device memory)",
            )
        if self.host_step:
            lines.insert(-2, "  " + host_step_line(self.host_step))
        if self.ranks:
            lines.insert(2, "  " + _ranks_line(self.ranks))
        if self.prediction_warning:
            lines.insert(2, "  WARNING: " + self.prediction_warning)
        return "\n".join(lines)


def _ranks_line(ranks: dict[str, Any]) -> str:
    """The report's line on the other ranks (`BlockReport.ranks`)."""
    head = (
        f"ranks: {ranks['ranks']}, tied by FSDP's collectives; predicted at step {ranks['planned_at_step']} "
        f"with every rank {'running its plan' if ranks['side'] == 'plan' else 'checkpointing every block'}: "
    )
    if ranks.get("group_predicted_ms") is None:
        return head + f"no prediction with the others (no plan on ranks {ranks.get('no_plan_on_ranks')})"
    waits = ranks["waits_for"]
    wait = (
        "waits "
        + ", ".join(f"{ms:.1f} ms for rank {r}" for r, ms in sorted(waits.items()))
        + " per iteration"
        if waits
        else "waits for no rank"
    )
    parts = "; ".join(
        f"rank {r} " + ", ".join(f"{k} {v:.1f}" for k, v in p.items())
        for r, p in enumerate(ranks["measured_parts_ms"])
    )
    return (
        head + f"this rank alone {ranks['own_predicted_ms']:.1f} ms, the ranks "
        f"{ranks['group_predicted_ms']:.1f} ms (per rank alone: "
        + ", ".join(f"{v:.1f}" for v in ranks["per_rank_predicted_ms"])
        + f"); this rank {wait}. Measured parts, ms: {parts}"
        + (
            f"; copies from host memory in backward counted as holding it up ({block_plan.SERIAL_COPIES_WHY})"
            if ranks.get("serial_copies")
            else ""
        )
    )


def _size(value: Optional[int]) -> str:
    return "-" if value is None else format_bytes(value)


def _local_bytes(tensor: torch.Tensor) -> int:
    """A tensor's storage bytes on this rank (a DTensor's local shard; 0 where moved out)."""
    return int(sharded.local_tensor(tensor).untyped_storage().nbytes())


def _windows(sizes: list[int], target: int) -> list[list[int]]:
    """Indices of `sizes` in order, grouped into windows of at most `target` bytes (one larger
    item alone): a windowed step's windows."""
    windows: list[list[int]] = []
    held = 0
    for index, nbytes in enumerate(sizes):
        if not windows or held + nbytes > target:
            windows.append([])
            held = 0
        windows[-1].append(index)
        held += nbytes
    return windows


@dataclass
class _Creation:
    """The first step stepped in windows (`BlockOffload._create_state_in_windows`): what it held
    besides the optimizer state (`base`: parameters, gradients), the parameter bytes stepped, the
    state created, the largest temporaries of a window and the most per parameter byte."""

    base: int
    stepped: int = 0
    created: int = 0
    temporaries: int = 0
    temporaries_per_byte: float = 0.0

    def add(self, param_bytes: int, state_bytes: int, temporaries: int) -> None:
        temporaries = max(0, temporaries)
        self.stepped += param_bytes
        self.created += state_bytes
        self.temporaries = max(self.temporaries, temporaries)
        if param_bytes:
            self.temporaries_per_byte = max(self.temporaries_per_byte, temporaries / param_bytes)

    def to_come(self, total_param_bytes: int) -> int:
        """The state still to be created (at the state per parameter byte so far) and one more
        window's temporaries."""
        left = total_param_bytes - self.stepped
        return self.created * left // max(1, self.stepped) + self.temporaries

    def step_peak(self, state_bytes: int) -> int:
        """The step with all `state_bytes` of state on the device and every parameter at once."""
        return self.base + state_bytes + self.step_temporaries()

    def step_temporaries(self) -> int:
        """The temporaries of a step over every parameter at once (the most per parameter byte
        a window had, times all of them)."""
        return int(self.temporaries_per_byte * self.stepped)


class BlockOffload(Session):
    """`teraio.offload` with the block plan (see the module docstring); same use:

    ```
    with teraio.offload(model, optimizer, store=store, gpu_memory="38GiB") as run:
        ...
    print(run.report())
    ```
    """

    #: Iterations before the plan: sizes; times with full recomputation (each block's own); times
    #: as checkpointing runs (recomputation stops early, once backward has what it needs).
    MEASURING_STEPS = 3
    #: Planned iterations each side of the A/B trial runs (`_check_plan`: the plan's in two
    #: halves, around checkpointing's); each side's median counts (the first iteration of a
    #: layout carries its one-time work: pinned buffers, switching). Even.
    TRIAL_STEPS = 4

    def __init__(self, model: Module, optimizer: Optimizer, options: OffloadOptions, budget: Budget) -> None:
        super().__init__(model, optimizer, options, budget)
        self.blocks = find_blocks(model)
        if not self.blocks:
            raise ValueError(
                "teraio.offload: granularity='block' needs repeated blocks (a ModuleList of one class)"
            )
        self.link = self._resolve_link()
        # FSDP2 over several ranks: their iterations are tied by FSDP's collectives, so the plan's
        # prediction is the ranks' (`_exchange_predictions`): every rank's, gathered when they plan.
        self._coupled = sharded.is_sharded(model) and sharded.rank_notes().get("world_size", 1) > 1
        self._ranks: Optional[list[dict[str, Any]]] = None
        self._ranks_at: Optional[int] = None
        #: The side of the A/B trial running now: "plan" or "checkpoint_all".
        self._side = "plan"
        self.reserve_auto = options.reserve in (None, "auto")
        self.reserve_bytes = self.gpu_memory_bytes // 10 if self.reserve_auto else parse_size(options.reserve)  # type: ignore[arg-type]
        n = len(self.blocks)
        self.actions = [RECOMPUTE] * n
        self.stats = SavedStats()
        parameters = {sharded.local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.mover = SavedTensorMover(
            self.device, self.host_memory_bytes, self.stats, options.min_bytes, parameters
        )
        streams = {
            "d2h_stream": getattr(self.mover, "d2h_stream", None),
            "h2d_stream": getattr(self.mover, "h2d_stream", None),
        }
        self.state = StateExecutor(
            self.device, store=self.store, object_id_base=ids.base("optimizer_state"), **streams
        )
        self.measured = Measurement(
            [BlockCost(name) for name, _ in self.blocks], serial_copies=self._coupled and self.cuda
        )
        # Frozen Linear weights in autocast's dtype (`movers.frozen`), decided as the first
        # iteration's first block starts (None: not this run).
        self.frozen: Optional[FrozenCopies] = None
        if options.frozen_compute_copies == "auto" and not sharded.is_sharded(model):
            found = frozen_linear_parameters(model, [module for _, module in self.blocks], self.device)
            self.frozen = FrozenCopies(self.device, found) if found else None
        self._frozen_decided = self.frozen is None
        self.loss_head = LossHead(model, options.loss_head == "chunked", options.fp32_outputs == "loss_only")
        self.plan: Optional[Plan] = None
        self.tried: list[dict[str, Any]] = []
        self.choice: dict[str, Any] = {}
        self.step = 0
        self.planned_from: Optional[int] = None
        self._originals: list[Callable[..., Any]] = []
        # The block whose forward began (`_enter_block`) and the mark at its start (measuring).
        self._entered: Optional[int] = None
        self._forward_start: Any = None
        self._marks: dict[str, Any] = {}
        self._block_marks: dict[str, list[tuple[int, Any, Any]]] = {"forward": [], "recompute": []}
        self._triggers: list[tuple[int, Any]] = []
        # The iteration's forward and backward passes (several with gradient accumulation):
        # each finished one's start mark, block marks, triggers and end mark; the present one's
        # start, and how many began in this iteration.
        self._passes: list[tuple[Any, dict[str, list[tuple[int, Any, Any]]], list[tuple[int, Any]], Any]] = []
        self._pass_start: Any = None
        self._pass_count = 0
        self._sizes: dict[int, int] = {}
        self._selective_sizes: dict[int, int] = {}
        # The blocks run selectively checkpointed in the third measuring iteration, and what
        # each block's forward left allocated there (CUDA).
        self._probes: list[int] = []
        self._forward_held: dict[int, int] = {}
        #: How selective checkpointing was measured (the report's `selective`).
        self.selective_measured: dict[str, Any] = {}
        self._iterations: list[dict[str, float]] = []
        self._pending_marks: list[dict[str, Any]] = []
        # The allocator's retries so far at the end of each iteration: each is a request that
        # found the cache full of blocks it could not use, so it freed them, synchronizing the
        # device (tens of ms where gigabytes are unmapped and mapped again).
        self._alloc_retries: list[int] = []
        # Cumulative host seconds in teraio at the end of each iteration.
        self._hook_s_at_end: list[float] = []
        self._started = 0.0
        self._prefetch_queue: list[int] = []
        self._pending_bytes: dict[int, int] = {}
        self._state_moves_set = False
        # The A/B trial (`_check_plan`): the plan tried, each side's iteration times, the steps
        # from which checkpointing every block and then the plan again run, and the step from
        # which the final choice runs.
        self._tried_plan: Optional[Plan] = None
        self._plan_times: list[float] = []
        self._baseline_times: list[float] = []
        self._trial_from: Optional[int] = None
        self._back_from: Optional[int] = None
        self.settled_from: Optional[int] = None
        self.replans = 0
        #: The first iteration that runs the present actions (`_allocator_retried`).
        self._layout_from = 0
        # A windowed step (`Plan.step_window_bytes`): the state slots of each window, the
        # parameters each window steps, and the gradients hidden from the optimizer meanwhile.
        self._step_windows: list[list[int]] = []
        self._window_params: list[set[int]] = []
        self._hidden_grads: dict[torch.Tensor, torch.Tensor] = {}
        # The first step stepped in windows (`_create_state_in_windows`): its accounting, the
        # window the caller's step steps with the bytes allocated before it, and the step with
        # all the state estimated from it (None: not estimated).
        self._creation = _Creation(0)
        self._creating_last: Optional[tuple[list[torch.Tensor], int]] = None
        self._step_peak_estimate: Optional[int] = None
        # Counters (block runtime, state executor) when the iterations counted from a step began:
        # {step: (stats, state stats)}, for the plan's first step and the trial's end.
        self._stats_at: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}

    def _resolve_link(self) -> Link:
        return machine.resolve_link(self.device, self.store, self.options, self.machine)

    # -- context -------------------------------------------------------------------------------

    def __enter__(self) -> BlockOffload:
        if self.options.if_no_fit == "raise":
            self._refuse_resident_overflow("; pass whole_model='on'")
        for index, (_, module) in enumerate(self.blocks):
            self._originals.append(module.forward)
            module.forward = self._wrapped(index, module.forward)  # type: ignore[method-assign]
            # First of the block's pre-hooks: before FSDP's, which waits for the all-gather.
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(index), prepend=True))
        self.loss_head.__enter__()
        self._install_step_hooks(self._before_step, self._after_step)
        self.host_step = host_step.install(self)
        self._install_peak()
        self._install_cache_off()
        # Checkpoints read, and loads keep, the real optimizer state (`teraio.optimizer_state_dict`).
        self._hooks.extend(osd.install(self, (self.state,)))
        self._begin_iteration()
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove_hooks()
        for _, module in self.blocks:
            if "forward" in module.__dict__:
                del module.__dict__["forward"]
        self._originals.clear()
        self.loss_head.__exit__()
        self.mover.close()
        self.state.close()
        if self.frozen is not None:
            self.frozen.restore()

    # -- blocks --------------------------------------------------------------------------------

    def _wrapped(self, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        module = self.blocks[index][1]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self._frozen_decided:
                self._decide_frozen()
            frozen = self.frozen
            if frozen is not None and frozen.active and not frozen.matches():
                with frozen.masters_in(module):
                    return original(*args, **kwargs)
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            if self._entered != index:  # called without its hooks (`block.forward(x)`)
                self._enter_block(index)
            self._entered = None
            start = self._forward_start
            action = self.actions[index]
            measuring = self.plan is None
            body = (
                self._measured_body(index, original, args, kwargs)
                if measuring and self.step < 2
                else original
            )
            timing = measuring and self.step >= 1
            held = measuring and self.step == 2 and self.cuda
            if held:
                allocated = torch.cuda.memory_allocated(self.device)
            if action == KEEP:
                out = body(*args, **kwargs)
            else:
                with autocast_cache_off():
                    if action == RECOMPUTE:
                        with set_checkpoint_early_stop(not measuring or self.step >= 2):
                            out = checkpoint(body, *args, use_reentrant=False, **kwargs)
                    elif action == SELECTIVE:
                        out = selective.run(body, *args, **kwargs)
                    else:
                        self.mover.begin_block(index)
                        with torch.autograd.graph.saved_tensors_hooks(self.mover.pack, self.mover.unpack):
                            out = body(*args, **kwargs)
            if timing:
                self._block_marks["forward"].append((index, start, mark(self.device)))
            if measuring and self.step == 1 and self.cuda and index == len(self.blocks) - 1:
                # Before the head's allocations, the largest of the iteration (the logits):
                # memory they cannot use (iteration 2 times the head).
                self._unreleasable = machine.unreleasable_bytes(self.device)
            if held:
                self._forward_held[index] = torch.cuda.memory_allocated(self.device) - allocated
            self._hook_output(index, out)
            return out

        return forward

    def _decide_frozen(self) -> None:
        """The first block's first forward with gradients: frozen Linear weights go to autocast's
        dtype where it runs with bf16 or fp16 (before anything is measured, so the plan sees the
        memory they leave)."""
        if not torch.is_grad_enabled():
            return
        self._frozen_decided = True
        assert self.frozen is not None
        kind = self.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        if dtype in (torch.bfloat16, torch.float16) and self.step == 0:
            # The saved-tensor mover never copies parameters: it must know their new storages
            # (and forget the old ones, whose memory the allocator hands out again).
            self.mover.skip.difference_update(self.frozen.storages())
            self.frozen.install(dtype)
            self.mover.skip.update(self.frozen.storages())
        else:
            self.frozen = None

    def _pre_forward(self, index: int) -> Callable[..., None]:
        def hook(module: Module, args: Any) -> None:
            if torch.is_grad_enabled():
                self._enter_block(index)

        return hook

    def _enter_block(self, index: int) -> None:
        """A block's forward begins: from its forward pre-hook, which runs before FSDP's (so a
        block's measured forward holds the wait for its all-gather, and for the ranks that
        all-gather waits on; marked inside the block's forward it fell between the blocks,
        where nothing counted it)."""
        self._entered = index
        if index == 0:
            started = time.perf_counter()
            if self._pass_count:
                self._next_pass()
            self._pass_count += 1
            self.state.issue_deferred_out()
            self.stats.hook_s += time.perf_counter() - started
        self._forward_start = mark(self.device) if self.plan is None and self.step >= 1 else None

    def _measured_body(
        self, index: int, original: Callable[..., Any], args: Any, kwargs: Any
    ) -> Callable[..., Any]:
        """The block's function in a measuring iteration: in backward's recomputation, step 0
        counts the bytes it leaves alive and step 1 times it."""
        step = self.step
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}

        def body(*a: Any, **k: Any) -> Any:
            if torch._C._current_autograd_node() is None:
                return original(*a, **k)
            if step == 0:
                live = _LiveOutputs()
                with live:
                    out = original(*a, **k)
                skip = inputs | self.mover.skip | {t.untyped_storage().data_ptr() for t in _tensors(out)}
                sizes: dict[int, int] = {}
                for ref in live.refs:
                    tensor = ref()
                    if tensor is not None and tensor.device == self.device:
                        storage = tensor.untyped_storage()
                        if storage.data_ptr() not in skip:
                            sizes[storage.data_ptr()] = storage.nbytes()
                self._sizes[index] = sum(sizes.values())
                self._selective_sizes[index] = live.selective_bytes
                return out
            start = mark(self.device)
            out = original(*a, **k)
            self._block_marks["recompute"].append((index, start, mark(self.device)))
            return out

        return body

    def _hook_output(self, index: int, out: Any) -> None:
        """A gradient hook on the block's output: backward has reached the block."""
        if self.plan is not None and not self._needs_triggers:
            return
        for tensor in _tensors(out):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, index=index: self._trigger(index))
                return

    @property
    def _needs_triggers(self) -> bool:
        plan = self.plan
        return plan is not None and (HOST in plan.actions or plan.state_restore_at is not None)

    def _trigger(self, index: int) -> None:
        if self.plan is None:
            if self.step >= 1:
                self._triggers.append((index, mark(self.device)))
            return
        started = time.perf_counter()
        position = len(self.blocks) - 1 - index
        if self._pass_count >= self.measured.passes:
            self.state.on_event(position)
        else:
            # Not the step's last pass: the state stays out through the next forward.
            self.state.poll()
        if index in self._pending_bytes:
            self._pending_bytes.pop(index)
        window = self.mover.window
        while self._prefetch_queue:
            nxt = self._prefetch_queue[0]
            pending = sum(self._pending_bytes.values())
            size = self.measured.blocks[nxt].saved_bytes
            if nxt != index and pending and pending + size > window:
                break
            self._prefetch_queue.pop(0)
            self._pending_bytes[nxt] = self.mover.prefetch(nxt)
            self.stats.prefetches_planned += 1
            if nxt == index:
                self._pending_bytes.pop(index)
        self.stats.hook_s += time.perf_counter() - started
        return None

    # -- iterations ----------------------------------------------------------------------------

    def _begin_iteration(self) -> None:
        self._peak.arm()
        self._started = time.perf_counter()
        self._marks = {"forward": mark(self.device)}
        self._triggers = []
        self._block_marks = {"forward": [], "recompute": []}
        self._passes = []
        self._pass_start = self._marks["forward"]
        self._pass_count = 0
        self._begin_pass()

    def _begin_pass(self) -> None:
        if self.plan is not None:
            self._prefetch_queue = [i for i in reversed(range(len(self.blocks))) if self.actions[i] == HOST]
            self._pending_bytes = {}

    def _end_pass(self, end: Any) -> None:
        """A forward and backward pass is done (`end`: a mark at its end): its marks are kept for
        the measuring iterations' times."""
        self._passes.append((self._pass_start, self._block_marks, self._triggers, end))
        self._pass_start = end
        self._block_marks = {"forward": [], "recompute": []}
        self._triggers = []

    def _next_pass(self) -> None:
        """Another forward pass before the step (gradient accumulation): the last pass's backward
        is done, so its host blocks' copies back are freed and the next backward prefetches
        anew. The plan restores the state in the backward of the step's last measured pass; a
        loop that runs more passes than measured meets a forward with the state back, and it
        leaves again (the bound has no room for the state through a forward)."""
        self._end_pass(mark(self.device))
        self.mover.end_iteration()
        if self.plan is not None and self.plan.state_restore_at is not None:
            self.state.out_again()
        self._begin_pass()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.cuda and self.plan is None:
            self._fb_peak = int(torch.cuda.max_memory_allocated(self.device))
            self._fb_split_peak = int(
                torch.cuda.memory_stats(self.device).get("inactive_split_bytes.all.peak", 0)
            )
            torch.cuda.reset_peak_memory_stats(self.device)
        self._marks["backward_end"] = mark(self.device)
        self._end_pass(self._marks["backward_end"])
        started = time.perf_counter()
        # Backward has used every copy back of a host block: freed now, not after the step, whose
        # peak (measured with no host blocks) does not count them.
        self.mover.end_iteration()
        if self.cuda and self.plan is None and self.step == 2:
            # Unreleasable memory again, once backward has allocated the gradients among what it
            # freed (iteration 2 times nothing from here on): the reserve covers the larger.
            self._unreleasable = max(
                getattr(self, "_unreleasable", 0), machine.unreleasable_bytes(self.device)
            )
        closure = any(a is not None for a in args[1:]) or kwargs.get("closure") is not None
        # With a closure the caller's step creates the state all at once, as without teraio.
        creating = self.plan is None and not closure and self._creates_state(optimizer)
        if self.plan is None and not creating:
            self._set_step_windows(self._measuring_window())
        if self._step_windows and closure:
            raise ValueError(
                "teraio.offload: optimizer.step(closure) is not supported where the step runs "
                "in windows (the optimizer state does not fit the budget all at once)"
            )
        if creating:
            self._create_state_in_windows(optimizer)
        elif self._step_windows:
            self._step_in_windows(optimizer)
        else:
            self.state.before_step()
        self.stats.hook_s += time.perf_counter() - started
        self._marks["step"] = mark(self.device)

    def _step_in_windows(self, optimizer: Any) -> None:
        """All windows but the last are stepped here, by the optimizer's own step without its
        hooks, each with only its parameters' gradients visible (an optimizer skips parameters
        without one, and updates each parameter from its own gradient and state alone); the
        caller's step then steps the last window and the parameters whose state stays."""
        self._hide_grads(optimizer)
        raw = self._raw_step()
        assert raw is not None

        def step(window: int) -> None:
            self._show_grads(self._window_params[window])
            raw(optimizer)

        self.state.step_in_windows(self._step_windows, step)
        self._show_grads(self._window_params[-1])

    def _hide_grads(self, optimizer: Any) -> None:
        """Takes every gradient aside (`_after_step` puts them back as the loop left them)."""
        self._hidden_grads = {
            p: p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        }

    def _show_grads(self, visible: set[int]) -> None:
        for param, grad in self._hidden_grads.items():
            param.grad = grad if id(param) in visible else None

    def _raw_step(self) -> Optional[Callable[[Any], Any]]:
        """The optimizer's step without its hooks (a windowed step calls it per window); None
        where it cannot be had (a windowed step is not offered)."""
        return getattr(type(self.optimizer).step, "__wrapped__", None)

    def _creates_state(self, optimizer: Any) -> bool:
        """Whether this step creates optimizer state (a parameter with a gradient and no state
        yet: the first step) and may do so window by window (the optimizer's step can be called
        without its hooks, and the plan may move state)."""
        if not self.options.offload_optimizer_state or self._raw_step() is None:
            return False
        # FSDP's host shards have their state made in host memory by the host step.
        return any(
            p.grad is not None and not optimizer.state.get(p) and id(p) not in self.host_ids
            for group in optimizer.param_groups
            for p in group["params"]
        )

    def _allocated(self) -> int:
        """Bytes allocated on the device (on a CPU "device": parameters, gradients and the state
        on it, as `_make_plan` models them)."""
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return 2 * sharded.parameter_bytes(self.model)[1] + self._resident_state_bytes()

    def _resident_state_bytes(self) -> int:
        """The optimizer state's bytes on the device now (moved-out tensors have empty storages)."""
        return sum(map(_local_bytes, movable_state(self.optimizer, self.device, 1, skip=self.host_ids)))

    def _all_state_bytes(self) -> int:
        """The optimizer state's bytes, on the device or moved out."""
        away = sum(slot.nbytes for slot in self.state.slots if not slot.resident)
        return self._resident_state_bytes() + away

    def _create_state_in_windows(self, optimizer: Any) -> None:
        """The first step, where the optimizer creates its state (AdamW: twice the parameters'
        bytes, all at once, before any plan: FSDP2 at half its peak ran out of memory there):
        stepped in windows of parameters (a sixteenth of their bytes; a larger one alone),
        each window's new state moved out right away where keeping it leaves no room for the
        state still to come (projected from the state per parameter byte so far) and the step's
        temporaries. It also estimates the step with all the state on the device
        (`_step_peak_estimate`, in `_finish_creation`). The caller's step steps the last window."""
        self._hide_grads(optimizer)
        raw = self._raw_step()
        assert raw is not None
        params = list(self._hidden_grads)
        sizes = [_local_bytes(p) for p in params]
        total = sum(sizes)
        windows = [[params[i] for i in w] for w in _windows(sizes, max(1, total // 16))] or [[]]
        limit = self.gpu_memory_bytes - self.reserve_bytes
        self._creation = _Creation(self._allocated() - self._resident_state_bytes())
        host_left = self.host_memory_bytes
        for members in windows[:-1]:
            self._show_grads({id(p) for p in members})
            before = self._allocated()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            raw(optimizer)
            mine = self._creation_window_done(members, before)
            if mine and self._allocated() + self._creation.to_come(total) > limit:
                moves = host_then_store(mine, host_left, self.store is not None)
                host_left -= sum(pinned_size(_local_bytes(m.tensor)) for m in moves if m.tier == HOST)
                self.state.take_out(moves)
        self._show_grads({id(p) for p in windows[-1]})
        self._creating_last = (windows[-1], self._allocated())
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _creation_window_done(self, members: list[torch.Tensor], before: int) -> list[torch.Tensor]:
        """After one window of the first step (`before`: allocated bytes as it began): its new
        state, counted with its temporaries (its peak beyond `before` and that state)."""
        after = self._allocated()
        peak = int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else after
        mine = movable_state(self.optimizer, self.device, self.options.min_bytes, members, self.host_ids)
        new = sum(map(_local_bytes, mine))
        self._creation.add(sum(map(_local_bytes, members)), new, peak - before - new)
        return mine

    def _finish_creation(self) -> None:
        """After the caller's step stepped the first step's last window: the step with all the
        state on the device, estimated as what it held besides the state, all of the state, and
        its temporaries scaled up from the windows' (`_step_peak_estimate`)."""
        assert self._creating_last is not None
        members, before = self._creating_last
        self._creating_last = None
        self._creation_window_done(members, before)
        self._step_peak_estimate = self._creation.step_peak(self._all_state_bytes())

    def _measuring_window(self) -> int:
        """The window of a measuring iteration's step: where the step with all the state would
        not fit (`_step_peak_estimate` from the first step), the plan's window over the state that
        moves; else 0 (the step takes all of its state back)."""
        estimate = self._step_peak_estimate
        if estimate is None or not self.state.slots:
            return 0
        if estimate <= self.gpu_memory_bytes - self.reserve_bytes:
            return 0
        return self._step_window([slot.tensor for slot in self.state.slots])[0]

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._marks["end"] = mark(self.device)
        started = time.perf_counter()
        if self._creating_last is not None:
            self._finish_creation()
        for param, grad in self._hidden_grads.items():  # as the loop left them
            param.grad = grad
        self._hidden_grads = {}
        if self.plan is None and self.step == 1:
            self._take_times()
            self._start_selective_probes()
        if self.plan is None and self.step == 2:
            self._take_early_stop_times()
        if self.plan is None and self.step == 0:
            for index, cost in enumerate(self.measured.blocks):
                cost.saved_bytes = self._sizes.get(index, 0)
                cost.selective_bytes = self._selective_sizes.get(index, 0)
        self._pending_marks.append(self._marks)
        checking = self.planned_from is not None and self.settled_from is None  # the trial's times
        waiting = time.perf_counter()
        self._collect(wait=self.plan is None or checking)
        started += time.perf_counter() - waiting  # a wait for the device, not teraio's work
        if self.cuda:
            self._peaks.append(self._peak_bytes())
            self._alloc_retries.append(self._allocator_retries())
        if self.plan is None and self.step + 1 == self.MEASURING_STEPS:
            self._make_plan()
        elif self.plan is not None:
            self._check_plan()
        if self.plan is None:
            self._state_all_out()
        # Out when the next forward reaches its first block (`issue_deferred_out`), after the
        # copy the training loop makes next (`loss.item()`).
        self.state.after_step(defer=True)
        self.stats.hook_s += time.perf_counter() - started
        self._hook_s_at_end.append(self.stats.hook_s)
        self._step_times_ms.append((time.perf_counter() - self._started) * 1e3)
        self.step += 1
        self._begin_iteration()

    def _collect(self, wait: bool) -> None:
        """Phase times of finished iterations (waits for the device only if `wait`)."""
        while self._pending_marks:
            marks = self._pending_marks[0]
            end = marks["end"]
            if not isinstance(end, float):
                if not wait and not end.query():
                    return
                end.synchronize()
            self._pending_marks.pop(0)
            self._iterations.append(
                {
                    "forward_backward": _ms(marks["forward"], marks["backward_end"]),
                    "step_wait": _ms(marks["backward_end"], marks["step"]),
                    "step": _ms(marks["step"], marks["end"]),
                }
            )

    def _start_selective_probes(self) -> None:
        """Before step 2: the probe blocks run selectively checkpointed, where step 1's peak
        leaves room for what they keep."""
        blocks = self.measured.blocks
        probes = [i for i in SELECTIVE_PROBES if i < len(blocks) - 1]
        if self.cuda:
            room = self.gpu_memory_bytes - self.reserve_bytes - getattr(self, "_fb_peak", 0)
            while probes and sum(blocks[i].selective_bytes for i in probes) > room:
                probes.pop()
        self._probes = probes
        for i in probes:
            self.actions[i] = SELECTIVE

    def _take_early_stop_times(self) -> None:
        """Step 2's backward spans (recomputation stopping early, as in planned iterations): each
        block's recomputation is its span less its backward as step 1 measured it; the probes'
        are selective (`_take_selective`)."""
        if self.cuda:
            self._marks["end"].synchronize()
        probes, self._probes = self._probes, []
        for i in probes:
            self.actions[i] = RECOMPUTE
        blocks = self.measured.blocks
        n = len(self.blocks)
        passes = self._passes
        if not passes or any(len(triggers) != n for _, _, triggers, _ in passes):
            return
        # Per pass, then the mean over the passes (gradient accumulation runs several).
        spans: list[list[float]] = [[] for _ in range(n)]
        heads = []
        for _, block_marks, triggers, _ in passes:
            trigger = {i: mark for i, mark in triggers}
            for i in range(1, n):
                spans[i].append(max(0.0, _ms(trigger[i], trigger[i - 1]) - blocks[i].backward_ms))
            forward_end = {i: b for i, _, b in block_marks["forward"]}
            if n - 1 in forward_end:
                heads.append(_ms(forward_end[n - 1], trigger[n - 1]))
        for i in range(1, n):
            blocks[i].recompute_ms = statistics.fmean(spans[i])
        if len(heads) == len(passes):
            # Iteration 1's head can run several times slower than planned iterations' (it
            # follows step 0, and the state that step left on the GPU leaves in its forward).
            # The head is the lesser of the two iterations'.
            self.measured.head_backward_ms = min(self.measured.head_backward_ms, statistics.fmean(heads))
        block_plan.steady_block_times(self.measured, probes)
        if probes:
            self._take_selective(probes)
        if self.cuda:
            held = sum(blocks[i].selective_bytes for i in probes)
            self.measured.peak_bytes = max(self.measured.peak_bytes, getattr(self, "_fb_peak", 0) - held)
            if self.reserve_auto:
                self._reserve_from_allocator()

    def _reserve_from_allocator(self) -> None:
        """The reserve from the allocator's fragmentation in this measuring iteration (its peak of
        split blocks it holds but cannot hand out whole; reserved minus allocated would count the
        cache the warm-up's state and step left, which a planned iteration reuses), the larger of
        iterations 1 and 2 (whose selective probes allocate as selective blocks do), or what the
        allocator could not release right before iteration 1's head or at iteration 2's end of
        backward, the larger (`machine.unreleasable_bytes`;
        with expandable segments it counts no split blocks, so a reserve without what the
        allocator cannot release falls short, and a planned iteration runs out of memory at the
        head's large allocation)."""
        split = getattr(self, "_fb_split_peak", 0)
        unreleasable = getattr(self, "_unreleasable", 0)
        slack = max(split, unreleasable)
        reserve = machine.reserve_from_allocator(self.gpu_memory_bytes, slack, 0, min_share=RESERVE_MIN_SHARE)
        if reserve > self.reserve_bytes or self.step == 1:
            self.reserve_bytes = reserve
            self.machine["reserve"] = (
                f"from the allocator: {format_bytes(split)} of split blocks at most, "
                f"{format_bytes(unreleasable)} it could not release (before the head, after backward)"
            )

    def _take_selective(self, probes: list[int]) -> None:
        """Selective checkpointing's costs from the probes of step 2, each against the median of
        the other blocks (one class: the same ops), as shares that every block gets:
        - recomputation: the probe's span, against the others' (the probe's own whole
          recomputation is taken as their median);
        - forward: the probe's against step 1's, less the others' drift between the two steps;
        - bytes (CUDA): what its forward left allocated beyond the others', where that exceeds
          the count of step 0 (`selective_bytes`)."""
        blocks = self.measured.blocks
        others = [i for i in range(1, len(blocks)) if i not in probes]
        whole = statistics.median(blocks[i].recompute_ms for i in others)
        spans = [blocks[i].recompute_ms for i in probes]
        for i in probes:
            blocks[i].recompute_ms = whole
        recompute_share = statistics.median(spans) / whole if whole > 0 else 1.0
        forward = self._mean_forward_ms()
        forward_share = 0.0
        if all(i in forward for i in range(len(blocks))) and all(blocks[i].forward_ms > 0 for i in others):
            drift = statistics.median(forward[i] / blocks[i].forward_ms for i in others)
            forward_share = max(
                0.0,
                statistics.median(
                    forward[i] / blocks[i].forward_ms - drift for i in probes if blocks[i].forward_ms > 0
                ),
            )
        bytes_scale = 1.0
        if self.cuda and all(i in self._forward_held for i in range(len(blocks))):
            base = statistics.median(self._forward_held[i] for i in others)
            held = [self._forward_held[i] - base for i in probes]
            counted = [blocks[i].selective_bytes for i in probes]
            if all(counted):
                bytes_scale = max(1.0, statistics.median(h / c for h, c in zip(held, counted)))
        for cost in blocks:
            cost.selective_recompute_ms = recompute_share * cost.recompute_ms
            cost.selective_forward_ms = forward_share * cost.forward_ms
            cost.selective_bytes = int(cost.selective_bytes * bytes_scale)
        self.selective_measured = {
            "probes": [self.blocks[i][0] for i in probes],
            "recompute_share": recompute_share,
            "forward_share": forward_share,
            "bytes_scale": bytes_scale,
            "kept_share": statistics.median(
                b.selective_bytes / b.saved_bytes for b in blocks if b.saved_bytes
            )
            if any(b.saved_bytes for b in blocks)
            else None,
        }

    def _mean_forward_ms(self) -> dict[int, float]:
        """Each block's forward in this iteration, the mean over its passes (ms)."""
        spans: dict[int, list[float]] = {}
        for _, block_marks, _, _ in self._passes:
            for i, a, b in block_marks["forward"]:
                spans.setdefault(i, []).append(_ms(a, b))
        return {i: statistics.fmean(values) for i, values in spans.items()}

    def _take_times(self) -> None:
        """Step 1's events into the measurement (per block, and the edges around them): one
        pass's, the mean over the iteration's passes (several with gradient accumulation)."""
        if self.cuda:
            self._marks["end"].synchronize()
        measured = self.measured
        marks = self._marks
        passes = self._passes
        measured.passes = max(1, len(passes))
        for i, value in self._mean_forward_ms().items():
            measured.blocks[i].forward_ms = value
        recompute: dict[int, list[float]] = {}
        for _, block_marks, _, _ in passes:
            for i, a, b in block_marks["recompute"]:
                recompute.setdefault(i, []).append(_ms(a, b))
        for i, values in recompute.items():
            measured.blocks[i].recompute_ms = statistics.fmean(values)
        n = len(self.blocks)
        prior = [b.backward_ms for b in measured.blocks]
        edges = [self._pass_edges(p, prior) for p in passes]
        if passes and all(e is not None for e in edges):
            known = [e for e in edges if e is not None]
            measured.pre_forward_ms = statistics.fmean(e[0] for e in known)
            measured.head_backward_ms = statistics.fmean(e[1] for e in known)
            measured.tail_backward_ms = statistics.fmean(e[2] for e in known)
            for i in range(n):
                measured.blocks[i].backward_ms = statistics.fmean(e[3][i] for e in known)
        else:
            total = _ms(marks["forward"], marks["backward_end"]) / measured.passes
            for cost in measured.blocks:
                cost.backward_ms = max(0.0, total / n - cost.forward_ms - cost.recompute_ms)
        measured.step_ms = _ms(marks["step"], marks["end"])
        if self.cuda:
            measured.peak_bytes = getattr(self, "_fb_peak", 0)
            # A step run in windows did not hold all the state: the first step's estimate.
            measured.step_peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            if self._step_windows:
                assert self._step_peak_estimate is not None
                measured.step_peak_bytes = self._step_peak_estimate
                measured.step_temporaries_bytes = self._creation.step_temporaries()
            if self.reserve_auto:
                self._reserve_from_allocator()

    def _pass_edges(
        self,
        one_pass: tuple[Any, dict[str, list[tuple[int, Any, Any]]], list[tuple[int, Any]], Any],
        prior: list[float],
    ) -> Optional[tuple[float, float, float, list[float]]]:
        """One pass's forward before the first block, head, tail and each block's backward (less
        its recomputation as measured), ms; None where a block's marks are missing. `prior`:
        the blocks' backward before this iteration (block 0's span holds the embedding's too: its
        share beyond the other blocks' is the tail)."""
        start, block_marks, triggers, end = one_pass
        blocks = self.measured.blocks
        n = len(self.blocks)
        forward = {i: (a, b) for i, a, b in block_marks["forward"]}
        if len(forward) != n or len(triggers) != n:
            return None
        trigger = {i: mark for i, mark in triggers}
        backward = []
        tail = 0.0
        for i in range(n):
            spent = _ms(trigger[i], trigger[i - 1] if i > 0 else end)
            if i == 0:
                mean = statistics.median(prior[1:]) if n > 1 else spent
                own = min(spent, mean)
                tail = spent - own
                spent = own
            backward.append(max(0.0, spent - blocks[i].recompute_ms))
        return _ms(start, forward[0][0]), _ms(forward[n - 1][1], trigger[n - 1]), tail, backward

    def _state_tensors(self) -> list[torch.Tensor]:
        """The movable optimizer-state tensors, largest first."""
        found = movable_state(self.optimizer, self.device, self.options.min_bytes, skip=self.host_ids)
        found.sort(key=lambda t: -t.untyped_storage().nbytes())
        return found

    def _state_all_out(self) -> None:
        """Before the plan: the optimizer state the measuring iterations cannot hold leaves the
        GPU between steps (host, then store), largest tensors first: on CUDA as much as step 0's
        forward and backward (every block checkpointed) plus all of the state exceed the budget
        by, or more where the step with all the state exceeds it by more (less its windows: the
        measuring steps then run in windows, `_measuring_window`); none where both fit (the
        measuring iterations then run as checkpointing runs, copying nothing; state the first
        step moved out comes back). On a CPU "device", with no allocator to measure, all of it.
        State in flight while measuring slows the measured iterations, which the plan is made
        from."""
        if self._state_moves_set or not self.options.offload_optimizer_state:
            return
        tensors = self._state_tensors_all()
        if not tensors:
            return
        self._state_moves_set = True
        count = len(tensors)
        fb_peak = getattr(self, "_fb_peak", None)
        if fb_peak is not None:
            sizes = [self._slot_bytes(t) for t in tensors]
            limit = self.gpu_memory_bytes - self.reserve_bytes
            over = fb_peak + sum(sizes) - limit
            estimate = self._step_peak_estimate
            if estimate is not None and estimate > limit:
                over = max(over, estimate - limit + self._step_window(tensors)[1])
            count = 0
            while over > 0 and count < len(tensors):
                over -= sizes[count]
                count += 1
            if count == 0 and not self.state.slots:
                return
        self._set_state_moves(tensors, self.host_memory_bytes, count, None)

    def _set_state_moves(
        self, tensors: list[torch.Tensor], host_left: int, count: int, restore_at: Optional[int]
    ) -> None:
        moving = tensors[:count]
        sizes = [self._slot_bytes(t) for t in moving]
        self.state.set_plan(host_then_store(moving, host_left, self.store is not None, restore_at, sizes))

    def _make_plan(self) -> None:
        measured = self.measured
        # Every state tensor is on the GPU at the step's end (its move out waits for the next
        # forward). Those that stayed on it while measuring are in the measured peaks.
        tensors = self._state_tensors_all() if self.options.offload_optimizer_state else []
        moved = {id(slot.tensor) for slot in self.state.slots}
        sizes = [self._slot_bytes(t) for t in tensors]
        measured.state_bytes = sum(sizes)
        if self.cuda:
            measured.peak_bytes -= sum(size for t, size in zip(tensors, sizes) if id(t) not in moved)
        sizes.sort(reverse=True)
        if not self.cuda:
            # No allocator to ask: parameters, gradients and the state that does not move stay;
            # the step holds all of the state.
            persistent = 2 * sharded.parameter_bytes(self.model)[1]
            all_state = self._all_state_bytes()
            measured.peak_bytes = persistent + all_state - measured.state_bytes
            measured.step_peak_bytes = persistent + all_state
        limit = self.gpu_memory_bytes - self.reserve_bytes
        plan, self.tried = block_plan.choose(
            measured,
            self.link,
            limit,
            sizes,
            self.host_memory_bytes,
            self.store is not None,
            *self._step_window(tensors),
        )
        if plan is None and self.options.if_no_fit != "raise":
            plan = Plan([RECOMPUTE] * len(self.blocks), state_host_bytes=measured.state_bytes)
            plan.predicted_ms, plan.predicted_peak_bytes = block_plan.predict(measured, plan, self.link)
        # Before a raise: the other ranks would wait on this rank's part for good.
        self._exchange_predictions(plan)
        if plan is None:
            remedy = (
                sharded.NO_FIT_REMEDY
                if sharded.is_sharded(self.model)
                else "raise gpu_memory, or pass whole_model='on' (parameters and gradients leave the GPU too)"
            )
            raise NoPlanFitsError(
                f"teraio.offload: no block plan fits gpu_memory={format_bytes(self.gpu_memory_bytes)} "
                f"(reserve {format_bytes(self.reserve_bytes)}): checkpointing every block with the "
                f"optimizer state away peaks at {format_bytes(measured.peak_bytes)} and the step at "
                f"{format_bytes(measured.step_peak_bytes)}; {remedy}"
            )
        self._install(plan)
        self.planned_from = self.step + 1
        self._stats_at[self.planned_from] = (self.stats.as_dict(), self.state.stats.as_dict())

    def _exchange_predictions(self, plan: Optional[Plan]) -> None:
        """Under FSDP2 over several ranks: every rank's predicted segments (`block_plan.segments`)
        for its plan and for checkpointing every block (the A/B trial's other side), with the
        parts it measured, gathered on every rank (`sharded.exchange`). Its one call is at the
        end of the last measuring step, which every rank reaches at the same step (they run the
        same loop, and the measuring steps do not depend on the budget); the A/B trial's two
        (`_agree`) follow at fixed steps after it, and memory replans issue none. A rank with no
        plan (it raises next) sends None."""
        if not self._coupled:
            return
        mine = {
            "plan": block_plan.segments(self.measured, plan, self.link) if plan is not None else None,
            "checkpoint_all": block_plan.segments(self.measured, self._checkpoint_all_plan(), self.link),
            "parts": self._measured_parts(),
        }
        self._ranks = sharded.exchange(mine)
        self._ranks_at = self.step

    def _measured_parts(self) -> dict[str, float]:
        """The measured iteration with every block checkpointed, by part (ms, one pass's blocks),
        for the report: where the ranks' measurements differ."""
        measured = self.measured
        return {
            "pre_forward": measured.pre_forward_ms,
            "forward": sum(b.forward_ms for b in measured.blocks),
            "head": measured.head_backward_ms,
            "backward": sum(b.backward_ms for b in measured.blocks),
            "recompute": sum(b.recompute_ms for b in measured.blocks),
            "tail": measured.tail_backward_ms,
            "step": measured.step_ms,
        }

    def _ranks_prediction(self) -> dict[str, Any]:
        """The ranks' predicted iteration for the side of the A/B trial this rank runs now, every
        rank taken on that side (`BlockReport.ranks`; empty without an exchange). The trial's sides
        run at the same steps on every rank, and the ranks settle on the same side (`_check_plan`)."""
        if self._ranks is None:
            return {}
        rank = sharded.rank_notes()["rank"]
        per = [r[self._side] for r in self._ranks]
        out: dict[str, Any] = {
            "ranks": len(per),
            "planned_at_step": self._ranks_at,
            "side": self._side,
            "measured_parts_ms": [r["parts"] for r in self._ranks],
            # Every rank's segments, for each side, as gathered.
            "segments_ms": {side: [r[side] for r in self._ranks] for side in ("plan", "checkpoint_all")},
            "serial_copies": self.measured.serial_copies,
        }
        missing = [r for r, p in enumerate(per) if p is None]
        if missing:
            return dict(out, no_plan_on_ranks=missing, group_predicted_ms=None)
        group, waits = block_plan.across_ranks(per, [r["checkpoint_all"] for r in self._ranks])
        alone = [sum(p) for p in per]
        return dict(
            out,
            own_predicted_ms=alone[rank],
            group_predicted_ms=group,
            predicted_wait_ms=sum(waits[rank].values()),
            waits_for=waits[rank],
            per_rank_predicted_ms=alone,
        )

    def _state_by_param(self, tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Each parameter with the ones of `tensors` (movable state) that are its state."""
        movable = {id(t): t for t in tensors}
        found = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})
                ids = [id(sharded.local_tensor(v)) for v in state.values() if isinstance(v, torch.Tensor)]
                found.append((param, [movable[i] for i in ids if i in movable]))
        return found

    def _step_window(self, tensors: list[torch.Tensor]) -> tuple[int, int]:
        """A windowed step over `tensors`: its window, a sixteenth of their bytes (a parameter
        with more state is a window of its own: its tensors are stepped together), and the most
        its `STEP_WINDOWS_HELD` largest windows hold; (0, 0) where the optimizer's step cannot be
        called without its hooks (a windowed step is not offered). Held counts each window
        whole, not a multiple of the largest: Llama's tied embedding has 2 GB of AdamW state,
        a sixth of all, and three windows of that did not fit FSDP2 at half its peak."""
        if self._raw_step() is None or not tensors:
            return 0, 0
        nbytes = [sum(map(self._slot_bytes, mine)) for _, mine in self._state_by_param(tensors)]
        window = max(1, sum(nbytes) // 16)
        largest = sorted((max(window, n) for n in nbytes), reverse=True)[:STEP_WINDOWS_HELD]
        return window, min(sum(nbytes), sum(largest))

    def _set_step_windows(self, window_bytes: int) -> None:
        """The windowed step's windows of about `window_bytes` (0: none) over the state slots the
        plan moves, in the optimizer's parameter order; parameters whose state stays are stepped
        with the last window."""
        self._step_windows, self._window_params = [], []
        if not window_bytes:
            return
        slot_of = {id(slot.tensor): index for index, slot in enumerate(self.state.slots)}
        moving: list[tuple[int, list[int]]] = []  # (parameter id, its slots)
        staying: set[int] = set()
        for param, mine in self._state_by_param([slot.tensor for slot in self.state.slots]):
            if mine:
                moving.append((id(param), [slot_of[id(t)] for t in mine]))
            else:
                staying.add(id(param))
        sizes = [sum(self.state.slots[i].nbytes for i in slots) for _, slots in moving]
        for window in _windows(sizes, window_bytes):
            self._step_windows.append([i for k in window for i in moving[k][1]])
            self._window_params.append({moving[k][0] for k in window})
        if self._window_params:
            self._window_params[-1] |= staying

    def _install(self, plan: Plan) -> None:
        self.plan = plan
        self._layout_from = self.step + 1
        self.mover.window = block_plan.window_bytes(self.measured, plan)
        self.actions = list(plan.actions)
        tensors = self._state_tensors_all()
        host_left = self.host_memory_bytes - sum(
            pinned_size(b.saved_bytes) for b, a in zip(self.measured.blocks, plan.actions) if a == HOST
        )
        count = 0
        moved = 0
        for tensor in tensors:
            if moved >= plan.state_out_bytes:
                break
            count += 1
            moved += self._slot_bytes(tensor)
        self._set_state_moves(tensors, host_left, count, plan.state_restore_at)
        moving = self.state.planned_bytes(HOST) + self.state.planned_bytes(SSD)
        # The plan's bound counts this state as gone from the GPU: it must leave.
        assert moving >= plan.state_out_bytes, (plan.state_out_bytes, moving)
        self._set_step_windows(plan.step_window_bytes)

    def _state_tensors_all(self) -> list[torch.Tensor]:
        """Every movable state tensor, largest first, whether it is on the GPU now or not: those
        the executor moves already (out, their storage is empty) and the rest. The measuring
        iterations may have moved only some; a plan that moves more must find the others (else
        it moves only what measuring moved, its bound counts the rest as gone, and it runs out of
        memory)."""
        known = [slot.tensor for slot in self.state.slots]
        ids = {id(t) for t in known}
        rest = [t for t in self._state_tensors() if id(t) not in ids]
        return sorted(known + rest, key=lambda t: -self._slot_bytes(t))

    def _slot_bytes(self, tensor: torch.Tensor) -> int:
        """A state tensor's bytes: its storage's, or, moved out (its storage empty), its slot's."""
        nbytes = int(tensor.untyped_storage().nbytes())
        if nbytes:
            return nbytes
        return next(slot.nbytes for slot in self.state.slots if slot.tensor is tensor)

    def _check_plan(self) -> None:
        """After a planned iteration: a peak within half the reserve of the budget checkpoints one
        more block (a kept one selectively where that was measured, else fully; else a selective
        one fully). Then the A/B trial: the plan's first `TRIAL_STEPS` / 2 iterations, as many
        again as `TRIAL_STEPS` with every block checkpointed (where that fits with all the state
        on the GPU), then the plan's other half; the side with the faster median stays (`choice`
        has both). Measured, because single iterations in this regime vary by 10% and the
        measuring iterations run under other conditions than planned ones; in two halves around
        the other side, because the first planned iterations run slower than later ones whatever
        their layout (2 x H200, FSDP2: every block checkpointed at 387-456 ms in the 4th to 6th
        planned iterations, 240-260 ms from the 7th), which would count against whichever side
        ran first.

        Ranks tied by FSDP's collectives (`_coupled`) run the trial in step: each side at the same
        steps on every rank (a memory replan does not restart the plan's side, as it does alone),
        every rank tries checkpointing every block or none does, and the ranks keep the side
        whose slowest rank's median is the faster (`_agree`). A rank alone decides on its own
        iterations; ranks deciding alone settled on different sides and ran at the slower one's
        speed."""
        assert self.plan is not None and self.planned_from is not None
        peak = self._peaks[-1] if self._peaks else 0
        near = peak > self.gpu_memory_bytes - self.reserve_bytes // 2
        if self.cuda and (near or self._allocator_retried()):
            self._checkpoint_one_more()
        if self.settled_from is not None:
            return
        n = self.TRIAL_STEPS
        half = n // 2
        # The plan's first half is its last layout's first iterations (a memory replan restarts
        # it), or, for coupled ranks, the first planned ones.
        plan_from = self.planned_from if self._coupled else self._layout_from
        if self._trial_from is None and self.step == plan_from + half - 1:
            plan = self.plan
            self._plan_times = self._recent_times(half)
            self.choice = {
                "kept": "plan",
                "plan": {
                    "keep": plan.count(KEEP),
                    "host": plan.count(HOST),
                    "selective": plan.count(SELECTIVE),
                    "recompute": plan.count(RECOMPUTE),
                    "state_out_bytes": plan.state_out_bytes,
                    "predicted_ms": plan.predicted_ms,
                    "trial_ms": statistics.median(self._plan_times),
                },
            }
            checkpointing = self._checkpoint_all_plan()
            fits = checkpointing.predicted_peak_bytes <= self.gpu_memory_bytes - self.reserve_bytes
            only_recompute = set(self.actions) == {RECOMPUTE}
            ranks = self._agree({"fits": fits, "only_recompute": only_recompute})
            if ranks is not None:
                # Every rank tries, or none: a rank whose plan already recomputes every block
                # runs the same layout on both sides.
                fits = all(r["fits"] for r in ranks)
                only_recompute = all(r["only_recompute"] for r in ranks)
            if only_recompute or not fits:
                self.settled_from = self.planned_from
                return
            self._tried_plan = plan
            self._install(checkpointing)
            self._side = "checkpoint_all"
            self._trial_from = self.step + 1
            self._stats_at[self._trial_from] = (self.stats.as_dict(), self.state.stats.as_dict())
            self.choice["kept"] = "undecided: the trial of checkpointing every block has not finished"
            return
        if self._back_from is None and self._trial_from is not None and self.step == self._trial_from + n - 1:
            self._baseline_times = self._recent_times(n)
            assert self._tried_plan is not None
            self._install(self._tried_plan)
            self._side = "plan"
            self._back_from = self.step + 1
            return
        if self._back_from is not None and self.step == self._back_from + (n - half) - 1:
            self._plan_times += self._recent_times(n - half)
            plan_ms = statistics.median(self._plan_times)
            baseline = statistics.median(self._baseline_times)
            self.choice["plan"]["trial_ms"] = plan_ms
            self.choice["checkpoint_all_ms"] = baseline
            ranks = self._agree({"plan_ms": plan_ms, "checkpoint_all_ms": baseline})
            if ranks is not None:
                # The ranks' iteration is their slowest rank's, on each side.
                plan_ms = max(r["plan_ms"] for r in ranks)
                baseline = max(r["checkpoint_all_ms"] for r in ranks)
                self.choice["ranks"] = {"plan_ms": plan_ms, "checkpoint_all_ms": baseline}
            if plan_ms < baseline:
                self.choice["kept"] = "plan"
            else:
                self._install(self._checkpoint_all_plan())
                self._side = "checkpoint_all"
                self.choice["kept"] = "checkpoint every block"
            self.settled_from = self.step + 1
            self._stats_at[self.settled_from] = (self.stats.as_dict(), self.state.stats.as_dict())

    def _agree(self, mine: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
        """Coupled ranks: every rank's `mine`, gathered (`sharded.exchange`) at a step every rank
        reaches with the same trial phase; None for a rank alone."""
        if not self._coupled:
            return None
        return sharded.exchange(mine)

    def _allocator_retried(self) -> bool:
        """Whether the allocator retried in this iteration, which did not follow a change of the
        blocks' actions (the first iteration of a layout allocates into what the last one left
        and may retry: checkpointing every block can retry in its first planned iterations,
        then never again, so a plan could lose a block to a transition).

        A retry is memory pressure the peak alone does not show: an allocation found no free
        range large enough, so the allocator synchronized every stream, released its cached
        blocks and mapped anew. A plan whose peak is gigabytes under the budget can still retry
        at every head (its logits are one large allocation that no free range fits), and then
        runs slower than checkpointing every block, which does not retry."""
        counts = self._alloc_retries
        if len(counts) < 2 or self.step < self._layout_from + 1:
            return False
        return counts[-1] > counts[-2]

    def _checkpoint_one_more(self) -> None:
        assert self.plan is not None
        if KEEP in self.actions:
            self.actions[self.actions.index(KEEP)] = SELECTIVE if self.measured.selective_ok else RECOMPUTE
        elif SELECTIVE in self.actions:
            self.actions[self.actions.index(SELECTIVE)] = RECOMPUTE
        else:
            return
        self.plan.actions = list(self.actions)
        self.replans += 1
        self._layout_from = self.step + 1

    def _checkpoint_all_plan(self) -> Plan:
        plan = Plan([RECOMPUTE] * len(self.blocks))
        plan.predicted_ms, plan.predicted_peak_bytes = block_plan.predict(self.measured, plan, self.link)
        return plan

    def _recent_times(self, count: int) -> list[float]:
        """The last `count` iterations' times (ms on the compute stream)."""
        return [sum(times.values()) for times in self._iterations[-count:]]

    # -- report --------------------------------------------------------------------------------

    def _counted(self) -> tuple[Optional[int], Optional[int]]:
        """The iterations the report counts, [start, end) (end None: to the last): those after the
        A/B trial where any ran since, else the plan's own (before the trial, where one ran)."""
        settled = self.settled_from
        if settled is not None and settled in self._stats_at and len(self._iterations) > settled:
            return settled, None
        return self.planned_from, self._trial_from

    def _retries_per_iteration(self) -> float:
        """The allocator's retries per counted iteration (see `_alloc_retries`)."""
        start, end = self._counted()
        if start is None or start < 1:
            return 0.0
        counts = self._alloc_retries[start - 1 : end]
        return (counts[-1] - counts[0]) / (len(counts) - 1) if len(counts) > 1 else 0.0

    def _host_ms(self) -> list[float]:
        """Host time in teraio in each counted iteration, ms."""
        start, end = self._counted()
        if start is None or start < 1:
            return []
        ends = self._hook_s_at_end[start - 1 : end]
        return [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]

    def report(self) -> BlockReport:
        self._collect(wait=True)
        host = self._host_ms()
        start, end = self._counted()
        planned = self._iterations[start:end] if start is not None else []
        count = len(planned)
        measured_ms = statistics.median(sum(p.values()) for p in planned) if planned else None
        plan = self.plan
        predicted = plan.predicted_ms if plan else None
        ranks = self._ranks_prediction()
        if ranks.get("group_predicted_ms") is not None:
            # The measured iteration is the ranks' (each waits for the slowest at each collective).
            predicted = ranks["group_predicted_ms"]
        stats, state_now = (
            self._stats_at[end] if end is not None else (self.stats.as_dict(), self.state.stats.as_dict())
        )
        before, state_before = self._stats_at.get(start, ({}, {})) if start is not None else ({}, {})

        def per(key: str) -> int:
            return int((stats[key] - before.get(key, 0)) / count) if count else 0

        recomputed = self.measured.passes * sum(
            max(0, b.saved_bytes - (b.selective_bytes if a == SELECTIVE else 0))
            for b, a in zip(self.measured.blocks, self.actions)
            if a in (RECOMPUTE, SELECTIVE)
        )

        def per_tier(now: dict[str, Any], earlier: dict[str, Any], kind: str) -> dict[str, int]:
            return {
                tier: int((now[kind][tier] - earlier.get(kind, {}).get(tier, 0)) / count) if count else 0
                for tier in (HOST, SSD)
            }

        state_per = {
            kind: per_tier(state_now, state_before, kind) for kind in ("offloaded_bytes", "prefetched_bytes")
        }
        trial_ms = self.choice.get("checkpoint_all_ms")
        ckpt_ms = trial_ms if trial_ms is not None else self.measured.checkpoint_all_ms
        if self.planned_from is None:
            ckpt_ms = None
        ideal = None
        if ckpt_ms is not None:
            ideal = ckpt_ms - self.measured.passes * sum(b.recompute_ms for b in self.measured.blocks)
        stalls = {
            "window_waits": per("window_waits"),
            "window_wait_ms": (stats["window_wait_s"] - before.get("window_wait_s", 0)) * 1e3 / count
            if count
            else 0.0,
            "prefetches_on_demand": per("prefetches_on_demand"),
            "state_step_wait_ms": (state_now["step_wait_s"] - state_before.get("step_wait_s", 0))
            * 1e3
            / count
            if count
            else 0.0,
            "memory_replans": self.replans,
            "allocator_retries": self._retries_per_iteration(),
        }
        return BlockReport(
            steps=self.step,
            planned_steps=count,
            **prediction_fields(measured_ms, predicted),
            checkpoint_all_ms=ckpt_ms,
            checkpoint_all_source=f"median of {self.TRIAL_STEPS} iterations in the trial"
            if trial_ms is not None
            else "the sum of each block's and the head's times in the measuring iterations",
            ideal_estimate_ms=ideal,
            peak_gpu_bytes=max(self._peaks[start:end])
            if start is not None and self._peaks[start:end]
            else None,
            predicted_peak_bytes=plan.predicted_peak_bytes if plan else None,
            gpu_memory_bytes=self.gpu_memory_bytes,
            reserve_bytes=self.reserve_bytes,
            actions={name: action for (name, _), action in zip(self.blocks, self.actions)},
            bytes_per_iteration={
                "offloaded": per_tier(stats, before, "offloaded_bytes"),
                "prefetched": per_tier(stats, before, "prefetched_bytes"),
            },
            recomputed_bytes_per_iteration=recomputed,
            state_bytes_per_iteration={
                "offloaded": state_per["offloaded_bytes"],
                "prefetched": state_per["prefetched_bytes"],
            },
            stalls=stalls,
            host_ms_per_iteration={"hooks": statistics.median(host) if host else 0.0},
            host_ms_mean=sum(host) / len(host) if host else 0.0,
            step_times_ms=list(self._step_times_ms),
            machine=self.machine,
            choice=dict(self.choice, tried=len(self.tried)),
            host_peak_bytes=self.mover.peak_bytes,
            selective=dict(self.selective_measured),
            loss_head=self.loss_head.describe(),
            ranks=ranks,
            frozen_copies=self.frozen.summary() if self.frozen is not None else {},
            host_step=self.host_step.report() if self.host_step is not None else {},
        )
