"""Selective recomputation: saved activations that are cheaper to compute again than to move.

A saved tensor that a cheap, deterministic op made from tensors backward has anyway (other saved
tensors, parameters, a module's inputs such as an attention mask) need not be kept or moved: the
executor drops it at the save and runs the op again when backward asks for it. On a link-bound
iteration this takes bytes off the link; the classic case is eager attention's softmax (1 GiB per
layer at batch 4 x 2048, remade from the saved query and key in a few milliseconds where moving it
out and back over a PCIe link takes tens of milliseconds).

What the profiler records (`Producer`): for each tensor a forward op made, the op and its
arguments, tensors as (record, dtype, shape, strides, offset) views of a storage, never the
tensors themselves. `find_recipes` turns a saved activation into a `Recipe` whose tensor inputs
are `Source`s (a saved tensor packed before it, a parameter or buffer, a module input captured
before it) or, for temporaries nobody keeps, nested recipes. Only ops in `_RECOMPUTABLE` (pointwise
ops, matrix products, softmax, copies, concatenation, simple reductions) qualify: deterministic
kernels that give the same bits on the same inputs, so recomputed training is bitwise equal to
training without it (the tests check this). Ops that draw random numbers or write their inputs
never qualify, and neither does a tensor a later forward op wrote in place.

`apply_to_trace` tells the planner: the tensor's life ends after its last forward use, a new
temporary holds it from its first backward use (its sources get a read there), and that op's
time grows by the recipe's profiled op times. The runtime plans with and without recomputation
and keeps the faster prediction (`teraio.offload(recompute="auto")`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

# Ops that are deterministic on the GPU and the CPU and worth replaying, besides those tagged
# pointwise. Reductions are limited to ones with a fixed order (no atomics).
_aten = torch.ops.aten
_RECOMPUTABLE = {
    _aten.mm.default,
    _aten.bmm.default,
    _aten.addmm.default,
    _aten._softmax.default,
    _aten._log_softmax.default,
    _aten.clone.default,
    _aten._to_copy.default,
    _aten.cat.default,
    _aten.mean.dim,
    _aten.sum.dim_IntList,
    _aten.native_layer_norm.default,
}
# Nesting limit for recipes through temporaries (a chain of ops nobody saved).
MAX_DEPTH = 8
MODES = ("auto", "on", "off")
#: The cost ratios (recipe time over one-way transfer time) "auto" plans with: the first lets
#: the forward pass move least, the last recomputes only what is nearly free.
AUTO_COST_RATIOS = (0.25, 0.21, 0.18, 0.13, 0.1, 0.07, 0.04)


def recomputable_op(func: Any) -> bool:
    """Whether the profiler should record `func`'s arguments so that its output can be remade."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    tags = getattr(func, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags or torch.Tag.nondeterministic_bitwise in tags:
        return False
    return func in _RECOMPUTABLE or torch.Tag.pointwise in tags


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument as a view of the storage of profiler record `record_id`."""

    record_id: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class Producer:
    """The forward op that made a storage: `func(*args, **kwargs)` from `spec` and `leaves`
    (a `TensorArg` where the argument was a tensor of the profiled device)."""

    op: int
    func: Any
    spec: Any
    leaves: list[Any]


@dataclass(frozen=True)
class Source:
    """A tensor backward can reach: `kind` "saved" (the first save of trace tensor `tensor_id`),
    "weight" (a parameter or buffer) or "arg" (`key` = (module name, call, flat position) of a
    module input)."""

    kind: str
    tensor_id: int
    key: Any = None


@dataclass
class Leaf:
    """A recipe's tensor argument: a view of `source`'s storage (a Source or a nested Recipe)."""

    source: Union[Source, Recipe]
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class Recipe:
    """How to make tensor `tensor_id`'s storage again: `func` over `leaves` (constants and Leafs)."""

    tensor_id: int
    func: Any
    spec: Any
    leaves: list[Any]
    size_bytes: int
    #: Profiled time of every op the recipe runs, microseconds.
    cost_us: float
    #: Largest intermediate (nested) output it holds while it runs.
    transient_bytes: int = 0
    sources: set[Source] = field(default_factory=set)

    def run(self, resolve: Any, device: torch.device) -> torch.Tensor:
        """Runs the recipe; `resolve(source)` returns the source's storage."""
        values = []
        for leaf in self.leaves:
            if not isinstance(leaf, Leaf):
                values.append(leaf)
                continue
            if isinstance(leaf.source, Recipe):
                storage = leaf.source.run(resolve, device).untyped_storage()
            else:
                storage = resolve(leaf.source)
            view = torch.empty(0, dtype=leaf.dtype, device=device)
            view.set_(storage, leaf.offset, leaf.size, leaf.stride)
            values.append(view)
        args, kwargs = torch.utils._pytree.tree_unflatten(values, self.spec)
        out = self.func(*args, **kwargs)
        if out.untyped_storage().nbytes() != self.size_bytes:
            raise RuntimeError(
                f"teraio: recomputing tensor {self.tensor_id} ({self.func}) gave "
                f"{out.untyped_storage().nbytes()} bytes, the profile had {self.size_bytes}"
            )
        return out


