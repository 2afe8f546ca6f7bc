"""FSDP2 (`fully_shard`) training three ways on 2 ranks, one run: plain, CPUOffloadPolicy, teraio.

    python3 benches/torch/bench_fsdp.py                        # 2 GPUs (NCCL), the default size
    python3 benches/torch/bench_fsdp.py --device cpu --tiny    # 2 gloo processes, a tiny model

The script starts its ranks itself (torch.multiprocessing, spawn; a file rendezvous, so no
port). Each rank shards the same seeded model (an embedding, `--layers` pre-norm MLP blocks, a
head; every block and the root `fully_shard`ed) and trains `--steps` steps on its rows of every
global batch, for each configuration in turn:

- `fsdp`: FSDP2 alone;
- `fsdp_cpu_offload`: FSDP2 with `CPUOffloadPolicy` (sharded parameters, gradients and optimizer
  state live in host memory; the optimizer steps on the CPU);
- `fsdp_teraio`: FSDP2 inside `teraio.offload` with a budget of `--budget-share` (default 50%) of
  that rank's `fsdp` peak (measured by the allocator on a GPU, the profiled unplanned peak on the
  CPU) and one store per rank (`--store-dir`/rank<r>/dev0).

Rank 0 prints one `RESULT {json}` line per configuration: ms/iter (the slowest rank's median over
the steps after `--warmup`), each rank's peak, its bytes per tier per iteration (teraio's report:
activations and optimizer state; CPUOffloadPolicy: what it keeps in host memory) and stalls, and
the losses' agreement with `fsdp`: bitwise where the reduction order is the same (teraio), else
the largest difference. `benches/torch/run-fsdp.sh` runs it on the 2-GPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

GIB = 1 << 30
CONFIGS = ("fsdp", "fsdp_cpu_offload", "fsdp_teraio")


class Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    """Token model: embedding, pre-norm MLP blocks, head; next-token cross entropy."""

    def __init__(self, vocab: int, dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList([Block(dim, hidden) for _ in range(layers)])
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


def build(args: argparse.Namespace, device: torch.device, config: str) -> tuple[Any, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = Model(args.vocab, args.dim, args.hidden, args.layers).to(device)
    # Pinned host memory needs CUDA; on a CPU device the policy's code path runs unpinned.
    cpu_offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    policy = {"offload_policy": cpu_offload} if config == "fsdp_cpu_offload" else {}
    for layer in model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def local_bytes(tensors: Any) -> int:
    total = 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            total += local.numel() * local.element_size()
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled_peak(model: Any, optimizer: Any, batch: torch.Tensor) -> int:
    """The planner's unplanned peak of one profiled iteration (the CPU has no allocator stats)."""
    import teraio

    profiler = teraio.Profiler(model, optimizer)
    with profiler:
        train_step(model, optimizer, batch)
    result = teraio.plan(profiler.trace(), gpu_memory=1 << 40, ssd_read_bandwidth=1e9)
    return int(result["prediction"]["unplanned_peak_bytes"])


def train_step(model: Any, optimizer: Any, batch: torch.Tensor) -> float:
    loss = model(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


def run_config(
    args: argparse.Namespace,
    rank: int,
    device: torch.device,
    config: str,
    batches: list[Any],
    peak: Optional[int],
) -> dict[str, Any]:
    """One configuration on this rank: its step times, losses, peak and traffic."""
    model, optimizer = build(args, device, config)
    mine: dict[str, Any] = {"rank": rank}
    handle: Any = None
    store: Any = None
    if config == "fsdp_teraio":
        import teraio

        assert peak is not None
        path = os.path.join(args.store_dir, f"rank{rank}")
        os.makedirs(path, exist_ok=True)
        store = teraio.Store.create(
            [os.path.join(path, "dev0")], file_size_bytes=int(args.store_gib * GIB), durable=False, force=True
        )
        budget = int(peak * args.budget_share)
        options: dict[str, Any] = dict(store=store, gpu_memory=budget, if_no_fit="run")
        options["host_memory"] = int(args.host_gib * GIB)
        if device.type == "cpu":
            # No pinned memory or link to measure: the figures given.
            options.update(reserve=0, min_bytes=16 << 10, ssd_bandwidth="2GB/s", host_link_bandwidth="25GB/s")
        handle = teraio.offload(model, optimizer, **options)
        mine["budget_bytes"] = budget
    times_ms, losses = [], []
    dist.barrier()
    if handle is not None:
        handle.__enter__()
    try:
        for step, batch in enumerate(batches):
            if step == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            started = time.perf_counter()
            losses.append(train_step(model, optimizer, batch))
            sync(device)
            times_ms.append((time.perf_counter() - started) * 1e3)
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)
    mine["ms_per_iter"] = statistics.median(times_ms[args.warmup :] or times_ms)
    mine["losses"] = losses
    mine["peak_bytes"] = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    tiers = {tier: {"offloaded": 0, "prefetched": 0, "resident": 0} for tier in ("host", "ssd")}
    if handle is not None:
        report = handle.report()
        for key in ("bytes_per_iteration", "state_bytes_per_iteration"):
            for direction, by_tier in getattr(report, key).items():
                for tier, nbytes in by_tier.items():
                    tiers[tier][direction] += nbytes
        if report.peak_gpu_bytes is not None:
            mine["peak_bytes"] = report.peak_gpu_bytes  # teraio resets the peak at each step
        mine["planned_peak_bytes"] = report.predicted_peak_bytes
        mine["unplanned_peak_bytes"] = report.unplanned_peak_bytes
        mine["plan_fits"] = report.plan_summary.get("fits")
        mine["stalls"] = report.stalls
        mine["report"] = str(report)
        mine["store_errors"] = store.stats()["errors"]
        store.close()
    if config == "fsdp_cpu_offload":
        # Sharded parameters, gradients and optimizer state are kept in host memory.
        state = [v for s in optimizer.state.values() for v in s.values()]
        tiers["host"]["resident"] = local_bytes(model.parameters()) * 2 + local_bytes(state)
    mine["tiers"] = tiers
    if config == "fsdp" and device.type == "cpu":
        mine["profiled_peak_bytes"] = profiled_peak(model, optimizer, batches[-1])
    return mine


