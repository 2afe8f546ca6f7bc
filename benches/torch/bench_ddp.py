"""Data-parallel Llama training with teraio offload: one store per rank, losses vs one GPU.

The same global batch trains three ways; each run prints one `RESULT {json}` line (rank 0):

    # one GPU, the whole global batch (world size 1, no DDP): the loss reference
    python3 benches/torch/bench_ddp.py --mode reference --global-batch 8
    # DistributedDataParallel, rank r trains rows [r*B/W, (r+1)*B/W) of every global batch
    torchrun --standalone --nproc-per-node 2 benches/torch/bench_ddp.py --mode ddp-plain --global-batch 8
    # the same with `teraio.offload` per rank under a per-rank GPU memory cap
    torchrun --standalone --nproc-per-node 2 benches/torch/bench_ddp.py --mode ddp-teraio \
        --global-batch 8 --cap-gib 22.5 --host-gib 48 --store-dir /root/teraio-ddp

`--device cpu` runs the same loop on gloo with a tiny token model (for tests and CPU-only
machines); `--device cuda` uses NCCL, one GPU per local rank, and bench_llama.py's model
(LlamaForCausalLM, 0.85B parameters, eager attention, fp32, TF32 off, AdamW lr 1e-4).

The global loss of a step is the mean of the rank losses (all_reduce): every rank has the same
number of tokens and no label is ignored, so it equals the reference's loss on the whole batch up
to rounding. The result has ms/iter (median of the steps after the warm-up ones), the global
losses, each rank's peak memory and, for ddp-teraio, each rank's `report().as_dict()` with bytes
per tier per iteration turned into GB/s over the measured iteration time, and the stalls. Two
checksums of the final parameters (rank 0's; DDP keeps the ranks equal) let runs be compared:
`param_checksum` (sum of float64 sums) and `param_fingerprint` (sum of the raw bits as integers:
equal fingerprints mean bitwise-equal parameters, barring a collision).
`benches/torch/compare_ddp.py` prints the table; `benches/torch/run-ddp.sh` runs all of it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

# bench_llama.py sits next to this file; its model and batches are the ones we compare against.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_llama

GIB = 1 << 30
MODES = ("reference", "ddp-plain", "ddp-teraio")


# -- the tiny CPU model ---------------------------------------------------------------------------


@dataclass
class Output:
    """What the training loop reads from a model call (transformers' outputs have `.loss` too)."""

    loss: torch.Tensor


class TinyLM(torch.nn.Module):
    """A small token model for `--device cpu`: embedding, MLP blocks, LM head, shifted CE loss.

    It takes bench_llama's batches (token ids below 32000) modulo its vocabulary, so the data
    pipeline and the loss (next-token cross entropy, mean over all tokens) are the Llama run's.
    """

    def __init__(self, vocab: int = 4096, dim: int = 128, hidden: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = torch.nn.Embedding(vocab, dim)
        self.ups = torch.nn.ModuleList([torch.nn.Linear(dim, hidden) for _ in range(layers)])
        self.downs = torch.nn.ModuleList([torch.nn.Linear(hidden, dim) for _ in range(layers)])
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Output:
        x = self.embed(input_ids % self.vocab)
        for up, down in zip(self.ups, self.downs):
            x = x + down(F.gelu(up(x)))
        logits = self.head(x)[:, :-1]
        targets = (labels % self.vocab)[:, 1:]
        return Output(F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1)))


