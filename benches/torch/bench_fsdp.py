"""FSDP2 (`fully_shard`) training on 2 ranks, one run: alone, with checkpointing, with
CPUOffloadPolicy, with teraio; and a model FSDP2 alone cannot hold, with teraio.

    python3 benches/torch/bench_fsdp.py --family llama          # 2 GPUs (NCCL)
    python3 benches/torch/bench_fsdp.py --configs big_teraio big_fsdp
    python3 benches/torch/bench_fsdp.py --device cpu --tiny    # 2 gloo processes, a tiny model

The script starts its ranks itself (torch.multiprocessing, spawn; a file rendezvous, so no
port). Each rank builds the same seeded model, `fully_shard`s every block and then the root, and
trains `--steps` steps on its rows of every global batch, for each configuration in turn:

- `--family llama` / `qwen2` (GPU default: llama): the transformers model of bench_regime.py's
  family (SDPA attention, 128K/152K vocabulary), trained as FSDP2 users train in bf16: a
  `MixedPrecisionPolicy` (bf16 parameters and compute, fp32 gradient reduction);
  `--family mlp` (CPU default): pre-norm MLP blocks in fp32.
- `fsdp`: FSDP2 alone; `fsdp_repeat`: the same again (the spread of two runs, for the losses of
  configurations whose reduction order differs);
- `fsdp_ckpt`: FSDP2 with every block checkpointed (transformers' gradient checkpointing);
  on a GPU this, `fsdp_cpu_offload` and `fsdp_teraio` run with the allocator capped at teraio's
  budget (`CAPPED`): the same per-rank memory, where an out-of-memory is the row's result;
- `fsdp_cpu_offload`: FSDP2 with `CPUOffloadPolicy` (sharded parameters, gradients and optimizer
  state live in host memory; the optimizer steps on the CPU); `fsdp_cpu_offload_ckpt`: the same
  with every block checkpointed, as a user under a cap would run it (capped too);
- `fsdp_teraio`: FSDP2 inside `teraio.offload(model, optimizer, store=store, gpu_memory=budget)`
  with the budget `--budget-share` (default 50%) of that rank's `fsdp` peak (the allocator's on a
  GPU, the profiled unplanned peak on the CPU) and one store per rank
  (`--store-dir`/rank<r>/dev0);
- `fsdp_cpu_offload_teraio`: `fsdp_cpu_offload`'s model inside the same `teraio.offload`: FSDP
  keeps the shards in host memory, teraio steps them there with its kernel and plans the
  activations (whole-model offload under FSDP2);
- `big_teraio`: the `BIG` llama shape (20.3B parameters, untied 128K vocabulary; built on the meta
  device and materialised after sharding), `--big-batch` rows of `--big-seq` tokens, inside
  `teraio.offload(model, optimizer, store=store)`: all defaults, the whole GPU;
  `big_teraio_host`: the same sharded with `CPUOffloadPolicy` (materialised in host memory);
- `big_fsdp`: the same model with FSDP2 alone (it does not fit: the row says where it failed).

Rank 0 prints one `RESULT {json}` line per configuration: ms/iter (the slowest rank's median over
the steps after `--warmup`), each rank's peak, its bytes per tier per iteration (teraio's report:
activations and optimizer state; CPUOffloadPolicy: what it keeps in host memory) and stalls, and
the losses' agreement with `fsdp`: bitwise, else the largest difference (compare it with
`fsdp_repeat`'s). `benches/torch/run-fsdp.sh` runs it on the 2-GPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import gc
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
HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = (
    "fsdp",
    "fsdp_repeat",
    "fsdp_ckpt",
    "fsdp_cpu_offload",
    "fsdp_cpu_offload_ckpt",
    "fsdp_teraio",
    "fsdp_cpu_offload_teraio",
    "big_teraio",
    "big_teraio_host",
    "big_fsdp",
)
#: On a GPU these run with the allocator capped at `--budget-share` of the `fsdp` peak: FSDP2's
#: own offload and checkpointing at the same per-rank memory as teraio.
CAPPED = ("fsdp_ckpt", "fsdp_cpu_offload", "fsdp_cpu_offload_ckpt", "fsdp_teraio", "fsdp_cpu_offload_teraio")
#: Configurations with FSDP2's `CPUOffloadPolicy`, and those that checkpoint every block.
CPU_OFFLOADED = ("fsdp_cpu_offload", "fsdp_cpu_offload_ckpt", "fsdp_cpu_offload_teraio", "big_teraio_host")
#: Configurations inside `teraio.offload`.
TERAIO = ("fsdp_teraio", "fsdp_cpu_offload_teraio", "big_teraio", "big_teraio_host")
CHECKPOINTED = ("fsdp_ckpt", "fsdp_cpu_offload_ckpt")
#: --family: bench_regime.py's family and the changes to its shape.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    # Llama-3-8B's layer (4096 wide) at 16 layers: a 4.3B model whose 128K-vocabulary head is a
    # smaller share of the peak than in the 1.2B one.
    "llama-wide": (
        "llama",
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=16, num_attention_heads=32),
    ),
}
#: The model FSDP2 alone cannot hold on 2 x H200 (139.8 GiB each): 20.3B parameters (48 layers
#: 6144 wide, untied 128K vocabulary), whose fp32 parameters, gradients and Adam state take
#: 151 GiB per rank before any activation. (A 14.5B shape, 108 GiB per rank, trained under
#: FSDP2 alone at `--big-batch` 2 x 4096 there.)
BIG = dict(
    hidden_size=6144,
    intermediate_size=16384,
    num_hidden_layers=48,
    num_attention_heads=48,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


class Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.checkpointed = False

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


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


def hf_model(family: str, overrides: dict[str, Any], device: torch.device, tiny: bool) -> torch.nn.Module:
    """bench_regime.py's transformers model of `family` (SDPA), with `overrides`, on `device`
    (the meta device: no memory; `materialise` fills it in after sharding)."""
    sys.path.insert(0, HERE)
    import transformers

    import bench_regime

    config_name, model_name, kwargs = bench_regime.FAMILIES[family]
    kwargs = {**kwargs, **overrides, **(bench_regime.TINY if tiny else {})}
    if tiny and "num_key_value_heads" in kwargs:
        kwargs["num_key_value_heads"] = 2
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(0)
    with device:
        model = getattr(transformers, model_name)(config)
    model.train()
    return model


def materialise(model: torch.nn.Module, device: torch.device, compute: torch.device) -> None:
    """A meta-device model made real after `fully_shard` (the way sharded models too large for
    one process are built): memory on `device` (the CPU for shards FSDP keeps in host memory),
    weights drawn as transformers draws them, norms at one, rotary tables computed on `compute`."""
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif type(module).__name__.endswith("RMSNorm"):
                module.weight.fill_(1.0)
            elif hasattr(module, "rope_init_fn"):
                inv_freq, module.attention_scaling = module.rope_init_fn(module.config, compute)
                module.register_buffer("inv_freq", inv_freq, persistent=False)
                module.original_inv_freq = inv_freq


def build(args: argparse.Namespace, device: torch.device, config: str) -> tuple[Any, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    big = config.startswith("big_")
    policy: dict[str, Any] = {}
    if config in CPU_OFFLOADED:
        # Pinned host memory needs CUDA; on a CPU device the policy's code path runs unpinned.
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if args.precision == "bf16":
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if args.family == "mlp" and not big:
        torch.manual_seed(0)
        model: Any = Model(args.vocab, args.dim, args.hidden, args.layers).to(device)
        layers = model.layers
        for layer in layers:
            layer.checkpointed = config in CHECKPOINTED
    else:
        family, overrides = ("llama", BIG) if big else FAMILIES[args.family]
        model = hf_model(family, overrides, torch.device("meta") if big else device, args.tiny)
        if config in CHECKPOINTED:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = model.model.layers
    if device.type == "cpu":
        # Without a CPU mesh, fully_shard moves the model to CUDA where a GPU is present.
        from torch.distributed.device_mesh import init_device_mesh

        policy["mesh"] = init_device_mesh("cpu", (args.world,))
    for layer in layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    if big:
        materialise(model, torch.device("cpu") if config in CPU_OFFLOADED else device, device)
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
    if isinstance(model, Model):
        loss = model(batch)
    else:
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


def shape(args: argparse.Namespace, config: str) -> tuple[int, int]:
    """Global rows and tokens per row of `config`'s batches."""
    return (args.big_batch, args.big_seq) if config.startswith("big_") else (args.batch, args.seq)


