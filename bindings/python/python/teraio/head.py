"""The loss head: a causal LM's cross-entropy without its full-size fp32 temporaries.

With a 128K-152K vocabulary the loss head allocates the iteration's largest tensors. Hugging
Face's causal-LM loss (`ForCausalLMLoss`) upcasts the logits to fp32 (4.6 GiB for Qwen2's 151936
at 4 x 2048 tokens), `cross_entropy` saves their fp32 log-softmax, and its backward holds three
fp32 tensors of that size at once (the log-softmax, nll_loss's gradient and log_softmax's) next to
the logits' gradient. For a 1.5B model with such a vocabulary that is a large share of the
iteration's peak when every block is checkpointed.

`teraio.offload` replaces a Hugging Face model's `ForCausalLMLoss` with `causal_lm_loss` (the
same label shift, reduction and division by `num_items_in_batch`) for as long as it runs
(`LossHead`). That loss runs the kernels `cross_entropy` and its backward run, one chunk of rows
at a time (`CHUNK_BYTES` of fp32 logits each): each chunk is upcast, its log-softmax taken, the
target entries picked, and the chunk's log-softmax freed. The loss is `nll_loss` over the picked
entries, the same reduction over the same values.

The logits' gradient is computed in the same pass, for the gradient `loss.backward()` gives the
loss (exactly 1): nll_loss's and log_softmax's own backward over each chunk, written in the
logits' dtype (as the upcast's backward casts it). Backward reads the loss's gradient on the host
(one synchronization, when the gradient came from forward):

- exactly 1: it hands on the gradient forward computed. Nothing is computed twice;
- anything else (`(loss / 4).backward()`, a weighted sum of losses): it computes each chunk's
  log-softmax again and the gradient for the value given, and `HeadState` stops computing it in
  forward for the rest of the session, since the loop scales its loss.

So the head's peak falls from the logits plus three fp32 copies to the logits, their gradient
and one chunk's temporaries: nothing of the vocabulary's size in fp32 outlives a chunk (at
8 x 2048 tokens of a 128K vocabulary, a kept log-softmax alone would be 7.8 GiB). Every kernel
computes a row from that row alone, and the gradient is computed for the exact value it is
scaled by, so the loss and the gradients are the same bits as the model's own loss
(tests/test_head.py checks it). Pass `loss_head="model"` to `teraio.offload` to keep the model's
own loss.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, Optional, Union

import torch
from torch.autograd.function import once_differentiable

#: fp32 logits per chunk: the size of each log-softmax chunk and of each temporary.
CHUNK_BYTES = 256 << 20

_REDUCTIONS = {"mean": 1, "sum": 2}

Divisor = Union[torch.Tensor, int, float, None]


class HeadState:
    """What one session's loss has learnt of its loop: whether forward computes the logits'
    gradient (`gradient_in_forward`, until a backward brings a gradient other than 1), and how
    many losses it computed for a gradient (`losses`)."""

    def __init__(self) -> None:
        self.gradient_in_forward = True
        self.losses = 0


def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Rows per chunk: `chunk_bytes` of fp32 logits, at least one row."""
    return max(1, chunk_bytes // (vocab * 4))


def _column_grad(
    grad: torch.Tensor,
    divisor: Divisor,
    picked: torch.Tensor,
    column_target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    """nll_loss's gradient at each row's target entry, for `grad` on the loss. With a divisor,
    first the division's own backward, then what autograd does with a gradient whose shape or
    dtype is not its input's (a per-replica (n, 1) count, a float64 one): summed to the
    shape, cast to the dtype."""
    if divisor is not None:
        grad = (grad / divisor).sum_to_size(()).to(torch.float32)
    return torch.ops.aten.nll_loss_backward(
        grad, picked, column_target, None, reduction, ignore_index, total_weight
    )


def _run_chunks(
    logits: torch.Tensor,
    rows: int,
    picks: torch.Tensor,
    picked: Optional[torch.Tensor] = None,
    column_grad: Optional[torch.Tensor] = None,
    gradient: Optional[torch.Tensor] = None,
) -> None:
    """One pass over the logits, `rows` at a time: each chunk's fp32 log-softmax, its target
    entries into `picked` and (with `column_grad`) nll_loss's and log_softmax's own backward
    over it into `gradient`, in `gradient`'s dtype (the upcast's backward casts so). Each chunk's
    temporaries are freed before the next."""
    for start in range(0, logits.shape[0], rows):
        chunk = slice(start, start + rows)
        log_softmax = torch.log_softmax(logits[chunk].float(), dim=1)
        if picked is not None:
            picked[chunk] = log_softmax.gather(1, picks[chunk])
        if gradient is not None:
            assert column_grad is not None
            nll_grad = torch.zeros_like(log_softmax)
            nll_grad.scatter_(1, picks[chunk], column_grad[chunk])
            gradient[chunk] = torch._log_softmax_backward_data(nll_grad, log_softmax, 1, torch.float32)
            del nll_grad
        del log_softmax


class _ChunkedCrossEntropy(torch.autograd.Function):
    """`cross_entropy(logits.float(), target, ignore_index=..., reduction=...)` over 2-D logits,
    divided by `divisor` where one is given, one chunk of rows at a time (the module docstring).
    `state` None: the gradient is computed in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        reduction: str,
        rows: int,
        divisor: Divisor,
        state: Optional[HeadState],
        wanted: bool,
    ) -> torch.Tensor:
        code = _REDUCTIONS[reduction]
        if wanted and state is not None:
            state.losses += 1
        with torch.autocast(logits.device.type, enabled=False):
            ignored = target == ignore_index
            # Ignored rows pick entry 0 (any valid index): nll_loss leaves them out.
            picks = target.masked_fill(ignored, 0).unsqueeze(1)
            picked = torch.empty((logits.shape[0], 1), dtype=torch.float32, device=logits.device)
            # nll_loss over the picked column: every row's target is its column 0.
            column_target = target.masked_fill(~ignored, 0)
            gradient = column_grad = None
            if wanted and state is not None and state.gradient_in_forward:
                # nll_loss's total weight (the labelled rows) before any entry is picked: the
                # kernel counts it from the targets alone.
                zeros = torch.zeros_like(picked)
                _, counted = torch.ops.aten.nll_loss_forward(zeros, column_target, None, code, ignore_index)
                # `loss.backward()`'s gradient: ones in the loss's shape and dtype.
                one = torch.ones_like(zeros[0, 0] if divisor is None else zeros[0, 0] / divisor)
                column_grad = _column_grad(one, divisor, picked, column_target, code, ignore_index, counted)
                gradient = torch.empty_like(logits)
            _run_chunks(logits, rows, picks, picked, column_grad, gradient)
            loss, total_weight = torch.ops.aten.nll_loss_forward(
                picked, column_target, None, code, ignore_index
            )
            if divisor is not None:
                loss = loss / divisor
        # The logits, not their log-softmax: where backward must compute the gradient itself, it
        # computes each chunk's log-softmax again (the same kernel on the same rows: the same
        # bits). The logits are the model's output, alive anyway. The gradient computed here is
        # held apart from the saved tensors, so that backward lets it go as soon as it is used.
        ctx.save_for_backward(logits, picks, picked, column_target, total_weight)
        ctx.gradient = [] if gradient is None else [gradient]
        ctx.rows = rows
        ctx.reduction = code
        ctx.ignore_index = ignore_index
        ctx.divisor = divisor
        ctx.state = state
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        logits, picks, picked, column_target, total_weight = ctx.saved_tensors
        none = (None,) * 7
        if ctx.gradient:
            gradient = ctx.gradient.pop()
            if bool((grad == 1).all()):  # one host synchronization
                return (gradient, *none)
            # The loop scales its loss: the gradient for this value, and none in forward again.
            ctx.state.gradient_in_forward = False
            del gradient
        # Here too for a second backward through a retained graph: the first one handed on
        # forward's gradient.
        with torch.autocast(logits.device.type, enabled=False):
            column_grad = _column_grad(
                grad, ctx.divisor, picked, column_target, ctx.reduction, ctx.ignore_index, total_weight
            )
            logits_grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            _run_chunks(logits, ctx.rows, picks, column_grad=column_grad, gradient=logits_grad)
        return (logits_grad, *none)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_bytes: Optional[int] = None,
    divisor: Divisor = None,
    state: Optional[HeadState] = None,
) -> torch.Tensor:
    """`torch.nn.functional.cross_entropy(logits.float(), target, ...) / divisor` (no division
    where `divisor` is None) for 2-D `logits` (rows, vocabulary) and 1-D class indices, computed
    in chunks of rows (module docstring); the gradient comes back in `logits`' dtype.
    `chunk_bytes`: None for `CHUNK_BYTES`. `state`: a `HeadState` kept across calls, with which
    forward computes the gradient until a backward brings a gradient other than 1; None: the
    gradient is computed in backward (no synchronization)."""
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(
            f"teraio.head.cross_entropy: logits (rows, vocabulary) and target (rows,), not "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"teraio.head.cross_entropy: reduction 'mean' or 'sum', not {reduction!r}")
    rows = chunk_rows(logits.shape[1], CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    # Read here: inside the Function's forward grad mode is off, and `needs_input_grad` does not
    # say whether the caller's was.
    wanted = torch.is_grad_enabled() and logits.requires_grad
    return _ChunkedCrossEntropy.apply(logits, target, ignore_index, reduction, rows, divisor, state, wanted)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: Divisor = None,
    ignore_index: int = -100,
    shift_labels: Optional[torch.Tensor] = None,
    *,
    state: Optional[HeadState] = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Hugging Face's `ForCausalLMLoss` (transformers.loss.loss_utils: labels shifted left by
    one, mean over the labelled tokens, or the sum divided by `num_items_in_batch`) with
    `cross_entropy` above for its `logits.float()`, `nn.functional.cross_entropy` and the
    division. `state`: as for `cross_entropy` (`LossHead` passes its session's)."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    if num_items_in_batch is None:
        reduction, divisor = "mean", None
    else:
        reduction = "sum"
        divisor = num_items_in_batch
        if torch.is_tensor(divisor):
            divisor = divisor.to(logits.device)
    return cross_entropy(
        logits.view(-1, vocab_size),
        shift_labels.view(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction=reduction,
        divisor=divisor,
        state=state,
    )


#: Module wrappers (DDP and the like, each holding the model as `.module`) looked through for
#: Accelerate's mixed-precision forward.
MAX_WRAPPERS = 4


def _accelerate_forward(model: torch.nn.Module) -> Optional[tuple[torch.nn.Module, Any, Any]]:
    """Accelerate's mixed-precision forward, which `accelerator.prepare` (and so the Trainer)
    sets on the model before any DDP wrapper: the autocast forward inside `ConvertOutputsToFp32`,
    which copies every bf16/fp16 output to fp32. (the module that has it, its `forward` as set,
    the `ConvertOutputsToFp32`); None where there is none. accelerate is never imported here: a
    model it prepared has loaded it."""
    operations = sys.modules.get("accelerate.utils.operations")
    if operations is None:
        return None
    module = model
    for _ in range(MAX_WRAPPERS + 1):
        forward = module.__dict__.get("forward")
        converting = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
        if isinstance(converting, operations.ConvertOutputsToFp32):
            return module, forward, converting
        inner = getattr(module, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return None
        module = inner
    return None


def _loss_only_forward(
    converting: Any, to_fp32: Callable[[Any], Any], state: HeadState
) -> Callable[..., Any]:
    """Accelerate's forward (`converting`, a `ConvertOutputsToFp32`) without its fp32 copy of
    the outputs in a forward where `state`'s loss ran for a gradient. Installed as Accelerate
    installs its own (a method where it set a method), and `__wrapped__` as its own: the
    signature (`generate()` reads it), `copy.deepcopy` and `unwrap_model` see through it."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        losses = state.losses
        outputs = converting.model_forward(*args, **kwargs)
        return outputs if state.losses != losses else to_fp32(outputs)

    forward.__wrapped__ = converting  # type: ignore[attr-defined]
    return forward


def _loss_of(module: torch.nn.Module, mapping: dict[str, Any]) -> Optional[Callable[..., Any]]:
    """The loss a Hugging Face model's `loss_function` returns (`mapping`: transformers'
    `LOSS_MAPPING`), read as that property does but without its warning for models that have
    none (a base model's `loss_type` is None)."""
    if "_loss_function" in module.__dict__:
        return module.__dict__["_loss_function"]
    loss_type = module.__dict__.get("loss_type")
    return mapping.get(loss_type) if isinstance(loss_type, str) else None


class LossHead:
    """While entered (and `enabled`: `loss_head="chunked"`), the model's Hugging Face modules
    whose loss is `ForCausalLMLoss` compute it with `causal_lm_loss` and this session's
    `HeadState` (`loss`, set through transformers' own `loss_function` setter); on exit each gets
    back what it had. `replaced` names them (empty: disabled, or the model's loss is not one this
    knows). transformers is never imported here: a model built with it has loaded it.

    A model that Accelerate prepared for mixed precision copies its bf16 outputs to fp32 after
    every forward (`ConvertOutputsToFp32`): the logits at 4 x 2048 tokens of a 128K vocabulary
    are 4 GiB, made at the end of the forward pass where the iteration's memory peaks, and a loop
    that takes the loss drops them unread. With `skip_fp32_copy` (`fp32_outputs="loss_only"`),
    while entered, a forward in which this loss ran for a gradient returns its outputs as the
    model computed them:
    the loss in fp32, every other output (the logits, hidden states) in the model's dtype. Any
    other forward (evaluation under `no_grad`, a loop that computes its own loss from the
    logits) keeps Accelerate's copy; so does every forward without `skip_fp32_copy`
    (`fp32_outputs="all"`). `fp32_copy_skipped` says whether it applies."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True, skip_fp32_copy: bool = True) -> None:
        self.model = model
        self.enabled = enabled
        self.skip_fp32_copy = skip_fp32_copy
        self.replaced: list[str] = []
        self.state = HeadState()
        #: What the replaced modules compute their loss with.
        self.loss: Callable[..., torch.Tensor] = functools.partial(causal_lm_loss, state=self.state)
        self._restore: list[tuple[torch.nn.Module, Any]] = []
        #: Where the forward without the fp32 copy went: (module, what it had, what was set).
        self._forward: Optional[tuple[torch.nn.Module, Any, Any]] = None
        self.fp32_copy_skipped = False

    def __enter__(self) -> LossHead:
        loss_utils = sys.modules.get("transformers.loss.loss_utils")
        if not self.enabled or loss_utils is None:
            return self
        hf_loss, mapping = loss_utils.ForCausalLMLoss, loss_utils.LOSS_MAPPING
        for name, module in self.model.named_modules():
            if _loss_of(module, mapping) is not hf_loss:
                continue
            self._restore.append((module, module.__dict__.get("_loss_function", _UNSET)))
            module.loss_function = self.loss  # type: ignore[union-attr]
            self.replaced.append(name or type(module).__name__)
        if self.replaced and self.skip_fp32_copy:
            self._install_loss_only_forward()
        return self

    def _install_loss_only_forward(self) -> None:
        """Accelerate's fp32 copy of the outputs, left out of forwards whose loss this computed
        (the class docstring)."""
        found = _accelerate_forward(self.model)
        if found is None:
            return
        module, previous, converting = found
        operations = sys.modules["accelerate.utils.operations"]
        forward: Any = _loss_only_forward(converting, operations.convert_to_fp32, self.state)
        if isinstance(previous, types.MethodType):
            forward = types.MethodType(forward, module)
        module.__dict__["forward"] = forward
        self._forward = (module, previous, forward)
        self.fp32_copy_skipped = True

    def __exit__(self, *exc: object) -> None:
        if self._forward is not None:
            module, previous, installed = self._forward
            # Accelerate's forward back, unless the loop set another one meanwhile.
            if module.__dict__.get("forward") is installed:
                module.__dict__["forward"] = previous
            self._forward = None
        for module, previous in reversed(self._restore):
            if previous is _UNSET:
                module.__dict__.pop("_loss_function", None)
            else:
                module.__dict__["_loss_function"] = previous
        self._restore.clear()

    def describe(self) -> str:
        """For the report."""
        if not self.enabled:
            return "the model's own (loss_head='model')"
        if not self.replaced:
            return "the model's own (not a Hugging Face causal-LM loss)"
        where = (
            "the logits' gradient in forward"
            if self.state.gradient_in_forward
            else "the logits' gradient in backward (the loop scales its loss)"
        )
        skipped = (
            "; Accelerate's fp32 copy of the outputs left out of its training forwards"
            if self.fp32_copy_skipped
            else ""
        )
        return (
            f"cross-entropy in chunks of {CHUNK_BYTES >> 20} MiB of fp32 logits, {where} "
            f"(teraio.head, in {', '.join(self.replaced)}{skipped})"
        )


_UNSET = object()
