"""Whole-model mode's update site (`update="auto"|"gpu"|"cpu"`): the choice on fake machines, the
CPU step's arithmetic against torch's CPU AdamW, and the bytes each site moves."""

from __future__ import annotations

import contextlib
import sys
from concurrent.futures import Future
from typing import Any, Optional

import pytest
import teraio
import torch
from cpu_step import assert_cpu_step_predicted
from teraio.planning import replay_schedule
from teraio.runtime.modes import cpu_update
from teraio.runtime.modes.whole_model import CPU_STEP_SWITCH_INTERVAL_S, ModelOffload
from teraio.runtime.plans import capacity as cp
from test_whole_model import TiedLM, _tokens
from test_whole_model_copies import _by_base_kind, _count_host_copies
from tiny import train_steps

STEPS = 4
GB = 1e9
#: The CPU step at optimizer.step(), whatever the loop ("auto" may run it in backward).
AT_STEP = {"update": "cpu", "step_in_backward": False}


def _build(fused: Optional[bool] = True, seed: int = 0) -> tuple[TiedLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TiedLM()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)


def _state_of(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    packed = optimizer.state_dict()["state"]
    return [{k: v.detach().clone() for k, v in packed[i].items()} for i in sorted(packed)]


def _train(offloaded: bool, fused: Optional[bool] = True, **kwargs: Any) -> Any:
    model, optimizer = _build(fused)
    data = _tokens(STEPS)
    states: list[Any] = []
    options = {"gpu_memory": 4096, "host_memory": 1 << 30, "update": "cpu"} | kwargs.pop("options", {})
    if offloaded:
        # The streamed step's state between steps is in its tiers (placeholders in the
        # optimizer): its state is compared after exit only.
        collect = options["update"] == "cpu"
        with teraio.offload(model, optimizer, **options) as run:
            assert isinstance(run, ModelOffload)
            on_step = (lambda _: states.append(_state_of(optimizer))) if collect else None
            losses = train_steps(model, optimizer, data, on_step=on_step, **kwargs)
        if not collect:
            states = [_state_of(optimizer)]
        return model, optimizer, losses, states, run
    losses = train_steps(
        model, optimizer, data, on_step=lambda _: states.append(_state_of(optimizer)), **kwargs
    )
    return model, optimizer, losses, states, None


def _assert_bitwise(reference: Any, other: Any) -> None:
    ref_model, ref_opt, ref_losses, ref_states, _ = reference
    model, optimizer, losses, states, _ = other
    assert losses == ref_losses
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    # Each step's state_dict, taken between steps while the model is offloaded, says the truth
    # (or the last one's, after exit).
    for ref_step, step in zip(ref_states[-len(states) :], states, strict=True):
        for ref_param, param in zip(ref_step, step, strict=True):
            assert ref_param.keys() == param.keys()
            for key in ref_param:
                assert torch.equal(ref_param[key].cpu(), param[key].cpu()), key


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"clip": 0.05}, {"accumulate": 2}],
    ids=["plain", "clipped", "accumulated"],
)
def test_cpu_step_is_torchs_fused_cpu_adamw(kwargs: dict[str, Any]) -> None:
    # The CPU step runs torch's fused CPU AdamW: against the same optimizer without offload the
    # bits are the same, with a scheduler changing lr at each step, clipping and accumulation.
    # (At optimizer.step(): "auto" would run the plain loop's in backward, tested below.)
    reference = _train(False, **kwargs)
    result = _train(True, options=AT_STEP, **kwargs)
    _assert_bitwise(reference, result)
    report = result[4].report()
    assert report.update == "cpu" and report.cpu_update_ms is not None
    assert "update on the CPU" in str(report)
    assert report.cpu_step_kernel.startswith("teraio (Adam/AdamW") and "CPU step kernel: teraio" in str(
        report
    )
    # At optimizer.step(), after the last op: the replay's next forward waits for them.
    record = assert_cpu_step_predicted(result[4])
    assert all(job["op"] == len(record.trace["ops"]) for job in record.schedule["cpu_jobs"])
    trained = [slot for slot in result[4].slots if slot.param.requires_grad]
    assert len(record.schedule["cpu_jobs"]) == len(result[4]._update_groups(trained))
    # After exit the state is the user's optimizer's own again, on the model's device.
    optimizer = result[1]
    assert all(state["exp_avg"].device.type == "cpu" for state in optimizer.state.values())


