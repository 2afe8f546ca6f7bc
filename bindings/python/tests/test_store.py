"""The store from Python: numpy, torch CPU tensors, bytes, handles, errors."""

from __future__ import annotations

import pathlib
import threading
import time

import numpy as np
import pytest
import teraio


def test_numpy_round_trip_and_metadata(store: teraio.Store) -> None:
    rng = np.random.default_rng(7)
    data = rng.standard_normal(300_001).astype(np.float32)  # not a block multiple
    store.put(5, data, meta=b"layer0")
    out = np.empty_like(data)
    assert store.get(5, out) is out
    assert np.array_equal(out, data)
    info = store.stat(5)
    assert info is not None
    assert info["len_bytes"] == data.nbytes
    assert info["meta"] == b"layer0"
    assert [o["id"] for o in store.list()] == [5]
    io = store.stats()
    assert io["write_bytes"] >= data.nbytes and io["read_bytes"] >= data.nbytes
    assert store.delete(5) is True
    assert store.delete(5) is False
    assert store.stat(5) is None


def test_torch_cpu_tensor_in_place(store: teraio.Store) -> None:
    torch = pytest.importorskip("torch")
    src = torch.arange(1 << 20, dtype=torch.int32)
    handle = store.put_async(1, src)
    assert handle.wait(timeout_s=30.0) is True
    assert handle.is_done()
    dst = torch.zeros(1 << 20, dtype=torch.int32)
    ptr = dst.data_ptr()
    store.get_async(1, dst, urgent=True).wait()
    assert dst.data_ptr() == ptr  # read in place, no new tensor
    assert torch.equal(dst, src)


def test_dropped_handle_finishes_its_io(store: teraio.Store) -> None:
    data = np.random.default_rng(3).integers(0, 255, 8 << 20, dtype=np.uint8)
    handle = store.put_async(8, data.copy())  # the handle owns the only reference to the copy
    del handle  # dropping it waits for the put (without the GIL) before releasing the memory
    assert np.array_equal(store.get(8, np.empty_like(data)), data)
    out = np.empty_like(data)
    pending = store.get_async(8, out)
    assert pending.wait(timeout_s=60.0) is True
    assert pending.wait() is True  # a second wait returns the same result
    assert np.array_equal(out, data)


def test_bytes_and_larger_buffer(store: teraio.Store) -> None:
    store.put(9, b"hello teraio")
    assert store.get_bytes(9) == b"hello teraio"
    out = np.zeros(100, dtype=np.uint8)
    store.get(9, out)
    assert bytes(out[:12]) == b"hello teraio" and not out[12:].any()


def test_errors_carry_engine_messages(store: teraio.Store) -> None:
    out = np.empty(16, dtype=np.uint8)
    with pytest.raises(teraio.NotFoundError, match="object 77 not found"):
        store.get(77, out)
    store.put(3, np.ones(1000, dtype=np.uint8))
    with pytest.raises(teraio.InvalidArgumentError, match="too small"):
        store.get(3, np.empty(10, dtype=np.uint8))
    with pytest.raises(teraio.InvalidArgumentError, match="C-contiguous"):
        store.put(4, np.ones((10, 10))[:, ::2])
    assert issubclass(teraio.NotFoundError, teraio.TeraioError)
    assert issubclass(teraio.NoSpaceError, teraio.TeraioError)


def test_no_space(store_dir: pathlib.Path) -> None:
    with teraio.Store.create([store_dir / "small"], file_size_bytes=16 << 20, durable=False) as small:
        with pytest.raises(teraio.NoSpaceError, match="not enough free space"):
            small.put(1, np.zeros(64 << 20, dtype=np.uint8))


def test_reopen_keeps_objects_and_close_is_final(store_dir: pathlib.Path) -> None:
    paths = [store_dir / "a"]
    data = np.arange(5000, dtype=np.float64)
    with teraio.Store.create(paths, file_size_bytes=64 << 20) as s:
        s.put(11, data)
    s2 = teraio.Store.open(paths)
    assert np.array_equal(s2.get(11, np.empty_like(data)), data)
    s2.close()
    s2.close()
    assert s2.closed
    with pytest.raises(teraio.ClosedError):
        s2.stat(11)
    with pytest.raises(teraio.DeviceError, match="not a teraio device"):
        (store_dir / "junk").write_bytes(b"\0" * (8 << 20))
        teraio.Store.open([store_dir / "junk"])


