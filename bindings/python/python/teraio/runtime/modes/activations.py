"""The activations' policy: a plan for saved tensors, executed through `saved_tensors_hooks`.

Every tensor autograd saves in the forward pass goes through `pack`; the plan (or, before there is
one, a fallback policy) says whether it stays, goes to host memory or goes to the SSD tier
through the engine. A saved tensor is moved as its whole storage (views share it, and several
saves of one storage share one copy), so restoring it is a byte copy: results are bitwise the same
as without offload.

Timing (CUDA): offloads are device-to-host copies on their own stream, started right after the
save; the GPU memory returns to PyTorch's allocator when the forward pass drops the tensor and the
copy is done (`record_stream`). Prefetches are host-to-device copies, issued at the save/unpack
event the plan maps the prefetch op to (earliest need first where several share an event); compute
waits on the copy's CUDA event only when it needs the tensor. The copy engine runs host-to-device
copies one at a time in the order they become ready, across streams too, so a small prefetch
needed soon waits behind a large one needed later (the planner's simulator lets the urgent one go
first). What closes that gap is `_pull_urgent_forward`: the urgent prefetch is issued just before
the large one. Prefetches also spread over two streams (a new one behind a copy needed no later
than itself, `_prefetch_stream`) in `PREFETCH_CHUNK_BYTES` pieces; that alone
measured no gain (the pieces of a copy already ready still ran first).
A prefetch the plan did not issue in time is issued on demand; that and any wait for an SSD
read are counted as stalls, and the result is still exact.

SSD tier (`movers.tiers.StagedSsdTier`): the device-to-host copy lands in a pinned buffer, then
the engine writes it from there; reads come back into a pinned buffer and are copied up. So the
activations' SSD bytes are staged in pinned host memory (at most `SSD_STAGING_BYTES` of writes
in flight), and the GPU memory of a save goes back once its copy lands, not once the disk has
it.

Recomputation (`teraio.recompute`): a saved tensor the plan marks "recompute" is not copied at
all; the executor keeps the handles of its sources (earlier saves, parameters, captured module
inputs) and, when backward unpacks it, runs its recipe on the compute stream (sources that were
offloaded are fetched first). Its memory is free from the end of the forward pass until then.

On a CPU "device" the same logic runs with synchronous copies (for tests and CPU-only stacks).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ... import ids
from ...profiler import KeptSave
from ...recompute import Recipe, Source
from ...sharded import is_parameter_memory
from ...store import Store
from ..movers.copy import copy_now, copy_on_stream, flat_bytes, join_copy, pinned_buffer, pinned_size
from ..movers.tiers import HOST, SSD, StagedSsdTier, TierCounters
from ..plans.tensor import RECOMPUTE, PackDecision

#: Prefetches are copied in pieces of this size (64 MiB: about a millisecond on a PCIe 5 x16
#: link, against about 10 us of host time to issue each piece).
PREFETCH_CHUNK_BYTES = 64 << 20


#: Pinned host memory staging SSD writes at most (beyond it a save waits for the disk).
SSD_STAGING_BYTES = 4 << 30

#: Prefetches at least this large (several milliseconds of link time) let later, more urgent
#: ones go first.
PULL_BEHIND_MIN_BYTES = 256 << 20
#: GPU memory left free besides a prefetch issued before its planned event (the allocator's
#: fragmentation and copies in flight, which measured peaks show above the plan).
PULL_HEADROOM_BYTES = 2 << 30


#: The CUDA allocator's statistics as nested dicts, straight from C++ (None: this build has no
#: such function; `torch.cuda.memory_allocated` is used instead).
_cuda_memory_stats = getattr(torch._C, "_cuda_memoryStats", None)


def _nothing() -> None:
    return None


def _deadline(need_event: Optional[int]) -> int:
    """A copy's deadline for ordering: its need event, or after every event if unknown."""
    return need_event if need_event is not None else 1 << 62


