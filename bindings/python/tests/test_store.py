"""The store from Python: numpy, torch CPU tensors, bytes, handles, errors."""

from __future__ import annotations

import pathlib
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
    with pytest.raises(ValueError, match="C-contiguous"):
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
