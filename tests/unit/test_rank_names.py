"""Per-rank file names of every local format: the one name written, the names read, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardckpt.core.errors import BadInputError
from shardckpt.formats import detect
from shardckpt.formats.ranks.rank_names import find_rank_files, rank_file_name, rank_files


def touch(directory: Path, *names: str) -> Path:
    for name in names:
        (directory / name).write_bytes(b"PK\x03\x04")
    return directory


def test_every_local_writer_names_files_rank_underscore_r_dot_pt():
    assert [rank_file_name(r) for r in range(3)] == ["rank_0.pt", "rank_1.pt", "rank_2.pt"]


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
        find_rank_files(tmp_path)
    assert exc.value.line() == (
        f"'{tmp_path}': two files for rank 0: 'rank0.pt' and 'rank_0.pt': "
        "keep one file per rank in the directory"
    )


def test_plain_and_verl_and_accelerate_names_are_recognised(tmp_path):
    plain = tmp_path / "a"
    plain.mkdir()
    touch(plain, "rank_0.pt", "rank_1.pt")
    assert list(rank_files(plain)[""]) == [0, 1]
    verl = tmp_path / "b"
    verl.mkdir()
    touch(
        verl,
        *(
            f"{s}_world_size_2_rank_{r}.pt"
            for s in ("model", "optim", "extra_state")
            for r in (0, 1)
        ),
    )
    assert sorted(rank_files(verl)) == ["extra_state", "model", "optim"]
    acc = tmp_path / "c"
    acc.mkdir()
    touch(acc, "pytorch_model_fsdp_rank0.bin", "pytorch_model_fsdp_rank1.bin", "notes.txt")
    assert list(rank_files(acc)) == ["pytorch_model_fsdp"]


def test_a_missing_rank_names_the_file_it_expects(tmp_path):
    touch(tmp_path, "model_world_size_4_rank_0.pt", "model_world_size_4_rank_1.pt")
    with pytest.raises(BadInputError) as err:
        rank_files(tmp_path)
    assert err.value.line() == (
        f"'{tmp_path}': no file for rank 2 of 4 (model_world_size_4_rank_2.pt): "
        "copy every rank's file of the checkpoint"
    )


def test_names_of_two_world_sizes_are_refused(tmp_path):
    touch(tmp_path, "m_world_size_2_rank_0.pt", "m_world_size_4_rank_1.pt")
    with pytest.raises(BadInputError) as err:
        rank_files(tmp_path)
    assert err.value.line() == (
        f"'{tmp_path}': holds files of different world sizes (2, 4): "
        "keep only one checkpoint's rank files in the directory"
    )


def test_a_world_size_in_an_of_name_finds_a_missing_last_rank(tmp_path):
    touch(tmp_path, "rank0-of-3.pt", "rank1-of-3.pt")
    with pytest.raises(BadInputError) as err:
        rank_files(tmp_path)
    assert err.value.line() == (
        f"'{tmp_path}': no file for rank 2 of 3 (rank2-of-3.pt): "
        "copy every rank's file of the checkpoint"
    )
