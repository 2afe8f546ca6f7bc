#!/usr/bin/env python3
"""Turns the guest console log (stdin) into the benchmark table of docs/nvme.md (Markdown)."""
import json
import sys

rows = []
fio_name, fio_text = None, []
for line in sys.stdin:
    line = line.rstrip("\n")
    if line.startswith('{"path"'):
        rows.append(json.loads(line))
    elif line.startswith("TERAIO-FIO-BEGIN"):
        fio_name, fio_text = line.split()[1], []
    elif line.startswith("TERAIO-FIO-END") and fio_name:
        text = "\n".join(fio_text)
        try:
            job = json.loads(text[text.index("{"):])["jobs"][0]
        except (ValueError, KeyError, IndexError):
            rows.append({"path": "fio io_uring_cmd", "workload": fio_name, "error": True})
            fio_name = None
            continue
        side = job["write"] if fio_name.startswith("seqwrite") else job["read"]
        ios = side["total_ios"] or 1
        pct = side.get("clat_ns", {}).get("percentile", {})
        runtime_s = job["job_runtime"] / 1000.0 or 1
        cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_s
        rows.append({
            "path": "fio io_uring_cmd", "workload": fio_name, "iops": side["iops"],
            "gbps": side["bw_bytes"] / 1e9,
            "lat_us_p50": pct.get("50.000000", 0) / 1000, "lat_us_p99": pct.get("99.000000", 0) / 1000,
            "lat_us_p999": pct.get("99.900000", 0) / 1000, "cpu_us_per_io": cpu_s * 1e6 / ios,
        })
        fio_name = None
    elif fio_name is not None:
        fio_text.append(line)

order = ["seqwrite1m-qd8", "seqread1m-qd8", "randread4k-qd1", "randread4k-qd128"]
paths = ["io_uring", "nvme-passthru", "nvme-vfio", "fio io_uring_cmd"]
label = {"io_uring": "block device, io_uring O_DIRECT", "nvme-passthru": "io_uring NVMe passthrough",
         "nvme-vfio": "userspace driver (VFIO)", "fio io_uring_cmd": "fio io_uring_cmd (reference)"}
print("| workload | path | IOPS | GB/s | p50 µs | p99 µs | p99.9 µs | CPU µs/IO | vs block (GB/s seq, IOPS rand) |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for w in order:
    base = next((r for r in rows if r["workload"] == w and r["path"] == "io_uring" and "iops" in r), None)
    for p in paths:
        for r in rows:
            if r["workload"] != w or r["path"] != p:
                continue
            if "iops" not in r:
                print(f"| {w} | {label[p]} | failed | | | | | | |")
                continue
            # Sequential runs compare bandwidth (fio uses a different block size), random ones IOPS.
            key = "gbps" if w.startswith("seq") else "iops"
            ratio = f"{r[key] / base[key]:.2f}x" if base and base[key] else ""
            print(f"| {w} | {label[p]} | {r['iops']:.0f} | {r['gbps']:.3f} | {r['lat_us_p50']:.1f} | "
                  f"{r['lat_us_p99']:.1f} | {r['lat_us_p999']:.1f} | {r['cpu_us_per_io']:.2f} | {ratio} |")
