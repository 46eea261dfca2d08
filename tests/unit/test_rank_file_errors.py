"""A per-rank file that cannot be written or read is one line naming it, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import fsdp1_jobs
import pytest
import torch
from conditions import tiny_disk

from shardckpt import api
from shardckpt.cli.app import run

# FSDP splits optimizer state as it splits parameters, so no --model is needed here.
EXP_AVG = 256 * 1024  # float32 elements: 1 MiB, 512 KiB per rank at 2


@pytest.fixture
def optim_only(tmp_path):
    state = {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(EXP_AVG // 64, 64)}}
    path = tmp_path / "optim.pt"
    torch.save({"optim": {"state": state, "param_groups": [{"lr": 0.1, "params": ["w"]}]}}, path)
    return path


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs (needs root); unmounted when the test ends."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip() or done.returncode}")
    yield mnt
    if os.path.ismount(mnt):
        # A file left open on it would make it busy: detach it then, rather than leak it.
        if subprocess.run(["umount", str(mnt)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.launches
@pytest.mark.parametrize("fmt", ["fsdp2-ranks", "fsdp1-sharded"])
def test_a_full_disk_while_writing_a_rank_file_is_one_line(optim_only, small_fs, capsys, fmt):
    dst = small_fs / "out"
    argv = ["convert", str(optim_only), str(dst), "--to", "local", "--world-size", "2"]
    code = run([*argv, "--format", fmt])
    assert (code, capsys.readouterr().err.strip()) == (
        4,
        f"shardckpt: error: '{small_fs / '.out.shardckpt-partial' / 'rank_0.pt'}': No space left "
        "on device while writing: free some space, or write DST on another filesystem",
    )
    assert os.listdir(small_fs) == []
    # Nothing of the failed write stays open: the filesystem is not busy.
    assert subprocess.run(["umount", str(small_fs)], check=False).returncode == 0


# A plain value bigger than the disk: the first file's torch.save skeleton cannot be written.
BIG_VALUE = "x" * 256 * 1024


@pytest.mark.launches
@pytest.mark.parametrize(
    "fmt, to, first",
    [
        ("fsdp2-ranks", "local", "rank_0.pt"),
        ("fsdp1-sharded", "local", "rank_0.pt"),
        ("torch-checkpointing", "sharded", "optim_0.pt"),
        ("lightning", "sharded", "meta.pt"),
    ],
)
def test_a_full_disk_while_laying_out_a_file_names_it(capsys, tmp_path, fmt, to, first):
    # Before, the skeleton's write was outside the guard that names the file: "No space
    # left on device" with no file, or an internal error from torch's zip writer.
    state = {"w": {"exp_avg": torch.ones(64, 64)}}
    tree = {"optim": {"state": state, "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    if fmt == "lightning":  # its DCP part fits; meta.pt, written last, holds the big value
        tree = {"model": {"w": torch.ones(8, 4)}, "loops": {"note": BIG_VALUE}}
    else:
        tree["optim"]["param_groups"][0]["note"] = BIG_VALUE
    torch.save(tree, tmp_path / "src.pt")
    with tiny_disk("64k") as disk:
        argv = ["convert", str(tmp_path / "src.pt"), str(disk / "out"), "--to", to]
        code = run([*argv, "--format", fmt, "--world-size", "2"])
        assert (code, capsys.readouterr().err.strip().splitlines()[-1]) == (
            4,
            f"shardckpt: error: '{disk / '.out.shardckpt-partial' / first}': No space left on "
            "device while writing: free some space, or write DST on another filesystem",
        )
        assert list(disk.iterdir()) == []


# Runs the CLI on each directory and prints [exit code, error line] per directory as JSON.
_INSPECT_ALL = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from shardckpt.cli.app import run
    out = []
    for src in sys.argv[1:]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = run(["inspect", src])
        out.append([code, err.getvalue().strip()])
    print(json.dumps(out))
    """
)


def _inspect_unreadable(dirs: list[str]) -> list[list]:
    """Return [exit code, error line] of ``inspect`` on each directory, run by a user the files deny."""
    argv = [sys.executable, "-c", _INSPECT_ALL, *dirs]
    if os.geteuid() == 0:
        # root reads any file: drop the capabilities that let it, so file modes apply.
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search"
        argv = ["setpriv", "--bounding-set", caps, "--inh-caps", caps, *argv]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0 and "setpriv" in done.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.launches
def test_an_unreadable_rank_file_is_named_as_permission_denied(optim_only, tmp_path):
    dirs = []
    for fmt in ("fsdp2-ranks", "fsdp1-sharded"):
        dst = tmp_path / fmt
        api.convert(
            api.ConvertRequest(src=optim_only, dst=dst, to="local", format=fmt, world_size=2)
        )
        dirs.append(dst)
    torch.save({"model": fsdp1_jobs.build_model().state_dict()}, tmp_path / "model.pt")
    dirs.append(tmp_path / "fsdp1-local")
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "model.pt",
            dst=dirs[-1],
            to="local",
            format="fsdp1-local",
            world_size=2,
            model="fsdp1_jobs:build_model",
            wraps=["fsdp1_jobs:Block"],
        )
    )
    for d in dirs:
        os.chmod(d / "rank_1.pt", 0)
    assert _inspect_unreadable([str(d) for d in dirs]) == [
        [
            4,
            f"shardckpt: error: '{d / 'rank_1.pt'}': permission denied: check the file's "
            "permissions; shardckpt needs to read it",
        ]
        for d in dirs
    ]