@pytest.mark.parametrize("kwargs", [{"clip": 0.05}, {"accumulate": 2}], ids=["clipped", "accumulated"])
def test_cpu_step_with_torchs_own_step(monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any]) -> None:
    # Where the engine's kernel does not run (`kernel_refusal`), torch's CPU optimizer steps the
    # same bits, and the report says which ran and why.
    monkeypatch.setattr(cpu_update, "kernel_refusal", lambda optimizer: "refused for this test")
    reference = _train(False, **kwargs)
    result = _train(True, **kwargs)
    _assert_bitwise(reference, result)
    assert result[4].cpu_update.kernel is None
    assert result[4].report().cpu_step_kernel == "torch (refused for this test)"


def test_cpu_step_of_adam_with_l2_decay_and_maximize() -> None:
    # Adam (not AdamW): its weight decay is added to the gradient; maximize flips it.
    def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1, maximize=True, fused=True)

    results = []
    for offloaded in (False, True):
        torch.manual_seed(0)
        model = TiedLM()
        optimizer = adam(model)
        data = _tokens(STEPS)
        if offloaded:
            with teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30, update="cpu") as run:
                losses = train_steps(model, optimizer, data, clip=0.05)
            assert run.cpu_update is not None and run.cpu_update.kernel is not None
        else:
            losses = train_steps(model, optimizer, data, clip=0.05)
        results.append((model, losses))
    (ref_model, ref_losses), (model, losses) = results
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters()))


def _host_hardware(host_link_bytes_per_s: float) -> dict[str, Any]:
    return {
        "gpu_capacity_bytes": 1 << 40,
        "host_capacity_bytes": 1 << 40,
        "host_link_bytes_per_s": host_link_bytes_per_s,
        "host_link_duplex_bytes_per_s": None,
        "host_latency_us": 0.0,
        "ssd_read_bytes_per_s": 1e9,
        "ssd_write_bytes_per_s": 1e9,
        "ssd_latency_us": 0.0,
        "ssd_shared": False,
        "ssd_via_host_link": True,
    }


def test_a_cpu_job_replays_between_the_gradients_write_and_the_parameters_read() -> None:
    # Ops of 1000 us: forward and backward read w (1 MB); backward writes its gradient g (1 MB),
    # which leaves for good after the last op, where the step queues the job (5000 us) that
    # reads g and writes w; w is read before the forward. At 1 GB/s: g's write (1000 us), the
    # job, w's read (1000 us) and the ops are one chain: 9000 us.
    tensor = {"size_bytes": 1_000_000, "alloc_op": None, "free_op": None}
    trace = {
        "format_version": 1,
        "description": "the CPU step, by hand",
        "gpu_capacity_bytes": 1 << 40,
        "ops": [{"name": "forward", "duration_us": 1000.0}, {"name": "backward", "duration_us": 1000.0}],
        "tensors": [
            {
                **tensor,
                "id": 1,
                "name": "w",
                "kind": "weight",
                "uses": [{"op": 0, "access": "read"}, {"op": 1, "access": "read"}],
            },
            {
                **tensor,
                "id": 2,
                "name": "w.grad",
                "kind": "gradient",
                "alloc_op": 1,
                "free_op": 1,
                "uses": [{"op": 1, "access": "write"}],
            },
        ],
    }
    transfers = [
        {"op": 0, "tensor_id": 1, "kind": "prefetch", "tier": "host"},
        {"op": 2, "tensor_id": 1, "kind": "drop", "tier": "host"},
        {"op": 2, "tensor_id": 2, "kind": "offload", "tier": "host"},
    ]
    job = {"op": 2, "duration_us": 5000.0, "waits_for": [2], "produces": [1]}
    with_job = replay_schedule(trace, {"transfers": transfers, "cpu_jobs": [job]}, _host_hardware(1e9))
    assert with_job["iteration_time_us"] == pytest.approx(9000.0)
    assert (with_job["host_read_bytes"], with_job["host_written_bytes"]) == (1_000_000, 1_000_000)
    # A record without jobs (the schedule format before them): w's read and the ops; g's write
    # runs meanwhile.
    alone = replay_schedule(trace, {"transfers": transfers}, _host_hardware(1e9))
    assert alone["iteration_time_us"] == pytest.approx(3000.0)
    # Ten times the link: 100 us each for the write and the read.
    fast = replay_schedule(trace, {"transfers": transfers, "cpu_jobs": [job]}, _host_hardware(1e10))
    assert fast["iteration_time_us"] == pytest.approx(7200.0)
    # A job naming a tensor the trace lacks is refused, naming it.
    with pytest.raises(teraio.PlannerError, match="tensor 9, which the trace lacks"):
        replay_schedule(
            trace, {"transfers": transfers, "cpu_jobs": [{**job, "produces": [9]}]}, _host_hardware(1e9)
        )


