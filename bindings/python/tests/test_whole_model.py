"""Whole-model offload on the CPU device: parameters, gradients and optimizer state in host memory
and on the store, exact against training without offload."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import pytest
import teraio
import torch
from teraio import ids
from teraio.planning import format_bytes
from teraio.runtime.modes.block import BlockOffload
from teraio.runtime.modes.whole_model import (
    RECORDED_ITERATION,
    WHOLE_MODEL_SHARE,
    WHOLE_MODEL_WEIGHTS_SHARE,
    ModelOffload,
    needs_whole_model,
)
from teraio.runtime.movers.tiers import HostTier
from teraio.runtime.plans import capacity as cp
from tiny import accumulate_pairs, batches, make, train

STEPS = 4
ROWS = 256


class TiedLM(torch.nn.Module):
    """Embedding, blocks and a head tied to the embedding (as Llama-3.2 and Qwen2 small models)."""

    def __init__(self, vocab: int = 96, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            [
                torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim), torch.nn.GELU())
                for _ in range(layers)
            ]
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def _tied(seed: int = 0) -> tuple[TiedLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TiedLM()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _tokens(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 96, (4, 16), generator=generator) for _ in range(count)]


def _assert_same(reference: Any, other: Any) -> None:
    (ref_model, ref_opt, ref_losses), (model, optimizer, losses) = reference, other
    assert losses == ref_losses
    for (name, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters()):
        assert q.untyped_storage().nbytes() == p.untyped_storage().nbytes(), name
        assert torch.equal(p, q), name
    for p, q in zip(ref_model.parameters(), model.parameters()):
        for key, value in ref_opt.state[p].items():
            assert torch.equal(value, optimizer.state[q][key]), key


def _run(
    build: Any, data: list[torch.Tensor], store: Optional[teraio.Store], **options: Any
) -> tuple[Any, ModelOffload]:
    model, optimizer = build()
    with teraio.offload(model, optimizer, store=store, gpu_memory=4096, **options) as run:
        assert isinstance(run, ModelOffload)
        losses = train(model, optimizer, data)  # type: ignore[arg-type]
    return (model, optimizer, losses), run


def _reference(build: Any, data: list[torch.Tensor]) -> Any:
    model, optimizer = build()
    return model, optimizer, train(model, optimizer, data)  # type: ignore[arg-type]


def _assert_host_time_within_each_iteration(run: ModelOffload) -> None:
    """Host time in the runtime (hooks and the step) is counted and is part of each iteration
    (per iteration: the report's medians of each part may sum above the median iteration)."""
    assert 0 < sum(run.report().host_ms_per_iteration.values())
    for counts, wall_ms in zip(run._iterations, run._step_times_ms, strict=True):
        assert (counts.host_s + counts.wait_s["step"]) * 1e3 <= wall_ms


@pytest.mark.parametrize("host_memory", [1 << 30, 300_000, 0], ids=["host", "mixed", "ssd"])
def test_exact_on_every_tier(store: teraio.Store, host_memory: int) -> None:
    data = batches(STEPS, rows=ROWS)
    reference = _reference(make, data)
    result, run = _run(make, data, store, host_memory=host_memory)
    _assert_same(reference, result)
    report = run.report()
    placed = report.placement
    if host_memory == 0:
        assert sum(placed["host"].values()) == 0 and sum(placed["ssd"].values()) > 0
    elif host_memory == 1 << 30:
        assert sum(placed["ssd"].values()) == 0
    else:
        assert sum(placed["host"].values()) > 0 and sum(placed["ssd"].values()) > 0
        # Host memory takes parameters first, optimizer state last.
        assert placed["host"]["parameter"] > 0 and placed["ssd"]["optimizer_state"] > 0
    moved = report.bytes_per_iteration
    params = sum(p.untyped_storage().nbytes() for p in result[0].parameters())
    total_in = sum(sum(kinds.values()) for kinds in moved["in"].values())
    # Every iteration brings every parameter in (forward + recomputation + step), its gradient
    # and its two AdamW state tensors.
    assert total_in >= params * (2 + 1 + 2)
    assert pytest.approx(report.pinned_host_bytes) == sum(placed["host"].values())
    _assert_host_time_within_each_iteration(run)
    assert store.list() == []  # the run's objects are deleted at exit
    # What teraio bought: the state the GPU would hold without offload (AdamW: parameter, its
    # gradient and two state tensors of its size), against the budget, in the report.
    assert report.model_state_bytes == 4 * params
    assert f"alone take {format_bytes(4 * params)}" in str(report)


def test_tied_weights_and_no_checkpointing(store: teraio.Store) -> None:
    # The head shares the embedding's weight; without checkpointing, autograd saves parameters
    # (LayerNorm, Linear in fp32), which must stay until their gradients are in.
    data = _tokens(STEPS)
    reference = _reference(_tied, data)
    result, run = _run(_tied, data, store, host_memory=20_000, checkpoint="off")
    _assert_same(reference, result)
    assert run.report().checkpointed_blocks == 0


def test_checkpointed_tied_model(store: teraio.Store) -> None:
    data = _tokens(STEPS)
    reference = _reference(_tied, data)
    result, run = _run(_tied, data, store, host_memory=0)
    _assert_same(reference, result)
    assert run.report().checkpointed_blocks == 3


def test_parameters_are_released_between_uses(store: teraio.Store) -> None:
    model, optimizer = make()
    data = batches(2, rows=ROWS)
    resident_during_forward: list[int] = []

    def probe(module: torch.nn.Module, args: Any, output: Any) -> None:
        resident_during_forward.append(sum(p.untyped_storage().nbytes() > 0 for p in model.parameters()))

    handle = model.layers[2].register_forward_hook(probe)
    with teraio.offload(
        model, optimizer, store=store, gpu_memory=1 << 20, host_memory=1 << 30, pull_forward_bytes=0
    ):
        train(model, optimizer, data)
        # Between iterations nothing of the model is on the device.
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        assert all(
            not optimizer.state[p] or optimizer.state[p]["exp_avg"].untyped_storage().nbytes() == 0
            for p in model.parameters()
        )
    handle.remove()
    # Inside layer 2's forward only its own four tensors were resident.
    assert max(resident_during_forward) <= 4
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # back at exit


def test_step_memory_is_bounded_by_its_window(store: teraio.Store) -> None:
    window = 100_000
    data = batches(2, rows=ROWS)
    reference = _reference(make, data)
    result, run = _run(make, data, store, host_memory=1 << 30, step_window=window)
    _assert_same(reference, result)
    largest = max(p.untyped_storage().nbytes() * 4 for p in result[0].parameters())
    report = run.report()
    assert report.windows > 4
    assert 0 < report.peak_step_window_bytes <= 2 * max(window, largest)


def test_gradient_accumulation_is_exact(store: teraio.Store) -> None:
    data = batches(4, rows=ROWS)
    ref_model, ref_opt = make()
    ref_losses = accumulate_pairs(ref_model, ref_opt, data)
    model, optimizer = make()
    with teraio.offload(model, optimizer, store=store, gpu_memory=1 << 20, host_memory=100_000):
        losses = accumulate_pairs(model, optimizer, data)
    _assert_same((ref_model, ref_opt, ref_losses), (model, optimizer, losses))


def test_model_trains_on_after_exit(store: teraio.Store) -> None:
    data = batches(4, rows=ROWS)
    reference = _reference(make, data)
    model, optimizer = make()
    with teraio.offload(model, optimizer, store=store, gpu_memory=1 << 20, host_memory=0):
        losses = train(model, optimizer, data[:2])
    losses += train(model, optimizer, data[2:])  # plain torch again
    _assert_same(reference, (model, optimizer, losses))


def test_auto_switches_on_when_the_state_does_not_fit() -> None:
    model, optimizer = make()
    state = sum(p.numel() * 4 for p in model.parameters()) * 4  # params + grads + 2 AdamW tensors
    weights = state // 2  # params + grads
    # Everything over its share, and parameters + gradients over theirs: whole-model.
    assert needs_whole_model(model, optimizer, int(weights / WHOLE_MODEL_WEIGHTS_SHARE) - 1024)
    # Everything over its share, parameters + gradients not: the block plan moves the state.
    budget = int(weights / WHOLE_MODEL_WEIGHTS_SHARE) + 1024
    assert state > WHOLE_MODEL_SHARE * budget and not needs_whole_model(model, optimizer, budget)
    assert not needs_whole_model(model, optimizer, int(state / WHOLE_MODEL_SHARE) + 1024)
    with teraio.offload(model, optimizer, gpu_memory=state * 4, host_memory=1 << 30) as run:
        assert isinstance(run, BlockOffload)  # activation offload, at the grain of its blocks
    with teraio.offload(model, optimizer, gpu_memory=state * 4, host_memory=1 << 30, whole_model="on") as run:
        assert isinstance(run, ModelOffload)


def test_store_too_small_is_refused_before_training(store_dir: Any) -> None:
    small = teraio.Store.create(
        [store_dir / "d0"], file_size_bytes=4 << 20, durable=False, stripe_unit_bytes=64 << 10
    )
    model, optimizer = make(dim=256, hidden=1024)  # 8 MiB of parameters: 32 MiB with state
    with pytest.raises(teraio.NoSpaceError, match="the plan needs"):
        teraio.offload(model, optimizer, store=small, gpu_memory=1 << 20, host_memory=0)
    assert small.list() == []
    small.close()


def test_no_store_and_too_little_host_memory_is_a_clear_error() -> None:
    model, optimizer = make()
    with pytest.raises(teraio.NoPlanFitsError, match="no store for the rest"):
        teraio.offload(model, optimizer, gpu_memory=1 << 20, host_memory=1000)


def test_pinned_host_memory_never_exceeds_its_cap() -> None:
    tier = HostTier(torch.device("cpu"), 1000)
    tier.reserve("a", 600)
    with pytest.raises(MemoryError, match="cap of 1000"):
        tier.reserve("b", 500)
    assert tier.used_bytes == 600


def test_a_released_key_gives_its_bytes_back() -> None:
    tier = HostTier(torch.device("cpu"), 1000)
    tier.write("a", torch.arange(600, dtype=torch.int32).to(torch.uint8))
    tier.reserve("b", 300)
    back = torch.empty(600, dtype=torch.uint8)
    tier.read_to_host("a", back)
    tier.release("a")
    assert torch.equal(back, torch.arange(600, dtype=torch.int32).to(torch.uint8))
    assert (tier.used_bytes, tier.peak_bytes, list(tier.buffers)) == (300, 900, ["b"])
    tier.reserve("c", 700)  # the cap counts what is held now
    tier.release("missing")  # nothing held: nothing to do
    tier.close()
    assert tier.used_bytes == 0


def test_state_left_in_cpu_memory_is_held_once(store: teraio.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the state does not fit back on the device at exit, it moves into CPU memory one
    tensor at a time, each tier copy given back as soon as it is read: host memory never holds
    the whole state twice (pinned and pageable)."""
    data = batches(STEPS, rows=ROWS)
    reference = _reference(make, data)
    monkeypatch.setattr(ModelOffload, "_fits_back", lambda self: False)
    held: list[int] = []
    release = HostTier.release

    def counted(tier: HostTier, key: Any) -> None:
        release(tier, key)
        held.append(tier.used_bytes)

    monkeypatch.setattr(HostTier, "release", counted)
    model, optimizer = make()
    with pytest.warns(UserWarning, match="left in CPU memory"):
        with teraio.offload(model, optimizer, store=store, gpu_memory=4096, host_memory=1 << 30) as run:
            losses = train(model, optimizer, data)
    _assert_same(reference, (model, optimizer, losses))
    assert run.returned_to == "cpu"
    # Every host key was given back, one at a time, before the tier closed.
    assert len(held) > 3 and held == sorted(held, reverse=True) and held[-1] == 0


def test_capacity_plan_moves_the_least_used_bytes_to_the_store() -> None:
    sizes = [cp.SlotSize(f"p{i}", 100, 100, 200) for i in range(4)]
    plan = cp.place(sizes, host_capacity_bytes=1000, ssd_capacity_bytes=10_000, window_bytes=800)
    # 1600 bytes, 1000 on host: 600 must go; optimizer state leaves first, last parameters first.
    assert plan.ssd_bytes == {"parameter": 0, "gradient": 0, "optimizer_state": 600}
    assert [t["optimizer_state"] for t in plan.tiers] == ["host", "ssd", "ssd", "ssd"]
    assert plan.windows == [[0, 1], [2, 3]]
    everything = cp.place(sizes, host_capacity_bytes=0, ssd_capacity_bytes=10_000, window_bytes=10)
    assert everything.host_total == 0 and everything.ssd_total == 1600
    assert everything.windows == [[0], [1], [2], [3]]
    with pytest.raises(cp.CapacityError, match="needs 1.*KiB"):
        cp.place(sizes, host_capacity_bytes=0, ssd_capacity_bytes=1000, window_bytes=800)


def test_object_id_namespaces_are_disjoint() -> None:
    bases = [ids.base(name) for name in ids.NAMESPACES]
    assert len(set(bases)) == len(bases)
    assert ids.namespace_of(ids.base("model_gradients") + 5) == "model_gradients"
    with pytest.raises(ValueError, match="unknown object-id namespace"):
        ids.base("nope")


def test_copy_of_model_is_untouched() -> None:
    # deepcopy before offload keeps its own storage (nothing teraio does leaks into it).
    model, optimizer = make()
    twin = copy.deepcopy(model)
    with teraio.offload(model, optimizer, gpu_memory=1 << 20, host_memory=1 << 30):
        train(model, optimizer, batches(1, rows=ROWS))
    assert all(p.untyped_storage().nbytes() > 0 for p in twin.parameters())


def _clipping_run(offloaded: bool, store: Optional[teraio.Store], step: Any) -> tuple[Any, list[Any], Any]:
    """Trains `make()`'s model with `step(model, other, x) -> [norms]` between backward and the
    optimizer step (`other`: a small model outside the offload, with its own gradients)."""
    model, optimizer = make()
    other = torch.nn.Linear(64, 1)
    torch.nn.init.constant_(other.weight, 0.01)
    data = batches(STEPS, rows=ROWS)
    norms: list[Any] = []
    losses: list[float] = []

    def train_all() -> None:
        for x in data:
            loss = model(x)
            loss.backward()
            other(x).square().mean().backward()
            norms.extend(step(model, other, x))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())

    if offloaded:
        with teraio.offload(model, optimizer, store=store, gpu_memory=4096, host_memory=100_000):
            train_all()
    else:
        train_all()
    return (model, optimizer, losses), norms, other


def _assert_same_clipping(store: teraio.Store, step: Any) -> list[Any]:
    reference, ref_norms, ref_other = _clipping_run(False, None, step)
    result, norms, other = _clipping_run(True, store, step)
    assert len(norms) == len(ref_norms) and all(torch.equal(a, b) for a, b in zip(ref_norms, norms))
    assert torch.equal(ref_other.weight.grad, other.weight.grad)
    _assert_same(reference, result)
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"  # restored
    return ref_norms


@pytest.mark.parametrize(
    ("max_norm", "norm_type"),
    [(0.05, 2.0), (1e6, 2.0), (0.05, 1.0), (0.001, float("inf"))],
    ids=["clips", "does-not-clip", "l1", "max"],
)
def test_gradient_clipping_is_exact(store: teraio.Store, max_norm: float, norm_type: float) -> None:
    # clip_grad_norm_ after backward, as Hugging Face's Trainer calls it: the gradients have left
    # the device; the step scales each one as it brings it back.
    def clip(model: Any, other: Any, x: Any) -> list[Any]:
        return [torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)]

    norms = _assert_same_clipping(store, clip)
    assert all((n > max_norm) == (max_norm < 1) for n in norms)  # clipped unless max_norm is huge


def test_clipping_part_of_the_model_and_another_models_parameters_is_exact(store: teraio.Store) -> None:
    # A list mixing held gradients with gradients still on their parameters (another model),
    # then a second clip over the whole model, which sees what the first one scaled.
    def clip(model: Any, other: Any, x: Any) -> list[Any]:
        first = torch.nn.utils.clip_grad_norm_([*model.layers[0].parameters(), *other.parameters()], 0.01)
        return [first, torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)]

    _assert_same_clipping(store, clip)


def test_backward_after_a_clip_adds_to_the_clipped_gradients(store: teraio.Store) -> None:
    def clip_then_accumulate(model: Any, other: Any, x: Any) -> list[Any]:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        model(x * 0.5).backward()
        return [norm]

    _assert_same_clipping(store, clip_then_accumulate)


def test_gradient_functions_that_would_see_no_gradient_raise() -> None:
    # After backward the gradients are in their tiers (param.grad is None): torch's functions
    # that read param.grad would do nothing on the model's parameters, so they raise; a
    # clip_grad_norm_ bound before the session (an early `from torch.nn.utils import ...`) is
    # caught where it scales. Another model's gradients are torch's as before.
    early_clip = torch.nn.utils.clip_grad_norm_
    clip_value = torch.nn.utils.clip_grad_value_
    model, optimizer = make()
    other = torch.nn.Linear(4, 4)
    with teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30) as run:
        assert isinstance(run, ModelOffload)
        x = batches(1, rows=ROWS)[0]
        train(model, optimizer, [x])
        model(x).backward()
        calls = {
            "clip_grads_with_norm_": lambda params: early_clip(params, 1.0),
            "clip_grad_value_": lambda params: torch.nn.utils.clip_grad_value_(params, 1.0),
            "clip_grads_with_norm_ ": lambda params: torch.nn.utils.clip_grads_with_norm_(
                params, 1.0, torch.tensor(1.0)
            ),
        }
        for name, call in calls.items():
            with pytest.raises(RuntimeError, match=f"{name.strip()} on the model's parameters"):
                call(model.parameters())
        other(torch.ones(2, 4)).square().sum().backward()
        grad = other.weight.grad.clone()
        torch.nn.utils.clip_grad_value_(other.parameters(), 1e-3)
        assert torch.equal(other.weight.grad, grad.clamp(-1e-3, 1e-3))
        assert float(early_clip(other.parameters(), 1.0)) > 0
        optimizer.step()  # the iteration goes on
        optimizer.zero_grad()
    assert torch.nn.utils.clip_grad_value_ is clip_value and torch.nn.utils.clip_grad_norm_ is early_clip
    import torch.nn.utils.clip_grad as clip_grad_module

    assert clip_grad_module._clip_grads_with_norm_ is torch.nn.utils.clip_grads_with_norm_


def test_optimizer_parameters_outside_the_model_are_refused() -> None:
    model, _ = make()
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([*model.parameters(), extra])
    with pytest.raises(ValueError, match="does not own"):
        teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30)


# -- the step in backward ----------------------------------------------------------------------


@pytest.mark.parametrize("host_memory", [1 << 30, 300_000, 0], ids=["host", "mixed", "ssd"])
def test_step_in_backward_is_exact_on_every_tier(store: teraio.Store, host_memory: int) -> None:
    data = batches(STEPS, rows=ROWS)
    reference = _reference(make, data)
    result, run = _run(make, data, store, host_memory=host_memory, step_in_backward=True)
    _assert_same(reference, result)
    report = run.report()
    assert report.step_in_backward
    # Host time in the runtime is counted (hooks and the step), and is part of the iteration.
    assert set(report.host_ms_per_iteration) == {"hooks", "step"}
    _assert_host_time_within_each_iteration(run)
    # Gradients never leave the GPU, and the step reads no parameter in: every parameter comes
    # in for forward and recomputation only.
    moved = report.bytes_per_iteration
    assert all(kinds.get("gradient", 0) == 0 for direction in moved.values() for kinds in direction.values())
    params = sum(p.untyped_storage().nbytes() for p in result[0].parameters())
    parameters_in = sum(kinds.get("parameter", 0) for kinds in moved["in"].values())
    assert parameters_in <= 2 * params
    # No tier holds gradients: host memory and the store go to parameters and state.
    placed = report.placement
    assert placed["host"]["gradient"] == 0 and placed["ssd"]["gradient"] == 0
    assert report.pinned_host_bytes == sum(placed["host"].values())
    assert store.list() == []


@pytest.mark.parametrize("checkpoint", [None, "off"])
def test_step_in_backward_with_tied_weights(store: teraio.Store, checkpoint: Optional[str]) -> None:
    # The tied weight's gradient is complete only once backward reaches the embedding: it must
    # not be stepped with the head's part alone.
    data = _tokens(STEPS)
    reference = _reference(_tied, data)
    result, _ = _run(_tied, data, store, host_memory=20_000, checkpoint=checkpoint, step_in_backward=True)
    _assert_same(reference, result)


def _stepping_in_backward(
    store: teraio.Store, update: str = "auto"
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model, optimizer = make()
    run = teraio.offload(
        model,
        optimizer,
        store=store,
        gpu_memory=4096,
        host_memory=1 << 30,
        step_in_backward=True,
        update=update,
    )
    return model, optimizer, run


def test_step_in_backward_updates_the_model_in_backward(store: teraio.Store) -> None:
    model, optimizer, run = _stepping_in_backward(store)
    x = batches(1, rows=ROWS)[0]
    with run:
        model(x).backward()
        # AdamW counts its steps per parameter: every one has stepped before optimizer.step().
        assert all(int(optimizer.state[p]["step"]) == 1 for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        assert all(int(optimizer.state[p]["step"]) == 1 for p in model.parameters())


@pytest.mark.parametrize("update", ["auto", "cpu"], ids=["gpu-step", "cpu-step"])
def test_step_in_backward_refuses_clipping_and_accumulation(store: teraio.Store, update: str) -> None:
    # On the CPU device "auto" is the GPU step; "cpu" queues each unit's update in backward.
    model, _, run = _stepping_in_backward(store, update)
    assert run.update_site.site == ("cpu" if update == "cpu" else "gpu")
    x = batches(1, rows=ROWS)[0]
    with run:
        model(x).backward()
        with pytest.raises(RuntimeError, match="clip_grad_norm_ after backward"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(RuntimeError, match="a second backward before optimizer.step"):
            model(x).backward()


def test_step_in_backward_without_whole_model_mode_warns() -> None:
    model, optimizer = make()
    with pytest.warns(UserWarning, match="step_in_backward=True has no effect"):
        teraio.offload(model, optimizer, gpu_memory=1 << 30, step_in_backward=True, granularity="tensor")


def test_capacity_table_compares_losses_with_a_reference_of_the_same_batch_only() -> None:
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benches" / "torch"))
    from bench_capacity import loss_agreement

    row = {"family": "llama3b", "batch": 8, "seq": 2048, "seed": 0, "losses": [1.0, 2.0]}
    assert loss_agreement(row, {**row, "losses": [1.0, 2.0]}) == "bitwise (2 steps)"
    assert (
        loss_agreement(row, {**row, "losses": [1.0, 2.5]}) == "max abs diff 5.00e-01 (2 steps), not bitwise"
    )
    other = loss_agreement(row, {**row, "batch": 1, "losses": [1.0, 2.5]})
    assert other.startswith("- (the reference ran") and "batch 1" in other


def test_capacity_table_counts_the_whole_model_reports_bytes() -> None:
    # benches/torch/bench_capacity.py's tier columns, from a whole-model report's per-kind counts.
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benches" / "torch"))
    from bench_capacity import tier_bytes

    model, optimizer = make()
    with teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30) as run:
        train(model, optimizer, batches(2, rows=ROWS))
    report = run.report().as_dict()
    moved = report["bytes_per_iteration"]
    assert tier_bytes(report) == {
        "host": {direction: sum(moved[direction]["host"].values()) for direction in ("in", "out")}
    }
    assert tier_bytes(report)["host"]["in"] > 0


def test_step_in_backward_reads_state_ahead_within_its_budget() -> None:
    # In backward, the optimizer state of the units ahead is read in up to pull_forward_bytes
    # (read ahead for the whole parameter horizon, twice its bytes, it ran out of memory on the
    # H100 at pull_forward_bytes=3GiB).
    pull = 600_000
    model, optimizer = make(layers=16)
    with teraio.offload(
        model, optimizer, gpu_memory=4096, host_memory=1 << 30, step_in_backward=True, pull_forward_bytes=pull
    ) as run:
        train(model, optimizer, batches(3, rows=ROWS))
    unit = max(sum(p.untyped_storage().nbytes() for p in layer.parameters()) for layer in model.layers)
    # Counted here: the state of the unit backward is in and the parameters and gradients of the
    # one it left (2 + 2 units), and the state read ahead (within the budget).
    assert run.report().peak_step_window_bytes <= pull + 4 * unit


@pytest.mark.parametrize("step_in_backward", [False, True])
@pytest.mark.parametrize("inputs", ["gpu", "host"])
def test_the_recorded_iteration_holds_every_transfer_and_replays_at_other_bandwidths(
    store: teraio.Store, step_in_backward: bool, inputs: str
) -> None:
    data = _tokens(RECORDED_ITERATION + 2)
    # With the blocks' inputs off the GPU (the plan fills host memory: they go to the store).
    options = {"checkpoint_inputs": inputs, "min_bytes": 0}
    _, run = _run(_tied, data, store, host_memory=20_000, step_in_backward=step_in_backward, **options)
    record = run.recorder.result()
    assert record is not None and record.unmodelled_transfers == 0
    activations = [t for t in record.trace["tensors"] if t["kind"] == "activation"]
    assert len(activations) == (2 if inputs == "host" else 0)  # 3 blocks, the last one's stay
    # Every byte the runtime counted in that iteration is a recorded read or write.
    sizes = {t["id"]: t["size_bytes"] for t in record.trace["tensors"]}
    recorded: dict[tuple[str, str], int] = {}
    for index, transfer in enumerate(record.schedule["transfers"]):
        if transfer["kind"] != "drop" and index not in record.kept:
            direction = "in" if transfer["kind"] == "prefetch" else "out"
            key = (direction, transfer["tier"])
            recorded[key] = recorded.get(key, 0) + sizes[transfer["tensor_id"]]
    counted = {
        (direction, tier): sum(kinds.values())
        for direction, tiers in run._iterations[RECORDED_ITERATION].moved().items()
        for tier, kinds in tiers.items()
    }
    assert recorded == counted
    assert ("in", "ssd") in counted  # the store carries part of it
    report = run.report()
    assert report.predicted_iteration_ms is not None and report.prediction["ops"] == len(record.trace["ops"])
    assert report.prediction["recorded_span_ms"] >= report.prediction["compute_ms"] > 0
    assert "predicted" in str(report)
    # Unbounded bandwidth: the recorded GPU work alone; a slow store: at least its reads' time.
    # The prediction adds the recorded iteration's time outside its GPU work (the loop's own).
    outside = run.report().step_times_ms[RECORDED_ITERATION] - record.span_ms
    assert report.prediction["outside_span_ms"] == pytest.approx(max(0.0, outside))
    fast = run.predict(host_link_bandwidth=1e18, ssd_bandwidth=1e18)
    assert fast is not None and fast["outside_span_ms"] == report.prediction["outside_span_ms"]
    assert fast["iteration_ms"] - fast["outside_span_ms"] == pytest.approx(
        fast["compute_ms"], rel=0.02, abs=0.2
    )
    slow = run.predict(ssd_bandwidth="1MB/s")
    assert slow is not None and slow["iteration_ms"] >= slow["ssd_read_bytes"] / 1e6 * 1e3
    # The link each way while both directions move data: the measured figure, and its ratio to
    # the one-way rate for a link given to `predict`.
    assert run.link.duplex is not None
    planned = min(run.link.d2h, run.link.h2d)
    assert report.prediction["host_link_duplex_bytes_per_s"] == pytest.approx(min(run.link.duplex, planned))
    assert fast["host_link_duplex_bytes_per_s"] == pytest.approx(
        min(run.link.duplex, planned) / planned * 1e18
    )
    # The default path's step reads a window's state while it writes the last one's: a slower
    # duplex rate makes it slower, at a link that needs the ops' time for the bytes it carries
    # (ops of 1 ms each: the same replay on every run, whatever the CPU's timing of the record
    # was). The step in backward's writes overlap nothing its ops wait for at that rate.
    if step_in_backward:
        return
    ops = [{**op, "duration_us": 1000.0} for op in record.trace["ops"]]
    timed = dataclasses.replace(record, trace={**record.trace, "ops": ops})
    moved = sum(fast[f"{tier}_{way}_bytes"] for tier in ("host", "ssd") for way in ("read", "written"))
    link = moved / (len(ops) * 1e-3)
    at = dict(host_link_bytes_per_s=link, ssd_read_bytes_per_s=1e18, ssd_write_bytes_per_s=1e18)
    alone, shared = timed.replay(**at), timed.replay(**at, host_link_duplex_bytes_per_s=link / 4)
    assert shared["iteration_time_us"] > alone["iteration_time_us"]


def test_no_prediction_before_the_recorded_iteration(store: teraio.Store) -> None:
    _, run = _run(_tied, _tokens(RECORDED_ITERATION), store, host_memory=20_000)
    report = run.report()
    assert report.predicted_iteration_ms is None and run.predict() is None
    assert "predicted: none" in str(report)


def test_the_largest_batch_keeps_the_modelled_peak_within_the_usable_bytes() -> None:
    gib = 1 << 30
    fit = cp.largest_batch(
        batch=2, peak_bytes=7 * gib, start_bytes=2 * gib, held_bytes=gib, usable_bytes=15 * gib
    )
    # 4 GiB grew with 2 sequences: 2 GiB each, 3 GiB at any batch, (15 - 3) / 2 = 6 sequences.
    assert (fit.batch, fit.largest, fit.per_sample_bytes, fit.fixed_bytes) == (2, 6, 2 * gib, 3 * gib)
    for batch, peak, usable in [(1, 5 * gib, 9 * gib), (3, 11 * gib, 40 * gib + 5), (8, 9 * gib, 9 * gib)]:
        fit = cp.largest_batch(
            batch=batch, peak_bytes=peak, start_bytes=gib, held_bytes=gib, usable_bytes=usable
        )
        grows = peak - 2 * gib
        assert fit.largest is not None
        assert fit.fixed_bytes * batch + fit.largest * grows <= usable * batch
        assert fit.fixed_bytes * batch + (fit.largest + 1) * grows > usable * batch
    # Usable memory below what the iteration holds at any batch: nothing fits.
    assert cp.largest_batch(batch=4, peak_bytes=5, start_bytes=1, held_bytes=1, usable_bytes=1).largest == 0
    # A peak that grew less than half with the batch (or not at all) gives no estimate, and says so.
    small = cp.largest_batch(
        batch=1, peak_bytes=8 * gib, start_bytes=4 * gib, held_bytes=3 * gib, usable_bytes=16 * gib
    )
    assert small.largest is None and "measure a larger batch than 1" in small.reason
    flat = cp.largest_batch(
        batch=4, peak_bytes=3 * gib, start_bytes=2 * gib, held_bytes=gib, usable_bytes=gib
    )
    assert flat.largest is None and "no estimate" in flat.reason


def test_suggest_batch_needs_two_iterations_on_a_gpu(store: teraio.Store) -> None:
    _, run = _run(_tied, _tokens(3), store, host_memory=1 << 30)
    with pytest.raises(RuntimeError, match="two training iterations on a GPU"):
        run.suggest_batch()
    report = run.report()
    assert report.batch == 4  # the token ids' rows
    assert report.largest_batch is None and "the largest that fits" not in str(report)
    model, optimizer = make()
    # The block plan fits the batch the loop gives it: it has no estimate to offer.
    block = teraio.offload(model, optimizer, gpu_memory="1GiB", whole_model="off")
    assert not hasattr(block, "suggest_batch")
