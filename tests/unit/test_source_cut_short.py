"""A SRC file cut short while a run reads it ends the run with exit 3 naming it (issue 30, item 13).

A DCP export mapped each run of rows it copied: a data file truncated under the mapping
killed the process (SIGBUS, exit 135) with the partial output and the lock left, or
ended it as "internal error (BufferError ...)", exit 4. A ``torch.save`` file, mapped by
``torch.load(mmap=True)``, ended as a failed write of DST ("Bad address", exit 4); a
safetensors file as an internal error. Here the cut is made at a known point of a real
run, in a process of its own (forked from the warm interpreter, ``warm_cli``): at the
first slice's write (the first slice of a run read, the rest not; the kernel's copy or a
``pwrite``, as DST's filesystem has it), or as
the first step of the write begins (the source opened and mapped, nothing read yet), at
several lengths.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
import warm_cli
from safetensors.torch import save_file

from shardckpt.core.files import SRC_CHANGED
from shardckpt.engine import fill, stored_copy

pytestmark = pytest.mark.launches


def _cut_at(point: str, target: str, size: int) -> None:
    """In the warm child: cut ``target`` to ``size`` bytes at ``point`` ("copy": the first
    slice's write; "step": as the first step of the write begins)."""

    def cut():
        if os.path.getsize(target) > size:
            os.truncate(target, size)

    if point == "copy":
        write_slice = stored_copy._write_slice

        def write_after_cut(*args):
            cut()
            return write_slice(*args)

        stored_copy._write_slice = write_after_cut
    else:
        step = fill._fill

        def step_after_cut(*args, **kwargs):
            cut()
            return step(*args, **kwargs)

        fill._fill = step_after_cut


BIG = 3 << 20
"""Elements of the large tensor: 12 MiB of float32, three slices of the copy and more."""


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"big": torch.randn(BIG, generator=gen), "w": torch.randn(97, 3, generator=gen)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Return a directory with the same tensors as a DCP save, a ``torch.save`` file and a safetensors file."""
    root = tmp_path_factory.mktemp("cut_short")
    dcp.save({"model": {"big": tensors()["big"]}}, checkpoint_id=root / "dcp", no_dist=True)
    torch.save(tensors(), root / "src.pt")
    save_file(tensors(), root / "src.safetensors")
    return root


def cut_while_converting(src, file, point: str, size: int, dst) -> subprocess.CompletedProcess:
    """Run ``convert SRC DST --to full`` in a process of its own that cuts ``file`` at ``point``."""
    argv = ["convert", src, dst, "--to", "full"]
    return warm_cli.run(argv, timeout=300, setup=(_cut_at, point, str(file), size))


def copy_of(path, into):
    """Return a copy of the file or directory ``path`` under ``into``: the run cuts it."""
    target = into / path.name
    subprocess.run(["cp", "-r", str(path), str(target)], check=True)
    return target


def assert_nothing_left(directory, dst) -> None:
    assert not dst.exists()
    assert sorted(p.name for p in directory.iterdir() if ".shardckpt-" in p.name) == []


@pytest.mark.parametrize("out", ["full.pt", "full.safetensors"])
@pytest.mark.parametrize(("size", "at"), [(0, 4195008), (100, 4195008), (6_000_000, 6_000_000)])
def test_a_dcp_file_cut_during_the_kernels_copy_is_exit_3(sources, tmp_path, out, size, at):
    src = copy_of(sources / "dcp", tmp_path)
    data = src / "__0_0.distcp"
    dst = tmp_path / out
    done = cut_while_converting(src, data, "copy", size, dst)
    assert done.returncode == 3, done.stderr
    assert done.stderr == (
        f"shardckpt: error: '{data}': truncated while it was read: it now ends at byte {at}, "
        f"inside the data of 'model.big': {SRC_CHANGED}\n"
    )
    assert_nothing_left(tmp_path, dst)


@pytest.mark.parametrize("out", ["full.pt", "full.safetensors"])
@pytest.mark.parametrize("size", [100, 6_000_000])
@pytest.mark.parametrize("name", ["src.safetensors", "src.pt"])
def test_a_file_cut_during_the_kernels_copy_is_exit_3(sources, tmp_path, name, out, size):
    # Its large tensor is copied as it lies, a slice at a time, as a DCP chunk is, on a
    # thread of its own while the small one is read: either read may find the cut first
    # (a torch file's small tensor, read through its mapping, is named by its record).
    src = copy_of(sources / name, tmp_path)
    dst = tmp_path / out
    done = cut_while_converting(src, src, "copy", size, dst)
    assert done.returncode == 3, done.stderr
    assert re.fullmatch(
        rf"shardckpt: error: '{re.escape(str(src))}': truncated while it was read: it now ends "
        rf"at byte \d+, inside the data of ('big'|'w'|record '[^']+' at byte \d+): {re.escape(SRC_CHANGED)}\n",
        done.stderr,
    ), done.stderr
    assert_nothing_left(tmp_path, dst)


@pytest.mark.parametrize("size", [0, 100, 6_000_000])
def test_a_dcp_file_cut_before_the_first_step_is_exit_3(sources, tmp_path, size):
    src = copy_of(sources / "dcp", tmp_path)
    data = src / "__0_0.distcp"
    dst = tmp_path / "full.pt"
    done = cut_while_converting(src, data, "step", size, dst)
    assert done.returncode == 3, done.stderr
    # Placing the chunk reads its zip first: cut there, it is told as damaged, which it now is.
    assert done.stderr.startswith(f"shardckpt: error: '{data}': ")
    assert "truncated" in done.stderr or "damaged" in done.stderr
    assert done.stderr.count("\n") == 1
    assert_nothing_left(tmp_path, dst)


@pytest.mark.parametrize("size", [100, 6_000_000])
@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("src.pt", "truncated while it was read: "),
        ("src.safetensors", "truncated while it was read: "),
    ],
)
def test_a_mapped_file_cut_before_the_first_step_is_exit_3(sources, tmp_path, size, name, what):
    src = copy_of(sources / name, tmp_path)
    dst = tmp_path / "out.pt"
    done = cut_while_converting(src, src, "step", size, dst)
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith(f"shardckpt: error: '{src}': {what}")
    assert done.stderr.endswith(f": {SRC_CHANGED}\n")
    assert done.stderr.count("\n") == 1
    assert_nothing_left(tmp_path, dst)


def test_a_source_left_whole_converts_through_the_same_hooks(sources, tmp_path):
    src = copy_of(sources / "dcp", tmp_path)
    dst = tmp_path / "full.pt"
    size = (src / "__0_0.distcp").stat().st_size
    done = cut_while_converting(src, src / "__0_0.distcp", "copy", size, dst)
    assert (done.returncode, done.stderr) == (0, "")
    assert torch.equal(torch.load(dst, weights_only=True)["model"]["big"], tensors()["big"])
