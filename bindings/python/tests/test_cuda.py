"""The same checks on CUDA (run on the GPU machine by benches/torch/run-gpu.sh; skipped elsewhere)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs CUDA", allow_module_level=True)

import teraio  # noqa: E402
from tiny import batches, make, train  # noqa: E402

STEPS = 6
ROWS = 8192
DEVICE = "cuda"


_CUFILE_REFUSED: dict[str, str] = {}


def _path_works(path: str, store_dir: Any) -> None:
    """Skips a cuFile case, saying what the driver said, where this machine's cuFile refuses to
    register the store's files (`cuFileHandleRegister`: CU_FILE_HANDLE_NOT_REGISTERED on the
    GPU machines' disks, where `gpu="auto"` takes the bounce path; docs/cli.md). Probed once,
    on a store of its own; any other failure is the test's."""
    if path != "cufile":
        return
    if "probed" not in _CUFILE_REFUSED:
        _CUFILE_REFUSED["probed"] = ""
        probe = store_dir / "cufile-probe"
        probe.mkdir()
        with teraio.Store.create(
            [probe / "dev0"], file_size_bytes=64 << 20, durable=False, gpu="cufile"
        ) as store:
            try:
                store.put(1, torch.ones(4096, dtype=torch.uint8, device=DEVICE))
            except teraio.TeraioError as error:
                if "cuFileHandleRegister" not in str(error):
                    raise
                _CUFILE_REFUSED["probed"] = str(error)
    if _CUFILE_REFUSED["probed"]:
        pytest.skip(f"cuFile refuses this machine's store files: {_CUFILE_REFUSED['probed']}")


def test_store_round_trips_cuda_tensors(store: teraio.Store) -> None:
    src = torch.randn(3, 1 << 18, device=DEVICE)
    store.put(1, src)
    dst = torch.empty_like(src)
    store.get_async(1, dst).wait()
    assert torch.equal(dst, src)
    pinned = torch.empty(3 << 18, dtype=torch.float32, pin_memory=True)
    store.get(1, pinned)
    assert torch.equal(pinned.view(3, -1).to(DEVICE), src)


@pytest.mark.parametrize("path", ["bounce", "cufile"])
def test_cuda_tensors_take_the_engine_gpu_path(path: str, store_dir: Any) -> None:
    _path_works(path, store_dir)
    store = teraio.Store.create(
        [store_dir / "dev0", store_dir / "dev1"], file_size_bytes=256 << 20, durable=False, gpu=path
    )
    with store:
        # Odd lengths (a partial last block) and a tensor at an unaligned device address.
        src = torch.randn(1_000_003, device=DEVICE)
        store.put(7, src)
        report = store.gpu_report()
        assert report is not None and report.startswith(path), report
        dst = torch.full_like(src, float("nan"))
        store.get(7, dst)
        assert torch.equal(dst, src)
        offset = torch.arange(4097, dtype=torch.uint8, device=DEVICE)[1:]
        store.put(8, offset)
        back = torch.zeros(4097, dtype=torch.uint8, device=DEVICE)[1:]
        store.get(8, back)
        assert torch.equal(back, offset)
        with pytest.raises(teraio.InvalidArgumentError):
            store.get(7, torch.empty(10, device=DEVICE))


class _HeldStream:
    """A CUDA stream held on a flag in pinned host memory (`cuStreamWaitValue32` on memory
    registered as the engine registers its hand-off flags): work queued on it runs only once
    `release()` is called, so the ordering checks below hold whatever the timing. Allocate
    before holding: nothing that synchronizes the device may run while the stream is held."""

    def __init__(self) -> None:
        import ctypes
        import mmap

        self._cuda = cuda = ctypes.CDLL("libcuda.so.1")
        self._page = mmap.mmap(-1, mmap.PAGESIZE)
        self.flag = ctypes.c_uint32.from_buffer(self._page)
        self._address = ctypes.addressof(self.flag)
        # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
        result = cuda.cuMemHostRegister_v2(
            ctypes.c_void_p(self._address), ctypes.c_size_t(mmap.PAGESIZE), 0x3
        )
        assert result == 0, f"cuMemHostRegister failed: CUresult {result}"
        device_address = ctypes.c_uint64(0)
        result = cuda.cuMemHostGetDevicePointer_v2(
            ctypes.byref(device_address), ctypes.c_void_p(self._address), ctypes.c_uint(0)
        )
        assert result == 0, f"cuMemHostGetDevicePointer failed: CUresult {result}"
        self.stream = torch.cuda.Stream(DEVICE)
        wait = cuda.cuStreamWaitValue32_v2
        wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        wait.restype = ctypes.c_int
        # Flags 0: CU_STREAM_WAIT_VALUE_GEQ.
        result = wait(self.stream.cuda_stream, device_address.value, 1, 0)
        assert result == 0, f"cuStreamWaitValue32 failed: CUresult {result}"

    def release(self) -> None:
        import ctypes

        self.flag.value = 1
        self.stream.synchronize()
        self._cuda.cuMemHostUnregister(ctypes.c_void_p(self._address))
        del self.flag  # the buffer's export, before the page can be closed
        self._page.close()


