"""A tiny accelerate FSDP training job, run under torchrun by tests/dist/test_accelerate.py.

Each JOB is ``VERSION:STATE_DICT:DIR``: the FSDP version (1 or 2), the plugin's
``state_dict_type`` (``SHARDED_STATE_DICT`` or ``FULL_STATE_DICT``) and a directory.

``save JOB...``: for each job, train 2 steps at the launch's world size,
``save_state(DIR)``, and write torch's own full model and optimizer state dicts to
``DIR.control.pt`` (rank 0): the library's consolidation the test compares shardckpt's
``--to full`` with.
``resume OUT JOB...``: for each job, build it afresh, ``load_state(DIR)``, keep the full
state as loaded and after one more step; rank 0 saves them all to OUT.
One launch runs several jobs: starting ranks is most of a test's time.
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


def _keep_fsdp1_full_on_cpu() -> None:
    """Hold FSDP1's ``FullStateDictConfig.offload_to_cpu`` False in this process.

    accelerate sets ``offload_to_cpu=True`` before each FULL save and load of more than
    one process; FSDP1 on CPU cannot offload (its flat parameter's unsharded storage is
    freed: "out of bounds for storage of size 0"), and a model on CPU needs no offload.
    What accelerate writes and reads is otherwise unchanged.
    """
    from torch.distributed.fsdp import FullStateDictConfig

    def setattr_(self, name, value):
        object.__setattr__(self, name, False if name == "offload_to_cpu" else value)

    FullStateDictConfig.__setattr__ = setattr_


def _job(version: str, state_dict: str):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=int(version),
        state_dict_type=state_dict,
        auto_wrap_policy="no_wrap",
    )
    acc = Accelerator(cpu=True)
    # accelerate applies its FSDP plugin on accelerators only; on CPU (gloo) the job is
    # told it is an FSDP one, and everything from prepare() on is accelerate's FSDP path.
    # (AcceleratorState copies PartialState's fields whenever it is built: set both.)
    PartialState().distributed_type = acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    if version == "1" and state_dict == "FULL_STATE_DICT":
        _keep_fsdp1_full_on_cpu()
    torch.manual_seed(0)
    model = Tiny()
    if version == "1":
        # accelerate wraps FSDP1 with its device as device_id, which FSDP1 refuses on
        # CPU ("cpu vs cpu:0"); a model wrapped beforehand is kept as it is by prepare()
        # (accelerate's manual wrapping), with the optimizer made over its flat params.
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=torch.device("cpu"))
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


def _full(model, opt, version: str) -> dict:
    """Return torch's own full model and optimizer state dicts (complete on rank 0)."""
    if version == "1":
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=False),
            FullOptimStateDictConfig(rank0_only=False),
        ):
            return _copied(
                {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt)}
            )
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    # On CPU the 0-dim ``step`` tensors come back as the optimizer's own: copy them, or
    # the next step changes what was kept.
    return _copied({"model": model_sd, "optimizer": optim_sd})


def _copied(tree):
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copied(v) for v in tree]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def save(job: str) -> None:
    version, state_dict, ckpt = job.split(":", 2)
    control = ckpt + ".control.pt"
    acc, model, opt, sched = _job(version, state_dict)
    for seed in (1, 2):
        _step(acc, model, opt, sched, seed)
    acc.save_state(ckpt)
    full = _full(model, opt, version)
    if acc.is_main_process:
        torch.save(full, control)
    acc.wait_for_everyone()
    acc.free_memory()


def resume(out: str, jobs: list[str]) -> None:
    results = []
    for job in jobs:
        version, state_dict, ckpt = job.split(":", 2)
        acc, model, opt, sched = _job(version, state_dict)
        if version == "1":
            # accelerate's FSDP1 loader asks FSDP1 for the optimizer state dict to load
            # into, which is empty before a first step: DCP would then load nothing.
            # torch's own way to give an optimizer its state before loading.
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(opt)
        acc.load_state(ckpt)
        loaded = _full(model, opt, version)
        _step(acc, model, opt, sched, 3)
        results.append(
            {
                **_full(model, opt, version),
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
        for job in args:
            save(job)
    else:
        resume(args[0], args[1:])
    torch.distributed.destroy_process_group()
