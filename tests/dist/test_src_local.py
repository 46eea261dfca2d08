"""Sources on the nodes' own disks: each rank sees only its part of SRC, rows move over gloo.

FSDP2's DCP checkpoint at 4 ranks (``fsdp2_ckpt``) is split as a job that saved to
node-local disks leaves it: the coordinator's "node" holds ``.metadata`` and the first
ranks' ``*.distcp`` files, each other node the files of its own ranks. Each conversion
rank gets its own directory (``ranks.convert_own``), so it cannot read what the others
hold. Outputs are checked against torch's own state: the full state the training job
gathered (``ref.pt``), FSDP2 at M loading the DCP output, and torch's ``Shard(0)`` rule
for the per-rank files.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import ranks
from harness import run_ranks
from rank_bytes import assert_rank_files_hold_torchs_shards, file_hashes
from reference import assert_trees_equal, load_dcp_into_fsdp2
from shardckpt.formats.fsdp2.reader import quiet_mesh_unpickling
from shardckpt.state.tree import subtree, walk

pytestmark = pytest.mark.timeout(300)

# Which of the 4 saving ranks' files each conversion rank's node holds.
SPLITS = {2: [[0, 1], [2, 3]], 3: [[0, 1], [2], [3]]}


@pytest.fixture(scope="module")
def ref(fsdp2_ckpt):
    return torch.load(fsdp2_ckpt.ref, weights_only=True)


def _nodes(src: Path, root: Path, nproc: int) -> list[str]:
    """Copy each node's part of the DCP directory ``src`` under ``root``; return the paths, by rank."""
    out = []
    for node, saved in enumerate(SPLITS[nproc]):
        here = root / f"node{node}" / "step-2"
        here.mkdir(parents=True)
        if node == 0:
            shutil.copy(src / ".metadata", here)
        for rank in saved:
            shutil.copy(src / f"__{rank}_0.distcp", here)
        out.append(str(here))
    return out


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_dcp_split_over_node_local_disks_converts_to_full_exactly(
    fsdp2_ckpt, ref, tmp_path, nproc
):
    srcs = _nodes(fsdp2_ckpt.dcp, tmp_path, nproc)
    dst = tmp_path / "full.pt"
    run_ranks(ranks.convert_own, nproc, srcs, str(dst), "full", {"src_local": True, "verify": True})
    assert_trees_equal(torch.load(dst, weights_only=True), ref)


@pytest.mark.parametrize("nproc, m", [(2, 3), (3, 2)])
def test_a_dcp_split_over_node_local_disks_reshards_for_fsdp2_at_m(
    fsdp2_ckpt, ref, tmp_path, nproc, m
):
    srcs = _nodes(fsdp2_ckpt.dcp, tmp_path, nproc)
    dst = tmp_path / "dcp"
    kwargs = {"src_local": True, "world_size": m}
    run_ranks(ranks.convert_own, nproc, srcs, str(dst), "sharded", kwargs)
    assert_trees_equal(load_dcp_into_fsdp2(dst, m), ref)


@pytest.mark.parametrize("nproc, m", [(2, 3), (3, 5)])
def test_a_dcp_split_over_node_local_disks_becomes_fsdp2_rank_files_at_m(
    fsdp2_ckpt, ref, tmp_path, nproc, m
):
    srcs = _nodes(fsdp2_ckpt.dcp, tmp_path, nproc)
    dst = tmp_path / "ranks"
    run_ranks(ranks.convert_own, nproc, srcs, str(dst), "local", {"world_size": m})
    assert_rank_files_hold_torchs_shards(dst, ref, m)
    # The same files as from a source every rank sees.
    shared = tmp_path / "shared"
    run_ranks(ranks.convert, nproc, str(fsdp2_ckpt.dcp), str(shared), "local", {"world_size": m})
    assert file_hashes(dst) == file_hashes(shared)


def _error(srcs: list[str], dst: Path) -> tuple[str, int, str]:
    """Return the error rank 0 ended with (every rank must end with its exit code)."""
    out = run_ranks(ranks.convert_expecting_failure, len(srcs), srcs, str(dst), "full")
    assert len({code for _, code, _ in out}) == 1 and out[0][1] != 0, out
    return out[0]


def test_a_data_file_no_rank_sees_is_named_on_every_rank(fsdp2_ckpt, tmp_path):
    srcs = _nodes(fsdp2_ckpt.dcp, tmp_path, 2)
    (Path(srcs[1]) / "__3_0.distcp").unlink()
    assert _error(srcs, tmp_path / "out.pt") == (
        "BadInputError",
        3,
        f"'{srcs[0]}': missing data file '__3_0.distcp' named by .metadata: copy every "
        "*.distcp file of the checkpoint",
    )
    assert not (tmp_path / "out.pt").exists()


def test_copies_of_one_file_that_differ_between_ranks_are_refused(fsdp2_ckpt, tmp_path):
    srcs = _nodes(fsdp2_ckpt.dcp, tmp_path, 2)
    shutil.copy(fsdp2_ckpt.dcp / "__0_0.distcp", srcs[1])
    with open(Path(srcs[1]) / "__0_0.distcp", "ab") as f:
        f.write(b"\0")
    size = (fsdp2_ckpt.dcp / "__0_0.distcp").stat().st_size
    assert _error(srcs, tmp_path / "out.pt") == (
        "BadInputError",
        3,
        f"'{srcs[0]}/__0_0.distcp': is {size} bytes on rank 0 but {size + 1} on rank 1: the "
        "ranks' copies of SRC differ; copy it again from where the job saved it",
    )


def test_a_directory_with_no_metadata_on_any_rank_says_the_save_did_not_finish(
    fsdp2_ckpt, tmp_path
):
    srcs = _nodes(fsdp2_ckpt.dcp, tmp_path, 2)
    (Path(srcs[0]) / ".metadata").unlink()
    assert _error(srcs, tmp_path / "out.pt") == (
        "BadInputError",
        3,
        f"'{srcs[0]}': has *.distcp files but no '.metadata': the DCP save did not finish; "
        "use a checkpoint whose save completed",
    )


def test_a_file_source_only_some_ranks_see_is_refused_in_one_line(fsdp2_ckpt, tmp_path):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    shutil.copy(fsdp2_ckpt.ref, tmp_path / "node0" / "full.pt")
    srcs = [str(tmp_path / "node0" / "full.pt"), str(tmp_path / "node1" / "full.pt")]
    assert _error(srcs, tmp_path / "out.safetensors") == (
        "BadInputError",
        3,
        f"'{srcs[0]}': not every rank sees every file of this torch checkpoint, and such a "
        "source is read from one filesystem every rank sees: copy SRC where every rank sees "
        "it (only DCP sources are read from node-local disks)",
    )


def test_a_rank_whose_node_holds_none_of_src_still_converts_its_share(fsdp2_ckpt, ref, tmp_path):
    srcs = [str(fsdp2_ckpt.dcp), str(tmp_path / "nothing-here")]
    dst = tmp_path / "full.safetensors"
    run_ranks(ranks.convert_own, 2, srcs, str(dst), "full", {"src_local": True})
    (tmp_path / "again").mkdir()
    run_ranks(ranks.convert, 2, str(fsdp2_ckpt.dcp), str(tmp_path / "again" / "full.safetensors"), "full", {})
    assert file_hashes(dst) == file_hashes(tmp_path / "again" / "full.safetensors")
