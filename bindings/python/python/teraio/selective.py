"""Selective checkpointing of one block: keep what is expensive to compute again, recompute the rest.

The block plan's SELECTIVE action (`teraio.runtime.modes.block`) runs a block through
`torch.utils.checkpoint` with torch's selective policy (`create_selective_checkpoint_contexts`):
the outputs of compute-bound ops (matrix products and attention, `SAVE_OPS`) are kept from the
forward; everything else (norms, rotary embeddings, activation functions, casts, elementwise ops:
memory-bound, short kernels) runs again in backward. In a bf16 transformer block the kept outputs
are about a third of what the block saves, and their recomputation a small share of the block's
forward: the plan measures both (`BlockOffload`) and weighs them against keeping the
block, copying it to the host, or recomputing it whole.

What such a block keeps is known without running it: every output of every op in `SAVE_OPS`, as
torch's caching mode holds all of them until backward (`kept_bytes`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _save_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    names = [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ]
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


#: The ops whose outputs a selectively checkpointed block keeps (compute-bound).
SAVE_OPS = _save_ops()


def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of `SAVE_OPS`; recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` checkpointed with `policy` (non-reentrant, as the block plan's
    full recomputation is)."""
    context_fn = partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def kept_bytes(op: Any, out: Any) -> int:
    """The bytes `policy` keeps of one op's outputs (0 for an op it recomputes)."""
    if op not in SAVE_OPS:
        return 0
    storages: dict[int, int] = {}
    for value in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
