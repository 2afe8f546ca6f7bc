"""Shared fixtures: store files live on a real file system (O_DIRECT fails on tmpfs)."""

from __future__ import annotations

import os
import pathlib
import shutil
import uuid
from typing import Iterator

import pytest
import teraio

_DEFAULT_DIR = pathlib.Path(__file__).resolve().parents[1] / "target" / "test-stores"


@pytest.fixture
def store_dir() -> Iterator[pathlib.Path]:
    root = pathlib.Path(os.environ.get("TERAIO_TEST_DIR", _DEFAULT_DIR))
    path = root / f"py-{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store(store_dir: pathlib.Path) -> Iterator[teraio.Store]:
    paths = [store_dir / "dev0", store_dir / "dev1"]
    s = teraio.Store.create(paths, file_size_bytes=256 << 20, durable=False, stripe_unit_bytes=64 << 10)
    yield s
    s.close()
