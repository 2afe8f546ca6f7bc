#!/usr/bin/env bash
# Runs teraio's raw NVMe backend tests (and the path benchmark) in a KVM guest with four emulated
# NVMe drives: the Debian kernel, an initramfs with busybox, the statically linked test binaries,
# fio, and the nvme/vfio modules; an emulated Intel IOMMU so vfio-pci works in the guest.
#
#   bash scripts/kvm/run-guest-tests.sh [tests|bench|all]     (default: tests)
#
# Exit status: 0 only when every guest test (and benchmark run) passed. It fails loudly, never
# skips, when KVM, QEMU or the kernel is missing. Env: CARGO_TARGET_DIR (build dir),
# TERAIO_KVM_WORK (where images go; default a temp dir, removed at the end),
# TERAIO_KVM_SECONDS (seconds per benchmark run; default 3), TERAIO_KVM_TIMEOUT (default 600 s).
set -euo pipefail
MODE=${1:-tests}
case $MODE in tests|bench|all) ;; *) echo "usage: $0 [tests|bench|all]" >&2; exit 2 ;; esac
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/scripts/kvm
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
SECONDS_PER_RUN=${TERAIO_KVM_SECONDS:-3}
TIMEOUT=${TERAIO_KVM_TIMEOUT:-600}

fail() { echo "run-guest-tests: FAIL: $*" >&2; exit 1; }

# --- what the host must have -------------------------------------------------------------
if [ ! -e /dev/kvm ]; then
    fail "/dev/kvm does not exist (CI=${CI:-unset}). The NVMe backend tests need KVM and are never skipped: run on a machine with hardware virtualization (and load kvm_intel/kvm_amd)."
fi
[ -r /dev/kvm ] && [ -w /dev/kvm ] || fail "/dev/kvm is not readable and writable by $(id -un): add the user to the kvm group or run as root"
# Accelerator. KVM by default; a host whose KVM is PVM (kvm_pvm: a pagetable-based hypervisor
# used by some cloud sandboxes, no vmx/svm) boots only PVM-enabled guest kernels, never Debian's,
# so there we run under TCG emulation and say so loudly. TERAIO_KVM_ACCEL=kvm|tcg overrides.
ACCEL=${TERAIO_KVM_ACCEL:-}
if [ -z "$ACCEL" ]; then
    if [ -d /sys/module/kvm_pvm ] && ! grep -q -w -E 'vmx|svm' /proc/cpuinfo; then
        ACCEL=tcg
        echo "run-guest-tests: WARNING: /dev/kvm is PVM (kvm_pvm), which cannot boot the stock Debian kernel;" >&2
        echo "run-guest-tests: WARNING: running the guest under TCG emulation (same tests, ~10x slower; benchmark CPU figures inflated)." >&2
    else
        ACCEL=kvm
    fi
fi
case $ACCEL in
    kvm) MACHINE="q35,accel=kvm,kernel-irqchip=split"; CPU="host,-arch-capabilities"; IOMMU="intel-iommu,intremap=on" ;;
    tcg) MACHINE="q35,accel=tcg"; CPU="max"; IOMMU="intel-iommu" ;;
    *) fail "TERAIO_KVM_ACCEL must be kvm or tcg, not $ACCEL" ;;