def _gpu_store(store_dir: Any, path: str) -> teraio.Store:
    store = teraio.Store.create([store_dir / "dev0"], file_size_bytes=256 << 20, durable=False, gpu=path)
    # The first GPU op sets up the GPU path (pinning, streams): done here, before a stream is held.
    store.put(99, torch.ones(4096, dtype=torch.uint8, device=DEVICE))
    return store


@pytest.mark.parametrize("path", ["bounce", "cufile"])
def test_a_put_after_an_event_stores_the_bytes_written_before_the_event(path: str, store_dir: Any) -> None:
    _path_works(path, store_dir)
    with _gpu_store(store_dir, path) as store:
        n = (6 << 20) + 123
        src = torch.zeros(n, dtype=torch.uint8, device=DEVICE)
        final = torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEVICE)
        back = torch.empty_like(src)
        torch.cuda.synchronize()
        held = _HeldStream()
        try:
            with torch.cuda.stream(held.stream):
                src.copy_(final)  # still to run when the put is called
                event = torch.cuda.Event()
                event.record()
            handle = store.put_async(3, src, after=event)
            event.record(torch.cuda.current_stream())  # the put took the event as it was at the call
            assert not handle.is_done(), "the put finished before the work it was to follow"
        finally:
            held.release()
        assert handle.wait(timeout_s=120.0) is True
        store.get(3, back)
        assert torch.equal(back, final)


@pytest.mark.parametrize("path", ["bounce", "cufile"])
def test_a_get_after_an_event_lands_after_the_work_before_the_event(path: str, store_dir: Any) -> None:
    _path_works(path, store_dir)
    with _gpu_store(store_dir, path) as store:
        data = torch.randint(0, 256, ((6 << 20) + 77,), dtype=torch.uint8, device=DEVICE)
        store.put(4, data)
        out = torch.zeros_like(data)
        torch.cuda.synchronize()
        held = _HeldStream()
        try:
            with torch.cuda.stream(held.stream):
                out.fill_(0xEE)  # a last use of the target, still to run when the get is called
                event = torch.cuda.Event()
                event.record()
            handle = store.get_async(4, out, after=event)
            assert not handle.is_done(), "the get finished before the work it was to follow"
        finally:
            held.release()
        assert handle.wait(timeout_s=120.0) is True
        assert torch.equal(out, data)


@pytest.mark.parametrize("path", ["bounce", "cufile"])
def test_a_kernel_after_a_get_with_a_stream_sees_the_data(path: str, store_dir: Any) -> None:
    _path_works(path, store_dir)
    with _gpu_store(store_dir, path) as store:
        data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device=DEVICE)
        store.put(5, data)
        out = torch.zeros_like(data)
        side = torch.cuda.Stream(DEVICE)
        torch.cuda.synchronize()
        handle = store.get_async(5, out, stream=side)
        with torch.cuda.stream(side):
            seen = out.clone()  # queued at once: it runs only after the get, on the GPU
        side.synchronize()
        assert handle.wait() is True
        assert torch.equal(seen, data)
        # A later stream wait on a finished get passes at once; a host op's handle refuses one.
        handle.enqueue_stream_wait(side)
        with pytest.raises(teraio.InvalidArgumentError, match="host op"):
            store.put_async(6, b"host").enqueue_stream_wait(side)


def _reference() -> tuple[list[float], dict[str, Any], int]:
    model, optimizer = make(device=DEVICE)
    data = batches(STEPS, rows=ROWS, device=DEVICE)
    losses = train(model, optimizer, data[:2])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses += train(model, optimizer, data[2:])
    peak = torch.cuda.max_memory_allocated()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, peak


def _peak_and_activations() -> tuple[int, int]:
    model, optimizer = make(device=DEVICE)
    data = batches(2, rows=ROWS, device=DEVICE)
    train(model, optimizer, data[:1])
    profiler = teraio.Profiler(model, optimizer)
    with profiler:
        train(model, optimizer, data[1:])
    trace = profiler.trace()
    result = teraio.plan(trace, gpu_memory=1 << 40, ssd_read_bandwidth=1e9)
    activations = sum(t["size_bytes"] for t in trace["tensors"] if t["kind"] == "activation")
    return result["prediction"]["unplanned_peak_bytes"], activations


