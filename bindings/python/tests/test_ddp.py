"""DistributedDataParallel with `teraio.offload` on a CPU "device": 2 gloo ranks, one store each.

Two processes (torch.multiprocessing, spawn; a file rendezvous, so no port) each train tiny.py's
model on their half of every global batch, wrapped in DDP, twice: plain, then inside
`teraio.offload` with a budget below the unplanned peak and little host memory, so activations
go to host memory and to the rank's own store (TERAIO_TEST_DIR, conftest.py). Checks:

(a) the offloaded run's global losses (the mean of the rank losses) and final parameters are
    bitwise the plain run's: offload restores the same bytes, so every rank computes the same
    gradients, and gloo's all-reduce of the same inputs in the same buckets is deterministic;
(b) both match one process training on the whole global batch within rel 1e-5 (the sums are
    split and added in another order, so only up to rounding).

    TERAIO_TEST_DIR=$PWD/target/py-test-stores python -m pytest -q bindings/python/tests/test_ddp.py -s
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import teraio  # noqa: E402
from ranks import init_group, rank_store, spawn_ranks  # noqa: E402
from tiny import batches, make, train  # noqa: E402

WORLD = 2
STEPS = 6
ROWS = 2048  # global batch; each rank trains ROWS // WORLD rows of it
DEADLINE_S = 120.0

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is needed"
)


def _peak_and_activations(rows: int) -> tuple[int, int]:
    """Unplanned peak and activation bytes of one rank's iteration (profiled without DDP)."""
    model, optimizer = make()
    data = batches(2, rows=ROWS)
    train(model, optimizer, [x[:rows] for x in data[:1]])
    profiler = teraio.Profiler(model, optimizer)
    with profiler:
        train(model, optimizer, [x[:rows] for x in data[1:]])
    trace = profiler.trace()
    result = teraio.plan(trace, gpu_memory=1 << 40, ssd_read_bandwidth=1e9)
    activations = sum(t["size_bytes"] for t in trace["tensors"] if t["kind"] == "activation")
    return result["prediction"]["unplanned_peak_bytes"], activations


