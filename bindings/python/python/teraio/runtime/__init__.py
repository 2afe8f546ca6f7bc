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

The front door: adapts the options (FSDP2), resolves the budget, picks the mode and returns it.
The modes are in `modes/` (docs/runtime.md describes the runtime's floors).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch

from .. import sharded
from ..blocks import find_blocks
from ..options import OffloadOptions
from ..store import Store
from .errors import NoPlanFitsError
from .modes import whole_model
from .modes.block import BlockOffload
from .modes.tensor import TensorOffload
from .session import Budget, gpu_budget, host_memory

__all__ = ["NoPlanFitsError", "offload"]


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
    host_memory_bytes, machine_notes = host_memory(adapted)
    return mode(model, optimizer, adapted, Budget(store, budget, host_memory_bytes, machine_notes))


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
