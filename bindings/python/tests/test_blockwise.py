"""The block plan (`teraio.runtime.plans.block`, run by `teraio.runtime.modes.block`): its choice
on measured costs, and training with it on CPU.

TERAIO_TEST_DIR=$PWD/target/py-test-stores python -m pytest -q bindings/python/tests/test_blockwise.py
"""

from __future__ import annotations

import copy
import dataclasses
import time
import weakref
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")

import teraio  # noqa: E402
from teraio import machine  # noqa: E402
from teraio.machine import Link  # noqa: E402
from teraio.runtime.modes.block import BlockOffload  # noqa: E402
from teraio.runtime.modes.tensor import TensorOffload  # noqa: E402
from teraio.runtime.movers.copy import pinned_size  # noqa: E402
from teraio.runtime.movers.tiers import HOST  # noqa: E402
from teraio.runtime.plans import block as bw  # noqa: E402
from teraio.runtime.plans.block import KEEP, RECOMPUTE, SELECTIVE, BlockCost, Measurement, Plan  # noqa: E402
from tiny import batches, make, train  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

GB = 10**9
#: The step at which the block plan's A/B trial has ended: the measuring steps and both sides'.
TRIAL_END = BlockOffload.MEASURING_STEPS + 2 * BlockOffload.TRIAL_STEPS


def _measured(blocks: int = 8, saved: int = GB, peak: int = 10 * GB, state: int = 4 * GB) -> Measurement:
    """Blocks of 1 ms forward, 1 ms recomputation and 2 ms backward, `saved` bytes each; forward
    and backward peak at `peak` with every block recomputed and the state away, the step at
    `peak` - 2 GB + `state` (the state back, the activations gone)."""
    return Measurement(
        [BlockCost(f"b{i}", saved, 1.0, 1.0, 2.0) for i in range(blocks)],
        pre_forward_ms=1.0,
        head_backward_ms=2.0,
        tail_backward_ms=1.0,
        step_ms=3.0,
        peak_bytes=peak,
        step_peak_bytes=peak - 2 * GB + state,
        state_bytes=state,
    )