def _train_ddp(
    rank: int, world: int, data: list[Any], options: Optional[dict[str, Any]]
) -> tuple[list[float], dict[str, Any], Optional[dict[str, Any]]]:
    """DDP training from tiny.make()'s seed; `options`: inside teraio.offload with these."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, optimizer = make()
    ddp = DDP(model)
    losses: list[float] = []
    handle = None
    if options is not None:
        handle = teraio.offload(ddp, optimizer, **options, granularity="tensor")
        handle.__enter__()
    try:
        for x in data:
            loss = ddp(x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)  # SUM: ReduceOp.AVG is NCCL-only
            losses.append((total / world).item())
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)
    report = handle.report().as_dict() if handle is not None else None
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, report


def _rank_main(
    rank: int, init_file: str, out_dir: str, store_root: str, budget: int, host_memory: int
) -> None:
    # One thread per rank (2 ranks on small CI machines); the plain and offloaded runs below share it.
    torch.set_num_threads(1)
    init_group(init_file, rank, WORLD)
    try:
        per = ROWS // WORLD
        data = [x[rank * per : (rank + 1) * per] for x in batches(STEPS, rows=ROWS)]
        plain_losses, plain_state, _ = _train_ddp(rank, WORLD, data, None)
        store = rank_store(store_root, f"rank{rank}")
        try:
            options = dict(
                store=store,
                gpu_memory=budget,
                host_memory=host_memory,
                reserve=0,
                min_bytes=64 << 10,
                ssd_bandwidth="2GB/s",
                # DDP rebuilds its buckets in iteration 1: profile iteration 2, a steady one.
                warmup_steps=2,
            )
            losses, state, report = _train_ddp(rank, WORLD, data, options)
            objects_left = store.info()["object_count"]
            io = store.stats()
        finally:
            store.close()
        out = pathlib.Path(out_dir)
        torch.save({"plain": plain_state, "offload": state}, out / f"state{rank}.pt")
        result = {
            "rank": rank,
            "plain_losses": plain_losses,
            "losses": losses,
            "report": report,
            "objects_left": objects_left,
            "store_write_bytes": io["write_bytes"],
            "store_read_bytes": io["read_bytes"],
            "store_errors": io["errors"],
        }
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _spawn(*args: Any) -> None:
    spawn_ranks(_rank_main, args, WORLD, DEADLINE_S)


def test_ddp_offload_bitwise_equal_and_matches_single_process(
    store_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    peak, activations = _peak_and_activations(ROWS // WORLD)
    budget = peak - activations // 2
    host_memory = activations // 8  # the rest of what the plan moves goes to the rank's store
    _spawn(str(tmp_path / "rendezvous"), str(tmp_path), str(store_dir), budget, host_memory)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    states = [torch.load(tmp_path / f"state{r}.pt") for r in range(WORLD)]

    # Single process, whole global batch, same seeds.
    model, optimizer = make()
    ref_losses = train(model, optimizer, batches(STEPS, rows=ROWS))
    ref_state = model.state_dict()

    for r, result in enumerate(ranks):
        moved = result["report"]["bytes_per_iteration"]
        print(
            f"rank {r}: offloaded per iteration host {moved['offloaded']['host']} B, "
            f"ssd {moved['offloaded']['ssd']} B; stalls {result['report']['stalls']}; "
            f"plan {result['report']['plan_summary']}"
        )
        assert moved["offloaded"]["host"] + moved["offloaded"]["ssd"] > 0
        assert moved["offloaded"]["ssd"] > 0, "the rank's store was not used"
        assert moved["prefetched"] == moved["offloaded"]
        assert result["report"]["stalls"]["plan_mismatches"] == 0
        assert result["store_write_bytes"] > 0 and result["store_read_bytes"] > 0
        assert result["store_errors"] == 0 and result["objects_left"] == 0
        # Every rank saw the same global losses.
        assert result["losses"] == ranks[0]["losses"]
        assert result["plain_losses"] == ranks[0]["plain_losses"]

    # (a) bitwise: losses and parameters (DDP keeps the ranks' parameters equal, too).
    plain_losses, losses = ranks[0]["plain_losses"], ranks[0]["losses"]
    assert losses == plain_losses, [a - b for a, b in zip(losses, plain_losses)]
    for state in states:
        for name, value in states[0]["plain"].items():
            assert torch.equal(state["offload"][name], value), name
            assert torch.equal(state["plain"][name], value), name

    # (b) the single-process reference, up to rounding.
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_diff = max(
        float((states[0]["offload"][name] - value).abs().max()) for name, value in ref_state.items()
    )
    print(
        f"DDP+offload vs single process: max |loss diff| {loss_diff:.3e} (rel {loss_rel:.3e}), "
        f"max |param diff| {param_diff:.3e}; vs DDP plain: bitwise equal"
    )
    assert loss_rel < 1e-5
    assert param_diff < 1e-5


def _probe_rank_main(rank: int, init_file: str, out_dir: str, store_root: str) -> None:
    """Rank `rank` resolves its bandwidths with recording probes; rank 0 has its figures cached
    from an earlier run of the same group size, rank 1 has none."""
    from teraio import machine

    torch.set_num_threads(1)
    init_group(init_file, rank, WORLD)
    try:
        store = rank_store(store_root, f"probe{rank}", 64 << 20)
        calls: list[tuple[str, bool]] = []

        def probe(kind: str, rate: float) -> Any:
            def run(*_: Any) -> Any:
                # Each rank's probe says it started and waits for every other rank's: it finds
                # them only if the probes run at the same time (no rank waits on a clock).
                folder = pathlib.Path(out_dir)
                (folder / f"{kind}-{rank}.started").touch()
                others = [folder / f"{kind}-{r}.started" for r in range(WORLD) if r != rank]
                deadline = time.monotonic() + DEADLINE_S / 4
                while not all(o.exists() for o in others) and time.monotonic() < deadline:
                    time.sleep(0.01)
                calls.append((kind, all(o.exists() for o in others)))
                return (rate, rate, rate) if kind == "link" else (rate, rate)

            return run

        try:
            suffix = f" x{WORLD} ranks"
            if rank == 0:
                cached = {"links": {"cpu" + suffix: {"d2h": 1.0, "h2d": 1.0, "duplex": 1.0}}}
                cached.update({"ssd_write" + suffix: 1.0, "ssd_read" + suffix: 1.0})
                pathlib.Path(machine.cache_path(store)).write_text(json.dumps(cached))
            measured = machine.resolve_bandwidths(
                torch.device("cpu"),
                store,
                want_link=True,
                want_store=True,
                link_probe=probe("link", 7e9),
                store_probe=probe("store", 3e9),
            )
            # A second start finds the figures in the cache: no probe, and still no deadlock.
            again = machine.resolve_bandwidths(
                torch.device("cpu"),
                store,
                want_link=True,
                want_store=True,
                link_probe=probe("link", 1.0),
                store_probe=probe("store", 1.0),
            )
        finally:
            store.close()
        result = {"calls": calls, "measured": measured.__dict__, "again": again.__dict__}
        (pathlib.Path(out_dir) / f"probe{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_ranks_probe_the_machine_together(tmp_path: pathlib.Path, store_dir: pathlib.Path) -> None:
    """Under a process group every rank probes where any rank lacks a cached figure, and the
    ranks' probes overlap in time: each measures its share of what the ranks share."""
    spawn_ranks(
        _probe_rank_main, (str(tmp_path / "rendezvous"), str(tmp_path), str(store_dir)), WORLD, DEADLINE_S
    )
    results = [json.loads((tmp_path / f"probe{rank}.json").read_text()) for rank in range(WORLD)]
    for result in results:
        assert [kind for kind, _ in result["calls"]] == ["link", "store"], result
        assert result["measured"]["link_d2h"] == 7e9 and result["measured"]["ssd_read"] == 3e9
        assert result["again"]["ssd_write"] == 3e9 and "cached" in result["again"]["source"]
        assert "measured x2 ranks" in result["measured"]["source"]
    for result in results:
        assert all(together for _, together in result["calls"]), (
            "the ranks' probes did not run at the same time"
        )
