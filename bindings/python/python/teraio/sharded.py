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
- Whole-model offload under FSDP2 is FSDP's own `CPUOffloadPolicy` with teraio's step: FSDP
  keeps each rank's fp32 shards and their gradients in host memory and copies them over for its
  collectives; teraio steps them there with the engine's kernel (`runtime.modes.host_step`)
  and plans the activations on the GPU (`compute_device`: the mesh's device, not the shards').
  teraio cannot move the parameters itself, so a model whose shards do not fit is refused with
  that remedy (`NO_FIT_REMEDY`), not switched to it.
- `teraio.shard` (`runtime.shard`) applies FSDP2 as teraio runs it: `fully_shard` on each
  repeated block, then the root, with `CPUOffloadPolicy` where the rank's share of the training
  state would not fit the GPU and does fit host memory (whole-model mode's thresholds, per
  rank): the one place a model "chooses" host shards, since teraio cannot move FSDP's
  parameters once it is sharded.
- Refused (`adapt_options`): whole-model mode (and its `step_in_backward`, which applies to host
  shards alone: `host_step`'s step in backward) and
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
#: block plan's `NoPlanFitsError`): under FSDP2, whole-model mode (their remedy on one GPU) is
#: FSDP's own host offload with teraio's step (`runtime.modes.host_step`).
HOST_SHARDS_REMEDY = (
    "shard with fully_shard(..., offload_policy=CPUOffloadPolicy()) and pass that "
    "model: FSDP then keeps each rank's parameter shards and their gradients in host memory, "
    "teraio steps them there with its CPU kernel and plans the activations on the GPU "
    "(teraio cannot move parameters FSDP owns: it gathers and frees them)"
)
NO_FIT_REMEDY = HOST_SHARDS_REMEDY + " (`teraio.shard(model)` chooses it); or shard over more ranks"


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (the one that owns memory); any other tensor as is."""
    if type(tensor) is torch.Tensor:
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return tensor if local is None else local


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """The rank-local bytes of the model's parameters, and of the gradients its trained ones get
    (one per trained parameter, of its size): what stays on the GPU through an iteration (none
    of the shards FSDP keeps in host memory)."""
    # Whether a parameter is trained is the DTensor's to say: its local shard has no autograd.
    # Shards FSDP keeps in host memory take no GPU memory between its gathers.
    on_host = {id(p) for p in host_shards(model)}
    shards = [(local_tensor(p), p.requires_grad) for p in model.parameters() if id(p) not in on_host]
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


def fsdp_params(model: torch.nn.Module) -> list[Any]:
    """FSDP2's record of each sharded parameter (its `FSDPParam`), module by module."""
    params = []
    for module in fsdp_modules(model):
        state = module._get_fsdp_state()  # type: ignore[operator]
        # torch 2.15 keeps a list of parameter groups per state; 2.11 one group (or None).
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        params.extend(p for group in groups if group is not None for p in group.fsdp_params)
    return params


def host_shards(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The sharded parameters FSDP2 keeps in host memory (`fully_shard(...,
    offload_policy=CPUOffloadPolicy())`): their shards, gradients and optimizer state live there,
    and the optimizer steps them on the CPU (`runtime.modes.host_step`). Empty: none."""
    return [p.sharded_param for p in fsdp_params(model) if getattr(p, "offload_to_cpu", False)]


def compute_device(model: torch.nn.Module) -> torch.device:
    """The device the model computes on: its first parameter's, or for an FSDP2 model whose
    shards live in host memory, its mesh's (the current device of that type)."""
    first = next(iter(model.parameters()))
    mesh = getattr(first, "device_mesh", None)
    if mesh is None or mesh.device_type == first.device.type:
        return first.device
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def adapt_options(model: torch.nn.Module, options: OffloadOptions) -> OffloadOptions:
    """The options an FSDP2 model runs with (see the module docstring); others unchanged."""
    if not is_sharded(model):
        return options
    refused = []
    if options.whole_model == "on":
        refused.append("whole_model='on'")
    on_host = bool(host_shards(model))
    if options.step_in_backward is True and not on_host:
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
            "state are offloaded. To keep parameters, gradients and optimizer state in host "
            f"memory, {HOST_SHARDS_REMEDY}"
        )
    checkpoint = "off" if options.granularity == "tensor" else options.checkpoint
    # The step in backward is the host shards' (`runtime.modes.host_step`); without any, off.
    in_backward = options.step_in_backward if on_host else False
    return options.replace(
        whole_model="off", step_in_backward=in_backward, recompute="off", checkpoint=checkpoint
    )


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
        params = fsdp_params(model)
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
