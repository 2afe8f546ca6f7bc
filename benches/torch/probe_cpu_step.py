"""The CPU step's rate and what slows it: an AdamW step over `--units` units of `--unit-params`
fp32 parameters, run the way whole-model mode's `update="cpu"` runs it (one step per unit on a
worker thread), by each of `--kernels`:

- "torch": torch's fused CPU AdamW over fp32 gradients (`optimizer.step()` per unit, the other
  units' gradients None);
- "torch+copies": the same with the compute copies' passes: bf16 gradients widened into the fp32
  ones first, the updated masters rounded to bf16 copies after;
- "teraio": the engine's kernel (`teraio.cpu_adamw`, the default CPU step for Adam/AdamW)
  reading the bf16 gradients and writing the bf16 copies in its one pass;

while the main thread

- idles (blocked: the baseline);
- keeps the host link busy both ways (pinned host <-> GPU copies on two streams, waited for
  with a CUDA event: the copies the next forward pass's reads and the step's own transfers make);
- runs Python (the forward pass's hooks): the worker takes the GIL back after each torch op it
  calls, and waits up to Python's switch interval for it each time;

at each of `--intervals` (`sys.setswitchinterval`, ms). Prints one table: the worker's time and
rate per case. The whole-model runtime's `CPU_STEP_SWITCH_INTERVAL_S` is set from it
(docs/python.md, "The step on the CPU")."""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from typing import Callable

import torch
from teraio.cpu_adamw import AdamHyper, AdamTensor, CpuAdamW


def _busy_python(stop: Callable[[], bool]) -> None:
    while not stop():
        total = 0
        for k in range(20000):
            total += k


def _idle(stop: Callable[[], bool]) -> None:
    while not stop():
        time.sleep(0.001)


def _copier() -> Callable[[Callable[[], bool]], None]:
    """A load that keeps both directions of the host link busy, in rounds of 1 GiB each way (its
    buffers allocated here, outside the timed steps)."""
    size = 256 << 20
    host_in = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    host_out = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    gpu_in = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(4)]
    gpu_out = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(4)]
    to_gpu, to_host = torch.cuda.Stream(), torch.cuda.Stream()

    def copies(stop: Callable[[], bool]) -> None:
        while not stop():
            for k in range(4):
                with torch.cuda.stream(to_gpu):
                    gpu_in[k].copy_(host_in[k], non_blocking=True)
                with torch.cuda.stream(to_host):
                    host_out[k].copy_(gpu_out[k], non_blocking=True)
            to_gpu.wait_stream(to_host)
            done = torch.cuda.Event()  # waited for by spinning, as CUDA's default does
            done.record(to_gpu)
            done.synchronize()

    return copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--units", type=int, default=24)
    parser.add_argument("--unit-params", type=int, default=1 << 26, help="parameters per unit")
    parser.add_argument("--intervals", default="5,0.5", help="switch intervals to try (ms, comma-separated)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="steps per case (the fastest counts: other work comes and goes)"
    )
    parser.add_argument(
        "--kernels", default="torch,torch+copies,teraio", help="steps to time (comma-separated)"
    )
    args = parser.parse_args()
    numel = args.unit_params
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(args.units)]
    grads = [torch.full_like(p, 1e-3) for p in params]
    low_grads = [g.bfloat16() for g in grads]
    copies = [torch.empty(numel, dtype=torch.bfloat16) for _ in params]
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer = torch.optim.AdamW(params, fused=True)
    optimizer.step()  # allocates the state
    kernel = CpuAdamW(torch.get_num_threads())
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)

    def torch_step(index: int) -> None:
        for k, param in enumerate(params):
            param.grad = grads[k] if k == index else None
        optimizer.step()

    def torch_step_with_copies(index: int) -> None:
        grads[index].copy_(low_grads[index])
        torch_step(index)
        copies[index].copy_(params[index].detach())

    def teraio_step(index: int) -> None:
        state = optimizer.state[params[index]]
        state["step"].add_(1)
        tensor = AdamTensor(
            params[index].detach(),
            low_grads[index],
            state["exp_avg"],
            state["exp_avg_sq"],
            step=float(state["step"]),
            copy=copies[index],
        )
        kernel.step(hyper, [tensor])

    steps = {"torch": torch_step, "torch+copies": torch_step_with_copies, "teraio": teraio_step}

    loads: dict[str, Callable[[Callable[[], bool]], None]] = {"idle": _idle, "Python": _busy_python}
    if torch.cuda.is_available():
        loads["host link both ways"] = _copier()
    worker = concurrent.futures.ThreadPoolExecutor(1)
    total = args.units * numel
    default_interval = sys.getswitchinterval()
    threads = torch.get_num_threads()
    print(f"AdamW, {args.units} units x {numel} parameters, {threads} threads")
    print("| step | switch interval | main thread | worker ms | G parameters/s |")
    print("|---|---:|---|---:|---:|")
    try:
        for step_name, interval_ms, (name, load) in (
            (k, float(v), case)
            for k in args.kernels.split(",")
            for v in args.intervals.split(",")
            for case in loads.items()
        ):
            sys.setswitchinterval(interval_ms / 1e3)
            unit_step = steps[step_name]
            times = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                futures = [worker.submit(unit_step, i) for i in range(args.units)]
                load(lambda futures=futures: all(f.done() for f in futures))
                for future in futures:
                    future.result()
                times.append(time.perf_counter() - started)
            best = min(times)
            print(
                f"| {step_name} | {interval_ms:g} ms | {name} | {best * 1e3:.0f} | {total / best / 1e9:.2f} |"
            )
    finally:
        sys.setswitchinterval(default_interval)
        worker.shutdown()


if __name__ == "__main__":
    main()
