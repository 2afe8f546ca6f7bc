"""The block plan's frozen Linear weights in autocast's dtype (`runtime/movers/frozen.py`), on a CPU
"device" under bf16 autocast: the same bits as training without teraio, the fp32 values in
`state_dict()` and back at exit, loads that reach them, and a forward without autocast (exact
without gradients, an error with them)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import teraio  # noqa: E402
from teraio.runtime.modes.block import BlockOffload  # noqa: E402
from teraio.runtime.movers.frozen import frozen_linear_parameters  # noqa: E402
from teraio.runtime.movers.tiers import HOST as HOST_TIER  # noqa: E402
from teraio.runtime.plans.block import HOST, KEEP, RECOMPUTE  # noqa: E402
from test_loops import STEPS, _force, _lora, _tokens  # noqa: E402
from test_loops import _loop as _accumulating_loop  # noqa: E402


def _loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[float]:
    seen = []
    for tokens in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens)
        loss.backward()
        seen.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return seen


def _run(monkeypatch: Any, action: str, **options: Any) -> BlockOffload:
    model, optimizer = _lora(all_parameters=False)
    _force(monkeypatch, action)
    return teraio.offload(
        model,
        optimizer,
        granularity="block",
        gpu_memory="1GiB",
        min_bytes=0,
        reserve=0,
        host_link_bandwidth="1000GB/s",
        **options,
    )


def _frozen_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad and ".base." in n]


def test_the_frozen_linear_weights_are_the_blocks_own() -> None:
    model, _ = _lora(all_parameters=False)
    cpu = torch.device("cpu")
    found = frozen_linear_parameters(model, list(model.layers), cpu)
    # Each block's two LoRA linears have a frozen base weight and bias; the frozen embedding is
    # no Linear's, the trained head is not frozen.
    assert len(found) == 4 * len(model.layers)
    assert all(type(module) is torch.nn.Linear for module, _ in found)
    tied = torch.nn.Linear(64, 96, bias=False)
    tied.weight = model.embed.weight  # held by an Embedding too
    model.layers[0].extra = tied
    assert len(frozen_linear_parameters(model, list(model.layers), cpu)) == len(found)
    assert frozen_linear_parameters(model, list(model.layers), torch.device("meta")) == []


@pytest.mark.parametrize("action", [KEEP, RECOMPUTE])
def test_training_with_bf16_frozen_weights_is_bitwise(monkeypatch: Any, action: str) -> None:
    data = _tokens(STEPS)
    ref_model, ref_opt = _lora(all_parameters=False)
    reference = _loop(ref_model, ref_opt, data)
    run = _run(monkeypatch, action)
    model, optimizer = run.model, run.optimizer
    names = _frozen_names(model)
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    with run:
        seen = _loop(model, optimizer, data[:1])
        params = dict(model.named_parameters())
        assert {params[n].dtype for n in names} == {torch.bfloat16}
        state = model.state_dict()
        for n in names:  # the fp32 values, not the copies
            assert state[n].dtype == torch.float32 and torch.equal(state[n], originals[n]), n
        seen += _loop(model, optimizer, data[1:])
    assert seen == reference
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert q.dtype == p.dtype and torch.equal(p, q), name
    report = run.report()
    assert report.frozen_copies["dtype"] == "bfloat16" and report.frozen_copies["parameters"] == len(names)
    assert report.frozen_copies["saved_bytes"] == sum(originals[n].numel() * 2 for n in names)
    assert "frozen weights:" in str(report)


def test_a_load_during_the_run_reaches_the_fp32_values(monkeypatch: Any) -> None:
    run = _run(monkeypatch, KEEP)
    model, optimizer = run.model, run.optimizer
    names = _frozen_names(model)
    loaded = {n: torch.randn_like(p) for n, p in model.named_parameters() if n in names}
    with run:
        _loop(model, optimizer, _tokens(2))
        model.load_state_dict(loaded, strict=False)
        params = dict(model.named_parameters())
        for n in names:  # the copies hold the loaded values rounded as autocast rounds them
            assert torch.equal(params[n], loaded[n].to(torch.bfloat16)), n
        assert all(torch.equal(model.state_dict()[n], loaded[n]) for n in names)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], loaded[n]) for n in names)


def test_an_evaluation_without_autocast_runs_on_the_fp32_values(monkeypatch: Any) -> None:
    tokens = _tokens(3)
    ref_model, ref_opt = _lora(all_parameters=False)
    _loop(ref_model, ref_opt, tokens[:2])
    with torch.no_grad():
        expected = ref_model(tokens[2])
    run = _run(monkeypatch, KEEP)
    model, optimizer = run.model, run.optimizer
    with run:
        _loop(model, optimizer, tokens[:2])
        with pytest.warns(UserWarning, match="without torch.bfloat16 autocast"), torch.no_grad():
            assert torch.equal(model(tokens[2]), expected)
        assert {p.dtype for n, p in model.named_parameters() if n in _frozen_names(model)} == {torch.bfloat16}
        with pytest.raises(RuntimeError, match="must run under torch.autocast"):
            model(tokens[2])


def test_off_and_a_run_without_autocast_leave_the_weights_as_they_are(monkeypatch: Any) -> None:
    for options, autocast in (({"frozen_compute_copies": "off"}, True), ({}, False)):
        run = _run(monkeypatch, KEEP, **options)
        model, optimizer = run.model, run.optimizer
        with run:
            for tokens in _tokens(2):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    model(tokens).backward()
                optimizer.step()
                optimizer.zero_grad()
                assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert run.report().frozen_copies == {}


def test_a_host_block_copies_no_frozen_weight(monkeypatch: Any) -> None:
    moved = {}
    for setting in ("auto", "off"):
        run = _run(monkeypatch, HOST, frozen_compute_copies=setting)
        with run:
            _loop(run.model, run.optimizer, _tokens(STEPS))
        moved[setting] = run.report().bytes_per_iteration["offloaded"][HOST_TIER]
    model, _ = _lora(all_parameters=False)
    weights = sum(p.numel() for n, p in model.named_parameters() if n.endswith("base.weight"))
    # "off": each block saves the bf16 casts of its frozen weights for backward, and they go to
    # host memory; with the copies nothing is cast, and the weights themselves never move.
    assert moved["off"] - moved["auto"] == 2 * weights


@pytest.mark.parametrize("micro", [2, 4])
@pytest.mark.parametrize("action", [KEEP, RECOMPUTE])
def test_gradient_accumulation_with_bf16_frozen_weights_is_bitwise(
    monkeypatch: Any, action: str, micro: int
) -> None:
    data = _tokens(STEPS)
    ref_model, ref_opt = _lora(all_parameters=False)
    reference = _accumulating_loop(ref_model, ref_opt, data, micro, clip=1.0, autocast=torch.bfloat16)
    run = _run(monkeypatch, action)
    model, optimizer = run.model, run.optimizer
    names = _frozen_names(model)
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    with run:
        seen = _accumulating_loop(model, optimizer, data[:1], micro, clip=1.0, autocast=torch.bfloat16)
        params = dict(model.named_parameters())
        assert {params[n].dtype for n in names} == {torch.bfloat16}
        seen += _accumulating_loop(model, optimizer, data[1:], micro, clip=1.0, autocast=torch.bfloat16)
        # Still the copies after every step, and the plan made with the forced action (the A/B
        # trial may then keep checkpointing every block, by measured times: the bits are the same).
        assert {params[n].dtype for n in names} == {torch.bfloat16}
        assert run.choice["plan"][action] == len(model.layers)
    assert len(seen) == STEPS * (micro + 1)
    assert seen == reference
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert q.dtype == p.dtype and torch.equal(p, q), name
    for p, q in zip(ref_model.parameters(), model.parameters()):
        for key, value in ref_opt.state[p].items():
            assert torch.equal(value, optimizer.state[q][key]), key
    # The trained parameters moved (the comparison above compares training, not two copies of
    # the initial values).
    fresh, _ = _lora(all_parameters=False)
    trained = [n for n, p in fresh.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    assert all(not torch.equal(params[n], dict(fresh.named_parameters())[n]) for n in trained)
    report = run.report()
    assert report.frozen_copies["dtype"] == "bfloat16" and report.frozen_copies["parameters"] == len(names)
    assert report.frozen_copies["saved_bytes"] == sum(originals[n].numel() * 2 for n in names)
    # At exit: the fp32 values back, as they were.
    for n in names:
        assert params[n].dtype == torch.float32 and torch.equal(params[n], originals[n]), n
