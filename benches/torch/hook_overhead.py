"""Host cost of teraio's saved-tensor hooks, per saved tensor, on the CPU.

A chain of small elementwise ops (each saves one tensor for backward) runs forward and backward
with no hooks, with torch's empty `saved_tensors_hooks` (pack and unpack return their argument)
and under `teraio.offload` once the plan is in place, in three cases: every saved tensor below
`min_bytes` (skipped at once), every one at or above it and kept by the plan (the budget holds
the whole iteration), and each second one offloaded to host memory by the plan (the copy is
included: on the CPU it is a memcpy). Each figure is (median iteration time - the same without
hooks) / saved tensors, in microseconds: the pack and the unpack of one saved tensor together.

    python3 benches/torch/hook_overhead.py
    python3 benches/torch/hook_overhead.py --against /tmp/old-site   # a second teraio, same run

`--against PATH` measures the teraio found under PATH too, in rounds that alternate between the
two (each in its own process), so that both see the same machine load; the table shows both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch


class Chain(torch.nn.Module):
    """`ops` sigmoids after one scale: each sigmoid saves its output (one storage per op)."""

    def __init__(self, ops: int) -> None:
        super().__init__()
        self.ops = ops
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        for _ in range(self.ops):
            h = torch.sigmoid(h)
        return h.sum()


def _saved_per_iteration(model: torch.nn.Module, x: torch.Tensor) -> int:
    count = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x).backward()
    return count


def _median_ms(step: Callable[[], None], iterations: int) -> float:
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One process's figures: ms per iteration of each case, and saved tensors per iteration."""
    import teraio

    torch.set_num_threads(1)
    model = Chain(args.ops)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(args.numel)
    saved = _saved_per_iteration(model, x)
    tensor_bytes = args.numel * 4

    def forward_backward() -> None:
        model(x).backward()

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    results: dict[str, Any] = {"saved_per_iteration": saved, "tensor_bytes": tensor_bytes}
    results["none"] = _median_ms(forward_backward, args.iterations)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        results["empty hooks"] = _median_ms(forward_backward, args.iterations)
    cases = {
        "teraio, below min_bytes": dict(min_bytes=tensor_bytes + 1, gpu_memory=1 << 40),
        "teraio, kept by the plan": dict(min_bytes=tensor_bytes, gpu_memory=1 << 40),
        # The activations of the chain are `saved` tensors of `tensor_bytes`: a budget of half
        # of them over the parameters makes the plan move about half.
        "teraio, half to host": dict(min_bytes=tensor_bytes, gpu_memory=saved * tensor_bytes // 2),
    }
    for name, options in cases.items():
        with teraio.offload(
            model,
            optimizer,
            host_memory=1 << 30,
            host_link_bandwidth="1000GB/s",
            reserve=0,
            recompute="off",
            if_no_fit="run",
            **options,
        ) as run:
            for _ in range(4):  # warm-up, profiled iteration, then planned ones
                forward_backward()
                step()

            def planned() -> None:
                forward_backward()
                step()

            # The step (an optimizer hook per iteration, not per tensor) is timed in both.
            results[name] = _median_ms(planned, args.iterations)
        report = run.report()
        results[name + " (offloaded per iteration)"] = report.bytes_per_iteration["offloaded"]["host"]
        results[name + " (mismatches)"] = report.stalls["plan_mismatches"]
    results["none, with step"] = _median_ms(lambda: (forward_backward(), step()), args.iterations)
    return results


def per_tensor_us(results: dict[str, Any], name: str) -> float:
    base = results["none, with step"] if name.startswith("teraio") else results["none"]
    return (results[name] - base) * 1e3 / results["saved_per_iteration"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=2000, help="saved tensors per iteration (about)")
    parser.add_argument("--numel", type=int, default=1024, help="elements per saved tensor (fp32)")
    parser.add_argument("--iterations", type=int, default=30, help="timed iterations per case")
    parser.add_argument("--rounds", type=int, default=3, help="processes per teraio (median taken)")
    parser.add_argument("--against", default="", help="another teraio's site directory, measured alike")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    labels = {"this": ""}
    if args.against:
        labels = {"against": args.against, "this": ""}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    child = [sys.executable, os.path.abspath(__file__), "--child"]
    child += ["--ops", str(args.ops), "--numel", str(args.numel), "--iterations", str(args.iterations)]
    for _ in range(args.rounds):
        for label, path in labels.items():
            env = dict(os.environ)
            if path:
                env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
            out = subprocess.run(child, env=env, check=True, capture_output=True, text=True).stdout
            runs[label].append(json.loads(out.strip().splitlines()[-1]))
    first = runs["this"][0]
    print(
        f"{first['saved_per_iteration']} saved tensors per iteration of {first['tensor_bytes']} B each; "
        f"us per saved tensor (pack + unpack), median of {args.rounds} processes x "
        f"{args.iterations} iterations"
    )
    names = ["empty hooks", "teraio, below min_bytes", "teraio, kept by the plan", "teraio, half to host"]
    header = f"  {'case':<28}" + "".join(
        f"{label + (' ' + path if path else ''):>28}" for label, path in labels.items()
    )
    print(header)
    print(
        f"  {'no hooks (ms/iteration)':<28}"
        + "".join(f"{statistics.median(r['none'] for r in runs[label]):>28.2f}" for label in labels)
    )
    for name in names:
        cells = "".join(
            f"{statistics.median(per_tensor_us(r, name) for r in runs[label]):>28.2f}" for label in labels
        )
        print(f"  {name:<28}{cells}")
    for label in labels:
        last = runs[label][-1]
        moved = last["teraio, half to host (offloaded per iteration)"]
        mismatches = sum(last[n + " (mismatches)"] for n in names[1:])
        print(f"  {label}: half to host moved {moved} B per iteration; plan mismatches {mismatches}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
