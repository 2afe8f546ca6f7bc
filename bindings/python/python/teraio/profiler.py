"""Lifetime profiler: records training iterations at op granularity and writes the planner's trace.

It needs no PyTorch patch. A `TorchDispatchMode` sees every aten op with its input and output
tensors; tensors are identified by their *storage* (views share their base's storage, and a
storage is what occupies memory). Op times come from CUDA events around each op (on a CUDA
device) or the host clock (CPU). Kinds: parameters and buffers are `weight`, `param.grad` at the
optimizer step is `gradient`, tensors in `optimizer.state` are `optimizer_state`, tensors saved for
backward (seen through `saved_tensors_hooks`) are `activation`, the rest `temporary`.

Allocation and free points: a storage is allocated at the op that first outputs it (or before the
iteration for parameters and optimizer state) and freed after its last use, or later where it was
seen alive longer; one still alive when recording stops is held by the caller (its batch, its
loss) and stays a temporary, from before the iteration if no recorded op made it. An address the
allocator hands out again is a new tensor (the old storage's weak reference has expired).

The cost (a Python callback and two CUDA events per op) is paid only while a profiler is active.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .recompute import Producer, TensorArg, recomputable_op
from .sharded import UnshardedTracker, is_parameter_memory, local_tensor

TRACE_FORMAT_VERSION = 1

_LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_SKIP_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.alias.default,
}


def storage_key(tensor: torch.Tensor) -> tuple[str, int, int]:
    """Identity of a tensor's memory: (device type, device index, base address of its storage)."""
    tensor = local_tensor(tensor)
    storage = tensor.untyped_storage()
    device = tensor.device
    return (device.type, device.index if device.index is not None else -1, storage.data_ptr())


@dataclass
class TensorRecord:
    """One storage's life in the profiled iteration."""

    id: int
    name: str
    size_bytes: int
    kind: str
    alloc_op: Optional[int]
    weak: Any
    uses: dict[int, str] = field(default_factory=dict)
    saved_for_backward: bool = False
    #: The forward op that made it, where that op can be replayed (teraio.recompute).
    producer: Optional[Producer] = None
    #: A forward op wrote it in place after it was made.
    mutated: bool = False
    #: The op after which its storage was seen freed (None: still alive when recording stopped).
    died_op: Optional[int] = None
    #: No recorded op made it: it existed before recording (the caller's batch).
    made_before: bool = False
    #: The storage first recorded, once a restored copy has taken `weak` over (`alias`): its
    #: death, not the copy's, is the tensor's (the copy dies in backward, the caller's batch never).
    first_weak: Any = None

    @property
    def held_past_end(self) -> bool:
        """A storage made during the iteration or first seen there (not a weight, gradient or
        optimizer state) that outlived the recording: something outside the iteration holds it
        (the caller's batch or loss, a model output the caller keeps)."""
        return self.kind in ("temporary", "activation") and self.died_op is None

    def use(self, op: int, access: str) -> None:
        if self.uses.get(op) != "write":
            self.uses[op] = access


@dataclass
class SaveEvent:
    """A `saved_tensors_hooks` event: `kind` is "pack" (forward saved a tensor) or "unpack"
    (backward needs it), `next_op` the index of the next op to run, `tensor_id` the record,
    `pack_index` the save (for an unpack: the save it reads; -1 where unknown)."""

    kind: str
    next_op: int
    tensor_id: Optional[int]
    pack_index: int


class KeptSave:
    """What a profiling pack hook gives autograd for a tensor it keeps as it is: the tensor and
    its save's index, so that the unpack event names the save it reads (a storage saved twice,
    inside and outside a block, is two saves; `teraio.blocks` drops the unpacks of the inside one)."""

    __slots__ = ("tensor", "pack_index", "tensor_id")

    def __init__(self, tensor: torch.Tensor, pack_index: int, tensor_id: Optional[int]) -> None:
        self.tensor = tensor
        self.pack_index = pack_index
        self.tensor_id = tensor_id


class _Recorder(TorchDispatchMode):
    def __init__(self, profiler: Profiler) -> None:
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        profiler = self.profiler
        if profiler._paused or func in _SKIP_OPS or getattr(func, "is_view", False):
            return func(*args, **kwargs)
        if profiler.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = func(*args, **kwargs)
            end.record()
            timing: Any = (start, end)
        else:
            started = time.perf_counter()
            out = func(*args, **kwargs)
            timing = (time.perf_counter() - started) * 1e6
        profiler._record_op(func, args, kwargs, out, timing)
        return out


