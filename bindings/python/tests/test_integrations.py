"""teraio inside the libraries that own the training loop (`teraio.integrations`), on CPU with a
tiny Hugging Face model: the Trainer's callback, Accelerate's prepared loop and Lightning's
callback each train with losses and parameters bitwise equal to the same run without teraio,
leave no hook behind (after a failing run too) and keep the report."""

from __future__ import annotations

from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")


STEPS = 6

#: Settings under which the tiny model's iterations are planned and offloaded on a CPU "device"
#: (the tensor plan, as test_training.py drives it), with a budget far below the run's needs.
SETTINGS: dict[str, Any] = {
    "host_memory": 1 << 30,
    "host_link_bandwidth": "2GB/s",
    "reserve": 0,
    "min_bytes": 16 << 10,
    "if_no_fit": "run",
    "granularity": "tensor",
}


def _tiny_llama() -> torch.nn.Module:
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def _budget(model: torch.nn.Module) -> int:
    return 6 * sum(p.numel() * p.element_size() for p in model.parameters())


def _token_rows(count: int, seed: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (128,), generator=generator) for _ in range(count)]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    for name, value in reference.items():
        assert torch.equal(state[name], value), name


def _assert_no_hooks(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Nothing of a teraio session is left: module hooks and instance forwards, the optimizer's
    step hooks and instance methods, saved-tensor hooks, torch's clip_grad_norm_."""
    for name, module in model.named_modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, name
        assert "forward" not in module.__dict__ or name == "", name
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    for method in ("step", "zero_grad"):  # on the instance: a scheduler's wrapper may be there
        assert "teraio" not in (getattr(optimizer.__dict__.get(method), "__module__", None) or ""), method
    assert not torch._C._autograd._top_saved_tensors_default_hooks(False)
    from teraio.runtime import session

    assert not session._CLIPPING


# -- Hugging Face Trainer ----------------------------------------------------------------------


def _hf_trainer(tmp_path: Any, callbacks: list[Any], accumulation: int = 1, **args: Any) -> Any:
    tf = pytest.importorskip("transformers")

    class Recording(tf.Trainer):
        """Keeps each micro-batch's loss as the Trainer computed it."""

        losses: list[float]

        def training_step(self, *a: Any, **k: Any) -> Any:
            loss = super().training_step(*a, **k)
            self.losses.append(loss.item())
            return loss

    rows = _token_rows(STEPS * 2 * accumulation)
    data = [{"input_ids": row, "labels": row} for row in rows]
    arguments = tf.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=STEPS,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        warmup_steps=2,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **args,
    )
    trainer = Recording(model=_tiny_llama(), args=arguments, train_dataset=data, callbacks=callbacks)
    trainer.losses = []
    return trainer


#: The modes beside the tensor plan (SETTINGS): the block plan (the default for this model) and
#: whole-model mode, whose gradients held off the GPU the Trainer's `model.zero_grad()` must not
#: leave behind.
BLOCK = {**SETTINGS, "granularity": "block"}
WHOLE = {**SETTINGS, "whole_model": "on", "min_bytes": 0}


