"""Capacity: train a model whose parameters, gradients and AdamW state do not fit the GPU memory it
may use, with teraio and with DeepSpeed's offloaders, on the same disk and the same cap.

The model is bench_regime's Qwen2-1.5B shape by default (`--family`; random init, fixed seed,
nothing downloaded): 1.54B parameters, so fp32 parameters + gradients + AdamW's two moments are
24.7 GB against a 12 GiB (12.9 GB) cap, 1.92x. It is built on the GPU from a fixed seed in every
mode (the same initial weights for all of them) and trained on fixed batches
(bench_regime.make_batches) with SDPA attention and AdamW (lr 1e-4, weight decay 0.01). Modes,
each in its own process:

    reference      bf16 autocast over fp32 weights, everything on the GPU, no cap (the H100's 80 GB
                   holds it; a row that runs out of memory says so)
    teraio         the same training loop, as a user writes it:
                       store = teraio.Store.create([dir/f0, dir/f1], file_size_bytes=...)
                       with teraio.offload(model, optimizer, store=store, gpu_memory=cap) as off:
                           ...loss.backward(); optimizer.step(); optimizer.zero_grad()
                   then off.report()
    teraio_ssd     the same with host_memory="8GiB" (`--ssd-host-memory`): host memory too small
                   for the state, so part of it must live on the SSD store
    teraio_step_in_bwd, teraio_ssd_step_in_bwd
                   teraio and teraio_ssd with step_in_backward=True (each parameter updated in
                   backward from the first iteration, on the GPU unless update="cpu"; the loop
                   neither clips nor accumulates gradients, so the default "auto" already runs
                   the CPU step in backward from the third iteration)
    zero_infinity  DeepSpeed ZeRO-3, parameters and optimizer state offloaded to NVMe (swap files
                   under the same work dir, so the same disk), Hugging Face gradient checkpointing
                   (use_reentrant=False, as ZeRO-Infinity users fit activations),
                   offload_param.buffer_size above the largest parameter
    zero_offload   DeepSpeed ZeRO-2 with the optimizer offloaded to CPU (`--zero-offload-stage`),
                   gradient checkpointing, the ZeRO-Offload tutorial's 2e8 bucket sizes

DeepSpeed runs in its own bf16 mode (`"bf16": {"enabled": true}`), as its users train: bf16
weights and activations on the GPU and fp32 master weights in the optimizer, initialised from the
bf16-rounded weights. That is not autocast over fp32 weights (autocast keeps fp32 weights and
runs matmuls in bf16), so DeepSpeed's losses agree with the reference within a tolerance, not
bitwise. teraio runs the reference's exact arithmetic: its losses are compared bitwise.

The cap is `torch.cuda.set_per_process_memory_fraction(cap / total, 0)` for every mode but the
reference, and also teraio's `gpu_memory`.

The loop takes `--accumulate` micro-batches of `--batch` rows per optimizer step (each loss
divided by their count, as DeepSpeed's `gradient_accumulation_steps` divides it) and, with
`--clip`, calls `torch.nn.utils.clip_grad_norm_` before the step (DeepSpeed: `gradient_clipping`);
a step's loss is the mean of its micro-batches'.

Per mode: ms/iter (median of the steps after `--warmup`; a step ends at `loss.item()` and a
synchronize), peak GPU memory (torch.cuda.max_memory_allocated, read after each step and the
largest taken, since teraio resets the allocator's peak each iteration), peak host RSS and locked
memory (VmRSS and VmLck sampled every 20 ms over the steps), peak pinned memory of torch's host
allocator (DeepSpeed's pinned buffers come from it; teraio's own appear in its report where it
says), bytes per tier per iteration (teraio: its report; DeepSpeed: an estimate from the
parameter count, labelled, beside the measured size of its swap folder and the process's
/proc/self/io counters where the kernel fills them), and the loss per step.

    python3 benches/torch/bench_capacity.py run --mode zero_infinity --work-dir /root/cap
    python3 benches/torch/bench_capacity.py table --work-dir /root/cap --out-dir OUT/capacity
    python3 benches/torch/bench_capacity.py table --modes zero_infinity,zero_offload --steps 3 ...
    python3 benches/torch/bench_capacity.py table --tiny --work-dir /tmp/cap   # CPU smoke test

`table` runs the modes one process each under a time limit per row and a deadline (an out-of-memory
error, an exception or a timeout is a row, not a crash; a row stops taking steps `STOP_MARGIN_S`
before its limit and says so, keeping its figures), removes each row's store or swap folder after
it (the GPU machine's disk has ~64 GB free), writes OUT/results.jsonl and prints a markdown table
with each mode's loss agreement against the first reference row (or against `--reference-from`, an
earlier results.jsonl). A mode may repeat: `--modes reference,reference,teraio` also says whether
the reference is itself bitwise reproducible. `--tiny`: CPU, two small layers, 256 tokens, teraio's
gpu_memory half of what an iteration needs without offload; DeepSpeed rows are recorded as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Optional

import torch

#: When this process started: a row's time budget counts its imports and setup too.
STARTED = time.monotonic()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import baselines  # noqa: E402  (beside this script)
import bench_regime  # noqa: E402
import summarize  # noqa: E402
from timeline import profiled  # noqa: E402

GIB = 1 << 30
#: ZeRO-Infinity's offload_param.buffer_count (see make_deepspeed).
ZERO_INFINITY_PARAM_BUFFERS = 40

MODES = [
    "reference",
    "teraio",
    "teraio_ssd",
    "teraio_step_in_bwd",
    "teraio_ssd_step_in_bwd",
    "zero_infinity",
    "zero_offload",
]
DEEPSPEED_MODES = ("zero_infinity", "zero_offload")
TERAIO_MODES = ("teraio", "teraio_ssd", "teraio_step_in_bwd", "teraio_ssd_step_in_bwd")
#: Files of teraio's store, in one folder of the work dir (one disk on the GPU machine).
#: Disk space a teraio store must leave free (its files are reserved in full when created).
DISK_KEPT_FREE = 8 * GIB
#: A row stops taking steps this long before its time limit (the report, removing ~25 GB of swap).
STOP_MARGIN_S = 30.0


# -- measurements -----------------------------------------------------------------------------


class HostMemorySampler:
    """Peak resident and locked host memory of this process, sampled from /proc/self/status on a
    thread (ru_maxrss would also count the model's build on the CPU, before training)."""

    FIELDS = {"VmRSS": "rss", "VmLck": "locked"}

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.peak = {"rss": 0, "locked": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    name, _, rest = line.partition(":")
                    key = self.FIELDS.get(name)
                    if key is not None:
                        self.peak[key] = max(self.peak[key], int(rest.split()[0]) * 1024)
        except OSError:  # no procfs: the row has no host figures
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> HostMemorySampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def proc_io() -> dict[str, int]:
    """This process's I/O counters (bytes through read/write calls, and bytes the kernel sent to
    storage); empty where /proc/self/io is missing."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}
    except (OSError, ValueError):
        return {}


def pinned_host_peak() -> Optional[int]:
    """The peak bytes of pinned blocks torch's host allocator held (tensor.pin_memory() and
    pin_memory=True allocations), where this torch reports it."""
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if stats_fn is None or not torch.cuda.is_available():
        return None
    try:
        stats = stats_fn()
    except RuntimeError:
        return None
    for key in ("allocated_bytes.peak", "reserved_bytes.peak", "segment_bytes.peak"):
        if key in stats:
            return int(stats[key])
    return None


def disk_bytes(path: str) -> int:
    """Bytes a folder takes on disk (allocated blocks: sparse files count what was written)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def tier_bytes(report: dict[str, Any]) -> dict[str, dict[str, int]]:
    """{tier: {direction: bytes}} per iteration, summed over every tensor kind the report lists
    (fields named `*bytes_per_iteration` shaped {direction: {tier: bytes}}, or {direction: {tier:
    {kind: bytes}}} as the whole-model report has them)."""
    totals: dict[str, dict[str, int]] = {}
    for key, value in report.items():
        if not key.endswith("bytes_per_iteration") or not isinstance(value, dict):
            continue
        for direction, tiers in value.items():
            if not isinstance(tiers, dict):
                continue
            for tier, nbytes in tiers.items():
                if isinstance(nbytes, dict):
                    nbytes = sum(v for v in nbytes.values() if isinstance(v, (int, float)))
                if isinstance(nbytes, (int, float)):
                    per_tier = totals.setdefault(tier, {})
                    per_tier[direction] = per_tier.get(direction, 0) + int(nbytes)
    return totals


def deepspeed_traffic_estimate(mode: str, params: int) -> dict[str, Any]:
    """Bytes per iteration DeepSpeed must move, from the parameter count P (it reports none).
    ZeRO-Infinity: bf16 parameters read from NVMe for the forward, the checkpointed recompute
    and the backward (3 x 2P), fp32 gradients swapped out and in (4P each way), fp32 master
    weights and two moments read and written by the step (12P each way), updated bf16 parameters
    written (2P). ZeRO-Offload: fp32 gradient partitions to the host (4P), updated fp32 weights
    back (4P); nothing on disk."""
    if mode == "zero_infinity":
        return {
            "ssd": {
                "read": 6 * params + 4 * params + 12 * params,
                "written": 4 * params + 12 * params + 2 * params,
            },
            "basis": "estimate from the parameter count: 3 bf16 parameter fetches, fp32 gradients, "
            "fp32 master + 2 moments in and out, bf16 parameters out",
        }
    return {
        "host": {"to_host": 4 * params, "to_gpu": 4 * params},
        "basis": "estimate from the parameter count: fp32 gradients out, fp32 weights back",
    }


# -- one mode ---------------------------------------------------------------------------------


def tiny_cap(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """--tiny's GPU memory for teraio: half of what one iteration needs without offload (model
    state plus the activations one forward pass saves), as the real run's cap is about half of
    its model state."""
    saved = bench_regime.SavedBytes(model)
    with saved.context(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=tokens, labels=tokens)  # the graph is dropped unused: no gradients
    return (bench_regime.model_state_bytes(model) + sum(saved.seen.values())) // 2


def apply_cap(cap: int) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)


def largest_parameter_elements(model: torch.nn.Module) -> int:
    return max(p.numel() for p in model.parameters())


def param_buffer_elements(model: torch.nn.Module) -> int:
    """offload_param.buffer_size: above the largest parameter, rounded up to a million."""
    largest = largest_parameter_elements(model)
    return max(int(1e8), (largest // 1_000_000 + 2) * 1_000_000)


def make_teraio(
    args: argparse.Namespace, model: torch.nn.Module, optimizer: Any, cap: int
) -> tuple[Any, dict]:
    import teraio

    store_dir = os.path.join(args.work_dir, args.mode)
    os.makedirs(store_dir, exist_ok=True)
    names = [f"f{i}" for i in range(args.store_devices)]
    file_size = int(args.store_gib * GIB / len(names))
    free = shutil.disk_usage(store_dir).free
    if free - file_size * len(names) < DISK_KEPT_FREE:
        # The store's files are reserved in full at create: a full disk took a machine down.
        raise RuntimeError(
            f"a {args.store_gib:g} GiB store would leave less than {DISK_KEPT_FREE / GIB:g} GiB of the "
            f"{free / GIB:.1f} GiB free under {store_dir}: lower --store-gib"
        )
    # An emulated array (files in tmpfs, each device paced like an SSD) has no O_DIRECT.
    emulated = {"emulate": args.emulate, "direct_io": False} if args.emulate else {}
    store = teraio.Store.create(
        [os.path.join(store_dir, name) for name in names], file_size_bytes=file_size, **emulated
    )
    kwargs: dict[str, Any] = {"store": store, "gpu_memory": cap}
    if args.mode.endswith("_step_in_bwd"):
        kwargs["step_in_backward"] = True
    for item in filter(None, (args.teraio_options or "").split(",")):
        name, _, value = item.partition("=")
        kwargs[name.strip()] = int(value) if value.strip().isdigit() else value.strip()
    if args.mode.startswith("teraio_ssd"):
        # --tiny: a quarter of the model state, so that the SSD store must hold the rest.
        kwargs["host_memory"] = args.ssd_host_memory or bench_regime.model_state_bytes(model) // 4
    described = {"store_files": len(names), "store_bytes": file_size * len(names), "emulate": args.emulate}
    described.update({k: v for k, v in kwargs.items() if k != "store"})
    return teraio.offload(model, optimizer, **kwargs), described


def make_deepspeed(args: argparse.Namespace, model: torch.nn.Module) -> tuple[Any, dict]:
    import bench_deepspeed

    bench_deepspeed.init_single_process()
    import deepspeed

    if args.mode == "zero_infinity":
        nvme_dir = os.path.join(args.work_dir, args.mode)
        os.makedirs(nvme_dir, exist_ok=True)
        # Its swap files: bf16 parameters, fp32 master weights, two moments and gradients.
        swap = 18 * sum(p.numel() for p in model.parameters())
        free = shutil.disk_usage(nvme_dir).free
        if free - swap < DISK_KEPT_FREE:
            raise RuntimeError(
                f"ZeRO-Infinity's ~{swap / GIB:.1f} GiB of swap files would leave less than "
                f"{DISK_KEPT_FREE / GIB:g} GiB of the {free / GIB:.1f} GiB free under {nvme_dir}"
            )
        config = bench_deepspeed.zero_config(
            stage=3,
            batch=args.batch,
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_dir=nvme_dir,
            bf16=True,
            param_buffer_elements=param_buffer_elements(model),
        )
        # One swap buffer per parameter in flight: the default 5 cannot hold one decoder layer's
        # ~12 parameters ("Not enough buffers 0 for swapping 1" on the H100); 40 hold three.
        config["zero_optimization"]["offload_param"]["buffer_count"] = ZERO_INFINITY_PARAM_BUFFERS
    else:
        config = bench_deepspeed.zero_config(
            stage=args.zero_offload_stage, batch=args.batch, offload_optimizer="cpu", bf16=True
        )
        # The ZeRO-Offload tutorial's buckets: the defaults (5e8 elements) take 1 GB each.
        config["zero_optimization"].update(reduce_bucket_size=int(2e8), allgather_bucket_size=int(2e8))
    config["gradient_accumulation_steps"] = args.accumulate
    if args.clip is not None:
        config["gradient_clipping"] = args.clip
    baselines.enable_hf_checkpointing(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, {"deepspeed": deepspeed.__version__, "config": config}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    result: dict[str, Any] = {}
    if args.mode in DEEPSPEED_MODES and not cuda:
        raise RuntimeError("DeepSpeed modes need CUDA")
    if args.accumulate < 1:
        raise ValueError(f"--accumulate must be at least 1, not {args.accumulate}")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    began = time.monotonic()
    setup_s: dict[str, float] = {}
    # Built on the device in every mode, from the same seed: the same initial weights in every
    # row (a 1.5B build on the CPU takes ~50 s on 2 cores). Under the cap the fp32 model
    # (6.2 GB) fits; DeepSpeed casts and partitions it from there.
    cap = None
    if args.mode != "reference" and (cuda or args.cap_gib_given):
        cap = int(args.cap_gib * GIB)
        if cuda:
            apply_cap(cap)
    model = bench_regime.build_model(args.family, "autocast", device, args.tiny, seed=args.seed)
    setup_s["build"] = round(time.monotonic() - began, 1)
    params = sum(p.numel() for p in model.parameters())
    state = bench_regime.model_state_bytes(model)
    # Each step takes `--accumulate` micro-batches of `--batch` rows.
    micro = bench_regime.make_batches(
        args.steps * args.accumulate, args.batch, args.seq, model.config.vocab_size
    )
    batches = [micro[i : i + args.accumulate] for i in range(0, len(micro), args.accumulate)]
    if args.mode != "reference" and cap is None:
        cap = tiny_cap(model, batches[0][0])
    result.update(
        params=params,
        vocab=model.config.vocab_size,
        model_state_bytes=state,
        largest_parameter_elements=largest_parameter_elements(model),
        cap_bytes=cap,
        state_over_cap=round(state / cap, 2) if cap else None,
    )
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(0)
        result["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory

    engine = None
    outer: Any = contextlib.nullcontext()
    if args.mode in DEEPSPEED_MODES:
        engine, result["setup"] = make_deepspeed(args, model)
        optimizer = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        if args.mode in TERAIO_MODES:
            outer, result["setup"] = make_teraio(args, model, optimizer, cap)
    setup_s["engine"] = round(time.monotonic() - began - setup_s["build"], 1)
    result["setup_s"] = setup_s
    print(f"  [{args.mode}] setup: {setup_s} s", flush=True)

    losses: list[float] = []
    times_ms: list[float] = []
    peaks: list[int] = []
    io_at_warmup: dict[str, int] = {}
    step = 0
    sampler = HostMemorySampler()
    try:
        with sampler, outer:
            for step, step_batches in enumerate(batches):
                # Stop before a step that would not end inside the time budget: the row then
                # reports its steps so far, with every figure, instead of being killed.
                spent = time.monotonic() - STARTED
                if args.time_budget_s and times_ms and spent + 1.2 * max(times_ms) / 1e3 > args.time_budget_s:
                    result["stopped_early"] = f"time budget: {step} of {args.steps} steps in {spent:.0f} s"
                    print(f"  [{args.mode}] {result['stopped_early']}", flush=True)
                    break
                if step == args.warmup:
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    io_at_warmup = proc_io()
                step_batches = [tokens.to(device) for tokens in step_batches]
                started = time.perf_counter()
                trace = os.path.join(args.trace_dir or args.work_dir, f"trace-{args.mode}-s{step}.json")
                with profiled(step == args.profile_step, trace):
                    step_losses = []
                    if engine is not None:
                        # DeepSpeed accumulates and clips by its config; its step() acts at the
                        # accumulation boundary.
                        for tokens in step_batches:
                            loss = engine(input_ids=tokens, labels=tokens).loss
                            engine.backward(loss)
                            engine.step()
                            step_losses.append(loss.item())
                    else:
                        for tokens in step_batches:
                            with torch.autocast(device.type, dtype=torch.bfloat16):
                                loss = model(input_ids=tokens, labels=tokens).loss
                            (loss / args.accumulate if args.accumulate > 1 else loss).backward()
                            step_losses.append(loss.item())
                        if args.clip is not None:
                            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                        optimizer.step()
                        optimizer.zero_grad()
                    losses.append(statistics.fmean(step_losses))
                if cuda:
                    torch.cuda.synchronize()
                    peaks.append(torch.cuda.max_memory_allocated())
                times_ms.append((time.perf_counter() - started) * 1e3)
                print(f"  [{args.mode}] step {step}: loss {losses[-1]:.6f} {times_ms[-1]:.0f} ms", flush=True)
            io_end = proc_io()
            if args.mode == "zero_infinity":
                result["swap_folder_bytes"] = disk_bytes(os.path.join(args.work_dir, args.mode))
    except torch.cuda.OutOfMemoryError as error:
        result.update(oom=True, oom_step=step, error="CUDA out of memory: " + str(error).split("\n")[0])
        io_end = {}
    except Exception as error:  # the row keeps the steps before it, and says what stopped it
        traceback.print_exc()
        result.update(error_step=step, error=f"{type(error).__name__}: {error}"[:800])
        io_end = {}
    result.update(losses=losses, step_ms=times_ms)
    if args.mode == "reference" and cuda:
        result["gpu_holds_whole_model"] = not result.get("oom")
    timed = times_ms[args.warmup :]
    if timed and "error" not in result:
        result["ms_per_iter"] = statistics.median(timed)
    window = peaks[args.warmup :] or peaks
    if window:
        result["peak_allocated_bytes"] = max(window)
    result["peak_host_rss_bytes"] = sampler.peak["rss"] or None
    result["peak_host_locked_bytes"] = sampler.peak["locked"]
    result["peak_pinned_torch_bytes"] = pinned_host_peak()
    result["max_rss_whole_process_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    measured_steps = len(times_ms) - args.warmup
    if io_at_warmup and io_end and measured_steps > 0:
        result["proc_io_per_iteration"] = {
            k: (io_end[k] - io_at_warmup.get(k, 0)) // measured_steps for k in io_end if k in io_at_warmup
        }
    if args.mode in DEEPSPEED_MODES:
        result["traffic_estimate"] = deepspeed_traffic_estimate(args.mode, params)
    if args.mode in TERAIO_MODES:
        with contextlib.suppress(Exception):  # a report is extra: a failed one must not hide the run
            report = outer.report()
            fields = report.as_dict() if hasattr(report, "as_dict") else dict(getattr(report, "__dict__", {}))
            result["teraio_report"] = bench_regime.jsonable(fields)
            result["tier_bytes_per_iteration"] = tier_bytes(fields)
            # Over the host link per kind (parameters in, gradients out: at the compute copies'
            # dtype where they are on), next to the least the placement needs.
            if "compute_copies" in fields:
                result["compute_copies"] = f"{fields['compute_copies']} ({fields['compute_copies_reason']})"
            for name, key in (
                ("host_bytes_by_kind", "bytes_per_iteration"),
                ("host_least_by_kind", "minimum_bytes_moved"),
            ):
                result[name] = {d: dict(t.get("host", {})) for d, t in (fields.get(key) or {}).items()}
            print(str(report), flush=True)
        with contextlib.suppress(Exception):
            result["predicted_ms_by_devices"] = predictions_by_devices(outer, args.store_devices)
        if args.record_out:
            save_record(outer, args.record_out)
    return result


def save_record(run: Any, path: str) -> None:
    """The recorded iteration (trace, schedule, its GPU span) and the bandwidths the runtime
    planned with, as JSON: to replay it again elsewhere (`ScheduleRecord.replay`)."""
    record = run.recorder.result() if hasattr(run, "recorder") else None
    if record is None:
        print(f"no recorded iteration to save to {path}", flush=True)
        return
    with open(path, "w") as f:
        json.dump({"record": dataclasses.asdict(record), "link": dataclasses.asdict(run.link)}, f)


#: Device counts the array table predicts from each row's recorded iteration.
PREDICTED_DEVICE_COUNTS = (1, 2, 4, 8)


def predictions_by_devices(offload: Any, devices: int) -> dict[int, Optional[float]]:
    """Whole-model rows: the recorded iteration replayed with the store's bandwidth scaled from
    `devices` to each of `PREDICTED_DEVICE_COUNTS` devices (ms; the array table's predictions
    from one row)."""
    link = offload.link
    out: dict[int, Optional[float]] = {}
    for count in PREDICTED_DEVICE_COUNTS:
        scale = count / devices
        read, write = link.ssd_read * scale, link.ssd_write * scale
        replay = offload.predict(ssd_bandwidth=read, ssd_write_bandwidth=write)
        out[count] = replay["iteration_ms"] if replay else None
    return out


def row_base(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    return {
        "bench": "capacity",
        "family": args.family + ("-tiny" if args.tiny else ""),
        "mode": mode,
        "precision": "bf16 (DeepSpeed)" if mode in DEEPSPEED_MODES else "bf16 autocast, fp32 weights",
        "batch": args.batch,
        "accumulate": args.accumulate,
        "clip": args.clip,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
    }


def run_main(args: argparse.Namespace) -> int:
    try:
        result = run(args)
    except torch.cuda.OutOfMemoryError as error:  # before the first step: model, store, engine
        result = {"oom": True, "oom_step": -1, "error": "CUDA out of memory: " + str(error).split("\n")[0]}
    except Exception as error:  # a row that says what stopped the run
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"[:800]}
    finally:
        shutil.rmtree(os.path.join(args.work_dir, args.mode), ignore_errors=True)
    print("RESULT " + json.dumps({**row_base(args, args.mode), **result}, default=str), flush=True)
    return 0


# -- the table --------------------------------------------------------------------------------


def run_command(args: argparse.Namespace, mode: str) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "run", "--mode", mode, "--work-dir", args.work_dir]
    steps, warmup = args.steps, args.warmup
    if mode == "zero_infinity" and args.zero_infinity_steps:
        steps = args.zero_infinity_steps
        warmup = min(warmup, 1)  # its steps after the first run alike (~33 s each on the H100)
    command += ["--steps", str(steps), "--warmup", str(warmup)]
    flags = (
        "family",
        "batch",
        "accumulate",
        "clip",
        "seq",
        "seed",
        "store_gib",
        "ssd_host_memory",
        "store_devices",
        "profile_step",
    )
    for flag in flags + ("emulate", "trace_dir", "teraio_options"):
        value = getattr(args, flag)
        if value is not None:
            command += ["--" + flag.replace("_", "-"), str(value)]
    command += ["--zero-offload-stage", str(args.zero_offload_stage)]
    if args.record_out and mode in TERAIO_MODES:  # a directory in a table: one record per row
        command += ["--record-out", os.path.join(args.record_out, f"record-{mode}.json")]
    if args.cap_gib_given:
        command += ["--cap-gib", str(args.cap_gib)]
    if args.tiny:
        command.append("--tiny")
    return command


def table_row(args: argparse.Namespace, mode: str, started: float, log_path: str) -> dict[str, Any]:
    base = row_base(args, mode)
    if args.tiny and mode in DEEPSPEED_MODES:
        return {**base, "skipped": "needs CUDA + DeepSpeed (--tiny runs on the CPU)"}
    left = args.deadline_s - (time.monotonic() - started)
    if left < args.min_run_s:
        return {
            **base,
            "skipped": f"out of time ({args.deadline_s - left:.0f} s of {args.deadline_s:.0f} used)",
        }
    limit = args.teraio_timeout_s if mode in TERAIO_MODES else args.timeout_s
    timeout = min(limit, left)
    began = time.monotonic()
    with open(log_path, "w") as log:
        # The same process group as the table: a `timeout` around the table ends the row too.
        # The row stops taking steps before its limit, leaving time to report and clean up.
        command = run_command(args, mode) + ["--time-budget-s", str(max(1.0, timeout - STOP_MARGIN_S))]
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            code: Optional[int] = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            code = None
    # The row's store or swap folder goes whatever happened (a killed row cannot clean up).
    row_dir = os.path.join(args.work_dir, mode)
    left_behind = disk_bytes(row_dir) if os.path.isdir(row_dir) else 0
    shutil.rmtree(row_dir, ignore_errors=True)
    with open(log_path) as f:
        found = [json.loads(line[7:]) for line in f if line.startswith("RESULT ")]
    if found:
        result = {**base, **found[-1]}
    elif code is None:
        why = "the row's limit" if timeout == limit else "the table's deadline"
        result = {**base, "timeout": True, "error": f"killed after {timeout:.0f} s ({why})"}
        result.update(steps_before_kill(log_path, mode))
    else:
        with open(log_path) as f:
            result = {**base, "error": f"exit code {code} without a result: {f.read()[-400:]}"}
    result["wall_s"] = round(time.monotonic() - began, 1)
    result["removed_after_row_bytes"] = left_behind
    result["log"] = os.path.basename(log_path)
    return result


def steps_before_kill(log_path: str, mode: str) -> dict[str, Any]:
    """The losses and step times a killed row printed (`run` prints one line per step)."""
    losses, times_ms = [], []
    prefix = f"  [{mode}] step "
    with open(log_path) as f:
        for line in f:
            if line.startswith(prefix):
                words = line.split()  # [mode] step N: loss X T ms
                losses.append(float(words[4]))
                times_ms.append(float(words[5]))
    return {"losses": losses, "step_ms": times_ms} if losses else {}


def partial_ms(r: dict[str, Any]) -> Optional[float]:
    """A killed row's median step time after the warm-up (None: no step after it finished)."""
    timed = (r.get("step_ms") or [])[r.get("warmup", 0) :]
    return statistics.median(timed) if timed else None


def status_of(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    if r.get("oom"):
        return f"out of memory at step {r.get('oom_step')}"
    if r.get("stopped_early"):
        ms = r.get("ms_per_iter")
        return "stopped at its " + r["stopped_early"] + (f" ({ms:.0f} ms/iter after warm-up)" if ms else "")
    if r.get("timeout"):
        text = f"{r['error']}, {len(r.get('losses') or [])} steps done"
        ms = partial_ms(r)
        return text + (f" (~{ms:.0f} ms/iter after warm-up)" if ms else "")
    if "ms_per_iter" not in r:
        where = f" at step {r['error_step']}" if "error_step" in r else ""
        return f"failed{where}: " + str(r.get("error", "?")).replace("|", "/").replace("\n", " ")[:160]
    return "ok"


def gb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def traffic(r: dict[str, Any]) -> tuple[str, str]:
    """(host tier, SSD tier) bytes per iteration, GB, each as out/in; estimates marked."""
    if r.get("tier_bytes_per_iteration") is not None:
        tiers = r["tier_bytes_per_iteration"]

        def cell(tier: str) -> str:
            moved = tiers.get(tier) or {}
            return " / ".join(f"{d} {gb(v)}" for d, v in sorted(moved.items())) or "0"

        return cell("host"), cell("ssd")
    estimate = r.get("traffic_estimate")
    if estimate:
        host = estimate.get("host") or {}
        ssd = estimate.get("ssd") or {}
        host_text = " / ".join(f"{d} {gb(v)}" for d, v in host.items()) or "-"
        ssd_text = " / ".join(f"{d} {gb(v)}" for d, v in ssd.items()) or "0"
        if r.get("swap_folder_bytes"):
            ssd_text += f"; swap folder {gb(r['swap_folder_bytes'])}"
        return f"{host_text} (est.)" if host else "-", f"{ssd_text} (est.)" if ssd else ssd_text
    return "-", "-"


def loss_agreement(r: dict[str, Any], reference: Optional[dict[str, Any]]) -> str:
    if reference is None or r is reference or not r.get("losses") or not reference.get("losses"):
        return "-"
    shape = ("family", "batch", "accumulate", "clip", "seq", "seed")
    if any(r.get(k) != reference.get(k) for k in shape):
        # Other batches are other losses: no agreement to state.
        ran = ", ".join(f"{k} {reference.get(k)}" for k in shape)
        return f"- (the reference ran {ran})"
    a, b = r["losses"], reference["losses"]
    n = min(len(a), len(b))
    diff = summarize.max_loss_diff(a, b)
    if diff == 0:
        return f"bitwise ({n} steps)"
    return f"max abs diff {diff:.2e} ({n} steps), not bitwise"


def markdown(rows: list[dict[str, Any]], reference: Optional[dict[str, Any]]) -> list[str]:
    lines = [
        "| mode | status | ms/iter | peak GPU alloc GiB | cap GiB | peak host RSS GiB "
        "| peak pinned (torch) / locked GiB | host tier GB/iter | SSD tier GB/iter "
        "| losses vs reference | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        host, ssd = traffic(r)
        pinned = summarize.gib(r.get("peak_pinned_torch_bytes"))
        pinned += " / " + summarize.gib(r.get("peak_host_locked_bytes"))
        ms = r.get("ms_per_iter")
        lines.append(
            f"| {r.get('row', r['mode'])} | {status_of(r)} | {'-' if ms is None else f'{ms:.0f}'} "
            f"| {summarize.gib(r.get('peak_allocated_bytes'))} | {summarize.gib(r.get('cap_bytes'))} "
            f"| {summarize.gib(r.get('peak_host_rss_bytes'))} | {pinned} | {host} | {ssd} "
            f"| {loss_agreement(r, reference)} | {r.get('wall_s', '-')} |"
        )
    with_losses = [r for r in rows if r.get("losses")]
    if with_losses:
        steps = max(len(r["losses"]) for r in with_losses)
        lines += ["", "| step | " + " | ".join(r.get("row", r["mode"]) for r in with_losses) + " |"]
        lines.append("| --- |" + " --- |" * len(with_losses))
        for i in range(steps):
            cells = [f"{r['losses'][i]:.6f}" if i < len(r["losses"]) else "-" for r in with_losses]
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return lines


def find_reference(rows: list[dict[str, Any]], path: Optional[str]) -> Optional[dict[str, Any]]:
    candidates = [r for r in rows if r.get("mode") == "reference"]
    if path:
        candidates += [r for r in summarize.load([path]) if r.get("mode") == "reference"]
    with_losses = [r for r in candidates if r.get("losses")]
    return with_losses[0] if with_losses else None


def table_main(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    results_path = os.path.join(args.out_dir, "results.jsonl")
    open(results_path, "w").close()
    started = time.monotonic()
    rows = []
    for i, mode in enumerate(modes):
        # A mode may repeat (reference,reference: is the reference itself bitwise reproducible?).
        name = mode if modes.count(mode) == 1 else f"{mode}-{modes[: i + 1].count(mode)}"
        free = shutil.disk_usage(args.work_dir).free
        r = table_row(args, mode, started, os.path.join(args.out_dir, f"capacity-{name}.log"))
        r["row"] = name
        r["disk_free_before_bytes"] = free
        rows.append(r)
        with open(results_path, "a") as f:
            f.write(json.dumps(r, default=str) + "\n")
        print(
            f"[{time.monotonic() - started:5.0f} s] {name}: {status_of(r)}"
            + (f", {r['ms_per_iter']:.0f} ms/iter" if "ms_per_iter" in r else ""),
            flush=True,
        )
    reference = find_reference(rows, args.reference_from)
    shape = rows[0] if rows else {}
    header = [
        f"Capacity: {shape.get('family')} ({shape.get('params', '?')} parameters), batch {args.batch} x "
        f"{args.seq}"
        + (f", {args.accumulate} micro-batches per step" if args.accumulate > 1 else "")
        + (f", clip_grad_norm_ at {args.clip:g}" if args.clip is not None else "")
        + f", {args.steps} steps ({args.warmup} warm-up), "
        + (
            "reference: " + ("this table" if reference in rows else str(args.reference_from))
            if reference
            else "no reference row"
        ),
        "",
    ]
    text = "\n".join(header + markdown(rows, reference))
    with open(os.path.join(args.out_dir, "capacity.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--family", choices=sorted(bench_regime.FAMILIES), default="qwen2")
    common.add_argument("--steps", type=int, default=10)
    common.add_argument("--warmup", type=int, default=3, help="steps left out of ms/iter")
    common.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    common.add_argument(
        "--accumulate", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)"
    )
    common.add_argument(
        "--clip", type=float, default=None, help="clip_grad_norm_ to this max norm before each step"
    )
    common.add_argument("--seq", type=int, default=None, help="default 2048; --tiny: 256")
    common.add_argument("--seed", type=int, default=0, help="the model's initial weights")
    common.add_argument(
        "--cap-gib", type=float, default=None, help="GPU memory cap (default 12; --tiny: see above)"
    )
    common.add_argument(
        "--work-dir", required=True, help="teraio's stores and DeepSpeed's swap folders, one per row"
    )
    common.add_argument(
        "--store-gib",
        type=float,
        default=None,
        help="teraio's store, over --store-devices files (default 40; --tiny: 0.25)",
    )
    common.add_argument("--ssd-host-memory", default=None, help='teraio_ssd\'s host_memory (default "8GiB")')
    common.add_argument("--store-devices", type=int, default=2, help="teraio's store: files (devices)")
    common.add_argument(
        "--emulate",
        default=None,
        help='each store device paced like an SSD, e.g. "6.5GB/s@20us" (work dir in tmpfs)',
    )
    common.add_argument("--zero-offload-stage", type=int, choices=[2, 3], default=2)
    common.add_argument("--tiny", action="store_true", help="CPU, 2 small layers (tests of this script)")
    common.add_argument(
        "--profile-step",
        type=int,
        default=-1,
        help="record this step with torch.profiler: a summary in the log, the trace in --trace-dir",
    )
    common.add_argument(
        "--teraio-options",
        default=None,
        help='extra teraio.offload options for the teraio rows, "name=value,..." (e.g. '
        '"pull_forward_bytes=1536MiB"); recorded in the row\'s setup',
    )
    common.add_argument(
        "--trace-dir", default=None, help="where --profile-step's trace goes (default: work dir)"
    )
    common.add_argument(
        "--record-out",
        default=None,
        help="teraio rows: write the recorded iteration here (JSON; for a table, a directory)",
    )

    one = commands.add_parser("run", parents=[common], help="one mode in this process")
    one.add_argument("--mode", choices=MODES, required=True)
    one.add_argument(
        "--time-budget-s", type=float, default=0, help="take no step that would end past this (0: no limit)"
    )

    many = commands.add_parser("table", parents=[common], help="every mode, one process each")
    many.add_argument("--modes", default=",".join(MODES))
    many.add_argument(
        "--out-dir", default=None, help="results.jsonl, logs, capacity.md (default: WORK_DIR/out)"
    )
    many.add_argument(
        "--zero-infinity-steps",
        type=int,
        default=0,
        help="steps of the zero_infinity row (default --steps), one of them warm-up: "
        "its ~33 s iterations and ~3 min set-up on the H100 leave room for little else in one call",
    )
    many.add_argument("--reference-from", default=None, help="a results.jsonl with a reference row")
    many.add_argument("--deadline-s", type=float, default=3000.0, help="no row starts after this")
    many.add_argument("--timeout-s", type=float, default=600.0, help="limit per reference/DeepSpeed row")
    many.add_argument("--teraio-timeout-s", type=float, default=600.0, help="limit per teraio row")
    many.add_argument("--min-run-s", type=float, default=30.0, help="no row starts with less time left")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    if args.seq is None:
        args.seq = 256 if args.tiny else 2048
    if args.store_gib is None:
        args.store_gib = 0.25 if args.tiny else 40.0
    args.cap_gib_given = args.cap_gib is not None
    if args.cap_gib is None:
        args.cap_gib = 12.0
    if args.ssd_host_memory is None and not args.tiny:
        args.ssd_host_memory = "8GiB"
    args.work_dir = os.path.abspath(args.work_dir)
    if args.command == "run":
        return run_main(args)
    if args.out_dir is None:
        args.out_dir = os.path.join(args.work_dir, "out")
    if args.trace_dir is None:
        args.trace_dir = args.out_dir
    return table_main(args)


if __name__ == "__main__":
    sys.exit(main())