@pytest.mark.parametrize("parameters", [False, True])
@pytest.mark.parametrize("tier", ["host", "ssd"])
def test_cuda_offload_bitwise_equal(tier: str, parameters: bool, store: teraio.Store) -> None:
    ref_losses, ref_state, ref_peak = _reference()
    peak, activations = _peak_and_activations()
    budget = peak - activations // 2
    model, optimizer = make(device=DEVICE)
    options: dict[str, Any] = {"host_memory": 1 << 30}
    if tier == "ssd":
        options = {"host_memory": 0, "store": store}
    options["offload_parameters"] = parameters
    torch.cuda.synchronize()
    with teraio.offload(
        model, optimizer, gpu_memory=budget, reserve=0, min_bytes=64 << 10, **options, granularity="tensor"
    ) as run:
        losses = train(model, optimizer, batches(STEPS, rows=ROWS, device=DEVICE))
    report = run.report()
    assert losses == ref_losses
    for name, value in ref_state.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert report.plan_summary["fits"] is True
    assert report.bytes_per_iteration["offloaded"][tier] > 0
    assert report.bytes_per_iteration["prefetched"][tier] == report.bytes_per_iteration["offloaded"][tier]
    # The planned steps use less GPU memory than the same steps without offload (measured by
    # PyTorch's allocator; the trace's own peak counts storages only).
    assert report.peak_gpu_bytes is not None and report.peak_gpu_bytes < ref_peak
    if parameters:  # every parameter holds its memory again
        assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    print(f"\n[{tier}, parameters {parameters}] {report}")


@pytest.mark.parametrize("copy_streams", [1, 3])
def test_cuda_prefetch_streams(copy_streams: int) -> None:
    ref_losses, ref_state, _ = _reference()
    peak, activations = _peak_and_activations()
    model, optimizer = make(device=DEVICE)
    with teraio.offload(
        model,
        optimizer,
        gpu_memory=peak - activations // 2,
        host_memory=1 << 30,
        reserve=0,
        min_bytes=64 << 10,
        copy_streams=copy_streams,
        granularity="tensor",
    ) as run:
        losses = train(model, optimizer, batches(STEPS, rows=ROWS, device=DEVICE))
    assert losses == ref_losses
    for name, value in ref_state.items():
        assert torch.equal(model.state_dict()[name], value), name
    per_stream = run.executor.stats.prefetches_per_stream
    assert len(per_stream) == copy_streams
    assert sum(per_stream) == run.executor.stats.prefetches_planned + run.executor.stats.prefetches_on_demand
    # How many streams the copies spread over depends on whether each is done before the next is
    # issued (the GPU's speed): test_offload.py checks the choice of stream with set events.


def test_chunked_copy_on_stream_copies_every_byte() -> None:
    from teraio.runtime.movers.copy import copy_on_stream

    source = torch.randint(0, 256, ((10 << 20) + 5,), dtype=torch.uint8).pin_memory()
    target = torch.empty(source.numel(), dtype=torch.uint8, device=DEVICE)
    stream = torch.cuda.Stream(DEVICE)
    event = copy_on_stream(stream, torch.device(DEVICE), target, source, chunk_bytes=1 << 20)
    event.synchronize()
    assert torch.equal(target.cpu(), source)


def test_host_tier_batches_are_ordered_and_exact() -> None:
    from teraio.runtime.movers.tiers import HostTier

    tier = HostTier(torch.device(DEVICE), 64 << 20)
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEVICE) for n in (4096, 1 << 20, 7)]
    expected = [s.clone() for s in sources]
    with tier.batched():
        writes = [tier.write(i, s) for i, s in enumerate(sources)]
        assert not any(w.done() for w in writes)  # queued: issued when the batch ends
        # A read of a key written in the same batch sees the write.
        first = torch.empty_like(sources[0])
        read_first = tier.read(0, first)
    read_first.join()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(first, expected[0])
    for s in sources:
        s.zero_()  # the host copies were taken before: changing the sources changes nothing
    # Joining inside a batch issues what is queued so far; reads after a new write see it.
    targets = [torch.empty_like(s) for s in expected]
    with tier.batched():
        transfers = [tier.read(i, t) for i, t in enumerate(targets)]
        transfers[1].join()
        assert torch.equal(targets[1], expected[1])
        tier.write(2, sources[2]).join()
        again = torch.empty_like(sources[2])
        tier.read(2, again).join()
    for t in transfers:
        t.join()
    torch.cuda.current_stream().synchronize()
    assert all(torch.equal(t, e) for t, e in zip(targets, expected))
    assert torch.equal(again, torch.zeros_like(again))
    # Compute waits for a read on the GPU: held back on its stream, the copy still lands before
    # compute uses the bytes, for every transfer of the batch that joins.
    now = [expected[0], expected[1], torch.zeros_like(expected[2])]
    for attempt in range(3):
        late = [torch.full_like(e, 7) for e in now]
        with tier.batched():
            with torch.cuda.stream(tier.h2d):
                torch.cuda._sleep(20_000_000)  # ~10 ms on the copy stream before the reads
            reads = [tier.read(i, t) for i, t in enumerate(late)]
        for read in reads:
            read.join()
        sums = [t.sum(dtype=torch.int64) for t in late]  # queued on compute after the joins
        assert [int(x) for x in sums] == [int(e.sum(dtype=torch.int64)) for e in now], attempt
    tier.close()


