"""The block plan: per repeated block keep, host, selective or recompute, chosen on measured costs.

Pure: measured costs in, a `Plan` out (`choose`, `predict`, the bounds); no hooks, no tensors.
The block mode (`teraio.runtime.modes.block`) measures and runs it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from ...machine import Link
from ..movers.copy import pinned_size
from ..movers.tiers import HOST

KEEP = "keep"
RECOMPUTE = "recompute"
SELECTIVE = "selective"
#: `HOST` (imported) is the fourth action.

#: Blocks that run selectively checkpointed in the third measuring iteration, to time it (block 0
#: is never one: its backward span holds the embedding's too).
SELECTIVE_PROBES = (1, 2)
#: The allocator's split blocks around what selective blocks keep, as a share of it, counted in
#: their bound: their kept tensors are allocated among the forward's temporaries and pin the
#: segments they sit in. The probes alone show none: with several selective blocks, the head can
#: run out of memory with hundreds of MiB reserved but unallocated around what they keep.
SELECTIVE_SPLIT_SHARE = 0.25

#: Saved bytes each copy direction may have in flight, in blocks' worth (the largest block): the
#: plan picks one of these (a wider window stalls forward less and costs more GPU memory).
WINDOW_BLOCKS = (1, 2)
#: A windowed step (`Plan.step_window_bytes`) holds at most this many windows of optimizer state on
#: the GPU at once: the one stepping, the next one's restore (issued ahead so that it overlaps) and
#: the previous one's, whose memory returns once its copy out has read it.
STEP_WINDOWS_HELD = 3
#: Why `Measurement.serial_copies` holds for FSDP2's ranks: on 2 x H200 (NCCL over NVLink) the
#: optimizer state's 65 ms restore in backward held the compute stream up for 61 ms, waiting on
#: the next all-gather's copy-out (benches/results/2026-11-28-h200x2/
#: fsdp2-50pct-plan-without-trial.log); the plans that moved state ran at 1.3-2x their
#: predictions, which had overlapped the restore with backward. A restore at the step (a
#: windowed step's) meets no all-gather, and the copies out in forward stay overlapped: the
#: 20.3B model's 46.75 GiB each way ran within 1.8% of such a prediction.
SERIAL_COPIES_WHY = "under FSDP2, copies from host memory in backward held its compute up until done"
#: The least reserve, as a share of the budget. Lower than the tensor plan's
#: (`machine.RESERVE_MIN_SHARE`): this plan's peak is measured, not modelled per tensor, and its
#: bound adds whole blocks to it; a peak that comes close still checkpoints one more block.
RESERVE_MIN_SHARE = 0.03


# -- what the measuring iterations found -----------------------------------------------------------


@dataclass
class BlockCost:
    """One block as measured (times in ms)."""

    name: str
    saved_bytes: int = 0
    forward_ms: float = 0.0
    recompute_ms: float = 0.0
    #: Its backward without its recomputation.
    backward_ms: float = 0.0
    #: Selectively checkpointed (`teraio.selective`): the bytes it keeps (beyond its inputs, as
    #: `saved_bytes`) and its recomputation; None where not measured (the action is not offered).
    selective_bytes: int = 0
    selective_recompute_ms: Optional[float] = None
    #: What selective checkpointing adds to its forward (torch's caching mode sees every op).
    selective_forward_ms: float = 0.0


@dataclass
class Measurement:
    """The iteration with every block checkpointed, as measured (times in ms, bytes)."""

    blocks: list[BlockCost]
    #: Forward before the first block.
    pre_forward_ms: float = 0.0
    #: From the last block's forward to its gradient hook (the head's forward and backward), and
    #: backward after the first block's.
    head_backward_ms: float = 0.0
    tail_backward_ms: float = 0.0
    step_ms: float = 0.0
    #: Peak allocated bytes in forward + backward (optimizer state away) and in the step.
    peak_bytes: int = 0
    step_peak_bytes: int = 0
    #: Of `step_peak_bytes`, the step's temporaries (a foreach AdamW's are about the parameters'
    #: bytes), which scale with the parameters stepped at once: a windowed step holds one
    #: window's. 0 where they are not known apart (then counted whole, windowed too).
    step_temporaries_bytes: int = 0
    #: Optimizer-state bytes that may leave the GPU between steps.
    state_bytes: int = 0
    #: Forward and backward passes per step (gradient accumulation over micro-batches): the
    #: times above are one pass's (the mean of the measured passes), the peaks the whole
    #: iteration's (the later passes' hold the gradients accumulated so far).
    passes: int = 1
    #: Copies from host memory issued in backward (the state's restore, the HOST blocks'
    #: prefetches) hold backward's compute up until they are done, instead of overlapping it:
    #: FSDP2's ranks on CUDA (`SERIAL_COPIES_WHY`).
    serial_copies: bool = False

    @property
    def selective_ok(self) -> bool:
        """Whether every block's selective recomputation was measured (the action is offered)."""
        return bool(self.blocks) and all(b.selective_recompute_ms is not None for b in self.blocks)

    @property
    def checkpoint_all_ms(self) -> float:
        """The measured iteration: every block recomputed, the state resident at the step."""
        blocks = sum(b.forward_ms + b.recompute_ms + b.backward_ms for b in self.blocks)
        edges = self.pre_forward_ms + self.head_backward_ms + self.tail_backward_ms
        return self.passes * (blocks + edges) + self.step_ms


