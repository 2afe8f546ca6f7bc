"""The profiler's trace of a tiny model: uses, sizes, kinds, phases."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import teraio  # noqa: E402
from tiny import batches, make  # noqa: E402

ROWS, DIM, HIDDEN, LAYERS = 512, 64, 256, 3


def _profile() -> tuple[dict[str, Any], Any, Any]:
    model, optimizer = make(dim=DIM, hidden=HIDDEN, layers=LAYERS)
    data = batches(2, rows=ROWS, dim=DIM)
    # One plain step first, so that the optimizer state exists in the profiled one.
    model(data[0]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    profiler = teraio.Profiler(model, optimizer)
    with profiler:
        loss = model(data[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return profiler.trace(gpu_capacity_bytes=1 << 30), model, optimizer


def test_trace_is_valid_and_phased() -> None:
    trace, _, _ = _profile()
    teraio.validate_trace(trace)
    phases = [op["phase"] for op in trace["ops"]]
    assert phases[0] == "forward"
    first_backward = phases.index("backward")
    first_optimizer = phases.index("optimizer")
    assert set(phases[:first_backward]) == {"forward"}
    assert set(phases[first_backward:first_optimizer]) == {"backward"}
    assert set(phases[first_optimizer:]) <= {"optimizer", "other"}
    assert all(op["duration_us"] >= 0 for op in trace["ops"])
    layers = {op.get("layer") for op in trace["ops"] if op["phase"] == "forward"} - {None}
    assert layers == set(range(LAYERS))


def test_kinds_sizes_and_uses() -> None:
    trace, model, optimizer = _profile()
    ops = trace["ops"]
    tensors = trace["tensors"]
    by_kind = Counter(t["kind"] for t in tensors)
    params = dict(model.named_parameters())
    # Every parameter is a persistent weight of its own size, read in forward, written by the optimizer.
    weights = {t["name"]: t for t in tensors if t["kind"] == "weight"}
    assert set(weights) == set(params)
    for name, t in weights.items():
        assert t["size_bytes"] == params[name].numel() * 4
        assert t["alloc_op"] is None and t["free_op"] is None
        phases = {ops[u["op"]]["phase"]: u["access"] for u in t["uses"]}
        assert phases["forward"] == "read"
        assert phases["optimizer"] == "write"
    # Gradients: one per parameter, same size, written in backward, last used by the optimizer.
    grads = {t["name"]: t for t in tensors if t["kind"] == "gradient"}
    assert set(grads) == {f"{name}.grad" for name in params}
    for name, t in grads.items():
        assert t["size_bytes"] == params[name[: -len(".grad")]].numel() * 4
        assert t["uses"][0]["access"] == "write" and ops[t["uses"][0]["op"]]["phase"] == "backward"
        assert ops[t["uses"][-1]["op"]]["phase"] == "optimizer"
        assert t["alloc_op"] <= t["uses"][0]["op"] and t["free_op"] == t["uses"][-1]["op"]
    # AdamW: exp_avg and exp_avg_sq per parameter (fp32, the parameter's size) and a step counter.
    states = [t for t in tensors if t["kind"] == "optimizer_state"]
    big = Counter(t["size_bytes"] for t in states if t["size_bytes"] > 4)
    assert big == Counter(p.numel() * 4 for p in params.values() for _ in range(2))
    assert by_kind["optimizer_state"] == 3 * len(params)
    # Activations: per block, the block input (saved by `up`), up's output (saved by gelu) and
    # gelu's output (saved by `down`): sizes ROWS*DIM*4, ROWS*HIDDEN*4, ROWS*HIDDEN*4; and the
    # model output, saved by `square` in the loss. But the first block's input is the batch: the
    # caller holds it before and after the iteration, so it is a persistent temporary (moving it
    # would free nothing), and so is the loss, which the caller holds to the last op.
    acts = [t for t in tensors if t["kind"] == "activation"]
    expected = Counter([ROWS * DIM * 4] * LAYERS + [ROWS * HIDDEN * 4] * (2 * LAYERS))
    held = [t for t in tensors if t["kind"] == "temporary" and t["alloc_op"] is None]
    assert [(t["size_bytes"], t["free_op"]) for t in held] == [(ROWS * DIM * 4, None)]
    assert ops[held[0]["uses"][0]["op"]].get("layer") == 0
    (loss,) = [t for t in tensors if t["name"] == "mean.default.out0"]
    assert loss["kind"] == "temporary" and loss["free_op"] == len(ops) - 1
    assert Counter(t["size_bytes"] for t in acts) == expected
    for t in acts:
        fwd = [u for u in t["uses"] if ops[u["op"]]["phase"] == "forward"]
        bwd = [u for u in t["uses"] if ops[u["op"]]["phase"] == "backward"]
        assert fwd and bwd, t["name"]
        assert all(u["access"] == "read" for u in bwd)
        assert t["free_op"] == t["uses"][-1]["op"]
    hidden_acts = [t for t in acts if t["size_bytes"] == ROWS * HIDDEN * 4]
    assert all(t["uses"][0]["access"] == "write" and t["alloc_op"] == t["uses"][0]["op"] for t in hidden_acts)
    assert by_kind["temporary"] > 0


def test_profiler_removes_its_hooks() -> None:
    trace, model, _ = _profile()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    # Outside the profiler nothing is recorded.
    assert len(trace["ops"]) > 0
