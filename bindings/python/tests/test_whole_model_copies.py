"""Whole-model mode's compute copies (`compute_copies="on"`, with the CPU step) under CPU bf16
autocast: bf16 copies of the Linear layers' parameters cross the link and their bf16 gradients
come back, bitwise against the same loop without offload; the bytes reported are the bytes moved."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any, Optional

import pytest
import teraio
import torch
from cpu_step import assert_cpu_step_predicted
from teraio.runtime.modes.whole_model import SHARE_FROM_STEP, ModelOffload, balanced_share
from teraio.runtime.movers import tiers
from teraio.runtime.movers.tiers import HostTier
from teraio.runtime.plans import capacity as cp
from test_whole_model import TiedLM, _tokens
from tiny import train_steps

STEPS = 4
VOCAB = 96
DIM = 32


class UntiedLM(torch.nn.Module):
    """Embedding, blocks of LayerNorm + Linear + GELU, and a head of its own."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(
            [
                torch.nn.Sequential(torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, DIM), torch.nn.GELU())
                for _ in range(layers)
            ]
        )
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


class LoraLinear(torch.nn.Module):
    """A frozen base Linear plus a trained low-rank update, as LoRA adapters are shaped."""

    def __init__(self, rank: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.Linear(DIM, DIM)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Linear(DIM, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, DIM, bias=False)
        torch.nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + 2.0 * self.lora_b(self.lora_a(x))


class LoraLM(torch.nn.Module):
    """A frozen model (embedding, head) with LoRA-shaped blocks: only the adapters train."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.embed.requires_grad_(False)
        self.layers = torch.nn.ModuleList(
            [
                torch.nn.Sequential(torch.nn.LayerNorm(DIM), LoraLinear(), torch.nn.GELU())
                for _ in range(layers)
            ]
        )
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.head.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).float().flatten(0, 1), tokens.flatten())


def _build(cls: type, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = cls()
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1, fused=True)


#: Trains under CPU bf16 autocast, with a scheduler, optional accumulation and clipping.
_loop = functools.partial(train_steps, autocast=True)


def _train(cls: type, offloaded: bool, options: Optional[dict[str, Any]] = None, **kwargs: Any) -> Any:
    model, optimizer = _build(cls)
    data = _tokens(STEPS)
    if not offloaded:
        return model, optimizer, _loop(model, optimizer, data, **kwargs), None
    settings = {"gpu_memory": 4096, "host_memory": 1 << 30, "update": "cpu", "compute_copies": "on"}
    settings |= options or {}
    with teraio.offload(model, optimizer, **settings) as run:
        assert isinstance(run, ModelOffload)
        losses = _loop(model, optimizer, data, **kwargs)
    return model, optimizer, losses, run


def _assert_bitwise(reference: Any, other: Any) -> None:
    ref_model, ref_opt, ref_losses, _ = reference
    model, optimizer, losses, _ = other
    assert losses == ref_losses
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        assert q.dtype == p.dtype == torch.float32, name
        assert torch.equal(p, q), name
    for p, q in zip(ref_model.parameters(), model.parameters()):
        for key, value in ref_opt.state.get(p, {}).items():
            assert torch.equal(value, optimizer.state[q][key]), key


def _train_steps_of(
    offloaded: bool,
    steps: list[list[torch.Tensor]],
    clip: Optional[float],
    end: str = "step",
    options: Optional[dict[str, Any]] = None,
) -> tuple[torch.nn.Module, list[float]]:
    """Trains `UntiedLM` under CPU bf16 autocast, a step per list of micro-batches (each loss
    divided by their count), clipping if `clip` is given; the last step ends as `end` says:
    "step", "zero_grad" (no step) or "exit" (the session ends after its backward passes).
    Returns the model and the losses, with each clip's total norm."""
    model, optimizer = _build(UntiedLM)
    settings = {"gpu_memory": 4096, "host_memory": 1 << 30, "update": "cpu", "compute_copies": "on"}
    settings |= options or {}
    losses = []
    with teraio.offload(model, optimizer, **settings) if offloaded else contextlib.nullcontext():
        for index, micro_batches in enumerate(steps):
            for x in micro_batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x)
                (loss / len(micro_batches)).backward()
                losses.append(loss.item())
            last = index == len(steps) - 1
            if last and end == "exit":
                break
            if clip is not None:
                losses.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            if not last or end == "step":
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model, losses


def _assert_same_training(reference: tuple[torch.nn.Module, list[float]], other: Any) -> None:
    assert other[1] == reference[1]
    for (name, p), q in zip(reference[0].named_parameters(), other[0].parameters(), strict=True):
        assert torch.equal(p, q), name


