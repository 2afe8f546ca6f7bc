"""Llama-shaped fp32 AdamW training under a GPU memory cap: teraio vs ideal vs other offloaders.

One mode per process (each needs its own CUDA memory state and cap):

    python3 benches/torch/bench_llama.py --mode ideal --steps 20
    python3 benches/torch/bench_llama.py --mode teraio --cap-gib 25.5 --store-dir /root/teraio-bench
    python3 benches/torch/bench_llama.py --mode save_on_cpu --cap-gib 25.5 --steps 8
    python3 benches/torch/bench_llama.py --mode hf_ckpt --cap-gib 22.5 --steps 8   # checkpointing
    python3 benches/torch/bench_llama.py --mode teraio --cap-gib 22.5 --user-defaults
    python3 benches/torch/bench_llama.py --mode teraio --cap-gib 22.5 --host-gib 4 \
        --store-dir /dev/shm/teraio --store-devices 4 --emulate 2.5GB/s@20us   # emulated SSD array

Prints one JSON line (prefix `RESULT `) with ms/iter (wall time of the steps after the warm-up
ones, synchronized at both ends of that window, divided by their number),
peak GPU memory over those steps, the losses, and for teraio its report. teraio runs with this
machine's measured link and store bandwidths unless `--user-defaults` (the call a user writes);
`hf_ckpt` is Hugging Face's gradient checkpointing (every decoder layer, use_reentrant=False).
Model: transformers' LlamaForCausalLM, 14 layers, hidden 2048, 16 heads, FFN 5632, vocab 32000
(0.85B parameters), eager attention (deterministic, so losses can be compared bitwise), fp32
weights and math (TF32 off, PyTorch's default), AdamW.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines

GIB = 1 << 30


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=14,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def make_batches(steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 32000, (batch, seq), generator=generator) for _ in range(steps)]


def measure_link_bytes_per_s() -> tuple[float, float]:
    """Pinned host <-> GPU copy bandwidth (1 GiB each way), bytes/s."""
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    rates = []
    for direction in ("d2h", "h2d"):
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            if direction == "d2h":
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            best = max(best, GIB / (time.perf_counter() - started))
        rates.append(best)
    del host, dev
    return rates[0], rates[1]


def measure_store_bytes_per_s(store: Any) -> tuple[float, float]:
    """Engine write and read bandwidth from pinned memory, 2 GiB in 256 MiB objects."""
    chunk = 256 << 20
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True).random_(0, 255) for _ in range(8)]
    started = time.perf_counter()
    handles = [store.put_async((1 << 50) + i, b) for i, b in enumerate(bufs)]
    for h in handles:
        h.wait()
    write = 8 * chunk / (time.perf_counter() - started)
    outs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(8)]
    started = time.perf_counter()
    handles = [store.get_async((1 << 50) + i, o) for i, o in enumerate(outs)]
    for h in handles:
        h.wait()
    read = 8 * chunk / (time.perf_counter() - started)
    assert all(torch.equal(a, b) for a, b in zip(bufs, outs)), "store round trip mismatch"
    for i in range(8):
        store.delete((1 << 50) + i)
    return write, read


@contextlib.contextmanager
def kineto_profile(args: argparse.Namespace, step: int) -> Any:
    """Records step `--kineto-step` with torch.profiler (CPU and CUDA timelines) into
    `--out-dir`/kineto-b<batch>.json.gz, to see where the GPU idles; other steps run bare."""
    if step != args.kineto_step:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        yield
        torch.cuda.synchronize()
    path = os.path.join(args.out_dir or ".", f"kineto-b{args.batch}.json")
    profile.export_chrome_trace(path)
    with open(path, "rb") as plain, gzip.open(path + ".gz", "wb") as packed:
        shutil.copyfileobj(plain, packed)
    os.remove(path)


def offload_with_measurements(
    teraio: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    store: Any,
    cap: int,
    args: argparse.Namespace,
    result: dict[str, Any],
) -> Any:
    """teraio.offload with this machine's measured link and store bandwidths and the flags'
    settings (the figures go into `result`)."""
    d2h, h2d = measure_link_bytes_per_s()
    result["link_d2h_bytes_per_s"], result["link_h2d_bytes_per_s"] = d2h, h2d
    write, read = measure_store_bytes_per_s(store)
    result["ssd_write_bytes_per_s"], result["ssd_read_bytes_per_s"] = write, read
    return teraio.offload(
        model,
        optimizer,
        store=store,
        gpu_memory=cap,
        host_memory=int(args.host_gib * GIB),
        ssd_bandwidth=read * args.ssd_share,
        ssd_write_bandwidth=write * args.ssd_share,
        # The measured figures are each direction alone: a store device serves reads and
        # writes one after another.
        ssd_shared=True,
        host_link_bandwidth=min(d2h, h2d) * args.link_scale,
        reserve=int(args.reserve_gib * GIB),
        max_inflight_bytes=int(args.max_inflight_gib * GIB),
        offload_optimizer_state=not args.no_state_offload,
        offload_parameters=args.offload_parameters,
        prefetch_slack=args.prefetch_slack,
        op_time_scale=args.op_time_scale,
        tier_preference=args.tier_preference,
        recompute=args.recompute,
        copy_streams=args.copy_streams,
        pull_forward_bytes=int(args.pull_forward_gib * GIB),
        trace_path=os.path.join(args.out_dir, f"trace-b{args.batch}.json") if args.out_dir else None,
        plan_path=os.path.join(args.out_dir, f"plan-b{args.batch}.json") if args.out_dir else None,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    total = torch.cuda.get_device_properties(0).total_memory
    result: dict[str, Any] = {
        "family": "llama-0.85b",
        "dtype": "fp32",
        "mode": args.mode,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
    }
    if args.cap_gib:
        cap = int(args.cap_gib * GIB)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        result["cap_bytes"] = cap
    model = build_model()
    result["params"] = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(args.steps, args.batch, args.seq)
    forward_context: Callable[[], Any] = contextlib.nullcontext
    outer: Any = contextlib.nullcontext()
    run_handle = None
    if args.mode == "save_on_cpu":

        def forward_context() -> Any:
            return torch.autograd.graph.save_on_cpu(pin_memory=True)

    elif args.mode == "torchtune":
        offloader = baselines.load_torchtune_offloader()

        def forward_context() -> Any:
            return offloader(use_pin_memory=True, use_streams=True)

    elif args.mode == "hf_ckpt":
        baselines.enable_hf_checkpointing(model)
        result["checkpointed_layers"] = baselines.checkpointed_layers(model)
    elif args.mode == "teraio":
        import teraio

        os.makedirs(args.store_dir, exist_ok=True)
        # An emulated array (--emulate) lives in tmpfs: no O_DIRECT there, and the device model,
        # not the memory copy, sets each device's pace.
        paths = [os.path.join(args.store_dir, f"dev{i}") for i in range(args.store_devices)]
        if args.emulate:
            # Allocate the tmpfs pages up front: first-touch page allocation would otherwise
            # slow the early writes below the device model's rate.
            for path in paths:
                with open(path, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, int(args.store_gib * GIB) // args.store_devices)
        store = teraio.Store.create(
            paths,
            file_size_bytes=int(args.store_gib * GIB) // args.store_devices,
            durable=False,
            force=True,
            direct_io=not args.emulate,
            emulate=args.emulate or None,
        )
        result["store_devices"] = args.store_devices
        result["emulate"] = args.emulate
        cap = int(args.cap_gib * GIB) if args.cap_gib else int(args.gpu_memory_gib * GIB)
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
        result["arguments"] = "defaults" if args.user_defaults else "measured"
        if args.user_defaults:
            # As docs/python.md tells a user to write it: the runtime measures and sizes the rest.
            outer = teraio.offload(model, optimizer, store=store, gpu_memory=cap)
        else:
            outer = offload_with_measurements(teraio, model, optimizer, store, cap, args, result)
        run_handle = outer
    losses: list[float] = []
    times_ms: list[float] = []
    peak = 0
    window_started = 0.0
    with outer:
        for step, tokens in enumerate(batches):
            if step == args.warmup:
                # The timed window: from here to the end, one device-wide sync at each edge (a
                # sync per step would also wait for offload copies a real loop overlaps with the
                # next iteration).
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                window_started = time.perf_counter()
            tokens = tokens.cuda(non_blocking=True)
            started = time.perf_counter()
            with kineto_profile(args, step):
                with forward_context():
                    loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())  # waits for the compute stream only
            times_ms.append((time.perf_counter() - started) * 1e3)
            print(
                f"  [{args.mode} b{args.batch}] step {step}: loss {losses[-1]:.6f} {times_ms[-1]:.0f} ms",
                flush=True,
            )
        torch.cuda.synchronize()
        window_ms = (time.perf_counter() - window_started) * 1e3
        peak = torch.cuda.max_memory_allocated()
    if run_handle is not None:
        # teraio.offload resets the peak at each iteration boundary: take its own figure.
        peak = run_handle.report().peak_gpu_bytes or peak
    timed = len(times_ms) - args.warmup
    measured = times_ms[args.warmup :] if timed > 0 else times_ms
    result.update(
        {
            "ms_per_iter": window_ms / timed if timed > 0 else statistics.median(measured),
            "ms_per_iter_median_step": statistics.median(measured),
            "step_ms": times_ms,
            "peak_bytes": peak,
            "losses": losses,
            "warmup": args.warmup,
        }
    )
    if run_handle is not None:
        report = run_handle.report()
        result["teraio_report"] = report.as_dict()
        result["teraio_report_text"] = str(report)
        print(report, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mode", choices=["ideal", "teraio", "hf_ckpt", "save_on_cpu", "torchtune"], required=True
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--cap-gib",
        type=float,
        default=0.0,
        help="torch.cuda.set_per_process_memory_fraction",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=76.0, help="teraio budget without a cap")
    parser.add_argument("--host-gib", type=float, default=64.0)
    parser.add_argument("--reserve-gib", type=float, default=3.0)
    parser.add_argument("--max-inflight-gib", type=float, default=2.0, help="device-to-host bytes in flight")
    parser.add_argument(
        "--ssd-share", type=float, default=0.9, help="share of the measured SSD bandwidth the plan may use"
    )
    parser.add_argument("--store-dir", default="/root/teraio-bench")
    parser.add_argument("--store-devices", type=int, default=1, help="files the store stripes over")
    parser.add_argument("--store-gib", type=float, default=24.0, help="store size, all devices")
    parser.add_argument("--emulate", default="", help="emulated SSDs, e.g. 2.5GB/s@20us (store in tmpfs)")
    parser.add_argument(
        "--user-defaults",
        action="store_true",
        help="teraio.offload(model, optimizer, store=store, gpu_memory=cap) and nothing else",
    )
    parser.add_argument("--no-state-offload", action="store_true", help="keep optimizer state on the GPU")
    parser.add_argument(
        "--offload-parameters", action="store_true", help="teraio.offload(offload_parameters=True)"
    )
    parser.add_argument("--prefetch-slack", type=float, default=1.0, help="teraio.offload(prefetch_slack=)")
    parser.add_argument("--op-time-scale", type=float, default=1.0, help="teraio.offload(op_time_scale=)")
    parser.add_argument(
        "--tier-preference",
        default="auto",
        choices=["auto", "host", "ssd"],
        help="teraio.offload(tier_preference=)",
    )
    parser.add_argument(
        "--recompute", default="auto", choices=["auto", "on", "off"], help="teraio.offload(recompute=)"
    )
    parser.add_argument(
        "--link-scale",
        type=float,
        default=0.9,
        help="the planner's host-link bandwidth: this times the slower measured direction",
    )
    parser.add_argument("--out-dir", default="")
    parser.add_argument("--copy-streams", type=int, default=2, help="teraio.offload(copy_streams=)")
    parser.add_argument(
        "--pull-forward-gib", type=float, default=0.5, help="teraio.offload(pull_forward_bytes=), GiB"
    )
    parser.add_argument("--kineto-step", type=int, default=-1, help="step to record with torch.profiler")
    parser.add_argument(
        "--allocator-settings",
        default="",
        help="CUDA caching allocator settings, e.g. garbage_collection_threshold:0.9",
    )
    args = parser.parse_args(argv)
    if args.allocator_settings:
        torch.cuda.memory._set_allocator_settings(args.allocator_settings)
    try:
        result = run(args)
    except torch.cuda.OutOfMemoryError as error:
        result = {
            "mode": args.mode,
            "batch": args.batch,
            "error": "CUDA out of memory: " + str(error).split("\n")[0],
        }
    except Exception as error:  # report whatever stopped the run
        traceback.print_exc()
        result = {
            "mode": args.mode,
            "batch": args.batch,
            "error": f"{type(error).__name__}: {error}"[:600],
        }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