class Profiler:
    """Records one (or more) training iterations and builds a trace (docs/trace.md).

    ```
    profiler = teraio.Profiler(model, optimizer)
    with profiler:
        loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
    trace = profiler.trace(gpu_capacity_bytes=40 << 30)
    ```

    `install_hooks=False` is for runtimes that own the `saved_tensors_hooks` and call
    `note_pack`/`note_unpack` themselves.
    """

    def __init__(
        self,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        install_hooks: bool = True,
        device: Optional[torch.device] = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.install_hooks = install_hooks
        if device is None and model is not None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = device if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.ops: list[dict[str, Any]] = []
        self._timings: list[Any] = []
        self.records: list[TensorRecord] = []
        self.events: list[SaveEvent] = []
        self._live: dict[tuple[str, int, int], TensorRecord] = {}
        self._module_stack: list[str] = []
        # Calls of each module so far, and for each record first passed to a module: (module
        # name, call, flat argument position, saves before the call) (teraio.recompute).
        self._module_calls: dict[str, int] = {}
        self.module_args: dict[int, tuple[str, int, int, int]] = {}
        self._handles: list[Any] = []
        self._mode: Optional[_Recorder] = None
        # Records made while recording whose storage has not been seen freed yet (`_note_deaths`).
        self._watch: list[TensorRecord] = []
        self._hooks_context: Any = None
        self._phase = "forward"
        self._pack_count = 0
        self._param_names: dict[tuple[str, int, int], str] = {}
        self.wall_time_s = 0.0
        self._started_at = 0.0
        self._paused = 0
        self.drive_optimizer_hooks = install_hooks
        # FSDP2's gathered-parameter buffers (None: not an FSDP2 model; see teraio.sharded).
        self._unsharded: Optional[UnshardedTracker] = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run inside are not recorded (a runtime's own copies)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts recording (registers persistent tensors, enters the dispatch mode)."""
        if self._mode is not None:
            raise RuntimeError("the profiler is already recording")
        self._register_persistent()
        self._unsharded = UnshardedTracker.for_model(self.model)
        if self.model is not None:
            for name, module in self.model.named_modules():
                self._handles.append(
                    module.register_forward_pre_hook(self._module_enter(name), with_kwargs=True)
                )
                self._handles.append(module.register_forward_hook(self._module_exit()))
        if self.optimizer is not None and self.drive_optimizer_hooks:
            self._handles.append(self.optimizer.register_step_pre_hook(self._before_step))
            self._handles.append(self.optimizer.register_step_post_hook(self._after_step))
        if self.install_hooks:
            self._hooks_context = torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack_hook)
            self._hooks_context.__enter__()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._started_at = time.perf_counter()
        self._mode = _Recorder(self)
        self._mode.__enter__()

    @property
    def recording(self) -> bool:
        """Between `start` and `stop`."""
        return self._mode is not None

    def stop(self) -> None:
        """Stops recording; `trace()` may be called afterwards."""
        if self._mode is None:
            raise RuntimeError("the profiler is not recording")
        self._mode.__exit__(None, None, None)
        self._mode = None
        if self._hooks_context is not None:
            self._hooks_context.__exit__(None, None, None)
            self._hooks_context = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.wall_time_s = time.perf_counter() - self._started_at
        # Storages freed after the last op (by the step's end) were not held past it.
        self._note_deaths(len(self.ops))
        self._classify_at_end()

    def __enter__(self) -> Profiler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- hooks -------------------------------------------------------------------------------

    def _pack_hook(self, tensor: torch.Tensor) -> Any:
        pack_index = self._pack_count
        return KeptSave(tensor, pack_index, self.note_pack(tensor))

    def _unpack_hook(self, saved: KeptSave) -> torch.Tensor:
        self.note_unpack(saved.tensor_id, saved.pack_index)
        return saved.tensor

    def note_pack(self, tensor: torch.Tensor) -> Optional[int]:
        """Records that autograd saved `tensor`; returns its tensor id (None: not tracked)."""
        pack_index = self._pack_count
        self._pack_count += 1
        if self._unsharded is not None:
            self._note_reshards(len(self.ops))
        if tensor.untyped_storage().nbytes() == 0:
            self.events.append(SaveEvent("pack", len(self.ops), None, pack_index))
            return None
        record = self.lookup(tensor)
        if record is None:
            record = self.new_record(
                tensor, "temporary", alloc_op=len(self.ops), name="saved", made_before=True
            )
        if record.kind not in ("weight", "optimizer_state", "gradient") and not is_parameter_memory(tensor):
            record.saved_for_backward = True
        self.events.append(SaveEvent("pack", len(self.ops), record.id, pack_index))
        return record.id

    def alias(self, tensor: torch.Tensor, tensor_id: int) -> None:
        """Makes `tensor`'s storage (a restored copy) count as tensor `tensor_id` from now on."""
        record = self.records[tensor_id]
        if record.first_weak is None:
            record.first_weak = record.weak
        record.weak = StorageWeakRef(tensor.untyped_storage())
        self._live[storage_key(tensor)] = record

    def note_unpack(self, tensor_id: Optional[int], pack_index: int) -> None:
        """Records that backward asked for a saved tensor."""
        self.events.append(SaveEvent("unpack", len(self.ops), tensor_id, pack_index))

    def _module_enter(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self._module_stack.append(name)
            call = self._module_calls.get(name, 0)
            self._module_calls[name] = call + 1
            if self._paused or self._phase != "forward":
                return
            for position, leaf in enumerate(tree_flatten((args, kwargs))[0]):
                if isinstance(leaf, torch.Tensor) and leaf.device.type == self.device.type:
                    record = self.lookup(leaf)
                    if record is not None and record.id not in self.module_args:
                        self.module_args[record.id] = (name, call, position, self._pack_count)

        return hook

    def _module_exit(self) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._module_stack:
                self._module_stack.pop()

        return hook

    def before_step(self) -> None:
        """Marks the optimizer step (call from a step pre-hook when `install_hooks=False`)."""
        if self.optimizer is not None:
            self._before_step(self.optimizer, (), {})

    def after_step(self) -> None:
        """Marks the end of the optimizer step."""
        self._phase = "other"

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._phase = "optimizer"
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                record = self.lookup(param.grad)
                if record is not None:
                    record.kind = "gradient"
                    name = self._param_names.get(storage_key(param))
                    if name:
                        record.name = f"{name}.grad"

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._phase = "other"

    # -- recording ---------------------------------------------------------------------------

    def _register_persistent(self) -> None:
        if self.model is not None:
            for name, param in self.model.named_parameters():
                self._param_names[storage_key(param)] = name
                self.new_record(param, "weight", alloc_op=None, name=name)
                if param.grad is not None:
                    self.new_record(param.grad, "gradient", alloc_op=None, name=f"{name}.grad")
            for name, buffer in self.model.named_buffers():
                if buffer.untyped_storage().nbytes() > 0 and self.lookup(buffer) is None:
                    self.new_record(buffer, "weight", alloc_op=None, name=name)
        if self.optimizer is not None:
            for param, state in self.optimizer.state.items():
                base = self._param_names.get(storage_key(param), "param")
                for key, value in state.items():
                    # Only state in the profiled device's memory (AdamW keeps `step` on the host).
                    if self._on_device(value) and self.lookup(value) is None:
                        self.new_record(value, "optimizer_state", alloc_op=None, name=f"{base}.{key}")

    def _on_device(self, value: Any) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.device.type == self.device.type
            and local_tensor(value).untyped_storage().nbytes() > 0
        )

    def new_record(
        self, tensor: torch.Tensor, kind: str, alloc_op: Optional[int], name: str, made_before: bool = False
    ) -> TensorRecord:
        """A record of `tensor`'s storage; `made_before`: no recorded op made it (it is first seen
        as an input, so it existed before recording)."""
        storage = local_tensor(tensor).untyped_storage()
        record = TensorRecord(
            id=len(self.records),
            name=name,
            size_bytes=int(storage.nbytes()),
            kind=kind,
            alloc_op=alloc_op,
            weak=StorageWeakRef(storage),
            made_before=made_before,
        )
        self.records.append(record)
        self._live[storage_key(tensor)] = record
        if alloc_op is not None:
            self._watch.append(record)
        return record

    def lookup(self, tensor: torch.Tensor) -> Optional[TensorRecord]:
        """The record of the storage `tensor` lives in, while that storage lives (else None)."""
        record = self._live.get(storage_key(tensor))
        if record is None or record.weak.expired():
            return None
        return record

    def _current_phase(self) -> str:
        if self._phase == "optimizer":
            return "optimizer"
        if self._phase == "forward" and torch._C._current_autograd_node() is not None:
            # Sticky: autograd-engine work between nodes (accumulation) belongs to backward too.
            self._phase = "backward"
        return self._phase

    def _record_op(self, func: Any, args: Any, kwargs: Any, out: Any, timing: Any) -> None:
        op = len(self.ops)
        if self._unsharded is not None:
            self._note_reshards(op)
        # A DTensor's memory is its local shard's (the optimizer's step runs on DTensors).
        inputs = [local_tensor(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [local_tensor(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        input_keys = set()
        phase = self._current_phase()
        module = self._module_stack[-1] if self._module_stack and phase == "forward" else ""
        op_name = str(func.__name__ if hasattr(func, "__name__") else func)
        for tensor in inputs:
            if tensor.untyped_storage().nbytes() == 0:
                continue
            key = storage_key(tensor)
            input_keys.add(key)
            record = self.lookup(tensor)
            if record is None:
                record = self.new_record(
                    tensor, "temporary", alloc_op=op, name=f"{op_name}.in", made_before=True
                )
            record.use(op, "read")
        mutable = getattr(getattr(func, "_schema", None), "is_mutable", False)
        for index, tensor in enumerate(outputs):
            if tensor.untyped_storage().nbytes() == 0:
                continue
            key = storage_key(tensor)
            record = self.lookup(tensor) if key in input_keys else None
            if record is None:
                label = f"{module}:{op_name}" if module else op_name
                record = self.new_record(tensor, "temporary", alloc_op=op, name=f"{label}.out{index}")
                if phase == "forward" and len(outputs) == 1 and recomputable_op(func):
                    record.producer = self._producer(op, func, args, kwargs)
            elif mutable and phase == "forward":
                record.mutated = True
            record.use(op, "write")
        entry: dict[str, Any] = {"name": f"{module}:{op_name}" if module else op_name, "phase": phase}
        match = _LAYER_PATTERN.search(module) if module else None
        if match:
            entry["layer"] = int(match.group(1))
        self.ops.append(entry)
        self._timings.append(timing)
        self._note_deaths(op)

    def _note_deaths(self, op: int) -> None:
        """Notes which storages were freed by the time `op` ran. A storage lives as long as
        anything holds it, which can be long after its last use: autocast's cache of low-precision
        weight copies holds them to the end of the autocast region, a model output object holds
        the logits. The planner must not count that memory as free any earlier."""
        if not self._watch:
            return
        alive = []
        for record in self._watch:
            if (record.first_weak or record.weak).expired():
                record.died_op = op
            else:
                alive.append(record)
        self._watch = alive

    def _note_reshards(self, op: int) -> None:
        """FSDP2 freed gathered-parameter buffers (their storage shrunk to zero bytes) before
        `op`: their records die there, before the allocator can hand their address out again."""
        assert self._unsharded is not None
        index = self.device.index if self.device.index is not None else -1
        for pointer in self._unsharded.freed():
            record = self._live.pop((self.device.type, index, pointer), None)
            if record is not None and record.died_op is None:
                record.died_op = op
                if record in self._watch:
                    self._watch.remove(record)

    def _producer(self, op: int, func: Any, args: Any, kwargs: Any) -> Optional[Producer]:
        """The op and its arguments, tensors as views of recorded storages (None: an argument
        is a tensor that is neither recorded nor a small constant)."""
        flat, spec = tree_flatten((args, kwargs))
        leaves: list[Any] = []
        for leaf in flat:
            if not isinstance(leaf, torch.Tensor):
                leaves.append(leaf)
            elif leaf.device.type == self.device.type and leaf.untyped_storage().nbytes() > 0:
                record = self.lookup(leaf)
                if record is None:
                    return None
                size, stride = tuple(leaf.size()), tuple(leaf.stride())
                leaves.append(TensorArg(record.id, leaf.dtype, size, stride, leaf.storage_offset()))
            elif leaf.numel() <= 64 and leaf.device.type == "cpu":
                leaves.append(leaf.clone())  # a scalar-like constant (e.g. a 0-dim CPU tensor)
            else:
                return None
        return Producer(op, func, spec, leaves)

    def _classify_at_end(self) -> None:
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for value in state.values():
                    if self._on_device(value):
                        record = self.lookup(value)
                        if record is not None and record.kind != "weight":
                            record.kind = "optimizer_state"
                            record.alloc_op = None
        for record in self.records:
            # One held past the end stays a temporary: offloading or recomputing it would free
            # nothing (whoever holds it keeps its memory).
            if record.saved_for_backward and record.kind == "temporary" and not record.held_past_end:
                record.kind = "activation"

    # -- output ------------------------------------------------------------------------------

    def op_durations_us(self) -> list[float]:
        """Measured duration of each op, microseconds."""
        durations = []
        for timing in self._timings:
            if isinstance(timing, tuple):
                durations.append(max(0.0, float(timing[0].elapsed_time(timing[1])) * 1e3))
            else:
                durations.append(max(0.0, float(timing)))
        return durations

    def _held_lifetime(
        self, record: TensorRecord, free_op: int, uses: list[tuple[int, str]]
    ) -> tuple[int, list[tuple[int, str]]]:
        """`free_op` and `uses` stretched to where the storage was seen freed (`_note_deaths`): a
        tensor held past its last use is freed no earlier; an activation held past its last
        forward use gets a use there, so that an offload cannot free it before then either."""
        if record.died_op is None or record.died_op < 1 or record.kind not in ("temporary", "activation"):
            return free_op, uses
        held = record.died_op - 1  # alive after op `held`, gone after `died_op`
        if self.ops[held]["phase"] != "forward":
            # Backward frees saved tensors as its nodes finish, at the last use give or take the
            # op running meanwhile; what outlives its use by far is held in forward.
            return free_op, uses
        if held > free_op:
            return held, uses
        if record.kind == "activation":
            forward = [op for op, _ in uses if self.ops[op]["phase"] == "forward"]
            if held > max(forward, default=-1):
                return free_op, sorted([*uses, (held, "read")])
        return free_op, uses

    def trace(self, gpu_capacity_bytes: Optional[int] = None, description: str = "") -> dict[str, Any]:
        """The recorded iteration in the planner's trace format (docs/trace.md, version 1)."""
        if self._mode is not None:
            raise RuntimeError("stop the profiler before building the trace")
        if not self.ops:
            raise RuntimeError("no ops were recorded")
        if gpu_capacity_bytes is None:
            if self.cuda:
                gpu_capacity_bytes = int(torch.cuda.get_device_properties(self.device).total_memory)
            else:
                gpu_capacity_bytes = 1 << 40
        durations = self.op_durations_us()
        ops = [dict(entry, duration_us=duration) for entry, duration in zip(self.ops, durations)]
        tensors = []
        for record in self.records:
            if not record.uses:
                continue
            uses = sorted(record.uses.items())
            persistent = record.kind in ("weight", "optimizer_state") or record.alloc_op is None
            # Held past the end: from before the iteration, if it made it not, to after its end.
            persistent = persistent or (record.held_past_end and record.made_before)
            if persistent:
                alloc_op: Optional[int] = None
                free_op: Optional[int] = None
            else:
                alloc_op = min(record.alloc_op if record.alloc_op is not None else uses[0][0], uses[0][0])
                free_op = len(self.ops) - 1 if record.held_past_end else uses[-1][0]
                free_op, uses = self._held_lifetime(record, free_op, uses)
            tensors.append(
                {
                    "id": record.id,
                    "name": record.name,
                    "size_bytes": record.size_bytes,
                    "kind": record.kind,
                    "alloc_op": alloc_op,
                    "free_op": free_op,
                    "uses": [{"op": op, "access": access} for op, access in uses],
                }
            )
        return {
            "format_version": TRACE_FORMAT_VERSION,
            "description": description,
            "gpu_capacity_bytes": int(gpu_capacity_bytes),
            "ops": ops,
            "tensors": tensors,
        }
