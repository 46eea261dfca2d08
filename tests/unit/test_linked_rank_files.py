"""Two names of one file (a symlink or a hard link) standing for two ranks' files are refused.

Each passes every per-file check, and a reader would take one rank's bytes for another's:
in a DCP directory whose ranks' files have the same layout, that was a conversion with
exit 0 and swapped or repeated values. The torch-checkpointing cases are in
test_torch_checkpointing_format.py.
"""

from __future__ import annotations

import os

import fsdp1_jobs
import pytest
import torch

from shardckpt import api
from shardckpt.cli.app import run

SEPARATE = (
    "copy each file itself into the checkpoint directory, from where the checkpoint was saved"
)


def _optim_tree() -> dict:
    """Return optimizer state only (split by every format without --model), 9 rows: 3 per rank at 3."""
    g = torch.Generator().manual_seed(0)
    state = {"w": {"exp_avg": torch.randn(9, 4, generator=g)}}
    return {"optim": {"state": state, "param_groups": [{"lr": 0.1, "params": ["w"]}]}}


def _link(kind: str, directory, name: str, target: str) -> None:
    (directory / name).unlink()
    if kind == "symlink":
        os.symlink(target, directory / name)
    else:
        os.link(directory / target, directory / name)


def _refused(capsys, src, tmp_path, *extra) -> tuple[int, str]:
    """Return the exit code and error line of converting ``src`` to a full file; DST must not exist."""
    out = tmp_path / "dst"
    out.mkdir()
    code = run(["convert", str(src), str(out / "full.pt"), "--to", "full", *extra])
    assert list(out.iterdir()) == []  # no DST, no partial output, no lock file
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
@pytest.mark.parametrize("fmt", ["fsdp2-ranks", "fsdp1-sharded", "fsdp1-local"])
def test_a_local_rank_file_linked_to_another_ranks_is_refused(capsys, tmp_path, fmt, kind):
    extra: list[str] = []
    if fmt == "fsdp1-local":
        torch.save({"model": fsdp1_jobs.build_model().state_dict()}, tmp_path / "src.pt")
        extra = ["--model", "fsdp1_jobs:build_model", "--wrap", "fsdp1_jobs:Block"]
    else:
        torch.save(_optim_tree(), tmp_path / "src.pt")
    ranks = tmp_path / "ranks"
    argv = ["convert", tmp_path / "src.pt", ranks, "--to", "local", "--format", fmt]
    assert run([*map(str, argv), "--world-size", "2", *extra]) == 0
    _link(kind, ranks, "rank_1.pt", "rank_0.pt")
    assert _refused(capsys, ranks, tmp_path, *extra) == (
        3,
        f"shardckpt: error: '{ranks / 'rank_1.pt'}': is the same file as 'rank_0.pt' (a symlink "
        f"or hard link), but rank 1's file and rank 0's file must be two files: {SEPARATE}",
    )


def test_a_part_linked_to_another_parts_file_is_refused(capsys, tmp_path):
    torch.save(_optim_tree(), tmp_path / "src.pt")
    api.convert(
        api.ConvertRequest(src=tmp_path / "src.pt", dst=tmp_path / "one", to="local", world_size=2)
    )
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for rank in range(2):  # veRL's layout: a model part and an optim part per rank
        os.replace(tmp_path / "one" / f"rank_{rank}.pt", ranks / f"optim_rank_{rank}.pt")
    os.link(ranks / "optim_rank_0.pt", ranks / "model_rank_0.pt")
    os.link(ranks / "optim_rank_1.pt", ranks / "model_rank_1.pt")
    assert _refused(capsys, ranks, tmp_path) == (
        3,
        f"shardckpt: error: '{ranks / 'optim_rank_0.pt'}': is the same file as 'model_rank_0.pt' "
        "(a symlink or hard link), but rank 0's file of 'optim' and rank 0's file of 'model' "
        f"must be two files: {SEPARATE}",
    )


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
@pytest.mark.parametrize("fmt", ["dcp", "lightning"])
def test_a_dcp_data_file_linked_to_another_is_refused(capsys, tmp_path, fmt, kind):
    # At 3, ranks 1 and 2 store one 3x4 chunk each at the same offsets: before, a link
    # converted with exit 0, rank 2's rows and values read from rank 1's file.
    torch.save(_optim_tree(), tmp_path / "src.pt")
    src = tmp_path / fmt
    api.convert(
        api.ConvertRequest(src=tmp_path / "src.pt", dst=src, to="sharded", format=fmt, world_size=3)
    )
    assert (src / "__1_0.distcp").stat().st_size == (src / "__2_0.distcp").stat().st_size
    _link(kind, src, "__2_0.distcp", "__1_0.distcp")
    assert _refused(capsys, src, tmp_path) == (
        3,
        f"shardckpt: error: '{src / '__2_0.distcp'}': is the same file as '__1_0.distcp' (a "
        "symlink or hard link), but '__2_0.distcp' and '__1_0.distcp' must be two files: "
        f"{SEPARATE}",
    )