esac
command -v qemu-system-x86_64 >/dev/null || fail "qemu-system-x86_64 not found: apt-get install qemu-system-x86"
KERNEL=${TERAIO_KVM_KERNEL:-$(ls /boot/vmlinuz-*-amd64 2>/dev/null | sort -V | tail -1)}
[ -n "$KERNEL" ] && [ -r "$KERNEL" ] || fail "no readable Debian kernel /boot/vmlinuz-*-amd64: apt-get install linux-image-amd64 (and run as root, or set TERAIO_KVM_KERNEL)"
KVER=${KERNEL#/boot/vmlinuz-}
MODDIR=/lib/modules/$KVER
[ -d "$MODDIR" ] || fail "no modules for $KVER in $MODDIR"
BUSYBOX=$(command -v busybox || true)
[ -n "$BUSYBOX" ] && file -L "$BUSYBOX" | grep -q "statically linked" || fail "need a static busybox: apt-get install busybox-static"
FIO=$(command -v fio || true)
[ -n "$FIO" ] || [ "$MODE" = tests ] || fail "fio not found (the benchmark's reference): apt-get install fio"
command -v cpio >/dev/null || fail "cpio not found: apt-get install cpio"

# --- build the guest binaries (static, so the initramfs needs no libc) -----------------------
echo "run-guest-tests: building static test binaries into $TARGET_DIR" >&2
BUILD_JSON=$(cd "$ROOT" && RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR=$TARGET_DIR \
    cargo test -p teraio-nvme --release --target x86_64-unknown-linux-gnu --test guest --no-run --message-format=json)
GUEST_TEST=$(echo "$BUILD_JSON" | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="guest": print(m["executable"])')
(cd "$ROOT" && RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR=$TARGET_DIR \
    cargo build -p teraio-nvme --release --target x86_64-unknown-linux-gnu --bin teraio-nvme-bench)
BENCH=$TARGET_DIR/x86_64-unknown-linux-gnu/release/teraio-nvme-bench
[ -x "$GUEST_TEST" ] && [ -x "$BENCH" ] || fail "build produced no test binary"

# --- initramfs --------------------------------------------------------------------------------
WORK=${TERAIO_KVM_WORK:-$(mktemp -d /tmp/teraio-kvm.XXXXXX)}
[ -n "${TERAIO_KVM_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
INITRD=$WORK/root
rm -rf "$INITRD" && mkdir -p "$INITRD"/{bin,usr/bin,tests,modules,proc,sys,dev,tmp}
cp "$BUSYBOX" "$INITRD/bin/busybox"
cp "$HERE/guest-init.sh" "$INITRD/init" && chmod +x "$INITRD/init"
cp "$GUEST_TEST" "$INITRD/tests/guest"
cp "$BENCH" "$INITRD/tests/bench"
# Modules in load order (dependencies first); built-in ones are skipped.
: > "$INITRD/modules/order"
for m in crc64 crc64_rocksoft_generic crc64-rocksoft crct10dif_common crct10dif_generic crc-t10dif t10-pi \
         nvme-core nvme irqbypass vfio vfio_iommu_type1 vfio_virqfd vfio-pci-core vfio-pci; do
    f=$(modinfo -k "$KVER" -n "$m" 2>/dev/null || true)
    case "$f" in ""|"(builtin)") continue ;; esac
    case "$f" in
        *.ko.xz) xz -dc "$f" > "$INITRD/modules/$m.ko" ;;
        *.ko.zst) zstd -qdc "$f" > "$INITRD/modules/$m.ko" ;;
        *) cp "$f" "$INITRD/modules/$m.ko" ;;
    esac
    echo "$m" >> "$INITRD/modules/order"
done
if [ -n "$FIO" ]; then
    cp "$FIO" "$INITRD/usr/bin/fio"
    for lib in $(ldd "$FIO" | awk '/=>/ {print $3} /ld-linux/ {print $1}'); do
        mkdir -p "$INITRD$(dirname "$lib")" && cp -L "$lib" "$INITRD$lib"
    done
fi
(cd "$INITRD" && find . | cpio -o -H newc --quiet | gzip -1) > "$WORK/initramfs.gz"

# --- drives and boot ------------------------------------------------------------------------
DRIVES=()
for serial in tio-k0 tio-k1 tio-v0 tio-v1; do
    truncate -s 2G "$WORK/$serial.img"
    DRIVES+=(-drive "file=$WORK/$serial.img,if=none,id=$serial,format=raw,cache=writeback"
             -device "nvme,serial=$serial,drive=$serial")
done
LOG=$WORK/console.log
echo "run-guest-tests: booting $KVER ($ACCEL) with 4 emulated NVMe drives (mode $MODE)" >&2
START=$(date +%s)
set +e
timeout "$TIMEOUT" qemu-system-x86_64 \
    -machine "$MACHINE" -cpu "$CPU" -smp 2 -m 2048 \
    -device "$IOMMU" \
    -nographic -no-reboot -nic none \
    -kernel "$KERNEL" -initrd "$WORK/initramfs.gz" \
    -append "console=ttyS0 quiet intel_iommu=on iommu=pt hugepages=128 panic=-1 teraio.mode=$MODE teraio.seconds=$SECONDS_PER_RUN" \
    "${DRIVES[@]}" < /dev/null 2>&1 | tee "$LOG" | grep --line-buffered -v '^{"path"' | sed -u 's/^/guest| /' >&2
QEMU_RC=${PIPESTATUS[0]}
set -e
echo "run-guest-tests: guest ran $(( $(date +%s) - START )) s (qemu exit $QEMU_RC)" >&2
[ "$QEMU_RC" = 124 ] && fail "the guest did not finish within $TIMEOUT s"
RESULT=$(tr -d '\r' < "$LOG" | grep -a '^TERAIO-GUEST-RESULT' | tail -1 || true)
[ -n "$RESULT" ] || fail "the guest printed no result line (crashed or failed to boot; see the log above)"
echo "run-guest-tests: $RESULT" >&2
if [ "$MODE" != tests ]; then
    { echo "Guest: $KVER under $ACCEL, $(qemu-system-x86_64 --version | head -1), ${SECONDS_PER_RUN} s per run."; echo
      tr -d '\r' < "$LOG" | python3 "$HERE/bench-report.py"; } | tee "${TERAIO_KVM_BENCH_OUT:-/dev/null}"
fi
case "$MODE" in
    tests) [[ "$RESULT" == *"tests=0 "* ]] ;;
    bench) [[ "$RESULT" == *"bench=0"* ]] ;;
    all) [[ "$RESULT" == *"tests=0 "* && "$RESULT" == *"bench=0"* ]] ;;
esac || fail "$RESULT"
echo "run-guest-tests: PASS ($MODE, $ACCEL)" >&2
