"""Per-rank file names and layout labels of the ``fsdp2-ranks`` format (no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate, Shard

from shardckpt.errors import BadInputError
from shardckpt.formats import detect
from shardckpt.formats.fsdp2_ranks import describe_placements, rank_file_name, rank_files


def touch(directory: Path, *names: str) -> Path:
    for name in names:
        (directory / name).write_bytes(b"PK\x03\x04")
    return directory


def test_the_writer_names_files_rank_r_dot_pt():
    assert [rank_file_name(r) for r in range(3)] == ["rank0.pt", "rank1.pt", "rank2.pt"]


@pytest.mark.parametrize(
    "files",
    [
        ["rank0.pt", "rank1.pt"],
        ["rank_0.pt", "rank_1.pt"],
        ["model_rank0.pth", "model_rank1.pth"],
        ["rank0-of-2.pt", "rank1-of-2.pt"],
        ["__0_0.pt", "__1_0.pt"],
    ],
)
def test_common_per_rank_names_are_one_part_with_their_ranks(tmp_path, files):
    touch(tmp_path, *files, "README.md")
    parts = rank_files(tmp_path)
    assert len(parts) == 1
    assert {r: p.name for r, p in next(iter(parts.values())).items()} == dict(enumerate(files))
    assert detect(tmp_path) == "fsdp2-ranks"


def test_verl_saves_model_optim_and_extra_state_as_three_parts(tmp_path):
    touch(
        tmp_path,
        *(
            f"{p}_world_size_2_rank_{r}.pt"
            for p in ("model", "optim", "extra_state")
            for r in (0, 1)
        ),
    )
    parts = rank_files(tmp_path)
    assert sorted(parts) == ["extra_state", "model", "optim"]
    assert parts["optim"][1].name == "optim_world_size_2_rank_1.pt"


def test_two_files_for_one_rank_are_refused(tmp_path):
    touch(tmp_path, "rank0.pt", "rank_0.pt")
    with pytest.raises(BadInputError) as exc:
        rank_files(tmp_path)
    assert exc.value.line() == (
        f"'{tmp_path}': two files for rank 0: 'rank0.pt' and 'rank_0.pt': "
        "keep one file per rank in the directory"
    )


def test_layouts_name_each_placement_over_each_mesh_dimension():
    assert describe_placements([Shard(0)], (4,)) == "Shard(0) over 4"
    assert describe_placements([Replicate(), Shard(0)], (2, 2)) == "Replicate×Shard(0) over 2×2"