def test_a_read_waiting_for_its_update_is_recorded_where_it_was_wanted() -> None:
    # Whether a unit's update is done when the step reads ahead is a race: the record holds the
    # read where it was wanted, once, whichever way the race went, and not where it was issued.
    from teraio.schedule_record import ScheduleRecorder

    recorder = ScheduleRecorder(torch.device("cpu"))
    recorder.wanted("early", "host")  # before the record (the last iteration's step)
    recorder.start()
    recorder.begin("forward")
    recorder.use("early", "early", "parameter", 8)
    recorder.use("late", "late", "parameter", 8)
    recorder.read("early", "host")  # issued now: wanted before the record, not recorded again
    recorder.left("early", "host")
    recorder.left("late", "host")
    recorder.wanted("late", "host")
    recorder.wanted("late", "host")  # still waiting at the next read ahead
    recorder.finish()
    recorder.read("late", "host")  # issued in the next iteration
    record = recorder.result()
    assert record is not None
    names = {t["id"]: t["name"] for t in record.trace["tensors"]}
    moves = [(names[t["tensor_id"]], t["kind"], t["op"]) for t in record.schedule["transfers"]]
    # "early"'s read came before the record: the record owes it one (where "late", first used
    # by the same op, was read), so that every departure pairs with a read.
    assert moves == [
        ("early", "drop", 1),
        ("late", "drop", 1),
        ("late", "prefetch", 1),
        ("early", "prefetch", 1),
    ]


def test_a_resident_parameter_made_stale_by_the_cpu_step_is_read_back_in_the_replay() -> None:
    # A parameter kept on the GPU, updated on the CPU: dropped after its update, read back at
    # its next use, in the next iteration. The first iteration after it became resident begins
    # with its copy fresh, so its record holds the drop alone; the record owes the read, issued
    # where the tensors its first op uses were read, and replays with the job gating it.
    from teraio.schedule_record import ScheduleRecorder

    recorder = ScheduleRecorder(torch.device("cpu"))
    recorder.start()
    recorder.begin("embedding")
    recorder.use("kept", "kept", "parameter", 1000)
    recorder.begin("block")
    recorder.read("streamed", "host")
    recorder.begin("block forward")
    recorder.use("streamed", "streamed", "parameter", 1000)
    recorder.use("kept", "kept", "parameter", 1000)
    recorder.left("streamed", "host")
    recorder.begin("backward")
    recorder.use("kept.grad", "kept.grad", "gradient", 1000, write=True)
    recorder.wrote("kept.grad", "host")
    future: Future[float] = Future()
    future.set_result(0.001)
    recorder.cpu_job(future, ["kept.grad"], ["kept"])
    recorder.left("kept", "host")  # its GPU copy is stale once the job ran
    recorder.finish()
    record = recorder.result()
    assert record is not None
    names = {t["id"]: t["name"] for t in record.trace["tensors"]}
    moves = [(names[t["tensor_id"]], t["kind"], t["op"]) for t in record.schedule["transfers"]]
    assert moves.count(("kept", "drop", 4)) == 1
    owed = [m for m in moves if m[0] == "kept" and m[1] == "prefetch"]
    # First used by op 0, which no other tensor is: read just before it (wrapping).
    assert owed == [("kept", "prefetch", 0)], moves
    sim = record.replay(host_link_bytes_per_s=1e9, ssd_read_bytes_per_s=1e9, ssd_write_bytes_per_s=1e9)
    assert sim["iteration_time_us"] > 0 and record.unmodelled_transfers == 0


def test_cpu_step_against_the_default_single_tensor_adamw() -> None:
    # The user's AdamW without fused/foreach runs torch's single-tensor loop on the CPU; the CPU
    # step runs the fused kernel, whose rounding differs (it evaluates the same update in
    # another order, in vectors): within a few fp32 ulps per step, not bitwise.
    reference = _train(False, fused=None)
    result = _train(True, fused=None)
    torch.testing.assert_close(result[2], reference[2], rtol=1e-5, atol=1e-6)
    for p, q in zip(reference[0].parameters(), result[0].parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


def test_gpu_step_is_unchanged_by_the_option() -> None:
    # update="gpu" on the CPU device is the streamed step with the user's optimizer: bitwise.
    reference = _train(False)
    result = _train(True, options={"update": "gpu"})
    _assert_bitwise(reference, result)
    assert result[4].report().update == "gpu"


def test_auto_on_the_cpu_device_keeps_the_streamed_step() -> None:
    model, optimizer = _build()
    with teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30) as run:
        train_steps(model, optimizer, _tokens(1))
    report = run.report()
    assert report.update == "gpu" and "CPU" in report.update_reason