def make_batches(
    args: argparse.Namespace, rank: int, config: str, vocab: int, device: torch.device
) -> list[Any]:
    """This rank's rows of `--steps` seeded global batches (the same on every configuration)."""
    rows, seq = shape(args, config)
    generator = torch.Generator().manual_seed(1)
    per = rows // args.world
    return [
        torch.randint(0, vocab, (rows, seq), generator=generator)[rank * per : (rank + 1) * per].to(device)
        for _ in range(args.steps)
    ]


def run_config(
    args: argparse.Namespace, rank: int, device: torch.device, config: str, peak: Optional[int]
) -> dict[str, Any]:
    """One configuration on this rank: its step times, losses, peak and traffic."""
    model, optimizer = build(args, device, config)
    vocab = model.vocab if isinstance(model, Model) else model.config.vocab_size
    batches = make_batches(args, rank, config, vocab, device)
    mine: dict[str, Any] = {"rank": rank}
    handle: Any = None
    store: Any = None
    if config in TERAIO:
        import teraio

        path = os.path.join(args.store_dir, f"rank{rank}")
        os.makedirs(path, exist_ok=True)
        store_gib = args.big_store_gib if config.startswith("big_") else args.store_gib
        store = teraio.Store.create(
            [os.path.join(path, "dev0")], file_size_bytes=int(store_gib * GIB), durable=False, force=True
        )
        options: dict[str, Any] = dict(store=store)
        if args.trace_dir and rank == 0:
            options["trace_path"] = os.path.join(args.trace_dir, f"trace-{args.family}-{config}.json")
        if config in CAPPED:
            assert peak is not None
            options["gpu_memory"] = mine["budget_bytes"] = int(peak * args.budget_share)
        if device.type == "cpu":
            # No allocator, pinned memory or link to measure: the figures given.
            options.setdefault("gpu_memory", 1 << 30)  # big_teraio: no device to take the size of
            options.update(
                host_memory=int(args.host_gib * GIB),
                reserve=0,
                min_bytes=16 << 10,
                ssd_bandwidth="2GB/s",
                host_link_bandwidth="25GB/s",
            )
        for item in filter(None, args.teraio_options.split(",")):
            name, _, value = item.partition("=")
            value = value.strip()
            flags = {"True": True, "False": False}
            options[name.strip()] = int(value) if value.isdigit() else flags.get(value, value)
        handle = teraio.offload(model, optimizer, **options)
        if args.no_trial and hasattr(handle, "TRIAL_STEPS"):
            handle.TRIAL_STEPS = 0  # the block plan as chosen, from its first planned step on
    times_ms, losses = [], []
    peaks = None
    if args.peak_steps and handle is not None and device.type == "cuda":
        from probe_block_plan import StepPeak

        peaks = StepPeak()

        def at_head(module: Any, inputs: Any, output: Any) -> None:
            # What the bound takes as gone by the head: the optimizer state the plan moves out.
            if len(times_ms) not in args.peak_steps:
                return
            slots = getattr(handle.state, "slots", [])
            out = sum(slot.nbytes for slot in slots if slot.tensor.untyped_storage().nbytes() == 0)
            copied = sum(s.nbytes for s in slots if s.d2h_event is not None and s.d2h_event.query())
            print(
                f"[{config}] rank {rank} step {len(times_ms)} at the head: allocated "
                f"{torch.cuda.memory_allocated(device) / GIB:.2f} GiB; optimizer state planned out "
                f"{sum(slot.nbytes for slot in slots) / GIB:.2f} GiB, released {out / GIB:.2f}, "
                f"copied {copied / GIB:.2f}",
                flush=True,
            )

        model.get_output_embeddings().register_forward_hook(at_head)
    sys.path.insert(0, HERE)
    from timeline import profiled

    dist.barrier()
    if handle is not None:
        handle.__enter__()
    try:
        for step, batch in enumerate(batches):
            if step == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            if peaks is not None and step in args.peak_steps:
                peaks.begin()
            started = time.perf_counter()
            timeline_path = os.path.join(
                args.trace_dir or ".", f"timeline-{args.family}-{config}-{step}.json"
            )
            with profiled(step in args.profile_step and rank == 0, timeline_path):
                losses.append(train_step(model, optimizer, batch))
                sync(device)
            times_ms.append((time.perf_counter() - started) * 1e3)
            if peaks is not None and step in args.peak_steps:
                peaks.end(f"[{config}] rank {rank} step {step}")
    except Exception:
        # Which step failed, and the plan teraio had then (its bound beside the failure).
        print(f"[{config}] rank {rank} failed at step {len(times_ms)}", flush=True)
        if handle is not None:
            print(f"[{config}] rank {rank} plan at the failure:\n{handle.report()}", flush=True)
        if peaks is not None and len(times_ms) in args.peak_steps:
            from probe_block_plan import print_measured

            peaks.end(f"[{config}] rank {rank} step {len(times_ms)} up to the failure")
            print_measured(handle)
        raise
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)
    mine["ms_per_iter"] = statistics.median(times_ms[args.warmup :] or times_ms)
    mine["times_ms"] = times_ms
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
        # The median of the iterations with the plan as chosen (after measuring, planning and the
        # A/B trial), and how many there were: the speed a long run settles at.
        mine["settled_ms_per_iter"] = getattr(report, "measured_iteration_ms", None)
        mine["settled_steps"] = getattr(report, "planned_steps", None)
        mine["predicted_ms_per_iter"] = getattr(report, "predicted_iteration_ms", None)
        # Several ranks (the block plan): this rank's prediction alone, the ranks' (the one above:
        # the slowest rank between each pair of FSDP's collectives) and its predicted wait.
        together = getattr(report, "ranks", None) or {}
        for key in ("own_predicted_ms", "group_predicted_ms", "predicted_wait_ms", "side"):
            mine[key] = together.get(key)
        mine["stalls"] = report.stalls
        # The block plan's phases, by first step: the plan, the A/B trial's other side, settled.
        for key in ("planned_from", "_trial_from", "settled_from"):
            mine[key.lstrip("_")] = getattr(handle, key, None)
        mine["host_step"] = report.host_step
        mine["plan"] = type(report).__name__
        # The block plan's (the default for these models) or the tensor plan's own figures.
        actions = getattr(report, "actions", None)
        if actions is not None:
            mine["actions"] = {a: sum(1 for v in actions.values() if v == a) for a in set(actions.values())}
            mine["recomputed_bytes"] = report.recomputed_bytes_per_iteration
        else:
            mine["unplanned_peak_bytes"] = report.unplanned_peak_bytes
            mine["plan_fits"] = report.plan_summary.get("fits")
        mine["report"] = str(report)
        mine["store_errors"] = store.stats()["errors"]
        store.close()
    if config in CPU_OFFLOADED:
        # Sharded parameters, gradients and optimizer state are kept in host memory.
        state = [v for s in optimizer.state.values() for v in s.values()]
        tiers["host"]["resident"] = local_bytes(model.parameters()) * 2 + local_bytes(state)
    mine["tiers"] = tiers
    if config == "fsdp" and device.type == "cpu":
        mine["profiled_peak_bytes"] = profiled_peak(model, optimizer, batches[-1])
    return mine