def _copied(run: ModelOffload) -> set[str]:
    return {slot.name for slot in run.slots if slot.low is not None}


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"accumulate": 2}, {"clip": 0.05}, {"accumulate": 2, "clip": 0.05}],
    ids=["plain", "accumulated", "clipped", "accumulated-clipped"],
)
def test_copies_are_bitwise_against_training_without_offload(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any]
) -> None:
    # Chunks smaller than the head's 3072 elements, and not dividing them: the host's fold of
    # accumulated bf16 gradients crosses chunk boundaries (`add_widened`).
    monkeypatch.setattr(tiers, "ADD_CHUNK_ELEMENTS", 1000)
    reference = _train(UntiedLM, False, **kwargs)
    result = _train(UntiedLM, True, **kwargs)
    _assert_bitwise(reference, result)
    report = result[3].report()
    assert report.compute_copies == "bfloat16", report.compute_copies_reason
    # Every Linear's weight and bias, nothing else (embedding, layer norms).
    linears = {f"layers.{i}.1.{k}" for i in range(3) for k in ("weight", "bias")} | {
        "head.weight",
        "head.bias",
    }
    assert _copied(result[3]) == linears
    assert report.compute_copy_parameters == len(linears)
    assert "compute copies: bfloat16" in str(report)
    # Each iteration's waits and hooks' time, and the worker's time of each iteration whose
    # updates are done (the last one's run past the loop).
    assert len(report.wait_ms_by_iteration) == report.steps
    assert all(waits["hooks"] > 0 for waits in report.wait_ms_by_iteration)
    assert len(report.cpu_update_ms_by_iteration) == report.steps - 1
    # The copies' bf16 transfers are their parameters' and gradients' in the record.
    assert_cpu_step_predicted(result[3])


def test_the_report_counts_the_allocators_retries_per_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three retries in each iteration after the first (a CPU device has none of its own): the
    # report gives them per iteration and warns, since no other figure shows their waits.
    calls: list[int] = []

    def retries(self: ModelOffload) -> int:
        calls.append(1)
        return 3 * (len(calls) - 1)

    monkeypatch.setattr(ModelOffload, "_allocator_retries", retries)
    report = _train(UntiedLM, True)[3].report()
    monkeypatch.undo()
    assert report.allocator_retries_by_iteration == [0, 3, 3, 3]
    assert any("allocator retried 9 times in iterations 2 to 4" in w for w in report.warnings)
    quiet = _train(UntiedLM, True)[3].report()
    assert quiet.allocator_retries_by_iteration == [0] * STEPS
    assert not any("allocator" in w for w in quiet.warnings)


@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["accumulated", "accumulated-clipped"])
def test_accumulated_gradients_fold_on_the_worker(
    monkeypatch: pytest.MonkeyPatch, clip: Any, micro_batches: int
) -> None:
    # Once the loop has accumulated (the first iteration, before the first step turns the
    # copies on), the last micro-batch's gradients are added to the sums on the device (read
    # back as backward goes), where a clip's norms are taken: the clip reads nothing back. The
    # micro-batches before it are widened into their fp32 buffers by jobs on the CPU step's
    # worker as they arrive, not by the training thread at the next micro-batch or by the
    # update; but a first micro-batch's bf16 gradients that the last one adds to are widened
    # on the device, not on the host at all. The record holds the jobs.
    where: list[str] = []
    widen = ModelOffload._widen
    read_back = 0
    read_gradient = ModelOffload._read_gradient

    def recorded(self: ModelOffload, slot: Any, fold: str) -> None:
        where.append(threading.current_thread().name)
        widen(self, slot, fold)

    def counted(self: ModelOffload, slot: Any) -> torch.Tensor:
        nonlocal read_back
        read_back += 1
        return read_gradient(self, slot)

    monkeypatch.setattr(ModelOffload, "_widen", recorded)
    monkeypatch.setattr(ModelOffload, "_read_gradient", counted)
    reference = _train(UntiedLM, False, accumulate=micro_batches, clip=clip)
    result = _train(UntiedLM, True, accumulate=micro_batches, clip=clip)
    _assert_bitwise(reference, result)
    run = result[3]
    copied = len(_copied(run))
    widened_per_step = 0 if micro_batches == 2 else micro_batches - 1
    assert len(where) == (STEPS - 1) * copied * widened_per_step
    assert all(name.startswith("teraio-cpu-step") for name in where), where
    assert read_back == 0
    record = assert_cpu_step_predicted(run)
    assert any(not job["produces"] for job in record.schedule["cpu_jobs"]) == (widened_per_step > 0)


