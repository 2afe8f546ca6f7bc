"""Whole-model mode with the checkpointed blocks' inputs on the host (`checkpoint_inputs`): the
same bits as training without offload, each input copied out once and back once per backward,
ahead of the recomputation that needs it."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import pytest
import teraio
import torch
from teraio.runtime.modes.whole_model import ModelOffload
from tiny import accumulate_pairs, batches, make, train

LAYERS = 4
ROWS = 256
DIM = 64
#: One block's input: ROWS x DIM fp32.
INPUT_BYTES = ROWS * DIM * 4


def _offloaded(
    loop: Callable[[torch.nn.Module, torch.optim.Optimizer], list[float]],
    store: Any,
    prepare: Callable[[ModelOffload], None] = lambda run: None,
    **options: Any,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float], ModelOffload]:
    model, optimizer = make()
    options = {"checkpoint_inputs": "host", "min_bytes": 0, "host_memory": 1 << 30, **options}
    with teraio.offload(model, optimizer, store=store, gpu_memory=4096, **options) as run:
        assert isinstance(run, ModelOffload)
        prepare(run)
        losses = loop(model, optimizer)
    return model, optimizer, losses, run


def _assert_same(loop: Callable[..., list[float]], model: Any, optimizer: Any, losses: list[float]) -> None:
    ref_model, ref_opt = make()
    assert losses == loop(ref_model, ref_opt)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
        for key, value in ref_opt.state[p].items():
            assert torch.equal(value, optimizer.state[q][key]), key


def _plain(data: list[torch.Tensor]) -> Callable[..., list[float]]:
    return lambda model, optimizer: train(model, optimizer, data)


@pytest.mark.parametrize("host_memory", [1 << 30, 300_000, 0], ids=["host", "mixed", "ssd"])
def test_inputs_on_the_host_are_exact(store: teraio.Store, host_memory: int) -> None:
    loop = _plain(batches(4, rows=ROWS))
    model, optimizer, losses, run = _offloaded(loop, store, host_memory=host_memory)
    _assert_same(loop, model, optimizer, losses)
    report = run.report()
    assert report.checkpoint_inputs == "host"
    # Every block's input but the last one's (backward starts there), out once and in once: to
    # host memory where the plan leaves room there, else to the store (the plan's kinds take
    # host memory first).
    moved = (LAYERS - 1) * INPUT_BYTES
    tier = "host" if host_memory == 1 << 30 else "ssd"
    assert report.bytes_per_iteration["out"][tier]["activation"] == moved
    assert report.bytes_per_iteration["in"][tier]["activation"] == moved
    assert report.checkpoint_inputs_pinned_bytes == (moved if tier == "host" else 0)
    assert report.checkpoint_inputs_kept_for_room == 0
    # Each came back at its planned point: when backward entered the block after it.
    assert run.saved_stats.prefetches_on_demand == 0
    assert "checkpointed blocks' inputs: off the GPU" in str(report)
    assert store.list() == []  # the run's objects, the inputs' among them, are deleted at exit


def test_inputs_follow_accumulation_and_two_forwards_before_backward(store: teraio.Store) -> None:
    data = batches(4, rows=ROWS)

    def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        # Accumulation: forward, backward, forward, backward; then both forwards first.
        losses = accumulate_pairs(model, optimizer, data)
        held = [model(x) for x in data[:2]]
        (held[0] + held[1]).backward()
        optimizer.step()
        losses.extend(loss.item() for loss in held)
        return losses

    model, optimizer, losses, run = _offloaded(loop, store)
    _assert_same(loop, model, optimizer, losses)
    # The second forward before backward had buffers of its own.
    assert run.report().checkpoint_inputs_pinned_bytes == 2 * (LAYERS - 1) * INPUT_BYTES


def _room_for_one(run: ModelOffload) -> None:
    run.inputs.capacity_bytes = INPUT_BYTES


def test_inputs_without_host_room_go_to_the_store(store: teraio.Store) -> None:
    loop = _plain(batches(3, rows=ROWS))
    model, optimizer, losses, run = _offloaded(loop, store, prepare=_room_for_one)
    _assert_same(loop, model, optimizer, losses)
    report = run.report()
    assert report.checkpoint_inputs_pinned_bytes == INPUT_BYTES
    assert report.checkpoint_inputs_kept_for_room == 0
    assert report.bytes_per_iteration["out"]["host"]["activation"] == INPUT_BYTES
    assert report.bytes_per_iteration["out"]["ssd"]["activation"] == (LAYERS - 2) * INPUT_BYTES
    assert report.bytes_per_iteration["in"]["ssd"]["activation"] == (LAYERS - 2) * INPUT_BYTES


def test_inputs_without_host_room_or_a_store_stay_on_the_gpu_and_are_counted() -> None:
    loop = _plain(batches(3, rows=ROWS))
    model, optimizer, losses, run = _offloaded(loop, None, prepare=_room_for_one)
    _assert_same(loop, model, optimizer, losses)
    report = run.report()
    assert report.checkpoint_inputs_pinned_bytes == INPUT_BYTES
    assert report.checkpoint_inputs_kept_for_room == 3 * (LAYERS - 2)
    assert report.bytes_per_iteration["out"]["host"]["activation"] == INPUT_BYTES


def test_inputs_take_at_most_their_room_on_the_store(store: teraio.Store) -> None:
    def room_for_one_there(run: ModelOffload) -> None:
        run.inputs.capacity_bytes = 0
        run.inputs.spill_room_bytes = INPUT_BYTES

    loop = _plain(batches(2, rows=ROWS))
    model, optimizer, losses, run = _offloaded(loop, store, prepare=room_for_one_there)
    _assert_same(loop, model, optimizer, losses)
    report = run.report()
    assert report.bytes_per_iteration["out"]["ssd"]["activation"] == INPUT_BYTES
    assert report.checkpoint_inputs_kept_for_room == 2 * (LAYERS - 2)


def test_inputs_on_the_store_take_half_its_free_space_at_most(store: teraio.Store) -> None:
    loop = _plain(batches(2, rows=ROWS))
    _, _, _, run = _offloaded(loop, store, prepare=lambda run: setattr(run.inputs, "capacity_bytes", 0))
    free = sum(int(d["free_bytes"]) for d in store.info()["devices"])
    assert run.inputs.spill_room_bytes is not None
    assert (
        free // 2 - (LAYERS - 1) * INPUT_BYTES <= run.inputs.spill_room_bytes <= free // 2 + 4 * INPUT_BYTES
    )


def test_a_second_backward_through_the_graph_reads_the_inputs_again(store: teraio.Store) -> None:
    data = batches(1, rows=ROWS)

    def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        loss = model(data[0])
        loss.backward(retain_graph=True)
        loss.backward()
        optimizer.step()
        return [loss.item()]

    model, optimizer, losses, run = _offloaded(loop, store)
    _assert_same(loop, model, optimizer, losses)
    assert run.saved_stats.prefetches_on_demand == LAYERS - 1


def test_auto_keeps_the_inputs_on_a_cpu_device(store: teraio.Store) -> None:
    loop = _plain(batches(2, rows=ROWS))
    _, _, _, run = _offloaded(loop, store, checkpoint_inputs="auto")
    report = run.report()
    assert report.checkpoint_inputs == "gpu" and report.checkpoint_inputs_pinned_bytes == 0


def test_bad_checkpoint_inputs_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="checkpoint_inputs must be one of"):
        teraio.OffloadOptions(checkpoint_inputs="disk")


def test_the_report_gives_tokens_per_second_and_model_tflops(store: teraio.Store) -> None:
    from test_whole_model import _tied, _tokens

    data = _tokens(4)  # (4, 16) token ids
    model, optimizer = _tied()
    parameters = sum(p.numel() for p in model.parameters())  # the tied weight once
    with teraio.offload(model, optimizer, store=store, gpu_memory=4096, host_memory=1 << 30) as run:
        for tokens in data:
            model(tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            model(data[0])  # an evaluation pass counts no tokens
    report = run.report()
    assert report.tokens_per_iteration == 64
    assert report.measured_iteration_ms is not None and report.tokens_per_s is not None
    assert report.tokens_per_s == pytest.approx(64 / report.measured_iteration_ms * 1e3)
    assert report.model_tflops == pytest.approx(6 * parameters * report.tokens_per_s / 1e12)
    assert "tokens per iteration" in str(report)


def test_a_model_fed_no_token_ids_reports_no_tokens(store: teraio.Store) -> None:
    _, _, _, run = _offloaded(_plain(batches(2, rows=ROWS)), store)
    report = run.report()
    assert report.tokens_per_iteration is None and report.tokens_per_s is None and report.model_tflops is None


def test_inputs_follow_an_evaluation_pass_and_a_smaller_last_batch(store: teraio.Store) -> None:
    data = batches(3, rows=ROWS) + batches(1, rows=ROWS // 2, seed=7)

    def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        losses = []
        for x in data:
            losses += train(model, optimizer, [x])
            with torch.no_grad():
                losses.append(model(data[0]).item())  # evaluation saves nothing
        return losses

    model, optimizer, losses, run = _offloaded(loop, store)
    _assert_same(loop, model, optimizer, losses)
    # The last batch's inputs, half the size, took buffers of their size in place of the
    # others: the pinned peak is one full-size buffer per block.
    assert run.report().checkpoint_inputs_pinned_bytes == (LAYERS - 1) * INPUT_BYTES
    assert run.report().bytes_per_iteration["out"]["host"]["activation"] == (LAYERS - 1) * INPUT_BYTES
    assert run.saved_stats.prefetches_on_demand == 0


@pytest.mark.parametrize("inputs", ["host", "gpu"])
def test_between_forward_and_backward_the_device_holds_one_blocks_inputs(
    store: teraio.Store, inputs: str
) -> None:
    """What lets a larger batch fit: with the inputs off the device, the block outputs that the
    next blocks' checkpoints would keep are freed after forward, all but the last block's input."""
    model, optimizer = make()
    alive: list[Any] = []
    handles = [
        layer.register_forward_hook(lambda module, args, output: alive.append(weakref.ref(output)))
        for layer in model.layers[:-1]
    ]
    options = {"checkpoint_inputs": inputs, "min_bytes": 0, "host_memory": 1 << 30}
    with teraio.offload(model, optimizer, store=store, gpu_memory=4096, **options):
        for x in batches(2, rows=ROWS):
            alive.clear()
            loss = model(x)
            held = [ref() is not None for ref in alive]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for handle in handles:
        handle.remove()
    # Block i's output is block i + 1's input; the last block's input stays for backward.
    assert held == ([False] * (LAYERS - 2) + [True] if inputs == "host" else [True] * (LAYERS - 1))
