"""What the store says about its own limits and repairs: a full object table raises
NoSpaceError naming the table while deletes go on working, and `info()` reports how full the
table is and what the open found and repaired."""

from __future__ import annotations

import pathlib

import pytest
import teraio


def test_a_full_table_raises_no_space_and_never_wedges(store_dir: pathlib.Path) -> None:
    # The reported case: 3 x 64 MiB with default options, small objects with 4 KiB of metadata.
    paths = [store_dir / f"dev{i}" for i in range(3)]
    store = teraio.Store.create(paths, file_size_bytes=64 << 20, durable=False)
    meta = b"\x5a" * 4096
    data = b"\x01" * 4096
    stored = 0
    with pytest.raises(teraio.NoSpaceError, match="the object table is full") as raised:
        while stored < 2048:
            store.put(stored, data, meta=meta)
            stored += 1
    assert "checkpoint slot" in str(raised.value)
    info = store.info()
    assert info["table_bytes"] <= info["checkpoint_slot_bytes"]
    assert sum(d["free_bytes"] for d in info["devices"]) > 100 << 20, "data space was not the limit"
    # Deletes and shrinking overwrites always succeed; then there is room again.
    store.put(0, data, meta=b"short")
    assert store.delete(1)
    store.put(1 << 40, data, meta=meta)
    store.close()
    store = teraio.Store.open(paths)
    assert store.info()["object_count"] == stored
    assert store.get_bytes(1 << 40) == data
    store.close()


def test_info_reports_what_the_open_repaired(store_dir: pathlib.Path) -> None:
    paths = [store_dir / "dev0", store_dir / "dev1"]
    teraio.Store.create(paths, file_size_bytes=16 << 20).close()
    # Damage device 1's backup superblock (its last 4 KiB), as failing media would.
    with open(paths[1], "r+b") as f:
        f.seek(-4096 + 40, 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x20]))
    store = teraio.Store.open(paths)
    info = store.info()
    assert len(info["repairs_at_open"]) == 1, info["repairs_at_open"]
    assert "backup superblock" in info["repairs_at_open"][0]
    assert info["recovery_problems"] == [] and isinstance(info["recovery_notes"], list)
    store.close()
    store = teraio.Store.open(paths)
    assert store.info()["repairs_at_open"] == []
    store.close()


def test_delete_many_deletes_in_one_call_and_checks_its_ids(store: teraio.Store) -> None:
    for object_id in range(3):
        store.put(object_id, b"x" * 100)
    assert store.delete_many([0, 2, 99]) == [True, True, False]
    assert store.stat(0) is None and store.stat(1) is not None and store.stat(2) is None
    assert store.delete_many([]) == []
    with pytest.raises(teraio.InvalidArgumentError, match="object id"):
        store.delete_many([1, -1])
    assert store.stat(1) is not None, "a refused call deleted nothing"
    with pytest.raises(teraio.InvalidArgumentError, match="at most"):
        store.delete_many(range(1 << 20))