def _choose(measured: Measurement, limit: int, link: float, host: int = 1 << 50, store: bool = False) -> Plan:
    sizes = [measured.state_bytes // 4] * 4 if measured.state_bytes else []
    plan, _ = bw.choose(measured, Link(link, link, link, link), limit, sizes, host, store)
    assert plan is not None
    return plan


def test_everything_kept_where_it_fits() -> None:
    measured = _measured()
    plan = _choose(measured, limit=30 * GB, link=1e9)
    assert plan.actions == [KEEP] * 8
    assert plan.state_out_bytes == 0
    assert plan.predicted_ms == pytest.approx(measured.checkpoint_all_ms - 8 * 1.0)


def test_recompute_wins_on_a_slow_link() -> None:
    # 4 blocks must go; 1 GB over 1 GB/s is 1000 ms of copies against 1 ms of recomputation.
    plan = _choose(_measured(), limit=18 * GB, link=1e9)
    assert plan.count(RECOMPUTE) == 4 and plan.count(HOST) == 0
    assert plan.state_out_bytes == 0


def test_host_wins_on_a_fast_link() -> None:
    # At 10 TB/s a block's copy takes 0.1 ms, hidden behind the next block's forward (no state
    # to move, which on such a link would be as cheap).
    plan = _choose(_measured(state=0), limit=14 * GB, link=1e13)
    assert plan.count(RECOMPUTE) == 0 and plan.count(HOST) >= 4
    assert plan.actions[: plan.count(HOST)] == [HOST] * plan.count(HOST)  # the earliest blocks
    assert plan.predicted_ms < _measured(state=0).checkpoint_all_ms - 7.5


def test_state_leaves_the_gpu_only_where_blocks_alone_cannot_fit() -> None:
    measured = _measured()
    # Everything recomputed peaks at 10 + 4 (state) GB; the limit is 13: 1 GB of state must go.
    plan = _choose(measured, limit=13 * GB, link=1e11)
    assert plan.state_out_bytes >= GB
    assert plan.predicted_peak_bytes <= 13 * GB
    roomy = _choose(measured, limit=14 * GB + 1, link=1e11)
    assert roomy.state_out_bytes == 0


def test_state_goes_to_the_store_past_the_host_cap() -> None:
    measured = _measured()
    # Everything recomputed peaks at 14 GB with the state; 12 GB: 2 GB of state must go.
    plan = _choose(measured, limit=12 * GB, link=1e12, host=pinned_size(GB) + (1 << 20), store=True)
    assert plan.state_host_bytes == GB and plan.state_ssd_bytes >= GB


def test_no_plan_when_even_the_step_does_not_fit() -> None:
    measured = _measured()
    plan, _ = bw.choose(measured, Link(1e11, 1e11), 13 * GB, [GB] * 4, 1 << 50, False)
    assert plan is not None  # the step (12 GB) is the floor...
    assert plan.predicted_peak_bytes >= measured.step_peak_bytes
    plan, _ = bw.choose(measured, Link(1e11, 1e11), measured.step_peak_bytes - 1, [GB] * 4, 1 << 50, False)
    assert plan is None  # ...and below it nothing fits


def test_a_windowed_step_fits_below_the_step_with_all_the_state() -> None:
    # The step holds 12 GB with all 4 GB of state back; at 11 GB only a step that takes the state
    # back a window (0.5 GB) at a time fits (3 GB out: 9 GB + 3 windows held), on a link fast enough
    # for the state to be out before forward ends.
    measured = _measured()
    limit = 11 * GB
    plan, _ = bw.choose(measured, Link(1e12, 1e12), limit, [GB // 2] * 8, 1 << 50, False, GB // 2)
    assert plan is not None and plan.step_window_bytes == GB // 2
    assert plan.predicted_peak_bytes <= limit
    assert bw.step_bound(measured, plan) == measured.step_peak_bytes - plan.state_out_bytes + 3 * GB // 2
    assert plan.state_restore_at is None  # the windowed step brings the state back itself
    # Where the step fits with all the state, it is not windowed.
    plan, _ = bw.choose(measured, Link(1e12, 1e12), 13 * GB, [GB // 2] * 8, 1 << 50, False, GB // 2)
    assert plan is not None and plan.step_window_bytes == 0
    # Windows held as measured (one parameter's 1 GB window and two of 0.5 GB), not three of
    # the largest: 3.5 GB leave the GPU, not 4 GB.
    plan, _ = bw.choose(measured, Link(1e12, 1e12), 10 * GB, [GB // 2] * 8, 1 << 50, False, GB // 2, 2 * GB)
    assert plan is not None and plan.step_held_bytes == 2 * GB
    assert bw.step_bound(measured, plan) == measured.step_peak_bytes - plan.state_out_bytes + 2 * GB
    assert plan.predicted_peak_bytes <= 10 * GB
    # On a link where 3 GB cannot leave during forward (5 ms per GB, forward 9 ms), the windowed
    # step still fits: its windows leave during the step, and only the last one in forward.
    slow = Link(2e11, 2e11)
    plan, _ = bw.choose(measured, slow, limit, [GB // 2] * 8, 1 << 50, False, GB // 2)
    assert plan is not None and plan.step_window_bytes == GB // 2 and plan.predicted_peak_bytes <= limit
    unwindowed = dataclasses.replace(plan, step_window_bytes=0, step_held_bytes=0)
    assert bw.predict(measured, unwindowed, slow)[1] > limit  # all of it in forward: still there


def test_a_windowed_step_holds_one_windows_temporaries() -> None:
    # Parameters and gradients 10 GB, 8 GB of state, the step's temporaries 4 GB (a foreach
    # AdamW's, about the parameters' bytes) with every parameter at once: the step peaks at 22 GB.
    # At 14 GB it fits only windowed with the temporaries of what it steps at once: counted whole
    # (4 GB) nothing fits, since 10 + 4 + 3 windows held of 0.5 GB is above 14 with all the state
    # out.
    measured = _measured(blocks=4, peak=10 * GB, state=8 * GB)
    measured.step_peak_bytes = 10 * GB + 8 * GB + 4 * GB
    limit = 14 * GB
    sizes = [GB // 2] * 16
    whole = dataclasses.replace(measured, step_temporaries_bytes=0)
    plan, _ = bw.choose(whole, Link(1e12, 1e12), limit, sizes, 1 << 50, False, GB // 2)
    assert plan is None
    measured.step_temporaries_bytes = 4 * GB
    plan, _ = bw.choose(measured, Link(1e12, 1e12), limit, sizes, 1 << 50, False, GB // 2)
    assert plan is not None and plan.step_window_bytes == GB // 2
    assert plan.predicted_peak_bytes <= limit
    # The bound: the state that stays and one window share the temporaries, 4 GB x their share of
    # the 8 GB of state.
    stays = measured.state_bytes - plan.state_out_bytes
    temporaries = int(4 * GB * (GB // 2 + stays) / (8 * GB))
    held = 3 * GB // 2
    expected = 10 * GB + 8 * GB + temporaries - plan.state_out_bytes + held
    assert bw.step_bound(measured, plan) == expected <= limit


def _with_selective(measured: Measurement, kept: int, recompute_ms: float) -> Measurement:
    for block in measured.blocks:
        block.selective_bytes, block.selective_recompute_ms = kept, recompute_ms
    return measured


def test_selective_wins_where_it_frees_bytes_cheaply() -> None:
    # 4 GB must go. Recomputing 4 blocks costs 4 ms; selectively recomputing 7 (each keeps a
    # third, counted with the allocator's split share: 0.58 GB freed) costs 7 x 0.2 ms.
    measured = _with_selective(_measured(), GB // 3, 0.2)
    plan = _choose(measured, limit=18 * GB, link=1e9)
    assert plan.count(SELECTIVE) == 7 and plan.count(RECOMPUTE) == 0, plan.actions
    assert plan.actions[-1:] == [KEEP]  # the kept block is the last (backward frees it first)
    assert plan.predicted_ms == pytest.approx(measured.checkpoint_all_ms - 8 * 1.0 + 7 * 0.2)
    held = int(GB // 3 * (1 + bw.SELECTIVE_SPLIT_SHARE))
    assert plan.predicted_peak_bytes == 10 * GB + 1 * GB + 7 * held + 4 * GB
    # Where selective recomputation costs about as much as the whole and keeps most, the
    # whole block is recomputed.
    costly = _choose(_with_selective(_measured(), 2 * GB // 3, 0.9), limit=18 * GB, link=1e9)
    assert costly.count(RECOMPUTE) == 4 and costly.count(SELECTIVE) == 0, costly.actions
    # Where its forward costs more (torch's caching mode in eager bf16 measured +150%), likewise.
    slow = _with_selective(_measured(), GB // 3, 0.2)
    for block in slow.blocks:
        block.selective_forward_ms = 1.5
    slowed = _choose(slow, limit=18 * GB, link=1e9)
    assert slowed.count(RECOMPUTE) == 4 and slowed.count(SELECTIVE) == 0, slowed.actions
    # Not measured (None): never chosen.
    assert _choose(_measured(), limit=18 * GB, link=1e9).count(SELECTIVE) == 0


def test_selective_and_whole_recomputation_mix_where_selective_alone_cannot_fit() -> None:
    # 7 GB must go: 8 selective blocks free 5.3 GB, so some are recomputed whole.
    plan = _choose(_with_selective(_measured(), GB // 3, 0.2), limit=15 * GB, link=1e9)
    assert plan.count(RECOMPUTE) >= 1 and plan.count(SELECTIVE) >= 1, plan.actions
    assert plan.predicted_peak_bytes <= 15 * GB
    assert plan.predicted_ms < _measured().checkpoint_all_ms


def test_forward_waits_while_the_window_is_full() -> None:
    measured = _measured()
    hosted = Plan([HOST] * 8)
    fast, _ = bw.predict(measured, hosted, Link(1e13, 1e13))
    slow, _ = bw.predict(measured, hosted, Link(1e10, 1e10))
    # 8 GB at 10 GB/s is 800 ms of copies each way; the window lets forward run 2 blocks ahead.
    assert slow > fast + 700
    # Fast: only the last block's prefetch, issued when backward reaches it, is waited for.
    assert fast == pytest.approx(measured.checkpoint_all_ms - 8.0 + 0.1)


def test_segments_cut_the_prediction_at_the_collectives() -> None:
    measured = _measured(blocks=4)
    checkpointing = Plan([RECOMPUTE] * 4)
    # Pre-forward, 4 forwards, the head, 4 backwards with their recomputation, the tail, the step.
    assert bw.segments(measured, checkpointing, Link(1e13, 1e13)) == [1.0] * 5 + [2.0] + [3.0] * 4 + [
        1.0,
        3.0,
    ]
    hosted = Plan([HOST, HOST, KEEP, RECOMPUTE], state_host_bytes=GB)
    slow = Link(1e10, 1e10)
    cut = bw.segments(measured, hosted, slow)
    assert len(cut) == 2 * 4 + 3 + 1
    assert sum(cut) == pytest.approx(bw.predict(measured, hosted, slow)[0])
    measured.passes = 2  # gradient accumulation: each pass has its own collectives
    assert len(bw.segments(measured, hosted, slow)) == 2 * (2 * 4 + 3) + 1


def test_the_ranks_take_the_slowest_rank_between_collectives() -> None:
    # Rank 0 keeps its blocks (backward 2 ms each), rank 1 recomputes them (3 ms): rank 0 waits
    # for rank 1 in each backward. Rank 0 measured a head 5 ms longer, and rank 1 waits for it.
    measured = _measured(blocks=4)
    link = Link(1e13, 1e13)
    baseline = bw.segments(measured, Plan([RECOMPUTE] * 4), link)
    slow_head = list(baseline)
    slow_head[5] += 5.0
    kept = bw.segments(measured, Plan([KEEP] * 4), link)
    kept[5] += 5.0
    group, waits = bw.across_ranks([kept, baseline], [slow_head, baseline])
    assert group == pytest.approx(sum(baseline) + 5.0)
    assert group == pytest.approx(sum(kept) + 4.0)
    assert waits == [{1: pytest.approx(4.0)}, {0: pytest.approx(5.0)}]
    # A delay the measured parts hold twice (a slow step, and the other rank's wait for it in the
    # next pre-forward) counts once: the baselines are one iteration, as long on each rank.
    late_step, waited = list(baseline), list(baseline)
    late_step[-1] += 7.0
    waited[0] += 7.0
    assert bw.across_ranks([late_step, waited], [late_step, waited])[0] == pytest.approx(sum(baseline) + 7.0)
    assert bw.across_ranks([baseline, baseline], [baseline, baseline]) == (sum(baseline), [{}, {}])
    # A wait at the first all-gather that no other segment explains (another rank's one-off
    # slowness in the iteration before) is not the ranks' iteration.
    leaked = list(baseline)
    leaked[0] += 50.0
    assert bw.across_ranks([leaked, baseline], [leaked, baseline]) == (pytest.approx(sum(baseline)), [{}, {}])
    with pytest.raises(ValueError, match="different numbers of segments"):
        bw.across_ranks([kept, kept[:-1]], [baseline, baseline])


# -- training on the CPU "device" ------------------------------------------------------------------

ROWS, LAYERS, HIDDEN = 4096, 6, 512
#: What a tiny block keeps: up's and gelu's outputs (its input x is the previous block's output).
BLOCK_SAVED = 2 * ROWS * HIDDEN * 4
#: What it keeps selectively checkpointed: the outputs of its two matrix products (gelu's is
#: recomputed).
SELECTIVE_KEPT = ROWS * HIDDEN * 4 + ROWS * 64 * 4


def _reference(steps: int) -> tuple[list[float], dict[str, Any]]:
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    losses = train(model, optimizer, batches(steps, rows=ROWS))
    return losses, copy.deepcopy(model.state_dict())


def _run(steps: int, **options: Any) -> tuple[list[float], dict[str, Any], Any]:
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    options = {"reserve": 0, "min_bytes": 0, "host_link_bandwidth": "1000GB/s", **options}
    run = teraio.offload(model, optimizer, granularity="block", **options)
    assert isinstance(run, BlockOffload)
    with run:
        losses = train(model, optimizer, batches(steps, rows=ROWS))
    return losses, model.state_dict(), run


def _trial_goes_to(monkeypatch: Any, winner: str) -> None:
    """The A/B trial's iterations "measure" so that `winner` ("plan" or "checkpoint") wins,
    whatever the CPU's timings say."""

    def best(self: BlockOffload, count: int) -> list[float]:
        checkpointing = set(self.actions) == {RECOMPUTE}
        return [0.0 if checkpointing == (winner == "checkpoint") else 1.0] * count

    monkeypatch.setattr(BlockOffload, "_recent_times", best)


def _times_are(monkeypatch: Any, recompute_ms: float) -> None:
    """The plan is chosen as if every block's recomputation took `recompute_ms` (a busy CPU's
    measured times vary more than the choices they decide)."""
    real = bw.choose

    def choose(measured: Measurement, *args: Any) -> Any:
        for block in measured.blocks:
            block.recompute_ms = recompute_ms
        return real(measured, *args)

    monkeypatch.setattr(bw, "choose", choose)


def _force(monkeypatch: Any, action: str) -> None:
    """Every block gets `action`, whatever the measured times say (they vary on a busy CPU)."""

    def forced(measured: Measurement, link: Link, *args: Any) -> Any:
        plan = Plan([action] * len(measured.blocks))
        plan.predicted_ms, plan.predicted_peak_bytes = bw.predict(measured, plan, link)
        return plan, []

    monkeypatch.setattr(bw, "choose", forced)


@pytest.mark.parametrize(
    "budget, options, expect",
    [
        ("1GiB", {}, {KEEP: 6}),  # everything fits: kept (ties go to keeping)
        ("40MiB", {"force": HOST}, {HOST: 6}),
        ("40MiB", {"force": SELECTIVE}, {SELECTIVE: 6}),
        ("40MiB", {"host_memory": "40MiB"}, {}),  # chosen under a host cap
        ("9MiB", {"host_link_bandwidth": "1MB/s"}, {RECOMPUTE: 6}),  # only recomputation fits
    ],
)
def test_trains_bitwise_with_each_action(
    monkeypatch: Any, budget: str, options: dict[str, Any], expect: dict[str, int]
) -> None:
    # The plan wins its trial against checkpointing (the trial has tests of its own).
    _trial_goes_to(monkeypatch, "plan")
    options = dict(options)
    if "force" in options:
        _force(monkeypatch, options.pop("force"))
    steps = TRIAL_END + 1  # the measuring steps, the trial's, 1 after it
    reference, state = _reference(steps)
    losses, final, run = _run(steps, gpu_memory=budget, **options)
    assert losses == reference
    assert all(torch.equal(final[k], v) for k, v in state.items())
    report = run.report()
    for action, count in expect.items():
        assert list(report.actions.values()).count(action) == count, report.actions
    trial = 2 * BlockOffload.TRIAL_STEPS if "checkpoint_all_ms" in report.choice else 0
    assert report.planned_steps == steps - BlockOffload.MEASURING_STEPS - trial
    assert [b.saved_bytes for b in run.measured.blocks] == [BLOCK_SAVED] * LAYERS
    assert [b.selective_bytes for b in run.measured.blocks] == [SELECTIVE_KEPT] * LAYERS
    assert all(b.selective_recompute_ms is not None for b in run.measured.blocks)
    assert report.selective["probes"] == ["layers.1", "layers.2"]
    assert report.selective["kept_share"] == pytest.approx(SELECTIVE_KEPT / BLOCK_SAVED)
    assert report.selective["bytes_scale"] == 1.0  # no allocator to count with on a CPU
    hosted = list(report.actions.values()).count(HOST)
    # A host block copies its input too (1 MiB), beside what it keeps.
    assert report.bytes_per_iteration["offloaded"]["host"] == hosted * (BLOCK_SAVED + ROWS * 64 * 4)
    counts = list(report.actions.values())
    assert report.recomputed_bytes_per_iteration == counts.count(RECOMPUTE) * BLOCK_SAVED + counts.count(
        SELECTIVE
    ) * (BLOCK_SAVED - SELECTIVE_KEPT)
    assert run.mover.peak_bytes <= run.host_memory_bytes
    # Host time: one figure per planned iteration, the report's the median of them.
    per_iteration = run._host_ms()
    assert len(per_iteration) == report.planned_steps and min(per_iteration) >= 0
    assert report.host_ms_per_iteration["hooks"] <= max(per_iteration)


class _WeightCasts(TorchDispatchMode):
    """Weak references to the low-precision copies autocast makes of the given parameters."""

    def __init__(self, parameters: Any) -> None:
        super().__init__()
        self.pointers = {p.data_ptr() for p in parameters}
        self.copies: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.pointers:
            self.copies.append(weakref.ref(out))
        return out

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.copies)


@pytest.mark.parametrize("action", [RECOMPUTE, HOST, SELECTIVE, KEEP])
def test_blocks_that_do_not_keep_their_activations_leave_no_weight_copies_in_autocasts_cache(
    monkeypatch: Any, action: str
) -> None:
    """Autocast caches each fp32 weight's bf16 copy to the end of its region, past the head where
    the iteration peaks; a recomputed, selective or host block must not leave them there (a kept
    block saves them for its backward). Training stays bitwise equal to training without teraio."""
    _trial_goes_to(monkeypatch, "plan")
    _force(monkeypatch, action)
    steps = TRIAL_END + 1  # the measuring steps, the trial's, 1 with the plan

    def train_autocast(model: Any, optimizer: Any, casts: Optional[_WeightCasts] = None) -> list[float]:
        losses = []
        for i, x in enumerate(batches(steps, rows=256)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if casts is not None and i == steps - 1:  # a planned iteration
                    with casts:
                        loss = model(x)
                    held = casts.alive()
                else:
                    loss = model(x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if casts is not None:
            casts.held = held
        return losses

    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    reference = train_autocast(model, optimizer)
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    casts = _WeightCasts([p for layer in model.layers for p in layer.parameters() if p.dim() == 2])
    run = teraio.offload(
        model, optimizer, granularity="block", gpu_memory="1GiB", reserve=0, min_bytes=0, whole_model="off"
    )
    with run:
        losses = train_autocast(model, optimizer, casts)
    assert losses == reference
    assert set(run.report().actions.values()) == {action}
    assert len(casts.copies) == 2 * LAYERS  # each block's two weights, cast once each
    assert casts.held == (2 * LAYERS if action == KEEP else 0)


@pytest.mark.parametrize("with_store", [False, True])
def test_optimizer_state_leaves_where_that_keeps_more_blocks(
    monkeypatch: Any, store: Any, with_store: bool
) -> None:
    _trial_goes_to(monkeypatch, "plan")
    _times_are(monkeypatch, recompute_ms=5.0)
    rows, steps = 512, 10
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    reference = train(model, optimizer, batches(steps, rows=rows))
    state = copy.deepcopy(model.state_dict())
    weights = sum(p.numel() * 4 for p in model.parameters())
    block = 2 * rows * HIDDEN * 4
    # Parameters, gradients, AdamW state (2x the weights, 1.5 blocks) and one block: moving the
    # state over a fast link keeps two more blocks, which beats recomputing them.
    budget = 4 * weights + block + (256 << 10)
    options: dict[str, Any] = {
        "whole_model": "off",
        "reserve": 0,
        "min_bytes": 0,
        "host_link_bandwidth": "1000GB/s",
    }
    if with_store:
        options.update(
            store=store, host_memory="1MiB", ssd_bandwidth="1000GB/s", ssd_write_bandwidth="1000GB/s"
        )
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    run = teraio.offload(model, optimizer, gpu_memory=budget, granularity="block", **options)
    with run:
        losses = train(model, optimizer, batches(steps, rows=rows))
    assert losses == reference
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    report = run.report()
    moved = report.state_bytes_per_iteration["offloaded"]
    assert moved["ssd" if with_store else "host"] > 0, report
    assert list(report.actions.values()).count(RECOMPUTE) <= LAYERS - 2
    assert run.plan is not None and run.plan.predicted_peak_bytes <= budget


def test_state_leaves_when_the_next_forward_starts_not_at_the_step() -> None:
    # Copies out issued at the step would run before the loop's `loss.item()` (copies in one
    # direction run in issue order): the state stays until the first block of the next forward.
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    run = teraio.offload(model, optimizer, gpu_memory="1GiB", granularity="block", min_bytes=0)
    data = batches(3, rows=256)
    seen: list[tuple[int, int]] = []

    def state_bytes() -> int:
        return sum(
            v.untyped_storage().nbytes()
            for s in optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )

    def first_block(module: Any, args: Any) -> None:
        seen.append((len(seen), state_bytes()))

    hook = model.layers[1].register_forward_pre_hook(first_block)
    with run:
        for x in data:
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            after_step = state_bytes()
            assert after_step > 0  # still on the device when the loop reads the loss
    hook.remove()
    # Before the plan every state tensor leaves between steps: by the second block of the next
    # forward all of it has (step 0 makes the state, so from the second forward on).
    assert [b for _, b in seen[1:]] == [0, 0], seen
    assert run.state.stats.offloaded_bytes["host"] > 0


@pytest.mark.parametrize("winner", ["checkpoint", "plan"])
def test_the_trial_keeps_the_faster_of_the_plan_and_checkpointing(monkeypatch: Any, winner: str) -> None:
    # 3 measuring steps, 2 with the plan, 4 checkpointing every block, 2 with the plan, then the
    # winner: training stays exact across every switch.
    steps = TRIAL_END + 2
    reference, state = _reference(steps)
    _force(monkeypatch, HOST)
    _trial_goes_to(monkeypatch, winner)
    losses, final, run = _run(steps, gpu_memory="1GiB")
    assert losses == reference
    assert all(torch.equal(final[k], v) for k, v in state.items())
    report = run.report()
    assert report.choice["kept"] == ("checkpoint every block" if winner == "checkpoint" else "plan")
    assert report.checkpoint_all_source.startswith("median of 4 iterations")
    assert report.planned_steps == 2  # the steps after the trial
    assert set(report.actions.values()) == ({RECOMPUTE} if winner == "checkpoint" else {HOST})
    moved = report.bytes_per_iteration["offloaded"]["host"]
    assert (moved == 0) == (winner == "checkpoint"), report


def _measuring_moves_as_if_peaked(run: Any, fb_peak: int) -> None:
    """After step 0: the measuring iterations' state moves as if its forward and backward had
    peaked at `fb_peak` (on CUDA the allocator says it; a CPU run has no such figure)."""
    run._fb_peak = fb_peak
    run._state_moves_set = False
    run.state.close()
    run._state_all_out()
    run.state.after_step(defer=True)


def test_measuring_moves_only_the_state_that_does_not_fit() -> None:
    # Step 0's forward and backward "peaked" (on CUDA the allocator says it) 1 byte more than one
    # state tensor below the budget with all of the state: the two largest tensors leave.
    reference, state = _reference(4)
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    run = teraio.offload(model, optimizer, gpu_memory="1GiB", granularity="block", reserve=0, min_bytes=0)
    data = batches(4, rows=ROWS)
    with run:
        losses = train(model, optimizer, data[:1])
        sizes = [t.untyped_storage().nbytes() for t in run._state_tensors()]
        _measuring_moves_as_if_peaked(run, (1 << 30) - sum(sizes) + sizes[0] + 1)
        assert [slot.nbytes for slot in run.state.slots] == sizes[:2]
        losses += train(model, optimizer, data[1:])
    assert losses == reference
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_a_plan_moves_more_state_than_the_measuring_iterations_did(monkeypatch: Any) -> None:
    # The measuring iterations moved the largest state tensor only; the plan moves all of it: every
    # tensor must leave, not just the one the executor already held.
    reference, state = _reference(6)
    planned: list[int] = []

    def all_state_out(measured: Measurement, link: Link, limit: int, sizes: list[int], *args: Any) -> Any:
        plan = Plan([RECOMPUTE] * len(measured.blocks), state_host_bytes=sum(sizes))
        plan.predicted_ms, plan.predicted_peak_bytes = bw.predict(measured, plan, link)
        planned.append(plan.state_out_bytes)
        return plan, []

    monkeypatch.setattr(bw, "choose", all_state_out)
    _trial_goes_to(monkeypatch, "plan")
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    run = teraio.offload(model, optimizer, gpu_memory="1GiB", granularity="block", reserve=0, min_bytes=0)
    data = batches(6, rows=ROWS)
    with run:
        losses = train(model, optimizer, data[:1])
        tensors = run._state_tensors()
        _measuring_moves_as_if_peaked(run, (1 << 30) - sum(t.untyped_storage().nbytes() for t in tensors) + 1)
        assert len(run.state.slots) == 1 < len(tensors)
        losses += train(model, optimizer, data[1:])
        assert planned and run.state.planned_bytes(HOST) == planned[0] > run.state.slots[0].nbytes
    assert losses == reference
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert run.report().state_bytes_per_iteration["offloaded"]["host"] == planned[0]


def test_the_step_runs_in_windows_where_it_cannot_hold_all_the_state(monkeypatch: Any) -> None:
    # Parameters, gradients and half of the AdamW state: the step with all of its state (twice
    # the weights) cannot fit, so the state leaves between steps and comes back a window at a
    # time. Training stays exact, and each window's state is on the device only for its step.
    _trial_goes_to(monkeypatch, "plan")
    steps = 6
    reference, state = _reference(steps)
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    weights = sum(p.numel() * 4 for p in model.parameters())
    budget = 3 * weights
    resident_at_step: list[int] = []
    out_by_step: list[int] = []

    def count_resident(optimizer: Any, args: Any, kwargs: Any) -> None:
        resident_at_step.append(
            sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values() if v.dim())
        )
        out_by_step.append(run.state.stats.offloaded_bytes[HOST])

    run = teraio.offload(
        model,
        optimizer,
        gpu_memory=budget,
        granularity="block",
        whole_model="off",  # as under FSDP2, where whole-model offload is refused
        reserve=0,
        min_bytes=0,
        host_link_bandwidth="1000GB/s",
    )
    with run:
        # Registered after teraio's: runs once teraio has stepped every window but the last.
        hook = optimizer.register_step_pre_hook(count_resident)
        losses = train(model, optimizer, batches(steps, rows=ROWS))
        hook.remove()
        moved = run.state.planned_bytes(HOST)
        with pytest.raises(ValueError, match="closure"):
            optimizer.step(lambda: 0.0)
    assert losses == reference
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    plan = run.plan
    assert plan is not None and plan.step_window_bytes > 0, run.report()
    assert plan.predicted_peak_bytes <= budget
    assert len(run._step_windows) > 1
    # At the caller's step only the last window (and any state that stays) is on the device.
    assert resident_at_step[-1] <= 2 * weights - plan.state_out_bytes + plan.step_window_bytes
    assert moved >= plan.state_out_bytes
    # Each moved tensor leaves once an iteration (the last window when the next forward starts).
    assert out_by_step[-1] - out_by_step[-2] == moved


@pytest.mark.parametrize("room", ["all", "parameters"])
def test_the_first_step_creates_the_state_in_windows_and_moves_out_what_cannot_stay(
    monkeypatch: Any, room: str
) -> None:
    # AdamW creates all of its state (twice the weights) in the first step, before any plan.
    # teraio steps it a window of parameters at a time: where the budget holds parameters and
    # gradients but not the state, each window's new state leaves at once and the measuring
    # steps run in windows too; where it holds everything, nothing moves in the first step.
    # Either way training is exact.
    _trial_goes_to(monkeypatch, "plan")
    steps = 6
    reference, state = _reference(steps)
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    weights = sum(p.numel() * 4 for p in model.parameters())
    budget = 3 * weights if room == "parameters" else 100 * weights
    seen: list[tuple[int, int, int]] = []  # (resident state, bytes out so far, windows) per step
    run = teraio.offload(
        model, optimizer, gpu_memory=budget, granularity="block", whole_model="off", reserve=0, min_bytes=0
    )

    def at_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        resident = sum(
            v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values() if v.dim()
        )
        seen.append((resident, run.state.stats.offloaded_bytes[HOST], len(run._step_windows)))

    with run:
        hook = optimizer.register_step_pre_hook(at_step)  # runs after teraio's own
        losses = train(model, optimizer, batches(steps, rows=ROWS))
        hook.remove()
    assert losses == reference
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    # The step with all the state, estimated from the windows: parameters, gradients, the state
    # (no temporaries on a CPU "device").
    all_state = sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values())
    assert run._step_peak_estimate == 2 * weights + all_state
    if room == "parameters":
        # Step 0: windows' state left as it was made until what stays fits beside the parameters
        # and gradients (counted before the last window makes its own).
        assert 0 < seen[0][0] <= budget - 2 * weights and seen[0][1] > 0
        # The measuring steps run in windows, and so does the plan's.
        assert seen[1][2] > 1 and seen[2][2] > 1
        assert run.plan is not None and run.plan.step_window_bytes > 0
        assert max(resident for resident, _, _ in seen[1:]) <= budget - 2 * weights
    else:
        assert seen[0][1] == 0  # nothing left in the first step
        assert seen[1][2] == 0  # nor does any measuring step run in windows


def test_host_blocks_copies_back_are_freed_before_the_step(monkeypatch: Any) -> None:
    # The step's peak is measured without host blocks: their copies back, which backward has
    # used, must not still be held when it runs (on the H100 they were, 2 GiB over the bound).
    _force(monkeypatch, HOST)
    _trial_goes_to(monkeypatch, "plan")
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    run = teraio.offload(
        model,
        optimizer,
        granularity="block",
        reserve=0,
        min_bytes=0,
        gpu_memory="1GiB",
        host_link_bandwidth="1000GB/s",
    )
    held: list[int] = []

    def at_step(*_: Any) -> None:  # registered after teraio's own: runs after it
        held.append(sum(slot.gpu is not None for slots in run.mover.slots.values() for _, slot in slots))

    with run:
        hook = optimizer.register_step_pre_hook(at_step)
        train(model, optimizer, batches(6, rows=ROWS))
        hook.remove()
    assert run.report().bytes_per_iteration["prefetched"]["host"] > 0  # host blocks came back
    assert held == [0] * 6, held


def test_the_reserve_covers_what_the_allocator_could_not_release_before_the_head() -> None:
    # With expandable segments the allocator counts no split blocks: the reserve comes from what
    # it could not release right before the head (measured on CUDA; set here).
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    run = teraio.offload(model, optimizer, granularity="block", gpu_memory="8GiB")
    assert isinstance(run, BlockOffload) and run.reserve_auto
    run._fb_split_peak = 0
    run._unreleasable = 1 << 30
    run.step = 2
    run._reserve_from_allocator()
    expected = machine.reserve_from_allocator(8 << 30, 1 << 30, 0, min_share=bw.RESERVE_MIN_SHARE)
    assert run.reserve_bytes == expected > (8 << 30) * bw.RESERVE_MIN_SHARE
    assert "could not release" in run.machine["reserve"]


def test_an_iteration_in_which_the_allocator_retried_checkpoints_one_more_block(monkeypatch: Any) -> None:
    # Every block fits (kept); then planned iterations report allocator retries (counted on CUDA,
    # set here): one retry after the first iteration of a layout checkpoints one more block.
    _trial_goes_to(monkeypatch, "plan")
    _, _, run = _run(TRIAL_END + 1, gpu_memory="1GiB")
    assert run.actions == [KEEP] * LAYERS and run.settled_from is not None
    run.cuda = True  # the check is CUDA's; nothing else in it touches the device once settled
    run._peaks = [0]

    def after_iteration(retried: bool) -> list[str]:
        run._alloc_retries.append(run._alloc_retries[-1] + int(retried))
        run._check_plan()
        run.step += 1
        return list(run.actions)

    run._alloc_retries = [0]
    run._layout_from = run.step  # this iteration is the first of its layout
    assert after_iteration(retried=True) == [KEEP] * LAYERS  # the first of a layout may retry
    assert after_iteration(retried=False) == [KEEP] * LAYERS
    actions = after_iteration(retried=True)
    assert actions.count(KEEP) == LAYERS - 1 and run.replans == 1
    assert after_iteration(retried=True) == actions  # the new layout's first iteration
    assert after_iteration(retried=False) == actions
    assert after_iteration(retried=True).count(KEEP) == LAYERS - 2 and run.replans == 2


def test_the_head_is_the_lesser_of_the_two_measuring_iterations(monkeypatch: Any) -> None:
    # Iteration 1's head can be slowed by what step 0 left to copy out: iteration 2 times it again.
    take_times = BlockOffload._take_times
    heads: list[float] = []

    def slow_head(self: BlockOffload) -> None:
        take_times(self)
        self.measured.head_backward_ms = 1e6  # as if iteration 1's head had stalled
        heads.append(self.measured.head_backward_ms)

    monkeypatch.setattr(BlockOffload, "_take_times", slow_head)
    _, _, run = _run(4, gpu_memory="1GiB")
    assert heads == [1e6]
    assert 0 < run.measured.head_backward_ms < 1e6


def test_a_blocks_forward_time_holds_its_pre_hooks() -> None:
    # FSDP2 waits for a block's all-gather (and so for the other ranks) in a forward pre-hook
    # registered before teraio's: the block's measured forward counts it.
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    run = teraio.offload(
        model,
        optimizer,
        granularity="block",
        gpu_memory="1GiB",
        reserve=0,
        min_bytes=0,
        host_link_bandwidth="1000GB/s",
    )
    with run:
        train(model, optimizer, batches(BlockOffload.MEASURING_STEPS, rows=ROWS))
    assert run.plan is not None
    assert all(block.forward_ms >= 20.0 for block in run.measured.blocks), run.measured.blocks


def test_a_report_in_the_middle_of_the_trial_counts_the_plan_side(monkeypatch: Any) -> None:
    _force(monkeypatch, HOST)
    _trial_goes_to(monkeypatch, "plan")
    _, _, run = _run(6, gpu_memory="1GiB")  # 3 measuring, 2 with the plan, 1 checkpointing
    report = run.report()
    assert report.choice["kept"].startswith("undecided")
    assert report.planned_steps == BlockOffload.TRIAL_STEPS // 2
    assert report.bytes_per_iteration["offloaded"]["host"] == LAYERS * (BLOCK_SAVED + ROWS * 64 * 4)


def test_a_run_entered_again_trains_on_exactly() -> None:
    # Leaving the context brings the state back (a move out left for the next forward is
    # dropped with it); entering again resumes.
    reference, state = _reference(4)
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    run = teraio.offload(model, optimizer, gpu_memory="1GiB", granularity="block", min_bytes=0)
    data = batches(4, rows=ROWS)
    losses = []
    with run:
        losses += train(model, optimizer, data[:2])
    with run:
        losses += train(model, optimizer, data[2:])
    assert losses == reference
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_no_trial_where_the_plan_is_checkpointing(monkeypatch: Any) -> None:
    steps = 7
    _force(monkeypatch, RECOMPUTE)
    _, _, run = _run(steps, gpu_memory="1GiB")
    report = run.report()
    assert set(report.actions.values()) == {RECOMPUTE}
    assert "checkpoint_all_ms" not in report.choice
    assert report.planned_steps == steps - BlockOffload.MEASURING_STEPS
    assert (
        report.checkpoint_all_source
        == "the sum of each block's and the head's times in the measuring iterations"
    )


def test_no_plan_fits_is_a_clear_error() -> None:
    model, optimizer = make(layers=LAYERS, hidden=HIDDEN)
    weights = sum(p.numel() * 4 for p in model.parameters())
    run = teraio.offload(
        model, optimizer, gpu_memory=2 * weights + 1024, granularity="block", whole_model="off", reserve=0
    )
    data = batches(3, rows=ROWS)
    with pytest.raises(teraio.NoPlanFitsError, match="no block plan fits"):
        with run:
            train(model, optimizer, data)
    # The model is usable again: the blocks run as they did.
    assert "forward" not in model.layers[0].__dict__


def test_granularity_is_chosen_by_the_model() -> None:
    model, optimizer = make()
    assert isinstance(teraio.offload(model, optimizer, gpu_memory="1GiB"), BlockOffload)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    optimizer = torch.optim.AdamW(plain.parameters())
    assert type(teraio.offload(plain, optimizer, gpu_memory="1GiB")) is TensorOffload
    model, optimizer = make()
    assert type(teraio.offload(model, optimizer, gpu_memory="1GiB", granularity="tensor")) is TensorOffload
    with pytest.raises(ValueError, match="granularity must be one of"):
        teraio.offload(model, optimizer, gpu_memory="1GiB", granularity="layer")


def _models() -> list[Any]:
    from test_training import PlainTransformer

    return [("plain", PlainTransformer, 256)] + [(f, f, 512) for f in ("llama", "qwen2", "mistral")]


@pytest.mark.parametrize("name, build, vocab", _models(), ids=lambda v: v if isinstance(v, str) else "")
def test_model_families_bf16_autocast_sdpa_bitwise(name: str, build: Any, vocab: int) -> None:
    from test_training import _bitwise_against_reference, _hf_model

    if isinstance(build, str):
        build = _hf_model(build)
    generator = torch.Generator().manual_seed(5)
    data = [torch.randint(0, vocab, (2, 128), generator=generator) for _ in range(5)]

    def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(tokens) if name == "plain" else model(input_ids=tokens, labels=tokens).loss

    # Parameters, gradients and AdamW state, and little beside: blocks must move or be recomputed.
    run = _bitwise_against_reference(
        build,
        data,
        loss_of,
        budget=lambda params: 4 * params + (64 << 10),
        granularity="block",
        whole_model="off",
        min_bytes=0,
    )
    assert isinstance(run, BlockOffload)
    actions = list(run.report().actions.values())
    assert len(actions) == 3 and actions != [KEEP] * 3


def test_the_allocators_peak_resets_when_the_next_forward_begins(monkeypatch: Any) -> None:
    """Not at the step's end: a training loop reading the peak after `optimizer.step()` sees its
    whole iteration (a CUDA device faked: only the reset is called)."""
    from teraio.timing import IterationPeak

    resets: list[Any] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    model, _ = make(layers=1)
    peak = IterationPeak(model, torch.device("cuda", 0))
    peak.arm()  # an iteration ended
    assert resets == []
    model(torch.zeros(2, 64))
    model(torch.zeros(2, 64))  # a second forward in the same iteration: no second reset
    assert resets == [torch.device("cuda", 0)]
    peak.handle.remove()
    peak.arm()
    model(torch.zeros(2, 64))
    assert len(resets) == 1
    cpu = IterationPeak(model, torch.device("cpu"))
    cpu.arm()
    model(torch.zeros(2, 64))
    assert len(resets) == 1  # no allocator on a CPU "device"


def test_a_stall_in_one_blocks_span_is_not_that_blocks_cost() -> None:
    """Blocks of one class get the median of their measured times: on the H100 the measuring
    iterations' allocator stalls put 8-25 ms recomputations on five Qwen2 blocks whose steady
    cost is 2 ms, and 0.2-1.2 ms on four others."""
    measured = _measured(blocks=6)
    recomputes = [3.0, 2.0, 25.0, 0.3, 2.1, 2.0]
    forwards = [4.0, 4.2, 4.1, 9.0, 4.0, 3.9]
    backwards = [7.0, 5.0, 5.1, 5.0, 11.0, 5.2]  # block 0's span holds the embedding's too
    for block, r, f, b in zip(measured.blocks, recomputes, forwards, backwards):
        block.recompute_ms, block.forward_ms, block.backward_ms = r, f, b
    before = measured.checkpoint_all_ms
    bw.steady_block_times(measured, probes=[1])
    # The probe (block 1) keeps its span; the others get the median of blocks 2-5's.
    assert [b.recompute_ms for b in measured.blocks] == pytest.approx([2.05, 2.0, 2.05, 2.05, 2.05, 2.05])
    assert [b.forward_ms for b in measured.blocks] == pytest.approx([4.05] * 6)
    assert [b.backward_ms for b in measured.blocks] == pytest.approx([7.0, 5.1, 5.1, 5.1, 5.1, 5.1])
    assert measured.checkpoint_all_ms < before - 20


def test_copies_in_backward_that_hold_it_up_count_in_full() -> None:
    """FSDP2's ranks on CUDA (`Measurement.serial_copies`): a copy from host memory issued in
    backward holds backward's compute up until it is done, so the state's restore there and
    the HOST blocks' prefetches count in full, and the chooser keeps, with nothing moved, the
    blocks that fit where those copies cost more than the recomputation they save."""
    link = Link(5e11, 5e11, 5e11, 5e11)  # 2 ms per GB each way
    serial = _measured()
    serial.serial_copies = True
    # The state (4 GB: 8 ms in) restored as backward starts: hidden behind its 24 ms of blocks,
    # or, held up, all of it added.
    restored = Plan([RECOMPUTE] * 8, state_host_bytes=4 * GB, state_restore_at=0)
    alone, _ = bw.predict(_measured(), restored, link)
    held_up, _ = bw.predict(serial, restored, link)
    assert held_up == pytest.approx(alone + 8.0)
    # Restored at the step instead, it meets no all-gather: the same either way.
    at_step = Plan([RECOMPUTE] * 8, state_host_bytes=4 * GB)
    assert bw.predict(serial, at_step, link)[0] == pytest.approx(bw.predict(_measured(), at_step, link)[0])
    limit = 16 * GB  # every block recomputed with the state on the GPU peaks at 14 GB: 2 blocks kept
    overlapped = _choose(_measured(), limit=limit, link=5e11)
    assert overlapped.count(HOST) > 0 or overlapped.state_out_bytes > 0, overlapped
    plan = _choose(serial, limit=limit, link=5e11)
    # A block's 1 GB back takes 2 ms, more than its 1 ms of recomputation: nothing moves, and the
    # blocks the state on the GPU leaves room for are kept.
    assert plan.state_out_bytes == 0 and plan.count(HOST) == 0 and plan.count(KEEP) == 2, plan
