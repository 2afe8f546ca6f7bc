"""Page-locked host memory of exactly the bytes asked for (to a page), for the runtime's host
tier and its probes.

torch's pinned allocator (`pin_memory=True`) rounds each block up to a power of two and keeps
freed blocks cached for the life of the process: a transformer's tensors pinned that way hold
about a third more host memory than their bytes, and a probe's buffers stay pinned after it.
`RegisteredBuffer` registers pageable memory with CUDA instead (`cudaHostRegister`): it holds
its bytes, and gives them back at `release`.
"""

from __future__ import annotations

import mmap
import os
import weakref

import torch

#: Registered host buffers own whole pages: CUDA refuses a registration that overlaps another.
PAGE_BYTES = mmap.PAGESIZE


class RegisteredBuffer:
    """`nbytes` of page-locked host memory (`tensor`, uint8), pinned until `release`. Needs CUDA."""

    __slots__ = ("tensor", "_unpin", "__weakref__")

    def __init__(self, nbytes: int) -> None:
        span = -(-max(nbytes, 1) // PAGE_BYTES) * PAGE_BYTES
        raw = torch.empty(span + PAGE_BYTES, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE_BYTES
        pages = raw[start : start + span]
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(pages.data_ptr(), span, 0)
        if error != cudart.cudaError.success:
            # torch's binding returns the error and leaves it as CUDA's last error, where torch's
            # next kernel launch check would raise it as its own: take it back first.
            _take_last_cuda_error()
            raise MemoryError(f"teraio: pinning {span} bytes of host memory failed (CUDA error {error})")
        self.tensor = pages[:nbytes]
        # Runs once: at `release`, or before the memory goes back where `release` was not called.
        self._unpin = weakref.finalize(self, cudart.cudaHostUnregister, pages.data_ptr())
        self._unpin.atexit = False  # the process's end gives everything back; CUDA may be gone by then

    def release(self) -> None:
        """Unpins and frees the memory; the caller has no copy in flight on it."""
        self._unpin()
        self.tensor = torch.empty(0, dtype=torch.uint8)


def _take_last_cuda_error() -> None:
    """`cudaGetLastError` of the CUDA runtime torch loaded (torch's binding has none)."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL).cudaGetLastError()
            return
        except OSError:
            continue
    raise RuntimeError("teraio: the CUDA runtime torch loaded was not found to clear its error")
