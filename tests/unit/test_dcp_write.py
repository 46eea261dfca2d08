"""Writing DCP: empty mappings survive it, and a full disk is one line naming the file (exit 4)."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from reference import assert_trees_equal
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.core.background import Background
from shardckpt.formats import open_reader

# ---------------------------------------------------------------- empty mappings


def before_first_step() -> dict:
    """Return what a training loop saves before its first step: an optimizer with ``state: {}``."""
    return {
        "model": {"w": torch.arange(21.0).reshape(7, 3), "b": torch.ones(3)},
        "optim": {
            "state": {},
            "param_groups": [{"lr": 0.1, "momentum": 0.0, "params": ["w", "b"]}],
        },
        "trainer": {"callbacks": {}, "epoch": 0},
        "extra": {},
        "buffers": [torch.zeros(2), {}],
        "none_yet": [],
    }


@pytest.fixture
def converted(tmp_path) -> tuple[Path, Path]:
    """Return (torch.save source, its DCP conversion at world size 2)."""
    torch.save(before_first_step(), tmp_path / "src.pt")
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "src.pt", dst=tmp_path / "dcp", to="sharded", world_size=2
        )
    )
    return tmp_path / "src.pt", tmp_path / "dcp"


def test_empty_mappings_read_back_from_dcp_output_in_their_place(converted):
    src, out = converted
    tree = open_reader(out).index().tree
    assert tree["optim"]["state"] == {} and tree["trainer"] == {"callbacks": {}, "epoch": 0}
    assert tree["extra"] == {} and tree["buffers"][1] == {} and tree["none_yet"] == []
    assert list(tree) == list(before_first_step())
    assert api.diff(api.DiffRequest(a=src, b=out)).equal


def test_an_optimizer_before_its_first_step_is_still_an_optimizer_in_dcp_output(converted):
    _, out = converted
    (found,) = api.inspect(api.InspectRequest(src=out)).optimizers
    assert (found.path, found.num_groups, found.num_params) == (("optim",), 1, 2)


def test_dcp_to_torch_save_sees_the_empty_mappings_a_loader_can_take(converted, tmp_path):
    _, out = converted
    dcp_to_torch_save(out, tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    expected = before_first_step()
    # Kept from torch's readers (dcp_write._SavePlanner): a top-level {} beside a
    # model, and a {} in a list of tensors; DCP's own save drops those too.
    del expected["extra"]
    expected["buffers"] = expected["buffers"][:1]
    assert_trees_equal(back, expected)


def test_dcp_load_into_a_state_dict_that_holds_the_same_empty_mappings_works(tmp_path):
    # An optimizer with tensor state beside a top-level {}: had the {} been stored under
    # its key, DCP's loader would take it for a pre-2.4 checkpoint and fail with
    # "Missing key in checkpoint state_dict: optim.param_groups".
    def state(fill: float) -> dict:
        return {
            "model": {"w": torch.full((7, 3), fill)},
            "optim": {
                "state": {"w": {"exp_avg": torch.full((7, 3), fill), "step": torch.tensor(fill)}},
                "param_groups": [{"lr": 0.1, "params": ["w"]}],
            },
            "extra": {},
        }

    torch.save(state(2.0), tmp_path / "src.pt")
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "src.pt", dst=tmp_path / "dcp", to="sharded", world_size=3
        )
    )
    loader = state(0.0)
    dcp.load(loader, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert_trees_equal(loader, state(2.0))


def test_empty_lists_were_already_kept_as_values(converted):
    _, out = converted
    md = pickle.loads((out / ".metadata").read_bytes())
    assert md.planner_data["none_yet"] == ("none_yet",) and "none_yet" in md.state_dict_metadata


@pytest.mark.parametrize("inner", [{}, torch.zeros(2)], ids=["empty mapping", "tensor"])
def test_two_paths_with_one_dotted_name_are_refused_in_one_line(capsys, tmp_path, inner):
    # DCP names a leaf by its dotted path; torch's own flattening raised a ValueError.
    torch.save({"a.b": torch.ones(2), "a": {"b": inner}}, tmp_path / "src.pt")
    code = run(
        [
            "convert",
            str(tmp_path / "src.pt"),
            str(tmp_path / "dcp"),
            "--to",
            "sharded",
            "--world-size",
            "1",
        ]
    )
    assert (code, capsys.readouterr().err.strip().splitlines()[-1]) == (
        3,
        "shardckpt: error: cannot be written as DCP (duplicated flatten key a.b): two paths "
        "have one dotted name: --rename or --drop one of them, or write --to full",
    )
    assert not (tmp_path / "dcp").exists()


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_fs(tmp_path):
    """Return ``mount(size)``: a fresh tmpfs of ``size`` bytes, unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a small tmpfs needs root and mount(8)")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


