"""FSDP2 (`torch.distributed.fsdp.fully_shard`) under `teraio.offload`: one store per rank.

What changes for a sharded model, and where teraio meets it:

- Parameters, their gradients and the optimizer state are DTensors whose rank-local shard is
  `_local_tensor`. A DTensor's own `untyped_storage()` is a wrapper's (the global size, no data
  pointer), so everything that moves or records memory works on `local_tensor(t)`: the state
  executor moves the shard's storage (`resize_(0)` and back on the local tensor; the DTensor
  the optimizer holds wraps that same tensor), the profiler records the shard.
- In forward and backward FSDP all-gathers each block's parameters into unsharded parameters
  (plain `nn.Parameter`s over a buffer it frees with `storage.resize_(0)` when it reshards) and
  reduce-scatters their gradients. The tensors autograd saves for them (the weight, or a view of
  it such as `weight.t()`) are FSDP's to free and gather again: the executor keeps them
  (`is_parameter_memory`), and the profiler records the buffer as a temporary that dies when FSDP
  frees it (`UnshardedTracker`), so the plan sees FSDP's all-gather memory come and go.
- teraio changes no FSDP hook or order: every rank runs the same FSDP collectives in the same
  order whatever its plan. It issues two collectives of its own, each once and at the same point
  on every rank: the ranks measure the machine together at the start (`teraio.machine`), and the
  block plan's ranks exchange their predictions when they plan (`exchange`), at the end of the
  last measuring step, which every rank reaches at the same step whatever its budget.
- The block plan (`teraio.runtime.modes.block`, the default for models with repeated blocks) runs under
  FSDP2 as activation checkpointing does in torchtitan: a block's checkpoint sits inside the
  FSDP module's forward, and its recomputation runs in backward after FSDP's pre-backward hook
  has gathered the block's parameters (FSDP's forward hooks do not run again). So one rank may
  recompute a block that another keeps or copies to host memory, with the same collectives.
  Its host copies leave FSDP's gathered parameters alone (`is_parameter_memory`).
- Refused (`adapt_options`): a model sharded with FSDP's `CPUOffloadPolicy` (its shards live on
  the host: teraio would take the CPU for the device); whole-model mode (and its `step_in_backward`) and
  `offload_parameters` (FSDP owns the parameters: it gathers and frees them), `recompute="on"`
  (the tensor plan's per-op recomputation reads FSDP-owned memory at a point of teraio's
  choosing); `recompute="auto"` means "off". The tensor plan (`granularity="tensor"`) runs
  without block checkpointing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .options import OffloadOptions

#: What the no-fit errors tell an FSDP2 user to do (`Session._refuse_resident_overflow`, the
#: block plan's `NoPlanFitsError`): whole-model mode, their remedy on one GPU, is refused here.
NO_FIT_REMEDY = (
    "shard over more ranks or raise gpu_memory (under FSDP2 the parameters and their gradients "
    "stay on the GPU: FSDP gathers and frees them, and whole-model mode, which moves them, is not "
    "supported there)"
)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (the one that owns memory); any other tensor as is."""
    if type(tensor) is torch.Tensor:
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return tensor if local is None else local


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """The rank-local bytes of the model's parameters, and of the gradients its trained ones get
    (one per trained parameter, of its size): what stays on the GPU through an iteration."""
    # Whether a parameter is trained is the DTensor's to say: its local shard has no autograd.
    shards = [(local_tensor(p), p.requires_grad) for p in model.parameters()]
    params = sum(shard.untyped_storage().nbytes() for shard, _ in shards)
    grads = sum(shard.untyped_storage().nbytes() for shard, trained in shards if trained)
    return params, grads


def is_parameter_memory(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a parameter or a view of one (`weight.t()` saved by a linear layer):
    its memory is the parameter's, which a saved-tensor hook must leave alone (under FSDP2 the
    unsharded parameters are freed and gathered again by FSDP itself)."""
    if type(tensor) is not torch.Tensor and isinstance(tensor, torch.nn.Parameter):
        return True
    base = tensor._base
    return base is not None and type(base) is not torch.Tensor and isinstance(base, torch.nn.Parameter)


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules `fully_shard` was applied to (empty: not an FSDP2 model)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed support
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    return bool(fsdp_modules(model))


def offloaded_by_fsdp(model: torch.nn.Module) -> bool:
    """Whether FSDP2 keeps the shards off the device its mesh computes on (`fully_shard(...,
    offload_policy=CPUOffloadPolicy())`): a DTensor parameter whose local tensor is not on its
    mesh's device type."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and mesh.device_type != local_tensor(param).device.type:
            return True
    return False