@pytest.mark.parametrize("end", ["step", "zero_grad", "exit"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["accumulated", "accumulated-clipped"])
def test_a_slow_worker_folds_each_micro_batch(monkeypatch: pytest.MonkeyPatch, clip: Any, end: str) -> None:
    # Distinct micro-batches (their bf16 gradients differ) and a worker that starts each fold
    # late: the next micro-batch's gradient, a clip, the step, a zero_grad() that drops the
    # sums and the session's exit each wait for the folds they follow, so the bits are those
    # of training without offload. The last iteration ends as `end` says.
    run_folds = ModelOffload._run_folds

    def late(self: ModelOffload, *args: Any) -> float:
        time.sleep(0.02)
        return run_folds(self, *args)

    monkeypatch.setattr(ModelOffload, "_run_folds", late)
    data = _tokens(2 * STEPS + 2)
    steps = [data[2 * step : 2 * step + 2] for step in range(STEPS + 1)]
    _assert_same_training(_train_steps_of(False, steps, clip, end), _train_steps_of(True, steps, clip, end))


@pytest.mark.parametrize("pull_forward_bytes", [0, 1 << 20], ids=["unit-by-unit", "ahead"])
def test_the_last_micro_batchs_sums_are_read_ahead(
    monkeypatch: pytest.MonkeyPatch, pull_forward_bytes: int
) -> None:
    # Every held sum of a block the last micro-batch adds to on the device was read before its
    # gradient left (at its unit's entry, or with the units ahead), not when it left; the
    # head, norm and embedding, which backward enters no more, read theirs as they leave. No
    # more than `pull_forward_bytes` of sums beyond the running unit's are in flight.
    ahead: list[bool] = []
    in_flight: list[int] = []
    take = ModelOffload._take_held_sum
    prefetch = ModelOffload._prefetch_ahead

    def taken(self: ModelOffload, slot: Any) -> torch.Tensor:
        if self.steps > 0 and ".layers." in f".{slot.name}":
            ahead.append(slot.incoming_sum is not None)
        return take(self, slot)

    def fetched(self: ModelOffload, current: Any = None) -> None:
        prefetch(self, current)
        mine = set(self.units[current].slots) if current is not None else set()
        in_flight.append(
            sum(
                s.incoming_sum[0].nbytes
                for s in self.slots
                if s.incoming_sum is not None and s.index not in mine
            )
        )

    monkeypatch.setattr(ModelOffload, "_take_held_sum", taken)
    monkeypatch.setattr(ModelOffload, "_prefetch_ahead", fetched)
    _train(UntiedLM, True, {"pull_forward_bytes": pull_forward_bytes}, accumulate=2)
    assert ahead and all(ahead)
    largest = max(s.numel() * 4 for s in UntiedLM().parameters())
    assert max(in_flight) <= max(pull_forward_bytes, largest)
    assert (max(in_flight) > 0) == (pull_forward_bytes > 0)


def test_the_read_ahead_counts_the_copies_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # `pull_forward_bytes` bounds GPU memory: the parameters read ahead count in the dtype they
    # cross the link and occupy the GPU in, bf16 for a compute copy, so the horizon holds twice
    # as many copied parameters as their fp32 masters' bytes would allow.
    budget = 6 << 10
    horizons: list[tuple[int, int, int]] = []
    horizon = ModelOffload._horizon

    def seen(self: ModelOffload) -> list[list[Any]]:
        units = horizon(self)
        slots = [slot for unit in units for slot in unit]
        if self.compute_copies is not None and len(slots) > 1:
            gpu = sum(slot.param.numel() * slot.param.element_size() for slot in slots)
            horizons.append((gpu, sum(slot.full.nbytes for slot in slots), len(slots)))
        return units

    monkeypatch.setattr(ModelOffload, "_horizon", seen)
    _train(UntiedLM, True, {"pull_forward_bytes": budget})
    assert horizons
    assert all(gpu <= budget for gpu, _, _ in horizons), horizons
    assert any(full > budget for _, full, _ in horizons), horizons


@pytest.mark.parametrize("clip", [None, 0.05], ids=["accumulated", "accumulated-clipped"])
def test_steps_of_changing_micro_batch_counts_are_bitwise(clip: Any) -> None:
    # The last micro-batch of a step is expected as the last step's count says:
    # steps of 2, 3, 1, 2 and 3 micro-batches are each one more or fewer than that, so the sum
    # is added on the device before the step's end or not at its end (the clip reads it back).
    counts = [2, 3, 1, 2, 3, 2]
    data = _tokens(sum(counts))
    steps = [data[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
    _assert_same_training(_train_steps_of(False, steps, clip), _train_steps_of(True, steps, clip))


@pytest.mark.parametrize("elements", [1, 999, 1000, 1001, 4321])
def test_the_hosts_fold_adds_as_torch_adds(monkeypatch: pytest.MonkeyPatch, elements: int) -> None:
    # The accumulated gradient's fold: bf16 widened and added in chunks, bitwise torch's
    # mixed-dtype add_, infinities, NaNs and subnormals included.
    monkeypatch.setattr(tiers, "ADD_CHUNK_ELEMENTS", 1000)
    generator = torch.Generator().manual_seed(elements)
    held = torch.randn(elements, generator=generator) * 1e3
    held[::7] = float("inf")
    held[::11] = 1e-40
    values = (torch.randn(elements, generator=generator) * 1e-3).bfloat16()
    values[::13] = float("nan")
    values[::17] = -float("inf")
    expected = held.clone().add_(values)
    tiers.add_widened(held, values)
    assert torch.equal(held.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("kwargs", [{}, {"autocast": False}], ids=["autocast", "fp32"])
def test_copies_with_the_step_in_backward(kwargs: dict[str, Any]) -> None:
    # The step in backward on the CPU: the first step turns the copies on (after the updates
    # queued in backward), later backward passes send bf16 gradients that the worker widens
    # before each unit's update. Without autocast the copies stay off: fp32 as before.
    reference = _train(UntiedLM, False, **kwargs)
    result = _train(UntiedLM, True, options={"step_in_backward": True}, **kwargs)
    _assert_bitwise(reference, result)
    report = result[3].report()
    assert report.step_in_backward and report.update == "cpu"
    assert report.compute_copies == ("off" if kwargs else "bfloat16"), report.compute_copies_reason
    assert_cpu_step_predicted(result[3])


def test_a_tied_head_stays_fp32() -> None:
    reference = _train(TiedLM, False, clip=0.05)
    seen: dict[str, torch.dtype] = {}

    def look(step: int) -> None:
        if step == 1:
            seen.update({name: p.dtype for name, p in result_model.named_parameters()})

    model, optimizer = _build(TiedLM)
    result_model = model
    with teraio.offload(
        model, optimizer, gpu_memory=4096, host_memory=1 << 30, update="cpu", compute_copies="on"
    ) as run:
        losses = _loop(model, optimizer, _tokens(STEPS), clip=0.05, on_step=look)
    _assert_bitwise(reference, (model, optimizer, losses, run))
    # The embedding's weight is the head's: read by the embedding in fp32, it stays fp32.
    assert "embed.weight" not in _copied(run) and _copied(run)
    assert seen["embed.weight"] == torch.float32
    # Inside the session a copied parameter's `.data` is its bf16 copy.
    assert seen["layers.0.1.weight"] == torch.bfloat16


def test_a_frozen_lora_base_is_copied() -> None:
    reference = _train(LoraLM, False, accumulate=2)
    result = _train(LoraLM, True, accumulate=2)
    _assert_bitwise(reference, result)
    run = result[3]
    # The frozen base layers and the head get copies made once; the adapters are updated.
    assert {"layers.0.1.base.weight", "layers.0.1.lora_a.weight", "head.weight"} <= _copied(run)
    assert "embed.weight" not in _copied(run)


def _count_host_copies(monkeypatch: pytest.MonkeyPatch, state: dict[str, Any]) -> dict[int, dict[Any, int]]:
    """Bytes each iteration's host-tier copies moved, by (direction, kind of key)."""
    made: dict[int, dict[Any, int]] = {}
    read, write = HostTier.read, HostTier.write

    def count(direction: str, key: Any, nbytes: int) -> None:
        run = state.get("run")
        if run is not None:
            per = made.setdefault(run.steps, {})
            per[(direction, key[0])] = per.get((direction, key[0]), 0) + nbytes

    def counted_read(self: HostTier, key: Any, target: torch.Tensor) -> Any:
        count("in", key, target.numel())
        return read(self, key, target)

    def counted_write(self: HostTier, key: Any, source: torch.Tensor) -> Any:
        count("out", key, source.numel())
        return write(self, key, source)

    monkeypatch.setattr(HostTier, "read", counted_read)
    monkeypatch.setattr(HostTier, "write", counted_write)
    return made


def _by_base_kind(made: dict[Any, int]) -> dict[tuple[str, str], int]:
    """`_count_host_copies`' bytes of one iteration by (direction, kind), a kind's variants (its
    copies, each optimizer-state tensor) counted as the kind, as the report counts them."""
    merged: dict[tuple[str, str], int] = {}
    for (direction, kind), nbytes in made.items():
        base = kind[0] if isinstance(kind, tuple) else kind
        merged[(direction, base)] = merged.get((direction, base), 0) + nbytes
    return merged


@pytest.mark.parametrize("copies", ["on", "off"])
def test_bytes_are_the_copies_made(monkeypatch: pytest.MonkeyPatch, copies: str) -> None:
    state: dict[str, Any] = {}
    made = _count_host_copies(monkeypatch, state)
    model, optimizer = _build(UntiedLM)
    # No read ahead: a read issued at optimizer.step() counts in the iteration that ends there,
    # or in the next where its unit's update was not done yet (the worker's timing), so the
    # counts per iteration would vary. Each unit's read at its entry counts where it is used.
    options = {"gpu_memory": 4096, "host_memory": 1 << 30, "update": "cpu", "compute_copies": copies}
    options |= {"step_in_backward": False, "pull_forward_bytes": 0}
    with teraio.offload(model, optimizer, **options) as run:
        state["run"] = run
        losses = _loop(model, optimizer, _tokens(STEPS))
        state["run"] = None
    _assert_bitwise(_train(UntiedLM, False), (model, optimizer, losses, run))
    report = run.report()
    copied = {slot.name for slot in run._copy_slots}
    numel = {name: p.numel() for name, p in model.named_parameters()}
    fp32 = sum(4 * n for name, n in numel.items() if name not in copied)
    bf16 = sum(2 * n for name, n in numel.items() if name in copied)
    # Each iteration's reported bytes are the copies made, by kind (copies counted as their kind).
    for step, counts in enumerate(run._iterations):
        reported = {(d, kind): n for d, tiers in counts.moved().items() for kind, n in tiers["host"].items()}
        assert reported == _by_base_kind(made[step]), step
    later = made[STEPS - 1]
    least = report.minimum_bytes_moved
    if copies == "on":
        assert report.compute_copies == "bfloat16"
        # From the second iteration: the Linear layers' parameters in at 2 bytes per element,
        # their gradients out at 2, none of their fp32 bytes on the link.
        assert later[("out", (cp.GRADIENT, "copy"))] == bf16
        assert later[("out", cp.GRADIENT)] == fp32
        assert ("in", (cp.PARAMETER, "copy")) in later
        read_low = later[("in", (cp.PARAMETER, "copy"))]
        assert bf16 <= read_low <= 2 * bf16 and read_low % 2 == 0
        assert least == {
            "in": {"host": {"parameter": fp32 + bf16}},
            "out": {"host": {"gradient": fp32 + bf16}},
        }
        assert report.compute_copy_bytes == 2 * bf16  # a pinned copy and a gradient buffer each
        assert report.compute_copy_elements == bf16 // 2
        # The first iteration streamed fp32: the copies go on at its step.
        assert not any(isinstance(kind, tuple) for _, kind in made[0])
    else:
        assert report.compute_copies == "off" and report.compute_copies_reason == "compute_copies='off'"
        assert not any(isinstance(kind, tuple) for step in made.values() for _, kind in step)
        assert later[("out", cp.GRADIENT)] == fp32 + 2 * bf16
        assert least == {
            "in": {"host": {"parameter": fp32 + 2 * bf16}},
            "out": {"host": {"gradient": fp32 + 2 * bf16}},
        }
        assert report.compute_copy_bytes == 0
    moved = report.bytes_per_iteration
    for direction, by_tier in moved.items():
        for kind, nbytes in by_tier["host"].items():
            assert nbytes >= least[direction]["host"][kind], (direction, kind)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_state_dict_gives_the_fp32_masters() -> None:
    reference: list[dict[str, torch.Tensor]] = []
    model, optimizer = _build(UntiedLM)
    _loop(model, optimizer, _tokens(STEPS), on_step=lambda s: reference.append(_snapshot(model)))
    taken: list[dict[str, torch.Tensor]] = []
    model, optimizer = _build(UntiedLM)
    with teraio.offload(
        model, optimizer, gpu_memory=4096, host_memory=1 << 30, update="cpu", compute_copies="on"
    ) as run:
        _loop(model, optimizer, _tokens(STEPS), on_step=lambda s: taken.append(_snapshot(model)))
        assert run.report().compute_copies == "bfloat16"
    for ref_step, step in zip(reference, taken, strict=True):
        assert ref_step.keys() == step.keys()
        for name, value in ref_step.items():
            assert step[name].dtype == torch.float32, name
            assert torch.equal(step[name], value), name


@pytest.mark.parametrize("at", [1, 2], ids=["before-in-backward", "in-backward"])
@pytest.mark.parametrize("copies", ["on", "off"])
def test_a_checkpoint_loaded_inside_the_session_continues_bitwise(copies: str, at: int) -> None:
    # load_state_dict brings the fp32 parameters back, torch copies into them, and the copies
    # are made again from the loaded masters; the CPU optimizer takes the loaded state (with
    # or without the copies), before step_in_backward="auto" turns on and after.
    data = _tokens(STEPS)
    model, optimizer = _build(UntiedLM)
    reference = _loop(model, optimizer, data)
    ref_params = [p.detach().clone() for p in model.parameters()]
    model, optimizer = _build(UntiedLM)
    saved: dict[str, Any] = {}

    def checkpoint(step: int) -> None:
        if step == at:
            saved["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            saved["optimizer"] = optimizer.state_dict()
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])

    options = {"gpu_memory": 4096, "host_memory": 1 << 30, "update": "cpu", "compute_copies": copies}
    with teraio.offload(model, optimizer, **options) as run:
        losses = _loop(model, optimizer, data, on_step=checkpoint)
    assert run.report().compute_copies == ("bfloat16" if copies == "on" else "off")
    assert run.report().step_in_backward
    assert losses == reference
    for p, q in zip(ref_params, model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_without_autocast_the_copies_stay_off() -> None:
    reference = _train(UntiedLM, False, autocast=False)
    result = _train(UntiedLM, True, autocast=False)
    _assert_bitwise(reference, result)
    report = result[3].report()
    assert (
        report.compute_copies == "off" and "did not run under bf16 autocast" in report.compute_copies_reason
    )
    assert _copied(result[3]) == set()


def test_a_forward_without_autocast_after_the_copies_raises() -> None:
    model, optimizer = _build(UntiedLM)
    data = _tokens(2)
    with teraio.offload(
        model, optimizer, gpu_memory=4096, host_memory=1 << 30, update="cpu", compute_copies="on"
    ):
        _loop(model, optimizer, data)
        with pytest.raises(RuntimeError, match="compute_copies='off'"):
            model(data[0])


def test_the_copies_need_room_beside_the_plan() -> None:
    model, optimizer = _build(UntiedLM)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    # The plan's parameters, gradients and AdamW state fill host_memory: no room for copies.
    with teraio.offload(
        model, optimizer, gpu_memory=4096, host_memory=4 * params, update="cpu", compute_copies="on"
    ) as run:
        losses = _loop(model, optimizer, _tokens(STEPS))
    report = run.report()
    assert report.compute_copies == "off" and "raise host_memory" in report.compute_copies_reason
    assert losses == _train(UntiedLM, False)[2]


def test_the_streamed_gpu_step_has_no_copies() -> None:
    result = _train(UntiedLM, True, options={"update": "gpu"})
    _assert_bitwise(_train(UntiedLM, False), result)
    report = result[3].report()
    assert report.compute_copies == "off" and "runs on the GPU" in report.compute_copies_reason


def test_auto_on_the_cpu_device_leaves_them_off() -> None:
    # No host link to save on a CPU "device": "auto" keeps the fp32 path, and says why.
    result = _train(UntiedLM, True, options={"compute_copies": "auto"})
    report = result[3].report()
    assert report.compute_copies == "off" and "no host link to save" in report.compute_copies_reason


def test_auto_weighs_the_link_against_the_conversions() -> None:
    # A Llama-3.2-3B shape's Linear layers (11.2 GB fp32, all trained) with the CPU step at
    # 500 ms: on a 50 GB/s link the step is the bound and the conversions would lengthen it;
    # on a 12 GB/s link the link is the bound and halving it wins.
    copied = 11_200_000_000
    figures: dict[str, Any] = {"copied_bytes": copied, "copied_gradient_bytes": copied, "cpu_step_s": 0.5}
    fast_link = cp.choose_compute_copies(**figures, cpu_update_bytes_per_s=107e9, host_link_bytes_per_s=50e9)
    assert fast_link[0] is False and "compute_copies='on' forces them" in fast_link[1]
    slow_link = cp.choose_compute_copies(**figures, cpu_update_bytes_per_s=107e9, host_link_bytes_per_s=12e9)
    assert slow_link[0] is True and "they shorten the bound" in slow_link[1]
    # A slow CPU (few cores) makes the conversions too dear even there.
    slow_cpu = cp.choose_compute_copies(**figures, cpu_update_bytes_per_s=10e9, host_link_bytes_per_s=12e9)
    assert slow_cpu[0] is False
    # With the CPU step's kernel converting in its own pass they cost nothing: on everywhere.
    for link in (50e9, 12e9):
        fused = cp.choose_compute_copies(
            **figures, cpu_update_bytes_per_s=10e9, host_link_bytes_per_s=link, converted_in_step=True
        )
        assert fused[0] is True and "converts in its own pass" in fused[1]


def test_compute_copy_room() -> None:
    sizes = [cp.SlotSize("w", 400, 400, 800)]
    plan = cp.place(sizes, host_capacity_bytes=2000, ssd_capacity_bytes=None, window_bytes=1 << 20)
    assert cp.compute_copy_room(plan, 2000, 400) is None
    assert "raise host_memory" in (cp.compute_copy_room(plan, 2000, 401) or "")


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match="compute_copies must be one of"):
        teraio.OffloadOptions(compute_copies="yes")


def _assert_share_recorded(run: ModelOffload) -> None:
    """The recorded iteration's step: the worker's jobs update the units before the GPU's share,
    whose "step share" ops read and write the masters and moments as optimizer state, and the
    replay predicts it with nothing unmodelled."""
    report = run.report()
    record = run.recorder.result()
    assert record is not None and report.predicted_iteration_ms is not None, report.warnings
    assert record.unmodelled_job_tensors == 0 and record.unmodelled_transfers == 0
    names = {t["id"]: t["name"] for t in record.trace["tensors"]}
    produced = {names[i] for job in record.schedule.get("cpu_jobs", []) for i in job["produces"]}
    shared = {t["name"].rsplit(".", 1)[0] for t in record.trace["tensors"] if t["name"].endswith(".master")}
    assert shared and not shared & produced
    assert shared | produced == {slot.name for slot in run.slots if slot.param.requires_grad}
    assert any(op["name"] == "step share" for op in record.trace["ops"])


@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"accumulate": 2}, {"clip": 0.05}, {"accumulate": 3, "clip": 0.05}],
    ids=["plain", "accumulated", "clipped", "accumulated-3-clipped"],
)
def test_the_gpus_share_of_the_step_is_bitwise(kwargs: dict[str, Any], share: float) -> None:
    # On a CPU device the share's "GPU" step is torch's fused CPU AdamW, whose bits the CPU
    # step's kernel has: the same training as without offload, with the units the next
    # forward pass enters last updated by the share from the second step on (half of the
    # elements or fewer, or all), each gradient as the kernel reads it (a lone micro-batch's
    # bf16 one widened, an accumulated fp32 sum, a clip's scale applied first).
    reference = _train(UntiedLM, False, **kwargs)
    result = _train(UntiedLM, True, {"gpu_step_share": share, "step_in_backward": False}, **kwargs)
    _assert_bitwise(reference, result)
    run = result[3]
    total = sum(p.numel() for p in run.model.parameters())
    report = run.report()
    shared = report.gpu_step_share_elements_by_iteration
    assert shared[:SHARE_FROM_STEP] == [0] * SHARE_FROM_STEP and len(shared) == STEPS
    assert all(0 < n <= share * total for n in shared[SHARE_FROM_STEP:])
    assert (shared[-1] == total) == (share == 1.0)
    assert report.gpu_step_share_ms is not None and report.gpu_step_share == str(share)
    shared_steps = STEPS - SHARE_FROM_STEP
    assert f"GPU's share of the CPU step ({share}): {shared_steps} of {STEPS} steps" in str(report)
    _assert_share_recorded(run)


