"""DST is written beside itself, locked for the run, and never allowed to touch SRC."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.cli.app import run
from shardckpt.core.lock import FileLock


def lines_of(capsys, argv):
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def small(tmp_path):
    sd = {"model": {"w": torch.arange(21.0).reshape(7, 3)}, "epoch": 1}
    torch.save(sd, tmp_path / "small.pt")
    return tmp_path


def tree_bytes(root):
    """Return {relative path: bytes} of every file under ``root`` (or of the file itself)."""
    if root.is_file():
        return {".": root.read_bytes()}
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


# ---------------------------------------------------------------- DST around SRC (item 1)


def test_dst_that_contains_src_is_refused_and_src_survives_overwrite(capsys, tmp_path):
    inner = tmp_path / "dir" / "inner"
    inner.mkdir(parents=True)
    torch.save({"w": torch.ones(3)}, inner / "x.pt")
    before = tree_bytes(tmp_path / "dir")
    code, err = lines_of(
        capsys,
        [
            "convert",
            inner / "x.pt",
            tmp_path / "dir",
            "--to",
            "sharded",
            "--world-size",
            "1",
            "--overwrite",
        ],
    )
    assert (code, err) == (
        2,
        [
            f"shardckpt: error: '{tmp_path / 'dir'}': DST holds SRC ('{inner / 'x.pt'}'): "
            "write the conversion somewhere else; SRC is never modified"
        ],
    )
    assert tree_bytes(tmp_path / "dir") == before


@pytest.mark.parametrize("dst", [".", "..", "./"])
def test_dst_that_is_the_current_directory_or_around_it_is_refused(capsys, small, monkeypatch, dst):
    monkeypatch.chdir(small)
    before = tree_bytes(small)
    code, err = lines_of(
        capsys, ["convert", "small.pt", dst, "--to", "sharded", "--world-size", "1", "--overwrite"]
    )
    assert code == 2
    assert err == [
        f"shardckpt: error: '{dst.rstrip('/') or dst}': DST is the current directory or a "
        "directory around it: name a new file or directory for the output"
    ]
    assert tree_bytes(small) == before


def test_dst_that_is_src_through_a_symlink_is_refused(capsys, small):
    (small / "link.pt").symlink_to(small / "small.pt")
    code, err = lines_of(
        capsys, ["convert", small / "small.pt", small / "link.pt", "--to", "full", "--overwrite"]
    )
    assert code == 2 and "DST is SRC or inside it" in err[-1]
    assert torch.load(small / "small.pt")["epoch"] == 1


def test_dst_holding_a_file_a_src_directory_links_to_is_refused(capsys, tmp_path):
    """SRC's members are resolved too: replacing DST would delete data SRC points at."""
    sd = {"w": torch.arange(6.0)}
    dcp.save(sd, checkpoint_id=tmp_path / "real", no_dist=True)
    (tmp_path / "out").mkdir()
    os.replace(tmp_path / "real" / "__0_0.distcp", tmp_path / "out" / "__0_0.distcp")
    (tmp_path / "real" / "__0_0.distcp").symlink_to(tmp_path / "out" / "__0_0.distcp")
    code, err = lines_of(
        capsys,
        [
            "convert",
            tmp_path / "real",
            tmp_path / "out",
            "--to",
            "sharded",
            "--world-size",
            "1",
            "--overwrite",
        ],
    )
    assert code == 2 and err[-1].startswith(
        f"shardckpt: error: '{tmp_path / 'out'}': DST holds SRC"
    )
    assert (tmp_path / "out" / "__0_0.distcp").is_file()


def test_overwrite_never_replaces_a_directory_that_holds_no_checkpoint(capsys, small):
    (small / "notes").mkdir()
    (small / "notes" / "todo.txt").write_text("keep")
    code, err = lines_of(
        capsys,
        [
            "convert",
            small / "small.pt",
            small / "notes",
            "--to",
            "sharded",
            "--world-size",
            "1",
            "--overwrite",
        ],
    )
    assert (code, err) == (
        2,
        [
            f"shardckpt: error: '{small / 'notes'}': is a directory that holds no checkpoint, so "
            "--overwrite will not replace it: remove it yourself if you mean it, or choose another DST"
        ],
    )
    assert (small / "notes" / "todo.txt").read_text() == "keep"