@dataclass
class Plan:
    """What each block does and how much optimizer state leaves the GPU; with its prediction."""

    actions: list[str]
    state_host_bytes: int = 0
    state_ssd_bytes: int = 0
    #: Backward position (0: the last block's gradient hook) where the state's restore starts,
    #: in the step's last backward pass (`Measurement.passes`); None: at the step.
    state_restore_at: Optional[int] = None
    predicted_ms: float = 0.0
    predicted_peak_bytes: int = 0
    #: The copy window of HOST blocks, in blocks' worth (`WINDOW_BLOCKS`).
    window_blocks: int = 1
    #: 0: the moved state comes back whole for the step. Else the step runs in windows of about
    #: this many bytes of moved state (a parameter's own where it holds more), each back, stepped
    #: and out again in turn: for a budget the step with all the state cannot fit.
    step_window_bytes: int = 0
    #: The most bytes of windows the windowed step holds at once (`STEP_WINDOWS_HELD` of them).
    step_held_bytes: int = 0

    @property
    def state_out_bytes(self) -> int:
        return self.state_host_bytes + self.state_ssd_bytes

    def count(self, action: str) -> int:
        return sum(1 for a in self.actions if a == action)


def window_bytes(measured: Measurement, plan: Plan) -> int:
    return plan.window_blocks * max((b.saved_bytes for b in measured.blocks), default=0)


def recompute_ms(block: BlockCost, action: str) -> float:
    """What `action` recomputes of `block` in backward, ms."""
    if action == RECOMPUTE:
        return block.recompute_ms
    if action == SELECTIVE:
        assert block.selective_recompute_ms is not None, "selective recomputation was not measured"
        return block.selective_recompute_ms
    return 0.0


def added_forward_ms(block: BlockCost, action: str) -> float:
    """What `action` adds to `block`'s forward as measured checkpointed, ms."""
    return block.selective_forward_ms if action == SELECTIVE else 0.0


def resident_bytes(block: BlockCost, action: str) -> int:
    """What `block` holds on the GPU from its forward to its backward under `action`, beyond what
    it holds checkpointed (a HOST block's bytes are in the copy window instead)."""
    if action == KEEP:
        return block.saved_bytes
    if action == SELECTIVE:
        return int(block.selective_bytes * (1 + SELECTIVE_SPLIT_SHARE))
    return 0