def find_recipes(
    profiler: Any,
    durations_us: list[float],
    *,
    min_bytes: int,
    link_bandwidth: Optional[float],
    cost_ratio: float = 0.25,
    allow_weights: bool = True,
) -> dict[int, Recipe]:
    """Recipes for the profiled iteration's saved activations of at least `min_bytes`.

    With `link_bandwidth` (bytes/s), only those whose recipe costs at most `cost_ratio` times
    the one-way transfer of their bytes; with None, every one that can be remade exactly.
    """
    records = profiler.records
    first_pack: dict[int, int] = {}
    for event in profiler.events:
        if event.kind == "pack" and event.tensor_id is not None:
            first_pack.setdefault(event.tensor_id, event.pack_index)
    weights = {r.id for r in records if r.kind == "weight"}

    def resolve(record_id: int, before_pack: int, depth: int, found: set[Source]) -> Optional[Any]:
        record = records[record_id]
        if record.mutated:
            return None
        if record_id in weights:
            if not allow_weights:
                return None
            source = Source("weight", record_id)
        elif first_pack.get(record_id, before_pack) < before_pack and record_id not in chosen:
            source = Source("saved", record_id)
        elif record_id in profiler.module_args and not record.saved_for_backward:
            # Only a tensor nobody saves: keeping a saved one alive would defeat its own plan.
            name, call, position, saves_before = profiler.module_args[record_id]
            if saves_before > before_pack:
                return None
            source = Source("arg", record_id, (name, call, position))
        else:
            # A temporary, or a saved tensor that is itself recomputed: made inline, so that a
            # recipe never waits for another one (each is made where backward first needs it).
            # Recomputed ones only one level deep: deeper, a chain of them (a residual stream)
            # would remake the whole network at the first backward op.
            if depth >= MAX_DEPTH or record.producer is None or (record_id in chosen and depth > 0):
                return None
            return build(record_id, before_pack, depth + 1, found)
        found.add(source)
        return source

    def build(record_id: int, before_pack: int, depth: int, found: set[Source]) -> Optional[Recipe]:
        producer: Producer = records[record_id].producer
        leaves: list[Any] = []
        cost = durations_us[producer.op]
        transient = 0
        for leaf in producer.leaves:
            if not isinstance(leaf, TensorArg):
                leaves.append(leaf)
                continue
            source = resolve(leaf.record_id, before_pack, depth, found)
            if source is None:
                return None
            if isinstance(source, Recipe):
                cost += source.cost_us
                transient = max(transient, source.size_bytes + source.transient_bytes)
            leaves.append(Leaf(source, leaf.dtype, leaf.size, leaf.stride, leaf.offset))
        return Recipe(
            record_id,
            producer.func,
            producer.spec,
            leaves,
            records[record_id].size_bytes,
            cost,
            transient,
        )

    def make(record_id: int) -> Optional[Recipe]:
        found: set[Source] = set()
        recipe = build(record_id, first_pack[record_id], 0, found)
        if recipe is None:
            return None
        if link_bandwidth is not None:
            transfer_us = records[record_id].size_bytes / link_bandwidth * 1e6
            if recipe.cost_us > cost_ratio * transfer_us:
                return None
        recipe.sources = found
        return recipe

    # Greedy, largest first: a candidate joins if its recipe works with those chosen so far and
    # the chosen recipes that read it can still be made with it inlined.
    candidates = sorted(
        (
            record.id
            for record in records
            if record.kind == "activation"
            and record.producer is not None
            and not record.mutated
            and record.size_bytes >= min_bytes
            and record.id in first_pack
        ),
        key=lambda record_id: (-records[record_id].size_bytes, first_pack[record_id]),
    )
    chosen: set[int] = set()
    recipes: dict[int, Recipe] = {}
    readers: dict[int, set[int]] = {}  # saved tensor -> chosen recipes that read it
    for candidate in candidates:
        chosen.add(candidate)
        remade: dict[int, Recipe] = {}
        for record_id in [candidate, *sorted(readers.get(candidate, ()))]:
            recipe = make(record_id)
            if recipe is None:
                break
            remade[record_id] = recipe
        else:
            for record_id, recipe in remade.items():
                for source in recipes[record_id].sources if record_id in recipes else ():
                    readers.get(source.tensor_id, set()).discard(record_id)
                recipes[record_id] = recipe
                for source in recipe.sources:
                    if source.kind == "saved":
                        readers.setdefault(source.tensor_id, set()).add(record_id)
            continue
        chosen.discard(candidate)
    return recipes


