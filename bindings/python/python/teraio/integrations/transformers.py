"""`teraio.offload` inside the Hugging Face `Trainer` (and trainers built on it, such as
`trl.SFTTrainer`): `OffloadCallback`, a `TrainerCallback`.

```
callback = OffloadCallback(store=store, gpu_memory="24GiB")
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
with callback:  # closes the session if train() raises
    trainer.train()
print(callback.report())
```

docs/integrations.md says what the Trainer's options do under it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from transformers import TrainerCallback

from ..runtime import unwrap_optimizer
from ._session import Held

__all__ = ["OffloadCallback"]

_log = logging.getLogger(__name__)


class OffloadCallback(TrainerCallback):
    """Runs `teraio.offload` (same arguments: `store`, `gpu_memory` and the `OffloadOptions`
    fields as keywords) on the model and optimizer the Trainer made, from `on_train_begin` to
    `on_train_end`.

    The Trainer calls no callback when `train()` raises: use the callback as a context manager
    around `train()` (`with callback: trainer.train()`), or call `close()`, to remove teraio's
    hooks then. A session left open is closed by the next `on_train_begin` (another `train()`,
    or `auto_find_batch_size`'s retry after an out-of-memory error)."""

    def __init__(
        self, store: Any = None, gpu_memory: Optional[Union[int, float, str]] = None, **options: Any
    ) -> None:
        self._held = Held(store, gpu_memory, options)

    # -- the Trainer's events --------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _refuse_checkpointing(args, None)

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        self._held.close()
        if model is None or optimizer is None:
            raise TypeError(
                "teraio OffloadCallback: the Trainer passed no model or optimizer to on_train_begin; "
                "it needs transformers >= 4.x, whose callbacks receive both"
            )
        _refuse_checkpointing(args, model)
        self._held.enter(model, unwrap_optimizer(optimizer))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._held.active:
            return
        self._held.close()
        if state.is_world_process_zero:
            _log.info("teraio.offload report:\n%s", self._held.report())

    # -- for the caller ----------------------------------------------------------------------

    @property
    def run(self) -> Any:
        """The `teraio.offload` session of the last `train()` (None before one started)."""
        return self._held.run

    def report(self) -> Any:
        """The last session's `run.report()`."""
        return self._held.report()

    def close(self) -> None:
        """Removes teraio's hooks now (no-op when no session is open)."""
        self._held.close()

    def __enter__(self) -> OffloadCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        self._held.close(*exc)


def _refuse_checkpointing(args: Any, model: Any) -> None:
    """teraio plans recomputation itself (whole blocks and single tensors, `checkpoint` and
    `recompute`); Hugging Face checkpointing under it hides the blocks' saved tensors from the plan
    and recomputes them all."""
    # transformers 5 renamed the model's flag (the old name warns).
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else ("is_gradient_checkpointing")
    )
    on = (
        bool(getattr(args, "activation_checkpointing", False))
        or bool(getattr(args, "gradient_checkpointing", False))
        or bool(getattr(model, flag, False))
    )
    if on:
        raise ValueError(
            "teraio OffloadCallback: gradient checkpointing is on (TrainingArguments("
            "gradient_checkpointing=True / activation_checkpointing=True, or the model's "
            "gradient_checkpointing_enable()); teraio plans "
            "its own recomputation: turn it off, and pass checkpoint='all' to the callback to "
            "checkpoint every block as it would"
        )
