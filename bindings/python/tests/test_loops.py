"""Training loops as users write them (issue 43): gradient accumulation, clipping, schedulers, a
last smaller batch and evaluation between steps, in every mode, bitwise against the same loop
without offload on a CPU "device".

TERAIO_TEST_DIR=$PWD/target/py-test-stores python -m pytest -q bindings/python/tests/test_loops.py
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import pytest

torch = pytest.importorskip("torch")

import teraio  # noqa: E402
from teraio.runtime.modes.block import BlockOffload  # noqa: E402
from teraio.runtime.modes.tensor import TensorOffload  # noqa: E402
from teraio.runtime.modes.whole_model import ModelOffload  # noqa: E402
from teraio.runtime.movers.tiers import HOST  # noqa: E402
from teraio.runtime.plans import block as bw  # noqa: E402
from teraio.runtime.plans import capacity as cp  # noqa: E402
from teraio.runtime.plans.block import KEEP, RECOMPUTE, SELECTIVE, Measurement, Plan  # noqa: E402
from tiny import make  # noqa: E402

ROWS, LAYERS, HIDDEN, DIM = 512, 4, 256, 64
STEPS = 9


def _data(steps: int, rows: int = ROWS, last_rows: Optional[int] = None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(rows, DIM, generator=generator) for _ in range(steps)]
    if last_rows is not None:
        data[-1] = data[-1][:last_rows].clone()
    return data


def _build(fused: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN, dim=DIM)
    if fused:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return model, optimizer


def _loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[torch.Tensor],
    micro: int,
    clip: Optional[float] = None,
    scheduler: Optional[Any] = None,
    evaluate: Optional[torch.Tensor] = None,
    autocast: Optional[torch.dtype] = None,
) -> list[float]:
    """Each batch split into `micro` micro-batches, `(loss / micro).backward()` each (the forward
    under CPU autocast to `autocast`, if given), then (with `clip`) `clip_grad_norm_`, the step,
    the scheduler's step, and (with `evaluate`) a forward under `torch.no_grad()`: the losses it
    saw, the clipped norms, and the evaluation's, in order."""
    seen = []
    for batch in data:
        for part in batch.chunk(micro):
            with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                loss = model(part) / micro
            loss.backward()
            seen.append(loss.item())
        if clip is not None:
            seen.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if evaluate is not None:
            with torch.no_grad():
                seen.append(model(evaluate).item())
    return seen


def _force(monkeypatch: Any, action: str) -> None:
    """Every block gets `action` (the CPU's measured times vary more than the choices they decide)."""

    def forced(measured: Measurement, link: Any, *args: Any) -> Any:
        plan = Plan([action] * len(measured.blocks))
        plan.predicted_ms, plan.predicted_peak_bytes = bw.predict(measured, plan, link)
        return plan, []

    monkeypatch.setattr(bw, "choose", forced)


#: Each mode as the tests run it: the options, and the class `teraio.offload` must pick.
MODES: dict[str, tuple[dict[str, Any], type]] = {
    "block-keep": ({"granularity": "block", "gpu_memory": "1GiB", "force": KEEP}, BlockOffload),
    "block-host": ({"granularity": "block", "gpu_memory": "1GiB", "force": HOST}, BlockOffload),
    "block-selective": ({"granularity": "block", "gpu_memory": "1GiB", "force": SELECTIVE}, BlockOffload),
    "block-recompute": ({"granularity": "block", "gpu_memory": "1GiB", "force": RECOMPUTE}, BlockOffload),
    "tensor": ({"granularity": "tensor", "gpu_memory": "1GiB", "host_memory": "256MiB"}, TensorOffload),
    # Below the tiny model's peak: activations and optimizer state move.
    "tensor-moving": (
        {"granularity": "tensor", "gpu_memory": "4MiB", "host_memory": "256MiB"},
        TensorOffload,
    ),
    "whole-model": ({"whole_model": "on", "gpu_memory": 1 << 20, "host_memory": 300_000}, ModelOffload),
    # The step on the CPU, with step_in_backward="auto": on from the third iteration of the loops
    # that take one backward per step and do not clip.
    "whole-model-cpu-step": (
        {"whole_model": "on", "gpu_memory": 1 << 20, "host_memory": 1 << 30, "update": "cpu"},
        ModelOffload,
    ),
}


