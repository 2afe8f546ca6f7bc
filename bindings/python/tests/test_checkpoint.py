"""Checkpoint and resume under `teraio.offload` in every mode (issue 43): `model.state_dict()` and
`optimizer.state_dict()` in the middle of training hold the true values wherever they live,
`torch.save` / `torch.load` round trip them, `load_state_dict` puts them back, and the resumed
losses equal the uninterrupted run's bitwise (CPU "device", and CUDA where there is one).

TERAIO_TEST_DIR=$PWD/target/py-test-stores python -m pytest -q bindings/python/tests/test_checkpoint.py
"""

from __future__ import annotations

import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import teraio  # noqa: E402
from teraio.runtime.modes.block import BlockOffload  # noqa: E402
from teraio.runtime.plans import block as bw  # noqa: E402
from test_loops import FUSED_MODES, MODES, _build, _data, _loop, _offload  # noqa: E402

STEPS = 8
#: The checkpoint is taken after this many steps: past the measuring iterations and into the
#: planned ones (the block plan measures three, then runs its plan first in the A/B trial).
SAVE_AT = 4


def _saved(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        # Whole-model mode reads what lives off the GPU into CPU tensors: the values must agree.
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _state_leaves_too(monkeypatch: Any) -> None:
    """The block plan (forced per block by `_offload`) moves all of the optimizer state too."""
    forced = bw.choose

    def choose(measured: Any, link: Any, *args: Any) -> Any:
        plan, tried = forced(measured, link, *args)
        plan.state_host_bytes = measured.state_bytes
        plan.predicted_ms, plan.predicted_peak_bytes = bw.predict(measured, plan, link)
        return plan, tried

    monkeypatch.setattr(bw, "choose", choose)


def _away(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters and optimizer-state tensors whose bytes are off the device now (empty storage)."""
    tensors = list(model.parameters()) + [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    return sum(1 for t in tensors if t.numel() and not t.untyped_storage().nbytes())


#: The modes that run on CUDA too (the others' tiny budgets are below what CUDA itself holds);
#: whole-model mode steps on the GPU there, whose arithmetic is the reference's.
CUDA_MODES = {"block-host": {}, "block-recompute": {}, "whole-model": {"update": "gpu"}}
CASES = [("cpu", mode) for mode in MODES] + [
    pytest.param(
        "cuda",
        mode,
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        id=f"cuda-{mode}",
    )
    for mode in CUDA_MODES
]


def _build_on(device: str, mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = _build(fused=mode in FUSED_MODES)
    return model.to(device), optimizer  # the same Parameter objects: the optimizer holds them


@pytest.mark.parametrize("device, mode", CASES)
def test_a_checkpoint_mid_training_holds_the_true_values_and_resumes_bitwise(
    monkeypatch: Any, store: Any, device: str, mode: str
) -> None:
    data = [batch.to(device) for batch in _data(STEPS)]
    more = CUDA_MODES[mode] if device == "cuda" else {}
    # Uninterrupted, without offload: the values at the save and the losses after it.
    ref_model, ref_opt = _build_on(device, mode)
    _loop(ref_model, ref_opt, data[:SAVE_AT], 2)
    expected = torch.load(io.BytesIO(_saved(ref_model, ref_opt)), weights_only=True)
    ref_after = _loop(ref_model, ref_opt, data[SAVE_AT:], 2)

    # With offload: the checkpoint taken in the middle of training, and training goes on.
    model, optimizer = _build_on(device, mode)
    run = _offload(monkeypatch, mode, model, optimizer, store, **more)
    if isinstance(run, BlockOffload):
        _state_leaves_too(monkeypatch)
    with run:
        _loop(model, optimizer, data[:SAVE_AT], 2)
        if isinstance(run, BlockOffload):
            # The block plan sends the state out as the next forward begins: as it is then.
            run.state.issue_deferred_out()
        if mode != "tensor":  # (1 GiB: nothing moves)
            assert _away(model, optimizer) > 0, "nothing lives off the device: the test tests nothing"
        checkpoint = _saved(model, optimizer)
        after = _loop(model, optimizer, data[SAVE_AT:], 2)
    assert after == ref_after
    loaded = torch.load(io.BytesIO(checkpoint), weights_only=True)
    assert _equal(loaded, expected)

    # Resumed in a new process's way: a fresh model and optimizer, the checkpoint loaded inside
    # a new session (their tensors live in its tiers by then), and the same batches.
    model, optimizer = _build_on(device, mode)
    if device == "cuda" and mode == "whole-model":
        # On the GPU the model does not fit whole-model mode's 1 MiB budget, and a load inside
        # the session brings it back there (refused): it is loaded before, as docs/python.md says.
        restored = torch.load(io.BytesIO(checkpoint), weights_only=True)
        model.load_state_dict(restored["model"])
        optimizer.load_state_dict(restored["optimizer"])
        del restored
        with _offload(monkeypatch, mode, model, optimizer, store, **more):
            resumed = _loop(model, optimizer, data[SAVE_AT:], 2)
    else:
        with _offload(monkeypatch, mode, model, optimizer, store, **more):
            _loop(model, optimizer, data[:1], 2)  # a step in the session first: the state exists
            # Loaded, then dropped, as a resume does: on a CPU "device" the loaded tensors are
            # device memory, which the plan would have to leave room for.
            restored = torch.load(io.BytesIO(checkpoint), weights_only=True)
            model.load_state_dict(restored["model"])
            optimizer.load_state_dict(restored["optimizer"])
            del restored
            resumed = _loop(model, optimizer, data[SAVE_AT:], 2)
    assert resumed == ref_after
    # (Whole-model mode under a budget too small for the model leaves it in CPU memory at exit.)
    assert all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(ref_model.parameters(), model.parameters()))


def test_whole_model_state_dict_views_the_host_tier_without_a_copy(store: Any) -> None:
    # A checkpoint of a model whose parameters and state live in host memory takes no second copy
    # of them: the dicts hold views of the tier's buffers, with the true values.
    data = _data(3)
    ref_model, ref_opt = _build()
    _loop(ref_model, ref_opt, data, 2)
    model, optimizer = _build()
    options = {"gpu_memory": 1 << 20, "host_memory": "64MiB", "min_bytes": 0, "reserve": 0}
    with teraio.offload(model, optimizer, store=store, whole_model="on", **options) as run:
        _loop(model, optimizer, data, 2)
        buffers = {t.untyped_storage().data_ptr() for t in run.host.buffers.values()}
        assert buffers, "nothing in the host tier: the test tests nothing"
        # What is not in the tier is the live tensor itself (resident, or CPU optimizer state).
        live = {p.untyped_storage().data_ptr() for p in model.parameters()} | {
            t.untyped_storage().data_ptr() for s in optimizer.state.values() for t in s.values() if t.dim()
        }
        params = model.state_dict()
        state = optimizer.state_dict()["state"]
        views = [t for t in params.values()] + [t for s in state.values() for t in s.values() if t.dim()]
        in_tier = [t for t in views if t.untyped_storage().data_ptr() in buffers]
        assert in_tier
        assert all(t.untyped_storage().data_ptr() in buffers | live for t in views)
        expected = {**ref_model.state_dict()}
        assert all(torch.equal(params[k], expected[k]) for k in expected)