@pytest.fixture
def big(tmp_path) -> Path:
    """Return a 360 KB DCP checkpoint written by ``dcp.save``."""
    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(300, 300, generator=g)}, "epoch": 3}
    dcp.save(state, checkpoint_id=tmp_path / "big", no_dist=True)
    return tmp_path / "big"


FULL = "No space left on device while writing: free some space, or write DST on another filesystem"


@pytest.mark.launches
def test_a_full_disk_while_writing_a_data_file_names_it(capsys, big, small_fs):
    fs = small_fs(256 * 1024)  # rank 0's half fits, rank 1's does not
    code = run(["convert", str(big), str(fs / "out"), "--to", "sharded", "--world-size", "2"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert (code, line) == (
        4,
        f"shardckpt: error: '{fs / '.out.shardckpt-partial' / '__1_0.distcp'}': {FULL}",
    )
    assert list(fs.iterdir()) == []


@pytest.mark.launches
def test_a_full_disk_while_writing_the_metadata_names_it(capsys, big, small_fs, tmp_path):
    api.convert(api.ConvertRequest(src=big, dst=tmp_path / "sized", to="sharded", world_size=1))
    data = (tmp_path / "sized" / "__0_0.distcp").stat().st_size
    # Room for the data file and the lock file beside DST (a page each), not one page more.
    fs = small_fs(-(-data // 4096) * 4096 + 4096)
    code = run(["convert", str(big), str(fs / "out"), "--to", "sharded", "--world-size", "1"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert (code, line) == (
        4,
        f"shardckpt: error: '{fs / '.out.shardckpt-partial' / '.metadata'}': {FULL}",
    )
    assert list(fs.iterdir()) == []


# ---------------------------------------------------------------- .metadata beside the data


@pytest.mark.launches
def test_metadata_written_by_a_forked_process_is_the_one_finish_writes(big, tmp_path, monkeypatch):
    from shardckpt.formats.dcp import writer

    monkeypatch.setattr(writer, "BACKGROUND_ITEMS", 1 << 62)
    api.convert(api.ConvertRequest(src=big, dst=tmp_path / "inline", to="sharded", world_size=3))
    monkeypatch.setattr(writer, "BACKGROUND_ITEMS", 0)
    forks = []
    monkeypatch.setattr(writer, "Background", lambda fn: forks.append(fn) or Background(fn))
    api.convert(api.ConvertRequest(src=big, dst=tmp_path / "forked", to="sharded", world_size=3))
    assert len(forks) == 1
    inline, forked = tmp_path / "inline", tmp_path / "forked"
    assert sorted(p.name for p in forked.iterdir()) == sorted(p.name for p in inline.iterdir())
    for path in inline.iterdir():
        assert (forked / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.launches
@pytest.mark.parametrize("items", [0, 1 << 62], ids=["forked", "inline"])
def test_a_failed_metadata_write_is_one_line_naming_it_forked_or_not(
    capsys, big, tmp_path, monkeypatch, items
):
    from shardckpt.formats.dcp import writer

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "BACKGROUND_ITEMS", items)
    monkeypatch.setattr(writer, "dump", full)
    out = tmp_path / "out"
    code = run(["convert", str(big), str(out), "--to", "sharded", "--world-size", "2"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    staged = tmp_path / ".out.shardckpt-partial" / ".metadata"
    assert (code, line) == (4, f"shardckpt: error: '{staged}': {FULL}")
    assert not out.exists() and not staged.parent.exists()
