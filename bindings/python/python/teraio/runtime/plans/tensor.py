"""Plan translation: a lifetime plan's migrations onto the runtime's `saved_tensors_hooks` events.

The planner plans in ops of the profiled trace; the runtime acts at the save/unpack events it
sees, which come in the same order every iteration. These functions map each migration to the
events at which the executors act: activations (`decisions_from_plan`, for
`modes.activations.ActivationExecutor`), optimizer state between steps and parameters between the passes
(`state_moves_from_plan`, `parameter_moves_from_plan`, for `modes.state.StateExecutor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ... import recompute as rc
from ...profiler import Profiler, SaveEvent
from ...recompute import Recipe

#: The tier of a saved tensor the plan recomputes instead of moving.
RECOMPUTE = "recompute"


@dataclass
class PackDecision:
    """What to do with the `pack_index`-th saved tensor of an iteration."""

    tensor_id: Optional[int]
    size_bytes: int
    tier: Optional[str]
    prefetch_event: Optional[int] = None
    #: The event where backward first needs it (orders prefetches issued at the same event).
    need_event: Optional[int] = None
    #: The event of its save (a prefetch can be issued only after it).
    pack_event: Optional[int] = None
    #: For tier RECOMPUTE: how to make it again.
    recipe: Optional[Recipe] = None


@dataclass
class Move:
    """One tensor the plan moves: its tier and the `saved_tensors_hooks` events (indices within
    an iteration) at which to act. `release_event` None: out after the optimizer step (optimizer
    state); else out at that event (a parameter after its last forward use). `restore_event` None:
    back at the step. `wait_event` None: compute waits at the step; else at that event."""

    tensor: torch.Tensor
    tier: str
    restore_event: Optional[int]
    release_event: Optional[int] = None
    wait_event: Optional[int] = None


def decisions_from_plan(
    trace: dict[str, Any],
    events: list[SaveEvent],
    plan_doc: dict[str, Any],
    recipes: Optional[dict[int, rc.Recipe]] = None,
    need: Optional[dict[int, int]] = None,
) -> list[PackDecision]:
    """Maps a plan's activation migrations onto the profiled save/unpack events.

    The runtime sees the iteration through `saved_tensors_hooks` events, which come in the same
    order every iteration: pack `i` of the profiled iteration is pack `i` of each later one. A
    tensor's offload starts at its first pack; its prefetch is issued at the last event whose next
    op is at or before the planned prefetch op (and never after the event where backward first
    needs it: its first unpack, or `need`'s earlier event where a recipe reads it). A tensor in
    `recipes` is recomputed instead.
    """
    recipes = recipes or {}
    sizes = {t["id"]: t["size_bytes"] for t in trace["tensors"]}
    kinds = {t["id"]: t["kind"] for t in trace["tensors"]}
    best: dict[int, dict[str, Any]] = {}
    for migration in plan_doc["migrations"]:
        tensor_id = migration["tensor_id"]
        if kinds.get(tensor_id) != "activation":
            continue
        span = migration["next_use_op"] - migration["offload_op"]
        current = best.get(tensor_id)
        if current is None or span > current["next_use_op"] - current["offload_op"]:
            best[tensor_id] = migration
    first_pack_event, first_unpack_event = rc.first_events(events)
    pack_events = [e for e in events if e.kind == "pack"]
    decisions: list[PackDecision] = []
    seen: set[int] = set()
    for event in pack_events:
        tensor_id = event.tensor_id
        size = sizes.get(tensor_id, -1) if tensor_id is not None else -1
        migration = best.get(tensor_id) if tensor_id is not None else None
        if tensor_id is not None and tensor_id in recipes and tensor_id not in seen:
            seen.add(tensor_id)
            decisions.append(PackDecision(tensor_id, size, RECOMPUTE, recipe=recipes[tensor_id]))
            continue
        if tensor_id is None or migration is None or tensor_id in seen:
            decisions.append(PackDecision(tensor_id, size, None))
            continue
        seen.add(tensor_id)
        pack_at = first_pack_event[tensor_id]
        limit = (need or {}).get(tensor_id, first_unpack_event.get(tensor_id, len(events) - 1))
        trigger = pack_at + 1
        for index in range(pack_at + 1, limit + 1):
            if events[index].next_op <= migration["prefetch_op"]:
                trigger = index
            else:
                break
        prefetch_event = min(trigger, limit)
        decisions.append(
            PackDecision(
                tensor_id, size, migration["tier"], prefetch_event, need_event=limit, pack_event=pack_at
            )
        )
    return decisions


def _last_event_at_or_before(events: list[SaveEvent], op: int) -> Optional[int]:
    """The last event whose next op is at or before `op` (None: every event comes later)."""
    found: Optional[int] = None
    for index, event in enumerate(events):
        if event.next_op > op:
            break
        found = index
    return found


def state_moves_from_plan(
    trace: dict[str, Any],
    state_ids: list[tuple[torch.Tensor, int]],
    events: list[SaveEvent],
    plan_doc: dict[str, Any],
) -> list[Move]:
    """The optimizer-state tensors (`state_ids`: each with its trace id) the plan moves between
    steps, with their tier and the event at which to restore them: the last event whose next op
    is at or before the planned prefetch op (None: the prefetch is in the step itself, so it is
    issued at the step)."""
    kinds = {t["id"]: t["kind"] for t in trace["tensors"]}
    wrapping = {
        m["tensor_id"]: m
        for m in plan_doc["migrations"]
        if m["wraps"] and kinds.get(m["tensor_id"]) == "optimizer_state"
    }
    moves: list[Move] = []
    for value, tensor_id in state_ids:
        migration = wrapping.get(tensor_id)
        if migration is None:
            continue
        event = _last_event_at_or_before(events, migration["prefetch_op"])
        moves.append(Move(value, migration["tier"], event))
    return moves


def parameter_moves_from_plan(
    trace: dict[str, Any], profiler: Profiler, events: list[SaveEvent], plan_doc: dict[str, Any]
) -> list[Move]:
    """The parameters the plan moves out between their last forward use and their first backward
    use: released at the first event after the planned offload op, restored at the last event
    at or before the planned prefetch op, and waited for at the last event before the use. A
    migration that the events cannot bracket that way is left out (the parameter stays)."""
    kinds = {t["id"]: t["kind"] for t in trace["tensors"]}
    planned = {
        m["tensor_id"]: m
        for m in plan_doc["migrations"]
        if not m["wraps"] and kinds.get(m["tensor_id"]) == "weight"
    }
    if not planned or profiler.model is None:
        return []
    moves: list[Move] = []
    for param in profiler.model.parameters():
        record = profiler.lookup(param)
        if record is None or record.id not in planned:
            continue
        migration = planned.pop(record.id)
        release = next((i for i, e in enumerate(events) if e.next_op >= migration["offload_op"]), None)
        restore = _last_event_at_or_before(events, migration["prefetch_op"])
        wait = _last_event_at_or_before(events, migration["next_use_op"])
        if release is None or restore is None or wait is None or not release < restore <= wait:
            continue
        moves.append(Move(param, migration["tier"], restore, release_event=release, wait_event=wait))
    return moves
