"""Movers: one per tier, used by every tensor kind the whole-model runtime moves.

A tier holds the bytes of a tensor while its GPU storage is released, under a key chosen by the
caller. Both tiers take and fill flat byte views of GPU storage (`flat_bytes`), asynchronously,
and return a `Transfer` that says when the copy is done and makes compute wait for it:

- `HostTier`: pinned host buffers, one per key, allocated when a key is first written and capped
  at `capacity_bytes` (an error past it, never a silent overflow). Each is sized to the key's
  bytes (to a page: `RegisteredBuffer`), not by torch's pinned allocator, which rounds every
  block up to a power of two; so the host memory a tier pins is its bytes. Copies run on their own CUDA
  streams after the compute work queued so far, and compute waits for a read on the GPU
  (`wait_event`), not on the host. Copies asked for inside `batched()` are issued together at its
  end, one stream ordering and one event per direction for all of them: the whole-model runtime
  moves a unit's tensors as one group, and its per-tensor host work (stream waits, events) bounded
  its iterations (the copy streams sat idle for want of copies the host had not queued yet).
- `SsdTier`: objects in a `teraio.Store`, one per key, in one id namespace (`teraio.ids`). Data
  moves through the engine's GPU path (`Store.start_put`/`start_get` of CUDA memory: its pinned
  bounce slab, or cuFile with GPUDirect Storage), so Python stages nothing. The engine copies on
  its own streams, so each transfer is handed a CUDA event recorded on the compute stream where
  it was asked for (`after=`: the producer is done, or the allocator's reuse of the target memory
  is), and the engine starts it once the event has completed; nothing polls. Compute waits for a
  read on the GPU (`Handle.enqueue_stream_wait`: the host waits only until the read's bytes are
  in and their copies queued); a write's join waits on the host, since the caller frees its
  source right after. A read's failure is raised by the next `poll` or `close` (the stream was
  released for it too).

- `StagedSsdTier`: objects in a `teraio.Store` written from and read into pinned host buffers
  through the engine's host path; the caller copies between the GPU and those buffers (with
  `copy.copy_on_stream`). For tensors whose GPU memory must go back as soon as their copy to
  host memory lands, well before the disk has them (a saved activation in the forward pass,
  optimizer state after the step), where the GPU path would hold the GPU memory until the write
  is done. The host path cannot wait for a CUDA event, so a write starts at the first `poll`
  after the copy that fills its buffer (`copied`) is done, and a read's `arrived` runs at the
  first `poll` after its bytes are in (or when the caller waits for it). The tier holds a
  write's buffer until the store has the bytes: the caller lets go of it at once, so pinned
  memory holds only what is still on its way to the disk, at most `staging_bytes` of it (a
  write past that waits for those before it).

On a CPU "device" both tiers copy synchronously (host tier) or through the engine's host path
(SSD tiers), for tests and CPU-only stacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ...pinned import RegisteredBuffer
from ...store import Handle, Store
from .copy import copies_on_stream, copy_now

#: The tier of tensors that stay on the GPU.
GPU = "gpu"
#: The tier of pinned host memory.
HOST = "host"
#: The tier of objects in a `teraio.Store` (the SSDs).
SSD = "ssd"


@dataclass
class Counters:
    """A mover's cumulative counters; reports take differences of `as_dict` snapshots."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TierCounters(Counters):
    """Bytes moved out to and back from each tier, and how the copies back were issued: at the
    planned point, or on demand when the data was needed first."""

    offloaded_bytes: dict[str, int] = field(default_factory=lambda: {HOST: 0, SSD: 0})
    prefetched_bytes: dict[str, int] = field(default_factory=lambda: {HOST: 0, SSD: 0})
    prefetches_planned: int = 0
    prefetches_on_demand: int = 0


__all__ = [
    "GPU",
    "HOST",
    "SSD",
    "Counters",
    "HostTier",
    "SsdTier",
    "StagedSsdTier",
    "TierCounters",
    "Transfer",
]


