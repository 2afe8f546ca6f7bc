"""The engine's CPU Adam/AdamW step over CPU tensors (`teraio_engine::adamw`): the typed face of
`teraio._native.CpuAdamW`, which whole-model mode's CPU step runs (`runtime/modes/cpu_update.py`).

One pass per element, on the kernel's own threads with the GIL released, reads the fp32 master,
the gradient (fp32, or bf16 as it came off the GPU), the two moments, and writes the master, the
moments and, where given, the bf16 copy the GPU computes with. Its bits are those torch's fused
CPU kernel gives on CPUs where torch runs its AVX2 or AVX-512 kernels (`TORCH_TAIL_WIDTH`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import _native

#: The trailing elements of each tensor (`numel % TORCH_TAIL_WIDTH`) that torch's fused CPU
#: kernel rounds in its scalar loop's order, with AVX2 and AVX-512 alike (measured against torch:
#: the AVX-512 build's scalar loop is vectorised 8 wide by its compiler).
TORCH_TAIL_WIDTH = 8


@dataclass(frozen=True)
class AdamHyper:
    """One parameter group's hyperparameters for one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    #: AdamW's decoupled decay; False: Adam's L2 term added to the gradient.
    decoupled: bool
    maximize: bool = False


@dataclass(frozen=True)
class AdamTensor:
    """One parameter's buffers: contiguous CPU tensors of the same number of elements."""

    param: torch.Tensor  # fp32, updated in place
    grad: torch.Tensor  # fp32 or bf16, read
    exp_avg: torch.Tensor  # fp32, updated in place
    exp_avg_sq: torch.Tensor  # fp32, updated in place
    #: The step count, already advanced for this step (as torch advances it before its kernel).
    step: float
    copy: Optional[torch.Tensor] = None  # bf16: receives the updated parameter, rounded


def _checked(t: AdamTensor, index: int) -> tuple[int, int, bool, int, int, Optional[int], int, float]:
    numel = t.param.numel()
    named = [("param", t.param, (torch.float32,)), ("grad", t.grad, (torch.float32, torch.bfloat16))]
    named += [("exp_avg", t.exp_avg, (torch.float32,)), ("exp_avg_sq", t.exp_avg_sq, (torch.float32,))]
    if t.copy is not None:
        named.append(("copy", t.copy, (torch.bfloat16,)))
    for name, tensor, dtypes in named:
        problem = (
            f"is on {tensor.device}"
            if tensor.device.type != "cpu"
            else f"is {tensor.dtype}, not {' or '.join(map(str, dtypes))}"
            if tensor.dtype not in dtypes
            else "is not contiguous"
            if not tensor.is_contiguous()
            else f"has {tensor.numel()} elements, the parameter {numel}"
            if tensor.numel() != numel
            else None
        )
        if problem is not None:
            raise ValueError(f"CpuAdamW.step: tensor {index}'s {name} {problem}")
    return (
        t.param.data_ptr(),
        t.grad.data_ptr(),
        t.grad.dtype == torch.bfloat16,
        t.exp_avg.data_ptr(),
        t.exp_avg_sq.data_ptr(),
        None if t.copy is None else t.copy.data_ptr(),
        numel,
        float(t.step),
    )


class CpuAdamW:
    """The kernel on `threads` threads of its own (at least one)."""

    def __init__(self, threads: int) -> None:
        self._kernel = _native.CpuAdamW(threads)

    @property
    def threads(self) -> int:
        return self._kernel.threads

    def step(
        self, hyper: AdamHyper, tensors: Sequence[AdamTensor], grad_scale: Optional[float] = None
    ) -> None:
        """Steps `tensors` with `hyper`, their gradients first multiplied by `grad_scale` where
        given (a clip's coefficient, as `clip_grad_norm_` scales gradients in place; the gradient
        tensors are not written). Bad buffers raise `ValueError` before anything is written."""
        addresses = [_checked(t, i) for i, t in enumerate(tensors)]
        self._kernel.step(
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
            decoupled=hyper.decoupled,
            maximize=hyper.maximize,
            tensors=addresses,
            grad_scale=grad_scale,
            vector_width=TORCH_TAIL_WIDTH,
        )
