"""Object-id namespaces: each kind of tensor the runtime keeps in a store gets its own id range.

The engine's object ids are 64-bit; a namespace is the range `[index << 40, (index + 1) << 40)`,
so a namespace holds 2^40 objects and an id says which kind of tensor it belongs to. Declared
once here; users' own objects (`Store.put`) live below `1 << 40`.
"""

from __future__ import annotations

#: Namespace names, in id order (index 0 is left to users' own objects).
NAMESPACES = (
    "user",
    "activations",
    "optimizer_state",
    "parameters",
    "fallback_state",
    "model_parameters",
    "model_gradients",
    "model_optimizer_state",
    "model_activations",
)

SHIFT = 40


def base(namespace: str) -> int:
    """The first id of `namespace` (a ValueError names the valid ones)."""
    if namespace not in NAMESPACES:
        raise ValueError(f"unknown object-id namespace {namespace!r}; valid: {', '.join(NAMESPACES)}")
    return NAMESPACES.index(namespace) << SHIFT


def namespace_of(object_id: int) -> str:
    """The namespace an object id belongs to."""
    index = object_id >> SHIFT
    if index >= len(NAMESPACES):
        raise ValueError(f"object id {object_id:#x} is in no teraio namespace")
    return NAMESPACES[index]