@pytest.mark.parametrize(
    "accumulation, bf16, options",
    [(1, False, SETTINGS), (2, True, SETTINGS), (2, True, BLOCK), (2, False, WHOLE)],
    ids=["tensor", "tensor-accumulate-bf16", "block-accumulate-bf16", "whole-model-accumulate"],
)
def test_trainer_callback_bitwise(
    tmp_path: Any, accumulation: int, bf16: bool, options: dict[str, Any]
) -> None:
    # The Trainer's own loop: clipping (max_grad_norm=1), a scheduler, accumulation through
    # gradient_accumulation_steps, bf16 autocast through its Accelerator.
    from teraio.integrations.transformers import OffloadCallback

    reference = _hf_trainer(tmp_path, [], accumulation, bf16=bf16)
    reference.train()
    ref_state = _state(reference.model)

    callback = OffloadCallback(gpu_memory=_budget(_tiny_llama()), **options)
    trainer = _hf_trainer(tmp_path, [callback], accumulation, bf16=bf16)
    with callback:
        trainer.train()
    assert len(trainer.losses) == STEPS * accumulation
    assert trainer.losses == reference.losses
    _assert_same_state(trainer.model, ref_state)
    report = callback.report()
    assert report.steps == STEPS
    mode = {id(SETTINGS): "TensorOffload", id(BLOCK): "BlockOffload", id(WHOLE): "ModelOffload"}[id(options)]
    assert type(callback.run).__name__ == mode
    if options is WHOLE:
        assert report.units > 0
    else:
        assert report.planned_steps > 0
    if options is BLOCK:
        # The Trainer's Accelerator wraps the model for bf16: no fp32 copy of the logits. Its loss
        # is divided by the tokens of all micro-batches inside the head, so backward gives it 1.
        assert "fp32 copy of the outputs left out" in report.loss_head, report.loss_head
        assert "gradient in forward" in report.loss_head, report.loss_head
    _assert_no_hooks(trainer.model, trainer.optimizer.optimizer)