def _finishes(work: Any, timeout_s: float) -> None:
    """Runs `work` on a daemon thread and fails, instead of hanging, if it has not returned in
    `timeout_s` (a deadlock: the bound is minutes for work of seconds, no speed assertion)."""
    import threading

    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        pytest.fail(f"no progress in {timeout_s:.0f} s: the GPU hand-off deadlocked")
    if errors:
        raise errors[0]


@pytest.mark.parametrize("path", ["bounce", "cufile"])
def test_ssd_tier_hands_events_to_the_engine_and_never_hangs(path: str, store_dir: Any) -> None:
    _path_works(path, store_dir)
    # Whole-model mode's pattern on the default stream: every key is produced by a kernel and
    # written, read back into memory the allocator hands out again, joined (the compute stream
    # waits for the read on the GPU) and used by kernels queued behind that wait, round after
    # round, with the tier's host waits for a key's last write in between. Every transfer is
    # handed a CUDA event (after=), none is polled.
    from teraio.ids import base
    from teraio.runtime.movers.tiers import SsdTier

    store = _gpu_store(store_dir, path)
    handed: list[Any] = []
    start_put, start_get = store.start_put, store.start_get

    def put(*args: Any, **kwargs: Any) -> Any:
        handed.append(kwargs.get("after"))
        return start_put(*args, **kwargs)

    def get(*args: Any, **kwargs: Any) -> Any:
        handed.append(kwargs.get("after"))
        return start_get(*args, **kwargs)

    store.start_put, store.start_get = put, get  # type: ignore[method-assign]
    keys, rounds, n = 6, 8, (1 << 20) + 4099
    seen: list[tuple[int, int, Any]] = []

    def work() -> None:
        tier = SsdTier(torch.device(DEVICE), store, base("model_parameters"))
        for r in range(rounds):
            writes = []
            for k in range(keys):
                source = torch.full((n,), r * keys + k + 1, dtype=torch.uint8, device=DEVICE)
                writes.append((tier.write(k, source), source))
            for k in range(keys):
                target = torch.empty(n, dtype=torch.uint8, device=DEVICE)
                tier.read(k, target).join()
                seen.append((r, k, target.sum(dtype=torch.int64)))  # queued behind the join
                tier.poll()
            for transfer, _ in writes:
                transfer.join()
        torch.cuda.current_stream().synchronize()
        tier.close()

    _finishes(work, 300.0)  # fails first if it hangs: a hung store could not close either
    store.close()
    assert [int(total) for _, _, total in seen] == [(r * keys + k + 1) * n for r, k, _ in seen]
    assert len(handed) == 2 * keys * rounds and all(isinstance(e, torch.cuda.Event) for e in handed)


_README_LIKE = """
import sys, tempfile, torch, teraio
torch.manual_seed(0)
blocks = [torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
          for _ in range(8)]
model = torch.nn.Sequential(*blocks).to("cuda")
optimizer = torch.optim.AdamW(model.parameters())
with tempfile.TemporaryDirectory(dir=sys.argv[1]) as scratch:
    store = teraio.Store.create([f"{scratch}/teraio-0.dev", f"{scratch}/teraio-1.dev"],
                                file_size_bytes=512 << 20, durable=False, gpu=sys.argv[2])
    with teraio.offload(model, optimizer, store=store, gpu_memory="160MiB", host_memory="32MiB") as run:
        for step in range(4):
            loss = model(torch.randn(256, 512, device="cuda")).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    assert sum(run.report().bytes_per_iteration["in"]["ssd"].values()) > 0
    store.close()
"""


@pytest.mark.parametrize("path", ["bounce", "cufile"])
def test_whole_model_mode_over_the_ssd_tier_does_not_hang(path: str, store_dir: Any) -> None:
    _path_works(path, store_dir)
    # README's whole-model example (most of its state on the store), in a process of its own
    # that is killed if it has not finished in minutes: its step once hung in a state write's
    # wait when the SSD tier handed its events to the engine.
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        done = subprocess.run(
            [sys.executable, "-c", _README_LIKE, str(store_dir), path],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"README's whole-model example hung on the {path} path: {e.stdout!r}")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "step 3" in done.stdout


