"""Training as users train, on a CPU "device": block checkpointing in the plan, a plain PyTorch
transformer, tiny transformers models in bf16 autocast with SDPA; losses and parameters bitwise
equal to training without offload."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import teraio  # noqa: E402
from teraio import blocks as teraio_blocks  # noqa: E402
from tiny import batches, make, train  # noqa: E402

STEPS = 6


def _peak_and_activations(
    model: Any, optimizer: Any, step: Callable[[Any], Any], data: list[Any]
) -> tuple[int, int]:
    step(data[0])
    profiler = teraio.Profiler(model, optimizer)
    with profiler:
        step(data[1])
    trace = profiler.trace()
    result = teraio.plan(trace, gpu_memory=1 << 40, ssd_read_bandwidth=1e9)
    activations = sum(t["size_bytes"] for t in trace["tensors"] if t["kind"] == "activation")
    return result["prediction"]["unplanned_peak_bytes"], activations


def _tiny_step(model: Any, optimizer: Any) -> Callable[[Any], float]:
    def step(x: Any) -> float:
        return train(model, optimizer, [x])[0]

    return step


def _offload_below_peak(data: list[Any], share: int, **options: Any) -> tuple[Any, Any, Any]:
    """A fresh tiny model and optimizer, and `teraio.offload` on them (not entered) with
    gpu_memory the unplanned peak less 1/`share` of the activations, as profiled on another fresh
    copy, no reserve and saved tensors from 64 KiB."""
    model, optimizer = make()
    peak, activations = _peak_and_activations(model, optimizer, _tiny_step(model, optimizer), data)
    model, optimizer = make()
    run = teraio.offload(
        model,
        optimizer,
        gpu_memory=peak - activations // share,
        reserve=0,
        min_bytes=64 << 10,
        **options,
        granularity="tensor",
    )
    return model, optimizer, run


def test_checkpointing_wins_where_nothing_can_be_moved() -> None:
    # No host memory and no store: only recomputation can make it fit. Per-tensor recipes off,
    # so whole-block checkpointing must carry it; results stay bitwise equal.
    data = batches(STEPS, rows=2048)
    model, optimizer = make()
    reference = train(model, optimizer, data)
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer, run = _offload_below_peak(
        data, 2, host_memory=0, host_link_bandwidth="10GB/s", recompute="off", checkpoint="auto"
    )
    with run:
        losses = train(model, optimizer, data)
    report = run.report()
    assert losses == reference
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref_state.items())
    assert report.plan_summary["fits"] is True
    assert report.checkpointed_blocks, report.checkpoint_summary
    assert report.plan_summary["migrations"] == 0
    chosen = [t for t in report.checkpoint_summary["tried"] if t["chosen"]]
    assert len(chosen) == 1 and chosen[0]["blocks"] == len(report.checkpointed_blocks)
    # Without checkpointing nothing fits in time (no tier to move to): slower, if it fits at all.
    none = [t for t in report.checkpoint_summary["tried"] if t["blocks"] == 0][0]
    slower = none["predicted_ms"] is None or none["predicted_ms"] > chosen[0]["predicted_ms"]
    assert not none["fits"] or slower
    # The blocks are plain modules again afterwards.
    assert all("forward" not in layer.__dict__ for layer in model.layers)


def test_offload_wins_on_a_fast_link() -> None:
    # Host memory and a fast link: moving saved tensors costs nothing, recomputing a block costs
    # its forward time, so no block is checkpointed.
    data = batches(STEPS, rows=2048)
    model, optimizer, run = _offload_below_peak(
        data, 2, host_memory=1 << 30, host_link_bandwidth="1000GB/s", recompute="off"
    )
    with run:
        train(model, optimizer, data)
    report = run.report()
    assert report.plan_summary["fits"] is True
    assert report.checkpointed_blocks == []
    assert report.plan_summary["host_migrations"] > 0


def test_never_predicted_slower_than_checkpointing_every_block() -> None:
    # A slow link: every candidate (0 .. all blocks checkpointed, with per-tensor recompute or
    # not) is planned; the chosen one's prediction is the lowest, so at most that of
    # checkpointing every block.
    data = batches(STEPS, rows=2048)
    model, optimizer, run = _offload_below_peak(
        data, 3, host_memory=1 << 30, host_link_bandwidth="5MB/s", checkpoint="auto"
    )
    with run:
        train(model, optimizer, data)
    report = run.report()
    tried = report.checkpoint_summary["tried"]
    all_blocks = [t for t in tried if t["blocks"] == report.checkpoint_summary["usable"]]
    assert len(all_blocks) == 1 and all_blocks[0]["fits"]
    assert report.predicted_iteration_ms is not None
    assert report.predicted_iteration_ms <= all_blocks[0]["predicted_ms"] * 1.0001
    assert report.recomputed_bytes_per_iteration > 0 or report.checkpointed_blocks


@pytest.mark.parametrize("blocks", [2, 4])
def test_checkpointed_blocks_keep_the_plans_event_numbering(
    blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inside a checkpointed block every save goes to checkpoint's own hooks, the weights' and
    # the block input's too, so backward's unpacks of them never reach the runtime: the plan's
    # events must leave out every one of them, or its prefetch points (event indices) fall on
    # other events. Some blocks or all, with per-tensor recompute and offload besides.
    monkeypatch.setattr(teraio_blocks, "candidate_counts", lambda usable, mode: [blocks])
    data = batches(STEPS, rows=2048)
    model, optimizer = make()
    reference = train(model, optimizer, data)
    model, optimizer, run = _offload_below_peak(
        data, 2, host_memory=1 << 30, host_link_bandwidth="1GB/s", recompute="on", checkpoint="auto"
    )
    seen: list[str] = []
    pack, unpack = run.executor.pack, run.executor.unpack
    run.executor.pack = lambda tensor: (seen.append("pack"), pack(tensor))[1]
    run.executor.unpack = lambda packed: (seen.append("unpack"), unpack(packed))[1]
    with run:
        losses = []
        for x in data:
            seen.clear()
            losses.append(train(model, optimizer, [x])[0])
    report = run.report()
    assert losses == reference
    assert len(report.checkpointed_blocks) == blocks
    if blocks < 4:  # with every block checkpointed, no saved tensor is left to recompute
        assert report.recomputed_bytes_per_iteration > 0
    assert seen == [event.kind for event in run._events]
    assert report.stalls["plan_mismatches"] == 0
    assert report.stalls["event_misalignments"] == 0
    assert report.stalls["prefetches_on_demand"] == 0


@pytest.mark.parametrize("faster", ["all_blocks", "chosen"])
def test_plan_measured_against_checkpointing_every_block(
    faster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fast link: the plan offloads and checkpoints no block; checkpointing every block fits
    # too. One planned iteration of each is timed (fake times here: which one the machine runs
    # faster is the point) and the faster one keeps running, exact either way.
    monkeypatch.setattr(teraio_blocks, "candidate_counts", lambda usable, mode: [0, usable])
    data = batches(STEPS, rows=2048)
    model, optimizer = make()
    reference = train(model, optimizer, data)
    model, optimizer, run = _offload_below_peak(
        data, 2, host_memory=1 << 30, host_link_bandwidth="1000GB/s", recompute="off", checkpoint="auto"
    )
    blocks_per_step: list[int] = []
    timed_faster = 1 if faster == "all_blocks" else 2  # the trial's second timed step: chosen

    def iteration_ms(step: int) -> float:
        return 1.0 if step == run._trial_steps[timed_faster] else 2.0

    monkeypatch.setattr(run, "_iteration_ms", iteration_ms)
    with run:
        losses = []
        for x in data:
            losses.append(train(model, optimizer, [x])[0])
            # The next step's plan is in place once a step ends: its blocks, and whether the
            # first block runs under checkpoint.
            blocks_per_step.append((len(run.checkpoint_blocks), "forward" in model.layers[0].__dict__))
    report = run.report()
    assert losses == reference
    measured = report.checkpoint_summary["measured"]
    assert measured["kept"] == faster and measured["steps"] == [3, 4]
    # Steps 2 and 4 ran the chosen plan (no block), step 3 every block, step 5 the faster.
    last = (4, True) if faster == "all_blocks" else (0, False)
    assert blocks_per_step[1:5] == [(0, False), (4, True), (0, False), last]
    assert [t["blocks"] for t in report.checkpoint_summary["tried"] if t["chosen"]] == [
        4 if faster == "all_blocks" else 0
    ]
    assert len(report.checkpointed_blocks) == (4 if faster == "all_blocks" else 0)
    assert report.stalls["plan_mismatches"] == 0
    assert report.stalls["event_misalignments"] == 0
    assert report.stalls["prefetches_on_demand"] == 0


def test_plan_events_follow_what_checkpoint_itself_saves() -> None:
    # torch 2.11's checkpoint saves an empty dummy ahead of a block's inputs and unpacks it with
    # them where backward recomputes the block (a plan that assumed the inputs alone numbered
    # every later save one off per block); 2.15 saves the inputs
    # alone. The rewrite follows the pattern measured on this torch, here given as 2.11's.
    data = batches(3, rows=512)
    model, optimizer = make()
    with teraio.offload(
        model, optimizer, gpu_memory=1 << 40, checkpoint="all", reserve=0, granularity="tensor"
    ) as run:
        train(model, optimizer, data)
    assert teraio_blocks.checkpoint_saves().saves_inputs
    records = list(run.block_records.values())
    names = [name for name, _ in run.blocks]
    durations = [op["duration_us"] for op in run.trace["ops"]]

    def events(saves: teraio_blocks.CheckpointSaves) -> list[tuple[str, Any]]:
        rewritten = teraio_blocks.checkpoint_trace(
            run.trace, run.profiler.events, records, names, durations, saves=saves
        )
        assert rewritten.blocks == names
        return [(e.kind, e.tensor_id) for e in rewritten.events]

    inputs_only = events(teraio_blocks.CheckpointSaves())
    with_dummy = events(teraio_blocks.CheckpointSaves(True, 1, 0, 1, 0))
    assert len(with_dummy) == len(inputs_only) + 2 * len(names)
    # Each block input's pack and its unpack come right after a dummy's; the rest is unchanged.
    block_inputs = {r.inputs[0] for r in records}
    expected = []
    for kind, tensor_id in inputs_only:
        if tensor_id in block_inputs and (kind, tensor_id) not in expected:
            expected.append((kind, None))
        expected.append((kind, tensor_id))
    assert with_dummy == expected


class PlainTransformer(torch.nn.Module):
    """A plain PyTorch model (no Hugging Face): embedding, encoder layers, a head."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, 4, dim * 4, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def _bitwise_against_reference(
    build: Callable[[], torch.nn.Module],
    data: list[torch.Tensor],
    loss_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    budget: Callable[[int], int] = lambda params: params * 6,
    **options: Any,
) -> Any:
    """Trains `build()` on `data` without offload and under `teraio.offload` at `budget(parameter
    bytes)` (`options` override the tensor plan's settings here); asserts losses and final state
    are bitwise equal and returns the offload run (its `report()` and plan)."""

    def run_steps(model: torch.nn.Module, optimizer: Any) -> list[float]:
        losses = []
        for tokens in data:
            loss = loss_of(model, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = run_steps(model, optimizer)
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    # Same seed, same steps, under teraio with a budget well below the run's needs.
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    settings: dict[str, Any] = {
        "host_memory": 1 << 30,
        "checkpoint": "auto",
        "host_link_bandwidth": "2GB/s",
        "reserve": 0,
        "min_bytes": 16 << 10,
        "if_no_fit": "run",
        "granularity": "tensor",
    }
    with teraio.offload(model, optimizer, gpu_memory=budget(params), **{**settings, **options}) as run:
        losses = run_steps(model, optimizer)
    assert losses == reference
    for name, value in ref_state.items():
        assert torch.equal(model.state_dict()[name], value), name
    return run


def _tensor_plan_bitwise(*args: Any, **options: Any) -> teraio.Report:
    report = _bitwise_against_reference(*args, **options).report()
    assert report.planned_steps == STEPS - 2
    return report


def test_plain_pytorch_transformer_bitwise() -> None:
    generator = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 128), generator=generator) for _ in range(STEPS)]
    report = _tensor_plan_bitwise(PlainTransformer, data, lambda model, tokens: model(tokens))
    moved = report.bytes_per_iteration["offloaded"]["host"] + report.recomputed_bytes_per_iteration
    assert moved > 0 or report.checkpointed_blocks


