"""Marks on the compute stream and the time between them: CUDA events on a GPU, host times on a
CPU "device" (where work is synchronous). Used by the runtimes to time phases and blocks without
per-op instrumentation."""

from __future__ import annotations

import time
from typing import Any

import torch


def mark(device: torch.device) -> Any:
    """A mark at this point of `device`'s current stream."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def elapsed_ms(first: Any, second: Any) -> float:
    """Milliseconds between two marks (waits for the second where it is a CUDA event)."""
    if isinstance(first, float):
        return (second - first) * 1e3
    second.synchronize()
    return float(first.elapsed_time(second))


class IterationPeak:
    """Resets the allocator's peak statistics when a training iteration's forward begins (a
    forward pre-hook on the model, `handle`), not when the previous iteration ends. A runtime
    reads its iteration's peak at the step; so can the training loop, with
    `torch.cuda.max_memory_allocated()` after `optimizer.step()`, as it would without teraio
    (reset at the step's end, its read saw nothing of the iteration)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self.armed = False
        self.handle = model.register_forward_pre_hook(self._begin)

    def arm(self) -> None:
        """The iteration ended (or none began yet): reset when the next forward begins."""
        self.armed = self.device.type == "cuda"

    def _begin(self, module: torch.nn.Module, args: Any) -> None:
        if self.armed:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.armed = False
