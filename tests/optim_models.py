"""Tiny models and optimizers for the optimizer-key tests, importable as ``--model optim_models:...``."""

from __future__ import annotations

import torch
from torch import nn


class Tiny(nn.Module):
    """Embedding tied to a head, a Linear, a LayerNorm and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.fc = nn.Linear(3, 2)
        self.norm = nn.LayerNorm(2)
        self.head = nn.Linear(2, 5, bias=False)
        self.tied = nn.Linear(3, 5, bias=False)
        self.tied.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4, 3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return logits; touches every parameter so each gets optimizer state."""
        x = self.embed(tokens) * self.scale[0]
        return self.head(self.norm(self.fc(x))) + self.tied(x)


def groups(model: nn.Module) -> list[dict]:
    """Return two groups: matrices, then vectors (each in model order)."""
    params = [p for _, p in model.named_parameters()]
    return [
        {"params": [p for p in params if p.ndim >= 2], "lr": 0.1},
        {"params": [p for p in params if p.ndim < 2], "lr": 0.2, "weight_decay": 0.0},
    ]


def tiny(seed: int = 0) -> Tiny:
    """Return a Tiny built from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Tiny()


def tiny_with_groups() -> tuple[nn.Module, list[dict]]:
    """Return ``(model, param_groups)``: the pair form of ``--model``."""
    model = tiny()
    return model, groups(model)


def trained(optimizer: str, model: nn.Module | None = None, steps: int = 2):
    """Return ``(model, optimizer)`` after ``steps`` steps of ``optimizer`` over ``groups``."""
    model = model or tiny()
    opt_groups = groups(model)
    make = {
        "adamw": lambda: torch.optim.AdamW(opt_groups, betas=(0.9, 0.95)),
        "sgd": lambda: torch.optim.SGD(opt_groups, lr=0.1, momentum=0.9),
        "adagrad": lambda: torch.optim.Adagrad(opt_groups),
    }
    opt = make[optimizer]()
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        model(torch.randint(5, (2, 3), generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def broken() -> nn.Module:
    """Raise, as a factory with a bug does."""
    raise RuntimeError("boom")


def tinylm_with_groups() -> tuple[nn.Module, list[dict]]:
    """Return the example TinyLM and its AdamW groups (examples/ is not an importable package)."""
    from reference import example

    return example.model_and_param_groups()
