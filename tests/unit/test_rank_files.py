"""Per-rank file names: which file is which rank's, and one-line errors for incomplete sets."""

from __future__ import annotations

import pytest

from shardckpt.errors import BadInputError
from shardckpt.formats.rank_files import rank_files


def touch(d, *names):
    for n in names:
        (d / n).write_bytes(b"")
    return d


def test_plain_and_verl_and_accelerate_names_are_recognised(tmp_path):
    plain = tmp_path / "a"
    plain.mkdir()
    touch(plain, "rank_0.pt", "rank_1.pt")
    assert [f.rank for f in rank_files(plain)[""]] == [0, 1]
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
