"""DST on the nodes' own disks: each node's ranks write their block of target ranks there.

Each conversion rank is given the DST path of its "node" (``ranks.convert_to_own``), so
the ranks of one node share a directory and no rank sees another node's. SRC is FSDP2's
DCP checkpoint at 4, which every rank sees. Every node's files must be the very files a
conversion to one shared DST writes, and what they hold is checked against torch: FSDP2
at M loading the DCP output, and torch's ``Shard(0)`` rule for the per-rank files.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import ranks
import torch
from harness import run_ranks
from rank_bytes import assert_rank_files_hold_torchs_shards, file_hashes
from reference import assert_trees_equal, load_dcp_into_fsdp2

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ref(fsdp2_ckpt):
    return torch.load(fsdp2_ckpt.ref, weights_only=True)


def _dsts(root: Path, nodes: list[list[int]], name: str) -> list[str]:
    """Return each rank's DST: ``root/node{g}/name`` for the node ``g`` that holds it."""
    by_rank = {rank: root / f"node{g}" / name for g, held in enumerate(nodes) for rank in held}
    for path in by_rank.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    return [str(by_rank[r]) for r in sorted(by_rank)]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_dcp_at_m_lands_on_each_nodes_disk_as_a_shared_dst_would_hold_it(fsdp2_ckpt, ref, tmp_path):
    # Nodes of 2 and 1 ranks, M = 5: target ranks 0-2 on node 0, 3-4 on node 1.
    dsts = _dsts(tmp_path, [[0, 1], [2]], "ckpt")
    kwargs = {"world_size": 5, "verify": True}
    out = run_ranks(ranks.convert_to_own, 3, str(fsdp2_ckpt.dcp), dsts, "sharded", kwargs)
    assert all(o["verified"] for o in out)
    node0, node1 = Path(dsts[0]), Path(dsts[2])
    assert _names(node0) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert _names(node1) == [".metadata", "__3_0.distcp", "__4_0.distcp"]
    for node in (node0.parent, node1.parent):  # no lock, staging or old copy left beside DST
        assert _names(node) == ["ckpt"]

    shared = tmp_path / "shared"
    run_ranks(ranks.convert, 3, str(fsdp2_ckpt.dcp), str(shared), "sharded", {"world_size": 5})
    assert file_hashes(node0) | file_hashes(node1) == file_hashes(shared)

    gathered = tmp_path / "gathered"
    shutil.copytree(node0, gathered)
    for file in node1.iterdir():
        shutil.copy(file, gathered)
    assert_trees_equal(load_dcp_into_fsdp2(gathered, 5), ref)


def test_fsdp2_rank_files_land_on_the_disk_of_the_node_whose_ranks_load_them(
    fsdp2_ckpt, ref, tmp_path
):
    dsts = _dsts(tmp_path, [[0], [1]], "ranks")
    run_ranks(ranks.convert_to_own, 2, str(fsdp2_ckpt.dcp), dsts, "local", {"world_size": 3})
    node0, node1 = Path(dsts[0]), Path(dsts[1])
    assert _names(node0) == ["rank_0.pt", "rank_1.pt"]
    assert _names(node1) == ["rank_2.pt"]
    # Each rank of the job at 3 loads its file from its own node's disk.
    assert_rank_files_hold_torchs_shards(lambda r: node0 if r < 2 else node1, ref, 3)
    shared = tmp_path / "shared"
    run_ranks(ranks.convert, 2, str(fsdp2_ckpt.dcp), str(shared), "local", {"world_size": 3})
    assert file_hashes(node0) | file_hashes(node1) == file_hashes(shared)


@pytest.mark.parametrize(
    "name, to, kwargs, line",
    [
        (
            "full.pt",
            "full",
            {},
            "the ranks write DST to 2 disks they do not share, and --format torch is one full "
            "output every rank writes into: write it to a filesystem every rank sees, or run "
            "the ranks on one node",
        ),
        (
            "ranks",
            "local",
            {"world_size": 2, "verify": True},
            "--verify reads DST back from every rank, and --format fsdp2-ranks on disks the "
            "ranks do not share cannot be: drop --verify and run diff on the gathered files, "
            "or write DST where every rank sees it",
        ),
    ],
)
def test_what_disks_the_ranks_do_not_share_cannot_hold_is_refused_and_nothing_is_left(
    fsdp2_ckpt, tmp_path, name, to, kwargs, line
):
    dsts = _dsts(tmp_path, [[0], [1]], name)
    out = run_ranks(
        ranks.convert_to_own_expecting_failure, 2, str(fsdp2_ckpt.dcp), dsts, to, kwargs
    )
    assert out[0] == ("UsageError", 2, f"'{dsts[0]}': {line}")
    assert out[1] == ("RemoteRankError", 2, f"rank 0 failed: {out[0][2]}")
    for dst in dsts:
        assert _names(Path(dst).parent) == []


def _stale_dir(dst: Path) -> None:
    dst.mkdir()
    (dst / "todo.txt").write_text("keep")


def _dangling_link(dst: Path) -> None:
    dst.symlink_to(dst.parent / "nowhere")


@pytest.mark.parametrize(
    "make, overwrite, line",
    [
        (_stale_dir, False, "already exists{where}: pass --overwrite to replace it"),
        (_dangling_link, False, "already exists{where}: pass --overwrite to replace it"),
        (
            _stale_dir,
            True,
            "is a directory that holds no checkpoint, so --overwrite will not replace it{where}: "
            "remove it yourself if you mean it, or choose another DST",
        ),
    ],
    ids=["directory", "dangling symlink", "not a checkpoint, with overwrite"],
)
@pytest.mark.parametrize("seen_on", [[2], [0, 1, 2]], ids=["one node", "every node"])
def test_a_dst_refused_on_some_nodes_stops_every_rank_at_once_with_that_line(
    tmp_path, seen_on, make, overwrite, line
):
    # Nodes of ranks 0-1 and 2; what is at DST differs between them.
    dsts = _dsts(tmp_path, [[0, 1], [2]], "out")
    for rank in seen_on:
        if not os.path.lexists(dsts[rank]):
            make(Path(dsts[rank]))
    before = {n: _names(tmp_path / f"node{n}") for n in (0, 1)}
    src = tmp_path / "small.pt"
    torch.save({"w": torch.arange(21.0).reshape(7, 3)}, src)
    kwargs = {"world_size": 3, "overwrite": overwrite}
    start = time.monotonic()
    # SHARDCKPT_TIMEOUT's wait, or a hang, would outlast the harness's 60 s.
    out = run_ranks(
        ranks.convert_to_own_expecting_failure, 3, str(src), dsts, "sharded", kwargs, timeout=60
    )
    assert time.monotonic() - start < 30
    code = 2 if overwrite else 5
    kind = "UsageError" if overwrite else "DestinationExistsError"
    host = socket.gethostname()
    # Every rank raises the same line: the real cause, and which ranks saw it. (Here each
    # node's DST has a path of its own, so node 0's refusal is not node 1's.)
    where = f" (on ranks 0-1, host {host})" if seen_on == [0, 1, 2] else ""
    if seen_on == [2]:
        where = f" (on rank 2, host {host}; not on ranks 0-1)"
    line = line.format(where=where)
    assert out == [(kind, code, f"'{dsts[seen_on[0]]}': {line}")] * 3
    assert {n: _names(tmp_path / f"node{n}") for n in (0, 1)} == before
