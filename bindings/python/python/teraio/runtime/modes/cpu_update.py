"""The optimizer step on the CPU, for whole-model mode's `update="cpu"`.

The fp32 master of each parameter is its host-tier buffer (pinned host memory, where the forward
pass reads it from), its gradient is the host-tier buffer backward wrote it to, and its optimizer
state is CPU memory. A second instance of the user's optimizer class steps CPU "shadow"
parameters that view those buffers, so the arithmetic is torch's own (fused on the CPU where the
build has it). The user's optimizer keeps its `param_groups`, whose hyperparameters (`lr` after a
scheduler, `weight_decay`, ...) are copied to the CPU optimizer at each `optimizer.step()`, and its
`state` holds, for each parameter, the very dict the CPU optimizer updates: `state_dict()` gives
the current state, as CPU tensors, while the model is offloaded.

For torch's Adam and AdamW the step is the engine's kernel (`teraio.cpu_adamw`), whose
bits are those of torch's fused CPU kernel (`kernel_refusal` says where it is not used): one pass
per element on its own threads, with the GIL released, that reads a bf16 gradient as it came off
the GPU and writes the bf16 compute copy beside the master (`whole_model`'s `compute_copies`).
Other optimizers run torch's own CPU step, with the bf16 gradients widened into the fp32 gradient
buffers before `CpuUpdate.step` and the copies rounded from the masters after it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.optim.adam import adam
from torch.optim.adamw import adamw

from ...cpu_adamw import AdamHyper, AdamTensor, CpuAdamW

#: Group keys that choose the CPU optimizer's implementation, not its arithmetic: not copied
#: from the user's groups.
IMPLEMENTATION_KEYS = ("params", "fused", "foreach", "capturable", "differentiable")


def _arithmetic(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's keys that set the step's arithmetic (not `IMPLEMENTATION_KEYS`)."""
    return {key: value for key, value in group.items() if key not in IMPLEMENTATION_KEYS}


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's hyperparameters as plain values (a tensor's as a list), for comparing two
    points of the loop: what a scheduler changes, not which implementation steps."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, (tuple, list)):
            return tuple(plain(v) for v in value)
        return value

    return [{key: plain(v) for key, v in _arithmetic(group).items()} for group in optimizer.param_groups]


