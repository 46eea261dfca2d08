"""Acceptance: FSDP2's DCP at 4 resharded to DCP at M is what FSDP2 at M itself saves, file by
file and chunk by chunk, and loads into FSDP2 at M exactly; any launch size writes the same."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ranks
from harness import run_ranks
from reference import (
    assert_trees_equal,
    dcp_to_torch_save_reference,
    load_dcp_into_fsdp2,
    make_fsdp2_dcp,
)
from shardckpt import api

_DATA_FILE = re.compile(r"^__(\d+)_0\.distcp$")


def chunk_layout(dcp_dir: Path) -> dict[str, set[tuple]]:
    """Return, per key of a DCP checkpoint, its set of (data-file rank, offsets, sizes)."""
    with open(dcp_dir / ".metadata", "rb") as f:
        md = pickle.load(f)
    layout: dict[str, set[tuple]] = {k: set() for k in md.state_dict_metadata}
    for index, info in md.storage_data.items():
        rank = int(_DATA_FILE.match(info.relative_path).group(1))
        entry = md.state_dict_metadata[index.fqn]
        if isinstance(entry, TensorStorageMetadata):
            (chunk,) = [c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset)]
            layout[index.fqn].add((rank, tuple(chunk.offsets), tuple(chunk.sizes)))
        else:
            layout[index.fqn].add((rank, None, None))
    return layout


def data_files(dcp_dir: Path) -> list[str]:
    """Return the names of the files in a DCP directory, sorted."""
    return sorted(p.name for p in dcp_dir.iterdir())


@pytest.fixture(scope="module")
def ref(fsdp2_ckpt):
    return torch.load(fsdp2_ckpt.ref, weights_only=True)


@pytest.fixture(scope="module")
def fsdp2_saves(tmp_path_factory):
    """Return ``save(M)``: the DCP directory real FSDP2 training at M ranks saves (made once per M)."""
    root = tmp_path_factory.mktemp("fsdp2_at_m")
    made: dict[int, Path] = {}

    def save(world_size: int) -> Path:
        if world_size not in made:
            out = root / f"dcp{world_size}"
            made[world_size] = make_fsdp2_dcp(
                out, root / f"ref{world_size}.pt", world_size=world_size, steps=1
            ).dcp
        return made[world_size]

    return save


@pytest.fixture(scope="module")
def resharded(fsdp2_ckpt, tmp_path_factory):
    """Return ``reshard(M)``: the session checkpoint converted standalone to DCP at M (once per M)."""
    root = tmp_path_factory.mktemp("resharded")
    made: dict[int, Path] = {}

    def reshard(world_size: int) -> Path:
        if world_size not in made:
            dst = root / f"at{world_size}"
            result = api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=dst, to="sharded", world_size=world_size))
            assert result.world_size == world_size
            made[world_size] = dst
        return made[world_size]

    return reshard


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_resharding_fsdp2_at_4_writes_the_files_and_chunks_fsdp2_at_m_saves(
    resharded, fsdp2_saves, world_size
):
    dst, theirs = resharded(world_size), fsdp2_saves(world_size)
    expected_files = [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)]
    assert data_files(dst) == data_files(theirs) == sorted(expected_files)
    ours, expected = chunk_layout(dst), chunk_layout(theirs)
    assert set(ours) == set(expected)
    for key in expected:
        assert ours[key] == expected[key], key


def read_metadata(dcp_dir: Path):
    """Return a DCP checkpoint's ``.metadata``, unpickled (torch's own files, trusted here)."""
    with open(dcp_dir / ".metadata", "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_the_metadata_is_what_dcp_save_of_fsdp2_at_m_writes(resharded, fsdp2_saves, world_size):
    # Planned once for the tree (formats/dcp/save_plan.py), not by DCP's planner per target
    # rank: every entry, chunk, property, file offset and length must still be torch's own.
    # Only the save's identity (its path, a random id) is the job's.
    ours, theirs = read_metadata(resharded(world_size)), read_metadata(fsdp2_saves(world_size))
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    for key, entry in theirs.state_dict_metadata.items():
        assert ours.state_dict_metadata[key] == entry, key
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    assert ours.version == theirs.version


@pytest.mark.parametrize("world_size", [3, 8])
def test_the_resharded_checkpoint_loads_into_fsdp2_at_m_exactly(resharded, ref, world_size):
    assert_trees_equal(load_dcp_into_fsdp2(resharded(world_size), world_size), ref)


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_two_ranks_reshard_to_the_same_checkpoint_as_one(
    fsdp2_ckpt, resharded, tmp_path, world_size
):
    one, two = resharded(world_size), tmp_path / "two"
    summaries = run_ranks(
        ranks.convert, 2, str(fsdp2_ckpt.dcp), str(two), "sharded", {"world_size": world_size}
    )
    assert [s["world_size"] for s in summaries] == [world_size, world_size]
    assert data_files(two) == data_files(one)
    assert chunk_layout(two) == chunk_layout(one)
    for r in range(world_size):
        name = f"__{r}_0.distcp"
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
    assert_trees_equal(
        torch.load(dcp_to_torch_save_reference(two, tmp_path / "two.pt"), weights_only=False),
        torch.load(dcp_to_torch_save_reference(one, tmp_path / "one.pt"), weights_only=False),
    )


def test_a_full_source_resharded_to_three_by_two_ranks_loads_into_fsdp2_at_three(
    fsdp2_ckpt, ref, tmp_path
):
    # A full source has no chunks to tell buffers from parameters: every tensor with a
    # dimension is split on dim 0, which DCP reshards on load all the same.
    dst = tmp_path / "at3"
    run_ranks(ranks.convert, 2, str(fsdp2_ckpt.ref), str(dst), "sharded", {"world_size": 3})
    assert data_files(dst) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert chunk_layout(dst)["model.pos_scale"] == {
        (0, (0, 0), (2, 48)),
        (1, (2, 0), (2, 48)),
        (2, (4, 0), (1, 48)),
    }
    assert_trees_equal(load_dcp_into_fsdp2(dst, 3), ref)
