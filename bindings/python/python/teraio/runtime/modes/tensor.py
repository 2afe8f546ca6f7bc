"""The tensor plan: profile an iteration, plan every saved tensor with the lifetime planner, run it.

`teraio.offload` runs this mode for models without repeated blocks, or with
`granularity="tensor"`. Iterations end at `optimizer.step()`. The first `warmup_steps` iterations
run with the fallback policy (every saved activation of at least `min_bytes` to host memory up to
`host_memory`, then to the SSD tier) so that they fit before there is a plan; the next one runs
the same way under the profiler; then the trace is planned and the following iterations run the
plan.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from typing import Any, Optional, Union

import torch
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten

from ... import blocks as bk
from ... import calibration as cal
from ... import ids, machine, sharded, timing
from ... import optimizer_state_dict as osd
from ... import recompute as rc
from ...options import OffloadOptions
from ...planning import format_bytes, parse_bandwidth, parse_size, plan, simulate
from ...profiler import Profiler, SaveEvent
from ...timing import elapsed_ms as _elapsed_ms
from ..errors import NoPlanFitsError
from ..movers.copy import pinned_size
from ..movers.tiers import HOST, SSD
from ..plans.tensor import decisions_from_plan, parameter_moves_from_plan, state_moves_from_plan
from ..report import TensorReport, prediction_fields
from ..session import Budget, Session
from . import host_step
from .activations import ActivationExecutor
from .state import (
    StateExecutor,
    host_then_store,
    movable_state,
    pin_outside_forward_gap,
    pin_within_iteration,
)

#: recompute="auto" ranks its plans by their simulated time on a host link this fraction of the
#: planned bandwidth (`TensorOffload._rank` says why).
SLOW_LINK_FACTOR = 0.85

#: A plan, the trace it was made for, its recipes (by tensor id) and their need events.
_Planned = tuple[dict[str, Any], dict[str, Any], dict[int, rc.Recipe], Optional[dict[int, int]]]
#: A candidate plan: planned, its events, its checkpointed blocks, its recompute summary.
_Candidate = tuple[_Planned, list[SaveEvent], list[str], dict[str, Any]]


class TensorOffload(Session):
    """The tensor plan (`teraio.offload` with granularity "tensor"); see the module docstring.

    ```
    with teraio.offload(model, optimizer, store=store, gpu_memory="22GiB", granularity="tensor") as run:
        ...
    ```
    """

    def __init__(self, model: Module, optimizer: Optimizer, options: OffloadOptions, budget: Budget) -> None:
        if options.checkpoint is None:
            options = options.replace(checkpoint="off")
        super().__init__(model, optimizer, options, budget)
        self._resolve_machine(options)
        self.machine.update(sharded.rank_notes())
        if options.warmup_steps is None:
            # DDP rebuilds its buckets in iteration 1; FSDP2 initialises itself in its first forward.
            ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
            self.warmup_steps = 2 if ddp or sharded.is_sharded(model) else 1
        else:
            self.warmup_steps = options.warmup_steps
        self.calibrate = options.calibrate if options.calibrate is not None else self.device.type == "cuda"
        # The profiled step, then (if calibrating) the calibration step; the plan follows.
        self.profile_step = self.warmup_steps
        self.plan_after_step = self.profile_step + (1 if self.calibrate else 0)
        self.trace_path = options.trace_path
        self.plan_path = options.plan_path
        self.sync_each_step = options.sync_each_step
        skip = {sharded.local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.executor = ActivationExecutor(
            self.device,
            store=self.store,
            host_memory_bytes=self.host_memory_bytes,
            min_bytes=options.min_bytes,
            max_inflight_bytes=parse_size(options.max_inflight_bytes),
            skip_storages=skip,
            gpu_memory_bytes=self.gpu_memory_bytes,
            copy_streams=options.copy_streams,
            pull_forward_bytes=parse_size(options.pull_forward_bytes),
        )
        self.offload_optimizer_state = options.offload_optimizer_state
        self.prefetch_slack = options.prefetch_slack
        self.op_time_scale = options.op_time_scale
        self.tier_preference = options.tier_preference
        self.recompute = options.recompute
        self.min_bytes = options.min_bytes
        # Per planned iteration: calls of each module whose inputs recipes read, and what to keep.
        self._module_calls: dict[str, int] = {}
        self._arg_hooks: list[Any] = []
        self.recompute_summary: dict[str, Any] = {}
        streams = {
            "d2h_stream": getattr(self.executor, "d2h_stream", None),
            "h2d_stream": getattr(self.executor, "h2d_stream", None),
        }
        self.state = StateExecutor(self.device, store=self.store, **streams)
        # Before the plan, every optimizer-state tensor leaves the GPU between steps, so that
        # the warm-up and profiled iterations need no more memory than planned ones.
        self.fallback_state = StateExecutor(
            self.device, store=self.store, object_id_base=ids.base("fallback_state"), **streams
        )
        self.offload_parameters = options.offload_parameters
        self.params = StateExecutor(
            self.device, store=self.store, object_id_base=ids.base("parameters"), **streams
        )
        self.executor.on_event = self._on_event
        self.executor.on_backward = lambda: self._mark("backward")
        # Repeated blocks (checkpointing candidates), their forward passes in the profiled
        # iteration, and the blocks checkpointed in the planned iterations.
        self.blocks = bk.find_blocks(model) if options.checkpoint != "off" or self.calibrate else []
        self.checkpointer = bk.Checkpointer(self.blocks)
        self.block_records: dict[str, bk.BlockRecord] = {}
        self._block_hooks: list[Any] = []
        self._block_marks: list[tuple[Any, Any]] = []
        self.checkpoint_blocks: list[str] = []
        self.checkpoint_summary: dict[str, Any] = {}
        self.calibration = cal.Calibration()
        self._state_ids: list[tuple[torch.Tensor, int]] = []
        self._events: list[SaveEvent] = []
        # Per iteration: when forward, backward and the step started and when the step ended
        # (CUDA events on the compute stream, or host times on a CPU device).
        self._marks: dict[str, Any] = {}
        # Marks whose events may still be pending, then the phase times (floats: CUDA events are
        # driver objects, so none is kept past its iteration).
        self._phase_marks: list[dict[str, Any]] = []
        self._phase_times: list[dict[str, float]] = []
        # Host seconds inside `before_step` / `after_step` (cumulative; the hooks' time is in
        # the executor's stats).
        self._host_s = {"before_step": 0.0, "after_step": 0.0}
        self._host_s_at_plan: dict[str, float] = {}
        self.profiler: Optional[Profiler] = None
        self.trace: Optional[dict[str, Any]] = None
        self.plan_result: Optional[dict[str, Any]] = None
        self.step = 0
        self._saved_hooks: Any = None
        self._step_started = 0.0
        self._planned_from_step: Optional[int] = None
        self._reserved_peaks: list[int] = []
        # The CUDA caching allocator's retries (it hit the cap, freed its cache, which waits for
        # the device, and tried again) when the plan was installed.
        self._alloc_retries_at_plan = 0
        self._stats_at_plan: Optional[dict[str, Any]] = None
        self._state_stats_at_plan: Optional[dict[str, Any]] = None
        self._param_stats_at_plan: Optional[dict[str, Any]] = None
        # The chosen plan and the one that checkpoints every block while they are timed
        # (`_timed_choice`), and the steps timed so far.
        self._trial: list[_Candidate] = []
        self._trial_steps: list[int] = []

    def _resolve_machine(self, options: OffloadOptions) -> None:
        """Bandwidths and the reserve: given, or measured / bounded ("auto")."""
        want_link = options.host_link_bandwidth == "auto"
        want_ssd = self.store is not None and "auto" in (options.ssd_bandwidth, options.ssd_write_bandwidth)
        measured = machine.resolve_bandwidths(
            self.device, self.store, want_link=want_link, want_store=want_ssd
        )
        self.machine["measured"] = measured.source
        share = machine.PLAN_SHARE
        if want_link:
            assert measured.link_d2h is not None and measured.link_h2d is not None
            self.host_link_bandwidth: Union[float, str] = share * min(measured.link_d2h, measured.link_h2d)
            self.machine["link_d2h_bytes_per_s"] = measured.link_d2h
            self.machine["link_h2d_bytes_per_s"] = measured.link_h2d
            self.machine["link_duplex_bytes_per_s"] = measured.link_duplex
        else:
            self.host_link_bandwidth = options.host_link_bandwidth
        ssd_measured = False
        self.ssd_bandwidth: Union[float, str] = (
            6.5e9 if options.ssd_bandwidth == "auto" else options.ssd_bandwidth
        )
        self.ssd_write_bandwidth: Optional[Union[float, str]] = (
            None if options.ssd_write_bandwidth == "auto" else options.ssd_write_bandwidth
        )
        if measured.ssd_read is not None and measured.ssd_write is not None:
            self.machine["ssd_read_bytes_per_s"] = measured.ssd_read
            self.machine["ssd_write_bytes_per_s"] = measured.ssd_write
            if options.ssd_bandwidth == "auto":
                self.ssd_bandwidth = share * measured.ssd_read
                ssd_measured = True
            if options.ssd_write_bandwidth == "auto":
                self.ssd_write_bandwidth = share * measured.ssd_write
                ssd_measured = True
        self.ssd_shared = options.ssd_shared if options.ssd_shared is not None else ssd_measured
        self.reserve_auto = options.reserve in (None, "auto")
        self.reserve_bytes = (
            self.gpu_memory_bytes // 10 if self.reserve_auto else parse_size(options.reserve)  # type: ignore[arg-type]
        )
        self.machine.update(
            {
                "host_memory_bytes": self.host_memory_bytes,
                "host_link_bandwidth": parse_bandwidth(self.host_link_bandwidth),
                "ssd_read_bandwidth": parse_bandwidth(self.ssd_bandwidth) if self.store is not None else None,
                "ssd_shared": self.ssd_shared,
            }
        )

    # -- context -------------------------------------------------------------------------------

    def __enter__(self) -> TensorOffload:
        if self.options.if_no_fit == "raise":
            self._refuse_resident_overflow(
                ", which stay on the GPU; raise gpu_memory, or pass if_no_fit='run' to train anyway"
            )
        self._install_step_hooks(self._before_step, self._after_step)
        self.host_step = host_step.install(self)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self.executor.pack, self.executor.unpack)
        self._saved_hooks.__enter__()
        self._hooks.extend(osd.install(self))
        self._install_peak()
        self._install_cache_off()
        self._begin_iteration()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.profiler is not None and self.profiler.recording:
            self.profiler.stop()
        self.executor.profiler = None
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        self._remove_hooks()
        for hook in self._arg_hooks + self._block_hooks:
            hook.remove()
        self._arg_hooks.clear()
        self._block_hooks.clear()
        self.checkpointer.apply(set())
        self.executor.end_iteration()
        self.executor.close()
        self.fallback_state.close()
        self.state.close()
        self.params.close()

    # -- iteration boundaries ------------------------------------------------------------------

    def _begin_iteration(self) -> None:
        self.executor.begin_iteration()
        self._module_calls.clear()
        self._peak.arm()
        for hook in self._block_hooks:
            hook.remove()
        self._block_hooks.clear()
        usable = self._usable_blocks()
        if self.plan_result is not None:
            self.checkpointer.apply(set(self.checkpoint_blocks))
        elif self.step == self.profile_step and self.trace is None:
            self.checkpointer.apply(set())
            if self.device.type == "cuda":
                # The reserve comes from the allocator's slack in this iteration (reserved minus
                # allocated at the peaks): blocks cached by earlier work (another model trained
                # in this process) would count as slack and shrink the plan's room for nothing.
                torch.cuda.empty_cache()
            self.profiler = Profiler(self.model, self.optimizer, install_hooks=False, device=self.device)
            self.executor.profiler = self.profiler
            self._record_blocks()
            self.profiler.start()
        else:
            # Warm-up and calibration: the conservative policy checkpoints every block.
            if self.options.checkpoint != "off":
                names = set(usable) if self.step > self.profile_step else {n for n, _ in self.blocks}
                self.checkpointer.apply(names)
            if self.step > self.profile_step:
                self._time_blocks(usable)
        self._step_started = time.perf_counter()
        previous_end = self._marks.get("end")
        self._marks = {} if previous_end is None else {"previous_end": previous_end}
        self._mark("forward")

    def _usable_blocks(self) -> list[str]:
        return [
            name for name, _ in self.blocks if name in self.block_records and self.block_records[name].usable
        ]

    def _record_blocks(self) -> None:
        """Hooks recording each block's forward ops, events and inputs in the profiled iteration."""
        profiler = self.profiler
        assert profiler is not None
        for name, module in self.blocks:
            record = self.block_records.setdefault(name, bk.BlockRecord(name))

            def enter(module: Any, args: Any, kwargs: Any, record: bk.BlockRecord = record) -> None:
                if torch._C._current_autograd_node() is not None:
                    return
                record.calls += 1
                record.op_start = len(profiler.ops)
                record.event_start = len(profiler.events)
                record.inputs = []
                for arg in args:
                    if isinstance(arg, torch.Tensor) and arg.device.type == self.device.type:
                        found = profiler.lookup(arg)
                        if found is None and arg.untyped_storage().nbytes() > 0:
                            # An input made before the iteration (the batch): tracked from here.
                            found = profiler.new_record(
                                arg, "temporary", len(profiler.ops), f"{record.name}.input", made_before=True
                            )
                        record.inputs.append(found.id if found is not None else None)

            def leave(module: Any, args: Any, output: Any, record: bk.BlockRecord = record) -> None:
                if torch._C._current_autograd_node() is not None:
                    return
                record.op_end = len(profiler.ops)
                record.event_end = len(profiler.events)

            self._block_hooks.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            self._block_hooks.append(module.register_forward_hook(leave))

    def _time_blocks(self, names: list[str]) -> None:
        """Hooks timing each block's forward pass (no per-op events) in the calibration step."""
        self._block_marks = []
        wanted = set(names)
        for name, module in self.blocks:
            if name not in wanted:
                continue
            pending: list[Any] = []

            def enter(module: Any, args: Any, pending: list[Any] = pending) -> None:
                if torch._C._current_autograd_node() is None:
                    pending.append(self._now())

            def leave(module: Any, args: Any, output: Any, pending: list[Any] = pending) -> None:
                if torch._C._current_autograd_node() is None and pending:
                    self._block_marks.append((pending.pop(), self._now()))

            self._block_hooks.append(module.register_forward_pre_hook(enter))
            self._block_hooks.append(module.register_forward_hook(leave))

    def _now(self) -> Any:
        return timing.mark(self.device)

    def _on_event(self, event_index: int) -> None:
        self.state.on_event(event_index)
        self.params.on_event(event_index)

    def _mark(self, name: str) -> None:
        self._marks[name] = self._now()

    def phase_times_ms(self) -> list[dict[str, float]]:
        """Forward, backward and step time of each iteration so far (ms; compute-stream time)."""
        self._collect_phases(wait=True)
        return list(self._phase_times)

    def _collect_phases(self, wait: bool) -> None:
        while self._phase_marks:
            marks = self._phase_marks[0]
            end = marks["end"]
            if not isinstance(end, float) and not wait and not end.query():
                return
            self._phase_marks.pop(0)
            names = [n for n in ("previous_end", "forward", "backward", "step", "end") if n in marks]
            times: dict[str, float] = {}
            for a, b in zip(names, names[1:]):
                name = "between" if a == "previous_end" else a
                times[name] = _elapsed_ms(marks[a], marks[b])
            self._phase_times.append(times)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._mark("step")
        started = time.perf_counter()
        with self._quiet():
            self.params.before_step()
            self.state.before_step()
            self.fallback_state.before_step()
        self._host_s["before_step"] += time.perf_counter() - started
        if self.profiler is not None and self.profiler.recording:
            self.profiler.before_step()

    def _quiet(self) -> Any:
        if self.profiler is not None and self.profiler.recording:
            return self.profiler.paused()
        return contextlib.nullcontext()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._mark("end")
        self._phase_marks.append(self._marks)
        self._collect_phases(wait=False)
        started = time.perf_counter()
        profiling = self.profiler is not None and self.profiler.recording
        if profiling:
            assert self.profiler is not None
            self.profiler.after_step()
            self.profiler.stop()
            self.executor.profiler = None
            self._state_ids = self._state_records(self.profiler)
            if self.device.type == "cuda":
                self._profiled_slack = int(torch.cuda.max_memory_reserved(self.device)) - int(
                    torch.cuda.max_memory_allocated(self.device)
                )
        planning = (
            self.plan_result is None and self.step == self.plan_after_step and self.profiler is not None
        )
        if not planning:
            if self._trial:
                # The iteration that ran is checked against its own plan before another one goes in.
                self.executor.end_iteration()
                self._timed_choice()
            self.state.after_step()
            self._fallback_state_out()
        self.executor.end_iteration()
        self._host_s["after_step"] += time.perf_counter() - started
        if self.sync_each_step and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._step_times_ms.append((time.perf_counter() - self._step_started) * 1e3)
        if self.device.type == "cuda":
            self._peaks.append(self._peak_bytes())
        if planning:
            assert self.profiler is not None
            planning_started = time.perf_counter()
            if self.calibrate:
                self._calibrate(self.profiler)
            self.fallback_state.close()
            self._make_plan(self.profiler)
            self.planning_s = time.perf_counter() - planning_started
            self._planned_from_step = self.step + 1
            self._stats_at_plan = self.executor.stats.as_dict()
            self._state_stats_at_plan = self.state.stats.as_dict()
            self._param_stats_at_plan = self.params.stats.as_dict()
            self.state.after_step()
            self._host_s_at_plan = dict(self._host_s)
            self._alloc_retries_at_plan = self._allocator_retries()
        self.step += 1
        self._begin_iteration()

    def _fallback_state_out(self) -> None:
        """Before the plan: moves every optimizer-state tensor off the GPU until the next step
        (host memory while the cap allows, else the SSD tier, else it stays)."""
        if self.plan_result is not None or not self.offload_optimizer_state:
            return
        if not self.fallback_state.slots:
            # The other half of host memory stays for activations.
            moves = host_then_store(
                movable_state(self.optimizer, self.device, self.min_bytes, skip=self.host_ids),
                self.host_memory_bytes // 2,
                self.store is not None,
            )
            self.fallback_state.set_plan(moves)
            held = sum(pinned_size(s.nbytes) for s in self.fallback_state.slots if s.tier == HOST)
            self.executor.host_memory_bytes = max(0, self.host_memory_bytes - held)
        self.fallback_state.after_step()

    def _state_records(self, profiler: Profiler) -> list[tuple[torch.Tensor, int]]:
        """Each optimizer-state tensor on the device and its trace id (taken while it is on the
        GPU: a tensor moved off has no address to look up)."""
        found = []
        seen: set[int] = set()
        for state in profiler.optimizer.state.values() if profiler.optimizer is not None else ():
            for value in state.values():
                if not isinstance(value, torch.Tensor) or value.device.type != profiler.device.type:
                    continue
                record = profiler.lookup(value)
                if record is not None and record.id not in seen:
                    seen.add(record.id)
                    found.append((value, record.id))
        return found

    # -- calibration ---------------------------------------------------------------------------

    def _calibrate(self, profiler: Profiler) -> None:
        """Fits the profiled op times to the calibration step (see teraio.calibration): the
        blocks' forward passes measured without per-op events, else the whole forward pass."""
        durations = profiler.op_durations_us()
        marks, self._block_marks = self._block_marks, []
        usable = self._usable_blocks()
        if marks and usable:
            measured_us = sum(_elapsed_ms(a, b) for a, b in marks) * 1e3
            spans = [(self.block_records[name].op_start, self.block_records[name].op_end) for name in usable]
            ops = [d for start, end in spans for d in durations[start:end]]
            region = f"the forward passes of {len(usable)} blocks"
        else:
            self._collect_phases(wait=True)
            measured_us = self._phase_times[-1].get("forward", 0.0) * 1e3 if self._phase_times else 0.0
            ops = [d for d, op in zip(durations, profiler.ops) if op["phase"] == "forward"]
            region = "the forward pass"
        self.calibration = cal.fit(ops, measured_us, region)

    # -- planning ------------------------------------------------------------------------------

    def _make_plan(self, profiler: Profiler) -> None:
        trace = profiler.trace(gpu_capacity_bytes=self.gpu_memory_bytes, description="teraio.offload profile")
        if self.trace_path:
            with open(self.trace_path, "w") as f:
                json.dump(trace, f)
        self.profiled_ops_us = sum(op["duration_us"] for op in trace["ops"])
        for op in trace["ops"]:
            op["duration_us"] = self.calibration.apply(op["duration_us"]) * self.op_time_scale
        self.trace = trace
        if self.reserve_auto and self.device.type == "cuda":
            slack = getattr(self, "_profiled_slack", 0)
            self.reserve_bytes = machine.reserve_from_allocator(self.gpu_memory_bytes, slack, 0)
            self.machine["reserve"] = f"from the allocator: {slack / 2**20:.0f} MiB reserved-minus-allocated"
        self.machine["reserve_bytes"] = self.reserve_bytes
        self.executor.margin_bytes = self.reserve_bytes // 2
        movable = ["activation"]
        if self.offload_optimizer_state:
            # Optimizer state may move only between steps (see `modes/state.py`).
            pin_within_iteration(trace, "optimizer_state")
            movable.append("optimizer_state")
        if self.offload_parameters:
            # Parameters may move only between the two passes (see `modes/state.py`).
            pin_outside_forward_gap(trace, "weight")
            movable.append("weight")
        durations = [op["duration_us"] for op in trace["ops"]]
        usable = self._usable_blocks()
        records = list(self.block_records.values())
        best: Optional[tuple[tuple[float, ...], _Planned, list[SaveEvent], list[str], dict[str, Any]]] = None
        all_blocks: Optional[_Candidate] = None
        tried = []
        held = frozenset(r.id for r in profiler.records if r.held_past_end)
        for count in bk.candidate_counts(len(usable), self.options.checkpoint):
            if count:
                checkpointed = bk.checkpoint_trace(
                    trace, profiler.events, records, usable[:count], durations, held
                )
                base, events, names = checkpointed.trace, checkpointed.events, checkpointed.blocks
            else:
                base, events, names, checkpointed = trace, profiler.events, [], None
            rank, planned = self._plan_with_recompute(base, profiler, movable, events, set(names))
            tried.append(
                {
                    "blocks": len(names),
                    "recompute_ms": checkpointed.cost_us / 1e3 if checkpointed else 0.0,
                    "fits": planned[0]["plan"]["fits"],
                    "predicted_ms": _predicted_ms(planned[0]),
                    "predicted_ms_slow_link": _slow_link_ms(rank),
                    "recompute_chosen": bool(planned[2]),
                }
            )
            candidate = (planned, events, names, self.recompute_summary)
            if best is None or rank < best[0]:
                best = (rank, *candidate)
            if names and len(names) == len(usable) and planned[0]["plan"]["fits"]:
                all_blocks = candidate
        assert best is not None
        chosen: _Candidate = best[1:]
        result = chosen[0][0]
        for entry in tried:
            entry["chosen"] = entry["blocks"] == len(chosen[2])
        self.checkpoint_summary = {"blocks": len(self.blocks), "usable": len(usable), "tried": tried}
        if self.store is None:
            for candidate in (chosen, all_blocks):
                for migration in candidate[0][0]["plan"]["migrations"] if candidate else ():
                    if migration["tier"] == SSD:
                        migration["tier"] = HOST
        if self.plan_path:
            with open(self.plan_path, "w") as f:
                json.dump(result, f)
        if not result["plan"]["fits"] and self.options.if_no_fit == "raise":
            prediction = result.get("prediction", {})
            raise NoPlanFitsError(
                f"teraio.offload: no plan fits gpu_memory={format_bytes(self.gpu_memory_bytes)} "
                f"(reserve {format_bytes(self.reserve_bytes)}; the iteration needs "
                f"{format_bytes(prediction.get('unplanned_peak_bytes', 0))} without offload; "
                f"planner: {prediction.get('outcome')}); raise gpu_memory or host_memory, add a store, "
                "or pass if_no_fit='run' to train anyway"
            )
        self._install(chosen)
        # Where checkpointing every block fits and is not the chosen plan, one planned iteration
        # of each is timed before the choice is final (`_timed_choice`).
        self._trial = [chosen, all_blocks] if all_blocks is not None and all_blocks is not chosen else []
        self._trial_steps = []

    def _install(self, candidate: _Candidate) -> None:
        """Makes `candidate` the plan of the next iterations: the optimizer state and parameters
        an earlier plan moved come back first (between steps all of them are on the GPU)."""
        (result, planned_trace, recipes, need), events, names, self.recompute_summary = candidate
        profiler = self.profiler
        assert profiler is not None
        self.plan_result = result
        self.checkpoint_blocks = names
        self._events = events
        for mover in (self.state, self.params):
            mover.close()
        self.state.set_plan(state_moves_from_plan(planned_trace, self._state_ids, events, result["plan"]))
        self.params.set_plan(parameter_moves_from_plan(planned_trace, profiler, events, result["plan"]))
        # The event clock goes straight to the executors with a plan (none: no call per event).
        clocks = [mover.on_event for mover in (self.state, self.params) if mover.slots]
        self.executor.on_event = clocks[0] if len(clocks) == 1 else (self._on_event if clocks else None)
        held = self.state.planned_bytes(HOST) + self.params.planned_bytes(HOST)
        self.executor.host_memory_bytes = max(0, self.host_memory_bytes - held)
        for hook in self._arg_hooks:
            hook.remove()
        self._arg_hooks.clear()
        self.executor.weight_sources.clear()
        self._install_sources(profiler, recipes)
        decisions = decisions_from_plan(planned_trace, events, result["plan"], recipes, need)
        self.executor.set_plan(decisions, event_count=len(events))

    def _timed_choice(self) -> None:
        """At a step's end, while the plan's choice is on trial: the first planned iteration runs
        the chosen plan (the first one pays for warming up the pools), the next the plan that
        checkpoints every block, the next the chosen one again; then the faster of the last two
        (forward, backward and step, as measured) keeps running. So where checkpointing fits, a
        plan measured slower than it is not kept, at the cost of one iteration of each."""
        if not self._trial:
            return
        self._trial_steps.append(self.step)
        if len(self._trial_steps) < 3:
            self._install(self._trial[len(self._trial_steps) % 2])
            return
        chosen, all_blocks = self._trial
        chosen_ms, all_blocks_ms = (
            self._iteration_ms(self._trial_steps[2]),
            self._iteration_ms(self._trial_steps[1]),
        )
        kept = chosen if chosen_ms <= all_blocks_ms else all_blocks
        if kept is all_blocks:
            self._install(all_blocks)
            for entry in self.checkpoint_summary["tried"]:
                entry["chosen"] = entry["blocks"] == len(all_blocks[2])
        self.checkpoint_summary["measured"] = {
            "chosen_ms": chosen_ms,
            "all_blocks_ms": all_blocks_ms,
            "kept": "chosen" if kept is chosen else "all_blocks",
            "steps": list(self._trial_steps[1:]),
        }
        self._trial = []

    def _iteration_ms(self, step: int) -> float:
        """Forward, backward and step time of iteration `step` (compute stream; waits for it)."""
        self._collect_phases(wait=True)
        times = self._phase_times[step]
        return sum(times.get(name, 0.0) for name in ("forward", "backward", "step"))

    def _hardware(self) -> dict[str, Any]:
        """The machine the planner and the simulator assume, but for the host link."""
        return {
            "gpu_memory": self.gpu_memory_bytes,
            # Without a store there is no SSD tier: a bandwidth of 1 B/s keeps the planner off it.
            "ssd_read_bandwidth": self.ssd_bandwidth if self.store is not None else 1.0,
            "ssd_write_bandwidth": self.ssd_write_bandwidth if self.store is not None else 1.0,
            "host_memory": self.host_memory_bytes,
            "ssd_shared": self.ssd_shared,
            # Every SSD-tier transfer is staged through pinned host memory (executor, state).
            "ssd_via_host_link": True,
        }

    def _plan_trace(self, trace: dict[str, Any], movable: list[str]) -> dict[str, Any]:
        return plan(
            trace,
            **self._hardware(),
            host_link_bandwidth=self.host_link_bandwidth,
            reserve=self.reserve_bytes,
            movable_kinds=movable,
            tier_preference=self.tier_preference,
            prefetch_slack=self.prefetch_slack,
        )

    def _plan_with_recompute(
        self,
        trace: dict[str, Any],
        profiler: Profiler,
        movable: list[str],
        events: list[SaveEvent],
        checkpointed: set[str],
    ) -> tuple[tuple[float, ...], _Planned]:
        """Plans the trace with the recipes `recompute` allows and, in "auto", with each of
        `rc.AUTO_COST_RATIOS` and without any; returns the rank (`_rank`) and the plan that holds
        up best, the trace it was made for, its recipes and need events. Recipes that read or
        make a tensor inside a `checkpointed` block are left out (checkpoint remakes those)."""
        summary: dict[str, Any] = {"mode": self.recompute, "candidates": 0}
        if self.recompute == "off":
            result = self._plan_trace(trace, movable)
            self.recompute_summary = summary
            return self._rank(trace, result), (result, trace, {}, None)
        durations = [op["duration_us"] for op in trace["ops"]]
        link = parse_bandwidth(self.host_link_bandwidth)
        packed = {e.tensor_id for e in events if e.kind == "pack"}
        # (cost ratio or None for "every one") -> recipes; equal sets are planned once.
        ratios: list[Optional[float]] = [None] if self.recompute == "on" else list(rc.AUTO_COST_RATIOS)
        options: list[tuple[tuple[float, ...], _Planned]] = []
        tried: list[frozenset[int]] = []
        summary["tried"] = []
        for ratio in ratios:
            recipes = rc.find_recipes(
                profiler,
                durations,
                min_bytes=self.min_bytes,
                link_bandwidth=None if ratio is None else link,
                cost_ratio=ratio or 0.0,
                allow_weights=not self.offload_parameters,
            )
            recipes = {
                t: r for t, r in recipes.items() if t in packed and _recipe_outside(r, packed, checkpointed)
            }
            if not recipes or frozenset(recipes) in tried:
                continue
            tried.append(frozenset(recipes))
            recompute_trace, applied, need = rc.apply_to_trace(trace, events, recipes)
            result = self._plan_trace(recompute_trace, movable)
            rank = self._rank(recompute_trace, result)
            summary["tried"].append(
                {
                    "cost_ratio": ratio,
                    "tensors": len(applied),
                    "bytes": sum(r.size_bytes for r in applied.values()),
                    "cost_ms": sum(r.cost_us for r in applied.values()) / 1e3,
                    "predicted_ms": _predicted_ms(result),
                    "predicted_ms_slow_link": _slow_link_ms(rank),
                }
            )
            options.append((rank, (result, recompute_trace, applied, need)))
        summary["candidates"] = max((t["tensors"] for t in summary["tried"]), default=0)
        without = self._plan_trace(trace, movable)
        without_rank = self._rank(trace, without)
        if not options:
            self.recompute_summary = summary
            return without_rank, (without, trace, {}, None)
        best_index = min(range(len(options)), key=lambda index: options[index][0])
        best_rank, best = options[best_index]
        summary["predicted_ms_with"] = _predicted_ms(best[0])
        for entry in summary["tried"]:
            entry["chosen"] = False
        if self.recompute == "auto":
            summary["predicted_ms_without"] = _predicted_ms(without)
            summary["predicted_ms_without_slow_link"] = _slow_link_ms(without_rank)
            if without_rank <= best_rank:
                summary["chosen"] = False
                self.recompute_summary = summary
                return without_rank, (without, trace, {}, None)
        summary["tried"][best_index]["chosen"] = True
        summary["chosen"] = True
        summary["tensors"] = len(best[2])
        summary["bytes"] = sum(r.size_bytes for r in best[2].values())
        self.recompute_summary = summary
        return best_rank, best

    def _rank(self, trace: dict[str, Any], result: dict[str, Any]) -> tuple[float, ...]:
        """Orders plans: one that fits first; then the simulated time on a link at
        `SLOW_LINK_FACTOR` of the planned bandwidth; then the planned prediction.

        Why the slow link: several plans often predict a stall-free iteration at the planned
        bandwidth, yet on the machine the one that leans on the link most runs slowest (plans
        predicted within 1% of each other have run up to 13% apart, in the order of their link
        bytes). Recomputation time is measured op time, the link's
        share under training is not; the plan that still holds up on a slower link is kept.
        """
        predicted = _predicted_ms(result)
        if predicted is None:
            return (1.0, 0.0, 0.0)
        slow = simulate(
            trace,
            result["plan"],
            **self._hardware(),
            host_link_bandwidth=parse_bandwidth(self.host_link_bandwidth) * SLOW_LINK_FACTOR,
        )
        completed = slow["outcome"]["status"] == "completed"
        return (0.0, slow["iteration_time_us"] / 1e3 if completed else float("inf"), predicted)

    def _install_sources(self, profiler: Profiler, recipes: dict[int, rc.Recipe]) -> None:
        """Gives the executor the parameters recipes read and hooks the modules whose inputs
        they read (captured each planned iteration, at the same call and argument position)."""
        sources = {source for recipe in recipes.values() for source in recipe.sources}
        weight_ids = {s.tensor_id for s in sources if s.kind == "weight"}
        if weight_ids:
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                record = profiler.lookup(tensor)
                if record is not None and record.id in weight_ids:
                    self.executor.weight_sources[record.id] = tensor
        wanted: dict[str, dict[int, list[tuple[int, rc.Source]]]] = {}
        for source in sources:
            if source.kind == "arg":
                name, call, position = source.key
                wanted.setdefault(name, {}).setdefault(call, []).append((position, source))
        for name, module in self.model.named_modules():
            if name in wanted:
                capture = self._capture_inputs(name, wanted[name])
                self._arg_hooks.append(module.register_forward_pre_hook(capture, with_kwargs=True))

    def _capture_inputs(self, name: str, by_call: dict[int, list[tuple[int, rc.Source]]]) -> Any:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if torch._C._current_autograd_node() is not None:
                return  # a checkpointed block's forward again in backward
            call = self._module_calls.get(name, 0)
            self._module_calls[name] = call + 1
            wanted = by_call.get(call)
            if not wanted:
                return
            flat = tree_flatten((args, kwargs))[0]
            for position, source in wanted:
                if position < len(flat) and isinstance(flat[position], torch.Tensor):
                    self.executor.capture(source, flat[position])

        return hook

    # -- report --------------------------------------------------------------------------------

    def report(self) -> TensorReport:
        """Predicted vs measured iteration time, stalls, bytes per tier, peak memory."""
        planned_times = []
        planned_peaks = []
        if self._planned_from_step is not None:
            planned_times = self._step_times_ms[self._planned_from_step :]
            planned_peaks = self._peaks[self._planned_from_step :]
        prediction = dict((self.plan_result or {}).get("prediction", {}))
        if prediction and not self.plan_result["plan"]["fits"]:
            # The planner predicts nothing for a plan that does not fit (it reports zeros).
            for key in ("iteration_time_us", "percent_of_ideal", "peak_gpu_bytes"):
                prediction.pop(key, None)
        stats = self.executor.stats.as_dict()
        count = max(1, len(planned_times))
        per_iteration = _per_iteration(stats, self._stats_at_plan, count)
        state = self.state.stats.as_dict()
        state_per_iteration = _per_iteration(state, self._state_stats_at_plan, count)
        params = self.params.stats.as_dict()
        param_per_iteration = _per_iteration(params, self._param_stats_at_plan, count)
        stall_keys = (
            "prefetches_on_demand",
            "prefetches_planned",
            "ssd_wait_s",
            "inflight_waits",
            "inflight_wait_s",
        )
        stalls = {k: stats[k] - (self._stats_at_plan or {}).get(k, 0) for k in stall_keys}
        stalls["plan_mismatches"] = stats["plan_mismatches"]
        stalls["event_misalignments"] = stats["event_misalignments"]
        for key in ("emergency_offloads", "emergency_offloaded_bytes", "prefetches_deferred", "memory_waits"):
            stalls[key] = stats[key] - (self._stats_at_plan or {}).get(key, 0)
        if self.device.type == "cuda" and self._planned_from_step is not None:
            stalls["allocator_retries"] = self._allocator_retries() - self._alloc_retries_at_plan
        for key in ("prefetches_on_demand", "step_wait_s"):
            stalls[f"state_{key}"] = state[key] - (self._state_stats_at_plan or {}).get(key, 0)
        if self.offload_parameters:
            for key in ("prefetches_planned", "prefetches_on_demand"):
                stalls[f"parameter_{key}"] = params[key] - (self._param_stats_at_plan or {}).get(key, 0)
        summary: dict[str, Any] = {}
        if self.plan_result is not None:
            migrations = self.plan_result["plan"]["migrations"]
            summary = {
                "recomputed_tensors": self.recompute_summary.get("tensors", 0),
                "recompute": self.recompute_summary,
                "migrations": len(migrations),
                "host_migrations": sum(1 for m in migrations if m["tier"] == HOST),
                "ssd_migrations": sum(1 for m in migrations if m["tier"] == SSD),
                "fits": self.plan_result["plan"]["fits"],
                "outcome": prediction.get("outcome"),
                "planning_time_ms": prediction.get("planning_time_ms"),
                # Calibrating, building the trace and planning every candidate, host seconds (in
                # the step that ends the calibration iteration).
                "planning_s": getattr(self, "planning_s", None),
                "ops": len(self.trace["ops"]) if self.trace else None,
                "tensors": len(self.trace["tensors"]) if self.trace else None,
            }
        ideal_ms = sum(op["duration_us"] for op in self.trace["ops"]) / 1e3 if self.trace else None
        predicted_ms = prediction["iteration_time_us"] / 1e3 if "iteration_time_us" in prediction else None
        measured_ms = statistics.median(planned_times) if planned_times else None
        hooks_ms = self._host_summary(stats, count)
        source = self.calibration.describe()
        if self.op_time_scale != 1.0:
            source += f", times op_time_scale {self.op_time_scale}"
        return TensorReport(
            steps=self.step,
            planned_steps=len(planned_times),
            ideal_iteration_ms=ideal_ms,
            predicted_percent_of_ideal=(ideal_ms / predicted_ms * 100) if ideal_ms and predicted_ms else None,
            step_times_ms=list(self._step_times_ms),
            peak_gpu_bytes=max(planned_peaks) if planned_peaks else None,
            predicted_peak_bytes=prediction.get("peak_gpu_bytes"),
            unplanned_peak_bytes=prediction.get("unplanned_peak_bytes"),
            gpu_memory_bytes=self.gpu_memory_bytes,
            bytes_per_iteration=per_iteration,
            stalls=stalls,
            plan_summary=summary,
            state_bytes_per_iteration=state_per_iteration,
            parameter_bytes_per_iteration=param_per_iteration,
            phases_ms=self._phases_summary(),
            host_ms_per_iteration=hooks_ms,
            recomputed_bytes_per_iteration=(
                stats["recomputed_bytes"] - (self._stats_at_plan or {}).get("recomputed_bytes", 0)
            )
            // count,
            ideal_source=source,
            profiled_ops_ms=getattr(self, "profiled_ops_us", 0.0) / 1e3 if self.trace else None,
            **prediction_fields(measured_ms, predicted_ms),
            checkpointed_blocks=list(self.checkpoint_blocks),
            checkpoint_summary=self.checkpoint_summary,
            machine=dict(self.machine),
            host_percent_of_ideal=(hooks_ms["hooks"] / ideal_ms * 100) if hooks_ms and ideal_ms else None,
            host_step=self.host_step.report() if self.host_step is not None else {},
        )

    def _host_summary(self, stats: dict[str, Any], count: int) -> dict[str, float]:
        if self._planned_from_step is None:
            return {}
        base = self._stats_at_plan or {}

        def per_iteration_ms(now: dict[str, Any], before: dict[str, Any], key: str) -> float:
            return (now[key] - before.get(key, 0.0)) * 1e3 / count

        return {
            "hooks": per_iteration_ms(stats, base, "hook_s"),
            "of which copy waits": per_iteration_ms(stats, base, "inflight_wait_s"),
            "of which SSD waits": per_iteration_ms(stats, base, "ssd_wait_s"),
            "of which recompute": per_iteration_ms(stats, base, "recompute_s"),
            "before step": per_iteration_ms(self._host_s, self._host_s_at_plan, "before_step"),
            "after step": per_iteration_ms(self._host_s, self._host_s_at_plan, "after_step"),
        }

    def _phases_summary(self) -> dict[str, dict[str, float]]:
        if self._planned_from_step is None or self.trace is None:
            return {}
        planned = self.phase_times_ms()[self._planned_from_step :]
        profiled: dict[str, float] = {}
        for op in self.trace["ops"]:
            phase = {"optimizer": "step", "other": "step"}.get(op["phase"], op["phase"])
            profiled[phase] = profiled.get(phase, 0.0) + op["duration_us"] / 1e3
        summary = {}
        for name in ("between", "forward", "backward", "step"):
            values = [times[name] for times in planned if name in times]
            if values:
                summary[name] = {"measured": statistics.median(values), "profiled": profiled.get(name, 0.0)}
        return summary


