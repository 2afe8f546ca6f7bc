"""Reads the RESULT lines of bench_llama.py / bench_deepspeed.py logs and prints the table."""

from __future__ import annotations

import json
import sys
from typing import Any

GIB = 1 << 30


def load(paths: list[str]) -> list[dict[str, Any]]:
    results = []
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.startswith("RESULT "):
                    results.append(json.loads(line[len("RESULT ") :]))
                elif line.startswith("{"):  # a saved results file (benches/torch/results/)
                    results.append(json.loads(line))
    return results


def losses_match(result: dict[str, Any], ideal: dict[str, Any] | None) -> str:
    if ideal is None or "losses" not in result or "losses" not in ideal:
        return "-"
    a, b = result["losses"], ideal["losses"]
    n = min(len(a), len(b))
    if n == 0:
        return "-"
    same = sum(1 for x, y in zip(a[:n], b[:n]) if x == y)
    diff = max(abs(x - y) for x, y in zip(a[:n], b[:n]))
    return f"{same}/{n} bitwise" + ("" if same == n else f", max diff {diff:.2e}")


def main() -> None:
    results = load(sys.argv[1:])
    ideal = {r["batch"]: r for r in results if r["mode"] == "ideal" and "ms_per_iter" in r}
    rows = [
        "| mode | batch | steps (timed) | ms/iter | % of ideal | peak GPU | cap "
        "| offloaded/iter host, ssd | stalls | losses vs ideal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            rows.append(
                f"| {r['mode']} | {r['batch']} | - | - | - | - | - | - | - | **failed**: {r['error'][:300]} |"
            )
            continue
        base = ideal.get(r["batch"])
        pct = f"{100 * base['ms_per_iter'] / r['ms_per_iter']:.1f}%" if base else "-"
        cap = f"{r['cap_bytes'] / GIB:.1f} GiB" if r.get("cap_bytes") else "-"
        moved, stalls = "-", "-"
        rep = r.get("teraio_report")
        peak = r["peak_bytes"]
        if rep:
            # teraio.offload resets the allocator's peak at each iteration: its report has the
            # peak of the planned steps.
            peak = rep.get("peak_gpu_bytes") or peak
            off = rep["bytes_per_iteration"]["offloaded"]
            moved = f"{off['host'] / GIB:.1f}, {off['ssd'] / GIB:.2f} GiB"
            if rep.get("recomputed_bytes_per_iteration"):
                moved += f" ({rep['recomputed_bytes_per_iteration'] / GIB:.1f} GiB recomputed)"
            s = rep["stalls"]
            stalls = (
                f"{s['prefetches_on_demand']} late, ssd wait {s['ssd_wait_s']:.2f} s, "
                f"d2h waits {s['inflight_waits']} ({s['inflight_wait_s']:.2f} s)"
            )
        timed = f"{r['steps']} ({r['steps'] - r['warmup']})"
        rows.append(
            f"| {r['mode']} | {r['batch']} | {timed} | {r['ms_per_iter']:.0f} | {pct} "
            f"| {peak / GIB:.1f} GiB | {cap} | {moved} | {stalls} | {losses_match(r, base)} |"
        )
    print("\n".join(rows))
    for r in results:
        if r.get("teraio_report_text"):
            print(f"\nteraio batch {r['batch']}:\n{r['teraio_report_text']}")
        for key in (
            "link_d2h_bytes_per_s",
            "link_h2d_bytes_per_s",
            "ssd_write_bytes_per_s",
            "ssd_read_bytes_per_s",
        ):
            if key in r:
                print(f"  {key}: {r[key] / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
