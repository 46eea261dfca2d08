"""Write the veRL goldens: FSDPCheckpointManager directories of a tiny Qwen2, FSDP2 and FSDP1.

Run with a Python that has verl (see README.md here), from the repository root:

    python tests/goldens/verl/make.py tests/goldens/verl [fsdp2] [fsdp1]

Each ``<kind>/global_step_2/`` is what veRL's manager saved after two AdamW steps of a
2-rank gloo job on CPU; ``<kind>/reference.pt`` is torch's full state of that job
(``get_state_dict(..., full_state_dict=True)``: model, and FQN-keyed optimizer). The
same functions save and load live in ``tests/dist/test_verl.py`` where verl is installed.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 2
LR = 1e-2


def config():
    """Return a Qwen2 config small enough for a golden, with uneven shapes (37 x 12)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=37,
        hidden_size=12,
        intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def build(kind: str, seed: int, hf_config=None):
    """Return (module veRL's manager takes, optimizer, lr scheduler) for this rank, wrapped as veRL wraps."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config or config(), torch_dtype=torch.float32)
    if kind == "fsdp2":
        from verl.utils.fsdp_utils import apply_fsdp2

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        apply_fsdp2(model, {"mesh": mesh}, {})
        wrapped = model
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from verl.utils.fsdp_utils import get_fsdp_wrap_policy

        wrapped = FSDP(
            model,
            auto_wrap_policy=get_fsdp_wrap_policy(model),
            use_orig_params=False,
            device_id=torch.device("cpu"),
        )
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return wrapped, optimizer, scheduler


def manager(wrapped, optimizer, scheduler):
    """Return veRL's FSDPCheckpointManager over the job's state, saving and loading everything."""
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    contents = ["model", "optimizer", "extra"]
    cfg = OmegaConf.create({"save_contents": contents, "load_contents": contents})
    return FSDPCheckpointManager(wrapped, optimizer, scheduler, checkpoint_config=cfg)


def full_state(wrapped, optimizer) -> dict:
    """Return torch's full state of the job: the model and the FQN-keyed optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # FSDP1 offloads a full state dict to CPU only from a GPU; on CPU it is there already.
    fsdp2 = not isinstance(wrapped, torch.distributed.fsdp.FullyShardedDataParallel)
    options = StateDictOptions(full_state_dict=True, cpu_offload=fsdp2)
    msd, osd = get_state_dict(wrapped, optimizer, options=options)
    return {"model": msd, "optim": osd}


def train(wrapped, optimizer, scheduler) -> None:
    """Run ``STEPS`` steps of next-token prediction on random tokens, each rank its own batch."""
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEPS):
        tokens = torch.randint(37, (2, 9), generator=gen)
        out = wrapped(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
        out.loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def save_job(kind: str, out: str) -> dict | None:
    """Train under ``kind`` (fsdp2 or fsdp1), save with veRL's manager into ``out``; return the truth on rank 0."""
    wrapped, optimizer, scheduler = build(kind, seed=0)
    train(wrapped, optimizer, scheduler)
    manager(wrapped, optimizer, scheduler).save_checkpoint(out, global_step=STEPS)
    truth = full_state(wrapped, optimizer)
    return truth if dist.get_rank() == 0 else None


def load_job(kind: str, ckpt: str) -> dict | None:
    """Load ``ckpt`` with veRL's manager into a fresh job of ``kind``; return its full state on rank 0."""
    from transformers import AutoConfig

    wrapped, optimizer, scheduler = build(
        kind, 1234, AutoConfig.from_pretrained(f"{ckpt}/huggingface")
    )
    manager(wrapped, optimizer, scheduler).load_checkpoint(ckpt)
    state = full_state(wrapped, optimizer)
    state["lr_scheduler"] = scheduler.state_dict()
    return state if dist.get_rank() == 0 else None


def _rank(rank: int, world_size: int, port: int, fn, args, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        out = fn(*args)
        if rank == 0:
            torch.save(out, result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(fn, world_size: int, *args):
    """Return rank 0's result of ``fn(*args)`` run on ``world_size`` gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.pt")
        mp.start_processes(
            _rank, (world_size, port, fn, args, result), world_size, start_method="spawn"
        )
        return torch.load(result, weights_only=False)


def main(out_dir: str) -> None:
    """Save both kinds under ``out_dir`` with their references."""
    for kind in sys.argv[2:] or ("fsdp2", "fsdp1"):
        ckpt = Path(out_dir) / kind / f"global_step_{STEPS}"
        truth = run(save_job, 2, kind, str(ckpt))
        torch.save(truth, Path(out_dir) / kind / "reference.pt")
        print(f"wrote {ckpt}")


if __name__ == "__main__":
    main(sys.argv[1])
