"""The executor on a CPU "device" with a small memory budget: bitwise-equal training."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import teraio  # noqa: E402
from tiny import batches, make, train  # noqa: E402

STEPS = 6
ROWS = 2048


def _reference() -> tuple[list[float], dict[str, Any]]:
    model, optimizer = make()
    losses = train(model, optimizer, batches(STEPS, rows=ROWS))
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _unplanned_peak_and_activations() -> tuple[int, int]:
    model, optimizer = make()
    data = batches(2, rows=ROWS)
    train(model, optimizer, data[:1])
    profiler = teraio.Profiler(model, optimizer)
    with profiler:
        train(model, optimizer, data[1:])
    trace = profiler.trace()
    result = teraio.plan(trace, gpu_memory=1 << 40, ssd_read_bandwidth=1e9)
    activations = sum(t["size_bytes"] for t in trace["tensors"] if t["kind"] == "activation")
    return result["prediction"]["unplanned_peak_bytes"], activations


def _offloaded_run(**options: Any) -> tuple[list[float], dict[str, Any], teraio.Report, Any]:
    model, optimizer = make()
    # A fixed link: a measured one drops on a loaded machine, where recomputing then looks
    # cheaper than the moves these tests check.
    options = {"host_link_bandwidth": "10GB/s", **options}
    with teraio.offload(
        model, optimizer, min_bytes=64 << 10, reserve=0, **options, granularity="tensor"
    ) as run:
        losses = train(model, optimizer, batches(STEPS, rows=ROWS))
    return losses, model.state_dict(), run.report(), run


def _assert_same(
    reference: tuple[list[float], dict[str, Any]], losses: list[float], state: dict[str, Any]
) -> None:
    ref_losses, ref_state = reference
    assert losses == ref_losses  # bitwise: float equality of every loss
    for name, value in ref_state.items():
        assert torch.equal(state[name], value), name


def test_host_tier_bitwise_equal() -> None:
    reference = _reference()
    peak, activations = _unplanned_peak_and_activations()
    budget = peak - activations // 2
    losses, state, report, run = _offloaded_run(gpu_memory=budget, host_memory=1 << 30)
    _assert_same(reference, losses, state)
    assert report.plan_summary["fits"] is True
    assert report.plan_summary["host_migrations"] > 0
    assert report.planned_steps == STEPS - 2
    moved = report.bytes_per_iteration
    assert moved["offloaded"]["host"] >= activations // 2 * 0.5
    assert moved["prefetched"]["host"] == moved["offloaded"]["host"]
    assert moved["offloaded"]["ssd"] == 0
    assert report.stalls["plan_mismatches"] == 0
    assert report.stalls["prefetches_planned"] > 0
    assert report.predicted_peak_bytes is not None and report.predicted_peak_bytes <= budget
    assert report.unplanned_peak_bytes == pytest.approx(peak, rel=0.01)


def test_ssd_tier_bitwise_equal(store: teraio.Store, tmp_path: pathlib.Path) -> None:
    reference = _reference()
    peak, activations = _unplanned_peak_and_activations()
    trace_path = tmp_path / "trace.json"
    losses, state, report, _ = _offloaded_run(
        gpu_memory=peak - activations // 2,
        host_memory=0,
        store=store,
        ssd_bandwidth="2GB/s",
        trace_path=str(trace_path),
    )
    _assert_same(reference, losses, state)
    assert report.plan_summary["ssd_migrations"] > 0 and report.plan_summary["host_migrations"] == 0
    moved = report.bytes_per_iteration
    assert moved["offloaded"]["ssd"] > 0 and moved["offloaded"]["host"] == 0
    assert moved["prefetched"]["ssd"] == moved["offloaded"]["ssd"]
    teraio.validate_trace(trace_path.read_text())
    # The executor wrote its objects through the engine and deleted them when the block ended.
    assert report.plan_summary["ssd_migrations"] > 0
    assert store.info()["object_count"] == 0
    io = store.stats()
    assert io["write_bytes"] >= moved["offloaded"]["ssd"] * 4  # 4 planned steps, plus the fallback ones
    assert io["read_bytes"] >= moved["prefetched"]["ssd"] * 4
    assert io["errors"] == 0


def test_tiny_budget_still_exact_with_on_demand_fetches(store: teraio.Store) -> None:
    # A budget below the persistent tensors cannot fit: with if_no_fit="run" the plan says so,
    # and training stays exact.
    reference = _reference()
    losses, state, report, _ = _offloaded_run(
        gpu_memory=1 << 20, host_memory=1 << 20, store=store, if_no_fit="run", whole_model="off"
    )
    _assert_same(reference, losses, state)
    assert report.plan_summary["fits"] is False


def test_budget_below_parameters_is_refused_before_training() -> None:
    model, optimizer = make()
    with pytest.raises(teraio.NoPlanFitsError, match="cannot hold the parameters"):
        with teraio.offload(
            model, optimizer, gpu_memory=1 << 10, host_memory=1 << 20, whole_model="off", granularity="tensor"
        ):
            pytest.fail("the block must not start")


def test_no_plan_fits_is_a_clear_error_before_the_planned_steps() -> None:
    # Parameters fit, but not the optimizer step's state with them (no host memory to move to).
    model, optimizer = make()
    params = sum(p.numel() * 4 for p in model.parameters())
    data = batches(STEPS, rows=ROWS)
    steps = 0
    with pytest.raises(teraio.NoPlanFitsError, match="no plan fits"):
        with teraio.offload(
            model,
            optimizer,
            gpu_memory=params * 2 + (64 << 10),
            host_memory=0,
            reserve=0,
            whole_model="off",
            granularity="tensor",
        ):
            for x in data:
                model(x).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
    assert steps == 1  # raised in the profiled step, before any planned one


def test_restored_copies_are_released_after_backward() -> None:
    # A restored activation must live only as long as autograd needs it: the executor may not
    # keep offloaded storages (or their GPU copies) alive past backward.
    peak, activations = _unplanned_peak_and_activations()
    model, optimizer = make()
    data = batches(4, rows=ROWS)
    with teraio.offload(
        model,
        optimizer,
        gpu_memory=peak - activations // 2,
        reserve=0,
        min_bytes=64 << 10,
        host_memory=1 << 30,
        host_link_bandwidth="10GB/s",
        granularity="tensor",
    ) as run:
        for x in data:
            loss = model(x)
            assert run.executor.live_slots() > 0
            loss.backward()
            assert run.executor.live_slots() == 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert run.executor.stats.offloads > 0


def test_report_text_mentions_figures() -> None:
    peak, activations = _unplanned_peak_and_activations()
    _, _, report, _ = _offloaded_run(gpu_memory=peak - activations // 2, host_memory=1 << 30)
    text = str(report)
    assert "measured" in text and "predicted" in text and "offloaded per iteration" in text
    assert "phases: between" in text and set(report.phases_ms) == {"between", "forward", "backward", "step"}
    assert "host time in teraio per iteration: hooks" in text
    host = report.host_ms_per_iteration
    assert host["hooks"] > 0 and host["before step"] >= 0 and host["after step"] >= 0
    assert host["of which copy waits"] <= host["hooks"] and host["of which SSD waits"] <= host["hooks"]


def test_prefetches_at_one_event_go_earliest_need_first() -> None:
    from teraio.runtime.modes.activations import ActivationExecutor
    from teraio.runtime.movers.tiers import HOST
    from teraio.runtime.plans.tensor import PackDecision

    executor = ActivationExecutor(torch.device("cpu"), host_memory_bytes=2 << 30, pull_forward_bytes=0)
    executor.set_plan(
        [
            PackDecision(1, 1 << 30, HOST, prefetch_event=5, need_event=9),
            PackDecision(2, 1 << 20, HOST, prefetch_event=5, need_event=6),
            PackDecision(3, 1 << 20, None),
            PackDecision(4, 1 << 20, HOST, prefetch_event=5, need_event=None),
            PackDecision(5, 1 << 20, HOST, prefetch_event=5, need_event=6),
            PackDecision(6, 1 << 20, HOST, prefetch_event=7, need_event=8),
        ]
    )
    assert executor.prefetch_at_event == {5: [1, 4, 0, 3], 7: [5]}
    with pytest.raises(ValueError, match="copy_streams must be >= 1"):
        ActivationExecutor(torch.device("cpu"), copy_streams=0)


def test_prefetch_needed_before_a_large_one_is_pulled_ahead_of_it() -> None:
    from teraio.runtime.modes.activations import ActivationExecutor
    from teraio.runtime.movers.tiers import HOST
    from teraio.runtime.plans.tensor import PackDecision

    mib = 1 << 20

    def plan() -> list[PackDecision]:
        return [
            # The large one: issued at 50, needed at 90.
            PackDecision(1, 1024 * mib, HOST, prefetch_event=50, need_event=90, pack_event=1),
            # Issued at 52 and 60, needed at 70: they would queue behind it.
            PackDecision(2, 176 * mib, HOST, prefetch_event=52, need_event=70, pack_event=2),
            PackDecision(3, 240 * mib, HOST, prefetch_event=60, need_event=70, pack_event=3),
            # Needed after it: stays.
            PackDecision(4, 64 * mib, HOST, prefetch_event=55, need_event=95, pack_event=4),
            # Issued after its need: stays.
            PackDecision(5, 64 * mib, HOST, prefetch_event=91, need_event=99, pack_event=5),
            # Saved after event 50: cannot be issued there (and 64 MiB holds no one up at 55).
            PackDecision(6, 64 * mib, HOST, prefetch_event=56, need_event=80, pack_event=53),
        ]

    cpu = torch.device("cpu")
    # Default: 512 MiB per event, 256 MiB each. Pulled ones stay listed at their planned event
    # too (issued there if memory had no room early; skipped there once issued).
    executor = ActivationExecutor(cpu, host_memory_bytes=4 << 30)
    executor.set_plan(plan())
    assert executor.prefetch_at_event == {50: [1, 2, 0], 52: [1], 55: [3], 56: [5], 60: [2], 91: [4]}
    assert executor._pulled == {50: {1, 2}}
    assert executor.stats.prefetches_pulled_forward == 2
    # 400 MiB per event: 200 MiB each, so the 240 MiB one stays.
    executor = ActivationExecutor(cpu, host_memory_bytes=4 << 30, pull_forward_bytes=400 * mib)
    executor.set_plan(plan())
    assert executor._pulled == {50: {1}}
    assert executor.prefetch_at_event[50] == [1, 0]
    # None pulled.
    executor = ActivationExecutor(cpu, host_memory_bytes=4 << 30, pull_forward_bytes=0)
    executor.set_plan(plan())
    assert executor._pulled == {} and executor.prefetch_at_event[50] == [0]


class _Copy:
    """A stand-in for a CUDA event: done or not."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_prefetch_stream_choice_lets_an_urgent_copy_pass_a_later_one() -> None:
    from teraio.runtime.modes.activations import ActivationExecutor

    executor = ActivationExecutor(torch.device("cpu"), copy_streams=2)
    choose = executor._prefetch_stream
    assert choose(10) == 0  # both free: the first
    big = _Copy(False)
    executor._h2d_last = [(big, 30), None]
    assert choose(20) == 1  # the other stream is free
    executor._h2d_last = [(big, 30), (_Copy(False), 15)]
    # Needed at 20: not behind the copy needed at 30; behind the one needed at 15.
    assert choose(20) == 1
    # Needed at 40: behind either; the one needed latest (30) keeps stream 1 for urgent copies.
    assert choose(40) == 0
    # Needed at 5, before both: behind the one needed first.
    assert choose(5) == 1
    # A deadline unknown counts as last.
    assert choose(None) == 0
    executor._h2d_last = [(big, 30), (_Copy(True), 50)]
    assert choose(100) == 1  # a finished copy leaves its stream free
    assert executor.stats.prefetches_per_stream == [3, 4]


