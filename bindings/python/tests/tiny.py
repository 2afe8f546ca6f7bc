"""A tiny MLP-block model whose saved tensors are known exactly."""

from __future__ import annotations

from typing import Callable, Optional

import torch


class Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # up saves x, gelu saves up's output, down saves gelu's output (plus the weights).
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Tiny(torch.nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(dim, hidden) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def make(seed: int = 0, device: str = "cpu", **kwargs: int) -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tiny(**kwargs).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def batches(
    count: int, rows: int = 2048, dim: int = 64, device: str = "cpu", seed: int = 1
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, dim, generator=generator).to(device) for _ in range(count)]


def train(model: Tiny, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[float]:
    losses = []
    for x in data:
        loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[torch.Tensor],
    *,
    accumulate: int = 1,
    clip: Optional[float] = None,
    autocast: bool = False,
    on_step: Optional[Callable[[int], None]] = None,
) -> list[float]:
    """Trains with a scheduler that changes lr each step, each batch `accumulate` times as
    micro-batches, optional clipping and CPU bf16 autocast; `on_step(step)` after each step."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    losses = []
    for step, x in enumerate(data):
        for _ in range(accumulate):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(x)
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step)
    return losses


def accumulate_pairs(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]
) -> list[float]:
    """Gradient accumulation over two micro-batches: each step's are consecutive batches of
    `data`, each backward as it is (no scaling)."""
    losses = []
    for first, second in zip(data[::2], data[1::2]):
        for x in (first, second):
            loss = model(x)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses
