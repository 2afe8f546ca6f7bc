"""Selective recomputation (teraio.recompute): which saved tensors get a recipe, what the planner
sees, and that training with them is bitwise equal to training without offload."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import teraio  # noqa: E402
from fixed_costs import fixed_op_costs  # noqa: E402
from teraio import recompute as rc  # noqa: E402
from tiny import batches, make, train  # noqa: E402

STEPS = 6
ROWS = 2048
# The training checks run on the CPU "device" everywhere and on CUDA where there is one (the GPU
# machine's run of benches/torch/run-gpu.sh).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


class Attention(torch.nn.Module):
    """Eager attention as Hugging Face writes it: the softmax output (saved for the product with
    v) is the large tensor, and the mask comes in as a keyword argument."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(dim // self.heads)) + mask
        probs = torch.softmax(scores, dim=-1)
        return x + self.out((probs @ v).transpose(1, 2).reshape(batch, seq, dim))


class AttentionModel(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(dim, heads) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        mask = torch.full((seq, seq), float("-inf"), device=x.device).triu(1)
        for layer in self.layers:
            x = layer(x, mask=mask)
        return self.norm(x).square().mean()


class MutatedBlock(torch.nn.Module):
    """`up`'s output is written in place before gelu saves it: it must not be recomputed."""

    def __init__(self, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h.add_(1.0)
        return self.down(torch.nn.functional.gelu(h)).square().mean()


def _attention_make(device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = AttentionModel().to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _attention_batches(count: int, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 128, 32, generator=generator).to(device) for _ in range(count)]


def _mutated_make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MutatedBlock()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _profile(
    make_model: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]], data: list[torch.Tensor]
) -> Any:
    model, optimizer = make_model()
    train(model, optimizer, data[:1])
    profiler = teraio.Profiler(model, optimizer)
    with profiler:
        train(model, optimizer, data[1:2])
    return profiler


def _recipes(profiler: Any, **options: Any) -> dict[int, rc.Recipe]:
    return rc.find_recipes(
        profiler, profiler.op_durations_us(), min_bytes=options.pop("min_bytes", 64 << 10), **options
    )


def _reference(make_model: Callable[[], Any], data: list[torch.Tensor]) -> tuple[list[float], dict]:
    model, optimizer = make_model()
    losses = train(model, optimizer, data)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _offloaded(
    make_model: Callable[[], Any], data: list[torch.Tensor], **options: Any
) -> tuple[list[float], dict, teraio.Report]:
    model, optimizer = make_model()
    # Per-tensor recomputation alone: whole-block checkpointing is tested in test_training.py.
    options.setdefault("checkpoint", "off")
    # Some budgets here are below what any plan fits: those tests check exactness, not the fit.
    options.setdefault("if_no_fit", "run")
    with teraio.offload(
        model, optimizer, min_bytes=64 << 10, reserve=0, **options, granularity="tensor"
    ) as run:
        losses = train(model, optimizer, data)
    return losses, model.state_dict(), run.report()


def _assert_same(reference: tuple[list[float], dict], losses: list[float], state: dict) -> None:
    ref_losses, ref_state = reference
    assert losses == ref_losses  # bitwise
    for name, value in ref_state.items():
        assert torch.equal(state[name], value), name


def _unplanned_peak(make_model: Callable[[], Any], data: list[torch.Tensor]) -> int:
    trace = _profile(make_model, data).trace()
    return teraio.plan(trace, gpu_memory=1 << 40)["prediction"]["unplanned_peak_bytes"]


# -- recipes -------------------------------------------------------------------------------------


def test_tiny_recipes_remake_up_and_gelu_from_the_layer_input() -> None:
    profiler = _profile(make, batches(2, rows=ROWS))
    recipes = _recipes(profiler, link_bandwidth=None)
    records = profiler.records
    # Per layer: up's output (saved by gelu) and gelu's output (saved by down), 512 KiB each.
    assert len(recipes) == 8
    funcs = sorted(str(recipe.func) for recipe in recipes.values())
    assert funcs.count("aten.addmm.default") == 4
    assert funcs.count("aten.gelu.default") == 4
    for tensor_id, recipe in recipes.items():
        assert records[tensor_id].kind == "activation"
        assert records[tensor_id].saved_for_backward
        assert recipe.size_bytes == records[tensor_id].size_bytes == ROWS * 256 * 4
        kinds = {source.kind for source in recipe.sources}
        assert kinds <= {"saved", "weight", "arg"}
        # Every recipe reads a weight (up's) and something the layer had as input.
        assert "weight" in kinds
        assert recipe.cost_us > 0


def test_cost_filter_and_weights_switch() -> None:
    profiler = _profile(make, batches(2, rows=ROWS))
    # A link so fast that moving the bytes always costs less than remaking them: no recipe.
    assert _recipes(profiler, link_bandwidth=1e18) == {}
    # A link so slow that any recipe is cheaper: the same recipes as with no filter.
    assert set(_recipes(profiler, link_bandwidth=1.0)) == set(_recipes(profiler, link_bandwidth=None))
    # Weights offloaded by the plan can't be recipe sources: linear outputs need them.
    no_weights = _recipes(profiler, link_bandwidth=None, allow_weights=False)
    assert all("weight" not in {s.kind for s in r.sources} for r in no_weights.values())
    assert not any(str(r.func) == "aten.addmm.default" for r in no_weights.values())
    # A minimum above every activation's size: nothing.
    assert _recipes(profiler, link_bandwidth=None, min_bytes=1 << 30) == {}


def test_mutated_tensor_is_not_recomputed() -> None:
    profiler = _profile(_mutated_make, batches(2, rows=ROWS))
    mutated = [r for r in profiler.records if r.mutated]
    assert mutated and all(r.kind == "activation" for r in mutated)
    recipes = _recipes(profiler, link_bandwidth=None)
    assert not set(recipes) & {r.id for r in mutated}
    # Nor anything read from it: which version a reader saw is not known.
    assert not any(str(r.func) == "aten.gelu.default" for r in recipes.values())
    assert not {s.tensor_id for r in recipes.values() for s in r.sources} & {r.id for r in mutated}


def test_attention_softmax_is_remade_from_q_k_and_the_mask_argument() -> None:
    profiler = _profile(_attention_make, _attention_batches(2))
    recipes = _recipes(profiler, link_bandwidth=None)
    softmax = [r for r in recipes.values() if "softmax" in str(r.func)]
    assert len(softmax) == 3  # one per layer
    for recipe in softmax:
        kinds = {source.kind for source in recipe.sources}
        # The mask is nobody's saved tensor: it is captured from the layer's keyword argument.
        assert "arg" in kinds
        # scores = q @ k^T * scale + mask is a temporary chain, made inline.
        assert any(isinstance(leaf, rc.Leaf) and isinstance(leaf.source, rc.Recipe) for leaf in recipe.leaves)
        assert recipe.transient_bytes > 0


def test_apply_to_trace_cuts_life_and_adds_the_remade_copy() -> None:
    profiler = _profile(make, batches(2, rows=ROWS))
    trace = profiler.trace()
    recipes = _recipes(profiler, link_bandwidth=None)
    planned, applied, need = rc.apply_to_trace(trace, profiler.events, recipes)
    teraio.validate_trace(planned)
    assert set(applied) == set(recipes)
    ops = planned["ops"]
    by_id = {t["id"]: t for t in planned["tensors"]}
    original = {t["id"]: t for t in trace["tensors"]}
    for tensor_id in applied:
        entry = by_id[tensor_id]
        assert all(ops[u["op"]]["phase"] == "forward" for u in entry["uses"])
        assert entry["free_op"] < original[tensor_id]["free_op"]
        at = profiler.events[need[tensor_id]].next_op
        assert ops[at]["phase"] == "backward"
        copies = [t for t in planned["tensors"] if t["name"] == f"{entry['name']} (recomputed)"]
        assert len(copies) == 1 and copies[0]["alloc_op"] == at
        assert ops[at]["duration_us"] > trace["ops"][at]["duration_us"]
    # The input trace is left as it was.
    assert len(trace["tensors"]) < len(planned["tensors"])
    # The planner sees a lower peak with nothing moved.
    before = teraio.plan(trace, gpu_memory=1 << 40)["prediction"]["unplanned_peak_bytes"]
    after = teraio.plan(planned, gpu_memory=1 << 40)["prediction"]["unplanned_peak_bytes"]
    assert after < before


# -- training ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_on_trains_bitwise_equal_and_moves_less(device: str) -> None:
    data = batches(STEPS, rows=ROWS, device=device)
    maker = functools.partial(make, device=device)
    reference = _reference(maker, data)
    budget = _unplanned_peak(maker, data) // 2
    losses, state, report = _offloaded(maker, data, gpu_memory=budget, host_memory=1 << 30, recompute="on")
    _assert_same(reference, losses, state)
    assert report.plan_summary["fits"] is True
    assert report.plan_summary["recompute"]["chosen"] is True
    assert report.plan_summary["recomputed_tensors"] == 8
    assert report.recomputed_bytes_per_iteration == 8 * ROWS * 256 * 4
    assert report.stalls["plan_mismatches"] == 0
    assert "recomputed per iteration" in str(report)
    off_losses, _, off_report = _offloaded(
        maker, data, gpu_memory=budget, host_memory=1 << 30, recompute="off"
    )
    assert off_losses == reference[0]
    assert off_report.recomputed_bytes_per_iteration == 0
    moved = sum(report.bytes_per_iteration["offloaded"].values())
    assert moved < sum(off_report.bytes_per_iteration["offloaded"].values())


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_attention_bitwise_equal(device: str) -> None:
    data = _attention_batches(STEPS, device=device)
    maker = functools.partial(_attention_make, device=device)
    reference = _reference(maker, data)
    budget = _unplanned_peak(maker, data) * 2 // 3
    losses, state, report = _offloaded(maker, data, gpu_memory=budget, host_memory=1 << 30, recompute="on")
    _assert_same(reference, losses, state)
    assert report.recomputed_bytes_per_iteration > 0
    assert report.stalls["plan_mismatches"] == 0


def test_recompute_of_a_mutated_model_bitwise_equal() -> None:
    data = batches(STEPS, rows=ROWS)
    reference = _reference(_mutated_make, data)
    budget = _unplanned_peak(_mutated_make, data) * 2 // 3
    losses, state, report = _offloaded(
        _mutated_make, data, gpu_memory=budget, host_memory=1 << 30, recompute="on"
    )
    _assert_same(reference, losses, state)
    assert report.stalls["plan_mismatches"] == 0


# Fixed op costs for the auto test (fixed_costs.py): at 300 MB/s a 2 MiB activation's one-way
# transfer takes 6990 us, so the cost ratios of rc.AUTO_COST_RATIOS allow 1748 us (0.25) down to
# 280 us (0.04) of recipe. up's output costs its addmm (400 us); gelu's output costs addmm and
# gelu (1000 us). So 0.25 down to 0.18 remake both, 0.13 down to 0.07 only up's output, 0.04 none:
# two different recipe sets, whatever the machine's load.
AUTO_TEST_COSTS_US = {"aten.addmm.default": 400.0, "aten.gelu.default": 600.0}
AUTO_TEST_OTHER_OP_US = 20.0


def test_auto_keeps_the_plan_without_recompute_when_moving_is_cheaper() -> None:
    data = batches(STEPS, rows=ROWS)
    budget = _unplanned_peak(make, data) // 2
    # A link so fast that no recipe passes the cost filter.
    _, _, report = _offloaded(
        make, data, gpu_memory=budget, host_memory=1 << 30, host_link_bandwidth=1e18, recompute="auto"
    )
    assert report.plan_summary["recompute"] == {"mode": "auto", "candidates": 0, "tried": []}
    assert report.recomputed_bytes_per_iteration == 0


def test_bad_recompute_value() -> None:
    model, optimizer = make()
    with pytest.raises(ValueError, match="recompute must be"):
        teraio.offload(model, optimizer, gpu_memory=1 << 20, recompute="always", granularity="tensor")


def test_auto_recomputes_when_the_link_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fixed op costs (below): on a loaded machine a measured recipe could pass no cost ratio.
    fixed_op_costs(monkeypatch, AUTO_TEST_COSTS_US, AUTO_TEST_OTHER_OP_US)
    data = batches(STEPS, rows=ROWS)
    reference = _reference(make, data)
    budget = _unplanned_peak(make, data) // 2
    # 10 MB/s: every recipe passes every cost ratio (one set, planned once), and moving the
    # bytes instead would take far longer than remaking them.
    losses, state, report = _offloaded(
        make, data, gpu_memory=budget, host_memory=1 << 30, host_link_bandwidth=1e7, recompute="auto"
    )
    _assert_same(reference, losses, state)
    summary = report.plan_summary["recompute"]
    assert len(summary["tried"]) == 1 and summary["tried"][0]["tensors"] == 8
    assert summary["tried"][0]["chosen"] is True
    assert summary["chosen"] is True
    assert summary["predicted_ms_with"] < summary["predicted_ms_without"]
    assert report.recomputed_bytes_per_iteration == 8 * ROWS * 256 * 4
    # The same plans replayed on a slower link: never faster.
    assert summary["tried"][0]["predicted_ms_slow_link"] >= summary["tried"][0]["predicted_ms"]
    assert summary["predicted_ms_without_slow_link"] >= summary["predicted_ms_without"]


def test_auto_keeps_the_plan_that_holds_up_on_a_slower_link(monkeypatch: pytest.MonkeyPatch) -> None:
    fixed_op_costs(monkeypatch, AUTO_TEST_COSTS_US, AUTO_TEST_OTHER_OP_US)
    data = batches(STEPS, rows=ROWS)
    budget = _unplanned_peak(make, data) // 2
    # 300 MB/s: a few recipe sets, each with a different share of the bytes left to move.
    _, _, report = _offloaded(
        make, data, gpu_memory=budget, host_memory=1 << 30, host_link_bandwidth=3e8, recompute="auto"
    )
    summary = report.plan_summary["recompute"]
    tried = summary["tried"]
    assert [t["tensors"] for t in tried] == [8, 4]
    slow = [t["predicted_ms_slow_link"] for t in tried]
    assert all(s is not None and s >= t["predicted_ms"] for s, t in zip(slow, tried))
    best = min(slow)
    if summary["chosen"]:
        (chosen,) = [t for t in tried if t["chosen"]]
        assert chosen["predicted_ms_slow_link"] == best
        assert best < summary["predicted_ms_without_slow_link"]
        assert report.recomputed_bytes_per_iteration == summary["bytes"] == chosen["bytes"]
    else:
        assert summary["predicted_ms_without_slow_link"] <= best
        assert not any(t["chosen"] for t in tried)
        assert report.recomputed_bytes_per_iteration == 0