def test_cpu_step_with_state_on_the_store_is_refused(store: teraio.Store) -> None:
    model, optimizer = _build()
    with pytest.raises(ValueError, match="update='cpu'.*on the store"):
        teraio.offload(model, optimizer, store=store, gpu_memory=4096, host_memory=0, update="cpu")


def test_cpu_step_refuses_what_it_cannot_run() -> None:
    class Custom(torch.optim.AdamW):
        pass

    model = TiedLM()
    with pytest.raises(ValueError, match="not one of torch.optim's"):
        teraio.offload(model, Custom(model.parameters()), gpu_memory=4096, host_memory=1 << 30, update="cpu")
    with pytest.raises(ValueError, match="update must be one of"):
        teraio.OffloadOptions(update="host")


# -- the step in backward on the CPU ----------------------------------------------------------

IN_BACKWARD = {"update": "cpu", "step_in_backward": True}


def test_cpu_step_in_backward_is_torchs_fused_cpu_adamw() -> None:
    # Each unit's update runs on the worker as backward completes its gradients, with the
    # scheduler's lr as the last optimizer.step() left it: the same bits as the plain loop.
    reference = _train(False)
    result = _train(True, options=IN_BACKWARD)
    _assert_bitwise(reference, result)
    report = result[4].report()
    assert report.update == "cpu" and report.step_in_backward and report.cpu_update_ms is not None
    assert "step in backward on the CPU" in str(report)
    # Queued as backward leaves each unit: one job per batch of gradients sent out, after it.
    record = assert_cpu_step_predicted(result[4])
    gradients = {t["id"] for t in record.trace["tensors"] if t["kind"] == "gradient"}
    out_at = sorted({x["op"] for x in record.schedule["transfers"] if x["tensor_id"] in gradients})
    assert [job["op"] for job in record.schedule["cpu_jobs"]] == out_at
    # Gradients leave for host memory (the CPU step's input), once per iteration.
    moved = report.bytes_per_iteration
    params = sum(p.untyped_storage().nbytes() for p in result[0].parameters())
    assert moved["out"]["host"]["gradient"] == params
    assert report.placement["host"]["gradient"] == params


def test_cpu_step_in_backward_queues_every_update_before_optimizer_step() -> None:
    model, optimizer = _build()
    data = _tokens(3)
    with teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30, **IN_BACKWARD) as run:
        submitted: list[int] = []
        submit = run._cpu_worker.submit

        def counted(fn: Any, params: list[torch.Tensor], *args: Any) -> Any:
            submitted.append(len(params))
            return submit(fn, params, *args)

        run._cpu_worker.submit = counted  # type: ignore[method-assign]
        trained = sum(p.requires_grad for p in model.parameters())
        for step, x in enumerate(data):
            model(x).backward()
            # Backward queued the update of every trained parameter, a unit at a time.
            assert sum(submitted) == trained and len(submitted) > 1
            optimizer.step()
            assert sum(submitted) == trained  # optimizer.step() queues nothing more
            optimizer.zero_grad()
            submitted.clear()
            # state_dict() waits for the queued updates: every parameter has stepped once more.
            assert all(int(s["step"]) == step + 1 for s in optimizer.state_dict()["state"].values())


# -- step_in_backward="auto" (the default) ------------------------------------------------------


def test_auto_runs_a_plain_loops_cpu_step_in_backward_from_the_third_iteration() -> None:
    # The first two iterations show one backward per step, no clip and a scheduler stepping
    # after optimizer.step(): from the third, each unit's update runs beside backward, with the
    # same bits.
    reference = _train(False)
    result = _train(True)
    _assert_bitwise(reference, result)
    run = result[4]
    report = run.report()
    assert report.step_in_backward and report.step_in_backward_reason.startswith("auto: on from iteration 3")
    assert "step in backward: auto: on" in str(report)
    # The recorded (third) iteration queued its updates in backward, one job per batch of
    # gradients sent out, after it: the prediction replays the schedule the run kept.
    record = assert_cpu_step_predicted(run)
    gradients = {t["id"] for t in record.trace["tensors"] if t["kind"] == "gradient"}
    out_at = sorted({x["op"] for x in record.schedule["transfers"] if x["tensor_id"] in gradients})
    assert [job["op"] for job in record.schedule["cpu_jobs"]] == out_at