def predict(
    measured: Measurement, plan: Plan, link: Link, marks: Optional[list[float]] = None
) -> tuple[float, int]:
    """The plan's iteration time (ms) and its peak bound (bytes); `marks`, where given, gets the
    predicted time at each point where FSDP's collectives tie the ranks (`segments`).

    Time: the measured iteration with every block checkpointed, less the recomputation of the
    blocks that are not, plus what waiting for copies costs: forward waits while more than the
    window is in flight to the host, backward waits for a block whose prefetch (issued when the
    window has room, in the order backward needs them) has not arrived, the step waits for the
    state's restore. The state's copy to the host goes first on the device-to-host queue (a
    windowed step's: only its last window, the others left during the step).
    Peak: the measured peak plus the kept blocks' bytes, the window (with any host block) and the
    state left on the GPU; the step's measured peak (all state back) is a floor.
    With several passes per step (`Measurement.passes`), each pass runs as above in turn; the
    state leaves in the first and comes back in the last one's backward (or, without a restore
    position, after it).
    """
    ms_per_byte_d2h, ms_per_byte_h2d = 1e3 / link.d2h, 1e3 / link.h2d
    ssd_ms_per_byte = 1e3 / max(1.0, min(link.ssd_read, link.ssd_write))
    state_out_ms = plan.state_host_bytes * ms_per_byte_d2h + plan.state_ssd_bytes * ssd_ms_per_byte
    if plan.step_window_bytes and plan.state_out_bytes:
        # A windowed step sends each window out after stepping it: only the last leaves in forward.
        state_out_ms *= min(1.0, plan.step_window_bytes / plan.state_out_bytes)
    # The state's copies out are issued when the first pass's forward reaches the first block.
    t = 0.0
    link_free = measured.pre_forward_ms + state_out_ms
    h2d_free = 0.0
    state_ready = 0.0
    state_late_bytes = 0
    passes = max(1, measured.passes)
    for pass_index in range(passes):
        t, link_free, h2d_free, state_ready, late = _predict_pass(
            measured,
            plan,
            t,
            link_free,
            h2d_free,
            state_ready,
            ms_per_byte_d2h,
            ms_per_byte_h2d,
            ssd_ms_per_byte,
            restores=pass_index == passes - 1,
            marks=marks,
        )
        if pass_index == 0:
            # State whose copy out is still queued when forward ends is still on the GPU at the peak.
            state_late = max(0.0, measured.pre_forward_ms + state_out_ms - late)
            state_late_bytes = int(
                state_late / max(ms_per_byte_d2h, ssd_ms_per_byte if plan.state_ssd_bytes else 0.0)
            )
    if plan.state_out_bytes and plan.state_restore_at is None:
        start = max(t, h2d_free)
        state_ready = start + plan.state_host_bytes * ms_per_byte_h2d + plan.state_ssd_bytes * ssd_ms_per_byte
    t = max(t, state_ready) + measured.step_ms
    if marks is not None:
        marks.append(t)
    return t, peak_bound(measured, plan) + min(state_late_bytes, plan.state_out_bytes)