def rank_main(rank: int, args: argparse.Namespace, init_file: str) -> None:
    world = args.world
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        torch.set_num_threads(max(1, args.threads))
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.collective_timeout_s),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator().manual_seed(1)
    per = args.batch // world
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)[
            rank * per : (rank + 1) * per
        ].to(device)
        for _ in range(args.steps)
    ]
    results: dict[str, Any] = {}
    peak: Optional[int] = None
    for config in args.configs:
        try:
            mine = run_config(args, rank, device, config, batches, peak)
        except Exception as error:  # this configuration failed on this rank: say so, go on
            traceback.print_exc()
            mine = {"rank": rank, "error": f"{type(error).__name__}: {error}"[:600]}
        if config == "fsdp" and "error" not in mine:
            peak = mine["profiled_peak_bytes"] if device.type == "cpu" else mine["peak_bytes"]
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, mine)
        results[config] = ranks
    if rank == 0:
        reference = results.get("fsdp")
        for config, ranks in results.items():
            ok = all("error" not in r for r in ranks)
            line: dict[str, Any] = {"config": config, "device": args.device, "world_size": world, "ok": ok}
            line.update(layers=args.layers, dim=args.dim, hidden=args.hidden, batch=args.batch, seq=args.seq)
            if ok:
                line["ms_per_iter"] = max(r["ms_per_iter"] for r in ranks)
                line["peak_bytes_per_rank"] = [r["peak_bytes"] for r in ranks]
                if reference and all("error" not in r for r in reference):
                    pairs = [
                        (a, b) for r, f in zip(ranks, reference) for a, b in zip(r["losses"], f["losses"])
                    ]
                    line["losses_bitwise_equal"] = all(a == b for a, b in pairs)
                    line["max_abs_loss_diff"] = max(abs(a - b) for a, b in pairs)
                    line["speed_vs_fsdp"] = max(r["ms_per_iter"] for r in reference) / line["ms_per_iter"]
            line["ranks"] = [{k: v for k, v in r.items() if k != "report"} for r in ranks]
            for r in ranks:
                if "report" in r:
                    print(f"[{config}] rank {r['rank']}:\n{r['report']}", flush=True)
            print("RESULT " + json.dumps(line), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(line) + "\n")
    # Rank 0 prints while the others wait: a peer that left first makes gloo abort rank 0's exit.
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (CPU smoke runs)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8, help="rows per step over all ranks")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    parser.add_argument("--budget-share", type=float, default=0.5, help="teraio budget / fsdp peak")
    parser.add_argument("--host-gib", type=float, default=48.0, help="pinned host memory per rank")
    parser.add_argument("--store-dir", default="/root/teraio-fsdp", help="rank r's store: DIR/rank<r>/dev0")
    parser.add_argument("--store-gib", type=float, default=24.0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank (--device cpu)")
    parser.add_argument("--collective-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default="", help="JSONL file rank 0 appends the RESULT lines to")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.dim, args.hidden, args.vocab = 4, 64, 256, 512
        args.batch, args.seq, args.steps, args.warmup = 8, 64, 10, 4
        args.host_gib, args.store_gib = 1 / 1024, 0.25  # 1 MiB of host memory: the store is used
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--device cuda needs {args.world} GPUs, found {torch.cuda.device_count()}")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            rank_main, args=(args, os.path.join(tmp, "rendezvous")), nprocs=args.world, start_method="spawn"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