#: Modes whose step is bitwise torch's fused CPU AdamW (the CPU step), against which they compare.
FUSED_MODES = {"whole-model-cpu-step"}


def _offload(
    monkeypatch: Any,
    mode: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    store: Any,
    **more: Any,
) -> Any:
    options, kind = MODES[mode]
    options = {"min_bytes": 0, "reserve": 0, **options, **more}
    if "force" in options:
        _force(monkeypatch, options.pop("force"))
        options["host_link_bandwidth"] = "1000GB/s"
    run = teraio.offload(model, optimizer, store=store if kind is ModelOffload else None, **options)
    assert type(run) is kind
    return run


def _assert_same(reference: Any, other: Any) -> None:
    (ref_model, ref_opt, ref_seen), (model, optimizer, seen) = reference, other
    assert seen == ref_seen
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(ref_model.parameters(), model.parameters()):
        for key, value in ref_opt.state[p].items():
            assert torch.equal(value, optimizer.state[q][key]), key


def _compare(
    monkeypatch: Any,
    mode: str,
    store: Any,
    loop: Callable[[torch.nn.Module, torch.optim.Optimizer], list[float]],
) -> Any:
    fused = mode in FUSED_MODES
    ref_model, ref_opt = _build(fused)
    reference = (ref_model, ref_opt, loop(ref_model, ref_opt))
    model, optimizer = _build(fused)
    with _offload(monkeypatch, mode, model, optimizer, store) as run:
        seen = loop(model, optimizer)
    _assert_same(reference, (model, optimizer, seen))
    return run


@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("mode", list(MODES))
def test_gradient_accumulation_is_bitwise(monkeypatch: Any, store: Any, mode: str, micro: int) -> None:
    data = _data(STEPS)
    run = _compare(monkeypatch, mode, store, lambda m, o: _loop(m, o, data, micro))
    if isinstance(run, BlockOffload):
        assert run.plan is not None
    if mode == "whole-model-cpu-step":  # "auto": in backward where one backward makes a step
        assert run.report().step_in_backward == (micro == 1)


