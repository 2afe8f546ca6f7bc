"""Probe of teraio.offload as a user writes it: default arguments, one model, one cap.

    python3 benches/torch/probe_runtime.py --model qwen2 --cap-bytes 41600000000
    python3 benches/torch/probe_runtime.py --model llama-flagship --cap-bytes 24190000000 --documented

`qwen2`: a Qwen2-1.5B-shaped transformers model (vocab 151936, tied embeddings, SDPA), bf16
autocast over fp32 weights, AdamW, batch 4 x 2048. `llama-flagship`: bench_llama.py's 0.85B Llama
(fp32, eager attention). `--documented`: the arguments docs/python.md showed before the defaults
were measured (host_memory="64GiB", ssd_bandwidth="1.7GB/s", host_link_bandwidth="50GB/s").
Prints the steps, the peak and teraio's report.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(name: str) -> tuple[torch.nn.Module, int, bool]:
    if name == "llama-flagship":
        from bench_llama import build_model

        return build_model(), 32000, False
    from bench_regime import FAMILIES, build_model

    model = build_model("qwen2", "autocast", torch.device("cuda"), tiny=False)
    return model, FAMILIES["qwen2"][2]["vocab_size"], True


@contextlib.contextmanager
def _on_oom(run: object):
    """Prints what the plan expected where a step runs out of memory, then re-raises."""
    try:
        yield
    except torch.OutOfMemoryError:
        result = run.plan_result or {}
        print("OOM: allocated", torch.cuda.memory_allocated() / 2**30, "GiB")
        print(
            "OOM: prediction",
            {k: v for k, v in result.get("prediction", {}).items() if "peak" in k or k == "outcome"},
        )
        print("OOM: reserve", run.reserve_bytes, "checkpointed", len(run.checkpoint_blocks))
        print("OOM: checkpoint candidates", run.checkpoint_summary.get("tried"))
        print("OOM: executor", run.executor.stats.as_dict())
        print(
            "OOM: state planned host", run.state.planned_bytes("host"), "ssd", run.state.planned_bytes("ssd")
        )
        print("OOM: step times", run._step_times_ms, "planning_s", getattr(run, "planning_s", None))
        raise


def main() -> None:
    import teraio

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2", choices=["qwen2", "llama-flagship"])
    parser.add_argument("--cap-bytes", type=int, required=True)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--documented", action="store_true")
    parser.add_argument("--store-dir", default="")
    parser.add_argument("--checkpoint", default="auto", choices=["auto", "off", "all"])
    parser.add_argument("--calibrate", default="auto", choices=["auto", "on", "off"])
    args = parser.parse_args()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_bytes / total), 0)
    model, vocab, autocast = build(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    directory = args.store_dir or tempfile.mkdtemp(prefix="teraio-probe-", dir="/root")
    store = teraio.Store.create(
        [os.path.join(directory, "dev0"), os.path.join(directory, "dev1")],
        file_size_bytes=20 << 30,
        durable=False,
        force=True,
    )
    extra: dict[str, object] = {"checkpoint": args.checkpoint} if args.checkpoint != "auto" else {}
    if args.calibrate != "auto":
        extra["calibrate"] = args.calibrate == "on"
    if args.documented:
        extra.update(host_memory="64GiB", ssd_bandwidth="1.7GB/s", host_link_bandwidth="50GB/s")
    generator = torch.Generator().manual_seed(1234)
    started_all = time.perf_counter()
    with (
        teraio.offload(model, optimizer, store=store, gpu_memory=args.cap_bytes, **extra) as run,
        _on_oom(run),
    ):
        for step in range(args.steps):
            tokens = torch.randint(0, vocab, (4, 2048), generator=generator).cuda()
            started = time.perf_counter()
            context = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with context:
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.item()
            peak = torch.cuda.max_memory_allocated() / 2**30
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            print(
                f"step {step}: loss {value:.6f} {(time.perf_counter() - started) * 1e3:.0f} ms, "
                f"peak allocated {peak:.2f} GiB, allocator retries so far {retries}",
                flush=True,
            )
    print(f"total {time.perf_counter() - started_all:.1f} s")
    report = run.report()
    print(report)
    print("machine", report.machine)
    print("checkpoint", report.checkpoint_summary)
    print("recompute", report.plan_summary.get("recompute", {}).get("chosen"))
    print("plan", {k: v for k, v in report.plan_summary.items() if k != "recompute"})
    store.close()


if __name__ == "__main__":
    main()