@pytest.mark.parametrize(
    "kwargs, why",
    [({"clip": 0.05}, "clips gradients"), ({"accumulate": 2}, "more than one backward")],
    ids=["clipped", "accumulated"],
)
def test_auto_keeps_the_step_at_optimizer_step_for_a_loop_that_clips_or_accumulates(
    kwargs: dict[str, Any], why: str
) -> None:
    reference = _train(False, **kwargs)
    result = _train(True, **kwargs)
    _assert_bitwise(reference, result)
    report = result[4].report()
    assert not report.step_in_backward
    assert report.step_in_backward_reason.startswith("auto: off") and why in report.step_in_backward_reason


def _loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[torch.Tensor],
    between: Optional[Any] = None,
) -> list[float]:
    """Plain steps at a constant lr; `between(step)` runs between backward and optimizer.step()."""
    losses = []
    for step, x in enumerate(data):
        loss = model(x)
        loss.backward()
        losses.append(loss.item())
        if between is not None:
            between(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _offloaded(**options: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model, optimizer = _build()
    run = teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30, update="cpu", **options)
    return model, optimizer, run


def test_auto_stays_off_where_the_loop_changes_hyperparameters_before_the_step() -> None:
    # A scheduler stepped between backward and optimizer.step(): an update in backward would
    # use the old lr.
    def scheduled(optimizer: torch.optim.Optimizer) -> Any:
        return lambda step: optimizer.param_groups[0].__setitem__("lr", 1e-2 / (2 + step))

    ref_model, ref_opt = _build()
    reference = _loop(ref_model, ref_opt, _tokens(STEPS), scheduled(ref_opt))
    model, optimizer, run = _offloaded()
    with run:
        losses = _loop(model, optimizer, _tokens(STEPS), scheduled(optimizer))
    assert losses == reference
    assert all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters()))
    report = run.report()
    assert not report.step_in_backward and "hyperparameters" in report.step_in_backward_reason


def test_auto_a_later_clip_that_scales_nothing_stands_and_turns_it_off() -> None:
    # Two plain iterations turn it on; the third clips with a bound its norm is under (the
    # update in backward is what torch would have made) and the fourth is at optimizer.step().
    def clip(step: int, model: torch.nn.Module, norms: list[float]) -> None:
        if step >= 2:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)))

    ref_model, ref_opt = _build()
    ref_norms: list[float] = []
    reference = _loop(ref_model, ref_opt, _tokens(STEPS), lambda s: clip(s, ref_model, ref_norms))
    model, optimizer, run = _offloaded()
    norms: list[float] = []
    with run:
        losses = _loop(model, optimizer, _tokens(STEPS), lambda s: clip(s, model, norms))
        assert not run.step_in_backward
    assert losses == reference and norms == ref_norms
    assert all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters()))
    reason = run.report().step_in_backward_reason
    assert reason.startswith("auto: on from iteration 3, off from iteration 4") and "clipped" in reason