@pytest.mark.parametrize("mode", ["whole-model-cpu-step"])
def test_a_step_in_backward_with_a_smaller_last_batch_and_evaluation_is_bitwise(
    monkeypatch: Any, store: Any, mode: str
) -> None:
    # One backward per step, so "auto" runs the CPU step in backward from the third iteration,
    # through evaluation forwards under no_grad between steps and a smaller last batch.
    data = _data(STEPS, last_rows=ROWS // 4)
    held_out = _data(1, rows=ROWS // 2)[0] * 0.5
    run = _compare(monkeypatch, mode, store, lambda m, o: _loop(m, o, data, 1, evaluate=held_out))
    assert run.report().step_in_backward


@pytest.mark.parametrize("mode", list(MODES))
def test_clipping_and_a_scheduler_are_bitwise(monkeypatch: Any, store: Any, mode: str) -> None:
    data = _data(STEPS)

    def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return _loop(model, optimizer, data, 2, clip=0.05, scheduler=scheduler)

    _compare(monkeypatch, mode, store, loop)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_smaller_last_batch_and_evaluation_under_no_grad_are_bitwise(
    monkeypatch: Any, store: Any, mode: str
) -> None:
    # The last batch has fewer rows than the measured ones; an evaluation forward runs between
    # steps, measuring iterations included.
    data = _data(STEPS, last_rows=ROWS // 4)
    held_out = _data(1, rows=ROWS // 2)[0] * 0.5
    _compare(monkeypatch, mode, store, lambda m, o: _loop(m, o, data, 2, evaluate=held_out))


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_the_block_plan_measures_one_pass_and_counts_the_passes(monkeypatch: Any, micro: int) -> None:
    data = _data(5)
    model, optimizer = _build()
    with _offload(monkeypatch, "block-recompute", model, optimizer, None) as run:
        _loop(model, optimizer, data, micro)
    measured = run.measured
    assert measured.passes == micro
    # Times are one pass's: the iteration with every block checkpointed counts each pass once.
    per_pass = sum(b.forward_ms + b.recompute_ms + b.backward_ms for b in measured.blocks)
    edges = measured.pre_forward_ms + measured.head_backward_ms + measured.tail_backward_ms
    assert measured.checkpoint_all_ms == pytest.approx(micro * (per_pass + edges) + measured.step_ms)
    assert all(b.backward_ms > 0 for b in measured.blocks[1:])
    report = run.report()
    assert report.recomputed_bytes_per_iteration == micro * sum(b.saved_bytes for b in measured.blocks)


def test_with_several_passes_the_state_comes_back_in_the_last_backward() -> None:
    # One pass: the state comes back where backward has freed room for it. Two: it comes back at
    # the same position of the second pass's backward; brought back in the first pass's, it would
    # stay through the second pass's forward, which the bound does not hold (on the GPU: out of
    # memory in the second micro-batch's loss head). The restore overlaps that backward, as with
    # one pass, instead of stalling the step.
    from test_blockwise import _measured

    GB = 10**9
    # Every block kept holds 8 GB; with all 4 GB of state on the device the bound is 16 GB, and
    # 14 GB fit once 2 GB of state leave (backward frees room for them after two blocks). The
    # copy back (10 ms at 200 GB/s) fits in the rest of backward (12 ms), and would delay the step.
    from teraio.machine import Link

    link = Link(1e12, 2e11, 1e12, 1e12)
    one = _measured(peak=4 * GB, state=4 * GB)
    single = bw.fit_layout(one, link, 14 * GB, [KEEP] * 8, 1, [GB] * 4, 1 << 50, False, 0)
    assert single is not None and single.state_out_bytes > 0 and single.state_restore_at == 2
    two = dataclasses.replace(one, passes=2)
    plan = bw.fit_layout(two, link, 14 * GB, [KEEP] * 8, 1, [GB] * 4, 1 << 50, False, 0)
    assert plan is not None and plan.state_out_bytes == single.state_out_bytes
    assert plan.state_restore_at == single.state_restore_at
    # The second pass costs its forward and backward again, the step once, and the restore no
    # more than with one pass.
    again = one.checkpoint_all_ms - one.step_ms - sum(b.recompute_ms for b in one.blocks)
    assert plan.predicted_ms == pytest.approx(single.predicted_ms + again)
    assert two.checkpoint_all_ms == 2 * one.checkpoint_all_ms - one.step_ms
    at_step = dataclasses.replace(plan, state_restore_at=None)
    assert bw.predict(two, at_step, link)[0] > plan.predicted_ms


def _keep_all_and_restore_in_backward(monkeypatch: Any, passes: int) -> None:
    """The block plan keeps every block, moves all the state to the host and brings it back at
    the first backward position, measured from iterations of `passes` passes; the A/B trial sees
    no difference in time."""
    monkeypatch.setattr(BlockOffload, "_recent_times", lambda self, count: [0.0] * count)

    def restoring(measured: Measurement, link: Any, *args: Any) -> Any:
        assert measured.passes == passes
        plan = Plan([KEEP] * len(measured.blocks), state_host_bytes=measured.state_bytes, state_restore_at=0)
        plan.predicted_ms, plan.predicted_peak_bytes = bw.predict(measured, plan, link)
        return plan, []

    monkeypatch.setattr(bw, "choose", restoring)


def test_with_several_passes_the_state_comes_back_once_in_the_last_backward(monkeypatch: Any) -> None:
    # A plan made from accumulating iterations (two passes) that restores in backward: the state
    # stays out through both forwards, comes back once per step, in the second pass's backward,
    # and nothing is sent out again between the passes.
    _keep_all_and_restore_in_backward(monkeypatch, passes=2)
    model, optimizer = _build()
    # The measuring steps, then the steps the A/B trial runs the plan first.
    planned_steps = BlockOffload.TRIAL_STEPS // 2
    data = _data(BlockOffload.MEASURING_STEPS + planned_steps)
    resident: list[int] = []
    run = teraio.offload(model, optimizer, gpu_memory="1GiB", granularity="block", min_bytes=0, reserve=0)
    # After block 0's forward (where a new pass begins), in each planned iteration.
    model.layers[1].register_forward_pre_hook(
        lambda module, args: resident.append(run._resident_state_bytes()) if run.plan else None
    )
    with run:
        seen = _loop(model, optimizer, data[: BlockOffload.MEASURING_STEPS], 2)
        assert run.plan is not None and run.plan.state_restore_at == 0
        stats = run.state.stats
        planned, offloaded = stats.prefetches_planned, stats.offloaded_bytes[HOST]
        on_demand = stats.prefetches_on_demand
        slots = len(run.state.slots)
        per_step = sum(slot.nbytes for slot in run.state.slots)
        assert slots > 0
        # The trial's first iterations run the plan.
        seen += _loop(model, optimizer, data[BlockOffload.MEASURING_STEPS :], 2)
        # One restore per slot and step, all at the planned point; one copy out per step.
        assert stats.prefetches_planned - planned == planned_steps * slots
        assert stats.prefetches_on_demand == on_demand
        assert stats.offloaded_bytes[HOST] - offloaded == planned_steps * per_step
    assert len(resident) == 2 * planned_steps and all(nbytes == 0 for nbytes in resident), resident
    ref_model, ref_opt = _build()
    assert seen == _loop(ref_model, ref_opt, data, 2)
    assert all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters()))


def test_state_restored_in_backward_leaves_again_before_another_forward(monkeypatch: Any) -> None:
    # A plan made for one pass per step (state back in backward) meets a loop that accumulates:
    # the second forward must not run with the state on the device.
    _keep_all_and_restore_in_backward(monkeypatch, passes=1)
    model, optimizer = _build()
    data = _data(BlockOffload.MEASURING_STEPS + BlockOffload.TRIAL_STEPS // 2)  # the plan's steps
    resident: list[tuple[int, int]] = []
    seen = []
    run = teraio.offload(model, optimizer, gpu_memory="1GiB", granularity="block", min_bytes=0, reserve=0)
    # After block 0's forward (where a new pass begins), in each planned iteration.
    model.layers[1].register_forward_pre_hook(
        lambda module, args: resident.append((run.step, run._resident_state_bytes())) if run.plan else None
    )
    with run:
        seen += _loop(model, optimizer, data[: BlockOffload.MEASURING_STEPS], 1)
        assert run.plan is not None and run.plan.state_restore_at == 0
        seen += _loop(model, optimizer, data[BlockOffload.MEASURING_STEPS :], 2)
    assert resident and all(nbytes == 0 for _, nbytes in resident), resident
    assert run.state.stats.prefetched_bytes[HOST] > 0
    ref_model, ref_opt = _build()
    reference = _loop(ref_model, ref_opt, data[: BlockOffload.MEASURING_STEPS], 1)
    reference += _loop(ref_model, ref_opt, data[BlockOffload.MEASURING_STEPS :], 2)
    assert seen == reference
    assert all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters()))


def _link(bandwidth: float) -> Any:
    from teraio.machine import Link

    return Link(bandwidth, bandwidth, bandwidth, bandwidth)


# -- frozen parameters -----------------------------------------------------------------------------


class LoraLinear(torch.nn.Module):
    """A frozen base `Linear` plus a trainable low-rank update (LoRA's shape: B @ A, B zero at the
    start), written out so that no `peft` is needed."""

    def __init__(self, dim_in: int, dim_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.Linear(dim_in, dim_out)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, dim_in) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.zeros(dim_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoraBlock(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = LoraLinear(dim, hidden)
        self.down = LoraLinear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class LoraLM(torch.nn.Module):
    """A frozen embedding, blocks of LoRA-adapted linears (their norms trained) and a head."""

    def __init__(self, vocab: int = 96, dim: int = 64, hidden: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.embed.requires_grad_(False)
        self.layers = torch.nn.ModuleList([LoraBlock(dim, hidden) for _ in range(layers)])
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def _lora(all_parameters: bool, fused: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = LoraLM()
    # peft's users pass the trainable parameters; others pass all (AdamW skips those without a
    # gradient).
    params = model.parameters() if all_parameters else [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2, fused=fused or None)


def _tokens(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 96, (8, 64), generator=generator) for _ in range(steps)]


@pytest.mark.parametrize("all_parameters", [False, True], ids=["trainable", "all"])
@pytest.mark.parametrize("mode", list(MODES))
def test_frozen_parameters_train_bitwise(
    monkeypatch: Any, store: Any, mode: str, all_parameters: bool
) -> None:
    data = _tokens(STEPS)
    ref_model, ref_opt = _lora(all_parameters, fused=mode in FUSED_MODES)
    reference = (ref_model, ref_opt, _loop(ref_model, ref_opt, data, 2, clip=1.0))
    model, optimizer = _lora(all_parameters, fused=mode in FUSED_MODES)
    frozen = {name: p.clone() for name, p in model.named_parameters() if not p.requires_grad}
    writes: list[tuple[int, Any]] = []
    real_write = ModelOffload._write

    def write(self: ModelOffload, slot: Any, kind: Any, source: Any) -> Any:
        writes.append((id(slot.param), kind))
        return real_write(self, slot, kind, source)

    monkeypatch.setattr(ModelOffload, "_write", write)
    with _offload(monkeypatch, mode, model, optimizer, store) as run:
        seen = _loop(model, optimizer, data, 2, clip=1.0)
    _assert_same(reference, (model, optimizer, seen))
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
            assert p.grad is None and not optimizer.state.get(p), name
    if isinstance(run, BlockOffload):
        # The state planned is the trained parameters' (AdamW: two moments and a step each).
        trained = [p for p in model.parameters() if p.requires_grad]
        assert run.measured.state_bytes == sum(
            v.untyped_storage().nbytes() for p in trained for v in optimizer.state[p].values()
        )
        assert run.measured.state_bytes >= 2 * sum(p.numel() * 4 for p in trained)
    if isinstance(run, ModelOffload):
        # Frozen weights are written once, as the session starts, and only read after that: no
        # write-back, no gradient; trained ones are written back after each GPU step (the CPU
        # step updates them where they are, in host memory).
        written_back = 0 if run.update_site.site == cp.CPU_UPDATE else STEPS
        for p in model.parameters():
            mine = [kind for key, kind in writes if key == id(p)]
            assert mine.count(cp.PARAMETER) == (1 if not p.requires_grad else 1 + written_back), mine
            if not p.requires_grad:
                assert mine == [cp.PARAMETER]


@pytest.mark.parametrize("all_parameters", [False, True], ids=["trainable", "all"])
def test_whole_model_choice_counts_no_gradient_or_state_for_frozen_parameters(all_parameters: bool) -> None:
    from teraio.runtime.modes.whole_model import model_state_bytes

    model, optimizer = _lora(all_parameters)
    params = sum(p.numel() * 4 for p in model.parameters())
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert trained < params // 4
    # AdamW: a gradient and two moments per trained parameter, nothing for the frozen ones.
    assert model_state_bytes(model, optimizer) == (params + trained, params + 3 * trained)


def _peft_llama() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(0)
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config),
        peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trained, lr=1e-2)


@pytest.mark.parametrize("mode", ["block-keep", "block-recompute", "tensor", "whole-model"])
def test_peft_lora_trains_bitwise(monkeypatch: Any, store: Any, mode: str) -> None:
    generator = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 256, (4, 32), generator=generator) for _ in range(STEPS)]

    def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        seen = []
        for tokens in data:
            for part in tokens.chunk(2):
                loss = model(input_ids=part, labels=part).loss / 2
                loss.backward()
                seen.append(loss.item())
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return seen

    ref_model, ref_opt = _peft_llama()
    reference = loop(ref_model, ref_opt)
    model, optimizer = _peft_llama()
    with _offload(monkeypatch, mode, model, optimizer, store) as run:
        seen = loop(model, optimizer)
    assert seen == reference
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trained < sum(p.numel() for p in model.parameters()) // 2
    if isinstance(run, BlockOffload):
        assert len(run.blocks) == 3 and run.measured.passes == 2