def test_without_direct_io(store_dir: pathlib.Path) -> None:
    # For file systems without O_DIRECT (older tmpfs): formatted and opened with buffered I/O.
    paths = [store_dir / "buffered"]
    with teraio.Store.create(paths, file_size_bytes=16 << 20, direct_io=False) as s:
        s.put(1, b"buffered")
    with teraio.Store.open(paths, direct_io=False) as s:
        assert s.get_bytes(1) == b"buffered"


def test_emulated_array_paces_to_its_model(store_dir: pathlib.Path) -> None:
    paths = [store_dir / "dev0", store_dir / "dev1"]
    # Two emulated SSDs of 0.1 GB/s: 16 MiB striped over both takes at least ~84 ms.
    with teraio.Store.create(
        paths, file_size_bytes=64 << 20, durable=False, direct_io=False, emulate="0.1GB/s@20us"
    ) as store:
        data = np.random.default_rng(3).integers(0, 255, 16 << 20, dtype=np.uint8)
        started = time.perf_counter()
        store.put(1, data)
        elapsed = time.perf_counter() - started
        assert elapsed >= 0.5 * (16 << 20) / 2 / 0.1e9, elapsed
        out = np.zeros_like(data)
        store.get(1, out)
        assert np.array_equal(out, data)
    with pytest.raises(teraio.InvalidArgumentError, match="emulate"):
        teraio.Store.open(paths, direct_io=False, emulate="fast")


def test_gpu_options_and_probe_say_what_they_found(store_dir: pathlib.Path) -> None:
    probe = teraio.gpu_probe()
    assert "CUDA driver" in probe or "no CUDA driver found" in probe, probe
    with pytest.raises(teraio.InvalidArgumentError, match="unknown GPU path"):
        teraio.Store.create([store_dir / "dev0"], file_size_bytes=64 << 20, gpu="warp")
    with teraio.Store.create([store_dir / "dev1"], file_size_bytes=64 << 20, durable=False) as store:
        assert store.gpu_report() is None  # no GPU op yet


def _flip_one_bit_of(path: pathlib.Path, needle: bytes) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.find(needle)
    assert at >= 0, "object bytes not found on the device"
    raw[at + 5] ^= 0x04
    path.write_bytes(bytes(raw))


def test_damaged_data_raises_corrupt_error_by_default(store_dir: pathlib.Path) -> None:
    paths = [store_dir / "dev0"]
    data = np.random.default_rng(11).integers(0, 255, 300_000, dtype=np.uint8)
    with teraio.Store.create(paths, file_size_bytes=16 << 20, stripe_unit_bytes=64 << 10) as s:
        s.put(1, data)
    _flip_one_bit_of(paths[0], data[200_000:200_064].tobytes())
    with teraio.Store.open(paths) as s:  # checks are on without asking
        with pytest.raises(teraio.CorruptError, match=r"object 1, stripe unit 3 \(device 0, offset \d+\)"):
            s.get(1, np.empty_like(data))
        with pytest.raises(teraio.CorruptError, match="object 1"):
            s.get_bytes(1)
    with teraio.Store.open(paths, verify_checksums=False) as s:
        out = s.get(1, np.empty_like(data))
        assert np.count_nonzero(out != data) == 1  # unchecked: the damaged byte comes back
    with teraio.Store.open(paths, verify_checksums=True) as s:
        with pytest.raises(teraio.CorruptError):
            s.get(1, np.empty_like(data))


def test_object_arrays_and_non_plain_buffers_are_refused(store: teraio.Store) -> None:
    with pytest.raises(teraio.InvalidArgumentError, match="object pointers"):
        store.put(1, np.array([object(), "x"], dtype=object))
    with pytest.raises(teraio.InvalidArgumentError, match="object pointers"):
        store.put(1, np.zeros(2, dtype=[("a", "i4"), ("b", "O")]))
    assert store.stat(1) is None  # nothing was stored
    store.put(2, np.arange(4, dtype=np.int64))
    with pytest.raises(teraio.InvalidArgumentError, match="object pointers"):
        store.get(2, np.empty(4, dtype=object))
    with pytest.raises(teraio.InvalidArgumentError, match="cannot store a list"):
        store.put(3, [1, 2, 3])
    with pytest.raises(teraio.InvalidArgumentError, match="not plain numeric data"):
        store.put(3, memoryview(np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])))
    with pytest.raises(teraio.InvalidArgumentError, match="C-contiguous"):
        store.put(3, memoryview(bytearray(16))[::2])
    assert store.stat(3) is None
    # Plain buffers of other formats are stored as their bytes.
    store.put(4, memoryview(np.arange(6, dtype=">f4").reshape(2, 3)))
    assert store.get_bytes(4) == np.arange(6, dtype=">f4").tobytes()


