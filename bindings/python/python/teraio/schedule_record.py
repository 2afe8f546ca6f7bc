"""One iteration of a runtime's own schedule as it ran, for the simulator to replay.

Whole-model offload does not execute a planner's plan; it predicts its iteration by recording one
(`ScheduleRecorder`) and replaying the record in the simulator (`planning.replay_schedule`,
planner/src/replay.rs) at the machine's bandwidths, or at others (`ScheduleRecord.replay`):

- ops: the stretches of GPU work between two waits of the runtime (a unit's forward, its
  recomputation and backward, a step window), each timed on the compute stream from just after
  the runtime's waits to just before the next ones (`timing.mark`), so the time the GPU waited
  for a transfer is not in it;
- tensors: what the ops used (a parameter, its gradient, each optimizer-state tensor, a
  checkpointed block's inputs), read or written, with their sizes;
- transfers: each read, write and drop the runtime issued, before the op that followed it (one
  issued while an op runs counts before the next op: the replay issues it a little late); a
  gradient written to host memory and never read back in the iteration (the CPU step reads it
  there) is a lone departure; a parameter's read that waits for the CPU step's update of it
  is recorded where it was wanted (`wanted`), the replay's read waiting for the update's job;
- CPU jobs (`update="cpu"`): each unit's update queued on the CPU step's worker, before the op
  that followed it (at `optimizer.step()` after backward: after the last op), with its time on
  the worker (measured there, not counting its wait for the gradients' copies), the gradients
  it waits for and the parameters it writes, which their next read waits for.

Only tensors that moved are recorded: a parameter kept on the GPU takes no link time.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

import torch

from .planning import replay_schedule
from .timing import elapsed_ms, mark

#: Trace kinds (docs/trace.md) of the runtime's kinds of bytes.
TRACE_KINDS = {
    "parameter": "weight",
    "gradient": "gradient",
    "optimizer_state": "optimizer_state",
    "activation": "activation",
}
#: Kinds that live from their first use to their last within the iteration.
_TRANSIENT = ("gradient", "activation")
#: Transfer kinds (planner/src/replay.rs).
PREFETCH, OFFLOAD, DROP = "prefetch", "offload", "drop"
#: GPU and host memory the replay assumes: unbounded (the runtime bounds its own memory; the
#: replay predicts time).
UNBOUNDED_BYTES = 1 << 62
#: Fixed cost per transfer the replay assumes (the planner's defaults, `Hardware::new`).
HOST_LATENCY_US, SSD_LATENCY_US = 10.0, 20.0


@dataclass
class _Tensor:
    name: str
    kind: str
    size_bytes: int
    persistent: bool
    uses: dict[int, str] = field(default_factory=dict)  # op -> "read" | "write"


@dataclass
class ScheduleRecord:
    """A recorded iteration: the trace (docs/trace.md) and the schedule the replay reads."""

    trace: dict[str, Any]
    schedule: dict[str, Any]
    #: Transfers of tensors no op used in the recorded iteration (not replayable; counted).
    unmodelled_transfers: int = 0
    #: Tensors CPU jobs name that the trace lacks (no op used them or they did not move):
    #: left out of the jobs, so nothing waits for them in the replay (counted).
    unmodelled_job_tensors: int = 0
    #: Indices of the schedule's reads that moved no bytes: a tensor kept while its write ran.
    kept: list[int] = field(default_factory=list)
    #: The recorded iteration as it ran on the GPU: from its first op's start to its last op's
    #: end (ms); less the ops' time, what it waited for (the replay's stall, measured).
    span_ms: float = 0.0

    def replay(
        self,
        *,
        host_link_bytes_per_s: float,
        ssd_read_bytes_per_s: float,
        ssd_write_bytes_per_s: float,
        ssd_shared: bool = False,
        host_link_duplex_bytes_per_s: Optional[float] = None,
    ) -> dict[str, Any]:
        """The simulator's report (planner/src/sim.rs `SimReport`) for this schedule at these
        bandwidths; SSD transfers also take the host link (the store's bounce path), each way
        at `host_link_duplex_bytes_per_s` while both directions move data (None: the one-way
        rate)."""
        hardware = {
            "gpu_capacity_bytes": UNBOUNDED_BYTES,
            "host_capacity_bytes": UNBOUNDED_BYTES,
            "host_link_bytes_per_s": host_link_bytes_per_s,
            "host_link_duplex_bytes_per_s": host_link_duplex_bytes_per_s,
            "host_latency_us": HOST_LATENCY_US,
            "ssd_read_bytes_per_s": ssd_read_bytes_per_s,
            "ssd_write_bytes_per_s": ssd_write_bytes_per_s,
            "ssd_latency_us": SSD_LATENCY_US,
            "ssd_shared": ssd_shared,
            "ssd_via_host_link": True,
        }
        return replay_schedule(self.trace, self.schedule, hardware)

    @property
    def cpu_update_ms(self) -> float:
        """The CPU jobs' time on the worker, all of them (ms)."""
        return sum(job["duration_us"] for job in self.schedule.get("cpu_jobs", [])) / 1e3


class ScheduleRecorder:
    """Records one iteration (see the module docstring): `start`, then the runtime calls `wait`
    before it waits, `begin` after, `use` for what the running op touches, `read` / `wrote` /
    `left` for its transfers, `cpu_job` for what it queues on the CPU step's worker; `finish`
    ends the record, `result` builds it (reading the GPU marks and the jobs' times then, not
    while training runs). Calls outside a record do nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.recording = False
        self._finished = False
        self._record: Optional[ScheduleRecord] = None
        self._ops: list[list[Any]] = []  # [name, start mark, end mark or None]
        self._tensors: dict[Hashable, _Tensor] = {}
        self._transfers: list[tuple[int, Hashable, str, str, bool]] = []  # (..., moved bytes)
        # (op, the job's future: its seconds on the worker, waits for, produces)
        self._jobs: list[tuple[int, Future[float], list[Hashable], list[Hashable]]] = []
        # Tensors written whose GPU memory has not left since (the write's departure is owed),
        # tracked between records too; and which of them were written during the record.
        self._owed: dict[Hashable, str] = {}
        self._written: set[Hashable] = set()
        # Reads recorded where they were wanted (`wanted`), not yet issued; kept between records.
        self._wanted: set[Hashable] = set()

    def start(self) -> None:
        self.recording, self._finished, self._record = True, False, None
        self._ops, self._tensors, self._transfers, self._written = [], {}, [], set()
        self._jobs = []

    def wait(self) -> None:
        """The runtime is about to wait for transfers: the running op ends here."""
        if self.recording and self._ops and self._ops[-1][2] is None:
            self._ops[-1][2] = mark(self.device)

    def begin(self, name: str) -> None:
        """The runtime's waits are done: op `name` starts."""
        if self.recording:
            self.wait()
            self._ops.append([name, mark(self.device), None])

    def use(self, key: Hashable, name: str, kind: str, size_bytes: int, write: bool = False) -> None:
        """The running op reads (or writes) tensor `key`; `kind` one of `TRACE_KINDS`' keys."""
        if not self.recording or not self._ops:
            return
        tensor = self._tensors.get(key)
        if tensor is None:
            tensor = _Tensor(name, TRACE_KINDS[kind], size_bytes, kind not in _TRANSIENT)
            self._tensors[key] = tensor
        op = len(self._ops) - 1
        if write or tensor.uses.get(op) != "write":
            tensor.uses[op] = "write" if write else "read"

    def read(self, key: Hashable, tier: str) -> None:
        if key in self._wanted:
            self._wanted.discard(key)  # recorded where it was wanted
            return
        self._issue(key, PREFETCH, tier)

    def wanted(self, key: Hashable, tier: str) -> None:
        """A read of `key` from `tier` is wanted here but waits for the CPU step's update of it:
        recorded here, where the replay issues it to wait for that job, so that the record does
        not depend on whether the update was done in time; the runtime's `read` once the wait
        is over is this one."""
        if key not in self._wanted:
            self._wanted.add(key)
            self._issue(key, PREFETCH, tier)

    def wrote(self, key: Hashable, tier: str, leaves: bool = True) -> None:
        """A write of `key` to `tier` was issued; `leaves`: its GPU memory goes with it (else it
        goes at `left` or stays at `returned`: this write's departure is owed until then)."""
        if leaves:
            self._issue(key, OFFLOAD, tier)
            return
        self._owed[key] = tier
        if self.recording:
            self._written.add(key)

    def left(self, key: Hashable, tier: str) -> None:
        """`key`'s GPU memory was released: the departure of the write owed since (none if that
        write came before the record: in the steady state the record's own last write is it,
        `finish`), or a drop (its copy on `tier` is current)."""
        if self._owed.pop(key, None) is None:
            self._issue(key, DROP, tier)
        elif key in self._written:
            self._written.discard(key)
            self._issue(key, OFFLOAD, tier)

    def returned(self, key: Hashable, tier: str) -> None:
        """`key` is kept on the GPU after all while its owed write goes on: the write's departure
        and a read at once (the simulator, too, keeps a tensor read while its write runs)."""
        if self._owed.pop(key, None) is None:
            return
        if key in self._written:
            self._written.discard(key)
            self._issue(key, OFFLOAD, tier)
        self._issue(key, PREFETCH, tier, moves=False)

    def cpu_job(self, future: Future[float], waits_for: list[Hashable], produces: list[Hashable]) -> None:
        """A job was queued on the CPU worker: `future` gives its seconds on the worker once it
        ran; it reads the lone departures of `waits_for` and writes `produces` on their tier."""
        if self.recording:
            self._jobs.append((len(self._ops), future, list(waits_for), list(produces)))

    def _issue(self, key: Hashable, kind: str, tier: str, moves: bool = True) -> None:
        if self.recording:
            self._transfers.append((len(self._ops), key, kind, tier, moves))

    def finish(self) -> None:
        """Ends the record: the last op ends here; writes whose release comes later (an SSD
        write still running) depart after it."""
        if self.recording:
            self.wait()
            for key in self._written:
                self._issue(key, OFFLOAD, self._owed[key])
            self.recording, self._finished = False, True

    def result(self) -> Optional[ScheduleRecord]:
        """The finished record (None before `finish`)."""
        if self._finished and self._record is None:
            self._record = self._build()
        return self._record

    def _reads_owed(
        self, transfers: list[tuple[int, Hashable, str, str, bool]]
    ) -> list[tuple[int, Hashable, str, str, bool]]:
        """The read back of each persistent tensor in `transfers` that leaves without one: a
        parameter kept on the GPU whose copy the CPU step makes stale is dropped after its
        update and read again at its next use, in the next iteration; where the record began
        with its copy fresh (the first iteration after it became resident), the record holds
        the drop alone. The read is issued where the tensors first used by the same op were
        read (their unit's read-ahead), else just before that op; the replay wraps it into the
        next iteration, waiting for the update's job."""
        first_use = {key: min(t.uses) for key, t in self._tensors.items() if t.uses}
        events: dict[Hashable, list[str]] = {}
        tiers: dict[Hashable, str] = {}  # each tensor's first transfer's tier
        read_at: dict[int, int] = {}  # first-use op -> the earliest read of a tensor it first uses
        for op, key, kind, tier, _ in transfers:
            events.setdefault(key, []).append(kind)
            tiers.setdefault(key, tier)
            if kind == PREFETCH and key in first_use:
                use = first_use[key]
                read_at[use] = min(read_at.get(use, op), op)
        owed = []
        for key, kinds in events.items():
            reads = kinds.count(PREFETCH)
            if self._tensors[key].persistent and kinds[0] != PREFETCH and len(kinds) - reads == reads + 1:
                use = first_use[key]
                owed.append((read_at.get(use, use), key, PREFETCH, tiers[key], True))
        return owed

    def _build(self) -> ScheduleRecord:
        ops = [
            {"name": name, "duration_us": max(0.0, elapsed_ms(start, end) * 1e3)}
            for name, start, end in self._ops
        ]
        span_ms = elapsed_ms(self._ops[0][1], self._ops[-1][2]) if self._ops else 0.0
        ids = {key: index for index, key in enumerate(k for k, t in self._tensors.items() if t.uses)}
        moved = {key for _, key, _, _, _ in self._transfers if key in ids}
        tensors = []
        for key, tensor in self._tensors.items():
            if key not in moved:
                continue
            uses = sorted(tensor.uses.items())
            entry: dict[str, Any] = {
                "id": ids[key],
                "name": tensor.name,
                "size_bytes": tensor.size_bytes,
                "kind": tensor.kind,
                "alloc_op": None if tensor.persistent else uses[0][0],
                "free_op": None if tensor.persistent else uses[-1][0],
                "uses": [{"op": op, "access": access} for op, access in uses],
            }
            tensors.append(entry)
        recorded = [t for t in self._transfers if t[1] in moved]
        # In op order (the recorded ones are), each owed read after those issued before its op.
        kept = sorted(recorded + self._reads_owed(recorded), key=lambda t: t[0])
        transfers = [
            {"op": op, "tensor_id": ids[key], "kind": kind, "tier": tier} for op, key, kind, tier, _ in kept
        ]
        cpu_jobs, unmodelled_job_tensors = [], 0
        for op, future, waits_for, produces in self._jobs:
            named = [*waits_for, *produces]
            unmodelled_job_tensors += sum(key not in moved for key in named)
            cpu_jobs.append(
                {
                    "op": op,
                    "duration_us": future.result() * 1e6,
                    "waits_for": [ids[key] for key in waits_for if key in moved],
                    "produces": [ids[key] for key in produces if key in moved],
                }
            )
        schedule: dict[str, Any] = {"transfers": transfers}
        if cpu_jobs:
            schedule["cpu_jobs"] = cpu_jobs
        return ScheduleRecord(
            trace={
                "format_version": 1,
                "description": "whole-model offload, one recorded iteration",
                "gpu_capacity_bytes": UNBOUNDED_BYTES,
                "ops": ops,
                "tensors": tensors,
            },
            schedule=schedule,
            unmodelled_transfers=len(self._transfers) - len(recorded),
            unmodelled_job_tensors=unmodelled_job_tensors,
            kept=[index for index, t in enumerate(kept) if not t[4]],
            span_ms=span_ms,
        )