@dataclass
class TransferStats(TierCounters):
    """What the executor moved and how often the step had to wait."""

    offloads: int = 0
    ssd_wait_s: float = 0.0
    inflight_waits: int = 0
    inflight_wait_s: float = 0.0
    kept: int = 0
    #: Saves that did not line up with the plan (by index and size: that tensor stays), and
    #: iterations whose save/unpack events did not add up to the plan's (its prefetch points,
    #: which are event indices, then fall elsewhere).
    plan_mismatches: int = 0
    event_misalignments: int = 0
    host_cap_demotions: int = 0
    #: Host time spent inside the pack and unpack hooks (the waits above included).
    hook_s: float = 0.0
    #: Saved storages dropped at the save and made again in backward, their bytes, and the
    #: host time spent issuing their ops.
    recomputed: int = 0
    recomputed_bytes: int = 0
    recompute_s: float = 0.0
    #: Prefetches moved to an earlier event so as not to queue behind a copy needed later
    #: (counted when the plan is installed).
    prefetches_pulled_forward: int = 0
    #: Early issues skipped for want of GPU memory (those went at their planned event).
    pulls_skipped: int = 0
    #: Activation prefetches issued on each prefetch stream (CUDA).
    prefetches_per_stream: list[int] = field(default_factory=list)
    #: Memory fallbacks: saved tensors the plan kept, offloaded because GPU memory ran short;
    #: planned prefetches put off to a later event for the same reason; allocations of a
    #: prefetch that failed, waited for the copies in flight and were tried again.
    emergency_offloads: int = 0
    emergency_offloaded_bytes: int = 0
    prefetches_deferred: int = 0
    memory_waits: int = 0


class _Slot:
    """One offloaded storage of the current iteration."""

    __slots__ = (
        "tier",
        "nbytes",
        "host",
        "object_id",
        "d2h_event",
        "gpu",
        "h2d_event",
        "weak",
        "key",
        "recipe",
        "bound",
        "need_event",
        "__weakref__",
    )

    def __init__(self, tier: str, nbytes: int, object_id: int) -> None:
        self.tier = tier
        self.nbytes = nbytes
        self.object_id = object_id
        self.host: Optional[torch.Tensor] = None
        self.d2h_event: Any = None
        self.gpu: Optional[torch.Tensor] = None
        self.h2d_event: Any = None
        # The event where backward first needs it (the prefetch's deadline); None: unknown.
        self.need_event: Optional[int] = None
        self.weak: Any = None
        self.key: Any = None
        self.recipe: Optional[Recipe] = None
        self.bound: Optional[dict[Source, Any]] = None


class _Packed:
    """What autograd holds instead of a saved tensor: the slot and how to view it."""

    __slots__ = ("slot", "dtype", "size", "stride", "offset", "pack_index", "tensor_id")

    def __init__(self, slot: _Slot, tensor: torch.Tensor, pack_index: int, tensor_id: Optional[int]) -> None:
        self.slot = slot
        self.tensor_id = tensor_id
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.pack_index = pack_index


