"""What the machine offers, measured or bounded, for `teraio.offload`'s "auto" settings.

- **Host link** (`measure_link`): pinned host <-> device copies of `LINK_PROBE_BYTES`, best of
  three each way alone, and each way with both directions copying at once (a PCIe link gives
  each direction less then; the whole-model prediction's replay uses it).
- **Store** (`measure_store`): the engine writes and reads `STORE_PROBE_BYTES` from pinned memory
  in `STORE_PROBE_OBJECT_BYTES` objects (then deletes them).
- Both are measured once and cached in a small JSON file keyed by the store's UUID (and the GPU's
  name for the link), next to the store's first device file (or in `~/.cache/teraio` where that
  directory cannot be written, e.g. a block device): `cache_path`.
- **Several ranks** (a `torch.distributed` process group of more than one rank, as under DDP or
  FSDP2, one store per rank): each rank plans with its share of what it shares with the others
  (the host's memory system and PCIe root, a disk several ranks' stores sit on). So the ranks
  measure together: where any rank has no cached figure, every rank probes, between barriers,
  at the same time (`_GroupProbe`), and the figures are cached under the group's size. This is
  the one collective teraio issues, once, when `teraio.offload` starts; every rank must start it
  with the same options (the same code does).
- **Host memory** (`default_host_memory`): MemAvailable (/proc/meminfo) at the start less a
  margin (`HOST_MEMORY_MARGIN_BYTES`, or `HOST_MEMORY_MARGIN_SHARE` of MemTotal where that is
  more), shared by the ranks on the host.
- **CPU step** (`measure_cpu_update`): the AdamW step the CPU step would run (the engine's
  kernel, or torch's CPU AdamW, fused where the build has it) over `CPU_UPDATE_PROBE_BYTES` of
  fp32 parameters, once per process and kind: the rate whole-model mode's choice of update site
  (`update="auto"`) assumes for a step on the CPU.
- **Reserve**: from the allocator's own behaviour in the profiled iteration
  (`reserve_from_allocator`).

The planner is given `PLAN_SHARE` of each measured bandwidth: training shares the link and the
disk with other work (the data loader, the allocator), which a quiet probe does not see.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .cpu_adamw import AdamHyper, AdamTensor, CpuAdamW
from .pinned import RegisteredBuffer
from .planning import parse_bandwidth

#: What "auto" host memory leaves of MemAvailable: the process's own memory beyond what the
#: runtime pins (the CUDA context, libraries, the Python heap: 1.5-2 GiB in a transformers
#: training process), data loader workers, the page cache and the rest of the machine. The larger
#: of the two. The runtime's pinned memory is its tiers' bytes, to a page (`tiers.RegisteredBuffer`).
HOST_MEMORY_MARGIN_BYTES = 8 << 30
HOST_MEMORY_MARGIN_SHARE = 0.1
#: Share of a measured bandwidth the planner assumes.
PLAN_SHARE = 0.9
LINK_PROBE_BYTES = 256 << 20
STORE_PROBE_BYTES = 1 << 30
STORE_PROBE_OBJECT_BYTES = 128 << 20
#: Object ids the store probe writes (and deletes): far above the runtime's own.
PROBE_OBJECT_BASE = 1 << 50
#: The reserve: at least this share of the budget, and the profiled iteration's allocator slack
#: (reserved minus allocated at the peak) times `RESERVE_SLACK_FACTOR` plus `RESERVE_EXTRA_BYTES`.
RESERVE_MIN_SHARE = 0.1
RESERVE_SLACK_FACTOR = 1.5
RESERVE_EXTRA_BYTES = 512 << 20


@dataclass(frozen=True)
class Link:
    """What a runtime plans with, bytes/s: each way between the GPU and host memory, and the
    store's reads and writes (1.0 without a store); `ssd_shared`: the store's reads and writes
    share its devices' time (`OffloadOptions.ssd_shared`)."""

    d2h: float
    h2d: float
    ssd_read: float = 1.0
    ssd_write: float = 1.0
    ssd_shared: bool = False
    #: Each way while both directions copy at once (None: not measured, taken as `d2h`/`h2d`).
    duplex: Optional[float] = None


@dataclass
class Measured:
    """Bandwidths, bytes/s, and where each came from ("measured", "cached" or "given")."""

    link_d2h: Optional[float] = None
    link_h2d: Optional[float] = None
    link_duplex: Optional[float] = None
    ssd_write: Optional[float] = None
    ssd_read: Optional[float] = None
    source: str = ""


