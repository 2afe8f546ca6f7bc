"""FSDP2 with `teraio.offload` on two GPUs (NCCL): a `torch.distributed.checkpoint` saved while the
optimizer state is in teraio's tiers, and training resumed from it. Skipped without 2 GPUs (CI
has none; `benches/torch/run-gpu.sh tests` with `PYTEST_ARGS=bindings/python/tests/test_fsdp_cuda.py`
on the 2-GPU machine runs it).

Each rank trains tiny.py's model, wide and with few rows so that the AdamW state is most of what
the GPU holds, sharded with `fully_shard`:

1. plain FSDP2, SAVE_AT + AFTER steps;
2. the same inside `teraio.offload` with default arguments but a budget below what the plain run
   needed less half its state (the block plan must move optimizer state to host memory), saving a
   DCP checkpoint after SAVE_AT steps, when the state is off the GPU;
3. a new model and optimizer inside `teraio.offload` load the checkpoint before any step and
   train the AFTER steps again.

Checks: (2) has (1)'s losses bitwise (the same kernels on the same bytes, the same collectives);
the state was away at the save; (3) gives (2)'s last AFTER losses and final shards bitwise.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import teraio  # noqa: E402
from ranks import (  # noqa: E402
    fully_shard,
    init_group,
    load_checkpoint,
    local_shards,
    rank_store,
    same_shards,
    save_checkpoint,
    shard_layers,
    spawn_ranks,
)
from tiny import batches, make, train  # noqa: E402

WORLD = 2
SHAPE = {"dim": 1024, "hidden": 4096, "layers": 4}
ROWS = 512  # global rows per step; each rank trains ROWS // WORLD of them
SAVE_AT = 6
AFTER = 3
DEADLINE_S = 300.0

pytestmark = pytest.mark.skipif(
    fully_shard is None
    or not torch.cuda.is_available()
    or torch.cuda.device_count() < WORLD
    or not dist.is_available()
    or not dist.is_nccl_available(),
    reason=f"FSDP2 on {WORLD} GPUs with NCCL is needed",
)


def _build(rank: int, **policy: Any) -> tuple[Any, Any]:
    """The model sharded (`fully_shard`'s other arguments in `policy`) and its AdamW."""
    model, _ = make(device=f"cuda:{rank}", **SHAPE)
    shard_layers(model, **policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _join(rank: int, tmp: str, name: str, steps: int) -> tuple[pathlib.Path, torch.device, list[Any]]:
    """This rank in the NCCL group (rendezvous `name` under `tmp`), and its rows of `steps` batches."""
    torch.cuda.set_device(rank)
    out = pathlib.Path(tmp)
    init_group(str(out / name), rank, WORLD, backend="nccl", timeout_s=120)
    device = torch.device("cuda", rank)
    per = ROWS // WORLD
    data = [x[rank * per : (rank + 1) * per].to(device) for x in batches(steps, rows=ROWS, dim=SHAPE["dim"])]
    return out, device, data


def _resumed(
    model: Any, optimizer: Any, options: dict[str, Any], checkpoint: str, data: list[Any]
) -> list[float]:
    """The losses of training on `data` inside `teraio.offload(**options)`, resumed from
    `checkpoint` (DCP) before the first step."""
    with teraio.offload(model, optimizer, **options):
        load_checkpoint(model, optimizer, checkpoint)
        return train(model, optimizer, data)


def _rank_main(rank: int, tmp: str, store_root: str) -> None:
    out, device, data = _join(rank, tmp, "rendezvous", SAVE_AT + AFTER)
    result: dict[str, Any] = {"rank": rank}

    held = torch.cuda.memory_allocated(device)
    model, optimizer = _build(rank)
    torch.cuda.reset_peak_memory_stats(device)
    plain = train(model, optimizer, data)
    # What the plain run needed beyond what the process held already.
    need = torch.cuda.max_memory_allocated(device) - held
    state = sum(
        value.to_local().numel() * value.to_local().element_size()
        for entry in optimizer.state.values()
        for value in entry.values()
        if hasattr(value, "to_local")
    )
    del model, optimizer
    torch.cuda.empty_cache()

    store = rank_store(store_root, f"rank{rank}")
    checkpoint = str(out / "checkpoint")
    try:

        def budget() -> int:
            # The budget is process-wide: what the process holds now (the checkpoint's bytes
            # among it, before the resumed run) and the plain run's need less half its state.
            return torch.cuda.memory_allocated(device) + need - state // 2

        options: dict[str, Any] = dict(store=store, gpu_memory=budget(), reserve=0)
        model, optimizer = _build(rank)
        with teraio.offload(model, optimizer, **options) as run:
            losses = train(model, optimizer, data[:SAVE_AT])
            result["state_away_at_save"] = sum(not slot.resident for slot in run.state.slots)
            save_checkpoint(model, optimizer, checkpoint)
            losses += train(model, optimizer, data[SAVE_AT:])
        result["report"] = str(run.report())
        finished = local_shards(model)
        # The first run's memory goes before the second measures its own peak.
        del model, optimizer, run
        torch.cuda.empty_cache()

        options["gpu_memory"] = budget()
        model, optimizer = _build(rank)
        resumed = _resumed(model, optimizer, options, checkpoint, data[SAVE_AT:])
        result["resumed_shards_equal"] = same_shards(model, finished)
    finally:
        store.close()
    result.update(plain=plain, losses=losses, resumed=resumed)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_fsdp2_on_two_gpus_resumes_from_a_checkpoint_taken_with_the_state_away(
    store_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    spawn_ranks(_rank_main, (str(tmp_path), str(store_dir)), WORLD, DEADLINE_S)
    for r in range(WORLD):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        print(result["report"])
        assert result["losses"] == result["plain"], [a - b for a, b in zip(result["losses"], result["plain"])]
        assert result["state_away_at_save"] > 0, "the optimizer state was on the GPU at the save"
        assert result["resumed"] == result["losses"][SAVE_AT:]
        assert result["resumed_shards_equal"]


HOST_STEPS = 6


def _host_build(rank: int) -> tuple[Any, Any]:
    """The same model sharded with FSDP's CPUOffloadPolicy: its shards and gradients in host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return _build(rank, offload_policy=CPUOffloadPolicy())


def _host_rank_main(rank: int, tmp: str, store_root: str) -> None:
    out, _, data = _join(rank, tmp, "rendezvous-host", HOST_STEPS)
    result: dict[str, Any] = {"rank": rank}
    store = rank_store(store_root, f"host{rank}")
    checkpoint = str(out / "checkpoint-host")
    try:
        options: dict[str, Any] = dict(store=store, reserve=0)
        # The kernel at optimizer.step(): the reference for the step in backward.
        model, optimizer = _host_build(rank)
        with teraio.offload(model, optimizer, step_in_backward=False, **options) as run:
            at_step = train(model, optimizer, data)
        result["at_step"] = run.report().host_step
        at_step_shards = local_shards(model)
        del model, optimizer, run

        # The default: in backward from the second step, waiting on FSDP's copies out.
        model, optimizer = _host_build(rank)
        with teraio.offload(model, optimizer, **options) as run:
            losses = train(model, optimizer, data[: HOST_STEPS // 2])
            save_checkpoint(model, optimizer, checkpoint)
            losses += train(model, optimizer, data[HOST_STEPS // 2 :])
        result["in_backward"] = run.report().host_step
        result["report"] = str(run.report())
        result["shards_equal"] = same_shards(model, at_step_shards)
        del model, optimizer, run

        # Resumed from the checkpoint: the same losses and shards.
        model, optimizer = _host_build(rank)
        resumed = _resumed(model, optimizer, options, checkpoint, data[HOST_STEPS // 2 :])
        result["resumed_shards_equal"] = same_shards(model, at_step_shards)
    finally:
        store.close()
    result.update(at_step_losses=at_step, losses=losses, resumed=resumed)
    (out / f"host{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_fsdp2_host_shards_on_two_gpus_step_in_backward_and_resume(
    store_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """CPUOffloadPolicy under teraio.offload on two GPUs: the kernel's step in backward, which
    waits on FSDP's asynchronous copies of the gradients to host memory, gives the bits of its
    step at optimizer.step(); a DCP checkpoint of the host shards resumes bitwise."""
    spawn_ranks(_host_rank_main, (str(tmp_path), str(store_dir)), WORLD, DEADLINE_S)
    for r in range(WORLD):
        result = json.loads((tmp_path / f"host{r}.json").read_text())
        print(result["report"])
        assert result["at_step"]["by"].startswith("the engine's kernel"), result["at_step"]
        assert result["at_step"]["steps_in_backward"] == 0
        assert result["in_backward"]["in_backward"] == "auto: on from step 1", result["in_backward"]
        assert result["in_backward"]["steps_in_backward"] == HOST_STEPS - 1
        assert result["losses"] == result["at_step_losses"]
        assert result["shards_equal"]
        assert result["resumed"] == result["losses"][HOST_STEPS // 2 :]
        assert result["resumed_shards_equal"]
