"""Ranks that see a chosen number of GPUs, for testing how ``dist.launch`` agrees on a device.

Each rank process fakes ``torch.cuda`` (how many devices it sees) and then runs the
CLI as torchrun would start it: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` in the environment. The ranks run every case one
after the other in the same two processes (a process group per case), so the whole
matrix costs one start-up of torch. A CPU machine has no NCCL: where the ranks agree on
CUDA, the device type they chose is recorded and the run goes on on CPU.
"""

from __future__ import annotations

import contextlib
import io
import os

import torch

from shardckpt.cli.app import run
from shardckpt.core import dist as shardckpt_dist

_real_join = shardckpt_dist._join_device


def _fake_cuda(count: int) -> list[str]:
    """Make this process see ``count`` CUDA devices; return the list the chosen device types go to."""
    torch.cuda.is_available = lambda: count > 0
    torch.cuda.device_count = lambda: count
    chosen: list[str] = []

    def record(dev_type: str, local_rank: int, world_size: int):
        chosen.append(dev_type)
        return _real_join("cpu", local_rank, world_size)

    shardckpt_dist._join_device = record
    return chosen


def run_cases(rank: int, world_size: int, cases: list, results) -> None:
    """Run each ``(gpus_per_rank, argv, port)`` case as rank ``rank``; put (case, code, stderr, device)."""
    for i, (gpus, argv, port) in enumerate(cases):
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            SHARDCKPT_TIMEOUT="30",
        )
        chosen = _fake_cuda(gpus)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = run(argv)
        results.put((i, rank, code, err.getvalue(), chosen[-1] if chosen else None))