def test_the_gpus_share_moves_its_moments_to_pinned_buffers_once() -> None:
    # The shared parameters' moments go into host-tier buffers at their first share, where the
    # CPU step updates them in place when a later step gives them back to the worker.
    model, optimizer = _build(UntiedLM)
    data = _tokens(STEPS)
    settings = {"gpu_memory": 4096, "host_memory": 1 << 30, "update": "cpu", "compute_copies": "on"}
    with teraio.offload(model, optimizer, gpu_step_share=1.0, step_in_backward=False, **settings) as run:
        assert isinstance(run, ModelOffload)

        pinned: list[set[Any]] = []

        def next_share(step: int) -> None:
            pinned.append({key for key in run.host.buffers if key[0][0] == cp.STATE})
            if step == SHARE_FROM_STEP:
                run._share_setting = 0.0

        losses = _loop(model, optimizer, data, clip=0.05, on_step=next_share)
        buffers = {key for key in run.host.buffers if key[0][0] == cp.STATE}
    # Pinned at the first step (slow on CUDA), not inside a measured one.
    assert all(keys == buffers for keys in pinned)
    reference = _train(UntiedLM, False, clip=0.05)
    assert losses == reference[2]
    _assert_bitwise(reference, (model, optimizer, losses, None))
    trained = [slot for slot in run.slots if slot.param.requires_grad]
    moments = ("exp_avg", "exp_avg_sq")
    assert buffers == {((cp.STATE, name), slot.index) for slot in trained for name in moments}
    total = sum(p.numel() for p in model.parameters())
    shared = run.report().gpu_step_share_elements_by_iteration
    assert shared[SHARE_FROM_STEP:] == [total, 0]


