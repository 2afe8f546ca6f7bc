"""kvikio (c) on the same file region as gpu_bench: one pwrite then one pread of NBYTES at OFFSET
from/into GPU memory, each timed with host CPU time (user+system of this process). Prints
`RESULT name gbps cores` lines like gpu_bench, and checks that the bytes read equal those written.

Each is done ROUNDS times (default 3); the RESULT lines give the median round.

Usage: python3 kvikio_bench.py FILE NBYTES OFFSET [ROUNDS]
"""
import os
import resource
import sys
import time

import cupy as cp
import kvikio
import kvikio.defaults


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass


def setting(name):
    for getter in (lambda: kvikio.defaults.get(name), lambda: getattr(kvikio.defaults, name)()):
        try:
            return getter()
        except Exception:
            continue
    return "unknown"


def main():
    path, nbytes, offset = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(f"kvikio {kvikio.__version__}: compat_mode={setting('compat_mode')} "
          f"num_threads={setting('num_threads')} task_size={setting('task_size')}")
    src = cp.random.randint(0, 256, nbytes, dtype=cp.uint8)
    dst = cp.zeros(nbytes, dtype=cp.uint8)
    cp.cuda.runtime.deviceSynchronize()
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    results = []
    same = True
    with kvikio.CuFile(path, "r+") as f:
        try:
            # True: kvikio does POSIX I/O plus its own bounce copies; False: it calls cuFile.
            print(f"kvikio file handle prefers compat (POSIX) mode: {f.is_compat_mode_preferred()}")
        except Exception as e:  # older kvikio
            print(f"kvikio file handle mode: unknown ({e})")
        for _ in range(rounds):
            drop_caches()
            c0, t0 = cpu_seconds(), time.perf_counter()
            f.pwrite(src, nbytes, file_offset=offset).get()
            fd = os.open(path, os.O_RDWR)
            os.fdatasync(fd)
            os.close(fd)
            wall = time.perf_counter() - t0
            results.append(("c_write_kvikio", nbytes / wall / 1e9, (cpu_seconds() - c0) / wall))
            drop_caches()
            c0, t0 = cpu_seconds(), time.perf_counter()
            f.pread(dst, nbytes, file_offset=offset).get()
            wall = time.perf_counter() - t0
            results.append(("c_read_kvikio", nbytes / wall / 1e9, (cpu_seconds() - c0) / wall))
            same = same and bool(cp.array_equal(src, dst))
            dst.fill(0)
    for name in ("c_write_kvikio", "c_read_kvikio"):
        mine = sorted((g, c) for n, g, c in results if n == name)
        print(f"  rounds {name}: {' '.join(f'{g:.2f}' for g, _ in mine)} GB/s")
        gbps, cores = mine[len(mine) // 2]
        print(f"RESULT {name} {gbps:.3f} {cores:.3f}")
    print(f"kvikio read-back equals written bytes: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
