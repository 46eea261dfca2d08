"""A tiny accelerate FSDP training job, run under torchrun by tests/dist/test_accelerate.py.

``save DIR CONTROL``: train 2 steps at the launch's world size, ``save_state(DIR)``, and
write torch's own full model and optimizer state dicts to CONTROL (rank 0), the
library's consolidation the test compares shardckpt's ``--to full`` with.
``resume OUT DIR [DIR ...]``: for each DIR, build the job afresh, ``load_state(DIR)``,
keep the full state as loaded and after one more step; rank 0 saves them all to OUT.

Environment: ``FSDP_VERSION`` (1 or 2), ``STATE_DICT`` (``SHARDED_STATE_DICT`` or
``FULL_STATE_DICT``).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")


class Tiny(nn.Module):
    """Uneven shapes (5x7, 3x5) so every world size leaves a remainder."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _job():
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=int(os.environ.get("FSDP_VERSION", "2")),
        state_dict_type=os.environ.get("STATE_DICT", "SHARDED_STATE_DICT"),
        auto_wrap_policy="no_wrap",
    )
    acc = Accelerator(cpu=True)
    # accelerate applies its FSDP plugin on accelerators only; on CPU (gloo) the job is
    # told it is an FSDP one, and everything from prepare() on is accelerate's FSDP path.
    # (AcceleratorState copies PartialState's fields whenever it is built: set both.)
    PartialState().distributed_type = acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _step(acc, model, opt, sched, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 7, generator=g), torch.randn(6, 3, generator=g)
    loss = ((model(x) - y) ** 2).mean()
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()


def _full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    return {"model": model_sd, "optimizer": optim_sd}


def save(ckpt: str, control: str) -> None:
    acc, model, opt, sched = _job()
    for seed in (1, 2):
        _step(acc, model, opt, sched, seed)
    acc.save_state(ckpt)
    full = _full(model, opt)
    if acc.is_main_process:
        torch.save(full, control)
    acc.wait_for_everyone()


def resume(out: str, ckpts: list[str]) -> None:
    results = []
    for ckpt in ckpts:
        acc, model, opt, sched = _job()
        acc.load_state(ckpt)
        loaded = _full(model, opt)
        _step(acc, model, opt, sched, 3)
        results.append(
            {
                **_full(model, opt),
                "loaded": loaded,
                "scheduler": sched.state_dict(),
                "step": acc.step,
            }
        )
        acc.free_memory()
    if int(os.environ["RANK"]) == 0:
        torch.save(results, out)
    torch.distributed.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, *args = sys.argv[1:]
    if mode == "save":
        save(*args)
    else:
        resume(args[0], args[1:])
    torch.distributed.destroy_process_group()
