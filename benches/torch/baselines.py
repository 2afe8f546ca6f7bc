"""What users already have against GPU memory limits, set up the way they set it up: Hugging Face
activation checkpointing, torch's selective activation checkpointing with a documented policy,
and torchtune's activation offloading (from its wheel, without its heavy package imports).
bench_regime.py and bench_llama.py share these."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
from functools import partial
from typing import Any

import torch
from teraio import selective


def enable_checkpointing(model: Any, checkpoint_kwargs: dict[str, Any]) -> None:
    """Hugging Face's per-decoder-layer checkpointing, passing `checkpoint_kwargs` to
    torch.utils.checkpoint.checkpoint (newer transformers renamed the method)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def enable_hf_checkpointing(model: Any) -> None:
    """Every decoder layer recomputed in backward: `gradient_checkpointing_enable()` with
    `use_reentrant=False` (what Hugging Face recommends)."""
    enable_checkpointing(model, {"use_reentrant": False})


#: The ops whose outputs the policy saves: teraio's selective action's own (matrix products and
#: attention), so that the two compare like for like.
SAC_SAVE_OPS = selective.SAVE_OPS
#: How often the policy chose each (forward and recomputation), reported with the row.
SAC_DECISIONS = {"save": 0, "recompute": 0}


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Save what is expensive to recompute (matmuls and attention, compute-bound), recompute the
    rest (norms, rotary, activation functions, casts, elementwise: memory-bound and cheap)."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = op in SAC_SAVE_OPS
    SAC_DECISIONS["save" if save else "recompute"] += 1
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def enable_selective_checkpointing(model: Any) -> None:
    """Per decoder layer, torch.utils.checkpoint.checkpoint with
    `context_fn=partial(create_selective_checkpoint_contexts, sac_policy)`."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context_fn = partial(create_selective_checkpoint_contexts, sac_policy)
    enable_checkpointing(model, {"use_reentrant": False, "context_fn": context_fn})


def checkpointed_layers(model: torch.nn.Module) -> int:
    """Modules below the model whose checkpointing is on (the decoder layers)."""
    from transformers import PreTrainedModel

    return sum(
        1
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) is True and not isinstance(m, PreTrainedModel)
    )


def load_torchtune_offloader() -> Any:
    """torchtune's OffloadActivations from its wheel, with its package-level imports stubbed.

    torchtune/__init__ imports torchao and all of torchtune (datasets, models, ...); the
    activation-offloading module itself needs only torch, psutil, and two names from torchao and
    torchtune (NF4Tensor, TiedLinear: type checks) plus a logger. Those names are stubbed when the
    real packages cannot be imported; the offloading code that runs is torchtune's.
    """
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torchtune is not installed")
    root = list(spec.submodule_search_locations)[0]
    try:
        import torchao.dtypes.nf4tensor
    except Exception:  # any import failure means: stub it
        torchao = types.ModuleType("torchao")
        dtypes = types.ModuleType("torchao.dtypes")
        nf4 = types.ModuleType("torchao.dtypes.nf4tensor")

        class NF4Tensor(torch.Tensor):  # never instantiated: isinstance checks only
            pass

        nf4.NF4Tensor = NF4Tensor  # type: ignore[attr-defined]
        sys.modules.update(
            {
                "torchao": torchao,
                "torchao.dtypes": dtypes,
                "torchao.dtypes.nf4tensor": nf4,
            }
        )
    package = types.ModuleType("torchtune")
    package.__path__ = [root]  # type: ignore[attr-defined]
    modules = types.ModuleType("torchtune.modules")

    class TiedLinear:  # isinstance checks only
        pass

    modules.TiedLinear = TiedLinear  # type: ignore[attr-defined]
    utils = types.ModuleType("torchtune.utils")
    utils.get_logger = lambda level=None: logging.getLogger("torchtune")  # type: ignore[attr-defined]
    training = types.ModuleType("torchtune.training")
    training.__path__ = [os.path.join(root, "training")]  # type: ignore[attr-defined]
    sys.modules.update(
        {
            "torchtune": package,
            "torchtune.modules": modules,
            "torchtune.utils": utils,
            "torchtune.training": training,
        }
    )
    path = os.path.join(root, "training", "_activation_offloading.py")
    module_spec = importlib.util.spec_from_file_location("torchtune.training._activation_offloading", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.OffloadActivations