@pytest.mark.parametrize("change", ["clip", "second backward", "zero_grad", "lr"])
def test_auto_a_later_loop_change_the_update_cannot_honour_raises(change: str) -> None:
    # Once on, a change the update in backward cannot take back raises, naming the option; the
    # model keeps the update that ran (three plain steps) and the session leaves cleanly.
    data = _tokens(3)
    ref_model, ref_opt = _build()
    _loop(ref_model, ref_opt, data)
    model, optimizer, run = _offloaded()
    expected = {
        "clip": "would scale",
        "second backward": "second backward",
        "zero_grad": "skip a step",
        "lr": "hyperparameters",
    }[change]
    with pytest.raises(RuntimeError, match=expected), run:
        _loop(model, optimizer, data[:2])
        assert run.step_in_backward
        model(data[2]).backward()
        if change == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-6)
        elif change == "second backward":
            model(data[2]).backward()
        elif change == "zero_grad":
            optimizer.zero_grad()
        else:
            optimizer.param_groups[0]["lr"] = 0.5
            optimizer.step()
    if change != "second backward":  # there the second backward ran partly
        assert all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters()))
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("loop", ["plain", "accumulated-clipped"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_auto_in_backward_trains_transformers_families_bitwise(family: str, loop: str) -> None:
    # A Hugging Face causal LM (SDPA, bf16 autocast; Qwen2 with tied embeddings) in the loops
    # its users write, the CPU step with "auto", the same bits as fused AdamW without offload:
    # a plain loop has the step in backward from the third iteration; one that accumulates two
    # micro-batches and clips keeps it at optimizer.step(), with the bf16 compute copies on (the
    # worker folds each micro-batch's bf16 gradients into the fp32 sums).
    from test_training import _hf_model

    build = _hf_model(family)
    generator = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 512, (2, 64), generator=generator) for _ in range(STEPS)]
    micro = 2 if loop == "accumulated-clipped" else 1

    def train(offloaded: bool) -> tuple[torch.nn.Module, list[float], Any]:
        torch.manual_seed(0)
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        options = {"whole_model": "on", "gpu_memory": 4096, "host_memory": 1 << 30, "update": "cpu"}
        if micro > 1:
            options["compute_copies"] = "on"
        run = teraio.offload(model, optimizer, **options) if offloaded else None
        losses = []
        with run if run is not None else contextlib.nullcontext():
            for tokens in data:
                for part in tokens.chunk(micro):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(input_ids=part, labels=part).loss
                    (loss / micro).backward()
                    losses.append(loss.item())
                if micro > 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # it scales
                optimizer.step()
                optimizer.zero_grad()
        return model, losses, run

    ref_model, ref_losses, _ = train(False)
    model, losses, run = train(True)
    assert losses == ref_losses
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    report = run.report()
    assert report.step_in_backward == (micro == 1), report.step_in_backward_reason
    if micro > 1:
        assert report.compute_copies == "bfloat16", report.compute_copies_reason
        assert run._loop_accumulated and run._loop_clipped


def test_auto_is_off_where_the_step_runs_on_the_gpu() -> None:
    model, optimizer = _build()
    with teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30) as run:
        train_steps(model, optimizer, _tokens(STEPS))
    report = run.report()
    assert report.update == "gpu" and not report.step_in_backward
    assert report.step_in_backward_reason.startswith("auto: off, the step runs on the GPU")


def test_step_in_backward_refuses_other_values() -> None:
    model, optimizer = _build()
    with pytest.raises(ValueError, match="step_in_backward must be True, False or 'auto'"):
        teraio.offload(model, optimizer, gpu_memory=4096, step_in_backward="on")


def test_step_in_backward_site_on_fake_machines() -> None:
    # In backward the GPU step keeps the gradient and the parameter where backward left them:
    # P + 2 S over the link. The CPU step sends the gradient out (G) beside its P + G + S of
    # host-memory work.
    params = sum(s.parameter for s in SIZES)
    site = _choose(TOTAL, None, 25 * GB, 40 * GB, in_backward=True)
    assert site.gpu_step_s == pytest.approx(5 * params / (25 * GB))
    assert site.cpu_step_s == pytest.approx(4 * params / (40 * GB) + params / (25 * GB))
    assert site.site == "cpu"
    assert _choose(TOTAL, None, 25 * GB, 15 * GB, in_backward=True).site == "gpu"


@pytest.mark.parametrize("update", ["gpu", "auto"])
def test_step_in_backward_on_the_gpu_holds_no_gradient_tier(update: str) -> None:
    # The step in backward on the GPU ("auto" keeps it there, and says so): gradients stay
    # where backward made them, so no host buffer is reserved for them.
    from teraio.runtime.modes.whole_model import IN_BACKWARD_AUTO

    model, optimizer = _build()
    with teraio.offload(
        model, optimizer, gpu_memory=4096, host_memory=1 << 30, update=update, step_in_backward=True
    ) as run:
        train_steps(model, optimizer, _tokens(2))
    report = run.report()
    assert report.update == "gpu" and report.placement["host"]["gradient"] == 0
    assert (report.update_reason == IN_BACKWARD_AUTO) == (update == "auto")