def _recipe_outside(recipe: rc.Recipe, packed: set[Optional[int]], checkpointed: set[str]) -> bool:
    """Whether a recipe reads only tensors the runtime will still see saved, and no module input
    captured inside a checkpointed block (its calls there repeat in backward)."""
    for source in recipe.sources:
        if source.kind == "saved" and source.tensor_id not in packed:
            return False
        if source.kind == "arg":
            module = source.key[0]
            if any(module == name or module.startswith(name + ".") for name in checkpointed):
                return False
    return True


def _predicted_ms(result: dict[str, Any]) -> Optional[float]:
    prediction = result.get("prediction", {})
    if not result["plan"]["fits"] or "iteration_time_us" not in prediction:
        return None
    return prediction["iteration_time_us"] / 1e3


def _slow_link_ms(rank: tuple[float, ...]) -> Optional[float]:
    return rank[1] if rank[0] == 0.0 and rank[1] != float("inf") else None


def _per_iteration(
    stats: dict[str, Any], base: Optional[dict[str, Any]], count: int
) -> dict[str, dict[str, int]]:
    """Bytes moved per planned iteration, per direction and tier, from two counter snapshots."""
    out: dict[str, dict[str, int]] = {}
    for direction, key in (("offloaded", "offloaded_bytes"), ("prefetched", "prefetched_bytes")):
        before = (base or {}).get(key, {})
        out[direction] = {t: (stats[key][t] - before.get(t, 0)) // count for t in (HOST, SSD)}
    return out
