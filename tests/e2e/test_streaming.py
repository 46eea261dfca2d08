"""Every output layout streams: a checkpoint 3x the memory cap converts under the cap, bit-exact.

The cap is real: each conversion runs as ``python -m shardckpt`` inside a fresh memory
cgroup (``conditions.memory_capped``), and the kernel kills it if it goes over. An idle
``python -m shardckpt convert`` process with torch imported holds about 285 MiB; the
cap of 512 MiB leaves 227 MiB for the work, with ``--buffer-size 32MiB``. The source,
a DCP checkpoint of 1.5 GiB (96 tensors of 16 MiB, saved by ``dcp.save``), is three
times the cap, so any layout that held the checkpoint, one target rank's shards of it,
or even a sixth of it at once, is killed.

Values are checked against torch's own reading of the source (``dcp_to_torch_save``)
with torch's and safetensors' own readers of each output; the FSDP1 rank files, which
need a job of M to unpickle, are read back through shardckpt (their loading into real
FSDP1 jobs is tested in tests/dist/test_fsdp1.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conditions import memory_capped
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardckpt import api

CAP = 512 * 2**20
TENSORS, SIDE = 96, 2048  # 96 x 16 MiB = 1.5 GiB: three times the cap

MODEL = f"""
import torch


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear({SIDE}, {SIDE}, bias=False)


def build():
    return torch.nn.Sequential(*[Block() for _ in range({TENSORS})])
"""

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[Path, dict, dict]:
    """Return (directory, environment, torch's full state) of a 1.5 GiB DCP checkpoint."""
    root = tmp_path_factory.mktemp("streaming")
    (root / "stream_model.py").write_text(MODEL)
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {f"{i}.proj.weight": torch.randn(SIDE, SIDE, generator=g) for i in range(TENSORS)},
        "step": 7,
    }
    dcp.save(state, checkpoint_id=root / "src", no_dist=True)
    del state
    dcp_to_torch_save(root / "src", root / "ref.pt")
    ref = torch.load(root / "ref.pt", mmap=True, weights_only=True)
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return root, env, ref


CASES = {
    "torch": ["o.pt", "--to", "full"],
    "safetensors": ["o.safetensors", "--to", "full"],
    "hf": ["o-hf", "--to", "full", "--format", "hf", "--max-shard-size", "200MB"],
    "dcp": ["o-dcp", "--to", "sharded", "--world-size", "3"],
    "fsdp2-ranks": [
        "o-ranks",
        "--to",
        "local",
        "--world-size",
        "3",
        "--model",
        "stream_model:build",
    ],
    "fsdp1-sharded": [
        *("o-fsdp1s", "--to", "local", "--format", "fsdp1-sharded", "--world-size", "2"),
        *("--model", "stream_model:build", "--wrap", "stream_model:Block"),
    ],
    "fsdp1-local": [
        *("o-fsdp1l", "--to", "local", "--format", "fsdp1-local", "--world-size", "2"),
        *("--model", "stream_model:build", "--wrap", "stream_model:Block"),
    ],
}


def _tensors_of(fmt: str, out: Path, root: Path) -> dict[str, torch.Tensor]:
    """Return the model tensors of output ``out`` by FQN, read by torch's or safetensors' own code."""
    if fmt == "torch":
        return torch.load(out, mmap=True, weights_only=True)["model"]
    if fmt == "safetensors":
        with safe_open(out, "pt") as f:
            return {k.removeprefix("model."): f.get_tensor(k) for k in f.keys()}
    if fmt == "hf":
        got = {}
        for shard in sorted(out.glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                got.update({k: f.get_tensor(k) for k in f.keys()})
        return got
    if fmt == "dcp":
        dcp_to_torch_save(out, root / f"back-{fmt}.pt")
        return torch.load(root / f"back-{fmt}.pt", mmap=True, weights_only=True)["model"]
    if fmt == "fsdp2-ranks":
        files = [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in range(3)]
        return {
            k: torch.cat([f["model"][k]._local_tensor for f in files]) for k in files[0]["model"]
        }
    # FSDP1's ShardedTensors unpickle only in a job of M: read back through shardckpt.
    back = root / f"back-{fmt}.pt"
    api.convert(out, back, to="full", model="stream_model:build", wraps=["stream_model:Block"])
    return torch.load(back, mmap=True, weights_only=True)["model"]


@pytest.mark.parametrize("fmt", list(CASES))
def test_every_layout_converts_three_times_its_memory_cap_bit_exact(big, fmt, monkeypatch):
    root, env, ref = big
    out = root / CASES[fmt][0]
    argv = [sys.executable, "-m", "shardckpt", "convert", str(root / "src"), str(out)]
    argv += [*CASES[fmt][1:], "--buffer-size", "32MiB", "--quiet"]
    with memory_capped(CAP) as prefix:
        proc = subprocess.run([*prefix, *argv], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, (
            f"killed under the {CAP >> 20} MiB cap (rc {proc.returncode})"
            if proc.returncode in (-9, 137)
            else proc.stderr
        )
    monkeypatch.syspath_prepend(str(root))
    got = _tensors_of(fmt, out, root)
    assert sorted(got) == sorted(ref["model"])
    for name, tensor in ref["model"].items():
        assert torch.equal(got[name], tensor), name