def _predict_pass(
    measured: Measurement,
    plan: Plan,
    t: float,
    link_free: float,
    h2d_free: float,
    state_ready: float,
    ms_per_byte_d2h: float,
    ms_per_byte_h2d: float,
    ssd_ms_per_byte: float,
    restores: bool,
    marks: Optional[list[float]] = None,
) -> tuple[float, float, float, float, float]:
    """One forward and backward pass from `t` (`predict`): its end, when each copy queue is free,
    when the state's restore (issued in backward where the plan says, if the pass `restores`:
    the step's last) is done, and when its forward ended. `marks` gets the time at the end of
    the pre-forward, of each block's forward, of the head, of each block's backward and of the
    tail."""
    blocks = measured.blocks
    window = window_bytes(measured, plan)
    # Where a mark is not asked for, the appends go to a list nobody reads.
    marks = [] if marks is None else marks
    # Forward.
    t += measured.pre_forward_ms
    marks.append(t)
    in_flight: deque[tuple[float, int]] = deque()
    flight_bytes = 0
    written: dict[int, float] = {}
    for index, (block, action) in enumerate(zip(blocks, plan.actions)):
        t += block.forward_ms + added_forward_ms(block, action)
        if action == HOST:
            start = max(t, link_free)
            link_free = start + block.saved_bytes * ms_per_byte_d2h
            written[index] = link_free
            in_flight.append((link_free, block.saved_bytes))
            flight_bytes += block.saved_bytes
            while in_flight and in_flight[0][0] <= t:
                flight_bytes -= in_flight.popleft()[1]
            while flight_bytes > window:
                done, nbytes = in_flight.popleft()
                t = max(t, done)
                flight_bytes -= nbytes
        marks.append(t)
    forward_end = t
    t += measured.head_backward_ms
    marks.append(t)
    # Backward: block n-1 first.
    host_order = [i for i in reversed(range(len(blocks))) if plan.actions[i] == HOST]
    ready: dict[int, float] = {}
    pending = 0  # prefetched bytes not yet used
    next_host = 0

    def restore_state(now: float) -> float:
        start = max(now, h2d_free)
        return start + plan.state_host_bytes * ms_per_byte_h2d + plan.state_ssd_bytes * ssd_ms_per_byte

    def issue(now: float) -> None:
        nonlocal h2d_free, pending, next_host
        b = host_order[next_host]
        start = max(now, h2d_free, written[b])
        h2d_free = start + blocks[b].saved_bytes * ms_per_byte_h2d
        ready[b] = h2d_free
        pending += blocks[b].saved_bytes
        next_host += 1

    # As the runtime's gradient hook does when backward reaches a block: the block's own copy
    # (issued now if it was not), then the next blocks' while the window has room.
    for position, index in enumerate(reversed(range(len(blocks)))):
        block = blocks[index]
        if plan.actions[index] == HOST:
            if index not in ready:
                issue(t)
            pending -= block.saved_bytes
        while next_host < len(host_order) and (
            pending == 0 or pending + blocks[host_order[next_host]].saved_bytes <= window
        ):
            issue(t)
        if restores and plan.state_out_bytes and plan.state_restore_at == position:
            state_ready = restore_state(t)
            h2d_free = state_ready
        if measured.serial_copies:
            t = max(t, h2d_free)  # what came in for backward so far, before its compute goes on
        if plan.actions[index] == HOST:
            t = max(t, ready[index])
        t += block.backward_ms + recompute_ms(block, plan.actions[index])
        marks.append(t)
    t += measured.tail_backward_ms
    marks.append(t)
    return t, link_free, h2d_free, state_ready, forward_end


def segments(measured: Measurement, plan: Plan, link: Link) -> list[float]:
    """The plan's predicted iteration (`predict`) cut where FSDP's collectives tie the ranks
    together, ms each: per pass the pre-forward, each block's forward (its all-gather before
    it), the head, each block's backward (its all-gather before it, its reduce-scatter after),
    the tail; then the step, up to the next forward's first all-gather. They sum to `predict`'s
    time."""
    marks: list[float] = []
    predict(measured, plan, link, marks)
    return [b - a for a, b in zip([0.0, *marks], marks)]


