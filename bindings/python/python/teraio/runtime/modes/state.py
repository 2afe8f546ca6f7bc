"""Executes a plan for persistent tensors: optimizer state between steps, parameters between passes.

Optimizer state (AdamW's `exp_avg` and `exp_avg_sq`: twice the parameters' bytes) is used only
inside `optimizer.step()`, so between two steps it is dead weight on the GPU, exactly when the
forward pass peaks. For each state tensor the plan moves, the executor

- after the step (`offload`; with `after_step(defer=True)`, at the next event or
  `issue_deferred_out` instead, so that the copies do not hold up the copy the training loop makes
  right after the step: copies in one direction run in issue order): copies the bytes to their
  tier (pinned host memory, or the SSD tier through the engine) on its own CUDA stream, then
  releases the GPU memory by shrinking the tensor's storage to zero bytes
  (`untyped_storage().resize_(0)`: the tensor object and every view of it stay valid, which is
  what the optimizer holds);
- at the event the plan maps the prefetch to (a `saved_tensors_hooks` event in the backward pass
  of the next iteration), grows the storage back and copies the bytes up (host tier: a host-to-
  device copy on its own stream; SSD tier: the engine reads into a pinned buffer, copied up as
  soon as it is in: `movers.tiers.StagedSsdTier`);
- before the next step (`before_step`), issues whatever was not issued yet (counted as on demand)
  and makes the compute stream wait for every restore, so the step always sees its exact bytes.

Only the period that wraps from one step to the next is moved (the trace pins optimizer state
inside the step: `pin_within_iteration`).

Parameters (`Move.release_event` set) use the same slots within an iteration: out at the event
after their last forward use, back at the planned event, and compute waits for them at the event
before their first backward use (`pin_outside_forward_gap` leaves the planner only that period).

On a CPU "device" the same logic runs with synchronous copies, for tests and CPU-only stacks.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ... import ids
from ...sharded import local_tensor
from ...store import Store
from ..movers.copy import copy_now, copy_on_stream, flat_bytes, pinned_buffer, pinned_size
from ..movers.tiers import HOST, SSD, StagedSsdTier, TierCounters
from ..plans.tensor import Move


@dataclass
class StateStats(TierCounters):
    """What the state executor moved, and how long the step waited for it."""

    step_wait_s: float = 0.0
    #: Times `bring_back` found state off the device (`optimizer.state_dict()` / `load_state_dict()`).
    brought_back: int = 0


def movable_state(
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    min_bytes: int,
    params: Optional[list[torch.Tensor]] = None,
    skip: frozenset[int] = frozenset(),
) -> list[torch.Tensor]:
    """The optimizer-state tensors a plan may move, in the optimizer's order: on `device` (a
    DTensor's local shard), of at least `min_bytes`, one per storage; of `params` only if given;
    none of the parameters whose ids are in `skip` (FSDP's host shards, whose step reads their
    state in host memory: `host_step`)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    pairs = optimizer.state.items() if params is None else [(p, optimizer.state.get(p, {})) for p in params]
    states = [state for param, state in pairs if id(param) not in skip]
    for state in states:
        for value in map(local_tensor, state.values()):
            if not isinstance(value, torch.Tensor) or value.device != device:
                continue
            storage = value.untyped_storage()
            if storage.nbytes() < min_bytes or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            found.append(value)
    return found


def host_then_store(
    tensors: list[torch.Tensor],
    host_bytes: int,
    has_store: bool,
    restore_event: Optional[int] = None,
    sizes: Optional[list[int]] = None,
) -> list[Move]:
    """Moves between steps for `tensors`, in order: to pinned host memory while `host_bytes` holds
    them, then to the store where there is one; the rest stay on the device. `sizes`: their bytes
    (default: their storages'; one moved out already has an empty storage)."""
    moves = []
    if sizes is None:
        sizes = [int(t.untyped_storage().nbytes()) for t in tensors]
    for tensor, nbytes in zip(tensors, sizes):
        size = pinned_size(nbytes)
        if size <= host_bytes:
            host_bytes -= size
            moves.append(Move(tensor, HOST, restore_event))
        elif has_store:
            moves.append(Move(tensor, SSD, restore_event))
    return moves


