"""The planner binding: plans, predictions, validation errors, pinned kinds."""

from __future__ import annotations

import json
from typing import Any

import pytest
import teraio

MIB = 1 << 20


def _trace() -> dict[str, Any]:
    # 8 ops; a 64 MiB activation written at op 0 and read at op 7; a 64 MiB weight read at 0 and 7.
    ops = [
        {"name": f"op{i}", "duration_us": 10_000.0, "phase": "forward" if i < 4 else "backward"}
        for i in range(8)
    ]
    tensors = [
        {
            "id": 1,
            "name": "w",
            "size_bytes": 64 * MIB,
            "kind": "weight",
            "alloc_op": None,
            "free_op": None,
            "uses": [{"op": 0, "access": "read"}, {"op": 7, "access": "read"}],
        },
        {
            "id": 2,
            "name": "act",
            "size_bytes": 64 * MIB,
            "kind": "activation",
            "alloc_op": 0,
            "free_op": 7,
            "uses": [{"op": 0, "access": "write"}, {"op": 7, "access": "read"}],
        },
        {
            "id": 3,
            "name": "tmp",
            "size_bytes": 16 * MIB,
            "kind": "temporary",
            "alloc_op": 3,
            "free_op": 4,
            "uses": [{"op": 3, "access": "write"}, {"op": 4, "access": "read"}],
        },
    ]
    return {
        "format_version": 1,
        "description": "unit",
        "gpu_capacity_bytes": 1 << 30,
        "ops": ops,
        "tensors": tensors,
    }


def test_plan_fits_and_predicts() -> None:
    result = teraio.plan(_trace(), gpu_memory="130MiB", ssd_read_bandwidth="6.5GB/s", host_memory=0)
    plan, prediction = result["plan"], result["prediction"]
    assert plan["fits"] is True
    assert prediction["unplanned_peak_bytes"] == 144 * MIB
    assert prediction["peak_gpu_bytes"] <= 130 * MIB
    assert prediction["ideal_time_us"] == pytest.approx(80_000.0)
    assert prediction["iteration_time_us"] >= prediction["ideal_time_us"]
    kinds = {a["kind"] for a in plan["actions"]}
    assert {"prefetch"} <= kinds and kinds & {"offload", "drop"}
    assert all(a["tier"] == "ssd" for a in plan["actions"])


def test_movable_kinds_pin_the_rest() -> None:
    result = teraio.plan(
        _trace(), gpu_memory="130MiB", ssd_read_bandwidth=6.5e9, movable_kinds=["activation"]
    )
    assert {m["tensor_id"] for m in result["plan"]["migrations"]} == {2}
    pinned = teraio.plan(_trace(), gpu_memory="130MiB", ssd_read_bandwidth=6.5e9, movable_kinds=["weight"])
    assert {m["tensor_id"] for m in pinned["plan"]["migrations"]} <= {1}


def test_host_tier_when_ssd_is_slow() -> None:
    result = teraio.plan(
        _trace(),
        gpu_memory="130MiB",
        ssd_read_bandwidth="10MB/s",
        host_memory="1GiB",
        movable_kinds=["activation"],
    )
    assert [m["tier"] for m in result["plan"]["migrations"]] == ["host"]
    assert result["prediction"]["host_written_bytes"] == 64 * MIB


def test_shared_ssd_is_passed_to_the_planner_and_simulator() -> None:
    options: dict[str, Any] = {"gpu_memory": "130MiB", "ssd_read_bandwidth": "6.5GB/s", "host_memory": 0}
    apart = teraio.plan(_trace(), **options)
    shared = teraio.plan(_trace(), ssd_shared=True, **options)
    assert shared["plan"]["fits"] is True
    # The same SSD time now serves both directions: never a faster prediction.
    assert shared["prediction"]["iteration_time_us"] >= apart["prediction"]["iteration_time_us"]
    replay = teraio.simulate(_trace(), shared["plan"], ssd_shared=True, **options)
    assert replay["iteration_time_us"] == pytest.approx(shared["prediction"]["iteration_time_us"])


