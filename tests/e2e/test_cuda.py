"""The NCCL/CUDA path under torchrun; skipped on machines without two CUDA GPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardckpt.cli.app import run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def torchrun(*argv: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "shardckpt",
        *map(str, argv),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))


def test_nccl_full_output_equals_the_standalone_bytes(fsdp2_ckpt, tmp_path):
    assert (
        run(["convert", str(fsdp2_ckpt.dcp), str(tmp_path / "cpu.pt"), "--to", "full", "-q"]) == 0
    )
    proc = torchrun(
        "convert", fsdp2_ckpt.dcp, tmp_path / "gpu.pt", "--to", "full", "--device", "cuda"
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "gpu.pt").read_bytes() == (tmp_path / "cpu.pt").read_bytes()


def test_nccl_sharded_output_at_another_world_size_reads_back_equal(fsdp2_ckpt, tmp_path):
    proc = torchrun(
        "convert",
        fsdp2_ckpt.dcp,
        tmp_path / "dcp3",
        "--to",
        "sharded",
        "--world-size",
        "3",
        "--device",
        "cuda",
        "--verify",
    )
    assert proc.returncode == 0, proc.stderr
    assert run(["diff", str(fsdp2_ckpt.dcp), str(tmp_path / "dcp3")]) == 0