@pytest.mark.parametrize("inputs", ["host", "gpu"])
@pytest.mark.parametrize("step_in_backward", [False, True], ids=["step", "step-in-backward"])
@pytest.mark.parametrize("host_memory", [1 << 30, 0], ids=["host", "ssd"])
def test_whole_model_offload_is_exact_on_cuda(
    store: teraio.Store, host_memory: int, step_in_backward: bool, inputs: str
) -> None:
    # Parameters, gradients and optimizer state stream through pinned host buffers or the
    # engine's GPU path; losses, parameters and state equal training without offload, with the
    # step at optimizer.step() or in backward (run from autograd's device thread), and the
    # checkpointed blocks' inputs in pinned host memory or on the GPU.
    data = batches(STEPS, rows=ROWS, device=DEVICE)
    reference_model, reference_optimizer = make(device=DEVICE)
    reference = train(reference_model, reference_optimizer, data)
    model, optimizer = make(device=DEVICE)
    options = {
        "gpu_memory": 64 << 20,
        "host_memory": host_memory,
        "whole_model": "on",
        "step_in_backward": step_in_backward,
        # The GPU step runs torch's CUDA AdamW: the reference's bits (the CPU step's are torch's
        # CPU AdamW: test_whole_model_update.py, and test_the_step_on_the_cpu_trains_on_cuda).
        "update": "gpu",
        "checkpoint_inputs": inputs,
        "min_bytes": 0,
    }
    with teraio.offload(model, optimizer, store=store, **options, granularity="tensor") as run:
        assert type(run).__name__ == "ModelOffload"
        losses = train(model, optimizer, data)
    assert losses == reference
    for p, q in zip(reference_model.parameters(), model.parameters()):
        assert q.is_cuda and torch.equal(p, q)
        for key, value in reference_optimizer.state[p].items():
            assert torch.equal(value, optimizer.state[q][key]), key
    report = run.report()
    tier = "ssd" if host_memory == 0 else "host"
    assert sum(report.bytes_per_iteration["in"][tier].values()) > 0
    if inputs == "host" and host_memory:
        block_input = ROWS * 64 * 4  # tiny.make: dim 64, fp32
        moved = report.bytes_per_iteration["in"]["host"]["activation"]
        assert moved == (len(model.layers) - 1) * block_input and run.saved_stats.prefetches_on_demand == 0


def test_whole_model_state_too_big_for_the_budget_is_left_in_cpu_memory(store: teraio.Store) -> None:
    data = batches(2, rows=ROWS, device=DEVICE)
    reference_model, reference_optimizer = make(device=DEVICE)
    reference = train(reference_model, reference_optimizer, data)
    model, optimizer = make(device=DEVICE)
    with pytest.warns(UserWarning, match="left in CPU memory"):
        with teraio.offload(
            model,
            optimizer,
            store=store,
            gpu_memory=1 << 20,
            host_memory=1 << 30,
            granularity="tensor",
            update="gpu",  # the reference's arithmetic (CUDA AdamW), so the bits are the same
        ) as run:
            losses = train(model, optimizer, data)
    assert losses == reference and run.report().returned_to == "cpu"
    for p, q in zip(reference_model.parameters(), model.parameters()):
        assert not q.is_cuda and torch.equal(p.cpu(), q)
        for key, value in reference_optimizer.state[p].items():
            assert torch.equal(value.cpu(), optimizer.state[q][key].cpu()), key


