"""The engine's CPU Adam/AdamW kernel (`teraio.cpu_adamw`, the whole-model CPU step's):
bit for bit torch's fused CPU kernel over sizes that end on and off its vectors, for Adam's and
AdamW's decay, maximize, both forms of the first moment's lerp, a clip's scale, bf16 gradients
and the bf16 copies it writes; and its refusals of bad buffers."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from teraio import _native
from teraio.cpu_adamw import AdamHyper, AdamTensor, CpuAdamW
from teraio.runtime.modes import cpu_update

pytestmark = pytest.mark.skipif(
    cpu_update.kernel_refusal(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])) is not None,
    reason="torch's CPU kernels here round without fused multiply-adds",
)

SIZES = [1, 7, 8, 9, 15, 16, 17, 31, 100, 1000, 4097, 65536 + 13, 300_001]


def _kernel_step(
    kernel: CpuAdamW,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    group: dict,
    decoupled: bool,
    scale: Optional[float] = None,
    copy: Optional[torch.Tensor] = None,
) -> None:
    state["step"].add_(1)
    beta1, beta2 = group["betas"]
    hyper = AdamHyper(
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        decoupled=decoupled,
        maximize=group["maximize"],
    )
    tensor = AdamTensor(param, grad, state["exp_avg"], state["exp_avg_sq"], float(state["step"]), copy)
    kernel.step(hyper, [tensor], scale)


@pytest.mark.parametrize(
    "cls,options",
    [
        (torch.optim.AdamW, {"weight_decay": 0.1}),
        (torch.optim.Adam, {"weight_decay": 0.1}),
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {"maximize": True, "betas": (0.3, 0.99)}),
    ],
    ids=["adamw", "adam-l2", "adam", "adamw-maximize-small-beta1"],
)
@pytest.mark.parametrize("low", [False, True], ids=["fp32-grad", "bf16-grad"])
@pytest.mark.parametrize("clip", [None, 0.37])
def test_bitwise_torchs_fused_cpu_kernel(cls: type, options: dict, low: bool, clip: Optional[float]) -> None:
    kernel = CpuAdamW(2)
    generator = torch.Generator().manual_seed(0)
    for size in SIZES:
        reference = torch.nn.Parameter(torch.randn(size, generator=generator))
        optimizer = cls([reference], lr=1e-2, fused=True, **options)
        group = optimizer.param_groups[0]
        param = reference.detach().clone()
        state = {
            "step": torch.zeros((), dtype=torch.float32),
            "exp_avg": torch.zeros(size),
            "exp_avg_sq": torch.zeros(size),
        }
        copy = torch.empty(size, dtype=torch.bfloat16)
        for _ in range(3):
            grad = torch.randn(size, generator=generator) * 0.1
            if low:
                grad = grad.bfloat16()
            scaled = grad.to(torch.float32, copy=True)
            if clip is not None:
                scaled.mul_(torch.tensor(clip, dtype=torch.float32))  # as clip_grad_norm_ scales
            reference.grad = scaled
            optimizer.step()
            clip_scale = None if clip is None else float(torch.tensor(clip, dtype=torch.float32))
            _kernel_step(kernel, param, grad, state, group, cls is torch.optim.AdamW, clip_scale, copy)
            torch_state = optimizer.state[reference]
            assert torch.equal(param, reference.detach()), size
            assert torch.equal(state["exp_avg"], torch_state["exp_avg"]), size
            assert torch.equal(state["exp_avg_sq"], torch_state["exp_avg_sq"]), size
            assert torch.equal(state["step"], torch_state["step"])
            assert torch.equal(copy, reference.detach().bfloat16()), size  # autocast's cast


def test_threads_do_not_change_the_bits() -> None:
    size = 3 * (1 << 16) + 5  # several of the kernel's tasks
    results = []
    for threads in (1, 3):
        kernel = CpuAdamW(threads)
        assert kernel.threads == threads
        torch.manual_seed(1)
        param, grad = torch.randn(size), torch.randn(size)
        state = {"step": torch.zeros(()), "exp_avg": torch.zeros(size), "exp_avg_sq": torch.zeros(size)}
        group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "maximize": False}
        _kernel_step(kernel, param, grad, state, group, True)
        results.append((param, state["exp_avg"], state["exp_avg_sq"]))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _addresses(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, n: int) -> tuple:
    return (param.data_ptr(), grad.data_ptr(), False, m.data_ptr(), v.data_ptr(), None, n, 1.0)


HYPER = {
    "lr": 1e-3,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "decoupled": True,
    "maximize": False,
}


def test_bad_tensors_are_refused_by_the_face() -> None:
    kernel = CpuAdamW(1)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    param, m, v = (torch.ones(8) for _ in range(3))
    for grad, match in [
        (torch.ones(8, dtype=torch.float16), "grad is torch.float16"),
        (torch.ones(7), "grad has 7 elements"),
        (torch.ones(16)[::2], "grad is not contiguous"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel.step(hyper, [AdamTensor(param, grad, m, v, 1.0)])
    with pytest.raises(ValueError, match="copy is torch.float32"):
        kernel.step(hyper, [AdamTensor(param, torch.ones(8), m, v, 1.0, copy=torch.ones(8))])
    assert torch.equal(param, torch.ones(8))


def test_bad_buffers_are_refused_by_the_binding_and_nothing_is_written() -> None:
    kernel = _native.CpuAdamW(1)
    param, grad, m, v = (torch.ones(8) for _ in range(4))
    before = param.clone()
    with pytest.raises(ValueError, match="overlaps"):
        kernel.step(**HYPER, tensors=[_addresses(param, grad, param, v, 8)])
    with pytest.raises(ValueError, match="overlaps"):  # a gradient read where it is written
        kernel.step(**HYPER, tensors=[_addresses(param, m, m, v, 8)])
    with pytest.raises(ValueError, match="not aligned"):
        kernel.step(
            **HYPER,
            tensors=[
                (param.data_ptr() + 2, grad.data_ptr(), False, m.data_ptr(), v.data_ptr(), None, 4, 1.0)
            ],
        )
    with pytest.raises(ValueError, match="null"):
        kernel.step(**HYPER, tensors=[(0, grad.data_ptr(), False, m.data_ptr(), v.data_ptr(), None, 8, 1.0)])
    with pytest.raises(ValueError, match="positive count"):
        kernel.step(**HYPER, tensors=[(*_addresses(param, grad, m, v, 8)[:7], 0.0)])
    with pytest.raises(ValueError, match="vector width"):
        kernel.step(**HYPER, tensors=[_addresses(param, grad, m, v, 8)], vector_width=3)
    with pytest.raises(ValueError, match="overflow"):
        kernel.step(**HYPER, tensors=[_addresses(param, grad, m, v, 1 << 62)])
    # A written buffer inside a read range that an earlier, longer read range hides from its
    # neighbour: the gradients of two tensors read overlapping memory (allowed), the second
    # tensor's first moment lies inside the first gradient.
    big = torch.ones(64)
    second = (torch.ones(8), big[8:16], big[24:32], torch.ones(8))
    with pytest.raises(ValueError, match="overlaps"):
        kernel.step(
            **HYPER,
            tensors=[
                _addresses(torch.ones(64), big, torch.ones(64), torch.ones(64), 64),
                _addresses(*second, 8),
            ],
        )
    # A tensor of no elements is stepped as torch steps it: nothing to do (its address is null).
    empty = torch.empty(0)
    assert empty.data_ptr() == 0
    kernel.step(**HYPER, tensors=[(0, 0, False, 0, 0, None, 0, 1.0), _addresses(param, grad, m, v, 8)])
    assert not torch.equal(param, before)
    before = param.clone()
    with pytest.raises(ValueError, match="null"):
        kernel.step(**HYPER, tensors=[(0, grad.data_ptr(), False, m.data_ptr(), v.data_ptr(), None, 8, 1.0)])
    assert torch.equal(param, before)


def test_the_refusals_name_what_runs_torchs_step() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert cpu_update.kernel_refusal(torch.optim.AdamW(params)) is None
    assert cpu_update.kernel_refusal(torch.optim.Adam(params)) is None
    assert "SGD" in (cpu_update.kernel_refusal(torch.optim.SGD(params, lr=0.1)) or "")
    assert cpu_update.kernel_refusal(torch.optim.AdamW(params, amsgrad=True)) == "amsgrad=True"
    bf16 = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    assert "torch.bfloat16" in (cpu_update.kernel_refusal(torch.optim.AdamW(bf16)) or "")

    class MyAdamW(torch.optim.AdamW):
        pass

    assert "MyAdamW" in (cpu_update.kernel_refusal(MyAdamW(params)) or "")
