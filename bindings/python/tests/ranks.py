"""Runs a test's rank function in spawned processes (the multi-process DDP and FSDP2 tests)."""

from __future__ import annotations

import time
from typing import Any, Callable


def spawn_ranks(main: Callable[..., None], args: tuple[Any, ...], world: int, deadline_s: float) -> None:
    """`main(rank, *args)` in `world` spawned processes; raises where a rank fails or the ranks do
    not all finish within `deadline_s` (the live ones are then terminated)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(main, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=1.0):  # raises if a rank failed
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world} ranks did not finish in {deadline_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
