"""The mover of saved activations: tensors autograd saves for backward, copied to pinned host
memory as they are saved and back to the GPU ahead of the backward that uses them.

Used through a pair of saved-tensor hooks (`pack`, `unpack`) around the code whose saves go to
the host: the block plan's HOST blocks (every tensor a block saves) and whole-model mode's
checkpointed blocks (the inputs `torch.utils.checkpoint` saves for the recomputation).

- Saves are grouped by block (`begin_block`); a storage saved twice in a group is copied once.
  Parameters (`skip`, and FSDP's parameter memory) and saves below `min_bytes` stay on the GPU.
- Host buffers (`RegisteredBuffer`: the bytes asked for, not torch's power-of-two blocks) are
  kept per (block, pass, order of the save) from one iteration to the next, so pinning happens
  once; a copy into a buffer waits on the GPU for the last read of it. A block entered again
  before `end_iteration` (a second forward pass before backward) gets buffers of its own: the
  first pass's bytes are still needed. At most `capacity_bytes` are pinned; past that a save is
  an error (`on_full="raise"`: the block plan sized its cap), goes to the store (`on_full="keep"`
  with a `spill` tier: an `SsdTier`, through the engine's GPU path, up to `spill_room_bytes`;
  the GPU memory of a save being written stays allocated until its write is done, at most
  `window` bytes of it before a save waits), or stays on the GPU and is counted (`on_full="keep"`
  without a store, or with its room taken).
- Copies out run on their own stream after the compute that made the tensor; at most `window`
  bytes are in flight before a save waits on the host (the GPU memory of a tensor in flight
  stays allocated until its copy is done).
- `prefetch(block)` issues the copies back of a block's saves; an unpack of a save not
  prefetched issues them then (counted as on demand). Compute waits for a copy back on the GPU.
  Once every save of a storage has been unpacked, the mover lets go of its GPU copy (autograd
  holds it as long as it needs it).

On a CPU "device" copies are synchronous.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ... import sharded
from ...pinned import RegisteredBuffer
from ...planning import format_bytes
from .copy import copy_now, copy_on_stream, flat_bytes
from .tiers import HOST, SSD, SsdTier, TierCounters, Transfer


@dataclass
class SavedStats(TierCounters):
    """What the mover moved (to host memory, or the store) and waited for, cumulative."""

    window_waits: int = 0
    window_wait_s: float = 0.0
    hook_s: float = 0.0
    #: Saves left on the GPU because the host buffers were at their cap (`on_full="keep"`).
    kept_for_room: int = 0
    kept_for_room_bytes: int = 0


class _Saved:
    """What autograd holds for a moved save: its storage's slot and the view."""

    __slots__ = ("slot", "dtype", "size", "stride", "offset")

    def __init__(self, slot: _Slot, tensor: torch.Tensor) -> None:
        self.slot = slot
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()


class _Slot:
    """One copied storage: its host buffer, the copy out, and while prefetched its GPU copy."""

    __slots__ = (
        "block",
        "key",
        "write",
        "nbytes",
        "host",
        "d2h",
        "gpu",
        "h2d",
        "read",
        "joined",
        "saves",
        "unpacked",
    )

    def __init__(
        self, block: int, key: tuple[int, int, int], write: int, nbytes: int, host: Optional[torch.Tensor]
    ) -> None:
        self.block = block
        self.key = key  # its host buffer's, or its store object's
        self.write = write  # which write under that key holds its bytes
        self.nbytes = nbytes
        self.host = host  # None: on the store
        self.d2h: Any = None
        self.gpu: Optional[torch.Tensor] = None
        self.h2d: Any = None
        self.read: Optional[Transfer] = None  # from the store
        self.joined = False
        self.saves = 0  # `_Saved` handles made for it
        self.unpacked = 0  # of those, unpacked since the last prefetch


