"""End to end: ``--src-local`` under a real torchrun, each rank in a mount namespace of its own.

Each rank's process sees, at the one SRC path every rank is given, only its "node's"
part of FSDP2's DCP checkpoint at 4 (``.metadata`` and saving ranks 0-1 on rank 0, ranks
2-3 on rank 1): a bind mount in a private mount namespace (``unshare -m``, root only),
as node-local disks mounted at the same path look to a multi-node job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import assert_trees_equal

# node.sh NODES SRC CMD...: run CMD where SRC shows NODES/node$LOCAL_RANK.
NODE_SH = """\
nodes=$1 src=$2
shift 2
exec unshare -m --propagation private bash -c \\
    'mount --bind "$1" "$2" && shift 2 && exec "$@"' _ "$nodes/node$LOCAL_RANK" "$src" "$@"
"""


def _can_unshare() -> bool:
    probe = ["unshare", "-m", "--propagation", "private", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe).returncode == 0


@pytest.mark.timeout(200)
def test_torchrun_converts_a_dcp_whose_files_are_on_each_nodes_own_disk(fsdp2_ckpt, tmp_path):
    if not _can_unshare():
        pytest.skip("cannot make a mount namespace here (unshare -m needs root)")
    nodes = tmp_path / "nodes"
    for node, saved in enumerate([[0, 1], [2, 3]]):
        here = nodes / f"node{node}"
        here.mkdir(parents=True)
        if node == 0:
            shutil.copy(fsdp2_ckpt.dcp / ".metadata", here)
        for rank in saved:
            shutil.copy(fsdp2_ckpt.dcp / f"__{rank}_0.distcp", here)
    src = tmp_path / "step-2"  # empty here; each rank sees its node's files at this path
    src.mkdir()
    (tmp_path / "node.sh").write_text(NODE_SH)
    dst = tmp_path / "full.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["--no-python", "bash", str(tmp_path / "node.sh"), str(nodes), str(src)]
    cmd += [sys.executable, "-m", "shardckpt", "convert", str(src), str(dst), "--to", "full"]
    cmd += ["--src-local", "--verify", "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDCKPT_TIMEOUT="60")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "shardckpt:" not in proc.stderr  # no note: --src-local said it is expected
    assert not any(Path(src).iterdir())
    ref = torch.load(fsdp2_ckpt.ref, weights_only=True)
    assert_trees_equal(torch.load(dst, weights_only=True), ref)