@pytest.mark.parametrize("bad_id", [-1, 2**64, True, False, 1.5, "3", None])
def test_bad_ids_raise_invalid_argument_on_every_method(store: teraio.Store, bad_id: object) -> None:
    store.put(1, b"one")
    out = np.empty(8, dtype=np.uint8)
    calls = [
        lambda: store.put(bad_id, b"x"),  # type: ignore[arg-type]
        lambda: store.put_async(bad_id, np.ones(4, dtype=np.uint8)),  # type: ignore[arg-type]
        lambda: store.get(bad_id, out),  # type: ignore[arg-type]
        lambda: store.get_async(bad_id, out),  # type: ignore[arg-type]
        lambda: store.get_bytes(bad_id),  # type: ignore[arg-type]
        lambda: store.delete(bad_id),  # type: ignore[arg-type]
        lambda: store.stat(bad_id),  # type: ignore[arg-type]
        lambda: store._native.put_bytes(bad_id, b"x"),
    ]
    for call in calls:
        with pytest.raises(teraio.InvalidArgumentError, match="object id"):
            call()
    assert [o["id"] for o in store.list()] == [1]
    assert store.get_bytes(1) == b"one"


def test_ids_span_the_whole_u64_range(store: teraio.Store) -> None:
    for good in (0, 2**64 - 1, np.uint64(2**63), np.int64(7)):
        store.put(good, b"ok")  # type: ignore[arg-type]
        assert store.get_bytes(good) == b"ok"  # type: ignore[arg-type]
        assert store.delete(good) is True  # type: ignore[arg-type]


def _overwrite_in_turn(store: teraio.Store, versions: list[bytes], stop: threading.Event) -> threading.Thread:
    """A thread that puts `versions` as object 1 in turn until `stop` is set (at most 10**6 puts)."""

    def run() -> None:
        for i in range(10**6):
            if stop.is_set():
                return
            store.put(1, versions[i % len(versions)])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_gets_under_concurrent_overwrite_return_one_version(store_dir: pathlib.Path) -> None:
    # docs/reliability.md, "No torn reads": every get returns one version whole, while another
    # thread replaces the object with a shorter and a longer one (the object shrinks and grows
    # between any length lookup and the read): never one's length with the other's bytes and
    # zero padding, never "buffer too small".
    short, long = b"\xf7" * 1000, b"\x95" * (1 << 20)
    with teraio.Store.create([store_dir / "dev0"], file_size_bytes=128 << 20, durable=False) as store:
        store.put(1, short)
        stop = threading.Event()
        writer = _overwrite_in_turn(store, [long, short], stop)
        try:
            for i in range(1500):
                if i % 2:
                    data = store.get_bytes(1)
                else:
                    out = bytearray(len(long) + 4096)
                    handle = store.get_async(1, out)
                    handle.wait()
                    length = handle.object_len_bytes
                    assert length in (len(short), len(long))
                    assert not any(out[length:]), "bytes past the version read were written"
                    data = bytes(out[:length])
                assert data in (short, long), (len(data), data[:2].hex(), data[-2:].hex())
        finally:
            stop.set()
            writer.join()
        assert store.get_bytes(1) in (short, long)