def test_the_report_hints_at_the_step_in_backward() -> None:
    from teraio.runtime.modes.whole_model import step_in_backward_hint

    base = dict(update="cpu", step_in_backward=False, steps=8, refusal="", iteration_ms=1000.0)
    assert "step_in_backward='auto'" in step_in_backward_hint(**base, cpu_wait_ms=500.0)
    # A short wait, a loop that rules the step in backward out (it clips, accumulates or
    # changes the hyperparameters before the step), the step already in backward or on the
    # GPU, or too few steps seen: no hint.
    assert step_in_backward_hint(**base, cpu_wait_ms=50.0) is None
    for change in (
        {"refusal": "the loop clips gradients"},
        {"refusal": "the loop changes the optimizer's hyperparameters between backward and optimizer.step()"},
        {"step_in_backward": True},
        {"update": "gpu"},
        {"steps": 2},
    ):
        assert step_in_backward_hint(**(base | change), cpu_wait_ms=500.0) is None


@pytest.mark.parametrize(
    "kwargs, clipped, accumulated",
    [({}, False, False), ({"clip": 0.05}, True, False), ({"accumulate": 2}, False, True)],
    ids=["plain", "clipped", "accumulated"],
)
def test_the_loop_shape_the_hint_reads(kwargs: dict[str, Any], clipped: bool, accumulated: bool) -> None:
    run = _train(True, **kwargs)[4]
    assert (run._loop_clipped, run._loop_accumulated) == (clipped, accumulated)
    assert all("step_in_backward" in h for h in run.report().hints)


# -- the choice on fake machines ---------------------------------------------------------------

#: A 3B-parameter model's fp32 state in 28 equal parameters (parameter, gradient, AdamW state).
SIZES = [cp.SlotSize(f"p{i}", 457 << 20, 457 << 20, 914 << 20) for i in range(28)]
TOTAL = sum(s.total for s in SIZES)


def _choose(
    host: int,
    store: Optional[int],
    link: float,
    cpu: Optional[float],
    requested: str = "auto",
    in_backward: bool = False,
) -> Any:
    plan = cp.place(SIZES, host_capacity_bytes=host, ssd_capacity_bytes=store, window_bytes=2 << 30)
    return cp.choose_update_site(
        SIZES,
        plan,
        requested=requested,
        host_link_bytes_per_s=link,
        cpu_update_bytes_per_s=cpu,
        in_backward=in_backward,
    )