def across_ranks(
    plans: list[list[float]], baselines: list[list[float]]
) -> tuple[float, list[dict[int, float]]]:
    """The ranks' iteration (ms), and what each rank waits for each other rank in it (ms), from
    each rank's `segments` for its plan and for checkpointing every block with the state
    resident (its baseline: the measured parts as they are).

    No rank leaves a collective before every rank has reached it, so a segment takes the slowest
    rank's time. The measured parts hold the waits of the measuring iterations, which every rank
    ran alike: a wait in the segment after the one a slower rank spent longer in, so the slowest
    rank per segment of the baselines would count one delay twice. So the ranks' iteration is
    the baselines' (the largest rank's sum: a rank's parts are disjoint spans of an iteration as
    long on every rank, which its gaps can only shorten) plus, per segment, the largest change
    any rank's plan makes to it (a rank that recomputes more slows every rank down).

    The first segment is the exception: its wait for the iteration's first all-gather is the
    imbalance of the iteration before. Where that imbalance is steady, the slower rank's own
    segments of the measured iteration hold it again; where it was a one-off (a rank's first
    iterations allocate and warm up at their own moments), nothing else does. So every rank's
    sum takes the least first segment of the ranks (ranks whose iterations settle alike can
    measure first segments far apart)."""
    sizes = {len(s) for s in (*plans, *baselines)}
    if len(sizes) != 1 or len(plans) != len(baselines):
        raise ValueError(
            f"the ranks' iterations have different numbers of segments ({[len(s) for s in plans]}, "
            f"baselines {[len(s) for s in baselines]}): every rank must train the same model with the "
            "same forward and backward passes per step"
        )
    first = min(b[0] for b in baselines) if baselines[0] else 0.0
    totals = [sum(b[1:]) + first for b in baselines]
    top = max(range(len(totals)), key=lambda r: totals[r])
    group = totals[top]
    waits: list[dict[int, float]] = [{} for _ in plans]

    def wait(rank: int, on: int, ms: float) -> None:
        if rank != on and ms > 0:
            waits[rank][on] = waits[rank].get(on, 0.0) + ms

    for rank, total in enumerate(totals):
        wait(rank, top, totals[top] - total)
    for i in range(len(plans[0])):
        changes = [plan[i] - base[i] for plan, base in zip(plans, baselines)]
        slowest = max(range(len(changes)), key=lambda r: changes[r])
        group += changes[slowest]
        for rank, change in enumerate(changes):
            wait(rank, slowest, changes[slowest] - change)
    return group, waits


def peak_bound(measured: Measurement, plan: Plan) -> int:
    return max(forward_bound(measured, plan), step_bound(measured, plan))


def forward_bound(measured: Measurement, plan: Plan) -> int:
    """Forward and backward's peak: as measured with every block recomputed and the state away,
    plus what the plan keeps, its host blocks' copies and the state it leaves on the GPU."""
    kept = sum(resident_bytes(b, a) for b, a in zip(measured.blocks, plan.actions))
    # The window, and the block whose copies backward is using while the next one arrives.
    largest = max((b.saved_bytes for b in measured.blocks), default=0)
    hosted = window_bytes(measured, plan) + largest if HOST in plan.actions else 0
    state_left = measured.state_bytes - plan.state_out_bytes
    return measured.peak_bytes + kept + hosted + state_left


def step_bound(measured: Measurement, plan: Plan) -> int:
    """The step's peak: as measured with all the state back, or, windowed, less the moved state
    but the windows it holds, and with the temporaries of what it steps at once (a window and
    the parameters whose state stays: `_windowed_temporaries`)."""
    if not plan.step_window_bytes:
        return measured.step_peak_bytes
    held = plan.step_held_bytes or STEP_WINDOWS_HELD * plan.step_window_bytes
    temporaries = _windowed_temporaries(measured, plan.step_window_bytes, plan.state_out_bytes)
    windowed = measured.step_peak_bytes - measured.step_temporaries_bytes + temporaries
    return min(measured.step_peak_bytes, windowed - plan.state_out_bytes + held)


def _windowed_temporaries(measured: Measurement, window: int, state_out: int) -> int:
    """The temporaries of a windowed step: the share of the whole step's that the parameters of
    one window and those whose state stays (stepped with the last window) take, in proportion to
    their state (the state per parameter byte is the optimizer's, the same for every one)."""
    whole = measured.step_temporaries_bytes
    if not whole or not measured.state_bytes:
        return whole
    share = min(1.0, (window + max(0, measured.state_bytes - state_out)) / measured.state_bytes)
    return int(whole * share)