class SavedTensorMover:
    """Saved tensors to pinned host memory and back (see the module docstring)."""

    def __init__(
        self,
        device: torch.device,
        capacity_bytes: int,
        stats: SavedStats,
        min_bytes: int,
        skip: set[int],
        on_full: str = "raise",
        streams: Optional[tuple[Any, Any]] = None,
        spill: Optional[SsdTier] = None,
    ) -> None:
        assert on_full in ("raise", "keep"), on_full
        assert spill is None or on_full == "keep", "a spill tier takes what the host cannot"
        self.device = device
        self.cuda = device.type == "cuda"
        self.capacity_bytes = capacity_bytes
        self.on_full = on_full
        #: Bytes in flight to the host before a save waits (set by the caller's plan).
        self.window = 0
        self.stats = stats
        self.used_bytes = 0
        self.peak_bytes = 0
        self.buffers: dict[tuple[int, int, int], torch.Tensor] = {}
        self._pinned: dict[tuple[int, int, int], RegisteredBuffer] = {}  # behind `buffers` (CUDA)
        self.last_read: dict[tuple[int, int, int], Any] = {}
        # Per block, this iteration's copied storages; per buffer, the writes into it so far.
        self.slots: dict[int, list[_Slot]] = {}
        self._writes: dict[tuple[int, int, int], int] = {}
        self._passes: dict[int, int] = {}
        self._in_flight: deque[tuple[Any, int]] = deque()
        self._flight_bytes = 0
        self.spill = spill
        #: Bytes the saves may take on the store (None: half of its free space, read at the first
        #: save that goes there); the bytes each key holds there.
        self.spill_room_bytes: Optional[int] = None
        self._spilled: dict[tuple[int, int, int], int] = {}
        self._spilled_bytes = 0
        #: Called with (key, bytes, tier) for each save moved out (the caller's record of it).
        self.on_moved: Optional[Callable[[tuple[int, int, int], int, str], None]] = None
        # Store writes not seen done yet, with the GPU memory each reads from.
        self._spilling: deque[tuple[Transfer, torch.Tensor]] = deque()
        self._spill_bytes = 0
        self._block = -1
        self._pass = 0
        self._seen: dict[int, tuple[Optional[_Slot], Any]] = {}
        # Storages never copied (parameters), and the size below which a save stays.
        self.skip = skip
        self.min_bytes = min_bytes
        if self.cuda:
            self.d2h_stream, self.h2d_stream = (
                streams if streams is not None else (torch.cuda.Stream(device), torch.cuda.Stream(device))
            )

    def begin_block(self, index: int) -> None:
        """The saves that follow are block `index`'s (until the next `begin_block`)."""
        self._block = index
        self._seen = {}
        self._pass = self._passes.get(index, -1) + 1
        self._passes[index] = self._pass
        if self._pass == 0:
            self.slots[index] = []

    def pack(self, tensor: torch.Tensor) -> Any:
        started = time.perf_counter()
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if (
            nbytes == 0
            or nbytes < self.min_bytes
            or tensor.device != self.device
            or key in self.skip
            or sharded.is_parameter_memory(tensor)
        ):
            return tensor
        seen = self._seen.get(key)
        # The address names the storage only while it lives: once a copied storage is freed, the
        # allocator may hand its address to a new tensor of the same block.
        if seen is not None and not seen[1].expired():
            slot = seen[0]
        else:
            slot = self._offload(tensor, nbytes)
            self._seen[key] = (slot, StorageWeakRef(storage))
        self.stats.hook_s += time.perf_counter() - started
        if slot is None:
            return tensor
        slot.saves += 1
        return _Saved(slot, tensor)

    def _offload(self, tensor: torch.Tensor, nbytes: int) -> Optional[_Slot]:
        slots = self.slots[self._block]
        key = (self._block, self._pass, len(slots))
        host = self.buffers.get(key)
        if host is None or host.numel() != nbytes:
            held = 0 if host is None else host.numel()
            if self.used_bytes - held + nbytes > self.capacity_bytes:
                if self.on_full == "raise":
                    raise MemoryError(
                        f"teraio.offload: host buffers for block activations would exceed their cap of "
                        f"{format_bytes(self.capacity_bytes)} ({format_bytes(self.used_bytes)} in use, "
                        f"{format_bytes(nbytes)} more)"
                    )
                slot = self._spill(key, tensor, nbytes) if self.spill is not None else None
                if slot is None:
                    self.stats.kept_for_room += 1
                    self.stats.kept_for_room_bytes += nbytes
                    return None
                slots.append(slot)
                return slot
            self.used_bytes -= held
            self._free(key)
            if self.cuda:
                self._pinned[key] = RegisteredBuffer(nbytes)
                host = self._pinned[key].tensor
            else:
                host = torch.empty(nbytes, dtype=torch.uint8)
            self.buffers[key] = host
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        slot = _Slot(self._block, key, self._written(key), nbytes, host)
        source = flat_bytes(tensor)
        if self.cuda:
            slot.d2h = copy_on_stream(
                self.d2h_stream, self.device, host, source, after=self.last_read.get(key)
            )
            source.record_stream(self.d2h_stream)
            self._in_flight.append((slot.d2h, nbytes))
            self._flight_bytes += nbytes
            self._throttle()
        else:
            copy_now(host, source)
        slots.append(slot)
        self.stats.offloaded_bytes[HOST] += nbytes
        if self.on_moved is not None:
            self.on_moved(key, nbytes, HOST)
        return slot

    def _written(self, key: tuple[int, int, int]) -> int:
        """Counts a write under `key`; returns its number."""
        self._writes[key] = self._writes.get(key, 0) + 1
        return self._writes[key]

    def _spill(self, key: tuple[int, int, int], tensor: torch.Tensor, nbytes: int) -> Optional[_Slot]:
        """The save as an object in the store (None where the room it may take there is full)."""
        assert self.spill is not None
        if self.spill_room_bytes is None:
            # Each object may be held twice while it is rewritten (the new version is written
            # before the old one goes): half of what the store has free.
            devices = self.spill.store.info()["devices"]
            self.spill_room_bytes = sum(int(d["free_bytes"]) for d in devices) // 2
        held = self._spilled.get(key, 0)
        if self._spilled_bytes - held + nbytes > self.spill_room_bytes:
            return None
        self._spilled[key] = nbytes
        self._spilled_bytes += nbytes - held
        source = flat_bytes(tensor)
        transfer = self.spill.write(key, source)
        self._spilling.append((transfer, source))
        self._spill_bytes += nbytes
        self._settle_spills(self.window)
        self.stats.offloaded_bytes[SSD] += nbytes
        if self.on_moved is not None:
            self.on_moved(key, nbytes, SSD)
        return _Slot(self._block, key, self._written(key), nbytes, None)

    def _settle_spills(self, limit: int) -> None:
        """Lets go of the sources of finished store writes; waits (on the host) for the oldest
        while more than `limit` bytes are being written."""
        while self._spilling and (self._spill_bytes > limit or self._spilling[0][0].done()):
            transfer, source = self._spilling.popleft()
            if not transfer.done():
                started = time.perf_counter()
                transfer.join()
                self.stats.window_waits += 1
                self.stats.window_wait_s += time.perf_counter() - started
            self._spill_bytes -= source.numel()

    def _free(self, key: tuple[int, int, int]) -> None:
        """Gives a buffer of another size back (a batch of another shape), once no copy uses it."""
        pinned = self._pinned.pop(key, None)
        if pinned is not None:
            self.d2h_stream.synchronize()
            self.h2d_stream.synchronize()
            pinned.release()

    def _throttle(self) -> None:
        """Waits (on the host) while more than the window is in flight to the host."""
        while self._in_flight and (self._flight_bytes > self.window or self._in_flight[0][0].query()):
            event, nbytes = self._in_flight.popleft()
            if self._flight_bytes > self.window and not event.query():
                started = time.perf_counter()
                event.synchronize()
                self.stats.window_waits += 1
                self.stats.window_wait_s += time.perf_counter() - started
            self._flight_bytes -= nbytes

    def held(self, index: int) -> bool:
        """Whether block `index` has saves off the GPU this iteration."""
        return bool(self.slots.get(index))

    def saves_of(self, index: int) -> list[tuple[tuple[int, int, int], int, str]]:
        """Block `index`'s saves off the GPU this iteration: (key, bytes, tier)."""
        return [
            (slot.key, slot.nbytes, HOST if slot.host is not None else SSD)
            for slot in self.slots.get(index, ())
        ]

    def prefetch(self, index: int) -> int:
        """Issues the copies back of block `index`'s saved tensors; returns their bytes."""
        total = 0
        for slot in self.slots.get(index, ()):
            if slot.gpu is None and slot.unpacked < slot.saves:
                self._copy_back(slot)
                total += slot.nbytes
        return total

    def _copy_back(self, slot: _Slot) -> None:
        if self._writes.get(slot.key) != slot.write:
            raise RuntimeError(
                "teraio.offload: a saved block input was overwritten by a later forward pass before "
                "this backward read it (a backward through an earlier graph after a new forward); "
                "pass checkpoint_inputs='gpu' for such loops"
            )
        slot.gpu = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)
        slot.joined = False
        if slot.host is None:
            assert self.spill is not None
            slot.read = self.spill.read(slot.key, slot.gpu)
            self.stats.prefetched_bytes[SSD] += slot.nbytes
            return
        if self.cuda:
            slot.h2d = copy_on_stream(self.h2d_stream, self.device, slot.gpu, slot.host, after=slot.d2h)
            slot.gpu.record_stream(self.h2d_stream)
            self.last_read[slot.key] = slot.h2d
        else:
            copy_now(slot.gpu, slot.host)
        self.stats.prefetched_bytes[HOST] += slot.nbytes

    def unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is not _Saved:
            return saved
        started = time.perf_counter()
        slot = saved.slot
        if slot.gpu is None:
            # Not prefetched (the rest of its block is needed soon too), or unpacked again (a
            # second backward through the same graph).
            self.stats.prefetches_on_demand += 1
            if slot.unpacked >= slot.saves:
                slot.unpacked = 0
            self._copy_back(slot)
            self.prefetch(slot.block)
        gpu = slot.gpu
        assert gpu is not None
        if not slot.joined:
            if slot.read is not None:
                slot.read.join()  # compute waits for the store's read (on the GPU)
                slot.read = None
            elif self.cuda:
                torch.cuda.current_stream(self.device).wait_event(slot.h2d)
            slot.joined = True
        view = torch.empty(0, dtype=saved.dtype, device=self.device)
        view.set_(gpu.untyped_storage(), saved.offset, saved.size, saved.stride)
        slot.unpacked += 1
        if slot.unpacked >= slot.saves:
            slot.gpu = None  # the views hold the memory as long as autograd needs it
        self.stats.hook_s += time.perf_counter() - started
        return view

    def end_iteration(self) -> None:
        """Forgets this iteration's saved tensors, and with them their copies back on the device
        (called once backward is done, before the step)."""
        self.slots = {}
        self._passes = {}
        self._seen = {}

    def close(self) -> None:
        self._settle_spills(0)
        if self.cuda:
            self.d2h_stream.synchronize()
            self.h2d_stream.synchronize()
        for pinned in self._pinned.values():
            pinned.release()
        self._pinned.clear()
        self.buffers.clear()
        self.last_read.clear()
        self.slots = {}
        self._passes = {}
        self._in_flight.clear()
        self._flight_bytes = 0
        self.used_bytes = 0