class _StateSlot:
    """One optimizer-state tensor the plan moves."""

    __slots__ = (
        "tensor",
        "tier",
        "nbytes",
        "object_id",
        "host",
        "resident",
        "issued",
        "d2h_event",
        "restore",
    )

    def __init__(self, tensor: torch.Tensor, tier: str, object_id: int) -> None:
        self.tensor = tensor
        self.tier = tier
        self.nbytes = int(tensor.untyped_storage().nbytes())
        self.object_id = object_id
        # Pinned copy (host tier; SSD tier: from the copy out until the SSD tier has it, and
        # while a read from the SSD tier is in it).
        self.host: Optional[torch.Tensor] = None
        self.resident = True  # the GPU storage holds the bytes (or a queued copy will)
        self.issued = False  # its restore has been issued since it was last moved out
        self.d2h_event: Any = None
        self.restore: Any = None  # CUDA event of the host-to-device copy in flight


class StateExecutor:
    """Moves optimizer-state tensors between steps per a plan (see the module docstring)."""

    def __init__(
        self,
        device: torch.device,
        *,
        store: Optional[Store] = None,
        object_id_base: int = ids.base("optimizer_state"),  # SSD-tier objects: one id per slot made
        d2h_stream: Any = None,
        h2d_stream: Any = None,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.store = store
        self.ssd = StagedSsdTier(store) if store is not None else None
        self.object_id_base = object_id_base
        self._next_object_id = object_id_base
        self.stats = StateStats()
        self.slots: list[_StateSlot] = []
        self.prefetch_at_event: dict[int, list[int]] = {}
        self.release_at_event: dict[int, list[int]] = {}
        self.wait_at_event: dict[int, list[int]] = {}
        # Events with anything in the three tables (most events have nothing: one test each).
        self._action_events: set[int] = set()
        self._between_steps: list[int] = []
        # Set by `bring_back` where it restored state between steps: out again at the next event.
        self._out_at_next_event = False
        if self.cuda:
            self.d2h_stream = d2h_stream if d2h_stream is not None else torch.cuda.Stream(device)
            self.h2d_stream = h2d_stream if h2d_stream is not None else torch.cuda.Stream(device)

    def set_plan(self, moves: list[Move]) -> None:
        """Installs the moves (see `Move`). A tensor the previous plan moved to the same tier keeps
        its slot as it is (out stays out: a plan made where the state cannot all be on the GPU must
        not bring it all back to switch); the previous plan's other tensors come back first."""
        old = {id(slot.tensor): slot for slot in self.slots}
        kept: dict[int, _StateSlot] = {}
        for move in moves:
            tensor = local_tensor(move.tensor)
            slot = old.get(id(tensor))
            if slot is not None and slot.tier == self._tier(move):
                kept[id(tensor)] = slot
        self._drop([slot for slot in self.slots if id(slot.tensor) not in kept])
        self.slots = []
        self.prefetch_at_event = {}
        self.release_at_event = {}
        self.wait_at_event = {}
        self._between_steps = [i for i, move in enumerate(moves) if move.release_event is None]
        for index, move in enumerate(moves):
            self.slots.append(kept.get(id(local_tensor(move.tensor))) or self._new_slot(move))
            for table, event in (
                (self.prefetch_at_event, move.restore_event),
                (self.release_at_event, move.release_event),
                (self.wait_at_event, move.wait_event),
            ):
                if event is not None:
                    table.setdefault(event, []).append(index)
        self._action_events = {*self.prefetch_at_event, *self.release_at_event, *self.wait_at_event}
        if not self._between_steps:
            self._out_at_next_event = False

    def take_out(self, moves: list[Move]) -> None:
        """Adds between-steps moves for tensors the plan does not move yet (state an optimizer
        creates window by window in its first step) and moves them out now."""
        assert all(move.release_event is None and move.restore_event is None for move in moves)
        assert not {id(local_tensor(m.tensor)) for m in moves} & {id(s.tensor) for s in self.slots}
        indices = list(range(len(self.slots), len(self.slots) + len(moves)))
        self.slots.extend(map(self._new_slot, moves))
        self._between_steps.extend(indices)
        self._move_out(indices)

    def _tier(self, move: Move) -> str:
        """Where `move` goes here: its tier, or host memory for the SSD tier without a store."""
        return HOST if move.tier == SSD and self.store is None else move.tier

    def _new_slot(self, move: Move) -> _StateSlot:
        # A DTensor (FSDP2) moves its local shard: the DTensor wraps that same tensor.
        slot = _StateSlot(local_tensor(move.tensor), self._tier(move), self._next_object_id)
        self._next_object_id += 1
        return slot

    def _drop(self, slots: list[_StateSlot]) -> None:
        """Brings `slots` back to the device, waits for them, and deletes their store objects."""
        for slot in slots:
            if not slot.resident:
                slot.issued = False
                self._restore_slot(slot)
        for slot in slots:
            self._join(slot)
            self._delete_stored(slot)
        if slots and self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _delete_stored(self, slot: _StateSlot) -> None:
        """Deletes an SSD slot's object from the store once its write is done."""
        if slot.tier == SSD and self.ssd is not None:
            self.ssd.delete(slot.object_id)

    def planned_bytes(self, tier: str) -> int:
        return sum(slot.nbytes for slot in self.slots if slot.tier == tier)

    # -- after the step: out ---------------------------------------------------------------------

    def after_step(self, defer: bool = False) -> None:
        """Copies every state tensor moved between steps to its tier and releases its memory.
        `defer`: not now but at the next event (`on_event`) or `issue_deferred_out`, that is once
        the next forward pass runs: copies in one direction run in the order they were issued,
        whatever their stream, so copies issued right after the step would hold up the small copy
        the training loop makes next (`loss.item()`) until all of them are done."""
        if defer:
            # Pinned memory is allocated now: allocating it takes long (about 1 s per GB), on the
            # host, and would stall the forward pass that issues the copies.
            for index in self._between_steps:
                if self.slots[index].resident:
                    self._host_buffer(self.slots[index])
            self._out_at_next_event = self._out_at_next_event or bool(self._between_steps)
        else:
            self._move_out(self._between_steps)
        self.poll()

    def issue_deferred_out(self) -> None:
        """Issues the copies out that `after_step(defer=True)` or `bring_back` left for now."""
        if self._out_at_next_event:
            self._out_at_next_event = False
            self._move_out(self._between_steps)

    def _move_out(self, indices: list[int]) -> None:
        for index in indices:
            if self.slots[index].resident:
                self._offload(self.slots[index])

    def _offload(self, slot: _StateSlot) -> None:
        storage = slot.tensor.untyped_storage()
        source = flat_bytes(slot.tensor)
        self._host_buffer(slot)
        if self.cuda:
            slot.d2h_event = copy_on_stream(self.d2h_stream, self.device, slot.host, source)
            # The allocator keeps the block until the copy has read it.
            source.record_stream(self.d2h_stream)
        else:
            copy_now(slot.host, source)
        del source
        storage.resize_(0)
        slot.resident = False
        slot.issued = False
        self.stats.offloaded_bytes[slot.tier] += slot.nbytes
        if slot.tier == SSD:
            assert self.ssd is not None and slot.host is not None
            self.ssd.write(slot.object_id, slot.host, slot.nbytes, slot.d2h_event)
            slot.host = None  # the tier holds it until the store has the bytes

    def _host_buffer(self, slot: _StateSlot) -> torch.Tensor:
        if slot.host is None:
            slot.host = pinned_buffer(slot.nbytes, self.cuda)
        return slot.host

    def poll(self) -> None:
        """Moves SSD-tier work along without blocking (`StagedSsdTier.poll`): writes start once
        their copy out is done, reads are copied up once they are in."""
        if self.ssd is not None and self.ssd.busy:
            self.ssd.poll()

    # -- during the next iteration: back ---------------------------------------------------------

    def on_event(self, event_index: int) -> None:
        """Does what the plan maps to this `saved_tensors_hooks` event: releases (tensors moved
        within the iteration), restores, and makes compute wait for restores it needs next."""
        self.poll()
        self.issue_deferred_out()
        if event_index not in self._action_events:
            return
        released = self.release_at_event.get(event_index)
        if released:
            self._move_out(released)
        for index in self.prefetch_at_event.get(event_index, ()):
            if not self.slots[index].issued:
                self.stats.prefetches_planned += 1
                self._restore(index)
        for index in self.wait_at_event.get(event_index, ()):
            slot = self.slots[index]
            if not slot.issued and not slot.resident:
                self.stats.prefetches_on_demand += 1
                self._restore(index)
            self._join(slot)

    def out_again(self) -> None:
        """State restored during a backward pass leaves again: another forward pass of the same
        iteration comes before the step (gradient accumulation), and the plan's bound has no room
        for the state during it."""
        for index in self._between_steps:
            slot = self.slots[index]
            if slot.issued:
                self._join(slot)
        self._move_out(self._between_steps)

    def before_step(self) -> None:
        """Restores what is still out and makes the step wait for every restore."""
        started = time.perf_counter()
        for index, slot in enumerate(self.slots):
            if not slot.issued and not slot.resident:
                self.stats.prefetches_on_demand += 1
                self._restore(index)
        for slot in self.slots:
            self._join(slot)
        self.stats.step_wait_s += time.perf_counter() - started

    def step_in_windows(self, windows: list[list[int]], step: Callable[[int], None]) -> None:
        """A windowed optimizer step over the slots in `windows` (lists of slot indices): window
        k's tensors come back (the next window's restore is issued before window k is stepped,
        so that it overlaps), `step(k)` runs, and they go out again, but the last window's, which
        stay for the caller's own step (they leave with `after_step`)."""
        started = time.perf_counter()
        for k, window in enumerate(windows):
            for index in (window if k == 0 else []) + (windows[k + 1] if k + 1 < len(windows) else []):
                if not self.slots[index].issued:
                    self._restore(index)
            for index in window:
                self._join(self.slots[index])
            if k + 1 == len(windows):
                break
            step(k)
            self._move_out(window)
        self.stats.step_wait_s += time.perf_counter() - started

    def _join(self, slot: _StateSlot) -> None:
        """Makes the compute stream wait for the slot's restore (an SSD read is waited for)."""
        if slot.tier == SSD and self.ssd is not None:
            self.ssd.wait_read(slot.object_id)
        restore, slot.restore = slot.restore, None
        if restore is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(restore)

    def _restore(self, index: int) -> None:
        self._restore_slot(self.slots[index])

    def _restore_slot(self, slot: _StateSlot) -> None:
        slot.issued = True
        if slot.resident:
            return
        self.stats.prefetched_bytes[slot.tier] += slot.nbytes
        if slot.tier == SSD:
            self._start_ssd_read(slot)
            return
        self._copy_up(slot)

    def _start_ssd_read(self, slot: _StateSlot) -> None:
        """Starts reading an SSD slot's bytes into a pinned buffer, copied up once they are in
        (`_arrived`)."""
        assert self.ssd is not None
        if self.ssd.reading(slot.object_id):
            return
        arrived = functools.partial(self._arrived, slot)
        self.ssd.read(slot.object_id, self._host_buffer(slot), slot.nbytes, arrived)

    def _arrived(self, slot: _StateSlot) -> None:
        self._copy_up(slot)
        slot.host = None  # the pinned block returns to the pool once the copy is done

    def _copy_up(self, slot: _StateSlot) -> None:
        host = slot.host
        assert host is not None
        storage = slot.tensor.untyped_storage()
        # Grown on the compute stream: the copy must not start before the compute work queued
        # so far, which may still use the memory the allocator hands out here.
        storage.resize_(slot.nbytes)
        target = flat_bytes(slot.tensor)
        slot.resident = True
        if self.cuda:
            slot.restore = copy_on_stream(self.h2d_stream, self.device, target, host, after=slot.d2h_event)
            target.record_stream(self.h2d_stream)
        else:
            copy_now(target, host)

    def bring_back(self, out_again: bool) -> None:
        """Restores every tensor now off the device and waits for it (the optimizer's state dict
        must read, or a load overwrite, its real bytes). `out_again`: those moved out between
        steps leave again at the next event (the next forward pass) instead of the next step."""
        away = [index for index, slot in enumerate(self.slots) if not slot.resident]
        for index in away:
            self._restore(index)
        for slot in self.slots:  # restores issued earlier (planned prefetches) included
            self._join(slot)
        if not away:
            return
        self.stats.brought_back += 1
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self._out_at_next_event = out_again and any(index in self._between_steps for index in away)

    def retarget(self, replacement: dict[int, torch.Tensor]) -> None:
        """Moves from now on the tensors `replacement` maps (by `id` of the slot's tensor) to in
        place of the slot's: `optimizer.load_state_dict` may put new state tensors in the
        optimizer. Call after `bring_back`; the new tensors hold the loaded bytes."""
        for slot in self.slots:
            new = replacement.get(id(slot.tensor))
            if new is None or new is slot.tensor:
                continue
            new = local_tensor(new)
            nbytes = int(new.untyped_storage().nbytes())
            if nbytes != slot.nbytes or new.device != slot.tensor.device:
                raise ValueError(
                    f"optimizer.load_state_dict replaced a state tensor of {slot.nbytes} bytes on "
                    f"{slot.tensor.device} with one of {nbytes} bytes on {new.device}: teraio's plan "
                    "moves state of the shapes it profiled; load a state dict of this model and "
                    "optimizer, or load it before teraio.offload"
                )
            assert slot.resident and not (self.ssd and self.ssd.reading(slot.object_id))
            slot.tensor = new
            slot.issued = False

    def close(self) -> None:
        """Brings every state tensor back (the optimizer is usable without teraio afterwards) and
        deletes the executor's objects from the store. Where the device has no room for it (a
        run that stopped with the state away and the GPU full: `NoPlanFitsError`, out of memory),
        what did not come back stays in host memory instead (its pinned buffer, no second
        copy), with a warning: its bytes are kept (`optimizer.state_dict()` reads them)."""
        try:
            self.set_plan([])
        except torch.OutOfMemoryError:
            away = [slot for slot in self.slots if not slot.resident]
            for slot in away:
                self._keep_in_host_memory(slot)
            for slot in self.slots:  # those that did come back: their copies up are waited for
                if slot.resident:
                    self._join(slot)
                self._delete_stored(slot)
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            warnings.warn(
                f"teraio: {len(away)} optimizer-state tensors ({sum(s.nbytes for s in away)} bytes) "
                "did not fit back on the device at exit and stay in host memory",
                stacklevel=2,
            )
            self.slots = []

    def _keep_in_host_memory(self, slot: _StateSlot) -> None:
        """Makes a slot's pinned buffer its tensor's data (its storage on the device is empty),
        once the copy out is done, or the store has read the bytes back into it."""
        if slot.tier == SSD:
            assert self.ssd is not None
            self._start_ssd_read(slot)
            self.ssd.wait_read(slot.object_id, arrive=False)
        elif slot.d2h_event is not None and self.cuda:
            slot.d2h_event.synchronize()
        assert slot.host is not None and slot.tensor.is_contiguous()
        slot.tensor.data = slot.host[: slot.nbytes].view(slot.tensor.dtype).view(slot.tensor.shape)


def pin_within_iteration(trace: dict[str, Any], kind: str) -> None:
    """Gives each `kind` tensor a read at every op between its first and last use, so that the
    planner may move it only over the period that wraps into the next iteration."""
    for tensor in trace["tensors"]:
        if tensor["kind"] != kind or not tensor["uses"]:
            continue
        accesses = {use["op"]: use["access"] for use in tensor["uses"]}
        first, last = min(accesses), max(accesses)
        tensor["uses"] = [{"op": op, "access": accesses.get(op, "read")} for op in range(first, last + 1)]


def pin_outside_forward_gap(trace: dict[str, Any], kind: str) -> None:
    """Gives each `kind` tensor a read at every op except those between its last forward use and
    its first backward use, so that the planner may move it only over that period (a parameter
    between the two passes). Tensors without both kinds of use are pinned over the iteration."""
    phases = [op.get("phase", "other") for op in trace["ops"]]
    last_op = len(phases) - 1
    for tensor in trace["tensors"]:
        if tensor["kind"] != kind or not tensor["uses"]:
            continue
        accesses = {use["op"]: use["access"] for use in tensor["uses"]}
        forward = [op for op in accesses if phases[op] == "forward"]
        backward = [op for op in accesses if phases[op] == "backward"]
        if forward and backward and max(forward) < min(backward):
            kept = [*range(0, max(forward) + 1), *range(min(backward), last_op + 1)]
        else:
            kept = list(range(0, last_op + 1))
        tensor["uses"] = [{"op": op, "access": accesses.get(op, "read")} for op in kept]
