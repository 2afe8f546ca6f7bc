"""Runs a test's rank function in spawned processes (the multi-process DDP and FSDP2 tests), and
what each rank sets up: its gloo process group, its own store, and FSDP2 over the model's layers."""

from __future__ import annotations

import datetime
import pathlib
import time
from typing import Any, Callable, Optional

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch without FSDP2
    fully_shard = None


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


def init_group(init_file: str, rank: int, world: int, backend: str = "gloo", timeout_s: float = 60) -> None:
    """This rank's process group (a file rendezvous, so no port): gloo, or the `backend` given
    (NCCL on GPUs)."""
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def rank_store(root: str, name: str, size_bytes: int = 256 << 20) -> Any:
    """A store of its own for one rank: `root`/`name`/dev0."""
    import teraio

    path = pathlib.Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return teraio.Store.create([path / "dev0"], file_size_bytes=size_bytes, durable=False, force=True)


def shard_layers(model: Any, mesh: Optional[Any] = None, **policy: Any) -> None:
    """FSDP2 as the tests use it: each of `model.layers`, then the root (on `mesh` where given,
    with `fully_shard`'s other arguments, such as `offload_policy`, in `policy`)."""
    assert fully_shard is not None
    on = dict(policy) if mesh is None else {"mesh": mesh, **policy}
    for layer in model.layers:
        fully_shard(layer, **on)
    fully_shard(model, **on)


def local_shards(model: Any) -> dict[str, Any]:
    """This rank's shard of each entry of the model's state dict (copies)."""
    return {name: value.to_local().clone() for name, value in model.state_dict().items()}


def same_shards(model: Any, reference: dict[str, Any]) -> bool:
    """Whether this rank's shards equal `reference`'s (`local_shards` of another run), bitwise."""
    import torch

    mine = local_shards(model)
    return all(torch.equal(mine[name], value) for name, value in reference.items())


def save_checkpoint(model: Any, optimizer: Any, checkpoint: str) -> None:
    """DCP's save of the model's and the optimizer's state dicts (which are let go after it, as a
    loop lets them go: on a GPU they hold device memory)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)


def load_checkpoint(model: Any, optimizer: Any, checkpoint: str) -> None:
    """DCP's load of `save_checkpoint`'s checkpoint into the model and the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
