"""Whole-model mode iteration by iteration: runs a script (a benchmark, usually
`bench_capacity.py run --mode teraio ...`) with its arguments, and writes to `--out` (JSON):

- `iters`: from the 2nd iteration on, each iteration's ops as the runtime's own record marks
  them (`ScheduleRecorder`: a unit's forward, its recomputation and backward), each as
  [name, GPU start, GPU end, host begin], in ms from the iteration's first op (GPU) or start
  (host). Every iteration is recorded, so the report's prediction replays the last one, not
  `RECORDED_ITERATION`.
- `jobs`: each job of the CPU step's worker (`update="cpu"`): [iteration it started in, "update"
  or "folds", host start, host end (ms from that iteration's start), parameters].

At exit it prints a line per iteration: the GPU span of its ops, the gaps before its forward and
backward ops (the GPU waiting for the runtime), and the worker's busy time by kind. It also prints
each residency decision (`_keep_resident`: the allocated and reserved peaks it
read and the parameters kept on the GPU before and after).

    python3 benches/torch/probe_iterations.py --out iterations.json -- \\
        benches/torch/bench_capacity.py run --mode teraio --family llama3b --cap-gib 16 \\
        --accumulate 2 --clip 1.0 --steps 9 --work-dir /root/w
"""

from __future__ import annotations

import argparse
import atexit
import json
import runpy
import sys
import time
from typing import Any, Callable

import torch
from teraio import schedule_record
from teraio.runtime.modes import whole_model
from teraio.timing import elapsed_ms

ModelOffload = whole_model.ModelOffload
Recorder = schedule_record.ScheduleRecorder


class Probe:
    """The iterations' ops and the worker's jobs, gathered by wrapping the runtime's methods."""

    def __init__(self) -> None:
        self.iterations: list[dict[str, Any]] = []
        self.jobs: list[tuple[int, str, float, float, int]] = []
        self.iteration = -1
        self.started = 0.0
        self.host_begins: list[float] = []

    def install(self) -> None:
        begin_iteration, begin, finish = ModelOffload._begin_iteration, Recorder.begin, Recorder.finish
        keep = ModelOffload._keep_resident
        probe = self

        def begin_iteration_(run: ModelOffload) -> None:
            begin_iteration(run)
            probe.iteration, probe.started = run.steps, time.perf_counter()
            probe.host_begins = []
            if run.steps >= 1 and not run.recorder.recording:
                run.recorder.start()
                run._recorded_marks = {"start": run._step_started}

        def begin_(recorder: Recorder, name: str) -> None:
            if recorder.recording:
                probe.host_begins.append(time.perf_counter() - probe.started)
            begin(recorder, name)

        def finish_(recorder: Recorder) -> None:
            ops = list(recorder._ops) if recorder.recording else []
            finish(recorder)
            if ops:
                first = ops[0][1]
                probe.iterations.append(
                    {
                        "it": probe.iteration,
                        "ops": [
                            [name, _ms(first, start), _ms(first, end), round(host * 1e3, 2)]
                            for (name, start, end), host in zip(ops, probe.host_begins)
                        ],
                    }
                )

        def keep_(run: ModelOffload, first: bool) -> None:
            if not run.cuda:
                keep(run, first)
                return
            peak = int(torch.cuda.max_memory_allocated(run.device))
            reserved = int(torch.cuda.max_memory_reserved(run.device))
            before = run.resident_parameter_bytes
            keep(run, first)
            print(
                f"keep_resident first={first}: allocated peak {peak / 2**30:.2f} GiB, reserved peak "
                f"{reserved / 2**30:.2f} GiB, kept {before / 2**30:.2f} -> "
                f"{run.resident_parameter_bytes / 2**30:.2f} GiB",
                flush=True,
            )

        ModelOffload._begin_iteration = begin_iteration_
        Recorder.begin = begin_
        Recorder.finish = finish_
        ModelOffload._keep_resident = keep_
        ModelOffload._run_cpu_update = self._timed("update", ModelOffload._run_cpu_update)
        ModelOffload._run_folds = self._timed("folds", ModelOffload._run_folds)

    def _timed(self, kind: str, job: Callable[..., float]) -> Callable[..., float]:
        def run(offload: ModelOffload, params: list[Any], *args: Any) -> float:
            started = time.perf_counter()
            try:
                return job(offload, params, *args)
            finally:
                self.jobs.append(
                    (
                        self.iteration,
                        kind,
                        round((started - self.started) * 1e3, 2),
                        round((time.perf_counter() - self.started) * 1e3, 2),
                        len(params),
                    )
                )

        return run


def summary(iterations: list[dict[str, Any]], jobs: list[Any]) -> list[str]:
    """A line per recorded iteration: its ops' GPU span, the gaps before its forward and backward
    ops, and the worker's busy time by kind in the jobs that started in it (ms)."""
    lines = []
    for iteration in iterations:
        ops = [op for op in iteration["ops"] if op[2] is not None]
        gaps = {"forward": 0.0, "backward": 0.0}
        for before, op in zip(ops, ops[1:]):
            kind = op[0].split()[0]
            if kind in gaps:
                gaps[kind] += op[1] - before[2]
        busy: dict[str, float] = {}
        for it, kind, start, end, _ in jobs:
            if it == iteration["it"]:
                busy[kind] = busy.get(kind, 0.0) + end - start
        span = ops[-1][2] if ops else 0.0
        worker = ", ".join(f"{kind} {ms:.0f}" for kind, ms in sorted(busy.items())) or "idle"
        lines.append(
            f"iteration {iteration['it']}: GPU span {span:.0f} ms, waits before forward "
            f"{gaps['forward']:.0f} ms and backward {gaps['backward']:.0f} ms; worker: {worker} ms"
        )
    return lines


def _ms(first: Any, mark: Any) -> Any:
    return None if mark is None else round(elapsed_ms(first, mark), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file written at exit")
    parser.add_argument("script", help="the script to run, then its arguments")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    probe = Probe()
    probe.install()

    @atexit.register
    def write() -> None:
        with open(args.out, "w") as f:
            json.dump({"iters": probe.iterations, "jobs": probe.jobs}, f)
        print("\n".join(summary(probe.iterations, probe.jobs)), flush=True)

    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    sys.argv = [args.script, *rest]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