class Transfer:
    """One copy between the GPU and a tier."""

    __slots__ = ("_done", "_join", "nbytes")

    def __init__(self, nbytes: int, done: Callable[[], bool], join: Callable[[], None]) -> None:
        self.nbytes = nbytes
        self._done = done
        self._join = join

    def done(self) -> bool:
        """The copy has finished (polls; never blocks)."""
        return self._done()

    def join(self) -> None:
        """Makes the compute stream wait for the copy (a read: before its data is used; a write:
        before its source is changed or freed)."""
        self._join()


class _Group:
    """Host-tier copies issued together: one event after the last of them."""

    __slots__ = ("tier", "event", "waited_on")

    def __init__(self, tier: HostTier) -> None:
        self.tier = tier
        self.event: Any = None
        self.waited_on: Optional[int] = None  # the stream (handle) already made to wait for it

    def done(self) -> bool:
        return self.event is not None and bool(self.event.query())

    def join(self) -> None:
        if self.event is None:
            self.tier.flush()  # joined inside its batch: issue what is queued now
        stream = torch.cuda.current_stream(self.tier.device)
        # By handle: `Stream.__ne__` is the C base's, and `None != stream` is False there.
        if self.waited_on != stream.cuda_stream:
            stream.wait_event(self.event)
            self.waited_on = stream.cuda_stream


def _finished() -> bool:
    return True


def _nothing() -> None:
    return None


#: Elements per chunk of `add_widened`: its scratch buffer per thread (32 MiB of fp32).
ADD_CHUNK_ELEMENTS = 1 << 23

_scratch = threading.local()


def add_widened(held: torch.Tensor, values: torch.Tensor) -> None:
    """`held.add_(values)` for a narrower `values` (bf16 into fp32), with the same bits: torch
    computes a mixed-dtype add as `held + float(value)` per element, but in a scalar loop on
    the CPU, about 10x slower than widening into a scratch buffer and adding like dtypes (both
    vectorised). Chunked, so the scratch is bounded; one per thread, since the update worker
    and the training threads (the loop's, autograd's) fold gradients: at most 32 MiB each,
    outside `host_memory`, kept for the thread's life."""
    if held.device.type != "cpu" or values.dtype == held.dtype:
        held.add_(values)
        return
    assert held.numel() == values.numel() and held.is_contiguous() and values.is_contiguous()
    scratch = getattr(_scratch, "buffer", None)
    if scratch is None or scratch.dtype != held.dtype or scratch.numel() != ADD_CHUNK_ELEMENTS:
        scratch = _scratch.buffer = torch.empty(ADD_CHUNK_ELEMENTS, dtype=held.dtype)
    flat_held, flat_values = held.view(-1), values.view(-1)
    for start in range(0, held.numel(), ADD_CHUNK_ELEMENTS):
        part = flat_held[start : start + ADD_CHUNK_ELEMENTS]
        widened = scratch[: part.numel()]
        widened.copy_(flat_values[start : start + ADD_CHUNK_ELEMENTS])
        part.add_(widened)


