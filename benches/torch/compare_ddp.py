"""Compares bench_ddp.py runs (reference, ddp-plain, ddp-teraio): one markdown table.

    python3 benches/torch/compare_ddp.py OUT/ddp-*.log          # logs with `RESULT {json}` lines
    python3 benches/torch/compare_ddp.py OUT/results-ddp.jsonl  # or bench_ddp.py --out files

Per mode: ms/iter (median after the warm-up steps), each rank's peak memory, the largest
|loss difference| against the reference (one device, the whole global batch: equal up to
rounding) and against ddp-plain, whether the losses and the final parameters are bitwise those
of ddp-plain (offload only moves bytes, so ddp-teraio should be), and for ddp-teraio each rank's
offloaded bytes per iteration, GB/s over the measured iteration time, and stalls. When a mode
appears more than once, the last result counts.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

GIB = 1 << 30


def load(paths: list[str]) -> dict[str, dict[str, Any]]:
    """The last result of each mode in the files (RESULT lines or plain JSON lines)."""
    by_mode: dict[str, dict[str, Any]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("RESULT "):
                    line = line[len("RESULT ") :]
                elif not line.startswith("{"):
                    continue
                try:
                    result = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(result, dict) and "mode" in result:
                    by_mode[result["mode"]] = result
    return by_mode


def max_diff(a: Optional[list[float]], b: Optional[list[float]]) -> Optional[float]:
    if not a or not b:
        return None
    n = min(len(a), len(b))
    return max(abs(x - y) for x, y in zip(a[:n], b[:n]))


def size(value: Optional[int]) -> str:
    if value is None:
        return "-"
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / (1 << 20):.1f} MiB"


def per_rank(values: list[str]) -> str:
    return " / ".join(f"r{i} {v}" for i, v in enumerate(values)) if values else "-"


def fmt_diff(value: Optional[float], reference: Optional[list[float]]) -> str:
    if value is None:
        return "-"
    scale = max((abs(x) for x in reference or [1.0]), default=1.0) or 1.0
    return f"{value:.2e} (rel {value / scale:.1e})"


def bitwise(result: dict[str, Any], plain: Optional[dict[str, Any]]) -> str:
    """Losses (and parameter fingerprints) equal to ddp-plain's, float for float."""
    if plain is None or result is plain or "losses" not in result or "losses" not in plain:
        return "-"
    if result.get("mode") == "reference":
        return "-"  # other sums in another order: equal only up to rounding
    losses = result["losses"] == plain["losses"]
    params = result.get("param_fingerprint") == plain.get("param_fingerprint")
    return f"losses {'yes' if losses else 'NO'}, params {'yes' if params else 'NO'}"


def teraio_columns(result: dict[str, Any]) -> tuple[str, str, str]:
    ranks = result.get("teraio") or []
    if not ranks:
        return "-", "-", "-"
    moved, rates, stalls = [], [], []
    for entry in ranks:
        report = entry.get("teraio_report", {})
        offloaded = report.get("bytes_per_iteration", {}).get("offloaded", {})
        text = f"{size(offloaded.get('host', 0))}+{size(offloaded.get('ssd', 0))}"
        state = (report.get("state_bytes_per_iteration") or {}).get("offloaded", {})
        if any(state.values()):
            text += f" (state {size(state.get('host', 0))}+{size(state.get('ssd', 0))})"
        moved.append(text)
        gbps = entry.get("gbps", {})
        # All traffic (activations and any optimizer state), and the SSD share of the offloads.
        down = sum(v for k, v in gbps.items() if "offloaded_" in k)
        up = sum(v for k, v in gbps.items() if "prefetched_" in k)
        ssd = sum(v for k, v in gbps.items() if k.endswith("offloaded_ssd"))
        rates.append(f"{down:.1f}/{up:.1f} (ssd {ssd:.2f})")
        s = report.get("stalls", {})
        stalls.append(
            f"{s.get('prefetches_on_demand', 0)} on demand, ssd wait {s.get('ssd_wait_s', 0.0):.2f} s, "
            f"d2h wait {s.get('inflight_wait_s', 0.0):.2f} s, {s.get('plan_mismatches', 0)} mismatches"
        )
    return per_rank(moved), per_rank(rates), per_rank(stalls)


def table(by_mode: dict[str, dict[str, Any]]) -> str:
    reference = by_mode.get("reference")
    plain = by_mode.get("ddp-plain")
    rows = [
        "| mode | ranks | global batch | ms/iter | peak per rank | max abs loss diff vs reference "
        "| max abs loss diff vs ddp-plain | bitwise = ddp-plain | offloaded per iter (host+ssd) "
        "| GB/s offload/prefetch | stalls |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = ["reference", "ddp-plain", "ddp-teraio"]
    modes = [m for m in order if m in by_mode] + sorted(m for m in by_mode if m not in order)
    for mode in modes:
        r = by_mode[mode]
        if "error" in r:
            rank = f" (rank {r['rank']})" if "rank" in r else ""
            rows.append(f"| {mode} | {r.get('world_size', '-')} | - | error{rank}: {r['error'][:160]} |")
            continue
        vs_ref = (
            max_diff(r.get("losses"), reference.get("losses")) if reference and r is not reference else None
        )
        vs_plain = max_diff(r.get("losses"), plain.get("losses")) if plain and r is not plain else None
        moved, rates, stalls = teraio_columns(r)
        peaks_list = r.get("peak_bytes_per_rank") or []
        peaks = per_rank([size(p) for p in peaks_list]) if any(p is not None for p in peaks_list) else "-"
        rows.append(
            f"| {mode} | {r.get('world_size', '-')} | {r.get('global_batch', '-')} "
            f"| {r.get('ms_per_iter', 0.0):.1f} | {peaks} "
            f"| {fmt_diff(vs_ref, reference.get('losses') if reference else None)} "
            f"| {fmt_diff(vs_plain, plain.get('losses') if plain else None)} "
            f"| {bitwise(r, plain)} | {moved} | {rates} | {stalls} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__)
        return 2
    by_mode = load(paths)
    if not by_mode:
        print("no RESULT lines found in " + ", ".join(paths))
        return 1
    print(table(by_mode))
    for mode, r in by_mode.items():
        if "param_checksum" in r:
            print(
                f"- {mode}: param checksum {r['param_checksum']!r}, fingerprint {r.get('param_fingerprint')}"
            )
    teraio = by_mode.get("ddp-teraio")
    plain = by_mode.get("ddp-plain")
    if teraio and plain and "losses" in teraio and "losses" in plain:
        same = teraio["losses"] == plain["losses"]
        print(f"- ddp-teraio losses bitwise equal to ddp-plain: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
