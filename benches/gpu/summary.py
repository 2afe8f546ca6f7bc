"""Prints the GPU benchmark table from the RESULT lines of gpu_bench and kvikio_bench logs."""
import sys

r = {}
for path in sys.argv[1:]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        p = line.split()
        if len(p) == 4 and p[0] == "RESULT":
            r[p[1]] = (float(p[2]), float(p[3]))
print(f"{'measurement':34} {'GB/s':>7} {'cores':>6} {'cores/(GB/s)':>12}")
for k, (g, c) in r.items():
    print(f"{k:34} {g:7.3f} {c:6.3f} {c / g:12.3f}")


def ratio(a, b):
    return f"{r[a][0] / r[b][0]:.2f}" if a in r and b in r else "n/a"


for d in ("bounce", "cufile", "auto", "bounce_qd32", "cufile_qd32"):
    get, put = f"d_read_teraio_{d}", f"d_write_teraio_{d}"
    if get not in r:
        continue
    print(f"get {d}: x(a) {ratio(get, 'a_read_odirect_pinned')}  x(a32) {ratio(get, 'a_read_odirect_pinned_qd32')}  x(b) {ratio(get, 'b_read_cufile')}  "
          f"x(b1) {ratio(get, 'b1_read_cufile_one_call')}  x(c) {ratio(get, 'c_read_kvikio')}")
    if put in r:
        print(f"put {d}: x(a) {ratio(put, 'a_write_pinned_odirect')}  x(a32) {ratio(put, 'a_write_pinned_odirect_qd32')}  x(b) {ratio(put, 'b_write_cufile')}  "
              f"x(b1) {ratio(put, 'b1_write_cufile_one_call')}  x(c) {ratio(put, 'c_write_kvikio')}")