def refusal(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Optional[str]:
    """Why the CPU step cannot run this optimizer over these parameters (None: it can)."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim"):
        return (
            f"the optimizer is a {cls.__name__}, not one of torch.optim's, whose CPU "
            "implementation the step runs"
        )
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return "the optimizer is differentiable=True"
    for param in params:
        if not param.is_contiguous() or param.storage_offset() != 0:
            return "a parameter is a view into a larger storage (it needs its own contiguous tensor)"
        if param.untyped_storage().nbytes() != param.numel() * param.element_size():
            return "a parameter's storage holds more than the parameter"
        if param.is_complex():
            return "a parameter is complex"
    return None


def kernel_refusal(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why the CPU step runs torch's optimizer rather than the engine's Adam/AdamW kernel (None:
    the kernel runs it, bit for bit as torch's fused CPU kernel would)."""
    cls = type(optimizer)
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        return f"the optimizer is a {cls.__name__}; the kernel is Adam's and AdamW's"
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        return "amsgrad=True"
    dtypes = {p.dtype for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    if dtypes - {torch.float32}:
        return (
            f"a trained parameter is {sorted(map(str, dtypes - {torch.float32}))[0]}; the kernel steps fp32"
        )
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(("AVX2", "AVX512")):
        return (
            f"torch's CPU kernels here are {capability}, without the fused multiply-adds whose "
            "rounding the kernel's reproduces"
        )
    return None


def adam_hyper(group: dict[str, Any], decoupled: bool) -> AdamHyper:
    """An Adam/AdamW parameter group's hyperparameters as the kernel takes them (`decoupled`:
    the optimizer is an AdamW, whose group may also say so itself)."""
    beta1, beta2 = group["betas"]
    return AdamHyper(
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        decoupled=bool(group.get("decoupled_weight_decay", decoupled)),
        maximize=bool(group["maximize"]),
    )


def _view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`buffer` (flat bytes) as a tensor of `like`'s dtype and shape."""
    return buffer.view(like.dtype).view(like.shape)


class CpuUpdate:
    """A CPU copy of the user's optimizer over the host-tier buffers (see the module docstring).
    `masters` and `grads`: each trained parameter's host buffers (flat bytes), by `id`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: dict[int, torch.Tensor],
        grads: dict[int, torch.Tensor],
    ) -> None:
        self.optimizer = optimizer
        self.shadow: dict[int, torch.nn.Parameter] = {}
        self.grad: dict[int, torch.Tensor] = {}
        groups = []
        for group in optimizer.param_groups:
            shadows = []
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                shadow = torch.nn.Parameter(_view(masters[id(param)], param))
                self.shadow[id(param)] = shadow
                self.grad[id(param)] = _view(grads[id(param)], param)
                shadows.append(shadow)
            groups.append(_arithmetic(group) | {"params": shadows})
        self.fused = "fused" in optimizer.defaults
        cls = type(optimizer)
        try:
            self.cpu = cls(groups, **({"fused": True} if self.fused else {}))
        except (RuntimeError, TypeError, ValueError):
            # No fused CPU kernel in this build: the single-tensor loop.
            self.fused = False
            self.cpu = cls(groups, **({"foreach": False} if "foreach" in optimizer.defaults else {}))
        # The user's state dicts become the CPU optimizer's (state the user's optimizer already
        # had is copied to the CPU once).
        for group in optimizer.param_groups:
            for param in group["params"]:
                shadow = self.shadow.get(id(param))
                if shadow is None:
                    continue
                held = optimizer.state.get(param, {})
                moved = self.cpu.state[shadow]
                for name, value in held.items():
                    moved[name] = (
                        value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
                    )
                optimizer.state[param] = moved
        self.sync_hyperparameters()
        #: The group index of each parameter's shadow (by the user's parameter's id).
        self._group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        self.kernel_refusal = kernel_refusal(optimizer)
        self.kernel: Optional[CpuAdamW] = (
            CpuAdamW(torch.get_num_threads()) if self.kernel_refusal is None else None
        )

    def sync_hyperparameters(self) -> None:
        """The user's groups' hyperparameters (as a scheduler left them) into the CPU optimizer:
        at `optimizer.step()`, before the step runs."""
        for mine, theirs in zip(self.cpu.param_groups, self.optimizer.param_groups):
            mine.update(_arithmetic(theirs))

    def step(
        self,
        params: list[torch.Tensor],
        clip: Optional[tuple[torch.Tensor, set[int]]] = None,
        low_grads: Optional[dict[int, torch.Tensor]] = None,
        copies: Optional[dict[int, torch.Tensor]] = None,
    ) -> None:
        """Updates `params` (the user's parameters; their gradients are in the host buffers),
        scaling first the gradients of those in `clip`'s set (ids) by its coefficient, as torch's
        `clip_grad_norm_` would have scaled them in place. With the kernel (`self.kernel`),
        `low_grads` (flat bytes by id) are bf16 gradients read in place of the fp32 buffers, and
        `copies` (flat bytes by id) receive the updated parameters rounded to bf16; without it
        both must be empty (the caller widens and rounds)."""
        if self.kernel is not None:
            self._kernel_step(params, clip, low_grads or {}, copies or {})
            return
        assert not low_grads and not copies
        shadows = []
        for param in params:
            shadow = self.shadow[id(param)]
            grad = self.grad[id(param)]
            if clip is not None and id(param) in clip[1]:
                grad.mul_(clip[0])
            shadow.grad = grad
            shadows.append(shadow)
        try:
            self.cpu.step()
        finally:
            for shadow in shadows:
                shadow.grad = None

    def _kernel_step(
        self,
        params: list[torch.Tensor],
        clip: Optional[tuple[torch.Tensor, set[int]]],
        low_grads: dict[int, torch.Tensor],
        copies: dict[int, torch.Tensor],
    ) -> None:
        """The engine's kernel over `params`, one call per parameter group and clip scale, with
        the state torch's fused Adam keeps (created as it creates it). Each call takes `step`
        advanced by one, as torch's kernel does; the tensors are advanced once every call ran."""
        assert self.kernel is not None
        scale = None if clip is None else float(clip[0])
        calls: dict[tuple[int, bool], list[AdamTensor]] = {}
        steps = []
        for param in params:
            shadow = self.shadow[id(param)]
            state = self.state_of(param)
            low = low_grads.get(id(param))
            copy = copies.get(id(param))
            clipped = clip is not None and id(param) in clip[1]
            calls.setdefault((self._group_of[id(param)], clipped), []).append(
                AdamTensor(
                    param=shadow.detach(),
                    grad=self.grad[id(param)] if low is None else low.view(torch.bfloat16),
                    exp_avg=state["exp_avg"],
                    exp_avg_sq=state["exp_avg_sq"],
                    step=float(state["step"]) + 1,  # as torch advances it before its kernel
                    copy=None if copy is None else copy.view(torch.bfloat16),
                )
            )
            steps.append(state["step"])
        for (index, clipped), tensors in calls.items():
            self.kernel.step(self._hyper(index), tensors, scale if clipped else None)
        for step in steps:  # once the kernel took every tensor (it refuses bad ones before writing)
            step.add_(1)

    def state_of(
        self, param: torch.Tensor, zeros: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None
    ) -> dict[str, Any]:
        """The parameter's Adam state (the user's optimizer's dict), created as torch's fused
        Adam creates it where the parameter has none yet: its moments by `zeros(name, like)`
        where given (zeroed memory of the caller's, shaped as `like`)."""
        shadow = self.shadow[id(param)]
        state = self.cpu.state[shadow]
        if not state:
            made = {  # all made before the dict changes: a failing `zeros` leaves it empty
                name: torch.zeros_like(shadow, memory_format=torch.preserve_format)
                if zeros is None
                else zeros(name, shadow)
                for name in ("exp_avg", "exp_avg_sq")
            }
            state.update(step=torch.zeros((), dtype=torch.float32), **made)
        return state

    def _hyper(self, index: int) -> AdamHyper:
        """Group `index`'s hyperparameters as the kernel takes them."""
        return adam_hyper(self.cpu.param_groups[index], self.decoupled)

    def device_step(self, params: list[torch.Tensor], tensors: list[tuple[torch.Tensor, ...]]) -> None:
        """The same Adam/AdamW update of `params` (the user's parameters) on another device, for
        the share of the step the GPU takes (`whole_model`'s `gpu_step_share`): `tensors` holds
        each one's (master, gradient, exp_avg, exp_avg_sq) there, fp32, the gradient already
        scaled as a clip scales it; torch's fused kernel of that device updates them, with this
        step's hyperparameters, and each state's `step` (in CPU memory) advances as the CPU
        step's does. On a CPU device its bits are the kernel's (torch's fused CPU kernel); on
        CUDA they are torch's fused CUDA AdamW's."""
        assert self.kernel is not None, "the device step runs the optimizers the kernel runs"
        calls: dict[int, list[int]] = {}
        for position, param in enumerate(params):
            calls.setdefault(self._group_of[id(param)], []).append(position)
        for index, positions in calls.items():
            hyper = self._hyper(index)
            device = tensors[positions[0]][0].device
            # torch's fused kernel advances the steps it is given before it uses them.
            steps = [self.state_of(params[p])["step"].to(device, copy=True) for p in positions]
            update = adamw if hyper.decoupled else adam
            update(
                [tensors[p][0] for p in positions],
                [tensors[p][1] for p in positions],
                [tensors[p][2] for p in positions],
                [tensors[p][3] for p in positions],
                [],
                steps,
                fused=True,
                amsgrad=False,
                beta1=hyper.beta1,
                beta2=hyper.beta2,
                lr=hyper.lr,
                weight_decay=hyper.weight_decay,
                eps=hyper.eps,
                maximize=hyper.maximize,
            )
        for param in params:
            self.state_of(param)["step"].add_(1)

    def state_bytes(self) -> int:
        return sum(
            int(v.untyped_storage().nbytes())
            for state in self.cpu.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )

    def give_back(self, device: Optional[torch.device]) -> None:
        """Ends the CPU step: each parameter's state becomes its own again, moved to `device`
        (None: left in CPU memory), with `step` where the user's optimizer expects it (on the
        device for a fused or capturable group)."""
        for group in self.optimizer.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for param in group["params"]:
                if id(param) not in self.shadow:
                    continue
                state = self.optimizer.state.get(param)
                if not state:
                    continue
                moved: dict[str, Any] = {}
                for name, value in state.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and device is not None
                        and (value.dim() > 0 or on_device)
                    ):
                        value = value.to(device)
                    moved[name] = value
                self.optimizer.state[param] = moved
        self.cpu.state.clear()