def test_a_checkpoint_loaded_inside_the_session_continues_with_the_share() -> None:
    # A load rebuilds the CPU optimizer, whose state is new CPU memory: the next share copies
    # it into the host-tier buffers again rather than reading the old bytes there.
    data = _tokens(STEPS)
    model, optimizer = _build(UntiedLM)
    reference = _loop(model, optimizer, data, clip=0.05)
    ref_params = [p.detach().clone() for p in model.parameters()]
    model, optimizer = _build(UntiedLM)

    def checkpoint(step: int) -> None:
        if step == 1:
            saved = optimizer.state_dict()
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
            optimizer.load_state_dict(saved)

    options = {"gpu_memory": 4096, "host_memory": 1 << 30, "update": "cpu", "compute_copies": "on"}
    with teraio.offload(model, optimizer, gpu_step_share=0.5, **options) as run:
        losses = _loop(model, optimizer, data, clip=0.05, on_step=checkpoint)
    assert all(run.report().gpu_step_share_elements_by_iteration[SHARE_FROM_STEP:])
    assert losses == reference
    for p, q in zip(ref_params, model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_moments_without_room_in_the_host_tier_leave_the_share_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self: HostTier, key: Any, value: torch.Tensor) -> torch.Tensor:
        raise MemoryError("no room for this test")

    # The moments are made where they would go (new) or moved there (a loaded state's): neither
    # fits, and the CPU step makes them in CPU memory as without the share.

    monkeypatch.setattr(HostTier, "adopt", full)
    monkeypatch.setattr(HostTier, "zeros_like", full)
    reference = _train(UntiedLM, False, clip=0.05)
    result = _train(UntiedLM, True, {"gpu_step_share": 0.5}, clip=0.05)
    _assert_bitwise(reference, result)
    report = result[3].report()
    assert report.gpu_step_share_elements_by_iteration == [0] * STEPS
    assert report.gpu_step_share == "off: the moments did not fit the host tier (no room for this test)"