def _step_state_need(measured: Measurement, plan: Plan, limit_bytes: int) -> int:
    """The state bytes a windowed step must have moved for its bound (`step_bound`) to fit
    `limit_bytes`: each byte moved frees itself and its share of the temporaries."""
    whole, state = measured.step_temporaries_bytes, max(1, measured.state_bytes)
    # step_bound at `out` bytes moved: base - out * (1 + whole / state), base as below.
    base = (
        measured.step_peak_bytes
        - whole
        + whole * (plan.step_window_bytes + measured.state_bytes) / state
        + plan.step_held_bytes
    )
    return math.ceil((base - limit_bytes) / (1 + whole / state))


def _restore_position(measured: Measurement, plan: Plan, limit: int) -> Optional[int]:
    """The earliest backward position where the freed kept (and selective) blocks make room for
    the state."""
    if not plan.state_out_bytes:
        return None
    peak = peak_bound(measured, plan)
    freed = 0
    for position, index in enumerate(reversed(range(len(measured.blocks)))):
        if peak - freed + plan.state_out_bytes <= limit:
            return position
        freed += resident_bytes(measured.blocks[index], plan.actions[index])
    return None


def _move_state(plan: Plan, need: int, state_sizes: list[int], host_left: int, has_store: bool) -> bool:
    """Sets which optimizer state leaves the GPU (host memory first, then the store) to free
    `need` bytes; False where it cannot."""
    moved = 0
    for size in state_sizes:
        if moved >= need:
            break
        if pinned_size(size) <= host_left:
            plan.state_host_bytes += size
            host_left -= pinned_size(size)
        elif has_store:
            plan.state_ssd_bytes += size
        else:
            continue
        moved += size
    return moved >= need


def fit_layout(
    measured: Measurement,
    link: Link,
    limit_bytes: int,
    actions: list[str],
    window: int,
    state_sizes: list[int],
    host_left: int,
    has_store: bool,
    step_window: int,
    step_held: int = 0,
) -> Optional[Plan]:
    """The plan running `actions` with the optimizer state it must move to fit `limit_bytes`,
    predicted; None where moving all it may does not make it fit. `step_window`/`step_held`:
    a windowed step's window and what its windows hold at once (`choose`)."""
    plan = Plan(list(actions), window_blocks=window)
    if step_window and measured.step_peak_bytes > limit_bytes:
        # The step cannot take all the state back: it runs in windows, and the state moved must
        # make room for the windows it holds.
        plan.step_window_bytes = step_window
        plan.step_held_bytes = step_held or STEP_WINDOWS_HELD * step_window
        need = max(forward_bound(measured, plan) - limit_bytes, _step_state_need(measured, plan, limit_bytes))
    else:
        need = peak_bound(measured, plan) - limit_bytes
    if need > 0 and not _move_state(plan, need, state_sizes, host_left, has_store):
        return None
    # A windowed step brings the state back itself; else where backward frees room, in the last
    # backward pass (brought back in an earlier one, the state would stay through the next
    # forward, which the bound leaves no room for).
    if not plan.step_window_bytes:
        plan.state_restore_at = _restore_position(measured, plan, limit_bytes)
    plan.predicted_ms, plan.predicted_peak_bytes = predict(measured, plan, link)
    if plan.predicted_peak_bytes > limit_bytes:
        return None
    return plan


