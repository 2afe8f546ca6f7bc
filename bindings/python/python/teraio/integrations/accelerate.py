"""`teraio.offload` around a loop after Hugging Face Accelerate's `accelerator.prepare(...)`.

```
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
with teraio.integrations.accelerate.offload(accelerator, model, optimizer, gpu_memory="24GiB") as run:
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
```

docs/integrations.md says what Accelerate's features do under it.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import accelerate

from ..runtime import offload as _offload
from ..runtime import unwrap_optimizer
from ..runtime.modes.whole_model import ModelOffload

__all__ = ["offload"]


def offload(
    accelerator: accelerate.Accelerator,
    model: Any,
    optimizer: Any,
    *,
    store: Any = None,
    gpu_memory: Optional[Union[int, float, str]] = None,
    **options: Any,
) -> Any:
    """`teraio.offload` (same keywords) on what `accelerator.prepare` returned: the prepared model
    as the loop calls it (its mixed-precision forward, a DDP wrapper) and the torch optimizer inside
    the `AcceleratedOptimizer`, whose step runs once per real step (not on accumulation
    micro-batches). Returns the context manager `teraio.offload` returns."""
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(
            f"teraio.integrations.accelerate.offload: expected an accelerate.Accelerator, got "
            f"{type(accelerator).__name__}; pass the accelerator that prepared the model"
        )
    kind = accelerator.distributed_type
    if kind == accelerate.DistributedType.DEEPSPEED:
        raise ValueError(
            "teraio.integrations.accelerate.offload: the accelerator runs DeepSpeed, whose engine "
            "owns the step and its own offload; use teraio with DeepSpeed off (or DeepSpeed alone)"
        )
    run = _offload(model, unwrap_optimizer(optimizer), store=store, gpu_memory=gpu_memory, **options)
    if isinstance(run, ModelOffload) and accelerator.scaler is not None:
        # The AcceleratedOptimizer steps through the GradScaler with the optimizer's step method it
        # kept at prepare, past whole-model mode's streamed step (set on the optimizer later).
        raise ValueError(
            "teraio.integrations.accelerate.offload: whole-model mode cannot run under fp16 mixed "
            "precision with a GradScaler (the scaler calls the optimizer's own step); use "
            "mixed_precision='bf16', or whole_model='off' where the state fits gpu_memory"
        )
    return run