def test_argument_mistakes_raise_invalid_argument(store: teraio.Store) -> None:
    store.put(1, b"x" * 100, meta=None)  # None is no metadata
    assert store.stat(1)["meta"] == b""  # type: ignore[index]
    store.put(2, b"y", meta=bytearray(b"m"))  # any bytes-like object
    assert store.stat(2)["meta"] == b"m"  # type: ignore[index]
    too_small = bytearray(10)
    mistakes = {
        "too small": lambda: store.get(1, too_small),
        "read-only bytes": lambda: store.get(1, bytes(200)),
        "None": lambda: store.get(1, None),
        "list": lambda: store.get(1, [0] * 200),
        "str": lambda: store.get(1, "x" * 200),
        "meta list": lambda: store.put(3, b"z", meta=[1]),  # type: ignore[arg-type]
        "meta str": lambda: store.put(3, b"z", meta="m"),  # type: ignore[arg-type]
        "urgent": lambda: store.put_async(3, b"z", urgent="yes"),  # type: ignore[arg-type]
        "timeout": lambda: store.get_async(1, bytearray(100)).wait(timeout_s="soon"),  # type: ignore[arg-type]
        "negative timeout": lambda: store.get_async(1, bytearray(100)).wait(timeout_s=-1.0),
        "read-only numpy": lambda: store.get(1, np.frombuffer(bytes(100), dtype=np.uint8)),
        "paths": lambda: teraio.Store.open(42),  # type: ignore[arg-type]
        "read_only": lambda: teraio.Store.open("x", read_only="yes"),  # type: ignore[arg-type]
    }
    for name, call in mistakes.items():
        with pytest.raises(teraio.InvalidArgumentError):
            call()
            pytest.fail(f"{name}: no error")
    assert bytes(too_small) == bytes(10)  # a refused get writes nothing
    assert store.stat(3) is None  # a refused put stores nothing
    assert store.get(1, bytearray(100)) == bytearray(b"x" * 100)  # a bytearray is a fine destination


def test_engine_errors_of_async_calls_surface_at_wait(store_dir: pathlib.Path) -> None:
    with teraio.Store.create([store_dir / "small"], file_size_bytes=16 << 20, durable=False) as small:
        handle = small.put_async(1, np.zeros(64 << 20, dtype=np.uint8))  # the call itself succeeds
        assert handle.is_done()
        with pytest.raises(teraio.NoSpaceError, match="not enough free space"):
            handle.wait()
        with pytest.raises(teraio.NoSpaceError):
            handle.wait()  # a second wait raises again
        missing = small.get_async(77, np.empty(16, dtype=np.uint8))
        with pytest.raises(teraio.NotFoundError, match="object 77"):
            missing.wait()
        assert small.stat(1) is None


def test_read_only_open_reads_beside_the_writer_and_refuses_writes(store_dir: pathlib.Path) -> None:
    paths = [store_dir / "dev0", store_dir / "dev1"]
    with teraio.Store.create(paths, file_size_bytes=64 << 20) as writer:
        writer.put(1, b"written", meta=b"m")
        with teraio.Store.open(paths, read_only=True) as reader:
            assert reader.get_bytes(1) == b"written"
            assert [o["id"] for o in reader.list()] == [1]
            with pytest.raises(teraio.InvalidArgumentError, match="read-only"):
                reader.put(2, b"no")
            with pytest.raises(teraio.InvalidArgumentError, match="read-only"):
                reader.delete(1)
        assert writer.get_bytes(1) == b"written"  # the reader changed nothing
    with teraio.Store.open(paths, read_only=True, verify_checksums=True) as reader:
        assert reader.get_bytes(1) == b"written"


def test_close_waits_for_calls_in_flight_in_other_threads(store_dir: pathlib.Path) -> None:
    paths = [store_dir / "dev0"]
    store = teraio.Store.create(paths, file_size_bytes=128 << 20, durable=False)
    data = np.random.default_rng(5).integers(0, 255, 1 << 20, dtype=np.uint8)
    store.put(0, data)
    outcomes: list[str] = []
    busy = [threading.Event() for _ in range(4)]

    def work(index: int) -> None:
        out = np.empty_like(data)
        for i in range(10**5):
            if i == 4:
                busy[index].set()
            try:
                if i % 2:
                    store.put(1 + index, data)
                else:
                    store.get(0, out)
            except teraio.ClosedError:
                outcomes.append("closed")
                return
            except Exception as e:  # anything else is the failure this test looks for
                outcomes.append(f"{type(e).__name__}: {e}")
                return
        outcomes.append("ran out of iterations")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for event in busy:  # every worker is in its loop of calls
        assert event.wait(timeout=60)
    store.close()  # must not raise "in use by another thread"
    for thread in threads:
        thread.join()
    assert outcomes == ["closed"] * 4
    assert store.closed
    with teraio.Store.open(paths) as again:  # closed cleanly: the devices are free again
        assert np.array_equal(again.get(0, np.empty_like(data)), data)


