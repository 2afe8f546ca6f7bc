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