@pytest.mark.parametrize("disk", [2 * GB, 26 * GB], ids=["slow-disk", "fast-disk"])
def test_update_site_on_fake_machines(disk: float) -> None:
    # The disk's speed decides nothing here: the CPU step needs the whole state in host memory,
    # and with any of it on the store the step streams through the GPU whatever the disk.
    del disk
    rich = _choose(TOTAL, None, 25 * GB, 40 * GB)  # RAM-rich, a CPU step at 40 GB/s of state
    assert rich.site == "cpu" and rich.cpu_step_s < rich.gpu_step_s
    # The model: the GPU step moves 2 P + G + 2 S over the link; the CPU step reads P + G + S.
    params = sum(s.parameter for s in SIZES)
    assert rich.gpu_step_s == pytest.approx(7 * params / (25 * GB))
    assert rich.cpu_step_s == pytest.approx(4 * params / (40 * GB))
    slow_cpu = _choose(TOTAL, None, 25 * GB, 10 * GB)  # RAM-rich, a slow CPU (few cores)
    assert slow_cpu.site == "gpu" and "cheaper than the CPU step" in slow_cpu.reason
    poor = _choose(TOTAL // 2, 1 << 40, 25 * GB, 40 * GB)  # RAM-poor: state on the store
    assert poor.site == "gpu" and "on the store" in poor.reason and poor.cpu_step_s is None
    assert _choose(TOTAL, None, 25 * GB, 40 * GB, requested="gpu").site == "gpu"
    with pytest.raises(ValueError, match="on the store"):
        _choose(TOTAL // 2, 1 << 40, 25 * GB, 40 * GB, requested="cpu")


# -- bytes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("update", ["gpu", "cpu"])
def test_byte_accounting_equals_the_transfers_made(monkeypatch: pytest.MonkeyPatch, update: str) -> None:
    state: dict[str, Any] = {}
    made = _count_host_copies(monkeypatch, state)
    model, optimizer = _build()
    # No read ahead: a read issued at optimizer.step() counts in the iteration that ends there,
    # or in the next where its unit's update was not done yet (the worker's timing), so the
    # counts per iteration would vary. Each unit's read at its entry counts where it is used.
    options = {"gpu_memory": 4096, "host_memory": 1 << 30, "update": update}
    options |= {"step_in_backward": False, "pull_forward_bytes": 0}
    with teraio.offload(model, optimizer, **options) as run:
        state["run"] = run
        train_steps(model, optimizer, _tokens(STEPS))
        state["run"] = None
    iterations = run._iterations
    assert len(iterations) == STEPS
    for step, counts in enumerate(iterations):
        reported = {(d, kind): n for d, tiers in counts.moved().items() for kind, n in tiers["host"].items()}
        assert reported == _by_base_kind(made[step]), step
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    moved = run.report().bytes_per_iteration
    # Next to the least this placement needs: the CPU step's gradients leave exactly once.
    least = run.report().minimum_bytes_moved
    for direction, tiers in moved.items():
        for kind, nbytes in tiers["host"].items():
            assert nbytes >= least[direction]["host"][kind], (direction, kind)
    # The GPU step reads each parameter a second time (forward, step).
    assert least["in"]["host"]["parameter"] == (params if update == "cpu" else 2 * params)
    if update == "cpu":
        assert least == {"in": {"host": {"parameter": params}}, "out": {"host": {"gradient": params}}}
        # Parameters in for forward and recomputation, gradients out: nothing else crosses.
        assert set(moved["in"]["host"]) == {"parameter"} and set(moved["out"]["host"]) == {"gradient"}
        assert moved["out"]["host"]["gradient"] == params
        assert params <= moved["in"]["host"]["parameter"] <= 2 * params
    else:
        assert moved["in"]["host"]["optimizer_state"] == moved["out"]["host"]["optimizer_state"] == 2 * params


def test_update_outside_whole_model_mode_says_it_has_no_effect() -> None:
    """A model whose state fits runs the block or tensor plan, whose optimizer steps where its
    state is: `update` is not silently ignored."""
    model, optimizer = _build()
    with pytest.warns(UserWarning, match="update='cpu' has no effect"):
        run = teraio.offload(model, optimizer, gpu_memory="1GiB", whole_model="off", update="cpu")
    assert not isinstance(run, ModelOffload)


def test_the_cpu_step_shortens_pythons_switch_interval_while_the_session_runs() -> None:
    # The worker takes the GIL back after each torch op; the loop's thread running Python holds
    # it up to one switch interval each time (benches/torch/probe_cpu_step.py).
    before = sys.getswitchinterval()
    model, optimizer = _build()
    with pytest.raises(RuntimeError, match="the loop failed"):
        with teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30, update="cpu"):
            assert sys.getswitchinterval() == CPU_STEP_SWITCH_INTERVAL_S < before
            train_steps(model, optimizer, _tokens(1))
            raise RuntimeError("the loop failed")
    assert sys.getswitchinterval() == before  # restored, on an error too
    model, optimizer = _build()
    with teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30, update="gpu"):
        assert sys.getswitchinterval() == before  # no CPU step: left as it was
    # Nested sessions (two models in one process): the interval stays short until the outer one
    # ends, and then is the one found before either.
    first, second = _build(), _build(seed=1)
    options = {"gpu_memory": 4096, "host_memory": 1 << 30, "update": "cpu"}
    with teraio.offload(*first, **options):
        with teraio.offload(*second, **options):
            train_steps(*second, _tokens(1))
        assert sys.getswitchinterval() == CPU_STEP_SWITCH_INTERVAL_S
        train_steps(*first, _tokens(1))
    assert sys.getswitchinterval() == before


def test_a_set_up_that_fails_midway_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    # The session fails after it has moved the state out, started the CPU step's worker,
    # shortened the switch interval, wrapped the forwards and taken over the optimizer's
    # methods and clip_grad_norm_: the error comes out and each of those is as it was.
    model, optimizer = _build()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    interval, clip = sys.getswitchinterval(), torch.nn.utils.clip_grad_norm_

    def fail(self: ModelOffload) -> None:
        raise RuntimeError("a failure in set-up")

    with monkeypatch.context() as patch:
        patch.setattr(ModelOffload, "_install_checkpoint_hooks", fail)
        with pytest.raises(RuntimeError, match="a failure in set-up"):
            with teraio.offload(model, optimizer, gpu_memory=4096, host_memory=1 << 30, update="cpu"):
                pass
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert sys.getswitchinterval() == interval and torch.nn.utils.clip_grad_norm_ is clip
    assert not {"step", "zero_grad", "state_dict"} & set(optimizer.__dict__)
    assert all("forward" not in module.__dict__ for module in model.modules())
    # And the model trains as if nothing had happened.
    reference = _train(False)
    losses = train_steps(model, optimizer, _tokens(STEPS))
    assert losses == reference[2]