class HostTier:
    """Pinned host memory, at most `capacity_bytes` of it (see the module docstring)."""

    name = HOST

    def __init__(
        self, device: torch.device, capacity_bytes: int, streams: Optional[tuple[Any, Any]] = None
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.peak_bytes = 0  # the most it held (kept after `close`)
        self.buffers: dict[Any, torch.Tensor] = {}
        # The pinned memory behind each buffer (CUDA only).
        self._pinned: dict[Any, RegisteredBuffer] = {}
        # The last write of each key: a read of the key is queued after it.
        self._written: dict[Any, Any] = {}
        # Inside `batched()`: (key, GPU tensor, host buffer) copies not issued yet, and their group.
        self._batching = 0
        self._queued: dict[str, list[tuple[Any, torch.Tensor, torch.Tensor]]] = {"out": [], "in": []}
        self._groups: dict[str, Optional[_Group]] = {"out": None, "in": None}
        if self.cuda:
            self.d2h, self.h2d = (
                streams if streams is not None else (torch.cuda.Stream(device), torch.cuda.Stream(device))
            )

    def reserve(self, key: Any, nbytes: int) -> None:
        """Allocates the key's buffer now (start-up), so that running out is an error up front."""
        if key in self.buffers:
            assert self.buffers[key].numel() == nbytes, f"{key}: {self.buffers[key].numel()} != {nbytes}"
            return
        if self.used_bytes + nbytes > self.capacity_bytes:
            raise MemoryError(
                f"teraio host tier: {nbytes} more bytes would exceed its cap of {self.capacity_bytes} "
                f"({self.used_bytes} in use)"
            )
        if self.cuda:
            self._pinned[key] = RegisteredBuffer(nbytes)
            self.buffers[key] = self._pinned[key].tensor
        else:
            self.buffers[key] = torch.empty(nbytes, dtype=torch.uint8)
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def zeros_like(self, key: Any, like: torch.Tensor) -> torch.Tensor:
        """The key's buffer, allocated now (pinned on CUDA) and zeroed, viewed as `like` (a
        contiguous tensor): a new tensor that lives in the tier from the start."""
        self.reserve(key, like.numel() * like.element_size())
        return self.buffers[key].view(like.dtype).view(like.shape).zero_()

    def adopt(self, key: Any, value: torch.Tensor) -> torch.Tensor:
        """Takes `value` (a contiguous tensor in CPU memory) into the key's buffer, allocated now
        (pinned on CUDA, so its copies run at the link's rate), and returns the buffer viewed as
        `value`: the caller keeps that view in place of `value` from now on."""
        nbytes = value.numel() * value.element_size()
        self.reserve(key, nbytes)
        held = self.buffers[key].view(value.dtype).view(value.shape)
        held.copy_(value)
        return held

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Copies asked for inside are issued together when the block ends (see the module
        docstring); a write's source must stay allocated until then. Joining a copy of the batch
        inside it issues what is queued so far."""
        self._batching += 1
        try:
            yield
        finally:
            self._batching -= 1
            if self._batching == 0:
                self.flush()

    def write(self, key: Any, source: torch.Tensor) -> Transfer:
        """Copies `source` (flat bytes on the GPU) to the key's buffer after the compute work
        queued so far; the source's memory may be released as soon as this returns (inside
        `batched()`: once the block has ended)."""
        self.reserve(key, source.numel())
        host = self.buffers[key]
        if not self.cuda:
            copy_now(host, source)
            return Transfer(source.numel(), _finished, _nothing)
        return self._queue("out", key, source, host)

    def read(self, key: Any, target: torch.Tensor) -> Transfer:
        """Copies the key's bytes into `target` (flat bytes on the GPU, allocated on the compute
        stream) after the compute work queued so far and the key's last write."""
        host = self.buffers[key]
        assert host.numel() == target.numel(), f"{key}: {host.numel()} != {target.numel()}"
        if not self.cuda:
            copy_now(target, host)
            return Transfer(target.numel(), _finished, _nothing)
        return self._queue("in", key, target, host)

    def _queue(self, direction: str, key: Any, gpu: torch.Tensor, host: torch.Tensor) -> Transfer:
        group = self._groups[direction]
        if group is None:
            group = self._groups[direction] = _Group(self)
        self._queued[direction].append((key, gpu, host))
        transfer = Transfer(gpu.numel(), group.done, group.join)
        if self._batching == 0:
            self.flush()
        return transfer

    def flush(self) -> None:
        """Issues the queued copies: writes first (a read of a key written in the same batch is
        ordered after the write), each direction on its stream after the compute work queued so
        far."""
        if not self.cuda:
            return  # copies on a CPU device are done when asked for
        for direction, stream in (("out", self.d2h), ("in", self.h2d)):
            queued, group = self._queued[direction], self._groups[direction]
            if not queued:
                continue
            self._queued[direction], self._groups[direction] = [], None
            out = direction == "out"
            pairs = [(host, gpu) if out else (gpu, host) for _, gpu, host in queued]
            # A read waits for its key's last write; writes of a key are in order on their stream.
            last = [] if out else [self._written.get(key) for key, _, _ in queued]
            written = {id(e): e for e in last if e is not None}
            event = copies_on_stream(stream, self.device, pairs, list(written.values()))
            for key, gpu, _ in queued:
                # The allocator keeps the GPU block until the copy is done with it.
                gpu.record_stream(stream)
                if out:
                    self._written[key] = event
            assert group is not None
            group.event = event

    def read_to_host(self, key: Any, target: torch.Tensor) -> None:
        """Copies the key's bytes into `target` (flat bytes in CPU memory) once its last write
        is done."""
        self.wait_written(key)
        target.copy_(self.buffers[key])

    def written_event(self, key: Any) -> Optional[Any]:
        """The CUDA event of the key's last issued write (None: none issued, or a CPU device),
        for a thread that waits for it without touching the tier."""
        return self._written.get(key)

    def wait_written(self, key: Any) -> None:
        """Waits on the host until the key's last write is in its buffer (for CPU work on it)."""
        self.flush()
        written = self._written.get(key)
        if written is not None:
            written.synchronize()

    def convert(
        self,
        target: Any,
        target_dtype: torch.dtype,
        source: Any,
        source_dtype: torch.dtype,
        add: bool = False,
    ) -> None:
        """On the host: the source key's elements (`source_dtype`) rounded or widened into the
        target key's buffer (`target_dtype`), added to what it holds where `add`. The caller
        orders it after the copies that fill the source and before those that read the target."""
        values = self.buffers[source].view(source_dtype)
        held = self.buffers[target].view(target_dtype)
        if add:
            add_widened(held, values)
        else:
            held.copy_(values)

    def discard(self, key: Any) -> None:
        """Forgets the key's bytes (its buffer stays allocated for the next write)."""
        self._written.pop(key, None)

    def release(self, key: Any) -> None:
        """Gives the key's buffer back (its bytes are gone): where the caller has copied them
        elsewhere, so that the tier's memory and the copy's are not both held at once."""
        if key not in self.buffers:
            return
        self._settle()
        self._written.pop(key, None)
        self.used_bytes -= self.buffers.pop(key).numel()
        pinned = self._pinned.pop(key, None)
        if pinned is not None:
            pinned.release()

    def close(self) -> None:
        self._settle()
        for pinned in self._pinned.values():
            pinned.release()
        self._pinned.clear()
        self.buffers.clear()
        self._written.clear()
        self.used_bytes = 0

    def _settle(self) -> None:
        """Issues what is queued and waits for every copy (before memory goes back)."""
        self.flush()
        if self.cuda:
            self.d2h.synchronize()
            self.h2d.synchronize()


