"""Counts that metadata claims, checked before anything is sized by them (issue 24 item 8): a
world size a file claims must fit the rank files there, instead of a run that fills memory
for minutes and ends as an internal error."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from conditions import run_capped

from shardckpt import api
from shardckpt.cli import run

CAP = 2 << 30  # address space: torch's import takes about 650 MiB of it
HUGE = 10**12


def error_of(capsys, argv) -> tuple[int, str, float]:
    """Return the exit code, last stderr line and wall seconds of an in-process run."""
    start = time.monotonic()
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1], time.monotonic() - start


def nothing_written(out) -> bool:
    """Return whether neither DST nor anything of a run staging it is beside it."""
    return not any(p.name.startswith((out.name, f".{out.name}")) for p in out.parent.iterdir())


# --- a world size that metadata claims ------------------------------------------------------


@pytest.fixture
def torch_checkpointing(tmp_path):
    """Return a torch_checkpointing directory of 2 ranks: a listed item and one found by name."""
    g = torch.Generator().manual_seed(0)
    torch.save(
        {"model": {"fc.weight": torch.randn(7, 3, generator=g)}, "epoch": 7}, tmp_path / "f.pt"
    )
    api.convert(
        tmp_path / "f.pt", tmp_path / "tcp", to="sharded", fmt="torch-checkpointing", world_size=2
    )
    return tmp_path / "tcp"  # fmt: skip


def claim_world_size(ckpt, world_size: int, *, list_items: bool = True) -> None:
    """Make ``ckpt``'s metadata.pkl claim ``world_size`` ranks (and, unless ``list_items``, no item)."""
    meta = pickle.loads((ckpt / "metadata.pkl").read_bytes())
    meta["world_size"] = world_size
    if not list_items:  # its files are then found by name, as items saved without a resharder
        meta["metadata"] = {}
    (ckpt / "metadata.pkl").write_bytes(pickle.dumps(meta))


@pytest.mark.parametrize("list_items", [True, False], ids=["listed", "found-by-name"])
def test_a_world_size_of_10_to_the_12_in_metadata_pkl_is_refused_against_the_files(
    torch_checkpointing, list_items
):
    claim_world_size(torch_checkpointing, HUGE, list_items=list_items)
    out = torch_checkpointing.parent / "out.pt"
    # The case: set(range(world_size)) filled memory for minutes.
    code, line, seconds = run_capped(["convert", torch_checkpointing, out, "--to", "full"], CAP)
    assert (code, line) == (
        3,
        f"shardckpt: error: '{torch_checkpointing / 'metadata.pkl'}': is not torch_checkpointing "
        f"metadata shardckpt can use: world_size is {HUGE}, but the directory holds 4 files "
        "besides metadata.pkl, and each rank saves a file of each item: re-copy it from where "
        "the checkpoint was saved",
    )
    assert seconds < 60 and nothing_written(out)


def test_a_world_size_just_past_the_files_is_refused_too(torch_checkpointing, capsys):
    claim_world_size(torch_checkpointing, 5)
    code, line, _ = error_of(capsys, ["inspect", torch_checkpointing])
    assert (code, line) == (
        3,
        f"shardckpt: error: '{torch_checkpointing / 'metadata.pkl'}': is not torch_checkpointing "
        "metadata shardckpt can use: world_size is 5, but the directory holds 4 files besides "
        "metadata.pkl, and each rank saves a file of each item: re-copy it from where the "
        "checkpoint was saved",
    )


@pytest.mark.parametrize(
    "name, missing",
    [
        (f"rank_0-of-{HUGE}.pt", f"rank_1-of-{HUGE}.pt"),
        (f"model_world_size_{HUGE}_rank_0.pt", f"model_world_size_{HUGE}_rank_1.pt"),
    ],
)
def test_a_world_size_of_10_to_the_12_in_rank_file_names_names_the_first_missing_file(
    tmp_path, capsys, name, missing
):
    (tmp_path / "ranks").mkdir()
    torch.save({"w": torch.ones(3)}, tmp_path / "ranks" / name)
    out = tmp_path / "out.pt"
    argv = ["convert", tmp_path / "ranks", out, "--to", "full", "--from", "fsdp1-sharded"]
    code, line, seconds = error_of(capsys, argv)
    assert (code, line) == (
        3,
        f"shardckpt: error: '{tmp_path / 'ranks'}': no file for rank 1 of {HUGE} ({missing}): "
        "copy every rank's file of the checkpoint",
    )
    assert seconds < 30 and nothing_written(out)
