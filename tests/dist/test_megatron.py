"""Megatron's own load of what shardckpt writes (needs megatron-core; the goldens' tests do not).

The golden ``tests/goldens/megatron/gpt-tp2`` was saved by megatron-core at TP=2 on 2
ranks, and ``reference_tp1.pt`` is what Megatron's ``dist_checkpointing.load`` gave a
TP=1 model from it (``make.py``). Here shardckpt writes the checkpoint for 3 ranks,
and megatron-core loads that at TP=1 on one rank, in its own process
(``tests/megatron_jobs.py``, which shims the two CUDA calls Megatron's load makes).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import assert_trees_equal

from shardckpt.cli import run

pytestmark = pytest.mark.trainers
# Found, not imported: megatron-core runs in megatron_jobs.py's own process, and its
# import (~2 s of CPU) would be paid by every pytest process that collects this file.
for _needed in ("megatron.core", "psutil"):
    if importlib.util.find_spec(_needed) is None:
        pytest.skip(f"could not find '{_needed}'", allow_module_level=True)

GOLDENS = Path(__file__).resolve().parents[1] / "goldens" / "megatron"
JOBS = Path(__file__).resolve().parents[1] / "megatron_jobs.py"


def megatron_load(ckpt: Path, out: Path) -> dict:
    """Return what ``dist_checkpointing.load`` at TP=1 gives from ``ckpt`` (model weights, iteration)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(JOBS), "load", str(ckpt), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.timeout(240)
def test_megatron_loads_the_output_at_3_at_tp1_equal_to_the_original(tmp_path):
    dst = tmp_path / "at3"
    argv = ["convert", GOLDENS / "gpt-tp2", dst, "--to", "sharded", "--format", "megatron"]
    assert run([str(a) for a in argv] + ["--world-size", "3", "-q"]) == 0
    loaded = megatron_load(dst, tmp_path / "loaded.pt")
    assert loaded["iteration"] == 7
    assert_trees_equal(loaded, torch.load(GOLDENS / "reference_tp1.pt", weights_only=True))