def available_host_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """MemAvailable, bytes (None where the file is missing)."""
    return _meminfo(meminfo).get("MemAvailable")


def total_host_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """MemTotal, bytes (None where the file is missing)."""
    return _meminfo(meminfo).get("MemTotal")


def _meminfo(path: str) -> dict[str, int]:
    try:
        with open(path) as f:
            return {
                name: int(rest.split()[0]) * 1024
                for name, _, rest in (line.partition(":") for line in f)
                if name in ("MemTotal", "MemAvailable")
            }
    except OSError:
        return {}


def default_host_memory(available: Optional[int], total: Optional[int] = None, ranks: int = 1) -> int:
    """What "auto" pins at most: MemAvailable less the margin (`HOST_MEMORY_MARGIN_BYTES`, or
    `HOST_MEMORY_MARGIN_SHARE` of MemTotal where that is more), split evenly between `ranks`
    processes on the host; 4 GiB where MemAvailable cannot be read."""
    if available is None:
        return 4 << 30
    margin = max(HOST_MEMORY_MARGIN_BYTES, int((total or available) * HOST_MEMORY_MARGIN_SHARE))
    return max(0, available - margin) // max(1, ranks)


def ranks_on_this_host() -> int:
    """Processes of this job on this host: torchrun's LOCAL_WORLD_SIZE, else the process group's
    size (every rank taken as local: the safe side), else 1."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) > 0:
        return int(local)
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def reserve_from_allocator(
    gpu_memory_bytes: int, reserved_peak: int, allocated_peak: int, min_share: float = RESERVE_MIN_SHARE
) -> int:
    """The GPU memory a plan leaves free: the allocator's slack seen in the profiled iteration
    (reserved minus allocated at their peaks: blocks the caching allocator holds but cannot hand
    out) times `RESERVE_SLACK_FACTOR` plus `RESERVE_EXTRA_BYTES`, at least `min_share` of the
    budget, and at most half of it."""
    slack = max(0, reserved_peak - allocated_peak)
    wanted = max(int(slack * RESERVE_SLACK_FACTOR) + RESERVE_EXTRA_BYTES, int(gpu_memory_bytes * min_share))
    return min(wanted, gpu_memory_bytes // 2)


def unreleasable_bytes(device: torch.device) -> int:
    """GPU memory the caching allocator holds and could not give back now: reserved minus
    allocated once it has released every free block it can (`torch.cuda.empty_cache`, what a
    failing allocation does before it gives up). With expandable segments that is the partly
    used pages around live blocks, which `inactive_split_bytes` does not count (it stays 0
    there); without them, the free parts of split segments. Synchronizes the device."""
    torch.cuda.empty_cache()
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def measure_link(device: torch.device, nbytes: int = LINK_PROBE_BYTES) -> tuple[float, float, float]:
    """Copy bandwidth in bytes/s, best of three each: pinned device -> host alone, host -> device
    alone, and each way while both copy at once (on two CUDA streams); on a CPU device, host
    memory copies (the two "at once" one after the other)."""
    cuda = device.type == "cuda"
    pinned = [RegisteredBuffer(nbytes) for _ in range(2)] if cuda else []
    hosts = [b.tensor for b in pinned] if cuda else [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)] if cuda else [None, None]

    def copies(directions: tuple[str, ...]) -> float:
        best = 0.0
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            for index, direction in enumerate(directions):
                with torch.cuda.stream(streams[index]) if cuda else contextlib.nullcontext():
                    if direction == "d2h":
                        hosts[index].copy_(devs[index], non_blocking=cuda)
                    else:
                        devs[index].copy_(hosts[index], non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize(device)
            best = max(best, nbytes / max(time.perf_counter() - started, 1e-9))
        return best

    try:
        return copies(("d2h",)), copies(("h2d",)), copies(("d2h", "h2d"))
    finally:
        for buffer in pinned:  # every copy was waited for
            buffer.release()


#: fp32 parameter bytes the CPU step's probe updates (its gradient and AdamW state: 3x more, 1 GiB
#: in all): far past any CPU cache, so that it runs at host memory's speed, as the CPU step over a
#: model's state does. A probe of a quarter of this ran from caches, at rates the CPU step over a
#: model's state did not reach.
CPU_UPDATE_PROBE_BYTES = 256 << 20

_cpu_update_rates: dict[bool, float] = {}


def measure_cpu_update(nbytes: int = CPU_UPDATE_PROBE_BYTES, kernel: bool = False) -> float:
    """Parameter + gradient + state bytes per second a CPU AdamW step updates: the median of
    three steps after a first that allocates the state (the best flatters a machine whose other
    work comes and goes). `kernel`: the engine's (`teraio.cpu_adamw`), else torch's, fused
    where the build supports it on the CPU (as the whole-model CPU step runs them). Measured once
    per process and kind (the default size)."""
    if nbytes == CPU_UPDATE_PROBE_BYTES and kernel in _cpu_update_rates:
        return _cpu_update_rates[kernel]
    param = torch.zeros(nbytes // 4, dtype=torch.float32, requires_grad=True)
    param.grad = torch.full_like(param, 1e-3)
    step: Callable[[], None]
    if kernel:
        adam = CpuAdamW(torch.get_num_threads())
        hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
        moments = (torch.zeros_like(param), torch.zeros_like(param))
        count = [0]

        def step() -> None:
            count[0] += 1
            adam.step(hyper, [AdamTensor(param.detach(), param.grad, *moments, step=float(count[0]))])

        step()
    else:
        try:
            optimizer = torch.optim.AdamW([param], fused=True)
            optimizer.step()
        except (RuntimeError, TypeError, ValueError):  # no fused CPU kernel in this build
            optimizer = torch.optim.AdamW([param], foreach=False)
            optimizer.step()
        step = optimizer.step
    times = []
    for _ in range(3):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    rate = 4 * nbytes / max(statistics.median(times), 1e-9)  # parameter, gradient, exp_avg, exp_avg_sq
    if nbytes == CPU_UPDATE_PROBE_BYTES:
        _cpu_update_rates[kernel] = rate
    return rate


def measure_store(store: Any, cuda: bool) -> tuple[float, float]:
    """The engine's write and read bandwidth (bytes/s) from pinned memory: `STORE_PROBE_BYTES`,
    or a quarter of the store's free space if that is less."""
    free = sum(int(d["free_bytes"]) for d in store.info()["devices"])
    total = max(4 << 20, min(STORE_PROBE_BYTES, free // 4))
    object_bytes = min(STORE_PROBE_OBJECT_BYTES, total)
    count = max(1, total // object_bytes)
    pinned = [RegisteredBuffer(object_bytes) for _ in range(count)] if cuda else []
    buffers = (
        [b.tensor for b in pinned]
        if cuda
        else [torch.empty(object_bytes, dtype=torch.uint8) for _ in range(count)]
    )
    for i, buffer in enumerate(buffers):
        buffer.fill_(i)
    ids = [PROBE_OBJECT_BASE + i for i in range(count)]
    try:
        started = time.perf_counter()
        for handle in [store.put_async(i, b) for i, b in zip(ids, buffers)]:
            handle.wait()
        write = count * object_bytes / (time.perf_counter() - started)
        started = time.perf_counter()
        for handle in [store.get_async(i, b) for i, b in zip(ids, buffers)]:
            handle.wait()
        read = count * object_bytes / (time.perf_counter() - started)
    finally:
        for object_id in ids:
            store.delete(object_id)
        for buffer in pinned:  # every transfer was waited for
            buffer.release()
    return write, read


def cache_path(store: Any) -> str:
    """The store's measurement cache: beside its first device file, else ~/.cache/teraio."""
    info = store.info()
    name = f".teraio-machine-{info['uuid']}.json"
    first = info["devices"][0]
    if not first.get("is_block_device"):
        directory = os.path.dirname(os.path.abspath(first["path"]))
        if os.access(directory, os.W_OK):
            return os.path.join(directory, name)
    return os.path.join(os.path.expanduser("~"), ".cache", "teraio", name)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "cpu"


class _GroupProbe:
    """Whether the ranks of a process group probe, and their barriers (see the module docstring);
    one process (no group, or a group of one): no collective at all."""

    def __init__(self) -> None:
        dist = torch.distributed
        self.ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def suffix(self) -> str:
        """The cache key's suffix: figures measured by this many ranks at once."""
        return "" if self.ranks == 1 else f" x{self.ranks} ranks"

    def agree(self, needs: tuple[bool, bool]) -> tuple[bool, bool]:
        """(link, store): whether any rank needs that probe (then every rank runs it)."""
        if self.ranks == 1:
            return needs
        gathered: list[Any] = [None] * self.ranks
        torch.distributed.all_gather_object(gathered, needs)
        return any(g[0] for g in gathered), any(g[1] for g in gathered)

    def barrier(self) -> None:
        if self.ranks > 1:
            torch.distributed.barrier()


def resolve_bandwidths(
    device: torch.device,
    store: Any,
    *,
    want_link: bool,
    want_store: bool,
    link_probe: Optional[Callable[[torch.device], tuple[float, float, float]]] = None,
    store_probe: Optional[Callable[[Any, bool], tuple[float, float]]] = None,
) -> Measured:
    """The link's and the store's bandwidth: from the store's cache where it has them, else
    measured (and cached with the store). Without a store the link is measured each time.
    Under a process group the ranks measure together (the module docstring says why)."""
    link_probe = link_probe or measure_link
    store_probe = store_probe or measure_store
    measured = Measured()
    want_store = want_store and store is not None
    if not want_link and not want_store:
        return measured
    cache: dict[str, Any] = {}
    path = cache_path(store) if store is not None else None
    if path is not None and os.path.exists(path):
        try:
            with open(path) as f:
                cache = json.load(f)
        except (OSError, ValueError):
            cache = {}
    group = _GroupProbe()
    links = cache.setdefault("links", {})
    link_key = _device_name(device) + group.suffix
    write_key, read_key = "ssd_write" + group.suffix, "ssd_read" + group.suffix
    # A link cached before the duplex figure was measured is measured again.
    link_cached = "duplex" in links.get(link_key, {})
    probe_link, probe_store = group.agree(
        (want_link and not link_cached, want_store and write_key not in cache)
    )
    sources = []
    if want_link:
        if probe_link:
            group.barrier()
            d2h, h2d, duplex = link_probe(device)
            links[link_key] = {"d2h": d2h, "h2d": h2d, "duplex": duplex}
            sources.append("link measured" + group.suffix)
        else:
            sources.append("link cached")
        figures = links[link_key]
        measured.link_d2h, measured.link_h2d = float(figures["d2h"]), float(figures["h2d"])
        measured.link_duplex = float(figures["duplex"])
    if want_store:
        if probe_store:
            group.barrier()
            cache[write_key], cache[read_key] = store_probe(store, device.type == "cuda")
            sources.append("store measured" + group.suffix)
        else:
            sources.append("store cached")
        measured.ssd_write, measured.ssd_read = float(cache[write_key]), float(cache[read_key])
    if (probe_link or probe_store) and path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            json.dump(cache, f)
        os.replace(temporary, path)
    measured.source = ", ".join(sources) + (f" ({path})" if path else "")
    return measured


def resolve_link(device: torch.device, store: Any, options: Any, notes: dict[str, Any]) -> Link:
    """The bandwidths a runtime plans with: `options`' (an `OffloadOptions`) where given, else
    `PLAN_SHARE` of the measured (or cached) ones; `notes` (the report's machine notes) get
    where they came from and the figures."""

    def given(value: Any, default: float = 1.0) -> float:
        return default if value in (None, "auto") else float(parse_bandwidth(value))

    want = options.host_link_bandwidth == "auto"
    want_store = store is not None and "auto" in (options.ssd_bandwidth, options.ssd_write_bandwidth)
    measured = resolve_bandwidths(device, store, want_link=want, want_store=want_store)
    notes["measured"] = measured.source
    if want:
        assert measured.link_d2h is not None and measured.link_h2d is not None
        assert measured.link_duplex is not None
        d2h, h2d = PLAN_SHARE * measured.link_d2h, PLAN_SHARE * measured.link_h2d
        duplex: Optional[float] = PLAN_SHARE * measured.link_duplex
    else:
        d2h = h2d = given(options.host_link_bandwidth)
        duplex = None
    ssd_read = ssd_write = 1.0
    shared = bool(options.ssd_shared) if options.ssd_shared is not None else measured.ssd_read is not None
    if store is not None:
        ssd_read = (
            PLAN_SHARE * measured.ssd_read if measured.ssd_read else given(options.ssd_bandwidth, 6.5e9)
        )
        write = options.ssd_write_bandwidth
        ssd_write = (
            PLAN_SHARE * measured.ssd_write
            if measured.ssd_write
            else given(write or options.ssd_bandwidth, 6.5e9)
        )
    notes.update(
        {
            "link_d2h_bytes_per_s": d2h,
            "link_h2d_bytes_per_s": h2d,
            "link_duplex_bytes_per_s": duplex,
            "ssd_read_bytes_per_s": ssd_read,
        }
    )
    return Link(d2h, h2d, ssd_read, ssd_write, shared, duplex)
