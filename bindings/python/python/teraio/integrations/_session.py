"""What the integrations share: one `teraio.offload`
session entered by one library hook and closed by another (or by an exception)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ..options import OffloadOptions
from ..planning import parse_size
from ..runtime import offload


class Held:
    """A `teraio.offload` session that one hook of a library enters and another closes.

    `close()` is idempotent and keeps the report: `report()` answers after the run too."""

    def __init__(self, store: Any, gpu_memory: Optional[Union[int, float, str]], options: dict[str, Any]):
        OffloadOptions().replace(**options)  # an unknown option fails here, not when training starts
        if gpu_memory is not None:
            parse_size(gpu_memory)
        self.store = store
        self.gpu_memory = gpu_memory
        self.options = dict(options)
        self.run: Any = None
        self.active = False

    def enter(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        self.close()
        run = offload(model, optimizer, store=self.store, gpu_memory=self.gpu_memory, **self.options)
        run.__enter__()
        self.run = run
        self.active = True
        return run

    def close(self, *exc: object) -> None:
        if self.active:
            self.active = False
            self.run.__exit__(*(exc or (None, None, None)))

    def report(self) -> Any:
        if self.run is None:
            raise RuntimeError(
                "teraio: no offload session has run yet (the training has not started); "
                "call report() after training"
            )
        return self.run.report()