def _sft_trainer(tmp_path: Any, callbacks: list[Any], **config: Any) -> Any:
    """trl's SFTTrainer on pre-tokenized rows, with a word-level tokenizer made here (no download)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    tf = pytest.importorskip("transformers")
    model = _tiny_llama()
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="t0")),
        pad_token="t0",
        eos_token="t1",
    )
    rows = datasets.Dataset.from_dict({"input_ids": [row.tolist() for row in _token_rows(STEPS * 2 * 2)]})
    arguments = trl.SFTConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **config,
    )
    return trl.SFTTrainer(
        model=model, args=arguments, train_dataset=rows, processing_class=tokenizer, callbacks=callbacks
    )


def test_trl_sft_trainer_callback_bitwise(tmp_path: Any) -> None:
    # SFTConfig turns Hugging Face checkpointing and bf16 on by default; teraio plans its own
    # recomputation, so the user turns checkpointing off (the default is refused, below).
    from teraio.integrations.transformers import OffloadCallback

    reference = _sft_trainer(tmp_path, [], gradient_checkpointing=False)
    reference.train()
    ref_state = _state(reference.model)

    callback = OffloadCallback(gpu_memory=_budget(_tiny_llama()), **BLOCK)
    trainer = _sft_trainer(tmp_path, [callback], gradient_checkpointing=False)
    with callback:
        trainer.train()
    _assert_same_state(trainer.model, ref_state)
    assert type(callback.run).__name__ == "BlockOffload"
    assert callback.report().planned_steps > 0
    _assert_no_hooks(trainer.model, trainer.optimizer.optimizer)


def test_trl_sft_trainer_default_checkpointing_refused(tmp_path: Any) -> None:
    from teraio.integrations.transformers import OffloadCallback

    with pytest.raises(ValueError, match="gradient checkpointing is on"):
        _sft_trainer(tmp_path, [OffloadCallback(gpu_memory="1GiB")])


class _FailAt:
    """A Trainer callback that raises once the Trainer reaches `step` (its on_step_end)."""

    def __init__(self, step: int) -> None:
        tf = pytest.importorskip("transformers")
        outer = self

        class Fail(tf.TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step == outer.step:
                    raise RuntimeError("failing on purpose")

        self.step = step
        self.callback = Fail()


def test_trainer_failure_leaves_no_hooks(tmp_path: Any) -> None:
    from teraio.integrations.transformers import OffloadCallback

    callback = OffloadCallback(gpu_memory=_budget(_tiny_llama()), **SETTINGS)
    trainer = _hf_trainer(tmp_path, [callback, _FailAt(3).callback])
    with pytest.raises(RuntimeError, match="failing on purpose"):
        with callback:
            trainer.train()
    assert not callback._held.active
    _assert_no_hooks(trainer.model, trainer.optimizer.optimizer)
    assert callback.report().steps == 3


def test_trainer_session_left_open_is_closed_by_the_next_train(tmp_path: Any, caplog: Any) -> None:
    # Without the context manager the Trainer's failure leaves the session open (the Trainer
    # calls no callback then); the next train() closes it before it opens its own.
    from teraio.integrations.transformers import OffloadCallback

    callback = OffloadCallback(gpu_memory=_budget(_tiny_llama()), **SETTINGS)
    failing = _FailAt(2)
    trainer = _hf_trainer(tmp_path, [callback, failing.callback])
    with pytest.raises(RuntimeError, match="failing on purpose"):
        trainer.train()
    first = callback.run
    assert callback._held.active and first._hooks
    failing.step = -1
    with caplog.at_level("INFO", logger="teraio.integrations.transformers"):
        trainer.train()
    assert not first._hooks and callback.run is not first
    assert [r.getMessage() for r in caplog.records].count(f"teraio.offload report:\n{callback.report()}") == 1
    _assert_no_hooks(trainer.model, trainer.optimizer.optimizer)
    assert callback.report().steps == STEPS


def test_trainer_gradient_checkpointing_refused(tmp_path: Any) -> None:
    from teraio.integrations.transformers import OffloadCallback

    callback = OffloadCallback(gpu_memory="1GiB")
    tf = pytest.importorskip("transformers")
    # transformers 5 renamed the argument and the model's method (the old names warn).
    renamed = hasattr(tf.TrainingArguments, "activation_checkpointing")
    with pytest.raises(ValueError, match="gradient checkpointing is on"):
        _hf_trainer(
            tmp_path, [callback], **{f"{'activation' if renamed else 'gradient'}_checkpointing": True}
        )
    # Turned on on the model itself after the Trainer was made: refused as training begins.
    trainer = _hf_trainer(tmp_path, [callback])
    model = trainer.model
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.raises(ValueError, match="gradient checkpointing is on"):
        trainer.train()
    assert not callback._held.active


def test_callback_options_checked_when_made() -> None:
    from teraio.integrations.transformers import OffloadCallback

    with pytest.raises(TypeError, match="unknown teraio.offload option"):
        OffloadCallback(gpu_memory="1GiB", bogus=1)
    with pytest.raises(ValueError):
        OffloadCallback(gpu_memory="lots")
    with pytest.raises(RuntimeError, match="after training"):
        OffloadCallback(gpu_memory="1GiB").report()


# -- Accelerate --------------------------------------------------------------------------------


def _accelerate_loop(
    helper: Optional[bool], accumulation: int, fail_at: int = -1, options: Optional[dict[str, Any]] = None
) -> tuple[list[float], Any, Any, Any]:
    """The loop as Accelerate's docs write it, bf16 mixed precision, `accelerator.accumulate`,
    clipping and a scheduler; under teraio (`helper`: through the integration, else
    `teraio.offload` on the prepared objects as they are) or not (`helper` None)."""
    accelerate = pytest.importorskip("accelerate")
    import teraio
    from accelerate.utils import GradientAccumulationPlugin
    from teraio.integrations import accelerate as teraio_accelerate

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(
        cpu=True,
        mixed_precision="bf16",
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=accumulation, sync_with_dataloader=False
        ),
    )
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    rows = torch.stack(_token_rows(STEPS * accumulation * 2)).view(STEPS * accumulation, 2, 128)
    loader = torch.utils.data.DataLoader(list(rows), batch_size=None)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    inner = optimizer.optimizer

    def train() -> list[float]:
        losses = []
        for index, tokens in enumerate(loader):
            if index == fail_at:
                raise RuntimeError("failing on purpose")
            with accelerator.accumulate(model):
                loss = model(input_ids=tokens, labels=tokens).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    if helper is None:
        return train(), model, inner, None
    budget = _budget(model)
    if helper:
        run = teraio_accelerate.offload(
            accelerator, model, optimizer, gpu_memory=budget, **(options or SETTINGS)
        )
    else:
        run = teraio.offload(model, optimizer, gpu_memory=budget, **SETTINGS)
    try:
        with run:
            losses = train()
    finally:
        _assert_no_hooks(model, inner)
    return losses, model, inner, run


@pytest.mark.parametrize(
    "helper, accumulation, options",
    [(False, 1, SETTINGS), (True, 1, SETTINGS), (True, 2, SETTINGS), (True, 2, BLOCK)],
    ids=["as-prepared", "helper", "helper-accumulate", "helper-accumulate-block"],
)
def test_accelerate_prepared_loop_bitwise(helper: bool, accumulation: int, options: dict[str, Any]) -> None:
    reference, model, _, _ = _accelerate_loop(None, accumulation)
    ref_state = _state(model)
    losses, model, _, run = _accelerate_loop(helper, accumulation, options=options)
    assert len(losses) == STEPS * accumulation
    assert losses == reference
    _assert_same_state(model, ref_state)
    report = run.report()
    assert report.steps == STEPS  # the real steps, not the micro-batches
    assert report.planned_steps > 0


def test_accelerate_failure_leaves_no_hooks() -> None:
    with pytest.raises(RuntimeError, match="failing on purpose"):
        _accelerate_loop(True, 1, fail_at=3)


def test_accelerate_refuses_what_is_not_an_accelerator() -> None:
    pytest.importorskip("accelerate")
    import teraio
    from teraio.integrations import accelerate as teraio_accelerate

    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="expected an accelerate.Accelerator"):
        teraio_accelerate.offload(object(), model, optimizer, gpu_memory="1GiB")
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        teraio.offload(model, object(), gpu_memory="1GiB")


# -- PyTorch Lightning -------------------------------------------------------------------------


def _lightning_fit(
    offloading: bool,
    manual: bool,
    accumulation: int,
    fail_at: int = -1,
    extra: Any = None,
    options: Optional[dict[str, Any]] = None,
) -> tuple[list[float], Any, Any, Any]:
    """A LightningModule around the tiny model, fitted in bf16 mixed precision with clipping and
    accumulation (Lightning's own in automatic optimization, the module's in manual), with
    teraio's callback (`offloading`) or without."""
    pl = pytest.importorskip("lightning.pytorch")
    from teraio.integrations.lightning import OffloadCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _tiny_llama()
            self.automatic_optimization = not manual
            self.losses: list[float] = []

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=tokens, labels=tokens).loss

        def training_step(self, tokens: torch.Tensor, index: int) -> Any:
            if index == fail_at:
                raise RuntimeError("failing on purpose")
            loss = self(tokens)
            self.losses.append(loss.item())
            if not manual:
                return loss
            optimizer = self.optimizers()
            self.manual_backward(loss / accumulation)
            if (index + 1) % accumulation == 0:
                self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
                optimizer.step()
                optimizer.zero_grad()
            return None

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Module()
    rows = torch.stack(_token_rows(STEPS * accumulation * 2)).view(STEPS * accumulation, 2, 128)
    loader = torch.utils.data.DataLoader(list(rows), batch_size=None)
    callback = OffloadCallback(gpu_memory=_budget(module), **(options or SETTINGS)) if offloading else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=([callback] if callback else []) + ([extra] if extra else []),
        **({} if manual else {"gradient_clip_val": 1.0, "accumulate_grad_batches": accumulation}),
    )
    trainer.fit(module, loader)
    return module.losses, module, trainer.optimizers[0], callback