def test_overwrite_replaces_an_earlier_output_directory(capsys, small):
    argv = [
        "convert",
        small / "small.pt",
        small / "ckpt",
        "--to",
        "sharded",
        "-q",
    ]
    assert run([str(a) for a in [*argv, "--world-size", "1"]]) == 0
    assert run([str(a) for a in [*argv, "--world-size", "2", "--overwrite"]]) == 0
    assert sorted(p.name for p in (small / "ckpt").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert sorted(p.name for p in small.iterdir()) == ["ckpt", "small.pt"]


def test_a_dangling_symlink_dst_is_not_replaced_without_overwrite(capsys, small):
    (small / "out.pt").symlink_to(small / "nowhere.pt")
    code, err = lines_of(capsys, ["convert", small / "small.pt", small / "out.pt", "--to", "full"])
    assert (code, err) == (
        5,
        [f"shardckpt: error: '{small / 'out.pt'}': already exists: pass --overwrite to replace it"],
    )
    assert os.readlink(small / "out.pt") == str(small / "nowhere.pt")


# ---------------------------------------------------------------- one run per DST (item 2)


def test_a_second_run_to_a_locked_dst_fails_at_once_and_touches_nothing(capsys, small):
    lock = FileLock(small / ".out.pt.shardckpt-lock")
    lock.acquire()
    try:
        (small / ".out.pt.shardckpt-partial").write_bytes(b"the other run's")
        code, err = lines_of(
            capsys, ["convert", small / "small.pt", small / "out.pt", "--to", "full"]
        )
    finally:
        lock.release()
    assert (code, err) == (
        4,
        [
            f"shardckpt: error: '{small / 'out.pt'}': is being written by another shardckpt run "
            f"(pid {os.getpid()} on {os.uname().nodename}): wait for that run to finish, "
            "or write to another DST"
        ],
    )
    assert (small / ".out.pt.shardckpt-partial").read_bytes() == b"the other run's"
    assert not (small / "out.pt").exists()


def test_the_lock_file_is_gone_after_a_run_that_succeeded_or_failed(capsys, small):
    assert (
        run([str(a) for a in ["convert", small / "small.pt", small / "o.pt", "--to", "full"]]) == 0
    )
    (small / "bad.pt").write_bytes(b"PK\x03\x04 not a zip")
    assert run([str(a) for a in ["convert", small / "bad.pt", small / "p.pt", "--to", "full"]]) == 3
    assert sorted(p.name for p in small.iterdir()) == ["bad.pt", "o.pt", "small.pt"]


# ---------------------------------------------------------------- leftovers of killed runs (item 13)


def test_leftovers_of_dead_runs_are_repaired_and_live_ones_left_alone(capsys, small):
    # A dead run's partial output (its lock file is there, but nobody holds it).
    (small / ".dead.pt.shardckpt-partial").write_bytes(b"x" * 100)
    (small / ".dead.pt.shardckpt-lock").write_text("pid 1 on elsewhere\n")
    # A run killed between the two renames of --overwrite: DST moved aside, not yet replaced.
    torch.save({"w": torch.ones(2)}, small / ".moved.pt.shardckpt-old")
    # A live run's partial output.
    live = FileLock(small / ".live.pt.shardckpt-lock")
    live.acquire()
    (small / ".live.pt.shardckpt-partial").mkdir()
    try:
        code, err = lines_of(
            capsys, ["convert", small / "small.pt", small / "o.pt", "--to", "full"]
        )
    finally:
        assert (small / ".live.pt.shardckpt-partial").is_dir()
        live.release()
    assert code == 0
    assert err == [
        f"shardckpt: note: removed '{small / '.dead.pt.shardckpt-partial'}', the partial output "
        "of a shardckpt run that was killed",
        f"shardckpt: note: put back '{small / 'moved.pt'}' from '.moved.pt.shardckpt-old': "
        "a run with --overwrite was killed while replacing it",
    ]
    assert torch.equal(torch.load(small / "moved.pt")["w"], torch.ones(2))
    assert sorted(p.name for p in small.iterdir()) == [
        ".live.pt.shardckpt-partial",
        "moved.pt",
        "o.pt",
        "small.pt",
    ]


def test_a_src_that_looks_like_a_leftover_is_never_removed(capsys, small):
    src = small / ".x.pt.shardckpt-partial"
    os.replace(small / "small.pt", src)
    code, err = lines_of(
        capsys, ["convert", src, small / "o.pt", "--to", "full", "--from", "torch"]
    )
    assert code == 0 and err == []
    assert src.is_file()


def test_a_dst_put_back_from_a_dead_overwrite_still_needs_overwrite(capsys, small):
    torch.save({"w": torch.zeros(1)}, small / ".o.pt.shardckpt-old")
    code, err = lines_of(capsys, ["convert", small / "small.pt", small / "o.pt", "--to", "full"])
    assert code == 5 and err[-1].endswith("already exists: pass --overwrite to replace it")
    assert torch.equal(torch.load(small / "o.pt")["w"], torch.zeros(1))


# ---------------------------------------------------------------- DST names its format (item 7)


@pytest.mark.parametrize(
    "dst, argv, line",
    [
        (
            "x.safetensors",
            ["--to", "full", "--format", "torch"],
            "DST ends in .safetensors, a safetensors file, but --format is torch: "
            "pass --format safetensors, or name DST like the torch files it will hold",
        ),
        (
            "x.pt",
            ["--to", "full", "--format", "safetensors"],
            "DST ends in .pt, a torch file, but --format is safetensors: "
            "pass --format torch, or name DST like the safetensors files it will hold",
        ),
        (
            "x.pt",
            ["--to", "full", "--format", "hf"],
            "--format hf writes a directory, but DST ends in .pt, a torch file: "
            "name DST without a file suffix, or pass --format torch",
        ),
        (
            "x.bin",
            ["--to", "sharded", "--world-size", "1"],
            "--format dcp writes a directory, but DST ends in .bin, a torch file: "
            "name DST without a file suffix, or pass --format torch",
        ),
    ],
)
def test_a_dst_suffix_that_contradicts_the_format_is_a_usage_error(capsys, small, dst, argv, line):
    code, err = lines_of(capsys, ["convert", small / "small.pt", small / dst, *argv])
    assert (code, err) == (2, [f"shardckpt: error: '{small / dst}': {line}"])
    assert not (small / dst).exists()


# ---------------------------------------------------------------- --verify before the rename (item 7)


def test_a_failed_verify_leaves_no_dst_and_says_where(capsys, small, monkeypatch):
    from shardckpt.engine import rows as engine

    real = engine.contiguous_bytes

    def corrupted(tensor):
        data = bytearray(real(tensor))
        data[0] ^= 0xFF
        return memoryview(bytes(data))

    monkeypatch.setattr(engine, "contiguous_bytes", corrupted)
    code, err = lines_of(
        capsys,
        ["convert", small / "small.pt", small / "o.safetensors", "--to", "full", "--verify"],
    )
    assert (code, err) == (
        4,
        [
            f"shardckpt: error: '{small / 'o.safetensors'}': --verify found 1 differing leaves, "
            "first 'model.w' (values differ); nothing was written to DST: the output did not "
            "read back equal to SRC; please report this"
        ],
    )
    assert sorted(p.name for p in small.iterdir()) == ["small.pt"]


def test_verify_of_a_good_output_keeps_it(capsys, small):
    argv = ["convert", small / "small.pt", small / "o.safetensors", "--to", "full", "--verify"]
    assert run([str(a) for a in argv]) == 0
    assert sorted(p.name for p in small.iterdir()) == ["o.safetensors", "small.pt"]


def test_a_symlink_planted_at_the_lock_name_is_not_followed(capsys, small):
    (small / "victim").write_text("precious")
    (small / ".out.pt.shardckpt-lock").symlink_to(small / "victim")
    code, err = lines_of(capsys, ["convert", small / "small.pt", small / "out.pt", "--to", "full"])
    assert code == 4 and err[-1].startswith(
        f"shardckpt: error: '{small / 'out.pt'}': cannot prepare the output ("
    )
    assert (small / "victim").read_text() == "precious"
    assert not (small / "out.pt").exists()


def test_odd_leftover_names_and_unremovable_leftovers_do_not_stop_a_run(capsys, small):
    (small / "....shardckpt-old").write_text("x")  # the name it would restore is '..'
    (small / "...shardckpt-partial").mkdir()  # '.'
    code, err = lines_of(capsys, ["convert", small / "small.pt", small / "o.pt", "--to", "full"])
    assert (code, err) == (0, [])
    assert (small / "....shardckpt-old").exists() and (small / "o.pt").is_file()


def test_a_dst_inside_a_directory_an_entry_of_src_links_to_is_allowed(capsys, tmp_path):
    """Only SRC itself can contain DST; a directory symlink beside its files is not SRC."""
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    (tmp_path / "logs").mkdir()
    (tmp_path / "ckpt" / "logs").symlink_to(tmp_path / "logs")
    dst = tmp_path / "logs" / "out.pt"
    assert run([str(a) for a in ["convert", tmp_path / "ckpt", dst, "--to", "full", "-q"]]) == 0
    assert torch.equal(torch.load(dst)["w"], torch.arange(6.0))


def test_missing_parent_directories_of_dst_are_created_and_said(capsys, small):
    dst = small / "new" / "deeper" / "out.pt"
    assert run(["convert", str(small / "small.pt"), str(dst), "--to", "full", "-q"]) == 0
    assert dst.is_file()
    assert capsys.readouterr().err == (
        f"shardckpt: note: created '{dst.parent}', the missing parent directory of DST\n"
    )
    assert (
        run(
            ["convert", str(small / "small.pt"), str(dst.parent / "again.pt"), "--to", "full", "-q"]
        )
        == 0
    )
    assert capsys.readouterr().err == ""