def _best_layout(
    measured: Measurement,
    link: Link,
    limit_bytes: int,
    state_sizes: list[int],
    host_left: int,
    has_store: bool,
    hosted: int,
    with_selective: bool,
    best: Optional[Plan],
    step_window: int,
    step_held: int,
) -> Optional[Plan]:
    """`best`, or a faster layout with `hosted` host blocks that fits (`choose`)."""
    n = len(measured.blocks)
    for recomputed, window in itertools.product(range(n - hosted + 1), WINDOW_BLOCKS if hosted else (1,)):
        left = n - hosted - recomputed
        for chosen in range(1, left + 1) if with_selective else (0,):
            actions = (
                [HOST] * hosted + [RECOMPUTE] * recomputed + [SELECTIVE] * chosen + [KEEP] * (left - chosen)
            )
            compute = measured.checkpoint_all_ms + measured.passes * sum(
                recompute_ms(b, a) - b.recompute_ms + added_forward_ms(b, a)
                for b, a in zip(measured.blocks, actions)
            )
            if best is not None and compute >= best.predicted_ms - 1e-9:
                break
            plan = fit_layout(
                measured,
                link,
                limit_bytes,
                actions,
                window,
                state_sizes,
                host_left,
                has_store,
                step_window,
                step_held,
            )
            if plan is None:
                continue
            if best is None or plan.predicted_ms < best.predicted_ms - 1e-9:
                best = plan
            if not plan.state_out_bytes:
                break
    return best


def choose(
    measured: Measurement,
    link: Link,
    limit_bytes: int,
    state_sizes: list[int],
    host_bytes: int,
    has_store: bool,
    step_window: int = 0,
    step_held: int = 0,
) -> tuple[Optional[Plan], list[dict[str, Any]]]:
    """The fastest layout that fits `limit_bytes` (None if none does), and a summary per block
    count tried. `state_sizes`: the movable optimizer-state tensors' bytes (largest first);
    `host_bytes`: pinned host memory for activations and state together; `step_window`: the
    window of a windowed step where the step with all the state cannot fit (0: no windowed step).

    Layouts: h blocks to the host, then c recomputed, s selective (where every block's selective
    recomputation was measured) and the rest kept. The layouts without selective blocks go first;
    then, for given h and c, each more selective block adds its recomputation and forward to the
    iteration: the count stops growing once the plan fits without moving state, or its time
    without copies cannot beat the best plan found."""
    n = len(measured.blocks)
    best: Optional[Plan] = None
    tried = []
    for with_selective in (False, True) if measured.selective_ok else (False,):
        for hosted in range(n + 1):
            # The saved-tensor mover pins exactly their bytes (`RegisteredBuffer`).
            host_activations = sum(b.saved_bytes for b in measured.blocks[:hosted])
            if host_activations > host_bytes:
                break
            best = _best_layout(
                measured,
                link,
                limit_bytes,
                state_sizes,
                host_bytes - host_activations,
                has_store,
                hosted,
                with_selective,
                best,
                step_window,
                step_held,
            )
            tried.append(
                {
                    "host_blocks": hosted,
                    "selective": with_selective,
                    "best_ms": best.predicted_ms if best else None,
                }
            )
    return best, tried


# -- measuring -------------------------------------------------------------------------------------


def steady_block_times(measured: Measurement, probes: list[int]) -> None:
    """Every block's forward, backward and recomputation set to the median of the blocks' (one
    class: the same ops on the same shapes); `probes` (selective in iteration 2: their spans are
    selective recomputation's) are left out of the recomputation's median and keep theirs. The
    measuring iterations stall where the allocator maps memory as they first grow, and a stall
    lands in whichever block's span it falls: a few blocks' recomputations then measure several
    times the steady figure and others a fraction of it, while planned iterations map no memory,
    so summing the blocks as measured predicts checkpointing every block well above what it
    takes. Block 0's backward is left as
    measured (its span holds the embedding's too: the tail takes the excess)."""
    blocks = measured.blocks
    if len(blocks) < 3:
        return
    forward = statistics.median(b.forward_ms for b in blocks)
    backward = statistics.median(b.backward_ms for b in blocks[1:])
    recompute = statistics.median(blocks[i].recompute_ms for i in range(1, len(blocks)) if i not in probes)
    for index, block in enumerate(blocks):
        block.forward_ms = forward
        if index > 0:
            block.backward_ms = backward
        if index not in probes:
            block.recompute_ms = recompute