def test_auto_shares_nothing_on_a_cpu_device() -> None:
    result = _train(UntiedLM, True, {"step_in_backward": False}, clip=0.05)
    report = result[3].report()
    assert report.gpu_step_share == "auto"
    assert report.gpu_step_share_elements_by_iteration == [0] * STEPS
    assert "GPU's share of the CPU step (auto): none" in str(report)


def test_balanced_share() -> None:
    # The worker's part and the GPU's part followed by the forward pass end together.
    total, cpu_s, gpu_s, forward_s = 1000, 2.0, 3.0, 500.0
    share = balanced_share(total, cpu_s, gpu_s, forward_s)
    assert cpu_s * (total - share) == pytest.approx(gpu_s * share + forward_s)
    assert balanced_share(total, cpu_s, gpu_s, 0.0) == pytest.approx(400.0)
    # A worker that finishes within the forward pass alone keeps every element.
    assert balanced_share(total, cpu_s, gpu_s, cpu_s * total) == 0.0
    assert balanced_share(total, cpu_s, gpu_s, 10 * cpu_s * total) == 0.0


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True, None])
def test_the_share_option_is_checked(value: Any) -> None:
    with pytest.raises(ValueError, match="gpu_step_share must be 'auto', 'off' or a fraction"):
        teraio.OffloadOptions(gpu_step_share=value)


