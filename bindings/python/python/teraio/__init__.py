"""teraio: tensor offload to NVMe SSDs and host memory for PyTorch training.

- `Store`: the engine's tensor-object store (put/get torch tensors, numpy arrays, bytes);
  `STORE_OPTIONS`: the options `Store.create`/`Store.open` take (name, stage, type, default, doc).
- `gpu_probe`: what this machine offers for GPU I/O (CUDA, cuFile, GDS or its compatibility mode).
- `plan`: the lifetime planner on a trace (docs/trace.md); `simulate`: replays a trace under a plan.
- `Profiler`: records training iterations into a trace (needs torch).
- `offload`: profile, plan and offload activations around an unchanged training loop (needs torch);
  `OffloadOptions`: its settings in one object.

Errors are `TeraioError` subclasses carrying the engine's message.
"""

from __future__ import annotations

from typing import Any

from ._native import (
    STORE_OPTIONS,
    TRACE_FORMAT_VERSION,
    ClosedError,
    CorruptError,
    DeviceError,
    InvalidArgumentError,
    LockedError,
    NoSpaceError,
    NotFoundError,
    PlannerError,
    TeraioError,
)
from .options import OffloadOptions
from .planning import parse_size, plan, simulate, validate_trace
from .store import Handle, Store, gpu_probe

__all__ = [
    "STORE_OPTIONS",
    "TRACE_FORMAT_VERSION",
    "ClosedError",
    "CorruptError",
    "DeviceError",
    "Handle",
    "InvalidArgumentError",
    "LockedError",
    "NoSpaceError",
    "NoPlanFitsError",
    "NotFoundError",
    "OffloadOptions",
    "PlannerError",
    "Profiler",
    "Report",
    "Store",
    "TeraioError",
    "offload",
    "parse_size",
    "plan",
    "shard",
    "simulate",
    "gpu_probe",
    "validate_trace",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # torch is imported only when the PyTorch integration is used.
    if name == "Profiler":
        from .profiler import Profiler

        return Profiler
    if name == "Report":
        from .runtime.report import Report

        return Report
    if name in ("offload", "shard", "NoPlanFitsError"):
        from . import runtime as module

        return getattr(module, name)
    raise AttributeError(f"module 'teraio' has no attribute {name!r}")