def adapt_options(model: torch.nn.Module, options: OffloadOptions) -> OffloadOptions:
    """The options an FSDP2 model runs with (see the module docstring); others unchanged."""
    if not is_sharded(model):
        return options
    if offloaded_by_fsdp(model):
        raise ValueError(
            "teraio.offload on an FSDP2 model sharded with offload_policy=CPUOffloadPolicy() is not "
            "supported: FSDP then keeps the parameters, gradients and optimizer state in host memory "
            "and teraio would plan for the CPU as the device. Shard without an offload policy: teraio "
            "offloads the activations and the optimizer state"
        )
    refused = []
    if options.whole_model == "on":
        refused.append("whole_model='on'")
    if options.step_in_backward is True:
        refused.append("step_in_backward=True")
    if options.recompute == "on":
        refused.append("recompute='on'")
    if options.offload_parameters:
        refused.append("offload_parameters=True")
    if options.granularity == "tensor" and options.checkpoint not in (None, "off"):
        refused.append(f"checkpoint={options.checkpoint!r} with granularity='tensor'")
    if refused:
        raise ValueError(
            f"teraio.offload on an FSDP2 (fully_shard) model does not support {', '.join(refused)}: "
            "FSDP owns the parameters (it gathers and frees them). Leave these options at their "
            "defaults: activations (kept, recomputed per block or copied out) and optimizer "
            "state are offloaded"
        )
    checkpoint = "off" if options.granularity == "tensor" else options.checkpoint
    return options.replace(whole_model="off", step_in_backward=False, recompute="off", checkpoint=checkpoint)


def rank_notes() -> dict[str, Any]:
    """The process's rank and world size where a process group is up (for the report)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return {}
    return {"rank": torch.distributed.get_rank(), "world_size": torch.distributed.get_world_size()}


def exchange(value: Any) -> Optional[list[Any]]:
    """Every rank's `value` in rank order, where a process group of more than one rank is up
    (else None): one `all_gather_object` over the default group. Every rank must call it at the
    same point of its collectives, once (it sits between FSDP's, which wait on it)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    world = torch.distributed.get_world_size()
    if world < 2:
        return None
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, value)
    return gathered


class UnshardedTracker:
    """Watches the buffers FSDP2 gathers parameters into, for the profiler: FSDP frees them by
    shrinking their storage to zero bytes, which no op and no weak reference shows."""

    def __init__(self, fsdp_params: list[Any]) -> None:
        self.fsdp_params = fsdp_params
        # Buffer -> data pointer while it holds bytes (an address freed memory may be handed out
        # again, so a freed buffer's record must die before that address is looked up).
        self._held: dict[int, int] = {}

    @classmethod
    def for_model(cls, model: Optional[torch.nn.Module]) -> Optional[UnshardedTracker]:
        if model is None:
            return None
        params = []
        for module in fsdp_modules(model):
            state = module._get_fsdp_state()  # type: ignore[operator]
            # torch 2.15 keeps a list of parameter groups per state; 2.11 one group (or None).
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            params.extend(p for group in groups for p in group.fsdp_params)
        return cls(params) if params else None

    def freed(self) -> list[int]:
        """Data pointers of the buffers freed since the last call."""
        out = []
        for index, fsdp_param in enumerate(self.fsdp_params):
            for slot, buffer in enumerate(getattr(fsdp_param, "all_gather_outputs", ())):
                key = index * 8 + slot
                storage = buffer.untyped_storage()
                pointer = storage.data_ptr() if storage.nbytes() > 0 else None
                before = self._held.pop(key, None)
                if before is not None and before != pointer:
                    out.append(before)  # freed (and perhaps gathered again elsewhere) since
                if pointer is not None:
                    self._held[key] = pointer
        return out
