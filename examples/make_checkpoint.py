"""Train a tiny model with FSDP2 for a few steps and save a DCP checkpoint of it.

helper: run under torchrun by scripts/demo.sh and the examples (not an example on its
own); its model and optimizer are what the tests and the other examples use.

Run it on CPU with any number of ranks (1, 2, 3, 4, 8, ...):

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        examples/make_checkpoint.py OUT_DIR [--steps 3] [--full-ref REF.pt] [--seed 0]

OUT_DIR becomes a DCP directory holding ``{"model": ..., "optim": ...}`` exactly as a
training loop writes it with ``get_state_dict`` + ``dcp.save``. With ``--full-ref``,
rank 0 also writes the same state, gathered to full tensors, with ``torch.save``: the
ground truth a conversion of OUT_DIR must reproduce bit for bit.

The model is small but awkward on purpose, so that a converter meets what real
checkpoints contain: dimensions that do not divide by 2, 3 or 4 (uneven shards, and a
3-row weight that leaves rank 3 of 4 with an empty shard), an embedding tied to the
output head, a persistent and a non-persistent buffer, LayerNorms, and AdamW with two
param groups that differ in lr and weight decay.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

VOCAB = 97
DIM = 48
HIDDEN = 7
GATE = 3
SEQ_LEN = 5
BATCH = 2


class Block(nn.Module):
    """A residual MLP with a tiny gate: weights 7x48, 48x7, 3x7, 7x3 and odd biases."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc_in = nn.Linear(DIM, HIDDEN)
        self.gate_down = nn.Linear(HIDDEN, GATE)
        self.gate_up = nn.Linear(GATE, HIDDEN)
        self.fc_out = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return x plus the gated MLP of its normalised value."""
        h = F.gelu(self.fc_in(self.norm(x)))
        h = h * torch.sigmoid(self.gate_up(F.gelu(self.gate_down(h))))
        return x + self.fc_out(h)


class TinyLM(nn.Module):
    """Embedding -> blocks -> LayerNorm -> head, with the head tied to the embedding."""

    def __init__(self, num_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        # Tie before fully_shard so FSDP2 sees one parameter under two FQNs, as in
        # GPT-2-style models; the checkpoint then has both "embed.weight" and
        # "head.weight" in the model state but one entry in the optimizer state.
        self.head.weight = self.embed.weight
        # Persistent: saved in the checkpoint, but FSDP2 does not shard buffers.
        self.register_buffer(
            "pos_scale", torch.linspace(0.5, 1.5, SEQ_LEN * DIM).view(SEQ_LEN, DIM)
        )
        # Non-persistent: must never appear in a checkpoint.
        self.register_buffer("positions", torch.arange(SEQ_LEN), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return next-token logits of shape (batch, seq, VOCAB)."""
        x = self.embed(tokens) * self.pos_scale[self.positions[: tokens.shape[1]]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(seed: int = 0) -> TinyLM:
    """Return a freshly initialised TinyLM, identical on every rank for the same seed."""
    # fully_shard keeps each rank's chunk of its own local init, so every rank must
    # build the same values; fork_rng keeps the caller's RNG stream untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM()


def param_groups(model: nn.Module) -> list[dict]:
    """Return AdamW param groups: matrices decay, vectors (biases, norms) do not."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():  # yields the tied weight once
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "lr": 1e-2, "weight_decay": 0.1},
        {"params": no_decay, "lr": 3e-2, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """Return AdamW over ``param_groups(model)``; call it after fully_shard."""
    return torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))


def model_and_param_groups() -> tuple[nn.Module, list[dict]]:
    """Return ``(model, param_groups)``: the zero-argument factory form of ``--model``."""
    model = build_model()
    return model, param_groups(model)


def shard_model(model: nn.Module, world_size: int) -> nn.Module:
    """Apply FSDP2 as training does: each block first, then the root; return the model."""
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """Run ``steps`` optimizer steps of next-token prediction on random tokens."""
    # Each rank draws its own batch, as data-parallel ranks do.
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(VOCAB, (BATCH, SEQ_LEN + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def make_checkpoint(
    out_dir: str, steps: int = 3, seed: int = 0, full_ref: str | None = None
) -> None:
    """Train on the current process group and save a DCP checkpoint (all ranks call)."""
    model = shard_model(build_model(seed), dist.get_world_size())
    optimizer = build_optimizer(model)
    train(model, optimizer, steps, seed)

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out_dir)

    if full_ref is not None:
        # A collective: every rank gathers, and with cpu_offload only rank 0 keeps
        # the result (the others get empty dicts).
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd_full, osd_full = get_state_dict(model, optimizer, options=options)
        if dist.get_rank() == 0:
            torch.save({"model": msd_full, "optim": osd_full}, full_ref)


def leave(code: int = 0) -> None:
    """Exit now, without Python's finalization: call it once the process group is destroyed.

    The gloo group outlives ``destroy_process_group`` in a process that ran FSDP2: torch's
    DTensor caches keep its device mesh, and so the group and its threads, until the
    interpreter finalizes. Torn down then, a gloo thread that needs the interpreter
    aborts the process (SIGABRT, "terminate called without an active exception") after
    every output was written: the demo's failure about once in 8 runs on a loaded 2-core
    machine. Every file is closed by now; only the streams need flushing.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    """Parse arguments, join the torchrun process group and write the checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="DCP directory to write")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (>= 1)")
    parser.add_argument("--full-ref", help="also torch.save the full state here (rank 0)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1 so that the optimizer has state")

    # Several ranks share a few CPU cores; more threads per rank only oversubscribe.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        make_checkpoint(args.out_dir, args.steps, args.seed, args.full_ref)
        # gloo on a loaded machine can abort at teardown while a peer is still
        # finishing its last send; the barrier makes every rank leave together.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {args.out_dir}" + (f" and {args.full_ref}" if args.full_ref else ""))
    leave()


if __name__ == "__main__":
    main()
