"""The host link, one way and both ways at once: pinned host <-> GPU copy bandwidth for host ->
GPU alone, GPU -> host alone, and both directions concurrently on two streams (the whole-model
runtime's backward moves parameters and optimizer state both ways at once). Prints a table; the
figures bound what the whole-model rows can reach (docs/benchmarks.md, "Capacity")."""

from __future__ import annotations

import argparse
import time

import torch


def _timed(copies: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]], repeat: int) -> float:
    """Seconds for `repeat` rounds of every copy, each copy on its own stream (best of 3)."""
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for stream, target, source in copies:
            with torch.cuda.stream(stream):
                for _ in range(repeat):
                    target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=512, help="bytes per copy (MiB)")
    parser.add_argument("--repeat", type=int, default=8, help="copies per direction per round")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_link.py: no CUDA device; this probe measures the GPU's host link")
    nbytes = args.mib << 20
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    moved = nbytes * args.repeat
    alone_in = moved / _timed([(h2d, dev_in, host_in)], args.repeat)
    alone_out = moved / _timed([(d2h, host_out, dev_out)], args.repeat)
    both_s = _timed([(h2d, dev_in, host_in), (d2h, host_out, dev_out)], args.repeat)
    print(f"| {torch.cuda.get_device_name()} | GB/s |")
    print("|---|---:|")
    print(f"| host -> GPU alone | {alone_in / 1e9:.1f} |")
    print(f"| GPU -> host alone | {alone_out / 1e9:.1f} |")
    print(f"| both at once, each way | {moved / both_s / 1e9:.1f} |")
    print(f"| both at once, sum | {2 * moved / both_s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
