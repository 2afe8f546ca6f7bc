"""teraio.head: the causal-LM loss in chunks of rows, the same bits as the model's own."""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from typing import Any

import pytest
import teraio
import torch
import torch.nn.functional as F
from teraio import head
from torch.utils._python_dispatch import TorchDispatchMode

CHUNKS = [None, 4 * 64 * 7, 4 * 64 * 1]  # one chunk; 7 rows (the last one short); one row


def _logits(dtype: torch.dtype, rows: int = 50, vocab: int = 64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(rows, vocab, generator=generator) * 4).to(dtype).requires_grad_()


def _targets(rows: int = 50, vocab: int = 64) -> torch.Tensor:
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(2))
    target[3:9] = -100
    return target


@pytest.mark.parametrize("scale", [1.0, 1.3, 0.5])
@pytest.mark.parametrize("chunk_bytes", CHUNKS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_is_the_same_bits_as_torchs(
    dtype: torch.dtype, reduction: str, chunk_bytes: Any, scale: float
) -> None:
    """For the gradient `loss.backward()` gives (1: the gradient computed in forward) and for
    scaled losses (computed in backward for the value given)."""
    logits, target = _logits(dtype), _targets()
    expected = F.cross_entropy(logits.float(), target, reduction=reduction)
    (expected_grad,) = torch.autograd.grad(expected * scale if scale != 1.0 else expected, logits)
    state = head.HeadState()
    loss = head.cross_entropy(logits, target, reduction=reduction, chunk_bytes=chunk_bytes, state=state)
    (grad,) = torch.autograd.grad(loss * scale if scale != 1.0 else loss, logits)
    assert loss.dtype == torch.float32 and torch.equal(loss, expected)
    assert grad.dtype == dtype and torch.equal(grad, expected_grad)
    assert state.gradient_in_forward == (scale == 1.0)


def test_every_row_ignored_is_nan_as_in_torch() -> None:
    logits = _logits(torch.float32)
    target = torch.full((50,), -100)
    assert torch.isnan(head.cross_entropy(logits, target)) and torch.isnan(F.cross_entropy(logits, target))


@pytest.mark.parametrize("chunk_bytes", CHUNKS)
def test_causal_lm_loss_is_hugging_faces_bit_for_bit(monkeypatch: Any, chunk_bytes: Any) -> None:
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    if chunk_bytes is not None:
        monkeypatch.setattr(head, "CHUNK_BYTES", chunk_bytes)
    logits = _logits(torch.bfloat16, rows=2 * 25).view(2, 25, 64).detach().requires_grad_()
    labels = _targets().view(2, 25)
    shifted = torch.roll(labels, -1, dims=1)
    cases = (
        {},
        {"num_items_in_batch": torch.tensor(31)},
        {"num_items_in_batch": torch.tensor(31.0)},  # the Trainer's: a float tensor
        {"num_items_in_batch": torch.tensor([[31]])},  # per replica under DataParallel
        {"num_items_in_batch": torch.tensor(31, dtype=torch.float64)},
        {"num_items_in_batch": 37},
        {"num_items_in_batch": 37.5},
        {"shift_labels": shifted},
    )
    for kwargs in cases:
        for scale in (1.0, 0.25, 0.3):  # loss.backward(), accumulation over 4, a weighted loss
            expected = loss_utils.ForCausalLMLoss(logits, labels, 64, **kwargs)
            (expected_grad,) = torch.autograd.grad(expected * scale if scale != 1.0 else expected, logits)
            state = head.HeadState()
            loss = head.causal_lm_loss(logits, labels, 64, **kwargs, state=state)
            (grad,) = torch.autograd.grad(loss * scale if scale != 1.0 else loss, logits)
            assert loss.dtype == expected.dtype and loss.shape == expected.shape, (kwargs, scale)
            assert torch.equal(loss, expected) and torch.equal(grad, expected_grad), (kwargs, scale)
            # Divided inside the loss: `loss.backward()` gives it 1, so forward's gradient serves.
            assert state.gradient_in_forward == (scale == 1.0), (kwargs, scale)


class _Recorded(TorchDispatchMode):
    """What the ops inside it did: their names, weak references to their outputs, and the most
    bytes any output held."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.refs: list[Any] = []
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.__name__)
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.refs.append(weakref.ref(value))
                self.largest = max(self.largest, value.untyped_storage().nbytes())
        return out

    def alive(self) -> list[torch.Tensor]:
        """The outputs still referenced."""
        return [ref() for ref in self.refs if ref() is not None]


def test_no_tensor_of_the_loss_is_larger_than_the_logits(monkeypatch: Any) -> None:
    """The model's own loss makes fp32 copies of all the bf16 logits (twice their bytes);
    teraio's makes none: its largest tensors are the logits' gradient and a chunk."""
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    monkeypatch.setattr(head, "CHUNK_BYTES", 4 * 64 * 10)
    logits = _logits(torch.bfloat16, rows=400).view(4, 100, 64).detach().requires_grad_()
    labels = torch.randint(0, 64, (4, 100), generator=torch.Generator().manual_seed(3))
    logits_bytes = logits.untyped_storage().nbytes()
    sizes = {}
    for name, loss_fn in (("model", loss_utils.ForCausalLMLoss), ("teraio", head.causal_lm_loss)):
        with _Recorded() as largest:
            loss = loss_fn(logits, labels, 64)
            loss.backward()
        sizes[name] = largest.largest
        logits.grad = None
    assert sizes["model"] >= 2 * logits_bytes
    assert sizes["teraio"] <= logits_bytes


def test_what_forward_leaves_for_backward_is_the_logits_gradient_and_a_value_per_row() -> None:
    """Between forward and backward the loss holds nothing of the vocabulary's size in fp32:
    the logits' gradient in their dtype (computed in forward) and one value per row. Backward
    then computes no log-softmax: it hands that gradient on."""
    rows, vocab = 400, 64
    logits, target = _logits(torch.bfloat16, rows=rows, vocab=vocab), _targets(rows=rows, vocab=vocab)
    with _Recorded() as outputs:
        loss = head.cross_entropy(logits, target, chunk_bytes=4 * vocab * 10, state=head.HeadState())
    alive = outputs.alive()
    gradients = [t for t in alive if t.shape == logits.shape]
    assert len(gradients) == 1 and gradients[0].dtype == torch.bfloat16
    rest = [t for t in alive if t.shape != logits.shape]
    assert sum(t.untyped_storage().nbytes() for t in rest) <= 4 * 8 * rows
    with _Recorded() as ops:
        loss.backward()
    assert logits.grad is not None and not any("log_softmax" in name for name in ops.names)


def test_a_scaled_loss_moves_the_gradient_to_backward_for_the_rest_of_the_session() -> None:
    """The first backward of a scaled loss (accumulation's `(loss / N).backward()`) computes the
    gradient for that value; from then on forward leaves a value per row and no gradient."""
    rows, vocab = 400, 64
    logits, target = _logits(torch.bfloat16, rows=rows, vocab=vocab), _targets(rows=rows, vocab=vocab)
    state = head.HeadState()
    grads = []
    for step in range(2):
        with _Recorded() as outputs:
            loss = head.cross_entropy(logits, target, chunk_bytes=4 * vocab * 10, state=state)
        alive = outputs.alive()
        assert any(t.shape == logits.shape for t in alive) == (step == 0)
        if step == 1:
            assert sum(t.untyped_storage().nbytes() for t in alive) <= 4 * 8 * rows
        with _Recorded() as ops:
            (grad,) = torch.autograd.grad(loss / 2, logits)
        assert any("log_softmax" in name for name in ops.names)
        grads.append(grad)
        assert not state.gradient_in_forward
    expected = F.cross_entropy(logits.float(), target)
    (expected_grad,) = torch.autograd.grad(expected / 2, logits)
    assert all(torch.equal(grad, expected_grad) for grad in grads)


def test_no_gradient_is_computed_in_forward_where_none_is_wanted() -> None:
    """Under no_grad, for logits that need no gradient, and without a `HeadState` (a direct
    call), forward runs no backward kernel and counts no loss."""
    rows, vocab = 400, 64
    logits, target = _logits(torch.bfloat16, rows=rows, vocab=vocab), _targets(rows=rows, vocab=vocab)
    cases = (
        (torch.no_grad(), logits, head.HeadState()),
        (contextlib.nullcontext(), logits.detach(), head.HeadState()),
        (contextlib.nullcontext(), logits, None),
    )
    for context, source, state in cases:
        with context, _Recorded() as ops:
            loss = head.cross_entropy(source, target, chunk_bytes=4 * vocab * 10, state=state)
        assert not any("backward" in name for name in ops.names), ops.names
        assert state is None or state.losses == 0
        assert torch.equal(loss, F.cross_entropy(logits.detach().float(), target))
    state = head.HeadState()
    with _Recorded() as ops:
        head.cross_entropy(logits, target, chunk_bytes=4 * vocab * 10, state=state)
    assert any("_log_softmax_backward_data" in name for name in ops.names) and state.losses == 1


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_backward_through_a_retained_graph_gives_the_same_gradient_each_time(scale: float) -> None:
    logits, target = _logits(torch.bfloat16), _targets()
    loss = head.cross_entropy(logits, target, chunk_bytes=4 * 64 * 7, state=head.HeadState()) * scale
    (first,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (second,) = torch.autograd.grad(loss, logits, retain_graph=True)
    assert torch.equal(first, second)
    # Into a leaf's .grad, zeroed in place between backwards: were .grad the gradient forward
    # computed, the zeroing would reach the next backward.
    loss = head.cross_entropy(logits, target, chunk_bytes=4 * 64 * 7, state=head.HeadState()) * scale
    for _ in range(3):
        loss.backward(retain_graph=True)
        assert torch.equal(logits.grad, first)
        logits.grad.zero_()


def test_bad_shapes_and_reductions_are_clear_errors() -> None:
    logits, target = _logits(torch.float32), _targets()
    with pytest.raises(ValueError, match="logits \\(rows, vocabulary\\)"):
        head.cross_entropy(logits.view(5, 10, 64), target)
    with pytest.raises(ValueError, match="reduction 'mean' or 'sum'"):
        head.cross_entropy(logits, target, reduction="none")


def _prepared(how: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A model with Accelerate's bf16 forward (the model the loop calls, the Hugging Face model):
    set by `accelerator.prepare` (a method), as Accelerate sets it where the forward has no
    `__func__` (a function), or prepared and then wrapped in DataParallel (on the CPU it calls
    the model as it is)."""
    accelerate = pytest.importorskip("accelerate")
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    model = _hf_causal_lm()
    if how == "function":
        from accelerate.utils import convert_outputs_to_fp32

        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        model.forward = convert_outputs_to_fp32(autocast(model.forward))
        return model, model
    model = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
    return (torch.nn.DataParallel(model), model) if how == "wrapped" else (model, model)


@pytest.mark.parametrize("how", ["method", "function", "wrapped"])
def test_accelerates_fp32_copy_of_the_outputs_is_left_out_where_this_loss_ran(how: str) -> None:
    """A model Accelerate prepared for bf16 copies its outputs to fp32 after each forward; under
    the head a forward whose loss it computed for a gradient returns them as computed (the bf16
    logits, the hidden states: the same values), the same loss and the same gradients; every
    other forward keeps the copy; on exit Accelerate's forward is back. (The hidden states
    here are fp32 already: autocast adds the bf16 blocks' outputs to the fp32 residual.)"""
    model, inner = _prepared(how)
    prepared = inner.__dict__["forward"]
    signature = inspect.signature(inner.forward)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(4))
    reference = model(input_ids=tokens, labels=tokens, output_hidden_states=True)
    (reference_grad,) = torch.autograd.grad(reference.loss, inner.lm_head.weight)
    assert reference.logits.dtype == torch.float32
    loss_head = head.LossHead(model)
    with loss_head:
        out = model(input_ids=tokens, labels=tokens, output_hidden_states=True)
        assert out.logits.dtype == torch.bfloat16 and torch.equal(out.logits.float(), reference.logits)
        for state, expected in zip(out.hidden_states, reference.hidden_states):
            assert torch.equal(state.float(), expected)
        assert torch.equal(out.loss, reference.loss)
        (grad,) = torch.autograd.grad(out.loss, inner.lm_head.weight)
        assert torch.equal(grad, reference_grad)
        with torch.no_grad():  # evaluation
            assert model(input_ids=tokens, labels=tokens).logits.dtype == torch.float32
        assert model(input_ids=tokens).logits.dtype == torch.float32  # a loop computing its own loss
        assert "fp32 copy of the outputs left out" in loss_head.describe()
        assert inspect.signature(inner.forward) == signature  # generate() reads it
    assert inner.__dict__["forward"] is prepared
    with head.LossHead(model, skip_fp32_copy=False) as kept:
        assert model(input_ids=tokens, labels=tokens).logits.dtype == torch.float32
        assert not kept.fp32_copy_skipped and "fp32 copy" not in kept.describe()
    with head.LossHead(model, enabled=False):
        assert model(input_ids=tokens, labels=tokens).logits.dtype == torch.float32


def test_a_copy_of_the_model_made_under_the_head_runs_its_own_weights() -> None:
    model, _ = _prepared("method")
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(4))
    with head.LossHead(model):
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin.lm_head.weight.zero_()
        assert not twin(input_ids=tokens, labels=tokens).logits.any()
        assert model(input_ids=tokens, labels=tokens).logits.any()


