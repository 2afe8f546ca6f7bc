"""`teraio.offload` inside PyTorch Lightning's `Trainer` (the `lightning` package):
`OffloadCallback`, a `lightning.pytorch.Callback`.

```
trainer = lightning.pytorch.Trainer(callbacks=[OffloadCallback(store=store, gpu_memory="24GiB")])
trainer.fit(module, loader)
```

docs/integrations.md says what Lightning's features do under it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch import Callback

from ..runtime import unwrap_optimizer
from ._session import Held

__all__ = ["OffloadCallback"]


class OffloadCallback(Callback):
    """Runs `teraio.offload` (same arguments: `store`, `gpu_memory` and the `OffloadOptions`
    fields as keywords) on the `LightningModule` and its optimizer from `on_train_start` (after
    the sanity check's validation) to `on_train_end`; an exception (`on_exception`) or the
    Trainer's `teardown` closes it too.

    In automatic optimization Lightning runs the training step's forward and backward inside
    `optimizer.step(closure)`, after the step's pre-hooks, where teraio's iteration has already
    ended. While the session runs, the optimizer's `step` (on the instance) runs the closure first
    and then the step without it: the same calls in the same order as torch's optimizers make
    them, so an iteration ends at the step as teraio expects."""

    def __init__(
        self, store: Any = None, gpu_memory: Optional[Union[int, float, str]] = None, **options: Any
    ) -> None:
        self._held = Held(store, gpu_memory, options)
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._step: Optional[Callable[..., Any]] = None
        self._had_step = False

    # -- Lightning's events ----------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"teraio OffloadCallback: the LightningModule configures {len(trainer.optimizers)} "
                "optimizers; teraio.offload runs one model with one optimizer: return one from "
                "configure_optimizers"
            )
        optimizer = unwrap_optimizer(trainer.optimizers[0])
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "teraio OffloadCallback: LBFGS calls its closure several times per step, each a "
                "forward and backward inside the step; use an optimizer that steps once per iteration"
            )
        self._held.enter(pl_module, optimizer)
        self._closure_first(optimizer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close(type(exception), exception, exception.__traceback__)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    # -- for the caller ----------------------------------------------------------------------

    @property
    def run(self) -> Any:
        """The `teraio.offload` session of the last fit (None before one started)."""
        return self._held.run

    def report(self) -> Any:
        """The last session's `run.report()`."""
        return self._held.report()

    # -- the closure -----------------------------------------------------------------------------

    def _closure_first(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._had_step = "step" in optimizer.__dict__
        previous = optimizer.step

        @functools.wraps(previous)
        def step(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            result = previous(**kwargs)
            return loss if closure is not None else result

        step.__module__ = __name__
        self._step = step
        optimizer.step = step  # type: ignore[method-assign]

    def _close(self, *exc: object) -> None:
        optimizer, self._optimizer = self._optimizer, None
        if optimizer is not None and optimizer.__dict__.get("step") is self._step:
            # Back to what was there: a scheduler's or teraio's own instance step, or the class's.
            previous = self._step.__wrapped__  # type: ignore[union-attr]
            if self._had_step:
                optimizer.step = previous  # type: ignore[method-assign]
            else:
                del optimizer.__dict__["step"]
        self._step = None
        self._held.close(*exc)