def build_model(device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The same initial weights on every rank and in the reference (seeded, built the same way)."""
    if device.type == "cuda":
        # bench_llama builds on "cuda", i.e. the current device (set to this rank's GPU).
        return bench_llama.build_model(seed=seed)
    torch.manual_seed(seed)
    return TinyLM()


# -- distributed plumbing ---------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def setup(args: argparse.Namespace) -> Dist:
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.mode == "reference":
        if launched and int(os.environ["WORLD_SIZE"]) != 1:
            raise SystemExit("--mode reference runs on one device: start it with python3, not torchrun")
        launched = False
    elif not launched:
        raise SystemExit(f"--mode {args.mode} needs torchrun (RANK / WORLD_SIZE are not set)")
    rank = int(os.environ.get("RANK", 0)) if launched else 0
    world = int(os.environ.get("WORLD_SIZE", 1)) if launched else 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if launched else 0
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if launched:
        # A rank that fails exits non-zero and torchrun stops the others; the timeout bounds a hang.
        timeout = datetime.timedelta(seconds=args.collective_timeout_s)
        if device.type == "cuda":
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return Dist(rank, world, local_rank, device)


def gather(value: Any, d: Dist) -> list[Any]:
    """Every rank's `value` (a picklable object), in rank order, on every rank."""
    if d.world == 1 or not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * d.world
    dist.all_gather_object(out, value)
    return out


def global_loss(loss: torch.Tensor, d: Dist) -> float:
    """Mean of the rank losses: equal token counts per rank make it the whole batch's loss."""
    value = loss.detach().clone()
    if d.world > 1:
        # SUM then divide: ReduceOp.AVG exists on NCCL only, and this keeps gloo and NCCL alike.
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= d.world
    return float(value.item())


def param_checksums(model: torch.nn.Module) -> tuple[float, int]:
    """(sum of float64 sums, sum of raw bits as int64) over all parameters, in parameter order."""
    total = 0.0
    bits = 0
    with torch.no_grad():
        for param in model.parameters():
            total += float(param.double().sum().item())
            # Reinterpret the bits as integers of the element's width: an exact, order-free sum.
            width = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(param.element_size(), torch.uint8)
            raw = param.detach().contiguous().view(-1).view(width)
            bits += int(raw.to(torch.int64).sum().item())
    return total, bits


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- teraio ---------------------------------------------------------------------------------------


def make_offload(
    args: argparse.Namespace, d: Dist, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Any, Any, dict[str, Any]]:
    """This rank's store and `teraio.offload`, as bench_llama.py sets them up (its measurements too)."""
    import teraio

    if args.cap_gib:
        budget = int(args.cap_gib * GIB)
    elif args.gpu_memory_gib:
        budget = int(args.gpu_memory_gib * GIB)
    else:
        raise SystemExit("--mode ddp-teraio needs --cap-gib or --gpu-memory-gib (the per-rank budget)")
    info: dict[str, Any] = {"rank": d.rank}
    store_dir = os.path.join(args.store_dir, f"rank{d.rank}")
    os.makedirs(store_dir, exist_ok=True)
    store = teraio.Store.create(
        [os.path.join(store_dir, "dev0")],
        file_size_bytes=int(args.store_gib * GIB),
        durable=False,
        force=True,
    )
    if d.device.type == "cuda":
        # All ranks measure at once: PCIe links and (when the stores share a disk) the SSD are
        # measured as the training will use them, concurrently.
        if d.world > 1:
            dist.barrier()
        d2h, h2d = bench_llama.measure_link_bytes_per_s()
        write, read = bench_llama.measure_store_bytes_per_s(store)
        info.update(
            link_d2h_bytes_per_s=d2h,
            link_h2d_bytes_per_s=h2d,
            ssd_write_bytes_per_s=write,
            ssd_read_bytes_per_s=read,
        )
        link = min(d2h, h2d) * 0.9
        # Stores of several ranks on one disk share it: each rank plans with its share.
        disks: list[Any] = [None] * d.world
        if d.world > 1:
            dist.all_gather_object(disks, os.stat(store_dir).st_dev)
        sharing = max(1, sum(1 for disk in disks if disk == os.stat(store_dir).st_dev))
        read, write = read / sharing, write / sharing
        info["ranks_per_disk"] = sharing
    else:
        # No pinned memory without CUDA: assume the figures given on the command line.
        write = read = args.ssd_gbps * 1e9
        link = args.link_gbps * 1e9
    out_dir = args.out_dir
    extra: dict[str, Any] = {}
    if args.no_state_offload:
        # Only when asked: teraio wheels from before optimizer-state offload lack the option.
        extra["offload_optimizer_state"] = False
    handle = teraio.offload(
        model,
        optimizer,
        store=store,
        gpu_memory=budget,
        host_memory=int(args.host_gib * GIB),
        ssd_bandwidth=read * args.ssd_share,
        ssd_write_bandwidth=write * args.ssd_share,
        # The measured figures are each direction alone: a store device serves reads and
        # writes one after another.
        ssd_shared=True,
        host_link_bandwidth=link,
        reserve=int(args.reserve_gib * GIB),
        min_bytes=args.min_bytes,
        max_inflight_bytes=int(args.max_inflight_gib * GIB),
        # DDP rebuilds its gradient buckets in the second iteration's forward (a broadcast of the
        # bucket order, new bucket tensors while the old ones are still referenced). With one
        # warm-up step teraio would profile that iteration; two make the profiled one steady.
        warmup_steps=args.teraio_warmup_steps,
        trace_path=os.path.join(out_dir, f"ddp-trace-rank{d.rank}.json") if out_dir else None,
        plan_path=os.path.join(out_dir, f"ddp-plan-rank{d.rank}.json") if out_dir else None,
        **extra,
    )
    info["gpu_memory_bytes"] = budget
    return handle, store, info


def bandwidths(report: dict[str, Any], ms_per_iter: float) -> dict[str, float]:
    """Bytes per iteration per direction and tier as GB/s (1e9) over the measured iteration time.

    Keys: "offloaded_host", "prefetched_ssd", ... (activations) and, where the report has
    optimizer-state traffic (`state_bytes_per_iteration`), "state_offloaded_host", ...
    """
    seconds = ms_per_iter / 1e3 if ms_per_iter else 0.0
    out: dict[str, float] = {}
    for key, prefix in (("bytes_per_iteration", ""), ("state_bytes_per_iteration", "state_")):
        for direction, tiers in (report.get(key) or {}).items():
            for tier, nbytes in tiers.items():
                out[f"{prefix}{direction}_{tier}"] = nbytes / seconds / 1e9 if seconds else 0.0
    return out


# -- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace, d: Dist) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.global_batch % d.world:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {d.world} ranks")
    per_rank = args.global_batch // d.world
    result: dict[str, Any] = {
        "mode": args.mode,
        "device": args.device,
        "world_size": d.world,
        "global_batch": args.global_batch,
        "batch_per_rank": per_rank,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    if d.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(d.device)
        if args.cap_gib:
            cap = int(args.cap_gib * GIB)
            total = torch.cuda.get_device_properties(d.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), d.device)
            result["cap_bytes"] = cap
    model = build_model(d.device)
    result["params"] = sum(p.numel() for p in model.parameters())
    train_model: torch.nn.Module = model
    if args.mode != "reference":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # gradient_as_bucket_view: the gradients are the all-reduce buckets, not a second copy
        # of them (3.4 GB for the Llama model), which matters under a cap.
        train_model = DDP(
            model,
            device_ids=[d.local_rank] if d.device.type == "cuda" else None,
            gradient_as_bucket_view=args.bucket_view,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # Every rank draws the same global batches and keeps its rows.
    batches = [
        b[d.rank * per_rank : (d.rank + 1) * per_rank]
        for b in bench_llama.make_batches(args.steps, args.global_batch, args.seq)
    ]
    outer: Any = contextlib.nullcontext()
    handle = None
    store = None
    if args.mode == "ddp-teraio":
        # The DDP wrapper is what the loop calls: its forward is what the profiler sees.
        handle, store, info = make_offload(args, d, train_model, optimizer)
        result["teraio_setup"] = gather(info, d)
        outer = handle
    losses: list[float] = []
    rank_losses: list[float] = []
    times_ms: list[float] = []
    tag = f"[{args.mode} w{d.world} B{args.global_batch}]"
    if d.world > 1:
        dist.barrier()
    with outer:
        for step, tokens in enumerate(batches):
            if step == args.warmup and d.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d.device)
            tokens = tokens.to(d.device, non_blocking=True)
            sync(d.device)
            started = time.perf_counter()
            loss = train_model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rank_losses.append(float(loss.item()))
            losses.append(global_loss(loss, d))
            sync(d.device)
            times_ms.append((time.perf_counter() - started) * 1e3)
            if d.rank == 0:
                print(f"  {tag} step {step}: loss {losses[-1]:.6f} {times_ms[-1]:.0f} ms", flush=True)
    peak: Optional[int] = None
    if d.device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(d.device))
    measured = times_ms[args.warmup :] if len(times_ms) > args.warmup else times_ms
    ms_per_iter = statistics.median(measured)
    mine: dict[str, Any] = {
        "rank": d.rank,
        "ms_per_iter": ms_per_iter,
        "step_ms": times_ms,
        "losses": rank_losses,
    }
    if handle is not None:
        report = handle.report()
        if report.peak_gpu_bytes is not None:
            # teraio.offload resets the peak at each iteration boundary: take its own figure.
            peak = report.peak_gpu_bytes
        as_dict = report.as_dict()
        mine["teraio_report"] = as_dict
        mine["teraio_report_text"] = str(report)
        mine["gbps"] = bandwidths(as_dict, ms_per_iter)
    mine["peak_bytes"] = peak
    if store is not None:
        mine["store_stats"] = store.stats()
        store.close()
    ranks = gather(mine, d)
    checksum, fingerprint = param_checksums(model)
    result.update(
        {
            "ms_per_iter": ms_per_iter,
            "ms_per_iter_mean": statistics.fmean(measured),
            "step_ms": times_ms,
            "losses": losses,
            "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
            "ms_per_iter_per_rank": [r["ms_per_iter"] for r in ranks],
            "rank_losses": [r["losses"] for r in ranks],
            "param_checksum": checksum,
            "param_fingerprint": fingerprint,
        }
    )
    if handle is not None:
        result["teraio"] = [
            {k: r[k] for k in ("rank", "teraio_report", "gbps", "store_stats") if k in r} for r in ranks
        ]
        if d.rank == 0:
            for r in ranks:
                print(f"rank {r['rank']}: " + r["teraio_report_text"], flush=True)
                print(
                    f"rank {r['rank']}: GB/s over {r['ms_per_iter']:.1f} ms/iter: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in r["gbps"].items()),
                    flush=True,
                )
    if d.rank == 0:
        print(f"param checksum {checksum!r} fingerprint {fingerprint}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--global-batch", type=int, default=8, help="rows per step over all ranks")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--cap-gib", type=float, default=0.0, help="per-rank set_per_process_memory_fraction")
    parser.add_argument(
        "--gpu-memory-gib", type=float, default=0.0, help="teraio's per-rank budget without a cap (CPU runs)"
    )
    parser.add_argument("--host-gib", type=float, default=48.0, help="pinned host memory per rank")
    parser.add_argument("--reserve-gib", type=float, default=3.0)
    parser.add_argument("--max-inflight-gib", type=float, default=2.0, help="device-to-host bytes in flight")
    parser.add_argument("--min-bytes", type=int, default=1 << 20, help="smaller saved tensors stay put")
    parser.add_argument(
        "--teraio-warmup-steps", type=int, default=2, help="teraio.offload iterations before the profiled one"
    )
    parser.add_argument("--no-state-offload", action="store_true", help="keep optimizer state on the GPU")
    parser.add_argument(
        "--ssd-share", type=float, default=0.9, help="share of the measured SSD bandwidth the plan may use"
    )
    parser.add_argument("--ssd-gbps", type=float, default=2.0, help="assumed SSD GB/s (CPU runs)")
    parser.add_argument("--link-gbps", type=float, default=25.0, help="assumed host link GB/s (CPU runs)")
    parser.add_argument("--store-dir", default="/root/teraio-ddp", help="rank r's store: DIR/rank<r>/dev0")
    parser.add_argument("--store-gib", type=float, default=24.0, help="store file size per rank")
    parser.add_argument(
        "--bucket-view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DDP gradient_as_bucket_view",
    )
    parser.add_argument("--collective-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default="", help="JSONL file rank 0 appends its RESULT to")
    parser.add_argument("--out-dir", default="", help="where ddp-teraio writes each rank's trace and plan")
    args = parser.parse_args(argv)
    d = setup(args)
    status = 0
    try:
        result = run(args, d)
    except Exception as error:  # report whatever stopped the run (this rank's)
        traceback.print_exc()
        if d.device.type == "cuda" and isinstance(error, torch.cuda.OutOfMemoryError):
            message = "CUDA out of memory: " + str(error).split("\n")[0]
        else:
            message = f"{type(error).__name__}: {error}"[:600]
        result = {"mode": args.mode, "world_size": d.world, "rank": d.rank, "error": message}
        # Non-zero: torchrun then stops the other ranks instead of leaving them in a collective.
        status = 1
    if d.rank == 0 or status:
        line = json.dumps(result)
        print("RESULT " + line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    if status == 0 and dist.is_initialized():
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