def first_events(events: list[Any]) -> tuple[dict[int, int], dict[int, int]]:
    """Each tensor's first pack event and first unpack event (indices into `events`, the
    profiler's `SaveEvent`s)."""
    first_pack: dict[int, int] = {}
    first_unpack: dict[int, int] = {}
    for index, event in enumerate(events):
        if event.tensor_id is None:
            continue
        if event.kind == "pack":
            first_pack.setdefault(event.tensor_id, index)
        else:
            first_unpack.setdefault(event.tensor_id, index)
    return first_pack, first_unpack


def need_events(events: list[Any], recipes: dict[int, Recipe]) -> dict[int, int]:
    """The event at which backward first needs each tensor: its first unpack, or earlier where a
    recomputed tensor made from it is needed first (only tensors with an unpack are listed)."""
    first_pack, need = first_events(events)
    # A recipe's saved sources were packed before it: walking recipes latest-packed first
    # settles each tensor before its sources.
    for tensor_id in sorted(recipes, key=lambda t: first_pack.get(t, -1), reverse=True):
        if tensor_id not in need:
            continue
        for source in recipes[tensor_id].sources:
            if source.kind != "weight":
                need[source.tensor_id] = min(need.get(source.tensor_id, need[tensor_id]), need[tensor_id])
    return need


def apply_to_trace(
    trace: dict[str, Any], events: list[Any], recipes: dict[int, Recipe]
) -> tuple[dict[str, Any], dict[int, Recipe], dict[int, int]]:
    """The trace as the planner should see it with `recipes` applied (see the module docstring),
    the recipes that apply (a tensor with no backward use, or one backward touches before it is
    unpacked, is left as it was) and `need_events`."""
    trace = copy.deepcopy(trace)
    ops = trace["ops"]
    by_id = {t["id"]: t for t in trace["tensors"]}
    need = need_events(events, recipes)
    applied: dict[int, Recipe] = {}
    for tensor_id, recipe in recipes.items():
        entry = by_id.get(tensor_id)
        if entry is None or tensor_id not in need:
            continue
        at = events[need[tensor_id]].next_op
        before = [u for u in entry["uses"] if u["op"] < at]
        if not before or at >= len(ops) or any(ops[u["op"]].get("phase") != "forward" for u in before):
            continue
        applied[tensor_id] = recipe
    need = need_events(events, applied)
    next_id = max(by_id) + 1
    remade: dict[int, dict[str, Any]] = {}
    # Recipes in order of their materialization, so that a source made again is there first.
    for tensor_id in sorted(applied, key=lambda t: need[t]):
        recipe = applied[tensor_id]
        entry = by_id[tensor_id]
        at = events[need[tensor_id]].next_op
        later = [u for u in entry["uses"] if u["op"] > at]
        entry["uses"] = [u for u in entry["uses"] if u["op"] < at]
        entry["free_op"] = entry["uses"][-1]["op"]
        copy_entry = remade_entry(entry, next_id, at, later, "recomputed")
        next_id += 1
        trace["tensors"].append(copy_entry)
        remade[tensor_id] = copy_entry
        if recipe.transient_bytes:
            trace["tensors"].append(
                {
                    "id": next_id,
                    "name": f"{entry['name']} (recompute scratch)",
                    "size_bytes": recipe.transient_bytes,
                    "kind": "temporary",
                    "alloc_op": at,
                    "free_op": at,
                    "uses": [{"op": at, "access": "write"}],
                }
            )
            next_id += 1
        for source in recipe.sources:
            target = remade.get(source.tensor_id) or by_id.get(source.tensor_id)
            if target is not None:
                _add_read(target, at)
        ops[at]["duration_us"] = ops[at]["duration_us"] + recipe.cost_us
    return trace, applied, need


def _add_read(entry: dict[str, Any], op: int) -> None:
    """Adds a read at `op` (kept in op order; an existing use there stays as it is)."""
    uses = {u["op"]: u["access"] for u in entry["uses"]}
    uses.setdefault(op, "read")
    entry["uses"] = [{"op": o, "access": uses[o]} for o in sorted(uses)]
    if entry["free_op"] is not None and op > entry["free_op"]:
        entry["free_op"] = op


def remade_entry(
    entry: dict[str, Any], tensor_id: int, at: int, later: list[dict[str, Any]], how: str
) -> dict[str, Any]:
    """The trace entry of `entry`'s tensor made again at op `at` (a temporary written there and
    read by the `later` uses): per-tensor recompute and checkpointed blocks both rewrite so."""
    return {
        "id": tensor_id,
        "name": f"{entry['name']} ({how})",
        "size_bytes": entry["size_bytes"],
        "kind": "temporary",
        "alloc_op": at,
        "free_op": later[-1]["op"] if later else at,
        "uses": [{"op": at, "access": "write"}, *later],
    }
