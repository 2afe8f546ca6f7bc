#!/bin/busybox sh
# /init of the teraio NVMe test guest (built into the initramfs by run-guest-tests.sh).
# Loads the nvme and vfio modules, sorts the emulated drives by serial number (tio-k*: kernel
# nvme driver, tio-v*: rebound to vfio-pci), then runs the mode given on the kernel command line
# (teraio.mode=tests|bench|all) and prints machine-readable markers on the console.
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /tmp /dev/hugepages && mount -t tmpfs tmp /tmp && mount -t hugetlbfs none /dev/hugepages
ulimit -l unlimited
MODE=$(sed -n 's/.*teraio\.mode=\([a-z]*\).*/\1/p' /proc/cmdline)
SECONDS_PER_RUN=$(sed -n 's/.*teraio\.seconds=\([0-9.]*\).*/\1/p' /proc/cmdline)
finish() { echo "TERAIO-GUEST-RESULT tests=$1 bench=$2"; sync; poweroff -f; }
for m in $(cat /modules/order); do
    params=""
    [ "$m" = nvme ] && params="poll_queues=1"
    insmod /modules/$m.ko $params || { echo "TERAIO-GUEST-ERROR insmod $m failed"; finish 1 1; }
done
# Wait for the controllers (up to 10 s).
i=0; while [ "$(ls /sys/class/nvme 2>/dev/null | wc -l)" -lt 4 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
KERNEL_NS=""; VFIO_BDFS=""; BENCH_BDF=""; BENCH_NS=""
for c in /sys/class/nvme/nvme*; do
    serial=$(cat $c/serial | tr -d ' ')
    bdf=$(basename $(readlink -f $c/device))
    name=$(basename $c)
    i=0; while [ ! -e /dev/${name}n1 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
    case $serial in
        tio-k*) KERNEL_NS="$KERNEL_NS /dev/${name}n1" ;;
        tio-v*) VFIO_BDFS="$VFIO_BDFS $bdf"; [ "$serial" = tio-v0 ] && BENCH_BDF=$bdf && BENCH_NS=/dev/${name}n1 ;;
    esac
done
KERNEL_NS=$(echo $KERNEL_NS | tr ' ' '\n' | sort | tr '\n' ' ')
echo "TERAIO-GUEST kernel namespaces:$KERNEL_NS vfio controllers:$VFIO_BDFS bench drive: $BENCH_NS ($BENCH_BDF)"
cat /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages | sed 's/^/TERAIO-GUEST hugepages: /'

to_vfio() {
    for bdf in $VFIO_BDFS; do
        echo $bdf > /sys/bus/pci/devices/$bdf/driver/unbind
        echo vfio-pci > /sys/bus/pci/devices/$bdf/driver_override
        echo $bdf > /sys/bus/pci/drivers_probe
        group=$(basename $(readlink /sys/bus/pci/devices/$bdf/iommu_group))
        i=0; while [ ! -e /dev/vfio/$group ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
        [ -e /dev/vfio/$group ] || echo "TERAIO-GUEST-ERROR no /dev/vfio/$group for $bdf"
    done
}

bench_kernel() {
    ng=$(echo $BENCH_NS | sed 's|/dev/nvme|/dev/ng|')
    echo "TERAIO-BENCH-BEGIN"
    for w in seqwrite1m-qd8 seqread1m-qd8 randread4k-qd1 randread4k-qd128; do
        /tests/bench bdev $BENCH_NS $w $SECONDS_PER_RUN || rc=1
        /tests/bench passthru $BENCH_NS $w $SECONDS_PER_RUN || rc=1
    done
    # fio's io_uring_cmd engine sends each I/O as one command and cannot exceed the drive's
    # transfer limit (MDTS 512 KiB here, and 127 segments), so its sequential runs use 256 KiB at
    # depth 32: the same 8 MiB in flight as 1 MiB at depth 8.
    for spec in "write 256k 32 seqwrite1m-qd8" "read 256k 32 seqread1m-qd8" "randread 4k 1 randread4k-qd1" "randread 4k 128 randread4k-qd128"; do
        set -- $spec
        echo "TERAIO-FIO-BEGIN $4"
        fio --name=ref --ioengine=io_uring_cmd --cmd_type=nvme --filename=$ng --rw=$1 --bs=$2 --iodepth=$3 \
            --size=1g --time_based --runtime=$SECONDS_PER_RUN --fixedbufs=1 --output-format=json || rc=1
        echo "TERAIO-FIO-END"
    done
    echo "TERAIO-BENCH-END"
}

bench_vfio() {
    echo "TERAIO-BENCH-BEGIN"
    for w in seqwrite1m-qd8 seqread1m-qd8 randread4k-qd1 randread4k-qd128; do
        /tests/bench vfio $BENCH_BDF $w $SECONDS_PER_RUN || rc=1
    done
    echo "TERAIO-BENCH-END"
}

rc=0; tests_rc=-; bench_rc=-
case $MODE in bench|all) bench_kernel ;; esac
to_vfio
if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
    echo "TERAIO-TESTS-BEGIN"
    TERAIO_NVME_REQUIRED=1 TERAIO_NVME_NAMESPACES="$KERNEL_NS" TERAIO_NVME_VFIO="$VFIO_BDFS" \
        /tests/guest --test-threads=1 --include-ignored
    tests_rc=$?
    echo "TERAIO-TESTS-END"
fi
case $MODE in bench|all) bench_vfio; bench_rc=$rc ;; esac
finish $tests_rc $bench_rc
