"""End to end: node-local disks under a real torchrun, each rank in a mount namespace of its own.

Each rank's process sees, at one path every rank is given, only its "node's" directory:
a bind mount in a private mount namespace (``unshare -m``, root only), as node-local
disks mounted at the same path look to a multi-node job. SRC there holds part of FSDP2's
DCP checkpoint at 4 (``.metadata`` and saving ranks 0-1 on rank 0, ranks 2-3 on rank 1);
DST there receives each node's block of target ranks.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_cli
from reference import assert_trees_equal, load_dcp_into_fsdp2

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


def _torchrun(tmp_path: Path, nodes: Path, mounted: Path, *args: str, timeout_s: int = 60):
    """Run ``shardckpt ARGS`` under torchrun at 2, where each rank sees ``nodes/node{rank}`` at ``mounted``."""
    (tmp_path / "node.sh").write_text(NODE_SH)
    cmd = ["--standalone", "--nproc-per-node=2"]
    cmd += ["--no-python", "bash", str(tmp_path / "node.sh"), str(nodes), str(mounted)]
    cmd += [sys.executable, "-m", "shardckpt", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDCKPT_TIMEOUT=str(timeout_s))
    # torchrun's agent forks warm (warm_cli); each rank is a fresh bash and interpreter.
    return warm_cli.run_torchrun(cmd, env=env, timeout=150)


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
    dst = tmp_path / "full.pt"
    args = ["convert", str(src), str(dst), "--to", "full", "--src-local", "--verify", "--quiet"]
    proc = _torchrun(tmp_path, nodes, src, *args)
    assert proc.returncode == 0, proc.stderr
    assert "shardckpt:" not in proc.stderr  # no note: --src-local said it is expected
    assert not any(Path(src).iterdir())
    ref = torch.load(fsdp2_ckpt.ref, weights_only=True)
    assert_trees_equal(torch.load(dst, weights_only=True), ref)


@pytest.mark.timeout(200)
def test_torchrun_writes_each_nodes_target_ranks_to_its_own_disk(fsdp2_ckpt, tmp_path):
    if not _can_unshare():
        pytest.skip("cannot make a mount namespace here (unshare -m needs root)")
    nodes = tmp_path / "nodes"
    for node in (0, 1):
        (nodes / f"node{node}").mkdir(parents=True)
    disk = tmp_path / "disk"  # empty here; each rank sees its node's directory at this path
    disk.mkdir()
    dst = disk / "ckpt-4"
    args = ["convert", str(fsdp2_ckpt.dcp), str(dst), "--to", "sharded", "--world-size", "4"]
    proc = _torchrun(tmp_path, nodes, disk, *args, "--verify", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "shardckpt: note: DST is on 2 disks the ranks do not share, so each holds a block of "
        "target ranks: rank 0's disk 0-1, rank 1's disk 2-3 (where a job at 4 on as many "
        "nodes runs them)"
    ]
    assert not any(disk.iterdir())
    held = {n: sorted(p.name for p in (nodes / f"node{n}" / "ckpt-4").iterdir()) for n in (0, 1)}
    assert held == {
        0: [".metadata", "__0_0.distcp", "__1_0.distcp"],
        1: [".metadata", "__2_0.distcp", "__3_0.distcp"],
    }
    gathered = tmp_path / "gathered"
    shutil.copytree(nodes / "node0" / "ckpt-4", gathered)
    for file in (nodes / "node1" / "ckpt-4").iterdir():
        shutil.copy(file, gathered)
    ref = torch.load(fsdp2_ckpt.ref, weights_only=True)
    assert_trees_equal(load_dcp_into_fsdp2(gathered, 4), ref)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("on_nodes", [[1], [0, 1]], ids=["one node", "every node"])
def test_a_dst_that_exists_on_some_nodes_disks_stops_every_rank_at_once_naming_it(
    tmp_path, on_nodes
):
    if not _can_unshare():
        pytest.skip("cannot make a mount namespace here (unshare -m needs root)")
    nodes = tmp_path / "nodes"
    for node in (0, 1):
        (nodes / f"node{node}").mkdir(parents=True)
    for node in on_nodes:
        (nodes / f"node{node}" / "out").symlink_to("elsewhere")  # dangling: still there
    disk = tmp_path / "disk"  # empty here; each rank sees its node's directory at this path
    disk.mkdir()
    src = tmp_path / "small.pt"
    torch.save({"w": torch.arange(21.0).reshape(7, 3)}, src)
    args = ["convert", str(src), str(disk / "out"), "--to", "sharded", "--world-size", "2"]
    start = time.monotonic()
    # A rank left waiting for the others would give up only after SHARDCKPT_TIMEOUT.
    proc = _torchrun(tmp_path, nodes, disk, *args, timeout_s=300)
    assert time.monotonic() - start < 100, proc.stderr
    assert proc.returncode != 0
    where = (
        "" if on_nodes == [0, 1] else f" (on rank 1, host {socket.gethostname()}; not on rank 0)"
    )
    line = (
        f"shardckpt: error: '{disk / 'out'}': already exists{where}: pass --overwrite to replace it"
    )
    ours = [text for text in proc.stderr.splitlines() if text.startswith("shardckpt:")]
    assert ours == [line]  # printed once, by rank 0, and nothing else before it
    # torchrun's summary names the same cause for every rank, never a stalled one.
    causes = [
        text.split("traceback : ", 1)[1]
        for text in proc.stderr.splitlines()
        if "traceback : " in text
    ]
    assert causes and set(causes) == {line}
    assert "stalled" not in proc.stderr and "lost contact" not in proc.stderr
    for node in (0, 1):
        expect = ["out"] if node in on_nodes else []
        assert sorted(p.name for p in (nodes / f"node{node}").iterdir()) == expect