def test_the_loops_host_time_leaves_the_share_to_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    # The prediction adds the loop's host time after the step as an op of its own; the share's
    # time on the training thread is the record's ops and transfers, so that time starts after
    # the share, not after the step's wait for the gradients' copies (counted twice, the
    # prediction was 28% high on the H200).
    ended: list[float] = []
    step_share = ModelOffload._step_share

    def timed(self: ModelOffload, groups: Any) -> None:
        step_share(self, groups)
        ended.append(time.perf_counter())

    monkeypatch.setattr(ModelOffload, "_step_share", timed)
    run = _train(UntiedLM, True, {"gpu_step_share": 0.5}, clip=0.05)[3]
    recorded_share_end = ended[0]  # the recorded iteration's step is the first that shares
    assert run._recorded_marks["copies_done"] >= recorded_share_end
    _assert_share_recorded(run)


@pytest.mark.parametrize("end", ["step", "zero_grad", "exit"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["accumulated", "accumulated-clipped"])
def test_the_share_through_changing_micro_batch_counts_and_endings(
    monkeypatch: pytest.MonkeyPatch, clip: Any, end: str
) -> None:
    # The GPU's share over steps of 2, 3, 1, 2 and 3 micro-batches (held sums read back as bf16
    # or fp32, or folded late), the last iteration ending with a step, a zero_grad() that drops
    # its sums, or the session's exit after its backward passes: the bits of training without
    # offload.
    counts = [2, 3, 1, 2, 3, 2]
    data = _tokens(sum(counts))
    steps = [data[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
    shared: list[int] = []
    step_share = ModelOffload._step_share

    def counted(self: ModelOffload, groups: Any) -> None:
        shared.append(len(groups))
        step_share(self, groups)

    monkeypatch.setattr(ModelOffload, "_step_share", counted)
    reference = _train_steps_of(False, steps, clip, end)
    _assert_same_training(reference, _train_steps_of(True, steps, clip, end, {"gpu_step_share": 0.5}))
    # Every step from the recorded iteration's shared (the last one's only where it ran).
    assert len(shared) == len(counts) - SHARE_FROM_STEP - (end != "step") and all(shared)