def test_start_put_and_start_get_move_the_first_nbytes_of_host_memory(store: teraio.Store) -> None:
    # The runtime movers' calls on host memory: the engine's host path, no metadata, and only
    # the first `nbytes` of the buffer written or filled.
    torch = pytest.importorskip("torch")
    src = torch.arange(1, 301, dtype=torch.int32)  # 1200 bytes, no zero among them
    assert store.start_put(4, src, 1000).wait(timeout_s=30.0) is True
    info = store.stat(4)
    assert info is not None and info["len_bytes"] == 1000 and info["meta"] == b""
    out = torch.zeros(300, dtype=torch.int32)
    assert store.start_get(4, out, 1000).wait(timeout_s=30.0) is True
    assert torch.equal(out[:250], src[:250])
    assert not out[250:].any()  # the bytes past `nbytes` are left as they were
    assert store.get_bytes(4) == bytes(src.numpy()[:250])


def test_cuda_ordering_arguments_are_refused_for_host_memory(store: teraio.Store) -> None:
    torch = pytest.importorskip("torch")
    store.put(1, b"x" * 64)
    event = torch.cuda.Event()  # made without CUDA; never recorded
    cpu = torch.zeros(64, dtype=torch.uint8)
    refused = {
        "put after on a CPU tensor": lambda: store.put_async(2, cpu, after=event),
        "put after on numpy": lambda: store.put_async(2, np.zeros(8, dtype=np.uint8), after=event),
        "put after on bytes": lambda: store.put_async(2, b"z", after=event),
        "start_put after on a CPU tensor": lambda: store.start_put(2, cpu, 64, after=event),
        "get after on a CPU tensor": lambda: store.get_async(1, cpu, after=event),
        "get after on a bytearray": lambda: store.get_async(1, bytearray(64), after=event),
        "start_get after on a CPU tensor": lambda: store.start_get(1, cpu, 64, after=event),
    }
    for name, call in refused.items():
        with pytest.raises(teraio.InvalidArgumentError, match="after= applies to CUDA tensors only"):
            call()
            pytest.fail(f"{name}: no error")
    assert store.stat(2) is None  # nothing was started
    assert bytes(cpu.numpy()) == bytes(64)


def test_cuda_ordering_arguments_of_the_wrong_type_are_refused(store: teraio.Store) -> None:
    torch = pytest.importorskip("torch")
    store.put(1, b"x" * 64)
    out = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(teraio.InvalidArgumentError, match="after must be a torch.cuda.Event"):
        store.put_async(2, out, after=0)  # type: ignore[arg-type]
    with pytest.raises(teraio.InvalidArgumentError, match="after must be a torch.cuda.Event"):
        store.start_get(1, out, 64, after="event")  # type: ignore[arg-type]
    with pytest.raises(teraio.InvalidArgumentError, match="stream must be a torch.cuda.Stream"):
        store.get_async(1, out, stream=123)  # type: ignore[arg-type]
    with pytest.raises(teraio.InvalidArgumentError, match="stream must be a torch.cuda.Stream"):
        store.get_async(1, bytearray(64), stream=object())  # type: ignore[arg-type]
    assert store.stat(2) is None
    assert bytes(out.numpy()) == bytes(64)


def test_a_host_handle_cannot_make_a_stream_wait(store: teraio.Store) -> None:
    handle = store.put_async(1, b"host bytes")
    with pytest.raises(teraio.InvalidArgumentError, match="wait for a host op with wait"):
        handle.enqueue_stream_wait(None)  # type: ignore[arg-type]
    assert handle.wait() is True
    native = store._native.put_address(2, 0, 0, None)
    with pytest.raises(teraio.InvalidArgumentError, match="only the handle of a put or get of CUDA memory"):
        native.enqueue_stream_wait(0)
    native.wait()


def test_the_native_gpu_calls_refuse_a_null_event(store: teraio.Store) -> None:
    for call in (
        lambda: store._native.put_device(1, 0x1000, 16, 0, None, after=0),
        lambda: store._native.get_device(1, 0x1000, 16, 0, None, after=0),
    ):
        with pytest.raises(teraio.InvalidArgumentError, match="after=0 is not a CUDA event"):
            call()
