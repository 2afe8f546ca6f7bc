"""Training as users train: teraio against activation checkpointing and the offloaders at a cap.

Models from transformers configs (random init, fixed seed: nothing is downloaded) with their real
vocabularies, SDPA attention, AdamW, and either bf16 autocast over fp32 master weights
(`--dtype autocast`, the default) or pure bf16 weights (`--dtype bf16`):

    llama    Llama-3.2-1B shape: vocab 128256, tied embeddings, hidden 2048, 16 layers, GQA 32/8
    llama3b  Llama-3.2-3B shape: vocab 128256, tied embeddings, hidden 3072, 28 layers, GQA 24/8
             (the capacity benchmark's larger model: 3.2B parameters, 51 GB of training state)
    llama7b  Llama-2-7B's layers (hidden 4096, 32 layers, MLP 11008) with Llama 3's vocabulary
             (128256, tied) and GQA 32/8: 6.2B parameters, 99 GB of training state, the largest
             Llama shape whose state fits the H100 machine's 125 GiB of RAM
    qwen2    Qwen2-1.5B shape: vocab 151936, tied embeddings, hidden 1536, 28 layers, GQA 12/2
    mistral  Mistral-7B-v0.3 vocabulary (32768) and layout, scaled to hidden 2048 and 20 layers
    neox     Pythia-1.4B shape (GPT-NeoX): vocab 50304, hidden 2048, 24 layers

Modes (what a user already has, and teraio as a user writes it):

    ideal        no offload, no checkpointing, no cap
    teraio       teraio.offload(model, optimizer, store=store, gpu_memory=cap): default arguments
    hf_ckpt      model.gradient_checkpointing_enable(use_reentrant=False): every decoder layer
    sac          torch's selective activation checkpointing per decoder layer: matmul and
                 attention outputs saved, everything else (norms, rotary, activations,
                 elementwise) recomputed (`sac_policy`)
    save_on_cpu  torch.autograd.graph.save_on_cpu(pin_memory=True)
    torchtune    torchtune.training.OffloadActivations (0.6.1; streams and pinned memory on)

Two commands. `run` trains one mode in this process and prints one `RESULT {json}` line (an
out-of-memory error is a row with "oom": true, not a crash):

    python3 benches/torch/bench_regime.py run --family qwen2 --mode ideal
    python3 benches/torch/bench_regime.py run --family qwen2 --mode teraio --cap-bytes 41600000000

`table` makes the whole table in one call: per family, `ideal` twice (its run-to-run spread is
the yardstick for loss agreement), then every mode at each cap (fractions of the first ideal
run's peak allocated memory, `torch.cuda.set_per_process_memory_fraction`), each in its own
process under a time limit; rows go to OUT/results.jsonl and the table is printed
(summarize.py). Rows that do not fit the deadline are recorded as skipped.

    python3 benches/torch/bench_regime.py table --families llama,qwen2 --out-dir /tmp/regime
    python3 benches/torch/bench_regime.py table --tiny --out-dir /tmp/regime-cpu   # CPU, tiny

ms/iter is the median of the steps after the warm-up ones (each step ends at `loss.item()`, which
waits for the compute stream); peaks are the CUDA allocator's over those steps. The row runner,
the store, the table and the shared options live in rows.py (bench_loops.py and bench_trainer.py
use them too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import baselines  # noqa: E402  (beside this script)
import rows  # noqa: E402
from rows import jsonable  # noqa: E402, F401  (bench_capacity.py's reports use bench_regime.jsonable)

MODES = ["ideal", "teraio", "hf_ckpt", "sac", "save_on_cpu", "torchtune"]

#: family -> (transformers config class, model class, config arguments). Rope and norm settings
#: are left at the classes' defaults: they change neither memory nor time.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
    "llama3b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128256,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
    "llama7b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            use_sliding_window=False,
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            vocab_size=32768,
            hidden_size=2048,
            intermediate_size=7168,
            num_hidden_layers=20,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
            max_position_embeddings=32768,
            # A sliding window would make SDPA take an explicit mask (no flash kernel); at 2048
            # tokens it would not change the result.
            sliding_window=None,
        ),
    ),
    "neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=24,
            num_attention_heads=16,
            tie_word_embeddings=False,
            max_position_embeddings=2048,
        ),
    ),
}

#: `--tiny` (CPU tests of this script): two small layers and a small vocabulary (bf16 matmuls
#: with a real one take seconds per step on a CPU).
TINY = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)


def build_model(family: str, dtype: str, device: torch.device, tiny: bool, seed: int = 0) -> torch.nn.Module:
    import transformers

    config_name, model_name, kwargs = FAMILIES[family]
    kwargs = dict(kwargs)
    if tiny:
        kwargs.update(TINY)
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = 2
        if "head_dim" in kwargs:
            kwargs["head_dim"] = 16
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(seed)
    with device:
        model = getattr(transformers, model_name)(config)
    if dtype == "bf16":
        model.to(torch.bfloat16)
    model.train()
    return model


def make_batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(steps)]


class SavedBytes:
    """Bytes autograd saves in one forward pass (distinct storages, parameters left out): with the
    model state, an estimate of the peak where the allocator cannot tell (a CPU device)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def context(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def model_state_bytes(model: torch.nn.Module) -> int:
    """Parameters, their gradients and AdamW's two moments."""
    return sum(4 * p.numel() * p.element_size() for p in model.parameters())


def base(
    args: argparse.Namespace, family: str, mode: str, cap: Optional[int], fraction: Optional[float]
) -> dict[str, Any]:
    """The fields that name a row."""
    names = {"family": family + ("-tiny" if args.tiny else ""), "dtype": args.dtype}
    return rows.fields(args, names, mode, cap, fraction)


def row_base(args: argparse.Namespace) -> dict[str, Any]:
    """The fields that name the row of a `run` command."""
    return base(args, args.family, args.mode, rows.cap_of(args), args.cap_fraction)


def run_in(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    device, result, cap = rows.start(args, row_base(args))
    if args.mode == "torchtune" and device.type != "cuda":
        raise RuntimeError("torchtune's OffloadActivations needs CUDA (it makes CUDA streams)")
    model = build_model(args.family, args.dtype, device, args.tiny)
    vocab = model.config.vocab_size
    result["params"] = sum(p.numel() for p in model.parameters())
    result["vocab"] = vocab
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(args.steps, args.batch, args.seq, vocab)

    forward_context: Callable[[], Any] = contextlib.nullcontext
    outer: Any = contextlib.nullcontext()
    handle = None
    saved: Optional[SavedBytes] = None
    if args.mode == "ideal" and device.type != "cuda":
        saved = SavedBytes(model)
        forward_context = saved.context
    elif args.mode == "hf_ckpt":
        baselines.enable_hf_checkpointing(model)
    elif args.mode == "sac":
        baselines.enable_selective_checkpointing(model)
    elif args.mode == "save_on_cpu":

        def forward_context() -> Any:
            return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")

    elif args.mode == "torchtune":
        offloader = baselines.load_torchtune_offloader()

        def forward_context() -> Any:
            return offloader(use_pin_memory=True, use_streams=True)

    elif args.mode == "teraio":
        import teraio

        store = rows.make_store(args, scratch)
        # As a user writes it: the store and the memory to fit in, nothing tuned (or whole-model
        # mode forced, to compare with what the default chooses).
        result["arguments"] = (
            "defaults" if args.whole_model == "auto" else f"whole_model={args.whole_model!r}"
        )
        outer = teraio.offload(model, optimizer, store=store, gpu_memory=cap, whole_model=args.whole_model)
        handle = outer

    autocast: Callable[[], Any] = contextlib.nullcontext
    if args.dtype == "autocast":
        autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16)

    def step(tokens: torch.Tensor) -> float:
        with forward_context(), autocast():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    steps = rows.Steps(f"{result['family']} {args.dtype} {args.mode}", device)
    rows.train(result, steps, batches, step, outer, args, f"{result['family']}-{args.mode}")
    rows.finish(result, steps, args.warmup)
    if args.mode in ("hf_ckpt", "sac"):
        result["checkpointed_layers"] = baselines.checkpointed_layers(model)
    if args.mode == "sac":
        result["sac_decisions"] = dict(baselines.SAC_DECISIONS)
    if saved is not None:
        result["peak_estimate_bytes"] = model_state_bytes(model) + sum(saved.seen.values())
    if handle is not None:
        rows.add_report(result, handle)
    return result


# -- the table --------------------------------------------------------------------------------


class Table(rows.Table):
    """The rows, with the baselines that ran out of memory at a larger cap left out."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        #: (family, mode) -> the largest cap fraction at which it ran out of memory.
        self.oom_at: dict[tuple[str, str], float] = {}

    def capped(
        self,
        family: str,
        mode: str,
        ideal_peak: int,
        fraction: float,
        extra: tuple[str, ...] = (),
        tag: str = "",
    ) -> dict[str, Any]:
        """A row at `fraction` of the ideal peak. A baseline that ran out of memory at a larger
        cap is not run again at a smaller one (teraio always is)."""
        cap = int(fraction * ideal_peak)
        larger = self.oom_at.get((family, mode))
        if mode != "teraio" and larger is not None and larger > fraction:
            result = {
                **base(self.args, family, mode, cap, fraction),
                "oom": True,
                "oom_at_larger_cap": larger,
            }
            self.progress(f"{family}-{self.args.dtype}-{mode}-{round(100 * fraction)}", self.write(result))
            return result
        result = self.row(family, mode, cap, fraction, tag=tag, extra=extra)
        if result.get("oom"):
            self.oom_at[(family, mode)] = max(fraction, self.oom_at.get((family, mode), 0.0))
        return result

    def row(
        self,
        family: str,
        mode: str,
        cap: Optional[int] = None,
        fraction: Optional[float] = None,
        tag: str = "",
        extra: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        args = self.args
        label = f"{family}-{args.dtype}-{mode}" + (f"-{round(100 * fraction)}" if fraction else "") + tag
        command = rows.run_command(__file__, args, family, mode) + ["--dtype", args.dtype, *extra]
        return self.write(self.run(label, base(args, family, mode, cap, fraction), command, mode))


def table_main(args: argparse.Namespace) -> int:
    families = rows.split(args.families)
    fractions = [float(f) for f in rows.split(args.fractions)]
    modes = rows.split(args.modes)
    late = [m for m in rows.split(args.late_modes) if m in modes]
    whole_at = {float(f) for f in rows.split(args.whole_model_at)}
    for name in families:
        if name not in FAMILIES:
            raise SystemExit(f"unknown family {name!r}: one of {', '.join(FAMILIES)}")
    for mode in modes:
        if mode not in MODES or mode == "ideal":
            raise SystemExit(f"unknown mode {mode!r} for the capped rows: one of {', '.join(MODES[1:])}")
    table = Table(args)
    caps: dict[str, int] = {}
    # Every family's ideal runs and first modes come before the slow offloaders (`--late-modes`),
    # so that a deadline cuts the rows that matter least.
    for family in families:
        peaks = []
        for i in range(args.ideal_runs):
            r = table.row(family, "ideal", tag=f"-{i + 1}")
            peaks.append(r.get("peak_allocated_bytes") or r.get("peak_estimate_bytes"))
        if peaks and peaks[0]:
            caps[family] = peaks[0]
        else:
            print(f"== {family}: the first ideal run gave no peak, so no capped rows", flush=True)
            continue
        for fraction in fractions:
            for mode in modes:
                if mode not in late:
                    table.capped(family, mode, caps[family], fraction)
            if fraction in whole_at:
                table.capped(
                    family, "teraio", caps[family], fraction, ("--whole-model", "on"), "-whole-model"
                )
    for family in families:
        if family not in caps:
            continue
        for fraction in fractions:
            for mode in late:
                table.capped(family, mode, caps[family], fraction)
    return table.finish()


def main(argv: Optional[list[str]] = None) -> int:
    common = rows.common_arguments()
    common.add_argument(
        "--dtype",
        choices=["autocast", "bf16"],
        default="autocast",
        help="bf16 autocast over fp32 weights, or bf16 weights",
    )
    parser, one, many = rows.parsers(__doc__, common, list(FAMILIES), MODES, "one mode in this process")
    one.add_argument(
        "--whole-model", choices=("auto", "on", "off"), default="auto", help="teraio mode's option"
    )
    rows.table_arguments(many, "llama,qwen2", deadline_s=480.0, timeout_s=120.0, teraio_timeout_s=240.0)
    many.add_argument("--modes", default="teraio,hf_ckpt,sac,save_on_cpu,torchtune")
    many.add_argument(
        "--late-modes",
        default="save_on_cpu,torchtune",
        help="modes run after every family's other rows (slow: they pin all activations)",
    )
    many.add_argument("--ideal-runs", type=int, default=2)
    many.add_argument(
        "--whole-model-at", default="", help="fractions with one more teraio row, whole_model='on'"
    )
    return rows.main(parser, argv, "regime", run_in, row_base, table_main)


if __name__ == "__main__":
    sys.exit(main())
