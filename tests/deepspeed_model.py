"""The tiny model of the DeepSpeed goldens (``tests/goldens/deepspeed/make.py``) and of the
FSDP2 jobs that resume from their conversions (importable by spawned ranks)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 11


class TinyLM(nn.Module):
    """What a ZeRO checkpoint can hold: a head tied to the embedding, a frozen Linear,
    a float and an integer buffer, two param groups, and uneven sizes (11x6, 7x6, 6x7)
    so that ZeRO's flat partitions split parameters mid-row."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.fc1 = nn.Linear(6, 7)
        self.norm = nn.LayerNorm(7)
        self.fc2 = nn.Linear(7, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("pos", torch.arange(5, dtype=torch.float32))
        self.register_buffer("count", torch.tensor([3], dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return logits; every trainable parameter gets a gradient."""
        x = self.embed(tokens) + self.pos[: tokens.shape[-1], None].to(self.embed.weight.dtype)
        x = self.fc2(self.norm(torch.relu(self.fc1(x)))) + self.frozen(x)
        return self.head(x)


def build(seed: int = 0) -> TinyLM:
    """Return a TinyLM built from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM()


def build_bf16() -> TinyLM:
    """Return a TinyLM as a bf16 DeepSpeed job holds it: parameters in bf16, buffers as they are."""
    model = build()
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model


def build_with_groups() -> tuple[TinyLM, list[dict]]:
    """Return a TinyLM and the param groups its jobs train (``--model``'s factory convention)."""
    model = build()
    return model, param_groups(model)


def build_bf16_with_groups() -> tuple[TinyLM, list[dict]]:
    """Return ``build_bf16``'s TinyLM and the param groups its jobs train."""
    model = build_bf16()
    return model, param_groups(model)


def build_unfrozen() -> TinyLM:
    """Return a TinyLM whose ``frozen`` Linear trains: another module than the goldens' job's."""
    model = build()
    model.frozen.requires_grad_(True)
    return model


def param_groups(model: nn.Module) -> list[dict]:
    """Return the trainable parameters in two groups: matrices (decayed), then vectors."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in named if p.ndim >= 2]},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": 2e-2},
    ]


def batch(generator: torch.Generator) -> torch.Tensor:
    """Return a batch of token ids (2 sequences of 5)."""
    return torch.randint(VOCAB, (2, 5), generator=generator)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Return the next-token-free cross entropy of ``tokens`` against themselves, in fp32."""
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens.reshape(-1))
