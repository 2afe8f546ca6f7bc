"""Optimizer state dicts under `teraio.offload`: checkpoints see, and loads keep, the real state.

Between steps teraio holds the optimizer state in host memory or the rank's store and leaves
the optimizer's tensors with zero-byte storages. Through PyTorch's own optimizer hooks, so that a
checkpointing loop needs no change (`optimizer.state_dict()`, `optimizer.load_state_dict()`,
and `torch.distributed.checkpoint`'s `get_state_dict` / `set_state_dict`, which call them):

- before `state_dict()`: the state is brought back to the device (its real bytes are what the
  state dict holds); it leaves again at the next forward pass's first saved tensor, or at the
  next step before the plan. A checkpoint writer must be done reading the state dict before the
  next forward pass (a synchronous `dcp.save`, or `dcp.async_save` once it returns: it stages
  the tensors to host memory first);
- before `load_state_dict()`: the state is brought back as well, and where each tensor sits
  in `optimizer.state` (parameter, key) is noted;
- after it: the tensors the load put in `optimizer.state` (PyTorch may replace the old ones)
  take the old ones' places in teraio's plan; they hold the loaded bytes and leave after the
  next step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from .sharded import local_tensor


def install(run: Any, movers: Optional[tuple[Any, ...]] = None) -> list[Any]:
    """Registers the hooks on `run.optimizer` for a `teraio.offload` run (the tensor plan's, or
    the block plan's with `movers`: its state executors); returns their handles."""
    optimizer: torch.optim.Optimizer = run.optimizer
    movers = movers if movers is not None else (run.fallback_state, run.state)
    # id(local state tensor) -> (parameter, key), noted before a load.
    places: dict[int, tuple[Any, Any]] = {}

    def bring_back() -> None:
        with getattr(run, "_quiet", contextlib.nullcontext)():
            for mover in movers:
                mover.bring_back(out_again=True)

    def before_state_dict(optimizer: torch.optim.Optimizer) -> None:
        bring_back()

    def before_load(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        bring_back()
        places.clear()
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    places[id(local_tensor(value))] = (param, key)

    def after_load(optimizer: torch.optim.Optimizer) -> None:
        replacement: dict[int, torch.Tensor] = {}
        for old, (param, key) in places.items():
            new = optimizer.state.get(param, {}).get(key)
            if isinstance(new, torch.Tensor):
                if not local_tensor(new).untyped_storage().resizable():
                    # Kept as loaded (same device and dtype): it may sit in torch.load's storage,
                    # which cannot be released between steps; the state takes a copy of its own.
                    new = new.clone()
                    optimizer.state[param][key] = new
                replacement[old] = local_tensor(new)
        places.clear()
        for mover in movers:
            mover.retarget(replacement)
        if not hasattr(run, "_state_ids"):
            return
        # The profiled state's tensors, from which a plan made later picks what to move.
        run._state_ids = [
            (replacement.get(id(local_tensor(tensor)), tensor), tensor_id)
            for tensor, tensor_id in run._state_ids
        ]

    return [
        optimizer.register_state_dict_pre_hook(before_state_dict),
        optimizer.register_load_state_dict_pre_hook(before_load),
        optimizer.register_load_state_dict_post_hook(after_load),
    ]
