"""A low ``ulimit -n`` never fails a run for descriptors (issue 30, item 12).

At ``ulimit -n 64`` the DCP reader kept all 64 descriptors open for SRC's data files (a
floor of 64 on "a quarter of the limit"), and a 100-file DCP export failed with "Too
many open files"; a DCP or per-rank output at a world size of 100 held every DST file
open. Here each command that reads or writes many files runs in a process of its own
under a limit of 12 (Python and torch start at 8): every one succeeds and
writes what it would without the limit.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.core import files

pytestmark = pytest.mark.launches

FILES = 100

# Runs each command in this one process, under the limit, and prints each exit code.
UNDER_LIMIT = textwrap.dedent(
    """
    import json, resource, sys
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from shardckpt.cli.app import run
    print(json.dumps([run(argv) for argv in json.loads(sys.argv[2])]))
    """
)


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    # Uneven rows (97, 7): a world size of 100 leaves some ranks without any.
    tensors = {f"layer{i}.w": torch.randn(97 + i, 3, generator=gen) for i in range(FILES + 20)}
    tensors["head"] = torch.randn(7, 5, generator=gen)
    return tensors


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Return a directory holding ``full.pt`` and ``dcp100``, a DCP save of 100 data files by torch."""
    root = tmp_path_factory.mktemp("fd_limit")
    torch.save({"model": state()}, root / "full.pt")
    writer = dcp.FileSystemWriter(root / "dcp100", thread_count=FILES)
    dcp.save({"model": state()}, storage_writer=writer, no_dist=True)
    assert len(list((root / "dcp100").glob("*.distcp"))) == FILES
    return root


def under_limit(limit: int, commands: list[list]) -> list[int]:
    """Return the exit code of each command, run one after another in a process limited to ``limit`` descriptors."""
    argv = json.dumps([[str(a) for a in command] for command in commands])
    done = subprocess.run(
        [sys.executable, "-c", UNDER_LIMIT, str(limit), argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".shardckpt-" in p.name)


# 12 only: every path under 64 is also under 12, with a cache of 3 descriptors instead
# of 16 (test_a_cache_of_descriptors_keeps_a_quarter_of_the_limit); the issue's own
# export at 64 runs from a shell below. The eleven commands take half a minute.
@pytest.mark.parametrize("limit", [12])
def test_every_many_file_command_succeeds_under_a_low_limit(sources, tmp_path, limit):
    full, src = sources / "full.pt", sources / "dcp100"
    out = tmp_path
    commands = [
        # Reading 100 data files: the issue's export, and to a safetensors file.
        ["convert", src, out / "from_dcp.pt", "--to", "full", "-q"],
        ["convert", src, out / "from_dcp.safetensors", "--to", "full", "-q"],
        # Writing 100 files: a DCP output, per-rank files and an hf directory of many shards.
        ["convert", full, out / "dcp_out", "--to", "sharded", "--world-size", FILES, "-q"],
        ["convert", out / "dcp_out", out / "ranks", "--to", "local", "--world-size", FILES, "-q"],
        [
            "convert",
            full,
            out / "hf",
            "--to",
            "full",
            "--format",
            "hf",
            "--max-shard-size",
            "4KB",
            "-q",
        ],
        # Reading them back, 100 files at a time, and comparing two many-file sources.
        ["convert", out / "dcp_out", out / "back.pt", "--to", "full", "-q"],
        ["convert", out / "ranks", out / "ranks_back.pt", "--to", "full", "-q"],
        ["diff", out / "ranks", out / "dcp_out", "-q"],
        ["diff", out / "hf", src, "-q"],
        ["verify", out / "dcp_out", "-q"],
        ["verify", src, "-q"],
    ]
    assert under_limit(limit, commands) == [0] * len(commands)
    assert len(list((out / "dcp_out").glob("*.distcp"))) == FILES
    assert len(list((out / "hf").glob("*.safetensors"))) > 20
    for made in ("from_dcp.pt", "back.pt", "ranks_back.pt"):
        got = torch.load(out / made, weights_only=True)
        assert got.keys() == {"model"} and got["model"].keys() == state().keys()
        assert all(torch.equal(got["model"][k], v) for k, v in state().items()), made
    assert leftovers(out) == []


def test_the_issues_export_at_ulimit_64_from_a_shell(sources, tmp_path):
    dst = tmp_path / "full.pt"
    line = f"ulimit -n 64 && exec '{sys.executable}' -m shardckpt convert '{sources / 'dcp100'}' '{dst}' --to full"
    done = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (0, "")
    got = torch.load(dst, weights_only=True)["model"]
    assert all(torch.equal(got[k], v) for k, v in state().items())
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(("soft", "kept"), [(64, 16), (12, 3), (1024, 256), (65536, 4096)])
def test_a_cache_of_descriptors_keeps_a_quarter_of_the_limit(monkeypatch, soft, kept):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, resource.RLIM_INFINITY))
    assert files.kept_open() == kept


KEEPS_ALL = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from shardckpt.cli.app import run
    from shardckpt.formats.dcp import rows
    rows.kept_open = lambda: 10_000  # as if the limit were far higher than it is
    sys.exit(run(sys.argv[1:]))
    """
)


def test_a_reader_out_of_descriptors_gives_up_the_files_it_kept(sources, tmp_path):
    dst = tmp_path / "full.pt"
    argv = ["convert", str(sources / "dcp100"), str(dst), "--to", "full"]
    done = subprocess.run(
        [sys.executable, "-c", KEEPS_ALL, *argv], capture_output=True, text=True, timeout=300
    )
    assert (done.returncode, done.stderr) == (0, "")
    got = torch.load(dst, weights_only=True)["model"]
    assert all(torch.equal(got[k], v) for k, v in state().items())
    assert leftovers(tmp_path) == []


def test_out_of_descriptors_is_one_line_naming_the_file_and_the_limit(tmp_path):
    import errno

    error = files.os_error(OSError(errno.EMFILE, "Too many open files"), tmp_path / "x.distcp")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert (error.exit_code, error.line()) == (
        4,
        f"'{tmp_path / 'x.distcp'}': too many open files (the limit is {soft}): raise the "
        "limit of open files (ulimit -n) and run again",
    )


def test_dst_files_keep_their_share_open_and_a_pinned_file_stays(tmp_path, monkeypatch):
    from shardckpt.engine import dst_files

    monkeypatch.setattr(dst_files, "kept_open", lambda: 2)
    names = [f"f{i}" for i in range(8)]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    out = dst_files.DstFiles(tmp_path)
    pinned = out.pin("f0")  # a copy writes through it on another thread
    for i, name in enumerate(names[1:], 1):
        os.pwrite(out.fd(name), bytes([i]) * i, 0)
        out.written(name, 0, i)
        assert len(out._fds) <= 3  # two kept, and the pinned one
    os.pwrite(pinned, b"pinned", 0)  # still open, still f0's
    assert out.crowded is False
    out.unpin()
    assert out.count == len(names)  # each flushed by sync, open or not
    out.sync()
    out.close()
    assert (tmp_path / "f0").read_bytes() == b"pinned"
    assert [(tmp_path / n).read_bytes() for n in names[1:]] == [bytes([i]) * i for i in range(1, 8)]
