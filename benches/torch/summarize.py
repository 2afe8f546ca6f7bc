"""Prints the table of benchmark results: the RESULT lines of bench_regime.py, bench_llama.py and
bench_deepspeed.py logs, or saved results files (benches/results/*/*.jsonl).

    python3 benches/torch/summarize.py OUT/results.jsonl [more logs ...] [--reports]

One table per model, dtype and shape: ms/iter, % of ideal, peak allocated / reserved, bytes per
tier and recomputed, teraio's predicted against measured iteration, its host time, and the loss
agreement with the first ideal run next to the ideal-vs-ideal spread. After each table, per cap:
teraio against the fastest checkpointing mode that fits, and the targets. `--reports`
adds each teraio run's own report.

    python3 benches/torch/summarize.py --array OUT/results.jsonl

prints the emulated-array sweep's table (`run-gpu.sh sweep`): % of ideal per device count next to
the simulator's prediction.

    python3 benches/torch/summarize.py --index benches/results

writes benches/results/README.md: one table per <date>-<machine> folder, each file with what it
holds (from the folder's about.txt, one `file: description` line per file) and the key figures
of its RESULT records.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

GIB = 1 << 30
MODE_ORDER = ["ideal", "teraio", "hf_ckpt", "sac", "save_on_cpu", "torchtune"]
CHECKPOINTING = ("hf_ckpt", "sac")
#: Targets: teraio over the best checkpointing mode, % of ideal at the 65% cap, prediction error.
TARGET_SPEEDUP = 1.15
TARGET_PERCENT_AT_65 = 80.0
TARGET_PREDICTION = 0.10


def load(paths: Iterable[str]) -> list[dict[str, Any]]:
    results = []
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.startswith("RESULT "):
                    results.append(json.loads(line[len("RESULT ") :]))
                elif line.startswith("{"):  # a saved results file
                    results.append(json.loads(line))
    return results


def group_key(r: dict[str, Any]) -> tuple[str, str, int, int]:
    # bench_llama.py's rows before it named its model: the fp32 0.85B Llama.
    return (r.get("family", "llama-0.85b"), r.get("dtype", "fp32"), r.get("batch", 0), r.get("seq", 2048))


def ok(r: dict[str, Any]) -> bool:
    return "ms_per_iter" in r and not r.get("oom") and "error" not in r


def peak_of(r: dict[str, Any]) -> Optional[int]:
    peak = r.get("peak_allocated_bytes", r.get("peak_bytes"))
    rep = r.get("teraio_report") or {}
    # bench_llama.py's teraio rows: the allocator's peak was reset at each iteration, so the
    # report's figure is the one to take.
    if "peak_allocated_bytes" not in r and rep.get("peak_gpu_bytes"):
        peak = rep["peak_gpu_bytes"]
    return peak


def gib(value: Optional[float]) -> str:
    """GiB with one decimal; MiB below 0.1 GiB (small test runs)."""
    if value is None:
        return "-"
    return f"{value / GIB:.1f}" if value == 0 or value >= GIB / 10 else f"{value / 2**20:.1f} MiB"


def max_loss_diff(a: list[float], b: list[float]) -> Optional[float]:
    n = min(len(a), len(b))
    return max(abs(x - y) for x, y in zip(a[:n], b[:n])) if n else None


def ideal_spread(ideals: list[dict[str, Any]]) -> Optional[float]:
    """Largest |loss difference| between the first ideal run and each repeat (None: one run)."""
    diffs = [max_loss_diff(r["losses"], ideals[0]["losses"]) for r in ideals[1:] if r.get("losses")]
    diffs = [d for d in diffs if d is not None]
    return max(diffs) if diffs else None


def loss_agreement(r: dict[str, Any], base: Optional[dict[str, Any]], spread: Optional[float]) -> str:
    if base is None or not r.get("losses") or not base.get("losses") or r is base:
        return "-"
    a, b = r["losses"], base["losses"]
    n = min(len(a), len(b))
    diff = max_loss_diff(a, b)
    if diff == 0:
        return f"bitwise ({n} steps)"
    text = f"max {diff:.1e} ({n} steps)"
    if spread is not None and r.get("mode") != "ideal":
        text += ", within ideal's spread" if diff <= spread else ", **beyond ideal's spread**"
    return text


def cap_label(r: dict[str, Any], ideal_peak: Optional[int]) -> str:
    cap = r.get("cap_bytes")
    if not cap:
        return "-"
    fraction = r.get("cap_fraction") or (cap / ideal_peak if ideal_peak else None)
    size = gib(cap) + ("" if gib(cap).endswith("MiB") else " GiB")
    return f"{100 * fraction:.0f}% ({size})" if fraction else size


def moved(rep: dict[str, Any]) -> str:
    """Bytes offloaded per iteration, host and SSD: activations, plus optimizer state and
    parameters where the run moved any."""

    def tiers(key: str) -> tuple[float, float]:
        offloaded = (rep.get(key) or {}).get("offloaded") or {}
        return float(offloaded.get("host", 0)), float(offloaded.get("ssd", 0))

    host, ssd = tiers("bytes_per_iteration")
    text = f"act. {gib(host)} + {gib(ssd)}"
    for key, label in (("state_bytes_per_iteration", "state"), ("parameter_bytes_per_iteration", "params")):
        h, s = tiers(key)
        if h or s:
            text += f"; {label} {gib(h)} + {gib(s)}"
    return text


def host_overhead_ms(rep: dict[str, Any]) -> Optional[float]:
    host = rep.get("host_ms_per_iteration") or {}
    if isinstance(host, (int, float)):
        return float(host)  # whole-model records saved before it took the others' shape
    parts = [v for k, v in host.items() if not k.startswith("of which") and isinstance(v, (int, float))]
    return sum(parts) if parts else None


def status(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    if r.get("oom_at_larger_cap"):
        return f"**out of memory** at {100 * r['oom_at_larger_cap']:.0f}% already (not run)"
    if r.get("oom") or "out of memory" in str(r.get("error", "")):
        step = r.get("oom_step")
        return "**out of memory**" + (f" at step {step}" if step is not None and step >= 0 else "")
    if r.get("timeout"):
        return f"**timed out** ({r.get('error', '')})"
    return f"**failed**: {str(r.get('error', '?'))[:200]}"


def mode_label(r: dict[str, Any]) -> str:
    """teraio rows say whether they ran with default arguments or the machine's measured ones."""
    mode = r.get("mode", r.get("config", "?"))  # bench_fsdp.py's rows name a configuration
    arguments = r.get("arguments")
    names = {"defaults": "default arguments", "measured": "measured bandwidths"}
    return f"{mode} ({names.get(arguments, arguments)})" if mode == "teraio" and arguments else mode


