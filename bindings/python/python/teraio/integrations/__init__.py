"""`teraio.offload` inside training libraries that own the loop (docs/integrations.md).

- `transformers`: `OffloadCallback`, a `TrainerCallback` for the Hugging Face `Trainer` (and
  trainers built on it, such as `trl.SFTTrainer`).
- `accelerate`: `offload(accelerator, model, optimizer, ...)` for a loop after
  `accelerator.prepare(...)`.
- `lightning`: `OffloadCallback`, a PyTorch Lightning `Callback`.

Each module imports its library when it is imported itself, so `import teraio` never needs them.
"""