def _hf_model(family: str, use_cache: bool = False) -> Callable[[], torch.nn.Module]:
    tf = pytest.importorskip("transformers")
    common = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    configs = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
    }
    config_class, model_class, extra = configs[family]

    def build() -> torch.nn.Module:
        config = config_class(**common, **extra)
        config._attn_implementation = "sdpa"
        model = model_class(config)
        model.config.use_cache = use_cache
        return model

    return build


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_transformers_bf16_autocast_sdpa_bitwise(family: str) -> None:
    build = _hf_model(family)
    generator = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 512, (2, 128), generator=generator) for _ in range(STEPS)]

    def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=tokens, labels=tokens).loss

    report = _tensor_plan_bitwise(build, data, loss_of)
    assert report.checkpoint_summary["blocks"] == 3
    assert report.plan_summary["fits"] is True


@pytest.mark.parametrize(
    "mode",
    [
        {"granularity": "block"},
        {"granularity": "tensor", "checkpoint": "all"},
        {"whole_model": "on", "granularity": "block"},
    ],
    ids=["block", "tensor", "whole-model"],
)
def test_transformers_default_cache_trains_bitwise(mode: dict[str, Any]) -> None:
    """A model as `from_pretrained` gives it (`use_cache=True` in its config) in a plain loop:
    teraio recomputes its blocks, which would update the key/value cache a second time in
    backward, so it passes `use_cache=False` to training forwards, as transformers does under
    its own checkpointing (said once), and trains to the bits of the loop without offload."""
    build = _hf_model("llama", use_cache=True)
    assert build().config.use_cache
    generator = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 512, (2, 64), generator=generator) for _ in range(STEPS)]

    def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens, labels=tokens).loss

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _bitwise_against_reference(build, data, loss_of, **mode)
    cache = [w for w in said if "use_cache=False" in str(w.message)]
    assert len(cache) == 1, [str(w.message) for w in said]