@pytest.mark.parametrize(
    "manual, accumulation, options",
    [(False, 1, SETTINGS), (False, 2, SETTINGS), (True, 2, SETTINGS), (False, 2, BLOCK)],
    ids=["automatic", "automatic-accumulate", "manual-accumulate", "automatic-accumulate-block"],
)
def test_lightning_callback_bitwise(manual: bool, accumulation: int, options: dict[str, Any]) -> None:
    reference, module, _, _ = _lightning_fit(False, manual, accumulation)
    ref_state = _state(module)
    losses, module, optimizer, callback = _lightning_fit(True, manual, accumulation, options=options)
    assert len(losses) == STEPS * accumulation
    assert losses == reference
    _assert_same_state(module, ref_state)
    report = callback.report()
    assert report.steps == STEPS
    assert report.planned_steps > 0
    _assert_no_hooks(module, optimizer)


def test_lightning_step_hooks_fire_after_backward() -> None:
    # Automatic optimization runs forward and backward in the closure it passes to
    # optimizer.step: under the callback the step's hooks (teraio's, and these, registered after
    # them) fire once backward is done, as in a plain loop.
    pl = pytest.importorskip("lightning.pytorch")
    order: list[str] = []

    class Record(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            module.register_forward_pre_hook(lambda *_: order.append("forward"))
            trainer.optimizers[0].register_step_pre_hook(lambda *_: order.append("step"))

    _lightning_fit(True, False, 1, extra=Record())
    assert order == ["forward", "step"] * STEPS


def test_lightning_failure_leaves_no_hooks() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from teraio.integrations.lightning import OffloadCallback

    seen: list[Any] = []
    original = OffloadCallback.on_exception

    def on_exception(self: Any, trainer: Any, module: Any, exception: BaseException) -> None:
        seen.append((module, trainer.optimizers[0]))
        original(self, trainer, module, exception)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OffloadCallback, "on_exception", on_exception)
        with pytest.raises(RuntimeError, match="failing on purpose"):
            _lightning_fit(True, False, 1, fail_at=3)
    assert pl is not None and len(seen) == 1
    _assert_no_hooks(*seen[0])


