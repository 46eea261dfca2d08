"""End to end: ``--map`` under a real torchrun, every rank writing its rows of the mapped tensors."""

from __future__ import annotations

import os

import pytest
import torch
import warm_cli
from safetensors.torch import load_file

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.trainers

import titan_models  # noqa: E402


def test_two_ranks_export_torchtitans_llama3_as_to_hf_gives_it(tmp_path):
    titan = titan_models.llama3()
    step, config = titan_models.save(titan, tmp_path)
    argv = ["--standalone", "--nproc-per-node=2", "-m", "shardckpt", "convert", step,
            tmp_path / "hf", "--to", "full", "--format", "hf", "--hf-config", config,
            "--buffer-size", "4KiB"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDCKPT_TIMEOUT="60")
    proc = warm_cli.run_torchrun([str(a) for a in argv], env=env, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("mapped with 'llama3' (to hf)") == 1  # rank 0's summary alone
    got = load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    reference = titan.adapter.to_hf(dict(titan.state))
    assert sorted(got) == sorted(reference)
    assert all(torch.equal(got[k], reference[k]) for k in reference)
