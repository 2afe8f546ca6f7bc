"""Op times fed to the profiler instead of the host clock, for tests whose outcome follows from op
costs (which recipes pay for themselves, which plan wins). Measured CPU op times change with the
machine's load: on a busy CI machine every recipe looked too dear and a test that needs several
recipe sets saw one. With fixed costs the same plans are made on any machine."""

from __future__ import annotations

from typing import Any, Mapping

import pytest
from teraio.profiler import Profiler
from teraio.runtime.modes.tensor import TensorOffload


def fixed_op_costs(monkeypatch: pytest.MonkeyPatch, costs_us: Mapping[str, float], other_us: float) -> None:
    """Every op the profiler records on the CPU takes `costs_us[str(func)]` microseconds (e.g.
    `"aten.addmm.default"`), else `other_us`; the runtime's calibration (which scales profiled
    times to a measured forward pass) is left out, so the plan sees exactly these costs. CUDA
    events are kept as they are."""
    assert other_us >= 0 and all(cost >= 0 for cost in costs_us.values())
    record_op = Profiler._record_op

    def record_fixed(self: Profiler, func: Any, args: Any, kwargs: Any, out: Any, timing: Any) -> None:
        if not isinstance(timing, tuple):  # a host-clock time; (start, end) are CUDA events
            timing = costs_us.get(str(func), other_us)
        record_op(self, func, args, kwargs, out, timing)

    monkeypatch.setattr(Profiler, "_record_op", record_fixed)
    monkeypatch.setattr(TensorOffload, "_calibrate", lambda self, profiler: None)
