"""The runtime's defaults: op-time calibration, measured bandwidths cached with the store, the
reserve from the allocator, the options object, the memory fallbacks' accounting."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import teraio  # noqa: E402
from teraio import calibration, machine  # noqa: E402
from teraio.runtime.modes.activations import ActivationExecutor  # noqa: E402
from teraio.runtime.movers.copy import pinned_size  # noqa: E402
from teraio.runtime.movers.tiers import HOST, SSD  # noqa: E402
from teraio.runtime.plans.tensor import PackDecision  # noqa: E402
from tiny import batches, make, train  # noqa: E402


def test_calibration_removes_a_per_op_overhead() -> None:
    # True op times: short elementwise ops and long matmuls; the profiler added 40 us to each.
    true = [15.0] * 60 + [900.0] * 10 + [30.0] * 30
    profiled = [d + 40.0 for d in true]
    fitted = calibration.fit(profiled, sum(true), "blocks")
    assert fitted.method == "overhead"
    assert fitted.overhead_us == pytest.approx(40.0, rel=0.02)
    calibrated = [fitted.apply(d) for d in profiled]
    assert sum(calibrated) == pytest.approx(sum(true), rel=1e-6)
    # Long ops keep their time (no uniform scaling that would shrink the matmuls).
    assert calibrated[60] == pytest.approx(900.0, rel=0.01)
    assert "per-op overhead" in fitted.describe()


def test_calibration_falls_back_to_one_factor() -> None:
    # The measurement is longer than the profile: scaled up, not an overhead.
    fitted = calibration.fit([100.0, 300.0], 800.0)
    assert fitted.method == "scale" and fitted.scale == pytest.approx(2.0)
    assert fitted.apply(100.0) == pytest.approx(200.0)
    # More reduction than the floor allows: one factor too.
    fitted = calibration.fit([100.0, 100.0], 2.0)
    assert fitted.method == "scale"
    assert sum(fitted.apply(d) for d in (100.0, 100.0)) == pytest.approx(2.0)
    assert calibration.fit([], 10.0).method == "none"


def test_offload_calibrates_against_an_unprofiled_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a CPU device with calibration forced on, with fixed times (the CI machine's clock is
    # too noisy to fit on): every op profiled at 1200 us, of which 1000 us are the profiler's
    # (as CUDA events inflate short ops); each block's 4 forward ops measured at 800 us.
    from teraio.runtime.modes import tensor as tensor_mode

    monkeypatch.setattr(teraio.Profiler, "op_durations_us", lambda self: [1200.0] * len(self.ops))
    monkeypatch.setattr(tensor_mode, "_elapsed_ms", lambda first, second: 0.8)
    model, optimizer = make()
    with teraio.offload(
        model,
        optimizer,
        gpu_memory=1 << 30,
        host_memory=1 << 30,
        calibrate=True,
        reserve=0,
        granularity="tensor",
        min_bytes=1 << 10,
    ) as run:
        train(model, optimizer, batches(5, rows=2048))
    report = run.report()
    fitted = run.calibration
    assert fitted.method == "overhead" and fitted.region == "the forward passes of 4 blocks"
    assert fitted.overhead_us == pytest.approx(1000.0, rel=1e-6)
    # The region's calibrated op times add up to its unprofiled measurement.
    assert run.profiler is not None
    durations = run.profiler.op_durations_us()
    region = [d for record in run.block_records.values() for d in durations[record.op_start : record.op_end]]
    assert sum(fitted.apply(d) for d in region) == pytest.approx(fitted.region_measured_us, rel=1e-3)
    # The report's ideal is the calibrated estimate, labelled, well below the inflated profile.
    assert report.profiled_ops_ms is not None and report.ideal_iteration_ms is not None
    assert report.ideal_iteration_ms < report.profiled_ops_ms / 2
    assert (
        "per-op overhead" in report.ideal_source and "measured without per-op events" in report.ideal_source
    )
    assert report.planned_steps == 5 - 3  # warm-up, profiled, calibration


def test_bandwidths_measured_once_and_cached_with_the_store(
    store: teraio.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"link": 0, "store": 0}

    def fake_link(device: torch.device) -> tuple[float, float, float]:
        calls["link"] += 1
        return 20e9, 30e9, 15e9

    def fake_store(store: object, cuda: bool) -> tuple[float, float]:
        calls["store"] += 1
        return 2e9, 3e9

    monkeypatch.setattr(machine, "measure_link", fake_link)
    monkeypatch.setattr(machine, "measure_store", fake_store)
    model, optimizer = make()
    runs = [
        teraio.offload(model, optimizer, store=store, gpu_memory=1 << 30, granularity="tensor")
        for _ in range(2)
    ]
    # The block plan reads the same cache.
    block = teraio.offload(model, optimizer, store=store, gpu_memory=1 << 30)
    assert block.link.d2h == pytest.approx(machine.PLAN_SHARE * runs[0].machine["link_d2h_bytes_per_s"])
    assert block.link.duplex == pytest.approx(machine.PLAN_SHARE * 15e9)
    assert calls == {"link": 1, "store": 1}
    for run in runs:
        assert run.host_link_bandwidth == pytest.approx(machine.PLAN_SHARE * 20e9)
        assert run.ssd_bandwidth == pytest.approx(machine.PLAN_SHARE * 3e9)
        assert run.ssd_write_bandwidth == pytest.approx(machine.PLAN_SHARE * 2e9)
        assert run.ssd_shared is True  # measured one direction at a time
    assert "cached" in runs[1].machine["measured"]
    path = pathlib.Path(machine.cache_path(store))
    assert path.exists() and json.loads(path.read_text())["ssd_read"] == 3e9
    # Given figures are used as they are and measure nothing.
    run = teraio.offload(
        model,
        optimizer,
        store=store,
        gpu_memory=1 << 30,
        ssd_bandwidth="1GB/s",
        ssd_write_bandwidth="1GB/s",
        host_link_bandwidth="5GB/s",
        granularity="tensor",
    )
    assert run.host_link_bandwidth == "5GB/s" and run.ssd_shared is False
    assert calls == {"link": 1, "store": 1}
    # A link cached before the duplex figure existed is measured again (once); the store is not.
    cache = json.loads(path.read_text())
    for figures in cache["links"].values():
        del figures["duplex"]
    path.write_text(json.dumps(cache))
    for _ in range(2):
        block = teraio.offload(model, optimizer, store=store, gpu_memory=1 << 30)
        assert block.link.duplex == pytest.approx(machine.PLAN_SHARE * 15e9)
    assert calls == {"link": 2, "store": 1}


def test_host_memory_is_bounded_by_what_the_machine_has(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meminfo = tmp_path / "meminfo"
    gib = 1 << 30
    # A small machine: the floor of the margin applies.
    meminfo.write_text(f"MemTotal:       {24 * gib // 1024} kB\nMemAvailable:   {20 * gib // 1024} kB\n")
    available, total = machine.available_host_bytes(str(meminfo)), machine.total_host_bytes(str(meminfo))
    assert (available, total) == (20 * gib, 24 * gib)
    assert machine.default_host_memory(available, total) == 20 * gib - machine.HOST_MEMORY_MARGIN_BYTES
    # A large one: a share of MemTotal stays free, and ranks on the host split the rest.
    big = 1000 * gib
    share = int(big * machine.HOST_MEMORY_MARGIN_SHARE)
    assert share > machine.HOST_MEMORY_MARGIN_BYTES
    assert machine.default_host_memory(big, big) == big - share
    assert machine.default_host_memory(big, big, ranks=4) == (big - share) // 4
    # Less available than the margin: nothing is pinned; unreadable: a fixed 4 GiB.
    assert machine.default_host_memory(gib, 2 * gib) == 0
    assert machine.default_host_memory(None) == 4 * gib
    # The session takes it from what the machine reports (fixed here: MemAvailable moves
    # between two reads on a shared machine).
    monkeypatch.setattr(machine, "available_host_bytes", lambda: 20 * gib)
    monkeypatch.setattr(machine, "total_host_bytes", lambda: 24 * gib)
    model, optimizer = make()
    run = teraio.offload(model, optimizer, gpu_memory=1 << 30, host_link_bandwidth="10GB/s")
    assert run.host_memory_bytes == 20 * gib - machine.HOST_MEMORY_MARGIN_BYTES


def test_host_memory_above_what_the_machine_has_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    monkeypatch.setattr(machine, "available_host_bytes", lambda: 20 * gib)
    model, optimizer = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="more than this machine has available"):
        teraio.offload(model, optimizer, gpu_memory=1 << 30, host_memory=21 * gib)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_ranks_on_this_host_follow_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert machine.ranks_on_this_host() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert machine.ranks_on_this_host() == 1  # no process group in this test


def test_reserve_from_the_allocators_slack() -> None:
    gib = 1 << 30
    # Little slack: the floor (a share of the budget).
    assert machine.reserve_from_allocator(20 * gib, 10 * gib, 10 * gib) == int(
        20 * gib * machine.RESERVE_MIN_SHARE
    )
    # Much slack: the slack with a margin.
    slack = 3 * gib
    expected = int(slack * machine.RESERVE_SLACK_FACTOR) + machine.RESERVE_EXTRA_BYTES
    assert machine.reserve_from_allocator(20 * gib, 13 * gib, 10 * gib) == expected
    # Never more than half the budget.
    assert machine.reserve_from_allocator(4 * gib, 10 * gib, 1 * gib) == 2 * gib


def test_unreleasable_memory_is_counted_after_the_allocator_releases_what_it_can(monkeypatch: Any) -> None:
    # A fake allocator: 10 GiB reserved, 6 allocated; releasing its cache leaves 7 reserved (with
    # expandable segments: pages partly used by live blocks). Read before the release, the cache
    # would count as unreleasable.
    gib = 1 << 30
    reserved = [10 * gib]
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: reserved.__setitem__(0, 7 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 6 * gib)
    assert machine.unreleasable_bytes(torch.device("cuda", 0)) == 1 * gib


def test_options_object_and_keywords() -> None:
    options = teraio.OffloadOptions(host_memory="1GiB", recompute="off")
    assert options.replace(recompute="on").recompute == "on"
    with pytest.raises(TypeError, match="unknown teraio.offload option"):
        options.replace(host_memroy="1GiB")
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        teraio.OffloadOptions(checkpoint="some")
    model, optimizer = make()
    run = teraio.offload(
        model, optimizer, options, gpu_memory=1 << 30, host_link_bandwidth="1GB/s", min_bytes=7
    )
    assert run.options.recompute == "off" and run.options.min_bytes == 7
    assert run.host_memory_bytes == 1 << 30


def test_compiled_model_is_refused_at_the_start() -> None:
    model, optimizer = make()
    compiled = torch.compile(model)
    with pytest.raises(TypeError, match="torch.compile"):
        teraio.offload(compiled, optimizer, gpu_memory=1 << 30)
    model.layers[0].compile()
    with pytest.raises(TypeError, match="layers.0"):
        teraio.offload(model, optimizer, gpu_memory=1 << 30)


def test_pinned_sizes_are_counted_as_the_allocator_rounds_them() -> None:
    assert pinned_size(1) == 1 and pinned_size(4096) == 4096 and pinned_size(4097) == 8192
    executor = ActivationExecutor(torch.device("cpu"), host_memory_bytes=3 << 20, min_bytes=1)
    # Two 1.5 MiB tensors take 2 MiB each: the second does not fit a 3 MiB cap.
    size = 3 << 19
    decisions = [PackDecision(0, size, HOST, 1), PackDecision(1, size, HOST, 1)]
    executor.set_plan(decisions)
    assert [d.tier for d in decisions] == [HOST, None]
    assert executor.stats.host_cap_demotions == 1


def test_memory_fallbacks_are_counted(store: teraio.Store) -> None:
    # A kept tensor is offloaded anyway when memory runs short, and a prefetch put off; both
    # counted, and the bytes come back exactly.
    executor = ActivationExecutor(torch.device("cpu"), store=store, host_memory_bytes=1 << 20, min_bytes=1)
    executor.cuda = True  # only the memory check is CUDA-specific
    short = {"value": True}
    executor._short_of_memory = lambda nbytes: short["value"]  # type: ignore[method-assign]
    executor.cuda = False
    executor.margin_bytes = 1
    tensors = [torch.randn(1 << 16) for _ in range(3)]
    sizes = [t.untyped_storage().nbytes() for t in tensors]
    decisions = [PackDecision(i, sizes[i], None) for i in range(3)]
    executor.set_plan(decisions)
    executor.begin_iteration()
    packed = [executor.pack(t) for t in tensors]
    stats = executor.stats
    assert stats.emergency_offloads == 3
    assert stats.emergency_offloaded_bytes == sum(sizes)
    # 1 MiB of host memory took the first three 256 KiB tensors at 256 KiB each.
    assert stats.offloaded_bytes[HOST] == sum(sizes) and stats.offloaded_bytes[SSD] == 0
    short["value"] = False
    restored = [executor.unpack(p) for p in packed]
    assert all(torch.equal(a, b) for a, b in zip(restored, tensors))
    assert stats.prefetches_on_demand == 3
    # A planned prefetch while memory is short is put off, then fetched when needed.
    short["value"] = True
    executor.set_plan([PackDecision(0, sizes[0], HOST, prefetch_event=1, need_event=1)])
    executor.begin_iteration()
    packed = [executor.pack(tensors[0])]
    restored = executor.unpack(packed[0])
    assert torch.equal(restored, tensors[0])
    assert stats.prefetches_deferred == 1 and stats.prefetches_on_demand == 4
    executor.end_iteration()
    executor.close()
