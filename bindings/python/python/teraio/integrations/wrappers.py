"""The torch optimizer inside a training library's wrapper, for `teraio.offload` (which takes
either) and the integrations. Imports no library."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a library's wrapper (Accelerate's `AcceleratedOptimizer` and
    Lightning's `LightningOptimizer` hold it as `optimizer` / `_optimizer`): teraio's hooks go on
    the optimizer whose `step` updates the parameters, since the wrapper's step may skip it (an
    accumulation micro-batch) or call it once per real step."""
    seen = 0  # a bound on nesting, against a wrapper that holds itself
    while seen < 8:
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
        seen += 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"teraio: expected a torch.optim.Optimizer (or a wrapper holding one as `.optimizer`), "
            f"got {type(optimizer).__name__}; pass the optimizer your training loop steps"
        )
    return optimizer
