"""A safetensors, hf or torch.save source's large tensors are copied as they lie, checked as read.

A tensor's bytes in a safetensors file, or in its storage's record of a ``torch.save``
zip, are what a ``.pt``, safetensors or hf output holds:
a run of a MiB or more is read a slice at a time and copied by the kernel
(``engine.stored_copy``), as DCP chunks are, instead of being read whole into a fresh
tensor of the step (a 1 GB safetensors export to ``.pt`` peaked at 600 MB of RSS, against
330 MB since; from ``.pt`` to safetensors, 590 MB against 300 MB). The checks stay: a flipped byte under a digest shardckpt wrote is exit 3
naming the file, with nothing left at DST.
"""

from __future__ import annotations

import pytest
import torch
from damage import copy, flip_in_safetensors, flip_in_torch_file
from safetensors.torch import load_file, save_file

from shardckpt.cli.app import run
from shardckpt.engine import stored_copy
from shardckpt.state.tree import dotted, walk

BIG = (1 << 20) + 7
"""Elements of the large tensor: 4 MiB and more of float32, more than one slice."""


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(BIG, generator=gen),
        "wide": torch.randn(1024, 600, generator=gen).to(torch.bfloat16),
        "small": torch.randn(7, 3, generator=gen),
    }


@pytest.fixture
def copies(monkeypatch) -> list[str]:
    """Return the tensors the kernel copy wrote, filled as the command runs."""
    seen: list[str] = []
    original = stored_copy.copy_runs

    def counted(runs, fd, offset, dst, key, *size):
        # Once per tensor: a large one is copied in pieces (``stored_copy.pieces_of``).
        if key not in seen:
            seen.append(key)
        return original(runs, fd, offset, dst, key, *size)

    monkeypatch.setattr("shardckpt.engine.fill.copy_runs", counted)
    return seen


def cli(capsys, *argv) -> tuple[int, list[str]]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def flat(tree: dict) -> dict[str, torch.Tensor]:
    return {dotted(path): leaf for path, leaf in walk(tree)}


@pytest.mark.parametrize("out", ["out.pt", "out.safetensors"])
def test_a_safetensors_files_large_tensors_are_copied_bit_exact(tmp_path, capsys, copies, out):
    src = tmp_path / "src.safetensors"
    save_file(tensors(), src)  # the safetensors library's file: no digests of ours
    dst = tmp_path / out
    assert cli(capsys, "convert", src, dst, "--to", "full", "-q") == (0, [])
    assert sorted(copies) == ["big", "wide"]
    got = flat(torch.load(dst, weights_only=True)) if out.endswith(".pt") else load_file(dst)
    assert got.keys() == tensors().keys()
    for key, want in tensors().items():
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key


def test_an_hf_directorys_shards_are_copied_bit_exact(tmp_path, capsys, copies):
    hf = tmp_path / "hf"
    made = ["--to", "full", "--format", "hf", "--max-shard-size", "3MB", "-q"]
    save_file(tensors(), tmp_path / "src.safetensors")
    assert cli(capsys, "convert", tmp_path / "src.safetensors", hf, *made) == (0, [])
    assert len(list(hf.glob("*.safetensors"))) > 1
    copies.clear()
    assert cli(capsys, "convert", hf, tmp_path / "back.pt", "--to", "full", "-q") == (0, [])
    assert sorted(copies) == ["big", "wide"]  # the names in the files
    got = flat(torch.load(tmp_path / "back.pt", weights_only=True))
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in tensors().items())


def test_a_cast_is_read_and_cast_not_copied(tmp_path, capsys, copies):
    src = tmp_path / "src.safetensors"
    save_file(tensors(), src)
    dst = tmp_path / "out.safetensors"
    assert cli(capsys, "convert", src, dst, "--to", "full", "--dtype", "bf16", "-q") == (0, [])
    assert copies == []
    got = load_file(dst)
    assert torch.equal(got["big"], tensors()["big"].to(torch.bfloat16))


@pytest.mark.parametrize("damaged", ["big", "wide"])
def test_a_flipped_byte_in_a_copied_tensor_of_our_own_export_is_exit_3(
    tmp_path, capsys, copies, damaged
):
    save_file(tensors(), tmp_path / "src.safetensors")
    export = tmp_path / "export.safetensors"
    assert (
        cli(capsys, "convert", tmp_path / "src.safetensors", export, "--to", "full", "-q")[0] == 0
    )
    src = copy(export, tmp_path / "flipped.safetensors")
    flipped = flip_in_safetensors(src, damaged)
    copies.clear()
    dst = tmp_path / "out.pt"
    assert cli(capsys, "convert", src, dst, "--to", "full") == (3, [flipped.line()])
    assert damaged in copies  # found where it was copied, not by another read
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if ".shardckpt-" in p.name] == []


def torch_tree() -> dict:
    """Return a tree whose large tensors are whole, a view at an offset, tied, and transposed."""
    t = tensors()
    base = torch.randn(BIG + 1000, generator=torch.Generator().manual_seed(1))
    return {
        "model": {**t, "tied": t["big"]},
        # A view 4,000 bytes into its storage: the coordinator reads those to judge the record.
        "offset_view": base[1000:],
        "transposed": torch.randn(600, 1024, generator=torch.Generator().manual_seed(2)).t(),
    }


@pytest.mark.parametrize("out", ["out.safetensors", "out.pt"])
def test_a_torch_files_large_tensors_are_copied_from_their_records_bit_exact(
    tmp_path, capsys, copies, out
):
    src = tmp_path / "src.pt"
    torch.save(torch_tree(), src)
    dst = tmp_path / out
    assert cli(capsys, "convert", src, dst, "--to", "full", "-q") == (0, [])
    # Each whole run is copied; the transposed view is not one run: read and laid out.
    assert sorted(copies) == ["0", "1", "3", "4"], copies
    got = flat(torch.load(dst, weights_only=True)) if out.endswith(".pt") else load_file(dst)
    for key, want in flat(torch_tree()).items():
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key


@pytest.mark.parametrize("damaged", ["model.big", "model.wide", "offset_view"])
def test_a_flipped_byte_in_a_copied_record_of_a_torch_file_is_exit_3(
    tmp_path, capsys, copies, damaged
):
    src = tmp_path / "src.pt"
    torch.save(torch_tree(), src)
    flipped = flip_in_torch_file(src, damaged)
    dst = tmp_path / "out.safetensors"
    assert cli(capsys, "convert", src, dst, "--to", "full") == (3, [flipped.line()])
    assert copies  # the damage is found by the copy
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if ".shardckpt-" in p.name] == []
