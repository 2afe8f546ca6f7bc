"""`teraio.offload`: profile, plan and offload around an unchanged training loop.

```
with teraio.offload(model, optimizer, store=store, gpu_memory="24GiB", host_memory="64GiB") as run:
    for batch in loader:
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
print(run.report())
```

Iterations end at `optimizer.step()`. The first `warmup_steps` iterations run with the fallback
policy (every saved activation of at least `min_bytes` to host memory up to `host_memory`, then to
the SSD tier) so that they fit before there is a plan; the next one runs the same way under the
profiler; then the trace is planned and the following iterations run the plan.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch.utils._pytree import tree_flatten

from . import recompute as rc
from .executor import HOST, RECOMPUTE, SSD, ActivationExecutor, PackDecision
from .planning import _bandwidth, parse_size, plan, simulate
from .profiler import Profiler, SaveEvent
from .state import Move, StateExecutor, pin_outside_forward_gap, pin_within_iteration
from .store import Store

#: recompute="auto" ranks its plans by their simulated time on a host link this fraction of the
#: planned bandwidth (`Offload._rank` says why).
SLOW_LINK_FACTOR = 0.85

#: A plan, the trace it was made for, its recipes (by tensor id) and their need events.
_Planned = tuple[dict[str, Any], dict[str, Any], dict[int, rc.Recipe], Optional[dict[int, int]]]


@dataclass
class Report:
    """What an offload run did: predicted vs measured iteration time, stalls, traffic, peak."""

    steps: int
    planned_steps: int
    ideal_iteration_ms: Optional[float]
    predicted_iteration_ms: Optional[float]
    predicted_percent_of_ideal: Optional[float]
    measured_iteration_ms: Optional[float]
    step_times_ms: list[float]
    peak_gpu_bytes: Optional[int]
    predicted_peak_bytes: Optional[int]
    unplanned_peak_bytes: Optional[int]
    gpu_memory_bytes: int
    bytes_per_iteration: dict[str, dict[str, int]]
    stalls: dict[str, Any]
    plan_summary: dict[str, Any] = field(default_factory=dict)
    #: Optimizer state moved between steps, per iteration: {"offloaded"|"prefetched": {tier: bytes}}.
    state_bytes_per_iteration: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Parameters moved between the passes, per iteration (same shape).
    parameter_bytes_per_iteration: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Median of the planned iterations, ms: {"forward"|"backward"|"step": {"measured", "profiled"}},
    #: and "between" (from one step's end to the next forward pass; the profile has no ops there).
    phases_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Host time inside teraio per planned iteration, ms: the saved-tensor hooks (and of that,
    #: waits for device-to-host copies in flight and for SSD reads/writes), before and after the
    #: step. Host time the GPU did not wait for costs nothing; a blocked host that lets the GPU
    #: run dry does.
    host_ms_per_iteration: dict[str, float] = field(default_factory=dict)
    #: Saved activations dropped at the save and recomputed in backward, per planned iteration.
    recomputed_bytes_per_iteration: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    def __str__(self) -> str:
        def ms(value: Optional[float]) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        def gib(value: Optional[int]) -> str:
            if value is None:
                return "-"
            return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"

        lines = [
            f"teraio offload: {self.steps} steps, {self.planned_steps} with the plan",
            f"  iteration: measured {ms(self.measured_iteration_ms)} (median of planned steps), "
            f"predicted {ms(self.predicted_iteration_ms)}, "
            f"ideal (profiled op times) {ms(self.ideal_iteration_ms)}",
            f"  peak GPU memory: measured {gib(self.peak_gpu_bytes)}, "
            f"planned {gib(self.predicted_peak_bytes)}, "
            f"without offload {gib(self.unplanned_peak_bytes)}, budget {gib(self.gpu_memory_bytes)}",
        ]
        for direction, tiers in self.bytes_per_iteration.items():
            lines.append(
                f"  {direction} per iteration: host {gib(tiers.get(HOST, 0))}, ssd {gib(tiers.get(SSD, 0))}"
                " (activations)"
            )
        if self.recomputed_bytes_per_iteration:
            lines.append(
                f"  recomputed per iteration: {gib(self.recomputed_bytes_per_iteration)} "
                f"({self.plan_summary.get('recomputed_tensors', 0)} saved tensors, not moved)"
            )
        for label, moved in (
            ("optimizer state", self.state_bytes_per_iteration),
            ("parameters", self.parameter_bytes_per_iteration),
        ):
            for direction, tiers in moved.items():
                if label == "parameters" and not any(tiers.values()):
                    continue
                host, ssd = gib(tiers.get(HOST, 0)), gib(tiers.get(SSD, 0))
                lines.append(f"  {direction} per iteration: host {host}, ssd {ssd} ({label})")
        if self.phases_ms:
            lines.append(
                "  phases: "
                + ", ".join(
                    f"{name} {v['measured']:.1f} ms (profiled ops {v['profiled']:.1f} ms)"
                    for name, v in self.phases_ms.items()
                )
            )
        if self.host_ms_per_iteration:
            lines.append(
                "  host time in teraio per iteration: "
                + ", ".join(f"{name} {v:.1f} ms" for name, v in self.host_ms_per_iteration.items())
            )
        if self.plan_summary.get("fits") is False:
            lines.append(f"  plan: does not fit the budget ({self.plan_summary.get('outcome')})")
        lines.append("  stalls: " + ", ".join(f"{k} {v}" for k, v in self.stalls.items()))
        return "\n".join(lines)


class offload:
    """Offloads a model's activations per a lifetime plan; see the module docstring.

    Args:
        model, optimizer: the model being trained and its optimizer (iterations end at its step).
        store: the SSD tier (a `teraio.Store`); None: host memory only.
        gpu_memory: GPU memory the iterations must fit in (bytes or "24GiB"); default: the
            device's memory.
        host_memory: pinned host memory the plan may use.
        ssd_bandwidth / host_link_bandwidth: what the planner assumes (bytes/s or "6GB/s").
        reserve: GPU memory the planner keeps free for allocator slack (default 10% of gpu_memory).
        warmup_steps: iterations before the profiled one (default 1: optimizer state exists then;
            2 for a `DistributedDataParallel` model, whose second iteration rebuilds its
            gradient buckets, one-off work that must not be planned for).
        min_bytes: saved tensors smaller than this stay on the GPU.
        max_inflight_bytes: device-to-host copy bytes in flight before a save waits for the
            oldest (their GPU memory is freed only once they land; default 2 GiB).
        ssd_shared: the store's reads and writes share its devices' time (e.g. one disk, or
            several ranks on one): the planner then splits each slot's SSD time between them.
        prefetch_slack: the planner issues prefetches earlier by up to this multiple of their
            transfer time where memory has room (default 1.0).
        op_time_scale: multiplies the profiled op times before planning (the profiler's own
            per-op cost makes short ops look longer than they run; default 1.0).
        offload_optimizer_state: let the plan also move optimizer state between steps (default
            True; the planner moves it only where that pays).
        offload_parameters: let the plan also move parameters between their last forward use
            and their first backward use (default False: tested on the CPU device only so far).
        tier_preference: the tier the planner fills first when a period fits both: "auto" (the
            default: plan both ways, keep the one the simulator predicts faster), "host" or
            "ssd" (the paper's order). The planner always counts SSD transfers against the host
            link too, because this runtime stages them through pinned host memory.
        recompute: saved activations that cheap, deterministic ops can make again from tensors
            backward has anyway are dropped at the save and recomputed when backward needs
            them (teraio.recompute): "auto" (the default: the planner is run with the tensors
            whose ops cost at most each of `recompute.AUTO_COST_RATIOS` (25% ... 4%) of moving
            their bytes one way over the host link, and with none; the plan the simulator
            predicts fastest on a link at `SLOW_LINK_FACTOR` (85%) of `host_link_bandwidth` is
            kept), "on" (every one that can be remade exactly, always) or "off". Results stay
            bitwise equal.
        copy_streams: CUDA streams the activation prefetches spread over (default 2).
        pull_forward_bytes: prefetch bytes per event that may be issued earlier than planned so
            that they do not queue behind a copy needed later, while GPU memory has room (default
            512 MiB; 0: as planned).
        trace_path / plan_path: where to write the trace and the plan (JSON), if given.
        sync_each_step: synchronize the device after each step (default False: the copies
            issued at the step, such as optimizer state going out, then overlap with the next
            forward pass).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        store: Optional[Store] = None,
        gpu_memory: Optional[Union[int, str]] = None,
        host_memory: Union[int, str] = 0,
        ssd_bandwidth: Union[float, str] = 6.5e9,
        ssd_write_bandwidth: Optional[Union[float, str]] = None,
        host_link_bandwidth: Union[float, str] = 25e9,
        reserve: Optional[Union[int, str]] = None,
        warmup_steps: Optional[int] = None,
        min_bytes: int = 1 << 20,
        max_inflight_bytes: Union[int, str] = 2 << 30,
        trace_path: Optional[str] = None,
        plan_path: Optional[str] = None,
        sync_each_step: bool = False,
        offload_optimizer_state: bool = True,
        ssd_shared: bool = False,
        prefetch_slack: float = 1.0,
        op_time_scale: float = 1.0,
        offload_parameters: bool = False,
        copy_streams: int = 2,
        pull_forward_bytes: Union[int, str] = 512 << 20,
        tier_preference: str = "auto",
        recompute: str = "auto",
    ) -> None:
        first = next(iter(model.parameters()))
        self.device = first.device
        self.model = model
        self.optimizer = optimizer
        self.store = store
        if gpu_memory is None:
            if self.device.type == "cuda":
                gpu_memory = int(torch.cuda.get_device_properties(self.device).total_memory)
            else:
                raise ValueError("gpu_memory is required on a CPU device")
        self.gpu_memory_bytes = parse_size(gpu_memory)
        self.host_memory_bytes = parse_size(host_memory)
        self.reserve_bytes = parse_size(reserve) if reserve is not None else self.gpu_memory_bytes // 10
        self.ssd_bandwidth = ssd_bandwidth
        self.ssd_write_bandwidth = ssd_write_bandwidth
        self.host_link_bandwidth = host_link_bandwidth
        if warmup_steps is None:
            ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
            warmup_steps = 2 if ddp else 1
        self.warmup_steps = warmup_steps
        self.trace_path = trace_path
        self.plan_path = plan_path
        self.sync_each_step = sync_each_step
        skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.executor = ActivationExecutor(
            self.device,
            store=store,
            host_memory_bytes=self.host_memory_bytes,
            min_bytes=min_bytes,
            max_inflight_bytes=parse_size(max_inflight_bytes),
            skip_storages=skip,
            gpu_memory_bytes=self.gpu_memory_bytes,
            copy_streams=copy_streams,
            pull_forward_bytes=parse_size(pull_forward_bytes),
        )
        self.offload_optimizer_state = offload_optimizer_state
        self.ssd_shared = ssd_shared
        self.prefetch_slack = prefetch_slack
        self.op_time_scale = op_time_scale
        if tier_preference not in ("auto", "host", "ssd"):
            raise ValueError(f'tier_preference must be "auto", "host" or "ssd", not {tier_preference!r}')
        self.tier_preference = tier_preference
        if recompute not in rc.MODES:
            raise ValueError(f'recompute must be "auto", "on" or "off", not {recompute!r}')
        self.recompute = recompute
        self.min_bytes = min_bytes
        # Per planned iteration: calls of each module whose inputs recipes read, and what to keep.
        self._module_calls: dict[str, int] = {}
        self._arg_hooks: list[Any] = []
        self.recompute_summary: dict[str, Any] = {}
        self.state = StateExecutor(
            self.device,
            store=store,
            d2h_stream=getattr(self.executor, "d2h_stream", None),
            h2d_stream=getattr(self.executor, "h2d_stream", None),
        )
        self.offload_parameters = offload_parameters
        self.params = StateExecutor(
            self.device,
            store=store,
            object_id_base=1 << 42,
            d2h_stream=getattr(self.executor, "d2h_stream", None),
            h2d_stream=getattr(self.executor, "h2d_stream", None),
        )
        self.executor.on_event = self._on_event
        self.executor.on_backward = lambda: self._mark("backward")
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
        self._hooks: list[Any] = []
        self._saved_hooks: Any = None
        self._step_started = 0.0
        self._step_times_ms: list[float] = []
        self._planned_from_step: Optional[int] = None
        self._peaks: list[int] = []
        # The CUDA caching allocator's retries (it hit the cap, freed its cache, which waits for
        # the device, and tried again) when the plan was installed.
        self._alloc_retries_at_plan = 0
        self._stats_at_plan: Optional[dict[str, Any]] = None
        self._state_stats_at_plan: Optional[dict[str, Any]] = None
        self._param_stats_at_plan: Optional[dict[str, Any]] = None

    # -- context -------------------------------------------------------------------------------

    def __enter__(self) -> offload:
        self._hooks.append(self.optimizer.register_step_pre_hook(self._before_step))
        self._hooks.append(self.optimizer.register_step_post_hook(self._after_step))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self.executor.pack, self.executor.unpack)
        self._saved_hooks.__enter__()
        self._begin_iteration()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.profiler is not None and self.profiler._mode is not None:
            self.profiler.stop()
        self.executor.profiler = None
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        for hook in self._hooks + self._arg_hooks:
            hook.remove()
        self._hooks.clear()
        self._arg_hooks.clear()
        self.executor.end_iteration()
        self.executor.close()
        self.state.close()
        self.params.close()

    # -- iteration boundaries ------------------------------------------------------------------

    def _begin_iteration(self) -> None:
        self.executor.begin_iteration()
        self._module_calls.clear()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.step == self.warmup_steps and self.trace is None:
            self.profiler = Profiler(self.model, self.optimizer, install_hooks=False, device=self.device)
            self.executor.profiler = self.profiler
            self.profiler.start()
        self._step_started = time.perf_counter()
        previous_end = self._marks.get("end")
        self._marks = {} if previous_end is None else {"previous_end": previous_end}
        self._mark("forward")

    def _on_event(self, event_index: int) -> None:
        self.state.on_event(event_index)
        self.params.on_event(event_index)

    def _mark(self, name: str) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._marks[name] = event
        else:
            self._marks[name] = time.perf_counter()

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
                first, second = marks[a], marks[b]
                name = "between" if a == "previous_end" else a
                if isinstance(first, float):
                    times[name] = (second - first) * 1e3
                else:
                    second.synchronize()
                    times[name] = float(first.elapsed_time(second))
            self._phase_times.append(times)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._mark("step")
        started = time.perf_counter()
        self.params.before_step()
        self.state.before_step()
        self._host_s["before_step"] += time.perf_counter() - started
        if self.profiler is not None and self.profiler._mode is not None:
            self.profiler.before_step()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._mark("end")
        self._phase_marks.append(self._marks)
        self._collect_phases(wait=False)
        started = time.perf_counter()
        self.state.after_step()
        self.executor.end_iteration()
        self._host_s["after_step"] += time.perf_counter() - started
        if self.sync_each_step and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._step_times_ms.append((time.perf_counter() - self._step_started) * 1e3)
        if self.device.type == "cuda":
            self._peaks.append(int(torch.cuda.max_memory_allocated(self.device)))
        if self.profiler is not None and self.profiler._mode is not None:
            self.profiler.after_step()
            self.profiler.stop()
            self.executor.profiler = None
            self._make_plan(self.profiler)
            self._planned_from_step = self.step + 1
            self._stats_at_plan = self.executor.stats.as_dict()
            self._state_stats_at_plan = self.state.stats.as_dict()
            self._param_stats_at_plan = self.params.stats.as_dict()
            self.state.after_step()
            self._host_s_at_plan = dict(self._host_s)
            self._alloc_retries_at_plan = self._alloc_retries()
        self.step += 1
        self._begin_iteration()

    def _alloc_retries(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    # -- planning ------------------------------------------------------------------------------

    def _make_plan(self, profiler: Profiler) -> None:
        trace = profiler.trace(gpu_capacity_bytes=self.gpu_memory_bytes, description="teraio.offload profile")
        self.trace = trace
        if self.trace_path:
            with open(self.trace_path, "w") as f:
                json.dump(trace, f)
        if self.op_time_scale != 1.0:
            for op in trace["ops"]:
                op["duration_us"] *= self.op_time_scale
        movable = ["activation"]
        if self.offload_optimizer_state:
            # Optimizer state may move only between steps (see teraio.state).
            pin_within_iteration(trace, "optimizer_state")
            movable.append("optimizer_state")
        if self.offload_parameters:
            # Parameters may move only between the two passes (see teraio.state).
            pin_outside_forward_gap(trace, "weight")
            movable.append("weight")
        result, planned_trace, recipes, need = self._plan_with_recompute(trace, profiler, movable)
        if self.store is None:
            for migration in result["plan"]["migrations"]:
                if migration["tier"] == SSD:
                    migration["tier"] = HOST
        self.plan_result = result
        if self.plan_path:
            with open(self.plan_path, "w") as f:
                json.dump(result, f)
        self.state.set_plan(state_moves_from_plan(planned_trace, profiler, result["plan"]))
        self.params.set_plan(parameter_moves_from_plan(planned_trace, profiler, result["plan"]))
        held = self.state.planned_bytes(HOST) + self.params.planned_bytes(HOST)
        self.executor.host_memory_bytes = max(0, self.host_memory_bytes - held)
        self._install_sources(profiler, recipes)
        decisions = decisions_from_plan(planned_trace, profiler.events, result["plan"], recipes, need)
        self.executor.set_plan(decisions)

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

    def _plan_with_recompute(self, trace: dict[str, Any], profiler: Profiler, movable: list[str]) -> _Planned:
        """Plans the trace with the recipes `recompute` allows and, in "auto", with each of
        `rc.AUTO_COST_RATIOS` and without any; returns the plan that holds up best (`_rank`),
        the trace it was made for, its recipes and need events."""
        summary: dict[str, Any] = {"mode": self.recompute, "candidates": 0}
        self.recompute_summary = summary
        if self.recompute == "off":
            return self._plan_trace(trace, movable), trace, {}, None
        durations = [op["duration_us"] for op in trace["ops"]]
        link = _bandwidth(self.host_link_bandwidth)
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
            if not recipes or frozenset(recipes) in tried:
                continue
            tried.append(frozenset(recipes))
            recompute_trace, applied, need = rc.apply_to_trace(trace, profiler.events, recipes)
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
        if not options:
            return self._plan_trace(trace, movable), trace, {}, None
        best_index = min(range(len(options)), key=lambda index: options[index][0])
        best_rank, best = options[best_index]
        summary["predicted_ms_with"] = _predicted_ms(best[0])
        for entry in summary["tried"]:
            entry["chosen"] = False
        if self.recompute == "auto":
            without = self._plan_trace(trace, movable)
            without_rank = self._rank(trace, without)
            summary["predicted_ms_without"] = _predicted_ms(without)
            summary["predicted_ms_without_slow_link"] = _slow_link_ms(without_rank)
            if without_rank <= best_rank:
                summary["chosen"] = False
                return without, trace, {}, None
        summary["tried"][best_index]["chosen"] = True
        summary["chosen"] = True
        summary["tensors"] = len(best[2])
        summary["bytes"] = sum(r.size_bytes for r in best[2].values())
        return best

    def _rank(self, trace: dict[str, Any], result: dict[str, Any]) -> tuple[float, ...]:
        """Orders plans for "auto": one that fits first; then the simulated time on a link at
        `SLOW_LINK_FACTOR` of the planned bandwidth; then the planned prediction.

        Why the slow link: several plans often predict a stall-free iteration at the planned
        bandwidth, yet on the machine the one that leans on the link most runs slowest (H100:
        15.6, 17.2 and 18.5 GiB per iteration over the link took 1151, 1196 and 1298 ms, all
        predicted within 1% of each other). Recomputation time is measured op time, the link's
        share under training is not; the plan that still holds up on a slower link is kept.
        """
        predicted = _predicted_ms(result)
        if predicted is None:
            return (1.0, 0.0, 0.0)
        slow = simulate(
            trace,
            result["plan"],
            **self._hardware(),
            host_link_bandwidth=_bandwidth(self.host_link_bandwidth) * SLOW_LINK_FACTOR,
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
                record = profiler._lookup(tensor)
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

    def report(self) -> Report:
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
        if self.device.type == "cuda" and self._planned_from_step is not None:
            stalls["allocator_retries"] = self._alloc_retries() - self._alloc_retries_at_plan
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
                "ops": len(self.trace["ops"]) if self.trace else None,
                "tensors": len(self.trace["tensors"]) if self.trace else None,
            }
        return Report(
            steps=self.step,
            planned_steps=len(planned_times),
            ideal_iteration_ms=prediction.get("ideal_time_us", 0) / 1e3 if prediction else None,
            predicted_iteration_ms=(
                prediction["iteration_time_us"] / 1e3 if "iteration_time_us" in prediction else None
            ),
            predicted_percent_of_ideal=prediction.get("percent_of_ideal"),
            measured_iteration_ms=statistics.median(planned_times) if planned_times else None,
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
            host_ms_per_iteration=self._host_summary(stats, count),
            recomputed_bytes_per_iteration=(
                stats["recomputed_bytes"] - (self._stats_at_plan or {}).get("recomputed_bytes", 0)
            )
            // count,
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


def _predicted_ms(result: dict[str, Any]) -> Optional[float]:
    prediction = result.get("prediction", {})
    if not result["plan"]["fits"] or "iteration_time_us" not in prediction:
        return None
    return prediction["iteration_time_us"] / 1e3


def _slow_link_ms(rank: tuple[float, ...]) -> Optional[float]:
    return rank[1] if rank[0] == 0.0 and rank[1] != float("inf") else None


def decisions_from_plan(
    trace: dict[str, Any],
    events: list[SaveEvent],
    plan_doc: dict[str, Any],
    recipes: Optional[dict[int, rc.Recipe]] = None,
    need: Optional[dict[int, int]] = None,
) -> list[PackDecision]:
    """Maps a plan's activation migrations onto the profiled save/unpack events.

    The runtime sees the iteration through `saved_tensors_hooks` events, which come in the same
    order every iteration: pack `i` of the profiled iteration is pack `i` of each later one. A
    tensor's offload starts at its first pack; its prefetch is issued at the last event whose next
    op is at or before the planned prefetch op (and never after the event where backward first
    needs it: its first unpack, or `need`'s earlier event where a recipe reads it). A tensor in
    `recipes` is recomputed instead.
    """
    recipes = recipes or {}
    sizes = {t["id"]: t["size_bytes"] for t in trace["tensors"]}
    kinds = {t["id"]: t["kind"] for t in trace["tensors"]}
    best: dict[int, dict[str, Any]] = {}
    for migration in plan_doc["migrations"]:
        tensor_id = migration["tensor_id"]
        if kinds.get(tensor_id) != "activation":
            continue
        span = migration["next_use_op"] - migration["offload_op"]
        current = best.get(tensor_id)
        if current is None or span > current["next_use_op"] - current["offload_op"]:
            best[tensor_id] = migration
    first_pack_event, first_unpack_event = rc.first_events(events)
    pack_events = [e for e in events if e.kind == "pack"]
    decisions: list[PackDecision] = []
    seen: set[int] = set()
    for event in pack_events:
        tensor_id = event.tensor_id
        size = sizes.get(tensor_id, -1) if tensor_id is not None else -1
        migration = best.get(tensor_id) if tensor_id is not None else None
        if tensor_id is not None and tensor_id in recipes and tensor_id not in seen:
            seen.add(tensor_id)
            decisions.append(PackDecision(tensor_id, size, RECOMPUTE, recipe=recipes[tensor_id]))
            continue
        if tensor_id is None or migration is None or tensor_id in seen:
            decisions.append(PackDecision(tensor_id, size, None))
            continue
        seen.add(tensor_id)
        pack_at = first_pack_event[tensor_id]
        limit = (need or {}).get(tensor_id, first_unpack_event.get(tensor_id, len(events) - 1))
        trigger = pack_at + 1
        for index in range(pack_at + 1, limit + 1):
            if events[index].next_op <= migration["prefetch_op"]:
                trigger = index
            else:
                break
        prefetch_event = min(trigger, limit)
        decisions.append(
            PackDecision(
                tensor_id, size, migration["tier"], prefetch_event, need_event=limit, pack_event=pack_at
            )
        )
    return decisions


def _per_iteration(
    stats: dict[str, Any], base: Optional[dict[str, Any]], count: int
) -> dict[str, dict[str, int]]:
    """Bytes moved per planned iteration, per direction and tier, from two counter snapshots."""
    out: dict[str, dict[str, int]] = {}
    for direction, key in (("offloaded", "offloaded_bytes"), ("prefetched", "prefetched_bytes")):
        before = (base or {}).get(key, {})
        out[direction] = {t: (stats[key][t] - before.get(t, 0)) // count for t in (HOST, SSD)}
    return out


def _last_event_at_or_before(events: list[SaveEvent], op: int) -> Optional[int]:
    """The last event whose next op is at or before `op` (None: every event comes later)."""
    found: Optional[int] = None
    for index, event in enumerate(events):
        if event.next_op > op:
            break
        found = index
    return found


def state_moves_from_plan(trace: dict[str, Any], profiler: Profiler, plan_doc: dict[str, Any]) -> list[Move]:
    """The optimizer-state tensors the plan moves between steps, with their tier and the event at
    which to restore them: the last `saved_tensors_hooks` event whose next op is at or before the
    planned prefetch op (None: the prefetch is in the step itself, so it is issued at the step)."""
    kinds = {t["id"]: t["kind"] for t in trace["tensors"]}
    wrapping = {
        m["tensor_id"]: m
        for m in plan_doc["migrations"]
        if m["wraps"] and kinds.get(m["tensor_id"]) == "optimizer_state"
    }
    if not wrapping or profiler.optimizer is None:
        return []
    moves: list[Move] = []
    seen: set[int] = set()
    for state in profiler.optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor) or value.device.type != profiler.device.type:
                continue
            record = profiler._lookup(value)
            if record is None or record.id in seen or record.id not in wrapping:
                continue
            seen.add(record.id)
            migration = wrapping[record.id]
            event = _last_event_at_or_before(profiler.events, migration["prefetch_op"])
            moves.append(Move(value, migration["tier"], event))
    return moves


def parameter_moves_from_plan(
    trace: dict[str, Any], profiler: Profiler, plan_doc: dict[str, Any]
) -> list[Move]:
    """The parameters the plan moves out between their last forward use and their first backward
    use: released at the first event after the planned offload op, restored at the last event
    at or before the planned prefetch op, and waited for at the last event before the use. A
    migration that the events cannot bracket that way is left out (the parameter stays)."""
    kinds = {t["id"]: t["kind"] for t in trace["tensors"]}
    planned = {
        m["tensor_id"]: m
        for m in plan_doc["migrations"]
        if not m["wraps"] and kinds.get(m["tensor_id"]) == "weight"
    }
    if not planned or profiler.model is None:
        return []
    events = profiler.events
    moves: list[Move] = []
    for param in profiler.model.parameters():
        record = profiler._lookup(param)
        if record is None or record.id not in planned:
            continue
        migration = planned.pop(record.id)
        release = next((i for i, e in enumerate(events) if e.next_op >= migration["offload_op"]), None)
        restore = _last_event_at_or_before(events, migration["prefetch_op"])
        wait = _last_event_at_or_before(events, migration["next_use_op"])
        if release is None or restore is None or wait is None or not release < restore <= wait:
            continue
        moves.append(Move(param, migration["tier"], restore, release_event=release, wait_event=wait))
    return moves
