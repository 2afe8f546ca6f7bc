"""Frozen Linear weights held on the GPU in the dtype autocast computes them in.

Under autocast a Linear layer's matmul reads its weight cast to the autocast dtype (bf16 or fp16).
For a trained weight autocast caches that cast for the forward pass; a frozen one
(`requires_grad=False`: the base weights under LoRA) is cast again at each use, and the matmul
saves the cast for backward, so each block's saved tensors hold a compute-dtype copy of its frozen
weights beside the fp32 weights themselves. Holding those weights in the compute dtype instead
gives the same bits (the cast of a tensor already in that dtype is that tensor), frees half of
their GPU memory and every saved copy, and drops the casts.

Which weights: parameters that do not require gradients, in fp32, held only by `torch.nn.Linear`
modules (as `weight` or `bias`) inside the repeated blocks, never a parameter shared with another
kind of module (a tied embedding stays as it is). Their fp32 values (the masters) stay in CPU
memory: the model's `state_dict()` returns them there, `load_state_dict()` updates them as it
loads the rounded values into the copies, and `restore` puts them back on the device.

Each block checks, as its forward starts, that autocast runs with the copies' dtype on the
device: a forward without gradients (evaluation without autocast) runs on the fp32 masters,
brought to the device for that block alone, with a warning (slow but exact); a forward with
gradients would save the copies for a backward that expects fp32 weights, so it is an error.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn import Module


def frozen_linear_parameters(
    model: Module, blocks: list[Module], device: torch.device
) -> list[tuple[Module, str]]:
    """(module, name) of every frozen fp32 parameter on `device` held only by Linear modules inside
    `blocks` (see the module docstring), each once."""
    owners: dict[int, list[Module]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(module)
    found: list[tuple[Module, str]] = []
    seen: set[int] = set()
    for block in blocks:
        for module in block.modules():
            if type(module) is not torch.nn.Linear:
                continue
            for name, param in module._parameters.items():
                if param is None or param.requires_grad or param.dtype != torch.float32 or id(param) in seen:
                    continue
                if param.device != device:
                    continue
                if any(type(owner) is not torch.nn.Linear for owner in owners[id(param)]):
                    continue
                seen.add(id(param))
                found.append((module, name))
    return found


class FrozenCopies:
    """Compute-dtype copies of frozen Linear weights on the device, their fp32 masters in CPU
    memory (see the module docstring)."""

    def __init__(self, device: torch.device, parameters: list[tuple[Module, str]]) -> None:
        self.device = device
        self.parameters = parameters
        self.dtype: torch.dtype = torch.float32
        self.active = False
        #: Device bytes the copies hold less than the fp32 weights did (kept after `restore`).
        self.saved_bytes = 0
        self._masters: dict[int, torch.Tensor] = {}  # id(parameter) -> its fp32 values (CPU)
        self._hooks: list[Any] = []
        self._warned = False

    def install(self, dtype: torch.dtype) -> None:
        """Replaces each weight's data with its `dtype` copy, keeping the fp32 values in CPU memory."""
        assert not self.active and dtype in (torch.bfloat16, torch.float16)
        self.dtype = dtype
        for module, name in self.parameters:
            param = module._parameters[name]
            assert param is not None
            self._masters[id(param)] = param.detach().to("cpu", copy=True)
            param.data = param.data.to(dtype)
            self.saved_bytes += param.numel() * (4 - param.element_size())
        modules = {id(module): module for module, _ in self.parameters}
        for module in modules.values():
            # Partials: torch marks a hook with an attribute, which a bound method cannot take.
            self._hooks.append(module.register_state_dict_post_hook(functools.partial(self._state_dict_hook)))
            self._hooks.append(module.register_load_state_dict_pre_hook(functools.partial(self._load_hook)))
        self.active = True

    def storages(self) -> set[int]:
        """The data pointers of the weights' storages now."""
        found = set()
        for module, name in self.parameters:
            param = module._parameters[name]
            assert param is not None
            found.add(param.untyped_storage().data_ptr())
        return found

    def summary(self) -> dict[str, Any]:
        """What was held in the compute dtype, for the report (empty: nothing was)."""
        if not self.saved_bytes:
            return {}
        dtype = str(self.dtype).removeprefix("torch.")
        return {"dtype": dtype, "parameters": len(self.parameters), "saved_bytes": self.saved_bytes}

    def matches(self) -> bool:
        """Whether autocast runs now, on the device, with the copies' dtype."""
        kind = self.device.type
        return torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == self.dtype

    def _frozen_of(self, module: Module) -> list[tuple[Module, str]]:
        return [(m, name) for m, name in self.parameters if m is module]

    @contextlib.contextmanager
    def masters_in(self, block: Module) -> Iterator[None]:
        """The block's weights hold their fp32 values on the device while inside (a forward
        without gradients and without autocast), their copies again after."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"teraio holds the frozen Linear weights of the model's blocks in {self.dtype} (the "
                "dtype autocast computes them in, found in the first iteration); a forward with "
                f"gradients must run under torch.autocast(dtype={self.dtype}) too, or pass "
                "frozen_compute_copies='off'"
            )
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"teraio: a forward pass without {self.dtype} autocast runs on the frozen weights' "
                "fp32 values, copied to the device block by block (slow)",
                stacklevel=3,
            )
        members = [(m, name) for inner in block.modules() for m, name in self._frozen_of(inner)]
        copies = []
        for module, name in members:
            param = module._parameters[name]
            assert param is not None
            copies.append(param.data)
            param.data = self._masters[id(param)].to(self.device)
        try:
            yield
        finally:
            for (module, name), copy in zip(members, copies):
                param = module._parameters[name]
                assert param is not None
                param.data = copy

    def _state_dict_hook(self, module: Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        for m, name in self._frozen_of(module):
            param = m._parameters[name]
            key = prefix + name
            if param is not None and key in state_dict:
                state_dict[key] = self._masters[id(param)]

    def _load_hook(self, module: Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        # Loading copies the values into the copies (rounded, as autocast would cast them); the
        # masters take them as they are. A value of another shape is left to torch's own error.
        for m, name in self._frozen_of(module):
            param = m._parameters[name]
            value = state_dict.get(prefix + name)
            if param is None or not isinstance(value, torch.Tensor):
                continue
            master = self._masters[id(param)]
            if value.shape == master.shape:
                with torch.no_grad():
                    master.copy_(value)

    def restore(self) -> None:
        """Puts the fp32 values back as the weights' data on the device; where the device has no
        room for them, in CPU memory instead, with a warning."""
        if not self.active:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        left_on_cpu = 0
        for module, name in self.parameters:
            param = module._parameters[name]
            assert param is not None
            master = self._masters.pop(id(param))
            try:
                param.data = master.to(self.device)
            except torch.OutOfMemoryError:
                param.data = master
                left_on_cpu += master.nbytes
        self.active = False
        if left_on_cpu:
            warnings.warn(
                f"teraio: {left_on_cpu} bytes of frozen weights did not fit back on the device at exit "
                "and stay in CPU memory",
                stacklevel=2,
            )
