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

The step in backward (`step_in_backward`, "auto" by default): each shard is updated as soon as
FSDP has put its reduced gradient in host memory (a post-accumulate-grad hook, which FSDP runs on
the sharded parameter), on a worker thread, while backward goes on over the blocks before it;
`optimizer.step()` then waits for the worker. "auto" turns it on from the second step where the
first showed a loop it leaves exact (so the block plan's measuring iterations see it): one
backward per step, no `clip_grad_norm_` (or `clip_grad_value_`) over the shards, the
hyperparameters unchanged in between; the session takes those calls over to see them
(`Session._take_over_clipping`). Once on, a second backward before
the step, a clip that would scale (one whose coefficient is 1 scales nothing, so it stands, and
turns the step in backward off from the next step), a value clip, or changed hyperparameters
raise, saying so (the update has run). Other in-place edits of the gradients between backward
and the step (an fp16 `GradScaler`'s unscale) are not seen: pass False for such a loop. True
turns it on from the first step; False keeps the step at `optimizer.step()`. FSDP copies a
gradient to the host asynchronously where no hook would read it early (torch 2.11 records an
event, which the worker waits for; later versions copy synchronously where a hook is
registered).

At `optimizer.step()` a gradient clip runs before the step, on the host gradients, as without
teraio; accumulation adds into them, as FSDP does. FSDP waits for each gradient's copy to the
host at the end of backward (`finalize_backward`), so the step reads finished bytes. Parameters
FSDP keeps on the GPU, and optimizers the kernel does not run (`cpu_update.kernel_refusal`: not
Adam/AdamW, `amsgrad`, a CPU without AVX2), are stepped by the optimizer itself, and the report
says why.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time
from typing import Any, Callable, Optional, Union

import torch

from ...cpu_adamw import AdamTensor, CpuAdamW
from ...machine import ranks_on_this_host
from ...sharded import fsdp_params, host_shards, local_tensor
from .cpu_update import adam_hyper, kernel_refusal

#: Steps kept for the report's median.
TIMES_KEPT = 64
#: Steps "auto" watches at `optimizer.step()` before it may step in backward: one, so that the
#: block plan measures its iterations with the step where it will run (from the second).
LEARNING_STEPS = 1


def install(session: Any) -> Optional[HostStep]:
    """The host step of `session`'s model, its hooks in the session's (after the mode's own
    step hooks, so the mode's pre-hook has brought back any state it moved); None: no host shards."""
    step = HostStep.for_model(session.model, session.optimizer, session.options.step_in_backward)
    if step is not None:
        session._install_step_hooks(step.before_step, step.after_step)
        session._hooks.extend(step.grad_hooks())
        if step.grad_hooks_installed:
            session._take_over_clipping(step.owns, step.clip, step.other)
            step.release_clipping = session._give_back_clipping
        session._hooks.append(step)  # its worker ends with the session (`remove`)
    return step


def kernel_threads() -> int:
    """The kernel's threads: torch's intra-op threads, at most this host's cores over the ranks
    on it (each rank steps its own shards at the same moment)."""
    cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores // max(1, ranks_on_this_host())))


class HostStep:
    """Steps the host shards of `params` (FSDP2's `CPUOffloadPolicy`) with the engine's kernel, in
    backward or at `optimizer.step()`; see the module docstring. `refusal`: why the optimizer
    itself steps them (None: the kernel does)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        in_backward: Union[bool, str] = "auto",
        records: Optional[dict[int, Any]] = None,
    ) -> None:
        self.optimizer = optimizer
        self.params = params
        self.host = {id(p) for p in params}
        self.elements = sum(local_tensor(p).numel() for p in params)
        self.refusal = kernel_refusal(optimizer)
        self.kernel: Optional[CpuAdamW] = None if self.refusal is not None else CpuAdamW(kernel_threads())
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        self._group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        #: FSDP's record of each shard (its gradient's copy-out event), by the parameter's id.
        self._records = records or {}
        self.setting = in_backward
        #: Whether this step's updates run in backward; "auto" decides after `LEARNING_STEPS`.
        self.in_backward = in_backward is True and self.kernel is not None
        self.why = "step_in_backward=True" if self.in_backward else "learning the loop"
        if self.kernel is None:
            self.why = "no kernel"
        elif in_backward is False:
            self.why = "step_in_backward=False"
        #: This iteration: hook calls per parameter, each gradient as the hook saw it, each
        #: group's hyperparameters (by index) at its first gradient, whether a clip ran, and the
        #: updates queued on the worker.
        self._seen: dict[int, int] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self._hypers: dict[int, Any] = {}
        self._clipped = False
        self.grad_hooks_installed = False
        self.release_clipping: Optional[Callable[[], None]] = None
        self._queued: list[tuple[torch.nn.Parameter, concurrent.futures.Future[None]]] = []
        self._clean_steps = 0
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._times_ms: list[float] = []
        self._waits_ms: list[float] = []
        self.steps = 0
        self.steps_in_backward = 0

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, in_backward: Union[bool, str] = "auto"
    ) -> Optional[HostStep]:
        """The host step of an FSDP2 model whose shards live in host memory (None: none do)."""
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = [p for p in host_shards(model) if id(p) in trained and p.requires_grad]
        if not params:
            return None
        records = {id(record.sharded_param): record for record in fsdp_params(model)}
        return cls(optimizer, params, in_backward, records)

    def grad_hooks(self) -> list[Any]:
        """The post-accumulate-grad hooks that count backward passes and queue updates."""
        if self.kernel is None or self.setting is False:
            return []
        self.grad_hooks_installed = True
        return [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    def remove(self) -> None:
        """Ends the worker (at the session's exit), once what it was given has run, and gives
        `clip_grad_norm_` back."""
        if self.release_clipping is not None:
            self.release_clipping()
            self.release_clipping = None
        if self._worker is not None:
            try:
                self._drain()
            except Exception:  # a failed update raised at the step that waited for it, if any
                pass
            self._worker.shutdown(wait=True)
            self._worker = None

    # -- backward ----------------------------------------------------------------------------

    def _grad_ready(self, param: torch.Tensor) -> None:
        key = id(param)
        self._seen[key] = self._seen.get(key, 0) + 1
        index = self._group_of[key]
        if index not in self._hypers:  # once per group and step: the group's as backward saw them
            self._hypers[index] = adam_hyper(self.optimizer.param_groups[index], self.decoupled)
        grad = local_tensor(param.grad)
        self._grads[key] = grad
        if not self.in_backward:
            return
        if self._seen[key] > 1:
            raise RuntimeError(
                f"teraio.offload ({self.why}): a second backward before optimizer.step(), which "
                "accumulates into gradients the step in backward has already applied (pass "
                "step_in_backward=False for a loop that accumulates)"
            )
        record = self._records.get(key)
        # torch 2.11 copies the gradient out asynchronously even with a hook: wait for its copy.
        event = getattr(record, "grad_offload_event", None) if record is not None else None
        tensor = self._tensor(param, grad)
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="teraio-host-step")
        hyper = self._hypers[index]
        self._queued.append((param, self._worker.submit(self._update, hyper, tensor, event)))

    def _update(self, hyper: Any, tensor: AdamTensor, event: Any) -> None:
        if event is not None:
            event.synchronize()
        assert self.kernel is not None
        self.kernel.step(hyper, [tensor])

    def _drain(self) -> None:
        """Waits for the queued updates (raising the first failure)."""
        queued, self._queued = self._queued, []
        for _, future in queued:
            future.result()

    # -- clipping ------------------------------------------------------------------------------

    def owns(self, listed: list[torch.Tensor]) -> bool:
        return any(id(p) in self.host for p in listed)

    def clip(
        self,
        listed: list[torch.Tensor],
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
        foreach: Optional[bool],
    ) -> torch.Tensor:
        """torch's `clip_grad_norm_`, seen: it scales through `other` (`_clip_grads_with_norm_`)."""
        import torch.nn.utils.clip_grad as clip_grad

        self._clipped = True
        return clip_grad.clip_grad_norm_(listed, max_norm, norm_type, error_if_nonfinite, foreach)

    def other(
        self, name: str, function: Callable[..., Any], listed: list[torch.Tensor], *args: Any, **kwargs: Any
    ) -> Any:
        """torch's gradient function `name` over the shards: as torch runs it, unless updates ran
        in backward this step and it would change their gradients (raises)."""
        self._clipped = True
        if not self._queued or not any(id(p) in self.host for p in listed):
            return function(listed, *args, **kwargs)
        if name == "clip_grads_with_norm_":
            max_norm, total_norm = args[0], args[1]
            coefficient = float(max_norm) / (float(total_norm) + 1e-6)  # torch's arithmetic
            if coefficient >= 1.0:
                return None  # torch would scale by 1: nothing changes
        raise RuntimeError(
            f"teraio.offload ({self.why}): torch.nn.utils {name} after backward has already "
            "updated the model with the unclipped gradients; pass step_in_backward=False for a "
            "loop that clips"
        )

    # -- the step ------------------------------------------------------------------------------

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
        stepped = [param for param, _ in self._queued]
        self._drain()
        if stepped:
            self._check_exact(stepped)
            self._waits_ms = (self._waits_ms + [(time.perf_counter() - started) * 1e3])[-TIMES_KEPT:]
        done = {id(p) for p in stepped}
        for group in self.optimizer.param_groups:
            tensors = []
            for param in group["params"]:
                if param.grad is None or id(param) not in self.host or id(param) in done:
                    continue
                tensors.append(self._tensor(param, local_tensor(param.grad)))
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
            self.steps_in_backward += bool(done)
        self._learn()

    def _check_exact(self, stepped: list[torch.nn.Parameter]) -> None:
        """Raises where the step in backward did not see what the step would have: a gradient
        replaced after its update read it, or hyperparameters changed in between."""
        for param in stepped:
            key = id(param)
            index = self._group_of[key]
            if param.grad is None or local_tensor(param.grad) is not self._grads[key]:
                changed = "a gradient was replaced between backward and optimizer.step()"
            elif adam_hyper(self.optimizer.param_groups[index], self.decoupled) != self._hypers[index]:
                changed = "the hyperparameters changed between backward and optimizer.step()"
            else:
                continue
            raise RuntimeError(
                f"teraio.offload ({self.why}): {changed}, but backward has already updated the "
                "model; pass step_in_backward=False for this loop"
            )

    def _learn(self) -> None:
        """With "auto": whether this step's loop leaves the step in backward exact (one backward,
        no clip, hyperparameters unchanged until the step); on after `LEARNING_STEPS` such steps."""
        seen, hypers, clipped = self._seen, self._hypers, self._clipped
        self._seen, self._grads, self._hypers, self._clipped = {}, {}, {}, False
        if clipped and self.in_backward and self.setting == "auto":
            # A clip that scaled nothing stood; the next steps run at optimizer.step().
            self.in_backward = False
            self.setting = False
            self.why = f"off from step {self.steps}: the loop clips"
            return
        if self.setting != "auto" or self.in_backward or self.kernel is None or not seen:
            return
        exact = max(seen.values()) == 1 and not clipped
        for index, hyper in hypers.items():
            if adam_hyper(self.optimizer.param_groups[index], self.decoupled) != hyper:
                exact = False
        if not exact:
            self.setting = False
            self.why = (
                "off: the loop accumulates, clips or changes the optimizer between backward and the step"
            )
            return
        self._clean_steps += 1
        if self._clean_steps >= LEARNING_STEPS:
            self.in_backward = True
            self.why = f"auto: on from step {self.steps}"

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for param, grad in self._hidden:
            param.grad = grad
        self._hidden.clear()

    def _tensor(self, param: torch.Tensor, grad: torch.Tensor) -> AdamTensor:
        state = self._state_of(param)
        return AdamTensor(
            param=local_tensor(param).detach(),
            grad=grad,
            exp_avg=local_tensor(state["exp_avg"]),
            exp_avg_sq=local_tensor(state["exp_avg_sq"]),
            step=float(local_tensor(state["step"])) + 1,  # torch advances it first
        )

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The parameter's state, made as torch's fused AdamW makes it where there is none."""
        state = self.optimizer.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for name in ("exp_avg", "exp_avg_sq"):
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def report(self) -> dict[str, Any]:
        """Who stepped the host shards, over how many elements on this rank, the kernel's median
        step (ms: at `optimizer.step()`, the wait for the step in backward included), whether it
        ran in backward and why, and the median wait for it at the step."""
        if self.kernel is None:
            return {"by": f"the optimizer: {self.refusal}", "elements": self.elements}
        return {
            "by": f"the engine's kernel ({self.kernel.threads} threads)",
            "elements": self.elements,
            "steps": self.steps,
            "step_ms": statistics.median(self._times_ms) if self._times_ms else None,
            "in_backward": self.why,
            "steps_in_backward": self.steps_in_backward,
            "wait_ms": statistics.median(self._waits_ms) if self._waits_ms else None,
        }
