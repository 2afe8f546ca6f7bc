"""benches/torch's row scripts (bench_regime.py, bench_loops.py and their shared rows.py) on the
CPU with their tiny models: the rows they print and the tables they write."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

BENCHES = pathlib.Path(__file__).resolve().parents[3] / "benches" / "torch"
COMMON = ["--tiny", "--family", "llama", "--steps", "4", "--warmup", "2", "--batch", "2", "--seq", "64"]


def _run(
    script: str, tmp_path: pathlib.Path, *arguments: str, timeout: int = 300
) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, str(BENCHES / script), *arguments],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _row(script: str, tmp_path: pathlib.Path, *extra: str) -> dict[str, Any]:
    done = _run(script, tmp_path, "run", *COMMON, *extra)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(lines[0][7:])


def _no_scratch_left(tmp_path: pathlib.Path) -> None:
    # The row's scratch folder (store file included) is gone (torch may leave its own files).
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("teraio")] == []


def test_bench_regime_rows_on_cpu(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    ideal = _row("bench_regime.py", tmp_path, "--mode", "ideal")
    teraio_row = _row("bench_regime.py", tmp_path, "--mode", "teraio", "--cap-bytes", str(1 << 30))
    assert "error" not in teraio_row, teraio_row.get("error")
    for row, mode in ((ideal, "ideal"), (teraio_row, "teraio")):
        assert row["family"] == "llama-tiny" and row["mode"] == mode and row["dtype"] == "autocast"
        assert (row["batch"], row["seq"], row["steps"], row["warmup"]) == (2, 64, 4, 2)
        assert len(row["losses"]) == len(row["step_ms"]) == 4 and row["ms_per_iter"] > 0
    assert ideal["cap_bytes"] is None and teraio_row["cap_bytes"] == 1 << 30
    assert ideal["peak_estimate_bytes"] > 0  # the CPU's estimate of the peak the caps are shares of
    assert teraio_row["losses"] == ideal["losses"]  # bitwise
    assert teraio_row["teraio_report"]["steps"] == 4 and teraio_row["arguments"] == "defaults"
    _no_scratch_left(tmp_path)
    # A mode that cannot run is a row that says why, not a crash.
    failed = _row("bench_regime.py", tmp_path, "--mode", "teraio")
    assert failed["mode"] == "teraio" and "teraio mode needs --cap-bytes" in failed["error"]
    _no_scratch_left(tmp_path)


def test_bench_loops_rows_on_cpu(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    accum = ["--accum", "2"]
    traces = tmp_path / "traces"
    ideal = _row(
        "bench_loops.py",
        tmp_path,
        "--mode",
        "ideal",
        *accum,
        "--profile-step",
        "3",
        "--trace-dir",
        str(traces),
    )
    teraio_row = _row("bench_loops.py", tmp_path, "--mode", "teraio", *accum, "--cap-bytes", str(1 << 30))
    assert "error" not in teraio_row, teraio_row.get("error")
    for row in (ideal, teraio_row):
        assert row["model_family"] == "llama-tiny" and (row["accum"], row["lora_rank"]) == (2, 0)
        assert row["clip"] == 1.0 and row["trained_params"] == row["params"]
        assert len(row["losses"]) == 4
    assert teraio_row["losses"] == ideal["losses"]  # bitwise, with accumulation and clipping
    assert teraio_row["full_state_fits_cap"] is True and "full_state_fits_cap" not in ideal
    assert teraio_row["teraio_report"]["steps"] == 4
    # --profile-step: that step's timeline, written where --trace-dir says (gzipped).
    assert [p.name for p in traces.iterdir()] == ["llama-ideal-accum2-step3.json.gz"]
    _no_scratch_left(tmp_path)
    bad = _run("bench_loops.py", tmp_path, "run", *COMMON, "--mode", "ideal", "--accum", "3", timeout=120)
    assert bad.returncode == 2 and "--accum 3 must divide --batch 2" in bad.stderr
    bad = _run("bench_regime.py", tmp_path, "run", *COMMON, "--mode", "ideal", "--warmup", "4", timeout=120)
    assert bad.returncode == 2 and "--warmup must be below --steps" in bad.stderr


@pytest.mark.parametrize(
    "script, named",
    [
        ("bench_regime.py", {"family": "qwen2-tiny", "dtype": "autocast"}),
        ("bench_loops.py", {"model_family": "qwen2-tiny", "accum": 1, "lora_rank": 0}),
        ("bench_trainer.py", {"family": "qwen2-tiny (HF Trainer)", "loop": "HF Trainer"}),
    ],
)
def test_a_table_records_the_rows_it_has_no_time_for(
    script: str, named: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    # No time for any row: each is recorded as skipped, with the fields that name it, and the
    # table is still printed.
    out = tmp_path / "out"
    done = _run(
        script, tmp_path, "table", "--tiny", "--families", "qwen2", "--deadline-s", "0", "--out-dir", str(out)
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert rows and all("out of time" in row["skipped"] for row in rows)
    assert all(row["mode"] == "ideal" and row["cap_bytes"] is None for row in rows)
    for key, value in named.items():
        assert all(row[key] == value for row in rows), (key, rows)
    if script == "bench_loops.py":  # the ideal row goes in the table of each accumulation
        assert [row["family"] for row in rows] == ["qwen2 accum 2", "qwen2 accum 4"]
    assert "no capped rows" in done.stdout and "skipped" in (out / "summary.md").read_text()
    assert not list(out.glob("*.log"))  # no row was started


def test_probe_checkpointing_runs_each_variant_on_cpu(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    done = _run(
        "probe_checkpointing.py",
        tmp_path,
        "--tiny", "--steps", "3", "--warmup", "1", "--batch", "2", "--seq", "64",
        "--cap-bytes", str(1 << 30),
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    medians = [line.split(":")[0] for line in done.stdout.splitlines() if ": median " in line]
    assert medians == ["hf", "hf_head", "hf_sync", "blocks", "blocks_cache", "teraio"]
    assert "teraio offload (block plan)" in done.stdout
    _no_scratch_left(tmp_path)  # the teraio variant's store went with its scratch folder


def _trace(path: pathlib.Path, kernels: list[tuple[str, str, float, int]]) -> None:
    """A chrome trace as torch.profiler writes it: the three phases on the host, one launch per
    kernel inside its phase, and the kernels (name, phase, ms, stream)."""
    phases = {"forward": 0, "backward": 1000, "step": 2000}
    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "user_annotation", "name": name, "ts": start, "dur": 900}
        for name, start in phases.items()
    ]
    for index, (name, phase, ms, stream) in enumerate(kernels):
        launch = phases[phase] + 10 + index
        events.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "ts": launch,
                "dur": 1,
                "args": {"correlation": index},
            }
        )
        category = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        events.append(
            {
                "ph": "X",
                "cat": category,
                "name": name,
                "ts": 5000 + 100 * index,
                "dur": ms * 1e3,
                "args": {"correlation": index, "stream": stream},
            }
        )
    path.write_text(json.dumps({"traceEvents": events}))


def test_profile_loop_compares_kernel_time_by_phase_and_kind(tmp_path: pathlib.Path) -> None:
    plain = [
        ("nvjet_sm90_gemm", "forward", 2.0, 7),
        ("cunn_SoftMaxForward", "forward", 1.0, 7),
        ("nvjet_sm90_gemm", "backward", 4.0, 7),
        ("multi_tensor_apply_kernel", "step", 3.0, 7),
    ]
    offloaded = plain + [("cunn_SoftMaxForward", "backward", 1.5, 7), ("Memcpy DtoH", "forward", 6.0, 21)]
    _trace(tmp_path / "plain.json", plain)
    _trace(tmp_path / "offloaded.json", offloaded)
    done = _run(
        "profile_loop.py", tmp_path, "compare", str(tmp_path / "plain.json"), str(tmp_path / "offloaded.json")
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line[:34].strip(): line[34:].split() for line in done.stdout.splitlines() if line[:1] != " "}
    assert rows["forward, matmul"] == ["2.00", "2.00"]
    assert rows["backward, softmax"] == ["0.00", "1.50"]
    assert rows["forward, copy stream 21"] == ["0.00", "6.00"]
    assert rows["step, foreach"] == ["3.00", "3.00"]
    assert rows["compute stream, all"] == ["10.00", "11.50"]  # the copy stream is not compute
    listed = done.stdout.split("differ most", 1)[1].splitlines()[1:]
    assert listed == ["     +1.50  backward cunn_SoftMaxForward"]  # kernels that did not change: not listed


def test_probe_cpu_step_prints_a_row_per_kernel_interval_and_load(tmp_path: pathlib.Path) -> None:
    done = _run(
        "probe_cpu_step.py",
        tmp_path,
        "--units",
        "2",
        "--unit-params",
        "1000000",
        "--intervals",
        "5,0.5",
        "--rounds",
        "1",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    cells = [line.split("|")[1:4] for line in done.stdout.splitlines() if line.startswith("| ")]
    rows = [tuple(c.strip() for c in cell) for cell in cells if cell[1].strip()[0].isdigit()]
    # No GPU here: the host-link load is left out.
    assert rows == [
        (kernel, interval, load)
        for kernel in ("torch", "torch+copies", "teraio")
        for interval in ("5 ms", "0.5 ms")
        for load in ("idle", "Python")
    ]


def test_probe_iterations_writes_each_iterations_ops_and_the_workers_jobs(tmp_path: pathlib.Path) -> None:
    # A whole-model row with the CPU step, 5 steps: every iteration from the 2nd is recorded
    # with its ops, and each update job on the worker is timed in the iteration it started in
    # (its step's or, where the worker started it after the step returned, the next one's:
    # which one is the threads' timing, so only the range is asserted).
    out = tmp_path / "iterations.json"
    done = _run(
        "probe_iterations.py",
        tmp_path,
        "--out",
        str(out),
        str(BENCHES / "bench_capacity.py"),
        "run",
        "--mode",
        "teraio",
        "--tiny",
        "--steps",
        "5",
        "--accumulate",
        "2",
        "--work-dir",
        str(tmp_path / "work"),
        "--teraio-options",
        "whole_model=on,update=cpu",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    probe = json.loads(out.read_text())
    assert [iteration["it"] for iteration in probe["iters"]] == [1, 2, 3, 4]
    for iteration in probe["iters"]:
        names = [op[0] for op in iteration["ops"]]
        assert names[0].startswith("forward") and any(name.startswith("backward") for name in names)
        assert all(op[1] <= op[2] for op in iteration["ops"])
    updates = [job for job in probe["jobs"] if job[1] == "update"]
    # The same update jobs each step (one per unit group), every one of the 5 steps' timed.
    assert updates and len(updates) % 5 == 0
    assert all(0 <= job[0] <= 5 for job in updates)
    assert all(job[2] <= job[3] and job[4] > 0 for job in updates)
    lines = [line for line in done.stdout.splitlines() if line.startswith("iteration ")]
    assert [line.split(":")[0] for line in lines] == [f"iteration {i}" for i in (1, 2, 3, 4)]
    assert all("waits before forward" in line and "worker: " in line for line in lines)
