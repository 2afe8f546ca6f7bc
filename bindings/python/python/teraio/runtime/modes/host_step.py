"""The optimizer step of FSDP2's host shards, on the engine's Adam/AdamW kernel.

A model sharded with `fully_shard(..., offload_policy=CPUOffloadPolicy())` keeps each rank's fp32
parameter shards, their gradients and the optimizer state in host memory: FSDP copies a shard to
the GPU for its all-gather and each reduced gradient shard back, and the optimizer steps on the
CPU. That is whole-model offload under FSDP2 (teraio cannot move parameters FSDP owns: it gathers
and frees them), and its step is the part the CPU makes slow: torch's AdamW over CPU DTensors runs
its single-tensor loop, a dozen passes over memory per parameter.

`HostStep` runs that step on the engine's kernel (`teraio.cpu_adamw`) instead: one pass per
element on `threads` threads of its own with the GIL released, bit for bit torch's fused CPU
AdamW (`fused=True`). It hooks the optimizer's step:

- before it (a step pre-hook, after the mode's own): the kernel updates every host shard that has
  a gradient, group by group with that group's hyperparameters as the loop left them (a scheduler's
  `lr`), its state created as torch's fused AdamW creates it where there is none (DTensor moments
  like the shard, `step` a CPU scalar), so `state_dict()` and `torch.distributed.checkpoint` see
  what torch would have made. Then it hides those shards' gradients (`grad = None`), so the
  optimizer's own step, which skips a parameter without one, leaves them alone;
- after it (a step post-hook): the gradients come back, for the loop's `zero_grad()` and anything
  that reads them.

A gradient clip runs before the step, on the host gradients, as without teraio; accumulation
adds into them, as FSDP does. FSDP waits for each gradient's copy to the host at the end of
backward (`finalize_backward`), so the step reads finished bytes. Parameters FSDP keeps on the
GPU, and optimizers the kernel does not run (`cpu_update.kernel_refusal`: not Adam/AdamW,
`amsgrad`, a CPU without AVX2), are stepped by the optimizer itself, and the report says why.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Optional

import torch

from ...cpu_adamw import AdamTensor, CpuAdamW
from ...machine import ranks_on_this_host
from ...sharded import host_shards, local_tensor
from .cpu_update import adam_hyper, kernel_refusal

#: Steps kept for the report's median.
TIMES_KEPT = 64


def install(session: Any) -> Optional[HostStep]:
    """The host step of `session`'s model, its hooks in the session's (after the mode's own
    step hooks, so the mode's pre-hook has brought back any state it moved); None: no host shards."""
    step = HostStep.for_model(session.model, session.optimizer)
    if step is not None:
        session._install_step_hooks(step.before_step, step.after_step)
    return step


def kernel_threads() -> int:
    """The kernel's threads: torch's intra-op threads, at most this host's cores over the ranks
    on it (each rank steps its own shards at the same moment)."""
    cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores // max(1, ranks_on_this_host())))


class HostStep:
    """Steps the host shards of `params` (FSDP2's `CPUOffloadPolicy`) with the engine's kernel at
    `optimizer.step()`; see the module docstring. `refusal`: why the optimizer itself steps them
    (None: the kernel does)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.host = {id(p) for p in params}
        self.elements = sum(local_tensor(p).numel() for p in params)
        self.refusal = kernel_refusal(optimizer)
        self.kernel: Optional[CpuAdamW] = None if self.refusal is not None else CpuAdamW(kernel_threads())
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._times_ms: list[float] = []
        self.steps = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Optional[HostStep]:
        """The host step of an FSDP2 model whose shards live in host memory (None: none do)."""
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = [p for p in host_shards(model) if id(p) in trained and p.requires_grad]
        return cls(optimizer, params) if params else None

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.kernel is None:
            return
        # `args` holds the optimizer itself first, as the step's hooks are given it.
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            raise ValueError(
                "teraio.offload: optimizer.step(closure) is not supported for an FSDP2 model whose "
                "shards live in host memory: teraio steps them before the closure would run"
            )
        started = time.perf_counter()
        stepped: list[torch.Tensor] = []
        for group in self.optimizer.param_groups:
            tensors = []
            for param in group["params"]:
                if param.grad is None or id(param) not in self.host:
                    continue
                state = self._state_of(param)
                tensors.append(
                    AdamTensor(
                        param=local_tensor(param).detach(),
                        grad=local_tensor(param.grad),
                        exp_avg=local_tensor(state["exp_avg"]),
                        exp_avg_sq=local_tensor(state["exp_avg_sq"]),
                        step=float(local_tensor(state["step"])) + 1,  # torch advances it first
                    )
                )
                stepped.append(param)
            if tensors:
                self.kernel.step(adam_hyper(group, self.decoupled), tensors)
        for param in stepped:  # once the kernel took every tensor (it refuses bad ones first)
            local_tensor(self.optimizer.state[param]["step"]).add_(1)
            self._hidden.append((param, param.grad))
            param.grad = None
        if stepped:
            self._times_ms = (self._times_ms + [(time.perf_counter() - started) * 1e3])[-TIMES_KEPT:]
            self.steps += 1

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for param, grad in self._hidden:
            param.grad = grad
        self._hidden.clear()

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The parameter's state, made as torch's fused AdamW makes it where there is none."""
        state = self.optimizer.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for name in ("exp_avg", "exp_avg_sq"):
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def report(self) -> dict[str, Any]:
        """Who stepped the host shards, over how many elements on this rank, and the kernel's
        median step (ms)."""
        if self.kernel is None:
            return {"by": f"the optimizer: {self.refusal}", "elements": self.elements}
        return {
            "by": f"the engine's kernel ({self.kernel.threads} threads)",
            "elements": self.elements,
            "steps": self.steps,
            "step_ms": statistics.median(self._times_ms) if self._times_ms else None,
        }