def prediction_line(mine: dict[str, Any]) -> str:
    """One rank's measured iteration (with the plan as settled) against its predictions: its own
    alone and the ranks' (`BlockReport.ranks`), each with its error."""

    def against(predicted: Optional[float]) -> str:
        if predicted is None:
            return "-"
        return f"{predicted:.1f} ms ({(measured - predicted) / predicted * 100:+.0f}%)"

    measured = mine["settled_ms_per_iter"]
    own = mine.get("own_predicted_ms")
    group = mine.get("group_predicted_ms")
    return (
        f"rank {mine['rank']}: measured {measured:.1f} ms over {mine['settled_steps']} steps; predicted "
        f"{against(mine['predicted_ms_per_iter'])}: alone {against(own)}, the ranks {against(group)}, "
        f"waiting {mine.get('predicted_wait_ms') or 0.0:.1f} ms (side: {mine.get('side')})"
    )


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
    results: dict[str, Any] = {}
    peak: Optional[int] = None
    for config in args.configs:
        # The configurations compared at the same per-rank memory run under it as a hard cap.
        cap = int(peak * args.budget_share) if peak and device.type == "cuda" and config in CAPPED else None
        if cap is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        try:
            mine = run_config(args, rank, device, config, peak)
        except Exception as error:  # this configuration failed on this rank: say so, go on
            traceback.print_exc()
            mine = {"rank": rank, "error": f"{type(error).__name__}: {error}"[:600]}
        finally:
            if cap is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, device)
        mine["cap_bytes"] = cap
        # Each configuration starts from an empty allocator cache, as its own process would.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
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
            rows, seq = shape(args, config)
            family = "llama-big" if config.startswith("big_") else args.family
            line.update(family=family, precision=args.precision, batch=rows, seq=seq, steps=args.steps)
            if family == "mlp":
                line.update(layers=args.layers, dim=args.dim, hidden=args.hidden)
            if ok:
                line["ms_per_iter"] = max(r["ms_per_iter"] for r in ranks)
                line["peak_bytes_per_rank"] = [r["peak_bytes"] for r in ranks]
                if not config.startswith("big_") and reference and all("error" not in r for r in reference):
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
            for r in ranks:
                if r.get("settled_ms_per_iter") is not None:
                    print(f"[{config}] {prediction_line(r)}", flush=True)
            print("RESULT " + json.dumps(line), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(line) + "\n")
    # Rank 0 prints while the others wait: a peer that left first makes gloo abort rank 0's exit.
    dist.barrier()
    dist.destroy_process_group()
    # Every result is written: the rank ends here, without the interpreter's finalization, in
    # which gloo's threads can still abort the process (std::terminate, seen once in a CI run
    # under load after all results were out; pytorch/pytorch#179291 describes such teardowns).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (CPU smoke runs)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--configs", nargs="+", choices=CONFIGS, default=[c for c in CONFIGS if not c.startswith("big_")]
    )
    parser.add_argument("--family", choices=[*FAMILIES, "mlp"], help="default: llama (cuda), mlp (cpu)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], help="default: bf16 (cuda), fp32 (cpu)")
    parser.add_argument("--layers", type=int, default=24, help="mlp family")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000, help="mlp family")
    parser.add_argument("--batch", type=int, default=8, help="rows per step over all ranks")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--big-batch", type=int, default=2, help="big_*: rows per step over all ranks")
    parser.add_argument("--big-seq", type=int, default=4096)
    parser.add_argument("--big-store-gib", type=float, default=40.0, help="big_teraio: each rank's store")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--budget-share", type=float, default=0.5, help="teraio budget / fsdp peak")
    parser.add_argument("--host-gib", type=float, default=1 / 1024, help="pinned host memory per rank (cpu)")
    parser.add_argument("--store-dir", default="/root/teraio-fsdp", help="rank r's store: DIR/rank<r>/dev0")
    parser.add_argument("--store-gib", type=float, default=24.0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank (--device cpu)")
    parser.add_argument("--collective-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default="", help="JSONL file rank 0 appends the RESULT lines to")
    parser.add_argument(
        "--peak-steps",
        type=int,
        nargs="*",
        default=[],
        help="teraio configurations: where these steps' peaks stood, by allocating line "
        "(probe_block_plan.StepPeak; recording slows the step); on a failure in one, with the block "
        "plan's bound beside its parts",
    )
    parser.add_argument("--trace-dir", default="", help="rank 0 writes teraio's profiled traces here")
    parser.add_argument(
        "--teraio-options", default="", help="more teraio.offload options: name=value,... (e.g. reserve=2GiB)"
    )
    parser.add_argument(
        "--no-trial",
        action="store_true",
        help="probe: teraio's block plan runs as chosen, without its A/B trial against "
        "checkpointing every block (the plan's own speed once it settles)",
    )
    parser.add_argument(
        "--profile-step",
        type=int,
        nargs="*",
        default=[],
        help="rank 0 records these steps of every configuration with torch.profiler: the timelines "
        "(gzipped, in --trace-dir) and a summary of where the GPU's time went (timeline.py)",
    )
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.family = args.family or ("llama" if cuda else "mlp")
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    if args.tiny:
        args.layers, args.dim, args.hidden, args.vocab = 4, 64, 256, 512
        args.batch, args.seq, args.steps, args.warmup = 8, 64, 10, 4
        args.store_gib = 0.25  # with 1 MiB of host memory (--host-gib): the store is used
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
