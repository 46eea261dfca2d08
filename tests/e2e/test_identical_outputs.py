"""An output does not depend on how many processes wrote it: byte-identical at N = 1, 2, 3.

Every rank writes its own part of DST (its rows of a full file, the files of the
target ranks it acts for), so this is what shows the parts fit together the same way
whatever the split.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardckpt.cli import run

CASES = {
    "torch": ["full.pt", "--to", "full"],
    "safetensors": ["full.safetensors", "--to", "full"],
    "hf": ["hf", "--to", "full", "--format", "hf", "--max-shard-size", "20KB"],
    "dcp": ["dcp", "--to", "sharded", "--world-size", "4"],
    "fsdp2-ranks": ["ranks", "--to", "local", "--world-size", "4"],
    "fsdp1-sharded": ["fsdp1", "--to", "local", "--format", "fsdp1-sharded", "--world-size", "4"],
}


def _files(root: Path) -> dict[str, str]:
    """Return the sha256 of every file under ``root`` (or of ``root`` itself), by relative path."""
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def _torchrun(nproc: int, argv: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "shardckpt", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDCKPT_TIMEOUT="60")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fmt", list(CASES))
def test_the_output_is_byte_identical_at_one_two_and_three_processes(fsdp2_ckpt, tmp_path, fmt):
    name, *options = CASES[fmt]
    outputs = {}
    for n in (1, 2, 3):
        dst = tmp_path / f"n{n}" / name
        argv = ["convert", str(fsdp2_ckpt.dcp), str(dst), *options, "--quiet"]
        if n == 1:
            assert run(argv) == 0
        else:
            proc = _torchrun(n, argv)
            assert proc.returncode == 0, proc.stderr
        outputs[n] = _files(dst)
    assert outputs[1], "nothing was written"
    assert outputs[2] == outputs[1]
    assert outputs[3] == outputs[1]