class ActivationExecutor:
    """Moves saved activations per a plan (see the module docstring)."""

    def __init__(
        self,
        device: torch.device,
        *,
        store: Optional[Store] = None,
        host_memory_bytes: int = 0,
        min_bytes: int = 1 << 20,
        max_inflight_bytes: int = 2 << 30,
        object_id_base: int = ids.base("activations"),  # SSD-tier objects: ids object_id_base + pack index
        skip_storages: Optional[set[Any]] = None,
        gpu_memory_bytes: int = 0,
        copy_streams: int = 2,
        pull_forward_bytes: int = 512 << 20,
    ) -> None:
        if copy_streams < 1:
            raise ValueError(f"copy_streams must be >= 1, got {copy_streams}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.store = store
        self.ssd = StagedSsdTier(store, SSD_STAGING_BYTES) if store is not None else None
        self.host_memory_bytes = host_memory_bytes
        self.min_bytes = min_bytes
        self.gpu_memory_bytes = gpu_memory_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.pull_forward_bytes = pull_forward_bytes
        #: GPU memory kept free under `gpu_memory_bytes` before the fallbacks act (the runtime
        #: sets it from the plan's reserve; 0: no fallback).
        self.margin_bytes = 0
        # Planned prefetches put off for want of memory (pack indices), retried at each event.
        self._deferred: list[int] = []
        self.object_id_base = object_id_base
        self.skip_storages = skip_storages if skip_storages is not None else set()
        self.stats = TransferStats()
        self.profiler: Any = None
        # Called with each event's index (the optimizer-state executor's clock).
        self.on_event: Optional[Callable[[int], None]] = None
        # Called at the first unpack of an iteration (where backward starts to need saved tensors).
        self.on_backward: Optional[Callable[[], None]] = None
        self._unpacked = False
        self.decisions: Optional[list[PackDecision]] = None
        self.planned_events: Optional[int] = None
        self._events_checked = False
        self.prefetch_at_event: dict[int, list[int]] = {}
        # Event -> the pack indices listed there ahead of their planned event.
        self._pulled: dict[int, set[int]] = {}
        self._pack_index = 0
        self._event_index = 0
        # Weak: a slot (and the GPU copy it restores) lives only as long as autograd holds it.
        self._slots_by_pack: dict[int, weakref.ref[_Slot]] = {}
        self._dedup: dict[Any, weakref.ref[_Slot]] = {}
        self._inflight: deque[tuple[Any, int]] = deque()
        self._inflight_bytes = 0
        self._host_in_use = 0
        # Recomputation: the saved tensors recipes read (their first save's handle is kept until
        # backward starts), the handles kept this iteration, and parameters/buffers by trace id.
        self._capture_ids: set[int] = set()
        self._sources: dict[Source, Any] = {}
        self.weight_sources: dict[int, torch.Tensor] = {}
        self._materializing = 0
        # Per prefetch stream: (copy event, need event) of the copy issued on it last.
        self._h2d_last: list[Optional[tuple[Any, int]]] = [None] * copy_streams
        self.stats.prefetches_per_stream = [0] * copy_streams
        # `_allocated`'s reading and the event it was taken at.
        self._allocated_event = -1
        self._allocated_bytes = 0
        self._device_index = 0
        if self.cuda:
            self._device_index = device.index if device.index is not None else torch.cuda.current_device()
            self.d2h_stream = torch.cuda.Stream(device)
            # Prefetch streams; the first is shared with the optimizer-state and parameter movers.
            self.h2d_streams = [torch.cuda.Stream(device) for _ in range(copy_streams)]
            self.h2d_stream = self.h2d_streams[0]

    # -- plan ----------------------------------------------------------------------------------

    def set_plan(self, decisions: list[PackDecision], event_count: Optional[int] = None) -> None:
        """Installs per-pack decisions. Host-tier entries beyond `host_memory_bytes` (counted in
        pack order) go to the SSD tier if there is a store, else stay on the GPU. `event_count`:
        the save/unpack events the plan expects per iteration (checked at each iteration's end).

        Host buffers come from PyTorch's caching pinned allocator: the planned iterations reuse
        the blocks the warm-up iterations pinned (pinning memory is slow: far slower than the
        copies it serves), and a
        block is reused only after the copies that use it are done (the allocator records events).
        """
        self.decisions = decisions
        self.planned_events = event_count
        self.prefetch_at_event = {}
        self._capture_ids = {
            source.tensor_id
            for decision in decisions
            if decision.recipe is not None
            for source in decision.recipe.sources
            if source.kind == "saved"
        }
        host_bytes = 0
        for index, decision in enumerate(decisions):
            if decision.tier == HOST and decision.recipe is None:
                if host_bytes + pinned_size(decision.size_bytes) > self.host_memory_bytes:
                    decision.tier = SSD if self.store is not None else None
                    self.stats.host_cap_demotions += 1
                else:
                    host_bytes += pinned_size(decision.size_bytes)
            if decision.tier is not None and decision.prefetch_event is not None:
                self.prefetch_at_event.setdefault(decision.prefetch_event, []).append(index)
        self._pull_urgent_forward(decisions)
        for indices in self.prefetch_at_event.values():
            indices.sort(key=lambda i: (_deadline(decisions[i].need_event), i))

    def _pull_urgent_forward(self, decisions: list[PackDecision]) -> None:
        """Issues a prefetch early where it would otherwise queue behind a copy needed later.

        The link runs copies in the order they become ready: a prefetch issued while a larger
        one needed later is still copying waits for all of it, where the planner's simulator
        lets it go first. So when prefetch `a` (of at least `PULL_BEHIND_MIN_BYTES`) is issued,
        each prefetch planned between that event and `a`'s need, needed before `a`, and already
        saved, is issued just before it (up to `pull_forward_bytes` per event, each at most
        half of that). Those bytes occupy GPU memory earlier than planned, so an early issue
        happens only while `PULL_HEADROOM_BYTES` stay free besides (`_room_for_early`); else
        the prefetch goes at its planned event, where it stays listed."""
        self._pulled = {}
        if self.pull_forward_bytes <= 0:
            return
        issue_at = {i: event for event, indices in self.prefetch_at_event.items() for i in indices}
        for event in sorted(self.prefetch_at_event):
            indices = self.prefetch_at_event[event]
            budget = self.pull_forward_bytes
            for a in list(indices):
                if decisions[a].size_bytes < PULL_BEHIND_MIN_BYTES:
                    continue
                need_a = _deadline(decisions[a].need_event)
                later = [
                    b
                    for b, at in issue_at.items()
                    if event < at < need_a
                    and _deadline(decisions[b].need_event) < need_a
                    and decisions[b].pack_event is not None
                    and decisions[b].pack_event < event
                    and decisions[b].size_bytes <= self.pull_forward_bytes // 2
                ]
                for b in sorted(later, key=lambda i: (_deadline(decisions[i].need_event), i)):
                    if decisions[b].size_bytes > budget:
                        continue
                    budget -= decisions[b].size_bytes
                    indices.append(b)
                    self._pulled.setdefault(event, set()).add(b)
                    issue_at[b] = event
                    self.stats.prefetches_pulled_forward += 1

    # -- iteration boundaries ------------------------------------------------------------------

    def begin_iteration(self) -> None:
        self._unpacked = False
        self._events_checked = False
        self._allocated_event = -1
        self._deferred = []
        self._pack_index = 0
        self._event_index = 0
        self._slots_by_pack.clear()
        self._dedup.clear()
        self._sources.clear()

    def capture(self, source: Source, tensor: torch.Tensor) -> None:
        """Keeps `tensor` (a module input a recipe reads) until backward starts."""
        self._sources.setdefault(source, tensor)

    def live_slots(self) -> int:
        """Offloaded storages of this iteration still held by autograd (0 after backward)."""
        return sum(1 for ref in set(self._slots_by_pack.values()) if ref() is not None)

    def end_iteration(self) -> None:
        """Finishes the SSD writes still pending (their pinned buffers return to the pool) and
        counts an iteration whose events did not add up to the plan's."""
        if self.decisions is not None and self._event_index and not self._events_checked:
            self._events_checked = True
            packs_off = self._pack_index != len(self.decisions)
            if packs_off or (self.planned_events is not None and self._event_index != self.planned_events):
                self.stats.event_misalignments += 1
        if self.ssd is not None:
            self.ssd.poll()
            self.stats.ssd_wait_s += self.ssd.flush()
        self._dedup.clear()

    def close(self) -> None:
        """Finishes pending writes and deletes the executor's objects from the store."""
        if self.ssd is not None:
            self.ssd.close()

    # -- hooks ---------------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        pack_index = self._pack_index
        self._pack_index = pack_index + 1
        event_index = self._event_index
        self._event_index = event_index + 1
        if self.profiler is not None:
            return self._pack_profiled(tensor, pack_index, event_index)
        started = time.perf_counter()
        self._on_hook_event(event_index)
        handle = self._pack_storage(tensor, pack_index, None)
        if self._capture_ids:
            self._capture_saved(pack_index, handle)
        self.stats.hook_s += time.perf_counter() - started
        return handle

    def _pack_profiled(self, tensor: torch.Tensor, pack_index: int, event_index: int) -> Any:
        """`pack` while a profiler records: the event is noted, the executor's own copies are
        kept out of the trace, and a kept tensor's unpack names its save (`KeptSave`)."""
        assert self.profiler is not None
        tensor_id = self.profiler.note_pack(tensor)
        started = time.perf_counter()
        with self.profiler.paused():
            self._on_hook_event(event_index)
            handle = self._pack_storage(tensor, pack_index, tensor_id)
            if self._capture_ids:
                self._capture_saved(pack_index, handle)
        self.stats.hook_s += time.perf_counter() - started
        if isinstance(handle, torch.Tensor):
            return KeptSave(handle, pack_index, tensor_id)
        return handle

    def _on_hook_event(self, event_index: int) -> None:
        """What every save/unpack event does first: moves SSD work along, issues the prefetches
        planned for it (and those put off), and runs the optimizer-state / parameter clock.
        Each step is skipped at once where it has nothing to do (most events)."""
        if self.ssd is not None and self.ssd.busy:
            self.ssd.poll()
        if self._deferred or event_index in self.prefetch_at_event:
            self._issue_prefetches(event_index)
        if self.on_event is not None:
            self.on_event(event_index)

    def _capture_saved(self, pack_index: int, handle: Any) -> None:
        """Keeps the handle of a save that recipes read (until backward starts)."""
        decisions = self.decisions
        if decisions is not None and pack_index < len(decisions):
            planned_id = decisions[pack_index].tensor_id
            if planned_id in self._capture_ids:
                self._sources.setdefault(Source("saved", planned_id), handle)

    def _pack_storage(self, tensor: torch.Tensor, pack_index: int, tensor_id: Optional[int]) -> Any:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        # Cheapest test first: most saves in many models are small. `isinstance(_, Parameter)`
        # runs Python code (Parameter's metaclass), so plain tensors skip it.
        if nbytes < self.min_bytes or tensor.device != self.device:
            return tensor
        if is_parameter_memory(tensor):
            return tensor
        key = storage.data_ptr()
        if key in self.skip_storages:
            return tensor
        slot_ref = self._dedup.get(key)
        slot = slot_ref() if slot_ref is not None else None
        if slot is not None and not slot.weak.expired():
            self._slots_by_pack[pack_index] = slot_ref  # type: ignore[assignment]
            return _Packed(slot, tensor, pack_index, tensor_id)
        tier = self._decide(pack_index, nbytes)
        if tier is None:
            self.stats.kept += 1
            return tensor
        slot = _Slot(tier, nbytes, self.object_id_base + pack_index)
        if self.decisions is not None:
            slot.need_event = self.decisions[pack_index].need_event
        slot.weak = StorageWeakRef(storage)
        slot.key = key
        if tier == RECOMPUTE:
            assert self.decisions is not None
            recipe = self.decisions[pack_index].recipe
            bound = self._bind(recipe) if recipe is not None else None
            if bound is None:
                self.stats.plan_mismatches += 1
                self.stats.kept += 1
                return tensor
            slot.recipe, slot.bound = recipe, bound
            self.stats.recomputed += 1
            self.stats.recomputed_bytes += nbytes
        else:
            self._offload(slot, tensor)
        self._dedup[key] = weakref.ref(slot)
        self._slots_by_pack[pack_index] = weakref.ref(slot)
        return _Packed(slot, tensor, pack_index, tensor_id)

    def unpack(self, packed: Any) -> torch.Tensor:
        event_index = self._event_index
        self._event_index = event_index + 1
        if not self._unpacked:
            self._unpacked = True
            # Forward is over: every recipe holds its own sources now.
            self._sources.clear()
            if self.on_backward is not None:
                self.on_backward()
        if self.profiler is not None or type(packed) is KeptSave:
            return self._unpack_profiled(packed, event_index)
        started = time.perf_counter()
        self._on_hook_event(event_index)
        tensor = packed if type(packed) is not _Packed else self._restored_view(packed)
        self.stats.hook_s += time.perf_counter() - started
        return tensor

    def _unpack_profiled(self, packed: Any, event_index: int) -> torch.Tensor:
        """`unpack` while a profiler records (see `_pack_profiled`)."""
        profiler = self.profiler
        if type(packed) is KeptSave:
            if profiler is not None:
                profiler.note_unpack(packed.tensor_id, packed.pack_index)
            packed = packed.tensor
        elif profiler is not None:
            tensor_id = None
            if isinstance(packed, torch.Tensor):
                record = profiler.lookup(packed)
                tensor_id = record.id if record is not None else None
            else:
                tensor_id = packed.tensor_id
            profiler.note_unpack(tensor_id, getattr(packed, "pack_index", -1))
        started = time.perf_counter()
        with profiler.paused() if profiler is not None else contextlib.nullcontext():
            self._on_hook_event(event_index)
            tensor = packed if type(packed) is not _Packed else self._restored_view(packed)
        self.stats.hook_s += time.perf_counter() - started
        return tensor

    def _restored_view(self, packed: _Packed) -> torch.Tensor:
        """The saved tensor again: a view of its storage, fetched or recomputed if need be."""
        slot = packed.slot
        gpu = self._restore(slot)
        view = torch.empty(0, dtype=packed.dtype, device=self.device)
        view.set_(gpu.untyped_storage(), packed.offset, packed.size, packed.stride)
        if self.profiler is not None and packed.tensor_id is not None:
            # Backward's uses of the restored copy are uses of the saved tensor.
            self.profiler.alias(view, packed.tensor_id)
        return view

    def _restore(self, slot: _Slot) -> torch.Tensor:
        """The slot's storage on the device (as bytes), fetched or recomputed if it is not there."""
        if slot.gpu is None:
            if slot.tier == RECOMPUTE:
                self._materialize(slot)
            else:
                self.stats.prefetches_on_demand += 1
                slot.need_event = self._event_index  # needed now
                self._prefetch(slot)
        self._await(slot)
        assert slot.gpu is not None
        return slot.gpu

    # -- recomputation -------------------------------------------------------------------------

    def _bind(self, recipe: Recipe) -> Optional[dict[Source, Any]]:
        """This iteration's handles of the recipe's sources (None: one is missing)."""
        bound: dict[Source, Any] = {}
        for source in recipe.sources:
            if source.kind == "weight":
                handle = self.weight_sources.get(source.tensor_id)
            else:
                handle = self._sources.get(source)
            if handle is None:
                return None
            bound[source] = handle
        return bound

    def _materialize(self, slot: _Slot) -> None:
        """Runs the slot's recipe on the compute stream; then lets go of its sources."""
        recipe, bound = slot.recipe, slot.bound
        assert recipe is not None and bound is not None
        started = time.perf_counter()
        self._materializing += 1
        try:
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
                out = recipe.run(lambda source: self._source_storage(bound[source]), self.device)
        finally:
            self._materializing -= 1
        slot.gpu = flat_bytes(out)
        slot.recipe = slot.bound = None
        if not self._materializing:
            self.stats.recompute_s += time.perf_counter() - started

    def _source_storage(self, handle: Any) -> Any:
        if isinstance(handle, _Packed):
            return self._restore(handle.slot).untyped_storage()
        return handle.untyped_storage()

    # -- policy --------------------------------------------------------------------------------

    def _decide(self, pack_index: int, nbytes: int) -> Optional[str]:
        decisions = self.decisions
        if decisions is None:
            # No plan yet (warm-up and profiled iterations): every saved tensor goes, to host
            # memory up to the cap, then to the SSD; so these iterations need no more GPU memory
            # than a plan.
            return self._fallback_tier(nbytes)
        if pack_index < len(decisions):
            decision = decisions[pack_index]
            if decision.size_bytes == nbytes:
                if decision.tier is not None:
                    return decision.tier
                # Kept by the plan: only the memory fallback may move it (with a margin).
                return self._if_short(nbytes) if self.margin_bytes else None
        self.stats.plan_mismatches += 1
        return self._if_short(nbytes)

    def _fallback_tier(self, nbytes: int) -> Optional[str]:
        if self._host_in_use + pinned_size(nbytes) <= self.host_memory_bytes:
            return HOST
        if self.store is not None:
            return SSD
        return None

    def _allocated(self) -> int:
        """GPU bytes the caching allocator has handed out, read once per event: the memory
        checks of one event share a reading, plus the prefetch buffers allocated since
        (`_device_buffer`). `torch.cuda.memory_allocated` flattens every allocator statistic
        into a new dict in Python, far slower than reading the nested statistics from C++."""
        if self._allocated_event != self._event_index:
            self._allocated_event = self._event_index
            if _cuda_memory_stats is not None:
                stats = _cuda_memory_stats(self._device_index)
                self._allocated_bytes = int(stats["allocated_bytes"]["all"]["current"])
            else:
                self._allocated_bytes = int(torch.cuda.memory_allocated(self.device))
        return self._allocated_bytes

    def _short_of_memory(self, nbytes: int) -> bool:
        """Whether `nbytes` more would leave less than `margin_bytes` of the budget (CUDA)."""
        if not self.cuda or not self.gpu_memory_bytes or not self.margin_bytes:
            return False
        return self._allocated() + nbytes > self.gpu_memory_bytes - self.margin_bytes

    def _if_short(self, nbytes: int) -> Optional[str]:
        """A tensor the plan keeps is offloaded anyway when memory runs short (the plan's memory
        estimate was off): a cheaper action than running out; it comes back on demand."""
        if not self._short_of_memory(nbytes):
            return None
        tier = self._fallback_tier(nbytes)
        if tier is not None:
            self.stats.emergency_offloads += 1
            self.stats.emergency_offloaded_bytes += nbytes
        return tier

    # -- transfers -----------------------------------------------------------------------------

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        return pinned_buffer(nbytes, self.cuda)

    def _offload(self, slot: _Slot, tensor: torch.Tensor) -> None:
        # Storage to storage: no flat byte tensor to build (`set_` is the costliest call here).
        source = tensor.untyped_storage()
        slot.host = self._host_buffer(slot.nbytes)
        if slot.tier == HOST:
            self._host_in_use += pinned_size(slot.nbytes)
        self.stats.offloads += 1
        self.stats.offloaded_bytes[slot.tier] += slot.nbytes
        if self.cuda:
            self._throttle(slot.nbytes)
            slot.d2h_event = copy_on_stream(self.d2h_stream, self.device, slot.host.untyped_storage(), source)
            tensor.record_stream(self.d2h_stream)  # marks the storage's block, as a view of it would
            self._inflight.append((slot.d2h_event, slot.nbytes))
            self._inflight_bytes += slot.nbytes
        else:
            copy_now(slot.host.untyped_storage(), source)
        if slot.tier == SSD:
            assert self.ssd is not None
            self.stats.ssd_wait_s += self.ssd.write(slot.object_id, slot.host, slot.nbytes, slot.d2h_event)
            slot.host = None  # the tier holds it until the store has the bytes

    def _throttle(self, nbytes: int) -> None:
        """Bounds device-to-host bytes in flight: GPU memory is only freed once they land."""
        while self._inflight and self._inflight_bytes + nbytes > self.max_inflight_bytes:
            event, size = self._inflight[0]
            if not event.query():
                started = time.perf_counter()
                event.synchronize()
                self.stats.inflight_waits += 1
                self.stats.inflight_wait_s += time.perf_counter() - started
            self._inflight.popleft()
            self._inflight_bytes -= size
        while self._inflight and self._inflight[0][0].query():
            _, size = self._inflight.popleft()
            self._inflight_bytes -= size

    def _issue_prefetches(self, event_index: int) -> None:
        indices = self.prefetch_at_event.get(event_index)
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            indices = deferred + list(indices or ())
        if not indices:
            return
        pulled = self._pulled.get(event_index, ())
        for pack_index in indices:
            slot_ref = self._slots_by_pack.get(pack_index)
            slot = slot_ref() if slot_ref is not None else None
            if slot is None or slot.gpu is not None or slot.tier == RECOMPUTE:
                continue
            if pack_index in pulled and not self._room_for_early(slot.nbytes):
                self.stats.pulls_skipped += 1
                continue  # it goes at its planned event
            if self._short_of_memory(slot.nbytes):
                # Wait for memory rather than run out: tried again at the next event, at the
                # latest fetched when backward needs it.
                self.stats.prefetches_deferred += 1
                self._deferred.append(pack_index)
                continue
            self.stats.prefetches_planned += 1
            self._prefetch(slot)

    def _room_for_early(self, nbytes: int) -> bool:
        """Whether GPU memory has room now for a prefetch issued before its planned event."""
        if not self.cuda or not self.gpu_memory_bytes:
            return True
        return self._allocated() + nbytes + PULL_HEADROOM_BYTES <= self.gpu_memory_bytes

    def _prefetch(self, slot: _Slot) -> None:
        self.stats.prefetched_bytes[slot.tier] += slot.nbytes
        if slot.tier == SSD:
            assert self.ssd is not None
            slot.host = pinned_buffer(slot.nbytes, self.cuda)
            if not self.cuda:
                self.stats.ssd_wait_s += self.ssd.read(slot.object_id, slot.host, slot.nbytes, _nothing)
                self.stats.ssd_wait_s += self.ssd.wait_read(slot.object_id)
                slot.gpu = slot.host.clone()
                slot.host = None
                return
            # The host-to-device copy is issued once the read is in (at an event's poll, at the
            # latest in `_await`).
            slot.gpu = self._device_buffer(slot.nbytes)
            arrived = functools.partial(self._copy_up, slot)
            self.stats.ssd_wait_s += self.ssd.read(slot.object_id, slot.host, slot.nbytes, arrived)
            return
        host = slot.host
        assert host is not None
        if self.cuda:
            slot.gpu = self._device_buffer(slot.nbytes)
            self._copy_up(slot)
        else:
            slot.gpu = host.clone()
            self._host_in_use -= pinned_size(slot.nbytes)
            slot.host = None

    def _device_buffer(self, nbytes: int) -> torch.Tensor:
        """GPU memory for a prefetch; when the allocator is out of it, waits for the
        device-to-host copies in flight (their sources' blocks come back once they land) and
        tries once more."""
        if self._allocated_event == self._event_index:
            self._allocated_bytes += nbytes  # this event's reading (`_allocated`) stays an upper bound
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            self.stats.memory_waits += 1
            self.d2h_stream.synchronize()
            self._throttle(self.max_inflight_bytes + 1)
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _copy_up(self, slot: _Slot) -> None:
        gpu = slot.gpu
        host = slot.host
        assert gpu is not None and host is not None
        index = self._prefetch_stream(slot.need_event)
        stream = self.h2d_streams[index]
        slot.h2d_event = copy_on_stream(
            stream, self.device, gpu, host, after=slot.d2h_event, chunk_bytes=PREFETCH_CHUNK_BYTES
        )
        self._h2d_last[index] = (slot.h2d_event, _deadline(slot.need_event))
        # No `record_stream` here: it would hold the block, once backward frees it, until every
        # copy queued on the prefetch stream by then is done (often most of the backward pass's
        # prefetches), and a full allocator then blocks. Compute instead waits for this copy
        # before it uses the tensor (`_await`) and, should it never use it, before the block is
        # freed (the finalizer runs before the slot's tensors are released).
        finalizer = weakref.finalize(slot, join_copy, self.device, slot.h2d_event)
        finalizer.atexit = False  # nothing to order once the process exits
        if slot.tier == HOST:
            self._host_in_use -= pinned_size(slot.nbytes)
        # The caching host allocator keeps the block until the copy is done.
        slot.host = None

    def _prefetch_stream(self, need_event: Optional[int]) -> int:
        """The prefetch stream for a copy needed at `need_event` (None: no deadline known).

        Copies are issued in the order of their prefetch points, so the copy last issued on a
        stream is the one a new copy would wait behind. Preferred, in order: a stream whose last
        copy is done; a stream whose last copy is needed no later than this one (the one needed
        latest of those: it leaves the stream with the earliest deadline free for an urgent
        copy); else the stream whose last copy is needed first."""
        deadline = _deadline(need_event)
        free, fits, other = [], [], []
        for index, last in enumerate(self._h2d_last):
            if last is None or last[0].query():
                free.append(index)
            elif last[1] <= deadline:
                fits.append((last[1], index))
            else:
                other.append((last[1], index))
        if free:
            index = free[0]
        elif fits:
            index = max(fits)[1]
        else:
            index = min(other)[1]
        self.stats.prefetches_per_stream[index] += 1
        return index

    def _await(self, slot: _Slot) -> None:
        if slot.tier == SSD and self.ssd is not None:
            self.stats.ssd_wait_s += self.ssd.wait_read(slot.object_id)
        if self.cuda and slot.h2d_event is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.h2d_event)