class SsdTier:
    """Objects in a store, ids `base + key index` (see the module docstring)."""

    name = SSD

    def __init__(self, device: torch.device, store: Store, id_base: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.store = store
        self.id_base = id_base
        self.ids: dict[Any, int] = {}
        # The last write of each key, and every transfer not yet seen finished.
        self._written: dict[Any, Handle] = {}
        self._in_flight: list[Handle] = []

    def object_id(self, key: Any) -> int:
        if key not in self.ids:
            self.ids[key] = self.id_base + len(self.ids)
        return self.ids[key]

    def write(self, key: Any, source: torch.Tensor) -> Transfer:
        """Writes `source` (flat bytes) as the key's object once the compute work queued so far
        is done. Do not release or change `source` until the transfer is done."""
        object_id = self.object_id(key)
        self._wait_written(key)  # one version of an object in flight at a time
        handle = self.store.start_put(object_id, source, source.numel(), after=self._compute_point())
        self._written[key] = handle
        self._in_flight.append(handle)
        return Transfer(source.numel(), handle.is_done, handle.wait)

    def read(self, key: Any, target: torch.Tensor) -> Transfer:
        """Reads the key's object into `target` (flat bytes) once the compute stream has passed
        this point (the allocator may have handed out memory that queued work still uses). The
        transfer's join makes the compute stream wait for it on the GPU."""
        self._wait_written(key)  # the read needs the object as last written
        handle = self.store.start_get(self.ids[key], target, target.numel(), after=self._compute_point())
        self._in_flight.append(handle)
        if not self.cuda:
            return Transfer(target.numel(), handle.is_done, handle.wait)

        def join() -> None:
            handle.enqueue_stream_wait(torch.cuda.current_stream(self.device))

        return Transfer(target.numel(), handle.is_done, join)

    def _compute_point(self) -> Optional[torch.cuda.Event]:
        """The one place the SSD tier orders the engine after compute: an event recorded on the
        compute stream, which the engine waits for before it touches the memory (None on a CPU
        device, whose work is done when asked for)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _wait_written(self, key: Any) -> None:
        previous = self._written.get(key)
        if previous is not None:
            previous.wait()

    def read_to_host(self, key: Any, target: torch.Tensor) -> None:
        """Reads the key's object into `target` (flat bytes in CPU memory) and waits."""
        self._wait_written(key)
        self.store.start_get(self.ids[key], target, target.numel()).wait()

    def poll(self) -> None:
        """Drops finished transfers, raising the error of one that failed."""
        still = []
        for handle in self._in_flight:
            if handle.is_done():
                handle.wait()
            else:
                still.append(handle)
        self._in_flight = still
        for key in [key for key, handle in self._written.items() if handle.is_done()]:
            self._written.pop(key).wait()

    def discard(self, key: Any) -> None:
        pending = self._written.pop(key, None)
        if pending is not None:
            pending.wait()

    def close(self) -> None:
        """Waits for every transfer and deletes the tier's objects."""
        for handle in self._in_flight:
            handle.wait()
        self._in_flight.clear()
        self._written.clear()
        if not self.store.closed:
            for object_id in self.ids.values():
                self.store.delete(object_id)
        self.ids.clear()


class _Staged:
    """A staged write or read of one object: its pinned buffer, the copy that fills it (a write),
    the engine's handle once started, and what runs when a read is in."""

    __slots__ = ("host", "nbytes", "copied", "handle", "arrived")

    def __init__(
        self,
        host: torch.Tensor,
        nbytes: int,
        copied: Any = None,
        handle: Optional[Handle] = None,
        arrived: Optional[Callable[[], None]] = None,
    ) -> None:
        self.host = host
        self.nbytes = nbytes
        self.copied = copied
        self.handle = handle
        self.arrived = arrived


class StagedSsdTier:
    """Objects in a store, staged through pinned host buffers (see the module docstring). Object
    ids are the caller's; one write and one read of an object are in flight at a time."""

    name = SSD

    def __init__(self, store: Store, staging_bytes: Optional[int] = None) -> None:
        self.store = store
        self.staging_bytes = staging_bytes
        #: Every object written and not deleted since.
        self.written: set[int] = set()
        # In issue order (dicts keep it).
        self._writes: dict[int, _Staged] = {}
        self._reads: dict[int, _Staged] = {}

    @property
    def busy(self) -> bool:
        """Whether a write or read is in flight (`poll` has work)."""
        return bool(self._writes or self._reads)

    def staged_bytes(self) -> int:
        """Pinned bytes held for writes the store does not have yet."""
        return sum(staged.nbytes for staged in self._writes.values())

    def writing(self, object_id: int) -> bool:
        return object_id in self._writes

    def reading(self, object_id: int) -> bool:
        return object_id in self._reads

    def write(self, object_id: int, host: torch.Tensor, nbytes: int, copied: Any = None) -> float:
        """Writes the first `nbytes` of `host` (pinned host memory) as the object once `copied`
        (the CUDA event of the copy that fills `host`; None: it is filled) has completed. The
        tier keeps `host` until the store has it. Returns the seconds spent waiting: for the
        object's previous write, and for writes in flight past `staging_bytes`."""
        waited = self.wait_write(object_id)
        self._writes[object_id] = _Staged(host, nbytes, copied)
        self.written.add(object_id)
        self.poll()
        if self.staging_bytes is not None and self.staged_bytes() > self.staging_bytes:
            # Staging must not outgrow host memory when the disk is slower than the writes.
            for earlier in list(self._writes):
                waited += self.wait_write(earlier)
        return waited

    def read(self, object_id: int, host: torch.Tensor, nbytes: int, arrived: Callable[[], None]) -> float:
        """Reads the object into `host` (pinned host memory), after its write; `arrived` runs
        once the bytes are in (at a `poll`, or in `wait_read`), where the caller copies them on.
        Returns the seconds spent waiting for its write."""
        waited = self.wait_write(object_id, urgent=True) + self.wait_read(object_id)
        handle = self.store.start_get(object_id, host, nbytes, urgent=True)
        self._reads[object_id] = _Staged(host, nbytes, handle=handle, arrived=arrived)
        return waited

    def poll(self) -> None:
        """Moves the work along without blocking: starts the writes whose buffer is filled, lets
        go of the buffers of finished writes, runs `arrived` for the reads that are in. Raises
        the error of a write or read that failed."""
        for object_id, staged in list(self._writes.items()):
            if staged.handle is None:
                if staged.copied is not None and not staged.copied.query():
                    continue
                staged.handle = self.store.start_put(object_id, staged.host, staged.nbytes)
            if staged.handle.is_done():
                del self._writes[object_id]
                staged.handle.wait()
        for object_id, staged in list(self._reads.items()):
            if staged.handle is not None and staged.handle.is_done():
                del self._reads[object_id]
                staged.handle.wait()
                assert staged.arrived is not None
                staged.arrived()

    def wait_write(self, object_id: int, urgent: bool = False) -> float:
        """Waits until the store has the object's write in flight, if any (started now, after
        its copy, where it was not yet); returns the seconds spent waiting."""
        staged = self._writes.pop(object_id, None)
        if staged is None:
            return 0.0
        started = time.perf_counter()
        if staged.handle is None:
            if staged.copied is not None:
                staged.copied.synchronize()
            staged.handle = self.store.start_put(object_id, staged.host, staged.nbytes, urgent=urgent)
        staged.handle.wait()
        return time.perf_counter() - started

    def wait_read(self, object_id: int, arrive: bool = True) -> float:
        """Waits for the object's read in flight, if any, then runs its `arrived` (not where
        `arrive` is False: the caller takes the bytes from the buffer itself); returns the
        seconds spent waiting."""
        staged = self._reads.pop(object_id, None)
        if staged is None:
            return 0.0
        assert staged.handle is not None and staged.arrived is not None
        started = time.perf_counter()
        staged.handle.wait()
        waited = time.perf_counter() - started
        if arrive:
            staged.arrived()
        return waited

    def flush(self) -> float:
        """Waits for every write in flight; returns the seconds spent waiting."""
        return sum(self.wait_write(object_id) for object_id in list(self._writes))

    def delete(self, object_id: int) -> None:
        """Deletes the object from the store, once its write in flight is done."""
        self.wait_write(object_id)
        if object_id in self.written:
            self.written.discard(object_id)
            if not self.store.closed:
                self.store.delete(object_id)

    def close(self) -> None:
        """Waits for every write and read in flight (their buffers go back only then) and
        deletes every object the tier wrote."""
        self.flush()
        for object_id in list(self._reads):
            self.wait_read(object_id, arrive=False)
        for object_id in sorted(self.written):
            self.delete(object_id)