def test_the_suggested_batch_fits_the_budget() -> None:
    """Whole-model mode at batch 4 estimates the largest batch its budget holds; a run at that
    batch peaks within the budget but not far below what the estimate calls usable, and the
    estimate from that run agrees within a tenth."""
    from test_whole_model import TiedLM

    budget = 4 << 30
    vocab, seq = 2048, 2048

    def run(batch: int) -> Any:
        torch.manual_seed(0)
        model = TiedLM(vocab=vocab, dim=256, layers=4).to(DEVICE)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1)
        options = {"gpu_memory": budget, "host_memory": 1 << 30, "whole_model": "on", "update": "gpu"}
        with teraio.offload(model, optimizer, **options) as session:
            for _ in range(4):
                tokens = torch.randint(0, vocab, (batch, seq), generator=generator).to(DEVICE)
                model(tokens).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            largest = session.suggest_batch()
        return largest, session.report()

    largest, report = run(4)
    assert report.batch == 4 and report.largest_batch == largest
    # Each sequence's fp32 logits and their gradients take tens of MiB; the budget holds several.
    assert largest > 4, str(report)
    again, at_largest = run(largest)
    usable = budget - (512 << 20)  # no split blocks with expandable segments: the margin alone
    assert 0.8 * usable <= at_largest.peak_gpu_bytes <= budget, str(at_largest)
    assert abs(again - largest) <= max(1, largest // 10), (again, largest)


@pytest.mark.parametrize("host_memory", [1 << 30, 0], ids=["host", "ssd"])
@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one-micro-batch", "accumulated"])
def test_whole_model_gradient_clipping_is_exact_on_cuda(
    store: teraio.Store, micro_batches: int, host_memory: int
) -> None:
    # The GPU step: the norm and the update are the reference's CUDA arithmetic. With two
    # distinct micro-batches a step, the second adds each gradient to its held sum on the GPU,
    # read back ahead of its unit's backward from host memory or the store. Losses, norms,
    # parameters and state are the loop's without offload.
    data = batches(3 * micro_batches, rows=ROWS, device=DEVICE)
    steps = [data[i : i + micro_batches] for i in range(0, len(data), micro_batches)]

    def clipped(model: Any, optimizer: Any) -> tuple[list[float], list[Any]]:
        losses, norms = [], []
        for micro in steps:
            for x in micro:
                loss = model(x)
                (loss / micro_batches).backward()
                losses.append(loss.item())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return losses, norms

    reference_model, reference_optimizer = make(device=DEVICE)
    reference, reference_norms = clipped(reference_model, reference_optimizer)
    model, optimizer = make(device=DEVICE)
    options = {"gpu_memory": 64 << 20, "host_memory": host_memory, "whole_model": "on", "update": "gpu"}
    with teraio.offload(model, optimizer, store=store, **options, granularity="tensor"):
        losses, norms = clipped(model, optimizer)
    assert losses == reference
    assert all(torch.equal(a, b) for a, b in zip(reference_norms, norms))
    for p, q in zip(reference_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
        for key, value in reference_optimizer.state[p].items():
            assert torch.equal(value, optimizer.state[q][key]), key


def test_the_step_on_the_cpu_trains_on_cuda(store: teraio.Store) -> None:
    """update="cpu": gradients go to pinned host memory and torch's CPU AdamW updates the fp32
    masters there; its arithmetic is not CUDA's, so losses and parameters agree with the
    reference to rounding, not bitwise, and the state is back on the GPU after the session."""
    data = batches(STEPS, rows=ROWS, device=DEVICE)
    reference_model, reference_optimizer = make(device=DEVICE)
    reference = train(reference_model, reference_optimizer, data)
    model, optimizer = make(device=DEVICE)
    options = {"gpu_memory": 64 << 20, "host_memory": 1 << 30, "whole_model": "on", "update": "cpu"}
    with teraio.offload(model, optimizer, store=store, **options, granularity="tensor") as run:
        losses = train(model, optimizer, data)
    assert run.report().update == "cpu"
    assert losses == pytest.approx(reference, rel=1e-4)
    for p, q in zip(reference_model.parameters(), model.parameters()):
        assert q.is_cuda and torch.allclose(p, q, rtol=1e-3, atol=1e-5)
        for key, value in reference_optimizer.state[p].items():
            assert optimizer.state[q][key].device == value.device, key


@pytest.mark.parametrize("share", [0.5, 1.0, "auto"])
def test_whole_model_gpu_step_share_on_cuda(store: teraio.Store, share: Any) -> None:
    """gpu_step_share: at optimizer.step() of a loop that clips and accumulates, the units the
    next forward pass enters last are updated by torch's fused CUDA AdamW, their masters,
    gradients and moments read from pinned host memory and written back, while the worker
    updates the rest. CUDA's rounding is not the CPU kernel's: losses and parameters agree
    with the reference to rounding; the state is back on the GPU after the session."""
    data = batches(2 * STEPS, rows=ROWS, device=DEVICE)

    def loop(model: Any, optimizer: Any) -> list[float]:
        losses = []
        for first, second in zip(data[::2], data[1::2]):
            for x in (first, second):
                loss = model(x)
                (loss / 2).backward()
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return losses

    from teraio.runtime.modes.whole_model import SHARE_FROM_STEP

    reference_model, reference_optimizer = make(device=DEVICE)
    reference = loop(reference_model, reference_optimizer)
    model, optimizer = make(device=DEVICE)
    options = {"gpu_memory": 64 << 20, "host_memory": 1 << 30, "whole_model": "on", "update": "cpu"}
    with teraio.offload(
        model, optimizer, store=store, **options, gpu_step_share=share, granularity="tensor"
    ) as run:
        losses = loop(model, optimizer)
    report = run.report()
    shared = report.gpu_step_share_elements_by_iteration
    assert report.update == "cpu" and len(shared) == STEPS and not any(shared[:SHARE_FROM_STEP])
    if share != "auto":
        total = sum(p.numel() for p in model.parameters())
        assert all(0 < n <= share * total for n in shared[SHARE_FROM_STEP:]), shared
    assert losses == pytest.approx(reference, rel=1e-4)
    for p, q in zip(reference_model.parameters(), model.parameters()):
        assert q.is_cuda and torch.allclose(p, q, rtol=1e-3, atol=1e-5)
        for key, value in reference_optimizer.state[p].items():
            assert optimizer.state[q][key].device == value.device, key


def test_the_cpu_step_in_backward_is_the_cpu_step_on_cuda(store: teraio.Store) -> None:
    """update="cpu" with step_in_backward: each unit's update waits on the worker for its
    gradients' copies (CUDA events) and runs beside backward; the arithmetic is the CPU step's
    at optimizer.step(), bit for bit. "auto" turns it on from the third iteration of this loop
    (no clip, no accumulation)."""
    data = batches(STEPS, rows=ROWS, device=DEVICE)
    results = []
    for step_in_backward in (False, True, "auto"):
        model, optimizer = make(device=DEVICE)
        options = {"gpu_memory": 64 << 20, "host_memory": 1 << 30, "whole_model": "on", "update": "cpu"}
        with teraio.offload(
            model, optimizer, store=store, **options, step_in_backward=step_in_backward, granularity="tensor"
        ) as run:
            losses = train(model, optimizer, data)
        report = run.report()
        assert report.update == "cpu" and report.step_in_backward == (step_in_backward is not False)
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses, params), *in_backward = results
    for losses_in_backward, params_in_backward in in_backward:
        assert losses_in_backward == losses
        for p, q in zip(params, params_in_backward, strict=True):
            assert torch.equal(p, q)


@pytest.mark.parametrize("action", ["keep", "host", "recompute", None])
def test_block_plan_is_exact_on_cuda(monkeypatch: Any, action: Any) -> None:
    """Each block action on CUDA (forced, so that each runs: copies on their streams, prefetches
    from the gradient hooks, checkpointing), and the plan chosen for a tight budget (None)."""
    from teraio.runtime.modes.block import BlockOffload

    # 3 measuring, 2 + 4 + 2 in the trial, 2 after.
    data = batches(BlockOffload.MEASURING_STEPS + 2 * BlockOffload.TRIAL_STEPS + 2, rows=8192, device=DEVICE)
    model, optimizer = make(device=DEVICE, layers=6, hidden=1024)
    reference = train(model, optimizer, data)
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    if action is not None:
        from test_blockwise import _force, _trial_goes_to

        _force(monkeypatch, action)
        _trial_goes_to(monkeypatch, "plan")
    model, optimizer = make(device=DEVICE, layers=6, hidden=1024)
    weights = sum(p.numel() * 4 for p in model.parameters())
    # None: what recomputing every block peaks at (~200 MiB) and room for about half the blocks.
    budget = "8GiB" if action is not None else 4 * weights + (384 << 20)
    run = teraio.offload(model, optimizer, gpu_memory=budget, min_bytes=0, whole_model="off", reserve="32MiB")
    assert isinstance(run, BlockOffload)
    with run:
        losses = train(model, optimizer, data)
    assert losses == reference
    for key, value in ref_state.items():
        assert torch.equal(model.state_dict()[key], value), key
    report = run.report()
    if action is not None:
        assert set(report.actions.values()) == {action}
    if action == "host":
        assert report.bytes_per_iteration["offloaded"]["host"] > 0


@pytest.mark.parametrize("divisor", [None, 8171, "tensor"])
@pytest.mark.parametrize("scale", [1.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loss_head_is_the_same_bits_as_torchs_on_cuda(dtype: Any, scale: float, divisor: Any) -> None:
    """A Qwen2-sized vocabulary over 1000 rows, in 5 chunks: the same kernels per row as
    `cross_entropy`, so the same bits (the reductions run over the same values in both), with
    the gradient computed in forward (`loss.backward()`) and in backward (a scaled loss); and
    the sum divided by a count as Hugging Face divides by `num_items_in_batch` (a Python int,
    which CUDA divides by as a reciprocal, and a tensor on the device)."""
    from teraio import head

    vocab = 151936
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(1000, vocab, device=DEVICE, generator=generator) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (1000,), device=DEVICE, generator=generator)
    target[10:30] = -100
    if divisor == "tensor":
        divisor = torch.tensor(8171, device=DEVICE)
    reduction = "mean" if divisor is None else "sum"
    expected = torch.nn.functional.cross_entropy(logits.float(), target, reduction=reduction)
    if divisor is not None:
        expected = expected / divisor
    (expected_grad,) = torch.autograd.grad(expected * scale if scale != 1.0 else expected, logits)
    state = head.HeadState()
    loss = head.cross_entropy(
        logits, target, chunk_bytes=vocab * 4 * 200, reduction=reduction, divisor=divisor, state=state
    )
    (grad,) = torch.autograd.grad(loss * scale if scale != 1.0 else loss, logits)
    assert state.gradient_in_forward == (scale == 1.0)
    assert torch.equal(loss, expected)
    assert torch.equal(grad, expected_grad)


def test_registered_buffers_pin_exactly_their_bytes_and_give_them_back() -> None:
    from teraio.pinned import PAGE_BYTES, RegisteredBuffer

    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    sizes = [1, PAGE_BYTES - 1, 9 << 20, 37_748_736]  # a 3072 x 3072 fp32 weight is 36 MiB
    buffers = [RegisteredBuffer(n) for n in sizes]
    assert [b.tensor.numel() for b in buffers] == sizes
    # Not from torch's pinned allocator (which rounds up to a power of two and keeps blocks).
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    source = torch.arange(sizes[-1], dtype=torch.uint8, device=DEVICE)
    buffers[-1].tensor.copy_(source, non_blocking=True)
    back = torch.empty_like(source)
    back.copy_(buffers[-1].tensor, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source)
    for buffer in buffers:
        buffer.release()
        buffer.release()  # once only
        assert buffer.tensor.numel() == 0


def test_a_refused_registration_leaves_no_error_behind() -> None:
    """torch's cudaHostRegister binding returns CUDA's error and leaves it as the last error,
    which torch's next kernel launch check would raise as its own; the runtime takes it back."""
    from teraio.pinned import PAGE_BYTES, RegisteredBuffer, _take_last_cuda_error

    buffer = RegisteredBuffer(PAGE_BYTES)
    cudart = torch.cuda.cudart()
    # Its page is registered already: CUDA refuses it again, which also shows it is page-locked.
    assert cudart.cudaHostRegister(buffer.tensor.data_ptr(), PAGE_BYTES, 0) != cudart.cudaError.success
    _take_last_cuda_error()
    assert int(torch.arange(4, device=DEVICE).sum()) == 6  # a kernel launch check sees no error
    buffer.release()


@pytest.mark.filterwarnings("ignore:teraio.offload \\(whole-model\\). the model's parameters")
@pytest.mark.parametrize("gpu_memory", [4096, 64 << 20], ids=["streamed", "kept-resident"])
def test_compute_copies_are_bitwise_on_cuda(gpu_memory: int) -> None:
    """update="cpu" under CUDA bf16 autocast: the Linear layers' bf16 compute copies and bf16
    gradients (`compute_copies="on"`) against the same step with fp32 on the link: the same
    bf16 inputs reach the same kernels, and the host widens the gradients autograd would have
    widened, with accumulation and clipping; a budget with room keeps copies resident on the GPU."""
    from test_whole_model_copies import STEPS as COPY_STEPS
    from test_whole_model_copies import UntiedLM, _tokens

    def run(copies: str) -> tuple[list[float], list[Any], list[Any], Any]:
        torch.manual_seed(0)
        model = UntiedLM().to(DEVICE)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        options = {"gpu_memory": gpu_memory, "host_memory": 1 << 30, "whole_model": "on", "update": "cpu"}
        losses = []
        with teraio.offload(model, optimizer, **options, compute_copies=copies) as session:
            for x in _tokens(COPY_STEPS):
                for _ in range(2):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(x.to(DEVICE))
                    (loss / 2).backward()
                    losses.append(loss.item())
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        states = [v for p in model.parameters() for v in optimizer.state[p].values()]
        return losses, [p.detach().clone() for p in model.parameters()], states, session.report()

    copied, plain = run("on"), run("off")
    assert copied[3].compute_copies == "bfloat16" and plain[3].compute_copies == "off"
    assert copied[0] == plain[0]
    # (The 4 KiB budget leaves the state in CPU memory at exit, with a warning; both runs alike.)
    for p, q in zip(plain[1], copied[1], strict=True):
        assert q.device == p.device and q.dtype == torch.float32 and torch.equal(p, q)
    for a, b in zip(plain[2], copied[2], strict=True):
        assert torch.equal(a, b)
    moved, least = copied[3].bytes_per_iteration, copied[3].minimum_bytes_moved
    assert least["out"]["host"]["gradient"] < plain[3].minimum_bytes_moved["out"]["host"]["gradient"]
    assert moved["out"]["host"]["gradient"] < plain[3].bytes_per_iteration["out"]["host"]["gradient"]
