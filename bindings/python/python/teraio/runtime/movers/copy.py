"""Copies between GPU memory and pinned host memory, on side streams, and the byte views they copy."""

from __future__ import annotations

from typing import Any

import torch


def pinned_size(nbytes: int) -> int:
    """What a pinned buffer of `nbytes` takes: PyTorch's caching host allocator rounds each
    block up to a power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


def pinned_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A host buffer of `nbytes` (flat bytes): pinned for CUDA copies (`pinned`), plain memory
    for a CPU "device", whose copies are synchronous."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def copy_now(target: Any, source: Any) -> None:
    """The CPU "device"'s copy between its memory and a host buffer: synchronous, in order."""
    target.copy_(source)


def device_index(device: torch.device) -> int:
    return int(device.index) if device.index is not None else int(torch.cuda.current_device())


def join_copy(device: torch.device, event: Any) -> None:
    """Orders the compute stream after a copy into memory it is about to get back."""
    torch.cuda.current_stream(device).wait_event(event)


def copy_on_stream(
    stream: Any,
    device: torch.device,
    target: Any,
    source: Any,
    after: Any = None,
    chunk_bytes: int = 0,
) -> Any:
    """Copies `source` into `target` (tensors, or untyped storages of one size) on a side stream
    once the compute work queued so far (and the copy event `after`, if given: the other
    direction's copy of the same bytes) is done; returns the copy's CUDA event. The caller
    decides how the memory outlives the copy (`record_stream`, or compute waiting on the event).
    `chunk_bytes` > 0 (flat byte tensors only): one copy per chunk, so copies queued on other
    streams can run between them."""
    if chunk_bytes > 0 and target.numel() > chunk_bytes:
        starts = range(0, target.numel(), chunk_bytes)
        pairs = [(target[s : s + chunk_bytes], source[s : s + chunk_bytes]) for s in starts]
    else:
        pairs = [(target, source)]
    return copies_on_stream(stream, device, pairs, [after] if after is not None else [])


def copies_on_stream(
    stream: Any, device: torch.device, pairs: list[tuple[Any, Any]], after: list[Any]
) -> Any:
    """`copy_on_stream` for several (target, source) pairs at once, after every event in
    `after`: one stream ordering and one event for all of them."""
    stream.wait_stream(torch.cuda.current_stream(device))
    for event in after:
        stream.wait_event(event)
    with torch.cuda.stream(stream):
        for target, source in pairs:
            target.copy_(source, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage of `tensor` as one flat byte tensor (views share it)."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat
