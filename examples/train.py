"""A small training loop with FSDP2 or DDP that saves and resumes checkpoints.

helper: run under torchrun by reshard_and_resume.sh and ddp_to_fsdp2.sh (not an
example on its own); runs on CPU ranks over gloo, as make_checkpoint.py does.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train.py \\
        --parallel fsdp2 --steps 5 --save-at 3 --save CKPT --losses LOSSES.json
    python -m torch.distributed.run --standalone --nproc-per-node 3 examples/train.py \\
        --parallel fsdp2 --resume CKPT --steps 2 --losses LOSSES.json

The model, its sharding and its optimizer are those of make_checkpoint.py (TinyLM,
AdamW with two param groups). What makes a resumed run comparable with an
uninterrupted one at another world size is the data: every step draws one global batch
from a seed that depends on the step alone, and each rank trains on its own slice of
it. The loss of a step is the mean over the global batch, so it does not depend on how
many ranks share the batch (up to the order of floating-point sums).

Checkpoints hold ``{"model": ..., "optim": ..., "train": {"step": K}}``:
- ``--parallel fsdp2`` saves a DCP directory with ``get_state_dict`` + ``dcp.save``
  (FQN-keyed optimizer state) and resumes with ``dcp.load`` + ``set_state_dict``;
- ``--parallel ddp`` saves one ``torch.save`` file on rank 0, as plain PyTorch
  training does: ``ddp.state_dict()`` (keys start with ``module.``) and
  ``optimizer.state_dict()`` (state keyed by param IDs 0, 1, 2, ...).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from make_checkpoint import SEQ_LEN, VOCAB, build_model, build_optimizer, leave, shard_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

# Divisible by 1, 2, 3, 4 and 6, so that every rank gets the same number of rows.
GLOBAL_BATCH = 12


def global_batch(step: int) -> torch.Tensor:
    """Return step ``step``'s token batch, the same whatever the world size."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=gen)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """Run optimizer step ``step`` on this rank's slice of its batch; return the global loss."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if GLOBAL_BATCH % world_size:
        raise SystemExit(f"train.py: {GLOBAL_BATCH} rows do not split over {world_size} ranks")
    tokens = global_batch(step).chunk(world_size)[rank]
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    # FSDP2 and DDP average gradients over ranks: with equal slices that is the
    # gradient of the mean loss over the global batch.
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world_size


def save(path: str, parallel: str, model, optimizer, step: int) -> None:
    """Write the checkpoint of ``step`` (all ranks call)."""
    if parallel == "fsdp2":
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd, "train": {"step": step}}, checkpoint_id=path)
    else:
        if dist.get_rank() == 0:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            torch.save({**state, "train": {"step": step}}, path)
        dist.barrier()


def resume(path: str, model, optimizer) -> int:
    """Load a DCP checkpoint into the FSDP2 model and optimizer; return its step."""
    # get_state_dict gives the state dict this world size holds (DTensor shards,
    # optimizer state initialised); dcp.load fills it in place. A checkpoint that
    # `shardckpt convert --world-size M` wrote holds each of the M ranks' shards in
    # that rank's own file, as a job at M would have saved it.
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "train": {"step": 0}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(state["train"]["step"])


def main() -> None:
    """Parse arguments, train (from scratch or a checkpoint), save and log the losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", choices=["fsdp2", "ddp"], default="fsdp2")
    parser.add_argument("--steps", type=int, required=True, help="steps to run in this launch")
    parser.add_argument("--resume", help="DCP checkpoint to resume from (fsdp2 only)")
    parser.add_argument("--save", help="checkpoint to write (DCP dir, or .pt file for ddp)")
    parser.add_argument("--save-at", type=int, help="global step after which to --save")
    parser.add_argument("--losses", help="JSON file where rank 0 writes {step: loss}")
    args = parser.parse_args()
    if args.resume and args.parallel != "fsdp2":
        parser.error("--resume needs --parallel fsdp2 (convert DDP checkpoints first)")
    if (args.save is None) != (args.save_at is None):
        parser.error("--save and --save-at go together")

    # Several ranks share a few CPU cores; more threads per rank only oversubscribe.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        model = build_model()
        if args.parallel == "fsdp2":
            model = shard_model(model, dist.get_world_size())
        else:
            model = DistributedDataParallel(model)
        optimizer = build_optimizer(model)
        start = resume(args.resume, model, optimizer) if args.resume else 0

        losses = {}
        for step in range(start + 1, start + args.steps + 1):
            losses[step] = train_step(model, optimizer, step)
            if dist.get_rank() == 0:
                print(f"step {step}: loss {losses[step]:.6f}", flush=True)
            if step == args.save_at:
                save(args.save, args.parallel, model, optimizer, step)
        # gloo on a loaded machine can abort at teardown while a peer is still
        # finishing its last send; the barrier makes every rank leave together.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f, indent=1)
    leave()  # not through Python's finalization: see make_checkpoint.leave


if __name__ == "__main__":
    main()