def test_simulate_a_plan_on_a_slower_link() -> None:
    options: dict[str, Any] = {"gpu_memory": "130MiB", "ssd_read_bandwidth": "10MB/s", "host_memory": "1GiB"}
    result = teraio.plan(_trace(), host_link_bandwidth="25GB/s", movable_kinds=["activation"], **options)
    assert [m["tier"] for m in result["plan"]["migrations"]] == ["host"]
    same = teraio.simulate(_trace(), result["plan"], host_link_bandwidth="25GB/s", **options)
    assert same["iteration_time_us"] == pytest.approx(result["prediction"]["iteration_time_us"])
    assert same["host_written_bytes"] == 64 * MIB
    # 64 MiB each way at 100 MB/s (0.67 s) cannot hide behind 80 ms of ops: the replay stalls.
    slow = teraio.simulate(_trace(), json.dumps(result["plan"]), host_link_bandwidth=100e6, **options)
    assert slow["stall_time_us"] > 1e6
    assert slow["iteration_time_us"] == pytest.approx(slow["compute_time_us"] + slow["stall_time_us"])
    with pytest.raises(teraio.PlannerError, match="JSON"):
        teraio.simulate(_trace(), "{", **options)


def test_invalid_trace_names_the_rule() -> None:
    trace = _trace()
    trace["tensors"][1]["uses"] = [{"op": 7, "access": "read"}, {"op": 0, "access": "write"}]
    with pytest.raises(
        teraio.PlannerError, match=r"tensor 2 \(act\): uses must be in strictly increasing op order"
    ):
        teraio.validate_trace(json.dumps(trace))
    with pytest.raises(teraio.PlannerError, match="format_version"):
        teraio.plan(dict(_trace(), format_version=2), gpu_memory=1 << 30)
    with pytest.raises(ValueError, match="unknown tensor kind"):
        teraio.plan(_trace(), gpu_memory=1 << 30, movable_kinds=["activations"])


def test_parse_size() -> None:
    assert teraio.parse_size("24GiB") == 24 << 30
    assert teraio.parse_size("1.5GB") == 1_500_000_000
    assert teraio.parse_size(4096) == 4096
    # One meaning per spelling, as the engine and the CLI read it: bare G is binary, GB decimal.
    assert teraio.parse_size("2G") == 2 << 30
    assert teraio.parse_size("1GB") == 10**9
    with pytest.raises(ValueError, match="unknown unit"):
        teraio.parse_size("40 gigs")
    with pytest.raises(ValueError):
        teraio.parse_size(True)
    with pytest.raises(ValueError):
        teraio.parse_size("lots")
    with pytest.raises(ValueError):
        teraio.parse_size(None)  # type: ignore[arg-type]


def test_fractional_sizes_round_down_to_whole_bytes() -> None:
    # 53.86 GiB = 57831734640.64 bytes: what a user gets from a fraction of a measured peak.
    assert teraio.parse_size("53.86GiB") == 57_831_734_640
    assert teraio.parse_size(5.5e9) == 5_500_000_000
    assert teraio.parse_size("5.5e9") == 5_500_000_000
    assert teraio.parse_size(4096.9) == 4096
    assert teraio.parse_size("1.5") == 1
    assert teraio.parse_size("0.5KiB") == 512
    assert teraio.parse_size((1 << 60) - 1) == (1 << 60) - 1  # ints stay exact past 2**53
    for bad in (-1, -0.5, float("nan"), float("inf"), 1 << 61, "-1GiB"):
        with pytest.raises(ValueError):
            teraio.parse_size(bad)
    # The planner takes them where it takes sizes.
    for cap in ("53.86GiB", 5.5e9):
        result = teraio.plan(_trace(), gpu_memory=cap, ssd_read_bandwidth="6.5GB/s")
        assert result["prediction"] is not None


def test_tier_preference_and_ssd_over_the_host_link() -> None:
    common = dict(gpu_memory="130MiB", ssd_read_bandwidth="6.5GB/s", host_memory="1GiB")
    ssd_first = teraio.plan(_trace(), tier_preference="ssd", **common)
    host_first = teraio.plan(_trace(), tier_preference="host", **common)
    tiers = {r["plan"]["migrations"][0]["tier"] for r in (ssd_first, host_first)}
    assert tiers == {"ssd", "host"}
    auto = teraio.plan(_trace(), tier_preference="auto", ssd_via_host_link=True, **common)
    assert auto["prediction"]["fits"]
    with pytest.raises(ValueError, match="tier_preference"):
        teraio.plan(_trace(), tier_preference="fastest", **common)


def test_offload_refuses_an_unknown_tier_preference() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="tier_preference"):
        teraio.offload(model, optimizer, gpu_memory="1GiB", tier_preference="fastest")
