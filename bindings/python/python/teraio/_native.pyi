"""Type stubs of `teraio._native` (the Rust extension; src/lib.rs)."""

from typing import Any, Optional, Sequence, Union

TRACE_FORMAT_VERSION: int
#: The store options `Store.create`/`Store.open` take, one dict each: name, stage ("format" or
#: "open"), type, accepts_size_text, optional, default, c_field (its C API field or None), doc.
STORE_OPTIONS: tuple[dict[str, Any], ...]

class TeraioError(Exception): ...
class NotFoundError(TeraioError): ...
class NoSpaceError(TeraioError): ...
class CorruptError(TeraioError): ...
class LockedError(TeraioError): ...
class ClosedError(TeraioError): ...
class DeviceError(TeraioError): ...
class InvalidArgumentError(TeraioError): ...
class PlannerError(TeraioError): ...

class Handle:
    def wait(self, timeout_s: Optional[float] = None) -> bool: ...
    def is_done(self) -> bool: ...
    def enqueue_stream_wait(self, stream: int) -> None: ...
    @property
    def object_len_bytes(self) -> Optional[int]: ...

class CpuAdamW:
    def __init__(self, threads: int) -> None: ...
    @property
    def threads(self) -> int: ...
    def step(
        self,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        decoupled: bool,
        maximize: bool,
        tensors: Sequence[tuple[int, int, bool, int, int, Optional[int], int, float]],
        grad_scale: Optional[float] = None,
        vector_width: int = 8,
    ) -> None: ...

class Store:
    # The store options (STORE_OPTIONS, the engine's table) as keyword arguments;
    # tests/test_store_options.py checks these signatures against the table.
    @staticmethod
    def create(
        paths: Sequence[str],
        *,
        file_size_bytes: Optional[Union[int, float, str]] = None,
        stripe_unit_bytes: Union[int, float, str] = 1048576,
        block_size: Union[int, float, str] = 4096,
        checksums: bool = True,
        force: bool = False,
        max_meta_bytes: Union[int, float, str] = 4096,
        checkpoint_slot_bytes: Optional[Union[int, float, str]] = None,
        journal_bytes: Optional[Union[int, float, str]] = None,
        durable: bool = True,
        direct_io: bool = True,
        queue_depth: int = 32,
        backend: str = "auto",
        max_inflight_bytes: Union[int, float, str] = 1073741824,
        max_io_bytes: Union[int, float, str] = 4194304,
        bounce_pool_bytes: Union[int, float, str] = 67108864,
        verify_checksums: bool = True,
        lock_wait_ms: int = 2000,
        emulate: Optional[str] = None,
        gpu: str = "auto",
    ) -> Store: ...
    @staticmethod
    def open(
        paths: Sequence[str],
        *,
        durable: bool = True,
        direct_io: bool = True,
        queue_depth: int = 32,
        backend: str = "auto",
        max_inflight_bytes: Union[int, float, str] = 1073741824,
        max_io_bytes: Union[int, float, str] = 4194304,
        bounce_pool_bytes: Union[int, float, str] = 67108864,
        verify_checksums: bool = True,
        lock_wait_ms: int = 2000,
        emulate: Optional[str] = None,
        gpu: str = "auto",
    ) -> Store: ...
    # Takes the same keyword arguments as `open`.
    @staticmethod
    def open_read_only(paths: Sequence[str], **options: Any) -> Store: ...
    def put_address(
        self,
        id: int,
        address: int,
        length: int,
        owner: Any,
        meta: Optional[bytes] = None,
        urgent: bool = False,
    ) -> Handle: ...
    def get_address(
        self,
        id: int,
        address: int,
        length: int,
        owner: Any,
        offset: int = 0,
        whole: bool = True,
        urgent: bool = False,
    ) -> Handle: ...
    def put_device(
        self,
        id: int,
        address: int,
        length: int,
        device: int,
        owner: Any,
        meta: Optional[bytes] = None,
        urgent: bool = False,
        after: Optional[int] = None,
    ) -> Handle: ...
    def get_device(
        self,
        id: int,
        address: int,
        length: int,
        device: int,
        owner: Any,
        offset: int = 0,
        whole: bool = True,
        urgent: bool = False,
        after: Optional[int] = None,
    ) -> Handle: ...
    def gpu_report(self) -> Optional[str]: ...
    def put_bytes(self, id: int, data: bytes, meta: Optional[bytes] = None) -> None: ...
    def get_bytes(self, id: int) -> bytes: ...
    def delete(self, id: int) -> bool: ...
    def delete_many(self, ids: Sequence[int]) -> list[bool]: ...
    def stat(self, id: int) -> Optional[dict[str, Any]]: ...
    def list(self) -> list[dict[str, Any]]: ...
    def info(self) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
    def stats_text(self) -> str: ...
    def block_size(self) -> int: ...
    def close(self) -> None: ...
    def is_closed(self) -> bool: ...

def gpu_probe() -> str: ...
def plan(
    trace_json: str,
    *,
    gpu_memory_bytes: int,
    ssd_read_bytes_per_s: float,
    ssd_write_bytes_per_s: float,
    host_memory_bytes: int = 0,
    host_link_bytes_per_s: float = 25e9,
    ssd_latency_us: float = 20.0,
    host_latency_us: float = 10.0,
    reserve_bytes: int = 0,
    prefetch_slack: float = 1.0,
    movable_kinds: Optional[list[str]] = None,
    ssd_shared: bool = False,
    ssd_via_host_link: bool = False,
    tier_preference: str = "ssd",
) -> str: ...
def simulate_plan(
    trace_json: str,
    plan_json: str,
    *,
    gpu_memory_bytes: int,
    ssd_read_bytes_per_s: float,
    ssd_write_bytes_per_s: float,
    host_memory_bytes: int = 0,
    host_link_bytes_per_s: float = 25e9,
    ssd_latency_us: float = 20.0,
    host_latency_us: float = 10.0,
    ssd_shared: bool = False,
    ssd_via_host_link: bool = False,
) -> str: ...
def replay_schedule(trace_json: str, schedule_json: str, hardware_json: str) -> str: ...
def validate_trace(trace_json: str) -> None: ...
def parse_size(value: Union[int, float, str]) -> int: ...
def parse_bandwidth(text: str) -> float: ...
