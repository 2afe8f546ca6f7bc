"""The loss head: a causal LM's cross-entropy without its full-size fp32 temporaries.

With a 128K-152K vocabulary the loss head allocates the iteration's largest tensors. Hugging
Face's causal-LM loss (`ForCausalLMLoss`) upcasts the logits to fp32 (4.6 GiB for Qwen2's 151936
at 4 x 2048 tokens), `cross_entropy` saves their fp32 log-softmax, and its backward holds three
fp32 tensors of that size at once (the log-softmax, nll_loss's gradient and log_softmax's) next to
the logits' gradient. For a 1.5B model with such a vocabulary that is a large share of the
iteration's peak when every block is checkpointed.

`teraio.offload` replaces a Hugging Face model's `ForCausalLMLoss` with `causal_lm_loss` (the
same label shift and reduction) for as long as it runs (`LossHead`). That loss runs the kernels
`cross_entropy` runs, one chunk of rows at a time (`CHUNK_BYTES` of fp32 logits each):

- forward: each chunk is upcast, its log-softmax taken and the target entries picked; the chunk's
  log-softmax is then freed. The loss is `nll_loss` over the picked entries, the same reduction
  over the same values. What backward keeps is the logits (the model's output, alive anyway)
  and one fp32 value per row;
- backward: each chunk's log-softmax is computed again (the same kernel on the same rows: the
  same bits), and its gradient is nll_loss's and log_softmax's own backward over that chunk,
  written into the logits' gradient in their dtype (as the upcast's backward casts it).

So the head's peak falls from the logits plus three fp32 copies to the logits, their gradient
and one chunk's temporaries: nothing of the vocabulary's size in fp32 outlives a chunk (at
8 x 2048 tokens of a 128K vocabulary, the kept log-softmax alone would be 7.8 GiB). The cost is
a second log-softmax per chunk, a pass over memory. Every kernel computes a row from that row
alone, so the loss and the gradients are the same bits as the model's own loss
(tests/test_head.py checks it). Pass `loss_head="model"` to `teraio.offload` to keep the model's
own loss.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from torch.autograd.function import once_differentiable

#: fp32 logits per chunk: the size of each kept log-softmax chunk and of each temporary.
CHUNK_BYTES = 256 << 20

_REDUCTIONS = {"mean": 1, "sum": 2}


def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Rows per chunk: `chunk_bytes` of fp32 logits, at least one row."""
    return max(1, chunk_bytes // (vocab * 4))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """`cross_entropy(logits.float(), target, ignore_index=..., reduction=...)` over 2-D logits,
    one chunk of rows at a time (the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, rows: int
    ) -> torch.Tensor:
        with torch.autocast(logits.device.type, enabled=False):
            ignored = target == ignore_index
            # Ignored rows pick entry 0 (any valid index): nll_loss leaves them out.
            picks = target.masked_fill(ignored, 0).unsqueeze(1)
            picked = torch.empty((logits.shape[0], 1), dtype=torch.float32, device=logits.device)
            for start in range(0, logits.shape[0], rows):
                log_softmax = torch.log_softmax(logits[start : start + rows].float(), dim=1)
                picked[start : start + rows] = log_softmax.gather(1, picks[start : start + rows])
                del log_softmax
            # nll_loss over the picked column: every row's target is its column 0.
            column_target = target.masked_fill(~ignored, 0)
            loss, total_weight = torch.ops.aten.nll_loss_forward(
                picked, column_target, None, _REDUCTIONS[reduction], ignore_index
            )
        # The logits, not their log-softmax: backward computes each chunk's again (the same
        # kernel on the same rows: the same bits), so nothing of the vocabulary's size in fp32
        # outlives a chunk. The logits are the model's output, alive anyway.
        ctx.save_for_backward(logits, picks, picked, column_target, total_weight)
        ctx.rows = rows
        ctx.reduction = _REDUCTIONS[reduction]
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        logits, picks, picked, column_target, total_weight = ctx.saved_tensors
        rows = ctx.rows
        with torch.autocast(logits.device.type, enabled=False):
            column_grad = torch.ops.aten.nll_loss_backward(
                grad, picked, column_target, None, ctx.reduction, ctx.ignore_index, total_weight
            )
            logits_grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            for start in range(0, logits.shape[0], rows):
                log_softmax = torch.log_softmax(logits[start : start + rows].float(), dim=1)
                nll_grad = torch.zeros_like(log_softmax)
                nll_grad.scatter_(1, picks[start : start + rows], column_grad[start : start + rows])
                logits_grad[start : start + rows] = torch._log_softmax_backward_data(
                    nll_grad, log_softmax, 1, torch.float32
                )
                del log_softmax, nll_grad
        return logits_grad, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_bytes: Optional[int] = None,
) -> torch.Tensor:
    """`torch.nn.functional.cross_entropy(logits.float(), target, ...)` for 2-D `logits` (rows,
    vocabulary) and 1-D class indices, computed in chunks of rows (module docstring); the
    gradient comes back in `logits`' dtype. `chunk_bytes`: None for `CHUNK_BYTES`."""
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(
            f"teraio.head.cross_entropy: logits (rows, vocabulary) and target (rows,), not "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"teraio.head.cross_entropy: reduction 'mean' or 'sum', not {reduction!r}")
    rows = chunk_rows(logits.shape[1], CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    return _ChunkedCrossEntropy.apply(logits, target, ignore_index, reduction, rows)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    shift_labels: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Hugging Face's `ForCausalLMLoss` (transformers.loss.loss_utils: labels shifted left by
    one, mean over the labelled tokens, or the sum over `num_items_in_batch`) with
    `cross_entropy` above for its `logits.float()` and `nn.functional.cross_entropy`."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = cross_entropy(
        logits.view(-1, vocab_size),
        shift_labels.view(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


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
    whose loss is `ForCausalLMLoss` compute it with `causal_lm_loss` (through transformers' own
    `loss_function` setter); on exit each gets back what it had. `replaced` names them (empty:
    disabled, or the model's loss is not one this knows). transformers is never imported here:
    a model built with it has loaded it."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True) -> None:
        self.model = model
        self.enabled = enabled
        self.replaced: list[str] = []
        self._restore: list[tuple[torch.nn.Module, Any]] = []

    def __enter__(self) -> LossHead:
        loss_utils = sys.modules.get("transformers.loss.loss_utils")
        if not self.enabled or loss_utils is None:
            return self
        hf_loss, mapping = loss_utils.ForCausalLMLoss, loss_utils.LOSS_MAPPING
        for name, module in self.model.named_modules():
            if _loss_of(module, mapping) is not hf_loss:
                continue
            self._restore.append((module, module.__dict__.get("_loss_function", _UNSET)))
            module.loss_function = causal_lm_loss  # type: ignore[union-attr]
            self.replaced.append(name or type(module).__name__)
        return self

    def __exit__(self, *exc: object) -> None:
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
        return (
            f"cross-entropy in chunks of {CHUNK_BYTES >> 20} MiB of fp32 logits "
            f"(teraio.head, in {', '.join(self.replaced)})"
        )


_UNSET = object()
