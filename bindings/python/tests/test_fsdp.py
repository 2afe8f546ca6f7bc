"""FSDP2 (`fully_shard`) with `teraio.offload` on a CPU "device": 2 gloo ranks, one store each.

Two processes (torch.multiprocessing, spawn; file rendezvous, so no port) shard tiny.py's model
with `fully_shard` (each block, then the root) and train on their halves of every global batch:

1. plain FSDP2;
2. the same inside `teraio.offload`, with a budget below the rank's unplanned peak and little host
   memory (activations go to host memory and the rank's store; the optimizer state, DTensors,
   moves its local shards), saving a `torch.distributed.checkpoint` after SAVE_AT steps while
   the state is off the device, then AFTER more steps;
3. in a new process group, a fresh model and optimizer inside `teraio.offload` load that
   checkpoint (DCP's `get_state_dict` / `dcp.load` / `set_state_dict`) before any step and train
   the AFTER steps again;
4. the same, but loading after three steps of other data, once the plan runs.

Checks: (2) has the losses, final shards and optimizer state of (1) bitwise (offload restores
the same bytes, and FSDP's collectives run with the same inputs in the same order: the recorded
sequences of collective calls are the same with and without teraio); (3) and (4) reproduce the
losses and final shards of (2)'s last AFTER steps bitwise; every rank's report names its rank,
shows no plan mismatch, and its store is used and left empty. The profiled trace shows FSDP's
gathered parameters freed at each reshard (at most two blocks' worth live at once).

    TERAIO_TEST_DIR=$PWD/target/py-test-stores python -m pytest -q bindings/python/tests/test_fsdp.py -s
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
from typing import Any, Iterator

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
from teraio import sharded  # noqa: E402
from tiny import batches, make, train  # noqa: E402

WORLD = 2
LAYERS = 4
ROWS = 512  # global batch; each rank trains ROWS // WORLD rows of it (activations ~ the state)
SAVE_AT = 5
AFTER = 3
DEADLINE_S = 240.0
#: The collectives FSDP2 calls (torch.distributed functions; those present are recorded).
COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)

pytestmark = pytest.mark.skipif(
    fully_shard is None or not dist.is_available() or not dist.is_gloo_available(),
    reason="FSDP2 (torch.distributed.fsdp.fully_shard) with gloo is needed",
)


def _build() -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    model, _ = make(layers=LAYERS)
    # A CPU mesh: without one, fully_shard moves the model to CUDA where a GPU is present.
    mesh = init_device_mesh("cpu", (WORLD,))
    shard_layers(model, mesh)
    # The optimizer holds the sharded parameters (DTensors), so it is made after sharding.
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(optimizer: Any) -> list[Any]:
    return [
        value.to_local().clone() if hasattr(value, "to_local") else value.clone()
        for state in optimizer.state.values()
        for value in state.values()
    ]


@contextlib.contextmanager
def _recording_collectives(calls: list[list[Any]]) -> Iterator[None]:
    """Records each collective FSDP calls: its name and its tensors' shapes."""
    saved = {}
    for name in COLLECTIVES:
        function = getattr(dist, name, None)
        if function is None:
            continue
        saved[name] = function

        def recorded(*args: Any, _name: str = name, _function: Any = function, **kwargs: Any) -> Any:
            shapes = [list(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            calls.append([_name, shapes])
            return _function(*args, **kwargs)

        setattr(dist, name, recorded)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(dist, name, function)


def _live_gathered_bytes(trace: dict[str, Any]) -> int:
    """Most bytes of FSDP's gathered-parameter buffers alive at once in the trace."""
    count = len(trace["ops"])
    live = [0] * count
    for tensor in trace["tensors"]:
        if tensor["name"].startswith("split_with_sizes_copy") and tensor["alloc_op"] is not None:
            for op in range(tensor["alloc_op"], tensor["free_op"] + 1):
                live[op] += tensor["size_bytes"]
    return max(live)


def _init(init_file: str) -> None:
    init_group(init_file, int(os.environ["TERAIO_TEST_RANK"]), WORLD)


def _rank_main(rank: int, tmp: str, store_root: str) -> None:
    torch.set_num_threads(1)
    os.environ["TERAIO_TEST_RANK"] = str(rank)
    out = pathlib.Path(tmp)
    _init(str(out / "rendezvous-1"))
    per = ROWS // WORLD
    data = [x[rank * per : (rank + 1) * per] for x in batches(SAVE_AT + AFTER + 3, rows=ROWS)]
    data, other = data[: SAVE_AT + AFTER], data[SAVE_AT + AFTER :]
    result: dict[str, Any] = {"rank": rank}

    # The rank's unplanned peak and activations, profiled on a steady FSDP2 iteration.
    model, optimizer = _build()
    train(model, optimizer, data[:2])
    profiler = teraio.Profiler(model, optimizer)
    with profiler:
        train(model, optimizer, data[2:3])
    trace = profiler.trace()
    planned = teraio.plan(trace, gpu_memory=1 << 40, ssd_read_bandwidth=1e9)
    peak = planned["prediction"]["unplanned_peak_bytes"]
    activations = sum(t["size_bytes"] for t in trace["tensors"] if t["kind"] == "activation")
    state = sum(t["size_bytes"] for t in trace["tensors"] if t["kind"] == "optimizer_state")
    result["gathered_live_bytes"] = _live_gathered_bytes(trace)
    result["block_bytes"] = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    result["ops"] = sorted({op["name"].split(":")[-1] for op in trace["ops"]})

    for refused in ({"checkpoint": "auto", "granularity": "tensor"}, {"step_in_backward": True}):
        with pytest.raises(ValueError, match="FSDP2"):
            teraio.offload(model, optimizer, gpu_memory=peak, **refused)
    # The rank's parameter and gradient shards alone above the budget: refused as the session
    # starts, before anything is hooked (they stay on the GPU under FSDP2).
    weights = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    for granularity in ("block", "tensor"):
        run = teraio.offload(model, optimizer, gpu_memory=2 * weights - 1, granularity=granularity)
        with pytest.raises(teraio.NoPlanFitsError, match="this rank's shards.*shard over more ranks"):
            run.__enter__()
        assert not optimizer._optimizer_step_pre_hooks

    model, optimizer = _build()
    plain_calls: list[Any] = []
    with _recording_collectives(plain_calls):
        plain = train(model, optimizer, data)
    plain_shards, plain_state = local_shards(model), _state(optimizer)

    store = rank_store(store_root, f"rank{rank}")
    options = dict(
        store=store,
        # Below the unplanned peak by half the activations and half the state: the plan moves
        # activations, and optimizer state where its profiled costs favour that.
        gpu_memory=peak - activations // 2 - state // 2,
        host_memory=activations // 8,  # the rest of what the plan moves goes to the rank's store
        reserve=0,
        min_bytes=16 << 10,
        ssd_bandwidth="2GB/s",
        granularity="tensor",  # the tensor plan (the block plan's test is below)
    )
    checkpoint = str(out / "checkpoint")
    try:
        model, optimizer = _build()
        calls: list[Any] = []
        with _recording_collectives(calls), teraio.offload(model, optimizer, **options) as run:
            losses = train(model, optimizer, data[:SAVE_AT])
            result["state_away_at_save"] = sum(not s.resident for s in run.state.slots)
            save_checkpoint(model, optimizer, checkpoint)
            losses += train(model, optimizer, data[SAVE_AT:])
        report = run.report()
        result["report"] = report.as_dict()
        result["report_text"] = str(report)
        result["brought_back"] = run.state.stats.brought_back
        result["state_planned"] = run.state.planned_bytes("host") + run.state.planned_bytes("ssd")
        offload_shards, offload_state = local_shards(model), _state(optimizer)
        dist.destroy_process_group()

        # A new process group, model and optimizer resume from the checkpoint.
        _init(str(out / "rendezvous-2"))
        resumed = {}
        for name, warmup in (("before_any_step", []), ("with_the_plan", other)):
            model, optimizer = _build()
            with teraio.offload(model, optimizer, **options) as run:
                train(model, optimizer, warmup)
                planned = run.plan_result is not None
                load_checkpoint(model, optimizer, checkpoint)
                moved_before = sum(run.state.stats.offloaded_bytes.values())
                after = train(model, optimizer, data[SAVE_AT:])
                moved_after = sum(run.state.stats.offloaded_bytes.values())
                state_planned = run.state.planned_bytes("host") + run.state.planned_bytes("ssd")
            resumed[name] = {
                "losses": after,
                "planned_at_load": planned,
                "state_moved_after_load": moved_after - moved_before,
                "state_planned": state_planned,
                "shards_equal": same_shards(model, offload_shards),
            }
        result["resumed"] = resumed
        result["objects_left"] = store.info()["object_count"]
        io = store.stats()
        result["store_io"] = [io["write_bytes"], io["read_bytes"], io["errors"]]
    finally:
        store.close()
    result.update(
        plain=plain,
        losses=losses,
        plain_calls=plain_calls,
        calls=calls,
        shards_equal=all(torch.equal(offload_shards[k], v) for k, v in plain_shards.items()),
        state_equal=len(plain_state) == len(offload_state)
        and all(torch.equal(a, b) for a, b in zip(plain_state, offload_state)),
    )
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _spawn(*args: Any) -> None:
    spawn_ranks(_rank_main, args, WORLD, DEADLINE_S)


def test_whole_model_mode_under_fsdp2_points_to_host_shards(monkeypatch: Any) -> None:
    # Whole-model offload under FSDP2 is FSDP's CPUOffloadPolicy with teraio's step: asked for by
    # name, the error says how to shard for it. (A stand-in model: the refusal needs no ranks.)
    from teraio.options import OffloadOptions

    monkeypatch.setattr(sharded, "is_sharded", lambda model: True)
    with pytest.raises(ValueError, match=r"whole_model='on'.*offload_policy=CPUOffloadPolicy\(\)"):
        sharded.adapt_options(torch.nn.Linear(2, 2), OffloadOptions(whole_model="on"))
    assert sharded.adapt_options(torch.nn.Linear(2, 2), OffloadOptions()).whole_model == "off"


def test_fsdp2_offload_bitwise_and_checkpoint_resume(store_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    _spawn(str(tmp_path), str(store_dir))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, result in enumerate(ranks):
        report = result["report"]
        print(result["report_text"])
        # FSDP's collectives are in the trace as ops, and its gathered parameters die at reshards.
        assert {"_allgather_base_.default", "_reduce_scatter_base_.default"} <= set(result["ops"])
        assert 0 < result["gathered_live_bytes"] <= 2 * result["block_bytes"], result["gathered_live_bytes"]

        # (2) bitwise the plain run, with the same collectives in the same order.
        assert result["losses"] == result["plain"], [a - b for a, b in zip(result["losses"], result["plain"])]
        assert result["shards_equal"] and result["state_equal"]
        assert result["calls"] and result["calls"] == result["plain_calls"]
        assert result["calls"] == ranks[0]["calls"]

        moved = report["bytes_per_iteration"]
        assert moved["offloaded"]["ssd"] > 0, "the rank's store was not used"
        assert moved["prefetched"] == moved["offloaded"]
        # The plan comes from profiled op times, and moving activations alone can meet this
        # budget: where the plan moves optimizer state, it moved, and the checkpoint (below) was
        # taken while some was off the device.
        state = report["state_bytes_per_iteration"]
        if result["state_planned"]:
            assert state["offloaded"]["host"] + state["offloaded"]["ssd"] > 0, (
                "the planned state did not move"
            )
        assert report["stalls"]["plan_mismatches"] == 0
        assert report["machine"]["rank"] == r and f"(rank {r} of {WORLD})" in result["report_text"]
        write, read, errors = result["store_io"]
        assert write > 0 and read > 0 and errors == 0 and result["objects_left"] == 0

        # The checkpoint was taken while state was off the device, and saw its real bytes.
        if result["state_planned"]:
            assert result["state_away_at_save"] > 0 and result["brought_back"] >= 1
        for name, resumed in result["resumed"].items():
            assert resumed["losses"] == result["losses"][SAVE_AT:], name
            assert resumed["shards_equal"], name
            # The plan comes from profiled op times, and a loaded machine may give one that moves
            # no optimizer state: where it moves some, the state the load put in the optimizer
            # moves after the load.
            if resumed["state_planned"]:
                assert resumed["state_moved_after_load"] > 0, name
        assert not result["resumed"]["before_any_step"]["planned_at_load"]
        assert result["resumed"]["with_the_plan"]["planned_at_load"]


def test_fsdp_benchmark_smoke(tmp_path: pathlib.Path, store_dir: pathlib.Path) -> None:
    """benches/torch/bench_fsdp.py end to end at a tiny size on the CPU (its GPU run needs 2 GPUs)."""
    script = pathlib.Path(__file__).resolve().parents[3] / "benches" / "torch" / "bench_fsdp.py"
    command = [sys.executable, str(script), "--device", "cpu", "--tiny", "--store-dir", str(store_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    results = [json.loads(line[len("RESULT ") :]) for line in lines if line.startswith("RESULT ")]
    by_config = {r["config"]: r for r in results}
    configs = {"fsdp", "fsdp_repeat", "fsdp_ckpt", "fsdp_cpu_offload", "fsdp_cpu_offload_ckpt", "fsdp_teraio"}
    configs.add("fsdp_cpu_offload_teraio")
    assert set(by_config) == configs, done.stdout[-4000:]
    for result in results:
        assert result["ok"], result
        assert len(result["ranks"]) == 2 and result["ms_per_iter"] > 0
    teraio_run = by_config["fsdp_teraio"]
    assert teraio_run["losses_bitwise_equal"], teraio_run
    assert by_config["fsdp_repeat"]["losses_bitwise_equal"], by_config["fsdp_repeat"]
    for rank in teraio_run["ranks"]:
        # Its plan fits half of the rank's peak, by moving or recomputing activations (the block
        # plan, the default for this model) and moving optimizer state.
        assert rank["plan"] == "BlockReport" and rank["planned_peak_bytes"] <= rank["budget_bytes"], rank
        moved = sum(rank["tiers"][tier]["offloaded"] for tier in ("host", "ssd"))
        assert moved + rank["recomputed_bytes"] > 0, rank
    # FSDP's CPUOffloadPolicy inside teraio.offload: the kernel stepped the host shards.
    for rank in by_config["fsdp_cpu_offload_teraio"]["ranks"]:
        assert rank["host_step"]["by"].startswith("the engine's kernel"), rank["host_step"]
        assert rank["host_step"]["steps"] > 0, rank["host_step"]


def _block_rank_main(rank: int, tmp: str, store_root: str) -> None:
    """The block plan under FSDP2: each rank plans for its own budget (rank 0 a tight one, rank
    1 a roomy one), so the ranks' plans differ; FSDP's collectives must not, and teraio's one
    exchange of predictions must come at the same step on both."""
    torch.set_num_threads(1)
    os.environ["TERAIO_TEST_RANK"] = str(rank)
    out = pathlib.Path(tmp)
    _init(str(out / "rendezvous-block"))
    per = ROWS // WORLD
    data = [x[rank * per : (rank + 1) * per] for x in batches(BLOCK_STEPS, rows=ROWS)]
    model, optimizer = _build()
    plain_calls: list[Any] = []
    with _recording_collectives(plain_calls):
        plain = train(model, optimizer, data)
    plain_shards = local_shards(model)
    shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())

    store = rank_store(store_root, f"block{rank}")
    # Parameters, gradients and the optimizer state (4x the shards) are all on the device in the
    # step; rank 0's budget leaves little more for activations, rank 1's plenty.
    budget = 4 * shard_bytes + (shard_bytes // 4 if rank == 0 else 64 * shard_bytes)
    try:
        model, optimizer = _build()
        calls: list[Any] = []
        options = dict(store=store, gpu_memory=budget, reserve=0, min_bytes=16 << 10, ssd_bandwidth="2GB/s")
        # The steps at which teraio exchanged its predictions with the other rank.
        exchanges: list[int] = []
        exchange = sharded.exchange

        def counted(value: Any) -> Any:
            exchanges.append(run.step)
            return exchange(value)

        sharded.exchange = counted
        try:
            with _recording_collectives(calls), teraio.offload(model, optimizer, **options) as run:
                losses = train(model, optimizer, data)
        finally:
            sharded.exchange = exchange
        report = run.report()
        result = {
            "kind": type(run).__name__,
            # The plan the rank chose (its actions in the last steps may be the timed trial's).
            "chosen": report.choice.get("plan", {}),
            "choice": {k: v for k, v in report.choice.items() if k != "plan"},
            "trial_steps": run.TRIAL_STEPS,
            "report_text": str(report),
            "ranks": report.ranks,
            "predicted": report.predicted_iteration_ms,
            "exchanges": exchanges,
            "measuring_steps": run.MEASURING_STEPS,
        }
    finally:
        store.close()
    result.update(
        plain=plain,
        losses=losses,
        plain_calls=plain_calls,
        calls=calls,
        shards_equal=same_shards(model, plain_shards),
    )
    (out / f"block{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# The measuring steps (3), both sides of the A/B trial (2 x 4) and one settled step.
BLOCK_STEPS = 12


def test_fsdp2_block_plan_per_rank(store_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The block plan (the default for a model with repeated blocks) under FSDP2: each rank's plan
    follows its own budget, the losses and shards are bitwise those of plain FSDP2, and every rank
    runs the same collectives in the same order as plain FSDP2. The ranks exchange their
    predictions once, at the same step, and each reports the ranks' iteration and its wait."""
    spawn_ranks(_block_rank_main, (str(tmp_path), str(store_dir)), WORLD, DEADLINE_S)
    ranks = [json.loads((tmp_path / f"block{r}.json").read_text()) for r in range(WORLD)]
    for result in ranks:
        print(result["report_text"])
        assert result["kind"] == "BlockOffload"
        assert result["losses"] == result["plain"], [a - b for a, b in zip(result["losses"], result["plain"])]
        assert result["shards_equal"]
        assert result["calls"] and result["calls"] == result["plain_calls"] == ranks[0]["calls"]
    # The roomy rank keeps every block; the tight one cannot (how many it keeps once its state
    # moves out depends on the times it measured: 0 or 1 blocks here).
    tight, roomy = ranks
    assert roomy["chosen"]["keep"] == LAYERS, roomy["report_text"]
    assert tight["chosen"]["keep"] < LAYERS, tight["report_text"]

    # The ranks exchanged their predictions once, at the same step whatever their budgets, and
    # each predicts the ranks' iteration: the measured one (the larger rank's, each with the
    # ranks' least first segment) plus, per segment between collectives, the larger change
    # either rank's plan makes to it. Then the A/B trial in step: an exchange as the plan's first
    # half ends (whether to try checkpointing every block) and, where they tried, one as the
    # plan's second half ends; both ranks keep the side whose slower rank is faster.
    assert tight["ranks"]["segments_ms"] == roomy["ranks"]["segments_ms"]
    for key in ("kept", "ranks"):
        assert tight["choice"].get(key) == roomy["choice"].get(key), (tight["choice"], roomy["choice"])
    assert tight["ranks"]["side"] == roomy["ranks"]["side"]
    measuring, trial = tight["measuring_steps"], tight["trial_steps"]
    tried = "checkpoint_all_ms" in roomy["choice"]
    expected = [measuring - 1, measuring + trial // 2 - 1] + ([measuring + 2 * trial - 1] if tried else [])
    assert tight["exchanges"] == roomy["exchanges"] == expected, (tight["exchanges"], roomy["exchanges"])
    if tried:
        agreed = roomy["choice"]["ranks"]
        assert agreed["checkpoint_all_ms"] == max(r["choice"]["checkpoint_all_ms"] for r in ranks)
        assert agreed["plan_ms"] == max(r["chosen"]["trial_ms"] for r in ranks)
        kept = "plan" if agreed["plan_ms"] < agreed["checkpoint_all_ms"] else "checkpoint every block"
        assert roomy["choice"]["kept"] == kept
    for rank, result in enumerate(ranks):
        got = result["ranks"]
        assert got["ranks"] == WORLD and got["planned_at_step"] == result["measuring_steps"] - 1
        segments = got["segments_ms"][got["side"]]
        baselines = got["segments_ms"]["checkpoint_all"]
        changes = [[p - b for p, b in zip(*pair)] for pair in zip(segments, baselines)]
        first = min(b[0] for b in baselines)
        group = max(sum(b[1:]) + first for b in baselines) + sum(max(column) for column in zip(*changes))
        assert result["predicted"] == got["group_predicted_ms"] == pytest.approx(group)
        assert got["own_predicted_ms"] == pytest.approx(sum(segments[rank]))
        assert got["per_rank_predicted_ms"] == pytest.approx([sum(s) for s in segments])
        # Each rank's own, with the ranks' least first segment, is at most the ranks'.
        own = [sum(s) - b[0] + first for s, b in zip(segments, baselines)]
        assert got["group_predicted_ms"] >= max(own) - 1e-6
        assert got["predicted_wait_ms"] == pytest.approx(group - own[rank])
        assert f"ranks: {WORLD}, tied by FSDP's collectives" in result["report_text"]
        other = 1 - rank
        if got["predicted_wait_ms"] > 0:  # a rank that waits says for whom
            assert f"ms for rank {other} per iteration" in result["report_text"], result["report_text"]
    assert tight["predicted"] == roomy["predicted"]


HOST_STEPS = 6


def _host_build(optimizer_class: Any = None) -> tuple[Any, Any]:
    """tiny.py's model sharded with FSDP2's CPUOffloadPolicy on a CPU mesh: FSDP keeps the shards
    and their gradients "on the host" and the optimizer steps there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    model, _ = make(layers=LAYERS)
    mesh = init_device_mesh("cpu", (WORLD,))
    shard_layers(model, mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    if optimizer_class is None:
        # The kernel's bits are torch's fused CPU AdamW's.
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return model, optimizer_class(model.parameters(), lr=1e-2, momentum=0.9)


def _host_train(model: Any, optimizer: Any, data: list[Any], seen: list[bool]) -> list[float]:
    """Two micro-batches per step, a clip at 0.5, a scheduler's lr: the loop users write."""
    losses = []
    for first, second in zip(data[::2], data[1::2]):
        loss = model(first)
        loss.backward()
        loss = loss + 0 * model(second).detach()  # the first micro-batch's loss is the one logged
        model(second).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        seen.append(all(p.grad is not None for p in model.parameters()))  # the step leaves them
        optimizer.zero_grad(set_to_none=True)
        for group in optimizer.param_groups:
            group["lr"] *= 0.9
        losses.append(loss.item())
    return losses


def _late_clip_train(model: Any, optimizer: Any, data: list[Any]) -> list[float]:
    """A plain loop that starts clipping (at a norm no gradient reaches) after LATE_CLIP steps."""
    losses = []
    for index, x in enumerate(data):
        loss = model(x)
        loss.backward()
        if index >= LATE_CLIP:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


LATE_CLIP = 6


def _host_rank_main(rank: int, tmp: str, store_root: str) -> None:
    torch.set_num_threads(1)
    out = pathlib.Path(tmp)
    init_group(str(out / "rendezvous"), rank, WORLD)
    per = ROWS // WORLD
    data = [x[rank * per : (rank + 1) * per] for x in batches(2 * HOST_STEPS, rows=ROWS)]
    save_at = HOST_STEPS // 2
    result: dict[str, Any] = {"rank": rank}

    model, optimizer = _host_build()
    plain = _host_train(model, optimizer, data, [])
    plain_shards, plain_state = local_shards(model), _state(optimizer)

    store = rank_store(store_root, f"host{rank}")
    options = dict(store=store, gpu_memory=1 << 30, host_memory=1 << 20, reserve=0, min_bytes=16 << 10)
    options.update(ssd_bandwidth="2GB/s", host_link_bandwidth="25GB/s")
    checkpoint = str(out / "checkpoint")
    try:
        model, optimizer = _host_build()
        seen: list[bool] = []
        with teraio.offload(model, optimizer, **options) as run:
            losses = _host_train(model, optimizer, data[: 2 * save_at], seen)
            save_checkpoint(model, optimizer, checkpoint)
            losses += _host_train(model, optimizer, data[2 * save_at :], seen)
        report = run.report()
        result.update(host_step=report.host_step, report_text=str(report), seen=seen)
        result["shards_equal"] = same_shards(model, plain_shards)
        state = _state(optimizer)
        result["state_equal"] = len(state) == len(plain_state) and all(
            torch.equal(a, b) for a, b in zip(state, plain_state)
        )

        # A fresh model and optimizer resume from the checkpoint (the lr as the loop left it).
        model, optimizer = _host_build()
        with teraio.offload(model, optimizer, **options):
            load_checkpoint(model, optimizer, checkpoint)
            resumed = _host_train(model, optimizer, data[2 * save_at :], [])
        result["resumed_shards_equal"] = same_shards(model, plain_shards)

        # A plain loop: "auto" steps in backward from the second step, bitwise the same; a clip
        # that scales nothing then stands and turns it off.
        model, optimizer = _host_build()
        reference = _late_clip_train(model, optimizer, data)
        reference_shards = local_shards(model)
        model, optimizer = _host_build()
        with teraio.offload(model, optimizer, **options) as run:
            in_backward = _late_clip_train(model, optimizer, data)
        result.update(in_backward_equal=in_backward == reference, in_backward_step=run.report().host_step)
        result["in_backward_shards_equal"] = same_shards(model, reference_shards)
        # step_in_backward=True in loops it cannot serve: raised, saying why.
        raised = []
        for loop in ("clip", "accumulate"):
            model, optimizer = _host_build()
            try:
                with teraio.offload(model, optimizer, step_in_backward=True, **options):
                    if loop == "clip":
                        model(data[0]).backward()
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                        optimizer.step()
                    else:
                        model(data[0]).backward()
                        model(data[1]).backward()
            except RuntimeError as error:
                raised.append(str(error))
        result["raised"] = raised

        # An optimizer the kernel does not run: its own step, said in the report.
        model, optimizer = _host_build(torch.optim.SGD)
        sgd_plain = _host_train(model, optimizer, data[:4], [])
        model, optimizer = _host_build(torch.optim.SGD)
        with teraio.offload(model, optimizer, **options) as run:
            sgd = _host_train(model, optimizer, data[:4], [])
        result.update(sgd_equal=sgd == sgd_plain, sgd_host_step=run.report().host_step)
    finally:
        store.close()
    result.update(plain=plain, losses=losses, resumed=resumed)
    (out / f"host{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_fsdp2_host_shards_stepped_by_the_kernel(store_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """FSDP2's CPUOffloadPolicy under `teraio.offload`: the engine's kernel steps the host shards
    (bitwise torch's fused CPU AdamW, through accumulation, a clip and a scheduler), the loop sees
    its gradients after the step, a DCP checkpoint resumes bitwise, and an optimizer the kernel
    does not run steps itself with the reason in the report."""
    spawn_ranks(_host_rank_main, (str(tmp_path), str(store_dir)), WORLD, DEADLINE_S)
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"host{rank}.json").read_text())
        print(result["report_text"])
        host_step = result["host_step"]
        assert host_step["by"].startswith("the engine's kernel"), host_step
        assert host_step["steps"] == HOST_STEPS and host_step["elements"] > 0
        assert "host shards (FSDP2 CPUOffloadPolicy)" in result["report_text"]
        assert result["losses"] == result["plain"], [a - b for a, b in zip(result["losses"], result["plain"])]
        assert result["shards_equal"] and result["state_equal"]
        assert result["seen"] == [True] * HOST_STEPS
        assert result["resumed"] == result["plain"][HOST_STEPS // 2 :]
        assert result["resumed_shards_equal"]
        assert result["sgd_equal"]
        # The plain loop: in backward from the second step, bitwise.
        in_backward = result["in_backward_step"]
        assert in_backward["in_backward"] == f"off from step {LATE_CLIP + 1}: the loop clips", in_backward
        assert in_backward["steps_in_backward"] == LATE_CLIP + 1 - 1, in_backward
        assert result["in_backward_equal"] and result["in_backward_shards_equal"]
        # The accumulating, clipping loop above: learnt, and left at optimizer.step().
        assert host_step["in_backward"].startswith("off: the loop accumulates"), host_step
        assert host_step["steps_in_backward"] == 0
        clip, accumulate = result["raised"]
        assert "clip_grads_with_norm_ after backward" in clip and "step_in_backward=False" in clip, clip
        assert "a second backward" in accumulate, accumulate
        assert result["sgd_host_step"]["by"].startswith("the optimizer: the optimizer is a SGD")


def _shard_rank_main(rank: int, tmp: str, store_root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    out = pathlib.Path(tmp)
    init_group(str(out / "rendezvous-shard"), rank, WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    result: dict[str, Any] = {}
    choices = {
        # The rank's share does not fit 64 KiB of GPU memory and does fit 1 GiB of host memory.
        "tight": dict(gpu_memory="64KiB", host_memory="1GiB"),
        "roomy": dict(gpu_memory="1GiB", host_memory="1GiB"),
        "no_host_room": dict(gpu_memory="64KiB", host_memory="1KiB"),
        "forced": dict(host_shards=True),
    }
    for name, given in choices.items():
        model, _ = make(layers=LAYERS)
        choice = teraio.shard(model, mesh=mesh, **given)
        result[name] = dict(
            host=choice.host_shards,
            blocks=choice.blocks,
            text=str(choice),
            on_host=len(sharded.host_shards(model)),
            params=len(list(model.parameters())),
        )
        if name == "tight":
            # The model it shards trains inside teraio.offload, its host shards on the kernel.
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            store = rank_store(store_root, f"shard{rank}")
            try:
                with teraio.offload(
                    model, optimizer, store=store, gpu_memory=1 << 30, host_memory=1 << 20, reserve=0
                ) as run:
                    train(model, optimizer, [x[:64] for x in batches(3, rows=128)])
                result["host_step"] = run.report().host_step
            finally:
                store.close()
            with pytest.raises(ValueError, match="already sharded"):
                teraio.shard(model, mesh=mesh)
    (out / f"shard{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_shard_chooses_host_shards_where_the_state_does_not_fit(
    store_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """`teraio.shard`: each block then the root, with CPUOffloadPolicy where the rank's share of
    parameters, gradients and AdamW state does not fit the GPU and fits host memory; the model it
    shards that way trains with teraio's kernel stepping its host shards."""
    spawn_ranks(_shard_rank_main, (str(tmp_path), str(store_dir)), WORLD, DEADLINE_S)
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"shard{rank}.json").read_text())
        tight, roomy, no_room, forced = (result[k] for k in ("tight", "roomy", "no_host_room", "forced"))
        assert tight["host"] and tight["on_host"] == tight["params"] and tight["blocks"] == LAYERS, tight
        assert "in host memory (CPUOffloadPolicy)" in tight["text"] and "do not fit" in tight["text"]
        assert not roomy["host"] and roomy["on_host"] == 0 and "they fit" in roomy["text"], roomy
        assert not no_room["host"] and "neither does host memory" in no_room["text"], no_room
        assert forced["host"] and forced["on_host"] == forced["params"], forced
        assert result["host_step"]["by"].startswith("the engine's kernel"), result["host_step"]
        assert result["host_step"]["steps"] == 3
    with pytest.raises(ValueError, match="host_shards must be"):
        teraio.shard(torch.nn.Linear(2, 2), host_shards="yes")
    # The budgets resolve as teraio.offload resolves them, before anything is sharded.
    with pytest.raises(ValueError, match="more than this machine has available"):
        teraio.shard(torch.nn.Linear(2, 2), mesh=_CpuMesh(), gpu_memory="1GiB", host_memory="1000TiB")
    with pytest.raises(ValueError, match="gpu_memory is required on a CPU device, to choose host shards"):
        teraio.shard(torch.nn.Linear(2, 2), mesh=_CpuMesh())


class _CpuMesh:
    """What `teraio.shard` reads of a mesh before it shards: its device type (no process group)."""

    device_type = "cpu"
