"""What every mode shares: the budget it runs under, the hooks it installs and removes, the
iteration's peak and the allocator's retries, and `clip_grad_norm_` taken over per session.

A mode (`modes/`) is a `Session` with a policy: `__enter__` installs its hooks (the session's
step hooks and iteration peak among them), the training loop runs, and `__exit__` removes them
and brings every tensor back. docs/runtime.md says which hook fires when.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union

import torch
from torch.nn import Module
from torch.optim import Optimizer

from .. import machine
from ..options import OffloadOptions
from ..planning import format_bytes, parse_size
from ..sharded import NO_FIT_REMEDY, compute_device, host_shards, is_sharded, parameter_bytes
from ..store import Store
from ..timing import IterationPeak
from .errors import NoPlanFitsError


class Mode(Protocol):
    """What `teraio.offload` returns: a context around the training loop, with a report."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def report(self) -> Any: ...


def gpu_budget(device: torch.device, gpu_memory: Optional[Union[int, float, str]]) -> int:
    """`gpu_memory` in bytes; default: the whole device."""
    if gpu_memory is None:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        raise ValueError("gpu_memory is required on a CPU device")
    return parse_size(gpu_memory)


def host_memory(options: OffloadOptions) -> tuple[int, dict[str, Any]]:
    """Pinned host memory the runtime may hold, and where the figure came from."""
    available = machine.available_host_bytes()
    if options.host_memory == "auto":
        ranks = machine.ranks_on_this_host()
        chosen = machine.default_host_memory(available, machine.total_host_bytes(), ranks)
        note = f"MemAvailable ({(available or 0) / 2**30:.1f} GiB) less a margin" + (
            f", over {ranks} ranks on this host" if ranks > 1 else ""
        )
        return chosen, {"host_memory": note}
    given = parse_size(options.host_memory)
    if available is not None and given > available:
        raise ValueError(
            f"host_memory={options.host_memory!r} ({format_bytes(given)}) is more than this machine has "
            f"available ({format_bytes(available)} MemAvailable): pinning it would end in the "
            'kernel\'s out-of-memory killer; pass less, or "auto"'
        )
    return given, {"host_memory": "given"}


@dataclass
class Budget:
    """What a session may use: the store (the SSD tier; None: host memory only), GPU memory the
    iterations must fit in, pinned host memory, and where those figures came from (`machine`:
    given or measured, for the report)."""

    store: Optional[Store]
    gpu_memory_bytes: int
    host_memory_bytes: int
    machine: dict[str, Any] = field(default_factory=dict)


class Session:
    """The state every mode starts from and the lifecycle pieces they share."""

    def __init__(self, model: Module, optimizer: Optimizer, options: OffloadOptions, budget: Budget) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options
        self.store = budget.store
        self.device = compute_device(model)
        self.cuda = self.device.type == "cuda"
        self.gpu_memory_bytes = budget.gpu_memory_bytes
        self.host_memory_bytes = budget.host_memory_bytes
        self.machine = budget.machine
        #: Hook handles removed at exit (`_remove_hooks`).
        self._hooks: list[Any] = []
        #: Per iteration: its wall time and (CUDA) its peak allocated bytes.
        self._step_times_ms: list[float] = []
        self._peaks: list[int] = []
        self._clipping: Optional[_Clipping] = None
        #: FSDP2's host shards' step (`modes.host_step.HostStep`), where the mode installs one,
        #: and the shards' parameter ids (their state is the host step's, never moved).
        self.host_step: Any = None
        self.host_ids = frozenset(id(p) for p in host_shards(model))
        self._cache_off_said = False

    # -- hooks in and out ------------------------------------------------------------------------

    def _refuse_resident_overflow(self, remedy: str) -> None:
        """Parameters and their gradients stay on the GPU in the tensor and block plans: a budget
        below them cannot work (`remedy` says what to do; under FSDP2, where whole-model mode
        is not supported, the sharded remedy replaces it)."""
        params, grads = parameter_bytes(self.model)
        if is_sharded(self.model):
            remedy = f": this rank's shards; {NO_FIT_REMEDY}"
        if params + grads > self.gpu_memory_bytes:
            raise NoPlanFitsError(
                f"teraio.offload: gpu_memory={format_bytes(self.gpu_memory_bytes)} cannot hold the "
                f"parameters ({format_bytes(params)}) and their gradients ({format_bytes(grads)})"
                f"{remedy}"
            )

    def _install_step_hooks(self, before: Callable[..., Any], after: Callable[..., Any]) -> None:
        """`before` and `after` around this session's optimizer's step (its own hooks, not a
        global patch): an iteration ends at the step."""
        self._hooks.append(self.optimizer.register_step_pre_hook(before))
        self._hooks.append(self.optimizer.register_step_post_hook(after))

    def _install_peak(self) -> None:
        """The iteration's peak, reset as its forward begins (`timing.IterationPeak`)."""
        self._peak = IterationPeak(self.model, self.device)
        self._hooks.append(self._peak.handle)

    def _install_cache_off(self) -> None:
        """A Hugging Face model's key/value cache off in its training forwards (`_cache_off`), on
        the outermost module whose config has `use_cache` and whose forward takes it."""
        for module in self.model.modules():
            if getattr(getattr(module, "config", None), "use_cache", None) is None:
                continue
            parameters = list(inspect.signature(module.forward).parameters)
            if "use_cache" not in parameters:
                continue
            position = parameters.index("use_cache")
            hook = functools.partial(self._cache_off, position)
            self._hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            return

    def _cache_off(self, position: int, module: Module, args: Any, kwargs: dict[str, Any]) -> Any:
        """Passes `use_cache=False` to a training forward with gradients that would build a
        cache (given True, or left to a config that says True), as transformers does under its
        own gradient checkpointing: teraio recomputes blocks in backward (to measure them, and
        where its plan checkpoints them), and a recomputed block would update the cache a second
        time, a replay that differs from its forward and that `torch.utils.checkpoint` refuses.
        Such a forward never reads the cache it builds, so its outputs are the same bits. A
        cache the loop passes in (`past_key_values`) is left as given."""
        if not (module.training and torch.is_grad_enabled()) or len(args) > position:
            return None
        if kwargs.get("past_key_values") is not None:
            return None
        wanted = kwargs.get("use_cache")
        if wanted is False or (wanted is None and not module.config.use_cache):
            return None
        if not self._cache_off_said:
            self._cache_off_said = True
            warnings.warn(
                f"teraio.offload: {type(module).__name__} trains with use_cache=False, as transformers "
                "sets it under gradient checkpointing: teraio recomputes blocks in backward, which "
                "would update a key/value cache twice (the loss and gradients are the same bits)",
                stacklevel=2,
            )
        return args, {**kwargs, "use_cache": False}

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # -- what an iteration took ------------------------------------------------------------------

    def _peak_bytes(self) -> int:
        """The allocator's peak since the last reset (the iteration's, with `_install_peak`)."""
        return int(torch.cuda.max_memory_allocated(self.device))

    def _allocator_retries(self) -> int:
        """The CUDA caching allocator's retries so far: each is a request that found the cache
        full of blocks it could not use, so it freed them, synchronizing the device."""
        if not self.cuda:
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    # -- clipping --------------------------------------------------------------------------------

    def _take_over_clipping(
        self,
        owns: Callable[[list[torch.Tensor]], bool],
        clip: Callable[..., Any],
        other: Optional[Callable[..., Any]] = None,
    ) -> None:
        """`torch.nn.utils.clip_grad_norm_` calls on parameter lists this session `owns` go to
        `clip` (same arguments) until `_give_back_clipping`; other lists, and every call once
        the session has given it back, go to the function that was there before. The other
        gradient functions (`_REFUSED_GRADIENT_FUNCTIONS`) on those lists go to `other` (its
        name, torch's function, then the call's arguments), or raise where there is none."""
        self._clipping = _Clipping(owns, clip, other)
        _CLIPPING.append(self._clipping)
        if len(_CLIPPING) == 1:
            _install_clipping()

    def _give_back_clipping(self) -> None:
        if self._clipping is None:
            return
        _CLIPPING.remove(self._clipping)
        self._clipping = None
        if not _CLIPPING:
            _remove_clipping()


