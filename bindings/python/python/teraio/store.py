"""The teraio store from Python: put/get torch tensors, numpy arrays and bytes.

Host memory (numpy arrays, CPU tensors, pinned tensors) goes to the engine by address, with no
copy on the Python side: the engine reads or writes it in place (straight to the disk with
O_DIRECT when the address and length are aligned to the store's block size, through the engine's
bounce pool otherwise). CUDA tensors go through the engine's GPU path by device address: its
pinned bounce slab with overlapped copies, or cuFile (GPUDirect Storage, or its compatibility
mode), whichever `gpu=` asks for; `Store.gpu_report()` says which one runs and why, and
`teraio.gpu_probe()` what the machine offers. There is no Python-side staging copy.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from . import _native

if TYPE_CHECKING:  # pragma: no cover
    import numpy
    import torch

PathLike = Union[str, "os.PathLike[str]"]


# struct-module format characters of plain data (no Python objects, no pointers), and the
# byte-order prefixes and repeat counts that may come with them.
_PLAIN_FORMAT_CHARS = frozenset("bBhHiIlLqQnNefdc?xs@=<>!0123456789")


def _numpy_address(array: numpy.ndarray, writable: bool) -> tuple[int, int]:
    if array.dtype.hasobject:
        # Its bytes are pointers to Python objects: stored, they would come back as dangling ones.
        raise _native.InvalidArgumentError(
            f"numpy arrays of dtype {array.dtype} hold Python object pointers, not data; "
            "convert to a numeric dtype (or bytes) first"
        )
    if not array.flags["C_CONTIGUOUS"]:
        raise _native.InvalidArgumentError("numpy array must be C-contiguous (use numpy.ascontiguousarray)")
    if writable and not array.flags["WRITEABLE"]:
        raise _native.InvalidArgumentError("numpy array is read-only")
    return int(array.__array_interface__["data"][0]), int(array.nbytes)


def _tensor_address(tensor: torch.Tensor) -> tuple[int, int]:
    if not tensor.is_contiguous():
        raise _native.InvalidArgumentError("tensor must be contiguous (use .contiguous())")
    return int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size())


def _is_tensor(value: Any) -> bool:
    torch = _torch_or_none()
    return torch is not None and isinstance(value, torch.Tensor)


def _torch_or_none() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional for the store
        return None
    return torch


def _cuda_index(tensor: torch.Tensor) -> int:
    index = tensor.device.index
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return int(index)


def gpu_probe() -> str:
    """What this machine offers for GPU I/O: CUDA driver, devices, cuFile and its mode."""
    return _native.gpu_probe()


class Handle:
    """An I/O in flight: `wait()` blocks (without the GIL) and raises the engine's error, if any.

    A handle keeps the memory it reads or writes alive until the I/O is done; for a CUDA tensor,
    done means the bytes are in GPU memory (get) or on the store (put). The handle of a CUDA
    tensor's op can also make a CUDA stream wait for it on the GPU (`enqueue_stream_wait`).
    """

    def __init__(self, native: _native.Handle, cuda_device: Optional[int] = None) -> None:
        self._native = native
        self._cuda_device = cuda_device  # the op's CUDA device; None for host memory

    def enqueue_stream_wait(self, stream: torch.cuda.Stream) -> None:
        """Makes `stream` (a `torch.cuda.Stream` of the op's device) wait for the op on the GPU:
        kernels queued on it after this call run once the op has finished (a get's data is in
        place, a put's source is no longer read). The CPU waits only until the op's own GPU work
        is queued (a get: its bytes are read from the store and their copies to the GPU queued),
        never for that work: a stream made to wait for GPU work queued after it could hold that
        work up (CUDA does not see the order) and hang. The op's outcome still comes from
        `wait()`: the stream goes on after a failed op too, whose data must not be used. Raises
        InvalidArgumentError for a host op's handle or a stream of another device, and the op's
        error for one the engine refused when it started."""
        if self._cuda_device is None:
            raise _native.InvalidArgumentError(
                "only the handle of a CUDA tensor's put or get can make a CUDA stream wait; "
                "wait for a host op with wait()"
            )
        self._native.enqueue_stream_wait(_stream_handle(stream, self._cuda_device))

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Waits until done; returns False if `timeout_s` passed first. Raises the op's error
        (TeraioError subclasses), including one the engine gave when the op was started: no
        space, not found, metadata too large, a read-only store."""
        return self._native.wait(timeout_s)

    def is_done(self) -> bool:
        """True once the I/O has completed; never blocks."""
        return self._native.is_done()

    @property
    def object_len_bytes(self) -> Optional[int]:
        """A get: the length of the object version it reads. The get fixes that version when it
        starts and returns its bytes alone, even if the object is replaced meanwhile; into a
        buffer longer than the object, this many leading bytes were filled. None for a put."""
        return self._native.object_len_bytes

    def __repr__(self) -> str:
        return repr(self._native)


class Store:
    """A teraio store on one or more devices (files on ext4/xfs, or block devices).

    Use `Store.create(paths, file_size_bytes=...)` for a new store and `Store.open(paths)` for an
    existing one; `close()` (or a `with` block) releases the devices.
    """

    def __init__(self, native: _native.Store) -> None:
        self._native = native

    @classmethod
    def create(cls, paths: Union[PathLike, Sequence[PathLike]], **options: Any) -> Store:
        """Formats `paths` as one store and opens it.

        Keyword arguments are the store options of `teraio.STORE_OPTIONS` (the engine's one
        table of them, listed in docs/python.md, "Store options"), format and open ones; an
        unknown name or a value of the wrong kind raises InvalidArgumentError naming it. Missing
        files are created with `file_size_bytes`. `durable=False` skips the flushes that make
        each put survive power loss (spilled activations need no durability); `direct_io=False`
        is for file systems without O_DIRECT; `emulate="6.5GB/s@20us"` makes every device behave
        like an SSD of that bandwidth and latency; `gpu` picks the path for CUDA tensors;
        `verify_checksums` (on by default) raises CorruptError instead of returning damaged data.
        Sizes take ints or strings such as `"64MiB"`.
        """
        return cls(_native.Store.create(_path_list(paths), **options))

    @classmethod
    def open(
        cls, paths: Union[PathLike, Sequence[PathLike]], read_only: bool = False, **options: Any
    ) -> Store:
        """Opens the store on `paths` (every device of it, in any order). Keyword arguments are
        the open-stage options of `teraio.STORE_OPTIONS`, as in `create`.

        With `read_only=True` the store is opened for reading beside a writer that may hold it
        (under a shared lock, writing nothing, repairing nothing): gets, `stat`, `list` and
        `info` work, and puts and deletes raise InvalidArgumentError. Of a store a writer is
        changing, it sees the objects as they were at one moment during the open."""
        if not isinstance(read_only, bool):
            raise _native.InvalidArgumentError(f"read_only must be True or False, not {read_only!r}")
        opener = _native.Store.open_read_only if read_only else _native.Store.open
        return cls(opener(_path_list(paths), **options))

    # -- writes -----------------------------------------------------------------------------

    def put_async(
        self,
        object_id: int,
        data: Any,
        meta: Optional[bytes] = b"",
        urgent: bool = False,
        after: Optional[torch.cuda.Event] = None,
    ) -> Handle:
        """Starts writing `data` (torch tensor, numpy array, bytes-like) as object `object_id`,
        with `meta` (bytes-like, at most the store's `max_meta_bytes`; None for none).

        Host memory is written in place: do not change it until the handle is done. A CUDA tensor
        goes through the engine's GPU path; this call first waits for the work queued on the
        current CUDA stream (the tensor's producer), then the engine reads it on its own streams.
        With `after` (a `torch.cuda.Event` recorded after the tensor's producer) this call does
        not wait: the engine starts reading once the event has completed, waiting for it on its
        own thread. The event is taken as recorded at the call (it may be recorded again right
        after); one never recorded has nothing to wait for, as in CUDA. `after` is for CUDA
        tensors only (InvalidArgumentError otherwise).
        Argument mistakes (an id, a type) raise InvalidArgumentError here; what the engine
        refuses (NoSpaceError, metadata too large, a read-only or closing store) is raised by
        the handle's `wait()`.
        """
        urgent = _flag("urgent", urgent)
        event = _event_handle(after)
        if _is_tensor(data) and data.device.type == "cuda":
            return self._cuda(True, object_id, data, meta, urgent, event)
        _host_only(after, None, data)
        address, length, owner = _host_memory(data, writable=False)
        return Handle(self._native.put_address(object_id, address, length, owner, meta, urgent))

    def put(self, object_id: int, data: Any, meta: Optional[bytes] = b"") -> None:
        """Writes `data` as object `object_id` and waits until the engine acknowledges it."""
        self.put_async(object_id, data, meta).wait()

    # -- reads ------------------------------------------------------------------------------

    def get_async(
        self,
        object_id: int,
        out: Any,
        urgent: bool = False,
        after: Optional[torch.cuda.Event] = None,
        stream: Optional[torch.cuda.Stream] = None,
    ) -> Handle:
        """Starts reading object `object_id` into `out` (torch tensor, writable numpy array or
        writable bytes-like object such as a bytearray), which must be at least as large as the
        object. Do not use `out` until the handle is done. A CUDA tensor is filled through the
        engine's GPU path (after the work already queued on the current CUDA stream, which may
        still be using it: this call waits for it).

        For CUDA tensors only (InvalidArgumentError otherwise): with `after` (a
        `torch.cuda.Event` recorded after the last work that uses `out`) this call does not wait
        for the current stream; the engine starts writing `out` once the event has completed (as
        `put_async`). With `stream` (a `torch.cuda.Stream` of the tensor's device), the get's
        completion is enqueued on that stream (`Handle.enqueue_stream_wait`): kernels queued on
        it after this call see the data, and the CPU waits only until the bytes are read and
        their copies queued, not for the copies. The handle still tells the outcome: the data is
        good only if its `wait()` succeeds.

        The get reads one version of the object, whole, even if another thread replaces it
        meanwhile; `handle.object_len_bytes` is that version's length. A wrong `out` raises
        InvalidArgumentError here; NotFoundError, a too small `out` (InvalidArgumentError) and
        CorruptError are raised by the handle's `wait()`."""
        urgent = _flag("urgent", urgent)
        event = _event_handle(after)
        if stream is not None:
            _check_stream_type(stream)
        if _is_tensor(out) and out.device.type == "cuda":
            # Checked before the get starts: a refused stream leaves no get running.
            wait_on = None if stream is None else _stream_handle(stream, _cuda_index(out))
            handle = self._cuda(False, object_id, out, None, urgent, event)
            if wait_on is not None:
                handle._native.enqueue_stream_wait(wait_on)
            return handle
        _host_only(after, stream, out)
        address, length, owner = _host_memory(out, writable=True)
        return Handle(self._native.get_address(object_id, address, length, owner, urgent=urgent))

    def get(self, object_id: int, out: Any) -> Any:
        """Reads object `object_id` into `out` and returns `out`."""
        self.get_async(object_id, out).wait()
        return out

    def get_bytes(self, object_id: int) -> bytes:
        """Reads the whole object into new bytes: one version of it, whole (its length and its
        bytes come from the same version, even if another thread replaces it meanwhile)."""
        return self._native.get_bytes(object_id)

    def gpu_report(self) -> Optional[str]:
        """The GPU path this store uses for CUDA tensors and why (None before the first one)."""
        return self._native.gpu_report()

    # -- metadata ---------------------------------------------------------------------------

    def delete(self, object_id: int) -> bool:
        """Deletes the object; returns whether it existed."""
        return self._native.delete(object_id)

    def delete_many(self, object_ids: Sequence[int]) -> list[bool]:
        """Deletes the objects in one journal batch; returns whether each existed. A store whose
        object table outgrew a checkpoint slot under an earlier release commits deletes only as
        a batch that brings the table under the slot (its NoSpaceError says so): this makes one."""
        return self._native.delete_many(list(object_ids))

    def stat(self, object_id: int) -> Optional[dict[str, Any]]:
        """The object's `id`, `len_bytes`, `meta`, `devices`, `extent_count`, or None."""
        return self._native.stat(object_id)

    def list(self) -> list[dict[str, Any]]:
        """Every object, as `stat` dicts."""
        return self._native.list()

    def info(self) -> dict[str, Any]:
        """Layout, devices and backend of the store; how full its object table is
        (`table_bytes` of `checkpoint_slot_bytes`: once full, puts that add objects or metadata
        raise NoSpaceError while deletes still succeed); and what the open found and repaired
        (`recovery_problems`, `recovery_notes`, `repairs_at_open`: lists of lines)."""
        return self._native.info()

    def stats(self) -> dict[str, Any]:
        """Device I/O totals since open (`read_bytes`, `write_bytes`, ops, errors, backend)."""
        return self._native.stats()

    def stats_text(self) -> str:
        """The engine's counters (ops, bytes, latency percentiles), for logs."""
        return self._native.stats_text()

    @property
    def block_size(self) -> int:
        """Host buffers aligned to this (address and length) go to the disk without a copy."""
        return self._native.block_size()

    @property
    def closed(self) -> bool:
        return self._native.is_closed()

    def close(self) -> None:
        """Closes the store: calls started after this raise ClosedError; calls already running in
        other threads are waited for (each is one put, get, delete or lookup, so the wait ends
        when they do), then the I/O in flight, then a checkpoint is written and the devices are
        released. Idempotent."""
        self._native.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the offload runtime's movers -------------------------------------------------------

    def start_put(
        self,
        object_id: int,
        memory: Any,
        nbytes: int,
        urgent: bool = False,
        after: Optional[torch.cuda.Event] = None,
    ) -> Handle:
        """Starts writing the first `nbytes` of `memory` (a contiguous torch tensor: host memory
        through the engine's host path, CUDA memory through its GPU path) as object `object_id`.
        Unlike `put_async` it never waits for the current CUDA stream: the caller has ordered
        the write after the tensor's producer, or passes `after` (CUDA memory only, as in
        `put_async`). Keep `memory` unchanged and alive until the handle is done."""
        return self._start(True, object_id, memory, nbytes, urgent, after)

    def start_get(
        self,
        object_id: int,
        memory: Any,
        nbytes: int,
        urgent: bool = False,
        after: Optional[torch.cuda.Event] = None,
    ) -> Handle:
        """Starts reading the whole object `object_id` (`nbytes` long) into the start of `memory`
        (as `start_put`): the caller has ordered the read after every use of the memory, or
        passes `after` (CUDA memory only). Do not use `memory` until the handle is done (for
        CUDA memory: make the stream that uses it wait with `Handle.enqueue_stream_wait`)."""
        return self._start(False, object_id, memory, nbytes, urgent, after)

    def _cuda(
        self, put: bool, object_id: int, tensor: torch.Tensor, meta: Optional[bytes], urgent: bool, event: Any
    ) -> Handle:
        """`put_async` (`put`) or `get_async` of a whole CUDA tensor. Without `after` the engine,
        which copies on its own CUDA streams, needs whatever produces (or reads) the tensor done:
        the current stream is synchronized first."""
        import torch

        address, length = _tensor_address(tensor)
        if event is None:
            torch.cuda.current_stream(tensor.device).synchronize()
        extra = {"meta": meta} if put else {}
        return self._device_call(put, object_id, address, length, tensor, extra, urgent, event)

    def _device_call(
        self,
        put: bool,
        object_id: int,
        address: int,
        nbytes: int,
        memory: Any,
        extra: dict[str, Any],
        urgent: bool,
        event: Any,
    ) -> Handle:
        """The engine's GPU path: `put_device` or `get_device` of CUDA memory at `address`."""
        index = _cuda_index(memory)
        call = self._native.put_device if put else self._native.get_device
        native = call(
            object_id, address, nbytes, index, memory, urgent=urgent, after=_after_handle(event), **extra
        )
        return Handle(native, index)

    def _start(self, put: bool, object_id: int, memory: Any, nbytes: int, urgent: bool, after: Any) -> Handle:
        """`start_put` (`put`) or `start_get`: the engine call by the memory's device, its GPU path
        for CUDA memory and its host path otherwise."""
        event = _event_handle(after)
        address = _start_address(memory, nbytes)
        meta = {"meta": b""} if put else {}
        if memory.device.type == "cuda":
            return self._device_call(put, object_id, address, nbytes, memory, meta, urgent, event)
        _host_only(after, None, memory)
        host_call = self._native.put_address if put else self._native.get_address
        return Handle(host_call(object_id, address, nbytes, memory, urgent=urgent, **meta))


def _host_memory(data: Any, writable: bool) -> tuple[int, int, Any]:
    """The address, length and owner of host memory to put from or get into (`writable`): a CPU
    tensor, a numpy array, or a bytes-like object (its buffer, through numpy)."""
    if _is_tensor(data):
        if data.device.type != "cpu":
            raise _native.InvalidArgumentError(
                f"tensors on {data.device} are not supported (cpu and cuda are)"
            )
        address, length = _tensor_address(data)
        return address, length, data
    import numpy

    if isinstance(data, numpy.ndarray):
        address, length = _numpy_address(data, writable=writable)
        return address, length, data
    array = _plain_bytes(data, writable=writable)
    return int(array.__array_interface__["data"][0]), int(array.nbytes), array


class _Event:
    """A `torch.cuda.Event` passed as `after`, with its CUDA handle read at the call (0: never
    recorded)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle


def _event_handle(after: Any) -> Optional[_Event]:
    """`after` checked: None, or a `torch.cuda.Event`."""
    if after is None:
        return None
    torch = _torch_or_none()
    if torch is None or not isinstance(after, torch.cuda.Event):
        raise _native.InvalidArgumentError(
            f"after must be a torch.cuda.Event recorded after the work the op must follow, or None; "
            f"not {type(after).__name__}"
        )
    return _Event(int(after.cuda_event))


def _after_handle(event: Optional[_Event]) -> Optional[int]:
    """The engine's `after`: the event's handle, or None for no event or one never recorded
    (CUDA waits for nothing on such an event)."""
    if event is None or event.handle == 0:
        return None
    return event.handle


def _check_stream_type(stream: Any) -> None:
    torch = _torch_or_none()
    if torch is None or not isinstance(stream, torch.cuda.Stream):
        raise _native.InvalidArgumentError(
            f"stream must be a torch.cuda.Stream (e.g. torch.cuda.current_stream()) or None; "
            f"not {type(stream).__name__}"
        )


def _stream_handle(stream: Any, device: int) -> int:
    """The CUstream of `stream`, a `torch.cuda.Stream` of CUDA device `device`."""
    _check_stream_type(stream)
    if stream.device.index != device:
        raise _native.InvalidArgumentError(
            f"stream is on {stream.device} but the op is on cuda:{device}; "
            "use a stream of the tensor's device"
        )
    return int(stream.cuda_stream)


def _host_only(after: Any, stream: Any, memory: Any) -> None:
    """Refuses `after` and `stream` for an op on host memory, which the engine does not order
    against CUDA work."""
    for name, value in (("after", after), ("stream", stream)):
        if value is not None:
            raise _native.InvalidArgumentError(
                f"{name}= applies to CUDA tensors only, not to {type(memory).__name__} in host "
                "memory: synchronize the CUDA work first (e.g. event.synchronize()) and leave it out"
            )


def _flag(name: str, value: Any) -> bool:
    """A bool argument, refused with InvalidArgumentError when it is anything else."""
    if not isinstance(value, bool):
        raise _native.InvalidArgumentError(f"{name} must be True or False, not {value!r}")
    return value


def _plain_bytes(data: Any, writable: bool) -> numpy.ndarray:
    """A uint8 view of a bytes-like object whose buffer is contiguous plain data (and writable,
    for a get's destination)."""
    import numpy

    try:
        view = memoryview(data)
    except TypeError:
        if writable:
            raise _native.InvalidArgumentError(
                f"cannot read into a {type(data).__name__}: give a torch tensor, a writable numpy array "
                "or a writable bytes-like object (bytearray)"
            ) from None
        raise _native.InvalidArgumentError(
            f"cannot store a {type(data).__name__}: give a torch tensor, a numpy array or a bytes-like object"
        ) from None
    if writable and view.readonly:
        raise _native.InvalidArgumentError(
            f"cannot read into a read-only {type(data).__name__}: give a bytearray, a writable numpy array "
            "or a torch tensor"
        )
    if not set(view.format) <= _PLAIN_FORMAT_CHARS:
        raise _native.InvalidArgumentError(
            f"buffer of format {view.format!r} is not plain numeric data (it may hold Python objects or "
            "pointers); pass bytes or a numpy array of a numeric or structured dtype"
        )
    if not view.c_contiguous:
        raise _native.InvalidArgumentError("buffer must be C-contiguous")
    return numpy.frombuffer(view.cast("B"), dtype=numpy.uint8)


def _path_list(paths: Union[PathLike, Sequence[PathLike]]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    try:
        return [os.fspath(p) for p in paths]
    except TypeError:
        raise _native.InvalidArgumentError(
            f"paths must be a path or a sequence of paths (str or os.PathLike), not {paths!r}"
        ) from None


def _start_address(memory: torch.Tensor, nbytes: int) -> int:
    """The address of `memory`, which must hold at least `nbytes` contiguous bytes."""
    address, length = _tensor_address(memory)
    if nbytes > length:
        raise ValueError(f"{nbytes} bytes asked of a tensor of {length}")
    return address


#: The engine's error when the store's devices are full (the offload runtime raises it too).
NoSpaceError = _native.NoSpaceError
