"""Whole-block recomputation (activation checkpointing) as one of the plan's choices.

A model's repeated blocks (the children of its largest `ModuleList` whose children share one
class: transformer layers) can each be run under `torch.utils.checkpoint` (non-reentrant): the
forward pass keeps only the block's positional tensor inputs (saved through the runtime's
`saved_tensors_hooks`, so they can be offloaded like any activation) and backward runs the block's
forward again when it first needs one of its saved tensors. Results are the same bits (same ops,
same inputs, RNG state restored).

`checkpoint_trace` tells the planner what that costs and saves, from the profiled iteration:
each tensor saved only inside a checkpointed block lives to its last forward use, then again
from the block's first backward op (as a temporary: checkpoint holds it, not the hooks); that op
is charged the block's forward time (calibrated op times); the block's inputs are saved at its
start and read there. The save/unpack events the runtime will see are rewritten the same way
(every save the block's forward makes disappears, with its unpacks: checkpoint's own hooks take
them, weights and the block's input included; the inputs are saved at its start and unpacked where
backward first unpacks one of those saves), so that event `i` of the plan is event `i` at run time.
An unpack is matched to its save by the save's index (the profiler's events name it), not by
tensor: a storage saved inside a block and outside it too is two saves.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.checkpoint import checkpoint

from .profiler import SaveEvent
from .recompute import remade_entry


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks: the children of the `ModuleList` (two or more children of one class)
    holding the most parameters; empty if there is none."""
    best: list[tuple[str, torch.nn.Module]] = []
    best_params = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        children = list(module.named_children())
        if len({type(child) for _, child in children}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best_params = params
            prefix = f"{name}." if name else ""
            best = [(prefix + child_name, child) for child_name, child in children]
    return best


class Checkpointer:
    """Runs chosen blocks under `torch.utils.checkpoint(use_reentrant=False)` by replacing their
    `forward` on the instance (removed again by `apply(set())`)."""

    def __init__(self, blocks: list[tuple[str, torch.nn.Module]]) -> None:
        self.blocks = blocks
        self._originals: dict[str, Callable[..., Any]] = {}

    @property
    def active(self) -> set[str]:
        return set(self._originals)

    def apply(self, names: set[str]) -> None:
        for name, module in self.blocks:
            if name in names and name not in self._originals:
                original = module.forward
                self._originals[name] = original
                module.forward = _checkpointed(original)  # type: ignore[method-assign]
            elif name not in names and name in self._originals:
                del self._originals[name]
                if "forward" in module.__dict__:
                    del module.__dict__["forward"]


def _checkpointed(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        with autocast_cache_off():
            return checkpoint(original, *args, use_reentrant=False, **kwargs)

    return forward


@contextlib.contextmanager
def autocast_cache_off() -> Iterator[None]:
    """Autocast without its cache of low-precision weight copies, for a block that does not keep
    what it saves.

    The cache holds each block's bf16 copy of its fp32 weights to the end of the user's autocast
    region, the loss included. A kept block saves those copies for its backward anyway; a
    recomputed block casts again when it recomputes, so its cached copies are dead weight through
    the forward (gigabytes for a 1.5B model with most blocks recomputed), and a block on the host
    would copy out what the cache still holds on the GPU. (Where the iteration peaks in the head's
    backward, after the region has ended, the peak does not change.) Each weight is cast once
    per block either way, so nothing else changes (`torch.utils.checkpoint` recomputes with the
    cache setting of the forward). The flag is autocast's own, global to every device type, as
    `torch.autocast(cache_enabled=False)` sets it."""
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


@dataclass(frozen=True)
class CheckpointSaves:
    """What `torch.utils.checkpoint(use_reentrant=False)` itself saves through the caller's
    saved-tensor hooks for one block, on this torch: the block's tensor inputs (`saves_inputs`)
    and other saves before and after them (torch 2.11 saves an empty dummy tensor ahead of the
    inputs; 2.15 does not), and the unpacks of those where backward recomputes the block."""

    saves_inputs: bool = True
    packs_before: int = 0
    packs_after: int = 0
    unpacks_before: int = 0
    unpacks_after: int = 0


@functools.cache
def checkpoint_saves() -> CheckpointSaves:
    """Measured once, by checkpointing a function of one small CPU tensor under counting hooks
    (a plan whose events assumed another torch's pattern would number every later save wrong:
    torch 2.11 saves a dummy ahead of each block's inputs, 2.15 does not)."""
    packs: list[bool] = []
    unpacks: list[bool] = []
    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        leaf = torch.ones(2, requires_grad=True)
        block_input = leaf * 2
        key = block_input.untyped_storage().data_ptr()

        def pack(tensor: torch.Tensor) -> tuple[bool, torch.Tensor]:
            is_input = tensor.untyped_storage().data_ptr() == key and tensor.untyped_storage().nbytes() > 0
            packs.append(is_input)
            return is_input, tensor

        def unpack(saved: tuple[bool, torch.Tensor]) -> torch.Tensor:
            unpacks.append(saved[0])
            return saved[1]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = checkpoint(torch.sin, block_input, use_reentrant=False)
        out.sum().backward()

    def around(flags: list[bool]) -> tuple[int, int]:
        if True not in flags:
            return len(flags), 0
        return flags.index(True), flags[::-1].index(True)

    packs_before, packs_after = around(packs)
    unpacks_before, unpacks_after = around(unpacks)
    return CheckpointSaves(True in packs, packs_before, packs_after, unpacks_before, unpacks_after)


@dataclass
class BlockRecord:
    """One block's forward pass in the profiled iteration: its ops `[op_start, op_end)`, its
    save/unpack events `[event_start, event_end)`, its positional tensor inputs (trace ids;
    None where one is not tracked) and how often it ran (only blocks run once are candidates)."""

    name: str
    op_start: int = -1
    op_end: int = -1
    event_start: int = -1
    event_end: int = -1
    inputs: list[Optional[int]] = field(default_factory=list)
    calls: int = 0

    @property
    def usable(self) -> bool:
        return self.calls == 1 and self.op_end > self.op_start and None not in self.inputs


@dataclass
class CheckpointedTrace:
    """A trace and its events with `blocks` checkpointed; `cost_us`: the recomputation charged."""

    trace: dict[str, Any]
    events: list[SaveEvent]
    blocks: list[str]
    cost_us: float
    freed_bytes: int


def checkpoint_trace(
    trace: dict[str, Any],
    events: list[SaveEvent],
    records: list[BlockRecord],
    chosen: list[str],
    durations_us: list[float],
    held: frozenset[int] = frozenset(),
    saves: Optional[CheckpointSaves] = None,
) -> CheckpointedTrace:
    """The trace and events the planner should see with the `chosen` blocks checkpointed (see the
    module docstring). A chosen block that cannot be applied (not usable, or backward never
    unpacks one of its saves) is left out of the result's `blocks`. `held`: tensors something
    outside the iteration holds (the caller's batch): saved by checkpoint, yet moving them frees
    nothing, so they stay temporaries. `saves`: what checkpoint itself saves through the
    runtime's hooks (default: measured on this torch, `checkpoint_saves`)."""
    saves = saves if saves is not None else checkpoint_saves()
    by_name = {r.name: r for r in records}
    candidates = [by_name[n] for n in chosen if n in by_name and by_name[n].usable]
    inside: dict[int, str] = {}
    for record in candidates:
        for index in range(record.event_start, record.event_end):
            inside[index] = record.name
    packed_outside = {
        e.tensor_id
        for i, e in enumerate(events)
        if e.kind == "pack" and i not in inside and e.tensor_id is not None
    }
    activations = {t["id"] for t in trace["tensors"] if t["kind"] == "activation"}
    internal: dict[str, set[int]] = {}
    for record in candidates:
        saved = {
            events[i].tensor_id
            for i in range(record.event_start, record.event_end)
            if events[i].kind == "pack" and events[i].tensor_id is not None
        }
        internal[record.name] = {
            t for t in saved if t in activations and t not in packed_outside and t not in record.inputs
        }
    owner = {t: name for name, ids in internal.items() for t in ids}
    pack_event = {e.pack_index: i for i, e in enumerate(events) if e.kind == "pack"}

    def saved_in(index: int, event: SaveEvent) -> Optional[str]:
        """The candidate block whose forward made the save an event packs or unpacks. Every save
        there goes to checkpoint's own hooks, the block input's and a weight's too, so none of
        their unpacks reaches the runtime (unpacks that do not name their save: by tensor)."""
        if event.kind == "pack":
            return inside.get(index)
        if event.pack_index >= 0:
            return inside.get(pack_event.get(event.pack_index, -1))
        return owner.get(event.tensor_id) if event.tensor_id is not None else None

    # Where backward reaches each block: its first unpack of a save made inside (checkpoint
    # recomputes the block there, unpacking its inputs first).
    first_unpack: dict[str, int] = {}
    for index, event in enumerate(events):
        if event.kind == "unpack":
            name = saved_in(index, event)
            if name is not None and internal.get(name):
                first_unpack.setdefault(name, index)
    applied = [r for r in candidates if r.name in first_unpack]
    applied_names = {r.name for r in applied}
    starts = {r.event_start: r for r in applied}
    reached = {first_unpack[r.name]: r for r in applied}
    new_events: list[SaveEvent] = []
    input_packs: dict[str, list[int]] = {}
    renumbered: dict[int, int] = {}  # profiled pack index -> the planned one
    pack_count = 0
    for index, event in enumerate(events):
        record = starts.get(index)
        if record is not None:
            inputs = record.inputs if saves.saves_inputs else []
            block_saves = [None] * saves.packs_before + list(inputs) + [None] * saves.packs_after
            input_packs[record.name] = [pack_count + saves.packs_before + i for i in range(len(inputs))]
            for tensor_id in block_saves:
                new_events.append(SaveEvent("pack", record.op_start, tensor_id, pack_count))
                pack_count += 1
        record = reached.get(index)
        if record is not None:
            inputs = record.inputs if saves.saves_inputs else []
            unpacks = [(None, -1)] * saves.unpacks_before
            unpacks += list(zip(inputs, input_packs.get(record.name, [])))
            unpacks += [(None, -1)] * saves.unpacks_after
            for tensor_id, pack_index in unpacks:
                new_events.append(SaveEvent("unpack", event.next_op, tensor_id, pack_index))
        if saved_in(index, event) in applied_names:
            continue
        if event.kind == "pack":
            renumbered[event.pack_index] = pack_count
            new_events.append(SaveEvent("pack", event.next_op, event.tensor_id, pack_count))
            pack_count += 1
        else:
            pack_index = renumbered.get(event.pack_index, -1)
            new_events.append(SaveEvent("unpack", event.next_op, event.tensor_id, pack_index))
    trace = copy.deepcopy(trace)
    ops = trace["ops"]
    by_id = {t["id"]: t for t in trace["tensors"]}
    next_id = max(by_id, default=-1) + 1
    cost_us = 0.0
    freed = 0
    for record in applied:
        at = events[first_unpack[record.name]].next_op
        if at >= len(ops):
            continue
        largest = 0
        for tensor_id in sorted(internal[record.name]):
            entry = by_id.get(tensor_id)
            if entry is None:
                continue
            before = [u for u in entry["uses"] if u["op"] < at]
            later = [u for u in entry["uses"] if u["op"] > at]
            if not before:
                continue
            entry["uses"] = before
            entry["free_op"] = before[-1]["op"]
            entry["kind"] = "temporary"  # the hooks never see it: nothing to move
            largest = max(largest, entry["size_bytes"])
            freed += entry["size_bytes"]
            trace["tensors"].append(remade_entry(entry, next_id, at, later, "block recomputed"))
            next_id += 1
        if largest:
            # The recomputed forward's own temporaries, about one more saved tensor's worth.
            trace["tensors"].append(
                {
                    "id": next_id,
                    "name": f"{record.name} (block recompute scratch)",
                    "size_bytes": largest,
                    "kind": "temporary",
                    "alloc_op": at,
                    "free_op": at,
                    "uses": [{"op": at, "access": "write"}],
                }
            )
            next_id += 1
        for tensor_id in record.inputs:
            entry = by_id.get(tensor_id) if tensor_id is not None else None
            if entry is None:
                continue
            if entry["kind"] == "temporary" and tensor_id not in held:
                entry["kind"] = "activation"  # saved by checkpoint through the hooks
            uses = {u["op"]: u["access"] for u in entry["uses"]}
            uses.setdefault(at, "read")
            entry["uses"] = [{"op": o, "access": uses[o]} for o in sorted(uses)]
            if entry["free_op"] is not None and at > entry["free_op"]:
                entry["free_op"] = at
        block_us = sum(durations_us[record.op_start : record.op_end])
        ops[at]["duration_us"] = ops[at]["duration_us"] + block_us
        cost_us += block_us
    return CheckpointedTrace(trace, new_events, [r.name for r in applied], cost_us, freed)


def candidate_counts(blocks: int, mode: str) -> list[int]:
    """How many blocks (the first ones in forward order) each candidate plan checkpoints."""
    if blocks == 0 or mode == "off":
        return [0]
    if mode == "all":
        return [blocks]
    return sorted({round(blocks * share) for share in (0.0, 0.25, 0.5, 0.75, 1.0)})
