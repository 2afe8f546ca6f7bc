"""The staged SSD tier (`movers.tiers.StagedSsdTier`) on the CPU: the state machine the optimizer-
state and activation executors share (pinned buffer -> engine write -> buffer let go -> engine
read -> `arrived`), its ordering (a read after the object's write), its staging limit, and that
it deletes what it wrote."""

from __future__ import annotations

import teraio
import torch
from teraio.runtime.movers.tiers import StagedSsdTier


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_read_returns_what_was_written_and_runs_arrived_once(store: teraio.Store) -> None:
    tier = StagedSsdTier(store)
    data = _bytes(1 << 20, 1)
    tier.write(7, data.clone(), data.numel())
    assert tier.written == {7}
    target = torch.empty_like(data)
    arrivals: list[int] = []
    tier.read(7, target, data.numel(), lambda: arrivals.append(7))
    assert not tier.writing(7)  # the read waited for the write
    tier.wait_read(7)
    tier.poll()
    assert arrivals == [7] and torch.equal(target, data)
    assert not tier.busy


def test_poll_finishes_writes_and_reads_without_being_asked(store: teraio.Store) -> None:
    tier = StagedSsdTier(store)
    data = _bytes(256 << 10, 2)
    tier.write(1, data.clone(), data.numel())
    while tier.writing(1):
        tier.poll()
    assert tier.staged_bytes() == 0
    target = torch.empty_like(data)
    arrived: list[bool] = []
    tier.read(1, target, data.numel(), lambda: arrived.append(True))
    while tier.reading(1):
        tier.poll()
    assert arrived == [True] and torch.equal(target, data)


def test_a_read_without_arrival_leaves_the_bytes_in_its_buffer(store: teraio.Store) -> None:
    tier = StagedSsdTier(store)
    data = _bytes(4096, 3)
    tier.write(2, data.clone(), data.numel())
    target = torch.empty_like(data)
    tier.read(2, target, data.numel(), lambda: (_ for _ in ()).throw(AssertionError("arrived ran")))
    tier.wait_read(2, arrive=False)
    assert torch.equal(target, data) and not tier.busy


def test_a_second_write_of_an_object_replaces_the_first(store: teraio.Store) -> None:
    tier = StagedSsdTier(store)
    first, second = _bytes(8192, 4), _bytes(8192, 5)
    tier.write(3, first.clone(), first.numel())
    tier.write(3, second.clone(), second.numel())
    target = torch.empty_like(first)
    tier.read(3, target, target.numel(), lambda: None)
    tier.wait_read(3)
    assert torch.equal(target, second)


def test_writes_past_the_staging_limit_wait_for_those_before_them(store: teraio.Store) -> None:
    tier = StagedSsdTier(store, staging_bytes=3 << 20)
    for object_id in range(4):
        tier.write(object_id, _bytes(1 << 20, object_id), 1 << 20)
        assert tier.staged_bytes() <= 3 << 20
    tier.flush()
    assert tier.staged_bytes() == 0 and tier.written == {0, 1, 2, 3}


def test_delete_and_close_remove_what_the_tier_wrote(store: teraio.Store) -> None:
    tier = StagedSsdTier(store)
    for object_id in (10, 11, 12):
        tier.write(object_id, _bytes(4096, object_id), 4096)
    tier.delete(10)
    assert store.stat(10) is None and store.stat(11) is not None
    tier.close()
    assert tier.written == set() and all(store.stat(i) is None for i in (10, 11, 12))
