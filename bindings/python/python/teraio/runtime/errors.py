"""The runtime's errors, below every module that raises them.

`NoPlanFitsError` is the runtime's own; `NoSpaceError` (the store's devices are full) and
`PlannerError` (the planner or its replay refused a schedule) come from the engine and are named
here so that the modes raise and catch them without reaching into the binding.
"""

from __future__ import annotations

from ..planning import PlannerError
from ..store import NoSpaceError

__all__ = ["NoPlanFitsError", "NoSpaceError", "PlannerError"]


class NoPlanFitsError(RuntimeError):
    """No plan fits the GPU memory budget (raised before the planned iterations, or at the
    start where the parameters and gradients alone exceed it); `if_no_fit="run"` trains anyway."""