def test_a_forward_the_loop_sets_under_the_head_stays_after_it() -> None:
    model, _ = _prepared("method")
    with head.LossHead(model):
        mine = model.forward.__func__.__wrapped__.model_forward.__get__(model)
        model.forward = mine
    assert model.__dict__["forward"] is mine


def _hf_causal_lm() -> torch.nn.Module:
    from test_training import _hf_model

    torch.manual_seed(0)
    return _hf_model("qwen2")()


def test_the_block_plan_runs_a_hugging_face_causal_lm_loss_as_teraios_and_gives_it_back() -> None:
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    model = _hf_causal_lm()
    optimizer = torch.optim.AdamW(model.parameters())
    assert model.loss_function is loss_utils.ForCausalLMLoss
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(4))
    with teraio.offload(model, optimizer, gpu_memory="1GiB", whole_model="off") as run:
        assert model.loss_function is run.loss_head.loss
        assert model.loss_function.func is head.causal_lm_loss
        assert "_loss_function" not in model.model.__dict__  # the base model has no loss
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert model.loss_function is loss_utils.ForCausalLMLoss
    assert "_loss_function" not in model.__dict__
    assert "teraio.head" in run.report().loss_head

    # A loss the user set is theirs: left as it is, and so is the model's with loss_head="model".
    custom = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()  # noqa: E731
    model.loss_function = custom
    with teraio.offload(model, optimizer, gpu_memory="1GiB", whole_model="off") as run:
        assert model.loss_function is custom
    assert model.loss_function is custom and "model's own" in run.report().loss_head
    del model.__dict__["_loss_function"]
    with teraio.offload(model, optimizer, gpu_memory="1GiB", whole_model="off", loss_head="model") as run:
        assert model.loss_function is loss_utils.ForCausalLMLoss
    assert "loss_head='model'" in run.report().loss_head
    with pytest.raises(ValueError, match="loss_head must be one of"):
        teraio.offload(model, optimizer, gpu_memory="1GiB", loss_head="fused")


def test_whole_model_mode_runs_the_chunked_loss_too_and_gives_it_back() -> None:
    """Whole-model mode's largest tensor at a large batch is the loss head's fp32 logits: it runs
    the chunked loss as the block plan does, and the same loss as the model's own."""
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(4))
    losses = {}
    for loss_head in ("chunked", "model"):
        model = _hf_causal_lm()
        optimizer = torch.optim.AdamW(model.parameters())
        options = dict(gpu_memory="1GiB", whole_model="on", loss_head=loss_head)
        with teraio.offload(model, optimizer, **options) as run:
            expected = run.loss_head.loss if loss_head == "chunked" else loss_utils.ForCausalLMLoss
            assert model.loss_function is expected
            losses[loss_head] = []
            for _ in range(2):
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[loss_head].append(loss.item())
        assert model.loss_function is loss_utils.ForCausalLMLoss
        described = run.report().loss_head
        assert ("teraio.head" in described) == (loss_head == "chunked"), described
        assert "loss head" in str(run.report())
    assert losses["chunked"] == losses["model"]
