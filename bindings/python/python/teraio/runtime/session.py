"""What every mode shares: the GPU budget and host memory it resolves, ..."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .. import machine
from ..options import OffloadOptions
from ..planning import parse_size


def gpu_budget(device: torch.device, gpu_memory: Optional[Union[int, str]]) -> int:
    """`gpu_memory` in bytes; default: the whole device."""
    if gpu_memory is None:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        raise ValueError("gpu_memory is required on a CPU device")
    return parse_size(gpu_memory)


def host_memory(options: OffloadOptions) -> tuple[int, dict[str, Any]]:
    """Pinned host memory the runtime may hold, and where the figure came from."""
    if options.host_memory == "auto":
        available = machine.available_host_bytes()
        share = f"{machine.HOST_MEMORY_SHARE:.0%} of MemAvailable ({(available or 0) / 2**30:.1f} GiB)"
        return machine.default_host_memory(available), {"host_memory": share}
    return parse_size(options.host_memory), {"host_memory": "given"}
