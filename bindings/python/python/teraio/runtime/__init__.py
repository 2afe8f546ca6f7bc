"""`teraio.offload`: profile, plan and offload around an unchanged training loop.

```
with teraio.offload(model, optimizer, store=store, gpu_memory="24GiB", host_memory="64GiB") as run:
    for batch in loader:
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
print(run.report())
```

The front door: adapts the options (FSDP2), resolves the budget, picks the mode and returns it;
and `shard`, FSDP2 applied as teraio runs it, choosing host shards where the state does not fit.
The modes are in `modes/` (docs/runtime.md describes the runtime's floors).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .. import sharded
from ..blocks import find_blocks
from ..options import OffloadOptions
from ..planning import format_bytes
from ..store import Store
from . import session
from .errors import NoPlanFitsError
from .modes import whole_model
from .modes.block import BlockOffload
from .modes.tensor import TensorOffload
from .modes.whole_model import WHOLE_MODEL_SHARE, WHOLE_MODEL_WEIGHTS_SHARE
from .session import Budget, gpu_budget

__all__ = ["NoPlanFitsError", "ShardChoice", "offload", "shard"]


def offload(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    options: Optional[OffloadOptions] = None,
    *,
    store: Optional[Store] = None,
    gpu_memory: Optional[Union[int, float, str]] = None,
    **overrides: Any,
) -> Any:
    """Offloads a model's training state around an unchanged training loop; see the module doc.

    ```
    with teraio.offload(model, optimizer, store=store, gpu_memory="22GiB") as run:
        ...
    ```

    Args:
        model, optimizer: the model being trained and its optimizer (iterations end at its step;
            a wrapper holding a torch optimizer as `.optimizer`, such as Accelerate's, is unwrapped).
        options: a `teraio.OffloadOptions` (every setting, documented there); its fields can
            also be given as keywords (`host_memory="64GiB"`, `recompute="off"`, ...), which
            override the options object.
        store: the SSD tier (a `teraio.Store`); None: host memory only.
        gpu_memory: GPU memory the iterations must fit in (bytes or "24GiB"); default: the
            device's memory.

    Returns the mode that runs: whole-model mode (`ModelOffload`) where parameters, gradients
    and optimizer state do not fit the budget (`whole_model` option); else the block plan
    (`BlockOffload`) for a model with repeated blocks (`granularity`); else the tensor plan
    (`TensorOffload`).
    """
    # A library's wrapper (Accelerate's AcceleratedOptimizer) steps the optimizer inside it: the
    # hooks go there, so an iteration ends at the step that updates the parameters.
    optimizer = unwrap_optimizer(optimizer)
    adapted = sharded.adapt_options(model, (options or OffloadOptions()).replace(**overrides))
    _refuse_compiled(model)
    device = sharded.compute_device(model)
    budget = gpu_budget(device, gpu_memory)
    whole = adapted.whole_model == "on" or (
        adapted.whole_model == "auto" and whole_model.needs_whole_model(model, optimizer, budget)
    )
    if adapted.step_in_backward is True and not whole and not sharded.host_shards(model):
        warnings.warn(
            "teraio.offload: step_in_backward=True has no effect: the model's parameters, "
            "gradients and optimizer state fit gpu_memory, so whole-model mode is off "
            "(whole_model='on' forces it)",
            stacklevel=2,
        )
    if adapted.update != "auto" and not whole:
        warnings.warn(
            f"teraio.offload: update={adapted.update!r} has no effect: the model's parameters, "
            "gradients and optimizer state fit gpu_memory, so whole-model mode is off and the "
            "optimizer steps where its state is (whole_model='on' forces whole-model mode)",
            stacklevel=2,
        )
    if whole:
        mode: Any = whole_model.ModelOffload
    elif adapted.granularity == "tensor" or (adapted.granularity == "auto" and not find_blocks(model)):
        mode = TensorOffload
    else:
        mode = BlockOffload
    host_memory_bytes, machine_notes = session.host_memory(adapted)
    return mode(model, optimizer, adapted, Budget(store, budget, host_memory_bytes, machine_notes))


#: Host memory host shards take per byte of their fp32 shards, gradients and AdamW state: FSDP
#: pins the shards and the gradients' copies through torch's caching host allocator, which rounds
#: each block up to a power of two. (A 14.5B model's 108 GiB per rank was killed on a host with
#: 125 GiB per rank, 2 x H200: docs/benchmarks.md.)
HOST_SHARDS_OVERHEAD = 1.5


@dataclass(frozen=True)
class ShardChoice:
    """What `shard` did: whether the shards live in host memory, how many blocks it sharded,
    the per-rank bytes it weighed, and why."""

    host_shards: bool
    blocks: int
    weights_bytes_per_rank: int
    state_bytes_per_rank: int
    reason: str

    def __str__(self) -> str:
        where = "in host memory (CPUOffloadPolicy)" if self.host_shards else "on the GPU"
        return f"teraio.shard: {self.blocks} blocks and the root, shards {where}: {self.reason}"


def shard(
    model: torch.nn.Module,
    *,
    mesh: Any = None,
    mp_policy: Any = None,
    gpu_memory: Optional[Union[int, float, str]] = None,
    host_memory: Union[int, float, str] = "auto",
    host_shards: Union[bool, str] = "auto",
) -> ShardChoice:
    """Shards `model` with FSDP2 as teraio runs it, in place: `fully_shard` on each of its
    repeated blocks (`blocks.find_blocks`), then on the root, on `mesh` (default: FSDP's, the
    world on the current device) with `mp_policy` (a `MixedPrecisionPolicy`, or None).

    `host_shards`: "auto" (default) keeps the shards, their gradients and the optimizer state in
    host memory (FSDP's `CPUOffloadPolicy`, stepped by teraio's kernel inside `teraio.offload`)
    where this rank's share of the trained parameters, their gradients and AdamW's state exceeds
    `WHOLE_MODEL_SHARE` of `gpu_memory` and the parameters and gradients alone exceed
    `WHOLE_MODEL_WEIGHTS_SHARE` of it, as whole-model mode is chosen on one GPU, and all of it
    (times `HOST_SHARDS_OVERHEAD`) fits this rank's share of `host_memory` ("auto":
    `machine.default_host_memory`; more than MemAvailable is refused, as `teraio.offload`
    refuses it); else on the
    GPU, where the block plan moves the optimizer state. True or False decide. `gpu_memory`:
    default, the device's memory (required on a CPU mesh with "auto"). Make the optimizer after
    sharding (it must hold the sharded parameters); a meta-device model with host shards is
    materialised in CPU memory (`model.to_empty(device="cpu")`), as FSDP requires."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if host_shards not in (True, False, "auto"):
        raise ValueError(f"host_shards must be True, False or 'auto', not {host_shards!r}")
    if sharded.is_sharded(model):
        raise ValueError("teraio.shard: the model is already sharded (fully_shard was applied)")
    device_type = mesh.device_type if mesh is not None else "cuda"
    if host_shards == "auto":
        # The budgets as `teraio.offload` resolves them (a host figure above MemAvailable refused).
        if device_type == "cuda" and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        try:
            budget = gpu_budget(device, gpu_memory)
        except ValueError as error:
            raise ValueError(f"teraio.shard: {error}, to choose host shards") from error
        host, _ = session.host_memory(OffloadOptions(host_memory=host_memory))
    world = int(mesh.size()) if mesh is not None else torch.distributed.get_world_size()
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    weights_per_rank = (weights + trained) // world
    state_per_rank = 2 * trained // world  # AdamW's two moments, in the parameters' dtype
    everything = weights_per_rank + state_per_rank
    if host_shards == "auto":
        needs = (
            everything > WHOLE_MODEL_SHARE * budget and weights_per_rank > WHOLE_MODEL_WEIGHTS_SHARE * budget
        )
        on_host = needs and HOST_SHARDS_OVERHEAD * everything <= host
        sizes = (
            f"{format_bytes(weights_per_rank)} of parameters and gradients and "
            f"{format_bytes(state_per_rank)} of AdamW state per rank, against "
            f"gpu_memory={format_bytes(budget)}"
        )
        if on_host:
            reason = f"{sizes}: they do not fit; host memory per rank ({format_bytes(host)}) holds them"
        elif needs:
            reason = (
                f"{sizes}: they do not fit, but neither does host memory per rank ({format_bytes(host)}): "
                "the block plan keeps parameters and gradients on the GPU and moves the optimizer state"
            )
        else:
            reason = f"{sizes}: they fit (the block plan moves the optimizer state where needed)"
    else:
        on_host = bool(host_shards)
        reason = f"host_shards={host_shards!r}"
    policy: dict[str, Any] = {}
    if mesh is not None:
        policy["mesh"] = mesh
    if mp_policy is not None:
        policy["mp_policy"] = mp_policy
    if on_host:
        # Pinned where a GPU copies the shards in (FSDP's default); a CPU mesh has none.
        policy["offload_policy"] = CPUOffloadPolicy(device_type == "cuda")
    blocks = find_blocks(model)
    for _, block in blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    return ShardChoice(on_host, len(blocks), weights_per_rank, state_per_rank, reason)


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


def _refuse_compiled(model: torch.nn.Module) -> None:
    """A `torch.compile`d model runs its forward and backward as compiled graphs: autograd's
    saved tensors are AOTAutograd's, not visible to `saved_tensors_hooks` in the way the plan
    maps them, and the profiler's dispatch mode does not see the graphs' ops. Refused at once."""
    compiled = []
    for name, module in model.named_modules():
        if (
            isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
            or getattr(module, "_compiled_call_impl", None) is not None
        ):
            compiled.append(name or "the model")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and "the model" not in compiled:
        compiled.insert(0, "the model")
    if compiled:
        raise TypeError(
            f"teraio.offload does not support torch.compile'd models ({', '.join(compiled[:3])} "
            "compiled): its profiler and its saved-tensor hooks need the eager ops. Pass the "
            "uncompiled module (for `compiled = torch.compile(model)`, pass `model`), or call "
            "torch.compile on parts that teraio does not need to see"
        )
