"""A ``.pt`` cut short anywhere is called damaged (exit 3), never a disk failure (issue 23, item 3).

Cut at 20 KB or 60 KB of 125 KB, a file read as a disk problem ("reading failed (Invalid
argument): check the disk", exit 4): a zip's records were read past the end of the file.
Here every cut at each KiB of a real ``torch.save`` file, and of the same checkpoint as
shardckpt writes it, gets the one "damaged ... re-copy" line.
"""

from __future__ import annotations

import sys

import pytest
import torch
from user_shell import REPO

from shardckpt.cli.app import run

sys.path.insert(0, str(REPO / "examples"))
from make_checkpoint import build_model, build_optimizer  # noqa: E402

DAMAGED = (
    "is a damaged torch.save file (zip: File is not a zip file): re-copy it from where it was "
    "written"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Return the example model and AdamW state as ``torch.save`` writes it and as shardckpt does."""
    root = tmp_path_factory.mktemp("truncated")
    model = build_model()
    optimizer = build_optimizer(model)
    model(torch.randint(97, (2, 5), generator=torch.Generator().manual_seed(0))).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, root / "torch.pt")
    argv = ["convert", root / "torch.pt", root / "shardckpt.pt", "--to", "full", "-q"]
    assert run([str(a) for a in argv]) == 0
    return root


def cut(src, dst, size: int):
    dst.write_bytes(src.read_bytes()[:size])
    return dst


@pytest.mark.parametrize("writer", ["torch", "shardckpt"])
def test_a_file_cut_at_every_kib_is_damaged(capsys, files, tmp_path, writer):
    src = files / f"{writer}.pt"
    size = src.stat().st_size
    assert size > 100_000  # the file was 125 KB
    seen = {}
    for at in range(1024, size, 1024):
        code = run(["inspect", str(cut(src, tmp_path / "cut.pt", at))])
        seen[at] = (code, capsys.readouterr().err.strip())
    expected = (3, f"shardckpt: error: '{tmp_path / 'cut.pt'}': {DAMAGED}")
    assert {at: got for at, got in seen.items() if got != expected} == {}


@pytest.mark.parametrize("at", [100, 20_000, 20_480, 60_000, 61_440, -1])
def test_convert_and_diff_of_a_cut_file_say_damaged(capsys, files, tmp_path, at):
    src = files / "torch.pt"
    damaged = cut(src, tmp_path / "cut.pt", at if at > 0 else src.stat().st_size + at)
    for argv in (
        ["convert", damaged, tmp_path / "out.pt", "--to", "full"],
        ["diff", src, damaged],
    ):
        code = run([str(a) for a in argv])
        assert (code, capsys.readouterr().err.strip()) == (
            3,
            f"shardckpt: error: '{damaged}': {DAMAGED}",
        )
    assert not (tmp_path / "out.pt").exists()