def test_lightning_refuses_several_optimizers() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from teraio.integrations.lightning import OffloadCallback

    class Two(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.automatic_optimization = False

        def training_step(self, x: torch.Tensor, index: int) -> None:
            return None

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.a.parameters()), torch.optim.SGD(self.b.parameters())]

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[OffloadCallback(gpu_memory="1GiB")],
    )
    with pytest.raises(ValueError, match="configures 2 optimizers"):
        trainer.fit(Two(), torch.utils.data.DataLoader([torch.zeros(4)]))


# -- the Trainer benchmark ---------------------------------------------------------------------


def test_bench_trainer_rows_on_cpu(tmp_path: Any) -> None:
    # benches/torch/bench_trainer.py's rows with its tiny CPU model: the teraio row trains with
    # the ideal row's losses, bitwise, and reports; the script's argument checks hold.
    pytest.importorskip("transformers")
    import json
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[3] / "benches" / "torch" / "bench_trainer.py"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    common = ["--tiny", "--family", "llama", "--steps", "5", "--warmup", "2", "--batch", "2", "--seq", "64"]

    def row(*extra: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, str(script), "run", *common, *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-2000:]
        return json.loads(lines[0][7:])

    ideal = row("--mode", "ideal")
    teraio_row = row("--mode", "teraio", "--cap-bytes", str(1 << 30), "--store-gib", "0.25")
    assert "error" not in teraio_row, teraio_row.get("error")
    assert len(ideal["losses"]) == 5 and teraio_row["losses"] == ideal["losses"]
    assert teraio_row["teraio_report"]["steps"] == 5
    # The scratch folder (store file, Trainer output) is gone (torch may leave its own).
    assert [p for p in tmp_path.iterdir() if p.name.startswith("teraio")] == []
    bad = subprocess.run(
        [sys.executable, str(script), "run", *common, "--mode", "teraio", "--warmup", "9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--warmup must be below --steps" in bad.stderr
