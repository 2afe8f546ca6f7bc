"""The CPU step's prediction (`update="cpu"`) as the whole-model tests check it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from teraio.runtime.modes.whole_model import RECORDED_ITERATION, ModelOffload


def assert_cpu_step_predicted(run: ModelOffload) -> Any:
    """The CPU step's prediction: the recorded iteration holds the worker's jobs. Each update
    waits for its parameters' gradients, which leave for good (a lone departure: their last
    transfer is a write to host memory that no read follows), and writes those parameters; in
    a loop that accumulates, folds of bf16 gradients into fp32 ones wait for a gradient's
    write and write nothing the GPU reads. The replay runs them. Returns the record."""
    report = run.report()
    record = run.recorder.result()
    assert record is not None
    assert report.predicted_iteration_ms is not None, report.warnings
    assert "CPU step" in str(report)
    jobs = record.schedule["cpu_jobs"]
    assert report.prediction["cpu_jobs"] == len(jobs) > 1
    assert report.prediction["cpu_update_ms"] == pytest.approx(sum(j["duration_us"] for j in jobs) / 1e3)
    assert report.prediction["cpu_update_ms"] > 0
    assert record.unmodelled_job_tensors == 0 and record.unmodelled_transfers == 0
    names = {t["id"]: t["name"] for t in record.trace["tensors"]}
    updates = [job for job in jobs if job["produces"]]
    folds = [job for job in jobs if not job["produces"]]
    assert not folds or run._loop_accumulated
    produced = sorted(names[i] for job in updates for i in job["produces"])
    assert produced == sorted(slot.name for slot in run.slots if slot.param.requires_grad)
    for job in updates:
        assert sorted(names[i] for i in job["waits_for"]) == sorted(
            names[i] + ".grad" for i in job["produces"]
        )
    for job in folds:
        assert job["waits_for"] and all(names[i].endswith(".grad") for i in job["waits_for"])
    for gradient in (t for t in record.trace["tensors"] if t["kind"] == "gradient"):
        kinds = [
            (x["kind"], x["tier"], x["op"])
            for x in record.schedule["transfers"]
            if x["tensor_id"] == gradient["id"]
        ]
        writes = [op for kind, tier, op in kinds if kind == "offload" and tier == "host"]
        assert writes and len(writes) == sum(kind != "prefetch" for kind, _, _ in kinds)
        # A read brings back the write before it (accumulated in fp32, or for a clip's norm);
        # a write no read follows is lone (bf16 copies' writes accumulate in host memory).
        assert all(kinds[i - 1][0] == "offload" for i, (kind, _, _) in enumerate(kinds) if kind == "prefetch")
        follows = [*(kind for kind, _, _ in kinds[1:]), None]
        assert any(kind == "offload" and after != "prefetch" for (kind, _, _), after in zip(kinds, follows))
        assert next(j["op"] for j in updates if gradient["id"] in j["waits_for"]) >= writes[-1]
        # A compute copy's gradient in a loop that accumulates: one fold per micro-batch's
        # write, each queued after its own write, except a write of a sum made on the device
        # (the held sum read back before it: a step's last micro-batch), which needs none.
        fold_ops = sorted(j["op"] for j in folds if gradient["id"] in j["waits_for"])
        if fold_ops:
            summed = [
                op
                for (kind, _, op), before in zip(kinds, [None, *kinds])
                if kind == "offload" and before is not None and before[0] == "prefetch"
            ]
            folded = sorted(set(writes) - set(summed))
            assert len(fold_ops) == len(folded)
            assert all(op >= write for op, write in zip(fold_ops, folded))
    # The replay runs the jobs one at a time: at a second each (far longer than the rest), the
    # next forward pass waits for all of them, less the backward ops they overlap.
    compute_us = sum(op["duration_us"] for op in record.trace["ops"])
    slow = {**record.schedule, "cpu_jobs": [{**job, "duration_us": 1e6} for job in jobs]}
    unbounded = dict(host_link_bytes_per_s=1e18, ssd_read_bytes_per_s=1e18, ssd_write_bytes_per_s=1e18)
    replayed = dataclasses.replace(record, schedule=slow).replay(**unbounded)
    latencies_us = len(record.schedule["transfers"]) * 10.0 * 2
    assert (
        len(jobs) * 1e6 - compute_us
        <= replayed["iteration_time_us"]
        <= len(jobs) * 1e6 + compute_us + latencies_us
    )
    # The loop's host time between iterations is an op after the recorded ones, which the jobs
    # queued at the step run through: with the jobs at a second each and that time at half a
    # second, the prediction is the jobs' time, not their sum with it. On the CPU device it is
    # at most the wall time outside the recorded span (the marks it is taken from lie outside).
    outside = report.prediction["outside_span_ms"]
    wall_ms = report.step_times_ms[RECORDED_ITERATION]
    assert outside >= 0
    if not run.cuda:
        assert outside <= wall_ms - record.span_ms + 1e-6
    marks = run._recorded_marks
    if run.step_in_backward:  # optimizer.step() waits for no copies: the wall time outside the span
        assert "copies_done" not in marks
        assert outside == pytest.approx(max(0.0, wall_ms - record.span_ms))
    else:  # from the marks: before the first unit's entry, after the copies' wait
        before = marks["first_entry"] - marks["start"]
        after = marks["start"] + wall_ms / 1e3 - marks["copies_done"]
        assert outside == pytest.approx((before + after) * 1e3)
    slow_record = dataclasses.replace(record, schedule=slow)
    run.recorder.result = lambda: slow_record  # type: ignore[method-assign]
    run._loop_host_ms = lambda span_ms: 500.0  # type: ignore[method-assign]
    try:
        predicted = run.predict(host_link_bandwidth=1e18, ssd_bandwidth=1e18)
    finally:
        del run.recorder.result, run._loop_host_ms
    assert predicted is not None and predicted["outside_span_ms"] == 500.0
    assert predicted["iteration_ms"] <= (len(jobs) * 1e6 + compute_us + latencies_us) / 1e3
    return record