def test_prefetch_streams_spread_copies_in_flight() -> None:
    from teraio.runtime.modes.activations import ActivationExecutor

    executor = ActivationExecutor(torch.device("cpu"), copy_streams=3)
    # Copies still in flight each take another stream: three in a row use all three.
    chosen = []
    for need in (4, 5, 6):
        index = executor._prefetch_stream(need)
        executor._h2d_last[index] = (_Copy(False), need)
        chosen.append(index)
    assert chosen == [0, 1, 2] and executor.stats.prefetches_per_stream == [1, 1, 1]
    # A stream whose last copy is done comes first...
    executor._h2d_last = [(_Copy(False), 5), (_Copy(True), 9), None]
    assert executor._prefetch_stream(7) == 1
    # ...else the stream whose last copy is needed no later than this one (the latest of those)...
    executor._h2d_last = [(_Copy(False), 3), (_Copy(False), 6), (_Copy(False), 9)]
    assert executor._prefetch_stream(7) == 1
    # ...else the one whose last copy is needed first.
    assert executor._prefetch_stream(2) == 0


@pytest.mark.parametrize(
    ("options", "mode"),
    [
        ({"granularity": "tensor", "gpu_memory": 1 << 40, "min_bytes": 64 << 10}, "tensor"),
        ({"granularity": "block", "gpu_memory": 1 << 40}, "block"),
        ({"whole_model": "on", "gpu_memory": 1 << 30, "host_memory": 1 << 30}, "whole-model"),
    ],
)
def test_every_mode_reports_one_report_type(options: dict[str, Any], mode: str) -> None:
    # Whichever mode runs, the report is a teraio.Report: the fields every mode fills, then the
    # mode's own section, all of them flat in as_dict().
    model, optimizer = make()
    with teraio.offload(model, optimizer, reserve=0, **options) as run:
        train(model, optimizer, batches(4, rows=256))
    report = run.report()
    assert isinstance(report, teraio.Report) and report.mode == mode
    assert report.steps == 4 and len(report.step_times_ms) == 4
    assert report.gpu_memory_bytes == options["gpu_memory"]
    common = {f.name for f in dataclasses.fields(teraio.Report)}
    fields = report.as_dict()
    assert common <= set(fields) and fields["mode"] == mode
    assert len(fields) > len(common)  # the mode's section