def row_order(r: dict[str, Any]) -> tuple[int, float, int]:
    mode = r.get("mode", "")
    rank = MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)
    if mode == "ideal" and not r.get("cap_bytes"):
        return (0, 0.0, 0)
    return (1, -(r.get("cap_bytes") or 0), rank)


def table(rows: list[dict[str, Any]]) -> list[str]:
    ideals = [r for r in rows if r.get("mode") == "ideal" and not r.get("cap_bytes") and ok(r)]
    base = ideals[0] if ideals else None
    ideal_ms = base["ms_per_iter"] if base else None
    ideal_peak = peak_of(base) if base else None
    spread = ideal_spread(ideals)
    out = [
        "| mode | cap | ms/iter | % of ideal | peak alloc / reserved GiB | moved / iter host + SSD GiB "
        "| recomputed / iter | predicted / measured ms | host time in teraio | losses vs ideal |",
        "|---|---|---:|---:|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=row_order):
        mode = mode_label(r)
        cap = cap_label(r, ideal_peak)
        if not ok(r):
            out.append(f"| {mode} | {cap} | - | - | - | - | - | - | - | {status(r)} |")
            continue
        ms = r["ms_per_iter"]
        pct = f"{100 * ideal_ms / ms:.1f}%" if ideal_ms else "-"
        peak = f"{gib(peak_of(r))} / {gib(r.get('peak_reserved_bytes'))}"
        rep = r.get("teraio_report") or {}
        traffic, recomputed, predicted, host = "-", "-", "-", "-"
        if rep:
            traffic = moved(rep)
            recomputed = f"{gib(rep.get('recomputed_bytes_per_iteration') or 0)} GiB" + block_actions(rep)
            pred = rep.get("predicted_iteration_ms")
            if pred:
                error = (pred - ms) / ms
                flag = " **>10%**" if abs(error) > TARGET_PREDICTION else ""
                predicted = f"{pred:.0f} / {ms:.0f} ({100 * error:+.0f}%){flag}"
            else:
                predicted = f"none / {ms:.0f}"
            overhead = host_overhead_ms(rep)
            if overhead is not None:
                host = f"{overhead:.0f} ms" + (
                    f" ({100 * overhead / ideal_ms:.0f}% of ideal)" if ideal_ms else ""
                )
        losses = loss_agreement(r, base, spread)
        if r is base:
            losses = "reference" + (
                ""
                if spread is None
                else (", repeat: bitwise" if spread == 0 else f", repeat: max {spread:.1e}")
            )
        out.append(
            f"| {mode} | {cap} | {ms:.0f} | {pct} | {peak} | {traffic} | {recomputed} | {predicted} "
            f"| {host} | {losses} |"
        )
    out += verdicts(rows, ideal_ms, ideal_peak)
    return out


def block_actions(rep: dict[str, Any]) -> str:
    """The block plan's actions, counted ("" for a report without them)."""
    actions = list((rep.get("actions") or {}).values())
    if not actions:
        return ""
    names = {"keep": "kept", "host": "to host", "selective": "selective", "recompute": "whole"}
    counts = [f"{actions.count(a)} {label}" for a, label in names.items() if actions.count(a)]
    return " (blocks: " + ", ".join(counts) + ")"


def verdicts(rows: list[dict[str, Any]], ideal_ms: Optional[float], ideal_peak: Optional[int]) -> list[str]:
    """Per cap: teraio against the fastest checkpointing mode that fits, and the targets."""
    lines = []
    caps = sorted({r["cap_bytes"] for r in rows if r.get("cap_bytes")}, reverse=True)
    for cap in caps:
        at_cap = [r for r in rows if r.get("cap_bytes") == cap]
        # The row a user gets (default arguments) is the one the targets are about.
        teraio = sorted(
            (r for r in at_cap if r.get("mode") == "teraio"), key=lambda r: r.get("arguments") != "defaults"
        )
        if not teraio:
            continue
        label = cap_label(at_cap[0], ideal_peak)
        t = teraio[0]
        fitting = [r for r in at_cap if r.get("mode") in CHECKPOINTING and ok(r)]
        tried = [r for r in at_cap if r.get("mode") in CHECKPOINTING and "skipped" not in r]
        if not ok(t):
            lines.append(f"- cap {label}: {mode_label(t)} {status(t)}")
            continue
        parts = []
        if fitting:
            best = min(fitting, key=lambda r: r["ms_per_iter"])
            speedup = best["ms_per_iter"] / t["ms_per_iter"]
            verdict = "met" if speedup >= TARGET_SPEEDUP else "missed"
            parts.append(
                f"teraio {speedup:.2f}x the best checkpointing mode that fits "
                f"({best['mode']}, {best['ms_per_iter']:.0f} ms; target {TARGET_SPEEDUP}x: {verdict})"
            )
        elif tried:
            parts.append("every checkpointing mode ran out of memory or failed; teraio trains")
        if ideal_ms:
            pct = 100 * ideal_ms / t["ms_per_iter"]
            fraction = t.get("cap_fraction") or (cap / ideal_peak if ideal_peak else None)
            target = ""
            if fraction is not None and abs(fraction - 0.65) < 0.01:
                verdict = "met" if pct >= TARGET_PERCENT_AT_65 else "missed"
                target = f" (target {TARGET_PERCENT_AT_65:.0f}%: {verdict})"
            parts.append(f"{pct:.1f}% of ideal{target}")
        pred = (t.get("teraio_report") or {}).get("predicted_iteration_ms")
        if pred:
            error = (pred - t["ms_per_iter"]) / t["ms_per_iter"]
            verdict = "met" if abs(error) <= TARGET_PREDICTION else "missed"
            parts.append(f"prediction {100 * error:+.1f}% (target 10%: {verdict})")
        lines.append(f"- cap {label}, {mode_label(t)}: " + "; ".join(parts))
    return [""] + lines if lines else []


ABOUT = "about.txt"
INDEX = "README.md"
_FOLDER = re.compile(r"^(\d{4}-\d{2}-\d{2})-([a-z0-9]+)$")


def descriptions(folder: Path) -> dict[str, str]:
    """The folder's about.txt: what each file holds. Every file must be described, and only
    files that exist, so the index never shows a file without saying what it is."""
    about = folder / ABOUT
    if not about.is_file():
        raise ValueError(f"{folder}: no {ABOUT} (one `file: what it holds` line per file)")
    described: dict[str, str] = {}
    for number, line in enumerate(about.read_text().splitlines(), 1):
        if not line.strip():
            continue
        name, sep, text = line.partition(": ")
        if not sep or not text.strip():
            raise ValueError(f"{about}:{number}: expected `file: what it holds`, got {line!r}")
        if name in described:
            raise ValueError(f"{about}:{number}: {name} is described twice")
        described[name] = text.strip()
    files = {p.name for p in folder.iterdir() if p.is_file() and p.name != ABOUT}
    if files - described.keys():
        raise ValueError(f"{about}: no description for {', '.join(sorted(files - described.keys()))}")
    if described.keys() - files:
        raise ValueError(f"{about}: describes missing {', '.join(sorted(described.keys() - files))}")
    return described


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def key_figures(r: dict[str, Any]) -> list[str]:
    """mode, batch, cap, ms/iter and peak GPU memory (per rank for data-parallel runs)."""
    mode = mode_label(r) + (f", {r['world_size']} ranks" if r.get("world_size", 1) > 1 else "")
    batch = r.get("batch", r.get("global_batch"))
    cap = gib(r.get("cap_bytes")) if r.get("cap_bytes") else "-"
    if not ok(r):
        return [mode, str(batch), cap, cell(status(r)[:80]), "-"]
    per_rank = r.get("peak_bytes_per_rank")
    peak = " / ".join(gib(p) for p in per_rank) if per_rank else gib(peak_of(r))
    return [mode, str(batch), cap, f"{r['ms_per_iter']:.0f}", peak]


def index_markdown(root: Path) -> str:
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    out = [
        "# Benchmark results",
        "",
        "Generated by `python3 benches/torch/summarize.py --index benches/results` from each",
        f"folder's `{ABOUT}` and the RESULT records of its files; edit those, not this file.",
        'One folder per date and machine; the newest folder holds the latest figures. "Flagship":',
        "the Llama-shaped 0.85B model, fp32, AdamW, batch 4 x 2048, GPU memory capped at 22.53 GiB",
        "(half the peak of training without a cap). Peaks and caps in GiB; `-` where a file or run",
        "has no such figure.",
    ]
    for folder in folders:
        match = _FOLDER.match(folder.name)
        if not match:
            raise ValueError(f"{folder}: results folders are named <yyyy-mm-dd>-<machine>")
        out += ["", f"## {match.group(1)}, {match.group(2)}: [{folder.name}/]({folder.name}/)", ""]
        out += [
            "| file | what it holds | mode | batch | cap | ms/iter | peak |",
            "|---|---|---|---:|---:|---:|---|",
        ]
        for name, text in sorted(descriptions(folder).items()):
            # Archives (recorded iterations and the like) hold no RESULT lines.
            records = [] if name.endswith((".tgz", ".gz")) else load([str(folder / name)])
            rows = [key_figures(r) for r in records] or [["-"] * 5]
            for i, figures in enumerate(rows):
                first = [f"`{name}`", cell(text)] if i == 0 else ["", ""]
                out.append("| " + " | ".join(first + figures) + " |")
    return "\n".join(out) + "\n"


def write_index(root: Path) -> Path:
    path = root / INDEX
    path.write_text(index_markdown(root))
    return path


def off_by(measured: Optional[float], predicted: Optional[float]) -> str:
    """(measured - predicted) / predicted, or "-"."""
    return f"{(measured - predicted) / predicted:+.1%}" if measured and predicted else "-"


def array_table(rows: list[dict[str, Any]]) -> list[str]:
    """The emulated-array sweep (`run-gpu.sh sweep`): per device count, teraio's iteration and
    the simulator's replay of that row's recorded iteration, each as % of the reference row's
    measured iteration (the ideal), and what the 1-device row's record predicts for that count."""
    ideal = next((r.get("ms_per_iter") for r in rows if r.get("mode") == "reference" and ok(r)), None)
    arrays = sorted((r for r in rows if "devices" in r), key=lambda r: r["devices"])
    first = next((r for r in arrays if r["devices"] == 1), None)
    from_one = (first or {}).get("predicted_ms_by_devices", {})

    def pct(ms: Optional[float]) -> str:
        return f"{100 * ideal / ms:.1f}%" if ideal and ms else "-"

    def ms_cell(ms: Optional[float]) -> str:
        return f"{ms:.0f}" if ms else "-"

    lines = [
        f"ideal (no offload, measured in the same call): {ms_cell(ideal)} ms/iter",
        "",
        "| devices | teraio ms/iter | % of ideal | predicted (its own record) | % of ideal | "
        "measured vs predicted | predicted from the 1-device record | measured vs that |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in arrays:
        measured = r.get("ms_per_iter") if ok(r) else None
        predicted = (r.get("teraio_report") or {}).get("predicted_iteration_ms")
        one = from_one.get(str(r["devices"]))  # JSON object keys are strings

        lines.append(
            f"| {r['devices']} | {ms_cell(measured) if measured else status(r)} | {pct(measured)} | "
            f"{ms_cell(predicted)} | {pct(predicted)} | {off_by(measured, predicted)} | {ms_cell(one)} | "
            f"{off_by(measured, one)} |"
        )
    return lines


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--array"]:
        print("\n".join(array_table(load(argv[1:]))))
        return
    if argv[:1] == ["--index"]:
        if len(argv) != 2:
            sys.exit("usage: summarize.py --index RESULTS_DIR")
        try:
            print(f"wrote {write_index(Path(argv[1]))}")
        except ValueError as e:
            sys.exit(f"summarize.py: {e}")
        return
    reports = "--reports" in argv
    results = load([a for a in argv if a != "--reports"])
    groups: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(group_key(r), []).append(r)
    for (family, dtype, batch, seq), rows in groups.items():
        params = next((r["params"] for r in rows if r.get("params")), None)
        size = f", {params / 1e9:.2f}B parameters" if params and params >= 1e8 else ""
        size = size or (f", {params / 1e6:.1f}M parameters" if params else "")
        print(f"\n### {family}, {dtype}, batch {batch} x {seq}{size}\n")
        print("\n".join(table(rows)))
    not_trained = [r for r in results if r.get("mode") == "teraio" and (r.get("oom") or r.get("error"))]
    if any(r.get("mode") == "teraio" for r in results):
        print(f"\nteraio runs that did not train: {len(not_trained)}" + " (target: none)")
    if reports:
        for r in results:
            if r.get("teraio_report_text"):
                print(f"\nteraio, {' '.join(str(k) for k in group_key(r))}, cap {cap_label(r, None)}:")
                print(r["teraio_report_text"])
    for r in results:
        for key in (
            "link_d2h_bytes_per_s",
            "link_h2d_bytes_per_s",
            "ssd_write_bytes_per_s",
            "ssd_read_bytes_per_s",
        ):
            if key in r:
                print(f"  {group_key(r)[0]} {r.get('mode')}: {key} {r[key] / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
