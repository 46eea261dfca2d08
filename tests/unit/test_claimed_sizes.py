"""Counts that metadata or an option claims, checked before anything is sized by them (issue 24
item 8): a world size a file claims must fit the rank files there, and a --world-size is
refused up front past the bounds of ``shardckpt.plan.world_limits``, instead of a run that fills
memory for minutes and ends as an internal error."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from conditions import run_capped
from optim_models import tiny

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.plan.world_limits import ANY_CHECKPOINT_RANKS, MAX_RANK_ENTRIES, MAX_WORLD_SIZE

BUDGET = 3 << 29  # address space past torch's import (650 MiB of the CPU wheel's, GiBs of CUDA's)
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
        api.ConvertRequest(
            src=tmp_path / "f.pt",
            dst=tmp_path / "tcp",
            to="sharded",
            format="torch-checkpointing",
            world_size=2,
        )
    )
    return tmp_path / "tcp"  # fmt: skip


def claim_world_size(ckpt, world_size: int, *, list_items: bool = True) -> None:
    """Make ``ckpt``'s metadata.pkl claim ``world_size`` ranks (and, unless ``list_items``, no item)."""
    meta = pickle.loads((ckpt / "metadata.pkl").read_bytes())
    meta["world_size"] = world_size
    if not list_items:  # its files are then found by name, as items saved without a resharder
        meta["metadata"] = {}
    (ckpt / "metadata.pkl").write_bytes(pickle.dumps(meta))


@pytest.mark.launches
@pytest.mark.parametrize("list_items", [True, False], ids=["listed", "found-by-name"])
def test_a_world_size_of_10_to_the_12_in_metadata_pkl_is_refused_against_the_files(
    torch_checkpointing, list_items
):
    claim_world_size(torch_checkpointing, HUGE, list_items=list_items)
    out = torch_checkpointing.parent / "out.pt"
    # The case: set(range(world_size)) filled memory for minutes.
    code, line, seconds = run_capped(["convert", torch_checkpointing, out, "--to", "full"], BUDGET)
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


# --- a world size the user asks for ---------------------------------------------------------

FEWER = "a DCP checkpoint, --to sharded, loads at any world size: dcp.load reshards it"


@pytest.fixture
def small(tmp_path):
    """Return a 3 KB checkpoint of Tiny's model and SGD-like state: at most 5 rows a tensor."""
    model = tiny().state_dict()
    torch.save({"model": model, "optim": {"step": 3, "lr": 0.1}}, tmp_path / "small.pt")
    return tmp_path / "small.pt"


@pytest.mark.launches
@pytest.mark.parametrize("to", ["sharded", "local"])
def test_a_world_size_past_the_most_is_refused_before_src_is_read(small, to):
    out = small.parent / "out"
    argv = ["convert", small, out, "--to", to, "--world-size", MAX_WORLD_SIZE + 1]
    # The case was --world-size 100000 on a 95 KB checkpoint: 275 s, then out of memory.
    code, line, seconds = run_capped([*argv, "--model", "optim_models:tiny"], BUDGET)
    assert (code, line) == (
        2,
        f"shardckpt: error: --world-size {MAX_WORLD_SIZE + 1} is more than {MAX_WORLD_SIZE}, "
        "the most ranks shardckpt writes a checkpoint for: every rank's files are planned and "
        f"written one by one: pass the number of ranks that will load DST ({FEWER})",
    )
    assert seconds < 60 and nothing_written(out)


@pytest.mark.parametrize(
    "options, what, parts",
    [
        (["--to", "sharded"], "SRC's tensors have at most 5 rows", 5),
        (["--to", "local", "--model", "optim_models:tiny"], "SRC's tensors have at most 5 rows", 5),
        # FSDP1's flat parameters are split by elements: 64 in Tiny, fewer than the floor.
        (["--to", "local", "--format", "fsdp1-local", "--model", "optim_models:tiny", "--wrap",
          "optim_models:Tiny"], "SRC's tensors hold 64 elements in all", 64),
    ],
)  # fmt: skip
def test_more_ranks_than_a_small_checkpoint_can_split_over_are_refused(
    small, capsys, options, what, parts
):
    out = small.parent / "out"
    world_size = 20_000  # the issue's --to local case: 9 files a second for 37 minutes
    code, line, seconds = error_of(
        capsys, ["convert", small, out, *options, "--world-size", world_size, "--only", "model"]
    )
    assert (code, line) == (
        2,
        f"shardckpt: error: --world-size {world_size} is more than {ANY_CHECKPOINT_RANKS} ranks, "
        f"and {what}: every rank past the first {parts} would hold no part of any split tensor: "
        f"pass --world-size {ANY_CHECKPOINT_RANKS} or less, the ranks that will load DST ({FEWER})",
    )
    assert seconds < 30 and nothing_written(out)


def test_past_the_floor_the_rows_of_the_tallest_tensor_are_the_most_ranks(tmp_path, capsys):
    torch.save(
        {"w": torch.zeros(2000, 2, dtype=torch.int8), "b": torch.zeros(3)}, tmp_path / "t.pt"
    )
    out = tmp_path / "out"
    argv = ["convert", tmp_path / "t.pt", out, "--to", "sharded", "--world-size", 2001]
    code, line, seconds = error_of(capsys, argv)
    assert (code, line) == (
        2,
        f"shardckpt: error: --world-size 2001 is more than {ANY_CHECKPOINT_RANKS} ranks, and "
        "SRC's tensors have at most 2000 rows: every rank past the first 2000 would hold no "
        f"part of any split tensor: pass --world-size 2000 or less, the ranks that will load "
        f"DST ({FEWER})",
    )
    assert seconds < 30 and nothing_written(out)


def test_more_ranks_times_leaves_than_are_laid_out_in_memory_are_refused(tmp_path, capsys):
    leaves, world_size = 1100, 4096
    assert world_size * leaves > MAX_RANK_ENTRIES
    tensors = {f"w{i}": torch.zeros(world_size, dtype=torch.int8) for i in range(leaves)}
    torch.save(tensors, tmp_path / "many.pt")
    out = tmp_path / "out"
    argv = ["convert", tmp_path / "many.pt", out, "--to", "sharded", "--world-size", world_size]
    code, line, seconds = error_of(capsys, argv)
    assert (code, line) == (
        2,
        f"shardckpt: error: --world-size {world_size} puts {leaves} tensors and values on each "
        f"rank, {world_size * leaves} in all, more than the {MAX_RANK_ENTRIES} shardckpt lays "
        f"out in memory at once: pass --world-size {MAX_RANK_ENTRIES // leaves} or less, or "
        "select fewer tensors (--only, --filter)",
    )
    assert seconds < 30 and nothing_written(out)


def test_a_small_checkpoint_is_still_written_for_a_few_more_ranks_than_it_has_rows(small, tmp_path):
    api.convert(
        api.ConvertRequest(
            src=small, dst=tmp_path / "out", to="sharded", world_size=7, only="model"
        )
    )
    assert len(list((tmp_path / "out").glob("*.distcp"))) == 7