class _Clipping:
    __slots__ = ("owns", "clip", "other")

    def __init__(
        self,
        owns: Callable[[list[torch.Tensor]], bool],
        clip: Callable[..., Any],
        other: Optional[Callable[..., Any]] = None,
    ) -> None:
        self.owns = owns
        self.clip = clip
        self.other = other


#: The sessions that take over `clip_grad_norm_`, innermost last, and torch's functions while any
#: does. `torch.nn.utils.clip_grad_norm_` is rebound only while the list is not empty, and each
#: session sees only the calls on its own parameters.
_CLIPPING: list[_Clipping] = []
_TORCH_CLIPPING: list[dict[tuple[Any, str], Callable[..., Any]]] = []

#: Gradient functions that read `param.grad`, which a session taking over clipping leaves None
#: after backward (the gradients are in its tiers): on its parameters they would do nothing, so
#: they raise instead. `_clip_grads_with_norm_` is also what a `clip_grad_norm_` bound before the
#: session (`from torch.nn.utils import clip_grad_norm_`) calls, with a total norm of no gradients.
_REFUSED_GRADIENT_FUNCTIONS = (
    ("clip_grad", "_clip_grads_with_norm_"),
    ("utils", "clip_grads_with_norm_"),
    ("clip_grad", "clip_grad_value_"),
    ("utils", "clip_grad_value_"),
)


def _install_clipping() -> None:
    import torch.nn.utils.clip_grad as clip_grad_module

    modules = {"utils": torch.nn.utils, "clip_grad": clip_grad_module}
    originals: dict[tuple[Any, str], Callable[..., Any]] = {}
    original = torch.nn.utils.clip_grad_norm_

    def clip_grad_norm_(
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        listed = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for session in reversed(_CLIPPING):
            if session.owns(listed):
                return session.clip(listed, max_norm, norm_type, error_if_nonfinite, foreach)
        return original(listed, max_norm, norm_type, error_if_nonfinite, foreach)

    def refusing(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def refused(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            listed = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            owner = next((session for session in reversed(_CLIPPING) if session.owns(listed)), None)
            if owner is not None and owner.other is not None:
                return owner.other(name, function, listed, *args, **kwargs)
            if owner is not None:
                raise RuntimeError(
                    f"teraio.offload (whole-model): torch.nn.utils {name} on the model's parameters, "
                    "whose gradients have left the GPU after backward (param.grad is None), so it "
                    "would change nothing. Clip with torch.nn.utils.clip_grad_norm_, called as that "
                    "attribute (a name imported from torch before teraio.offload began is torch's own "
                    "function and lands here): teraio answers it from the gradients it holds"
                )
            return function(listed, *args, **kwargs)

        return refused

    originals[(torch.nn.utils, "clip_grad_norm_")] = original
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]
    for module_name, name in _REFUSED_GRADIENT_FUNCTIONS:
        module = modules[module_name]
        function = getattr(module, name, None)
        if function is not None:
            originals[(module, name)] = function
            setattr(module, name, refusing(name.lstrip("_"), function))
    _TORCH_CLIPPING.append(originals)


def _remove_clipping() -> None:
    for (module, name), function in _TORCH_CLIPPING.pop().items():
        setattr(module, name, function)
