"""``--threads``: one process moves its bytes on a pool of worker threads (issue 31, item 2).

The same DST bytes, and the same JSON, at one thread and at four; a source cut short
while a worker reads it, a damaged byte a worker checks and a SIGTERM while the workers
copy end the run as they do with one thread (exit 3 naming the file, 128 + 15, nothing
left behind); the default takes the cores the process may use, shared by the ranks on its
node; the workers' slices come out of ``--buffer-size``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import warm_cli
from damage import copy, flip_in_dcp

from shardckpt.cli.app import run
from shardckpt.core.files import SRC_CHANGED
from shardckpt.engine import fill, stored_copy, workers

BIG = 3 << 20
"""Elements of the large tensor: 12 MiB of float32, twelve pieces of a MiB (``PIECES``)."""
PIECES = 1 << 20


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(31)
    return {
        "big": torch.randn(BIG, generator=gen),
        "wide": torch.randn(1024, 700, generator=gen).to(torch.bfloat16),
        "small": torch.randn(7, 3, generator=gen),
    }


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """Return a DCP checkpoint (torch's own save) of a large tensor, a wide one and a small one."""
    path = tmp_path_factory.mktemp("threads") / "dcp"
    dcp.save({"model": tensors()}, checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture(scope="module")
def copied(tmp_path_factory) -> Path:
    """Return a DCP checkpoint of the large tensors alone: every byte of it is copied by the workers."""
    path = tmp_path_factory.mktemp("threads") / "dcp"
    big = {k: v for k, v in tensors().items() if k != "small"}
    dcp.save({"model": big}, checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture
def pieces(monkeypatch) -> list[int]:
    """Cut copies into pieces of a MiB (many per tensor); return the threads that copied them."""
    monkeypatch.setattr(stored_copy, "PIECE", PIECES)
    seen: list[int] = []
    original = fill.copy_runs

    def spy(*args):
        seen.append(threading.get_ident())
        return original(*args)

    monkeypatch.setattr(fill, "copy_runs", spy)
    return seen


def cli(capsys, *argv) -> tuple[int, str, list[str]]:
    code = run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def files_of(dst: Path) -> dict[str, bytes]:
    """Return every file of DST (a file or a directory) by its path inside it."""
    if dst.is_file():
        return {"": dst.read_bytes()}
    return {str(p.relative_to(dst)): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()}


def without_costs(document: str) -> dict:
    """Return a JSON document less what a run's timing and memory make differ."""
    found = json.loads(document)
    for key in ("costs", "seconds", "wall_seconds", "read_seconds"):
        found.pop(key, None)
    return found


@pytest.mark.parametrize(
    "flags",
    [
        ("out.safetensors", "--to", "full"),
        ("out.pt", "--to", "full", "--format", "torch"),
        ("out-hf", "--to", "full", "--format", "hf", "--max-shard-size", "8MB"),
        ("out-dcp", "--to", "sharded", "--world-size", "3"),
    ],
    ids=["safetensors", "torch", "hf", "dcp-at-3"],
)
def test_dst_and_its_json_are_the_same_bytes_at_one_thread_and_at_four(
    src, tmp_path, capsys, pieces, flags
):
    name, *layout = flags
    dst = tmp_path / name  # one path: the JSON names it
    got = {}
    for threads in (4, 1):
        argv = ["convert", src, dst, *layout, "--threads", threads, "--json", "--overwrite"]
        code, out, err = cli(capsys, *argv)
        assert (code, err) == (0, []), err
        got[threads] = files_of(dst), without_costs(out), set(pieces)
        pieces.clear()
    assert got[1][0] == got[4][0]
    assert got[1][1] == got[4][1]
    # Tensors are copied as they lie, piece by piece: a full file's regions, and the
    # blobs of DCP's files at 3 (each target rank's file a job written front to back).
    assert got[1][2] == {threading.get_ident()}  # one thread: this one, no pool
    assert got[4][2] and threading.get_ident() not in got[4][2]  # the pool's, not this one
    # And they are intact, checked by four threads.
    assert cli(capsys, "verify", dst, "-q", "--threads", "4")[0] == 0


def test_a_small_buffer_shared_by_four_threads_writes_the_same_bytes(src, tmp_path, capsys, pieces):
    one, four = tmp_path / "one.safetensors", tmp_path / "four.safetensors"
    assert cli(capsys, "convert", src, one, "--to", "full", "--threads", "1", "-q")[0] == 0
    argv = ["convert", src, four, "--to", "full", "--threads", "4", "--buffer-size", "1MiB"]
    assert cli(capsys, *argv, "-q")[0] == 0
    assert one.read_bytes() == four.read_bytes()


def test_the_workers_slices_come_out_of_the_buffer():
    mib = 1 << 20
    # The default buffer over 16 threads: 2 MiB slices (an eighth of it), the rest for rows.
    assert workers.slice_bytes(256 * mib, 16) == 2 * mib
    assert workers.rows_budget(256 * mib, 16) == 224 * mib
    assert workers.slice_bytes(256 * mib, 2) == stored_copy.SLICE == 4 * mib
    for buffer in (96 * mib, 256 * mib, 4 << 30):
        for threads in (1, 2, 3, 8, 16, 64):
            size = workers.slice_bytes(buffer, threads)
            assert threads * size + workers.rows_budget(buffer, threads) <= buffer
            assert workers.MIN_SLICE <= size <= stored_copy.SLICE


def test_verify_finds_the_same_at_one_thread_and_at_four(src, tmp_path, capsys):
    intact = {t: cli(capsys, "verify", src, "--json", "--threads", t) for t in (1, 4)}
    assert intact[1][0] == intact[4][0] == 0
    assert without_costs(intact[1][1]) == without_costs(intact[4][1])
    damaged = tmp_path / "damaged"
    copy(src, damaged)
    flipped = flip_in_dcp(damaged, "model.big")
    for threads in (1, 4):
        code, _, err = cli(capsys, "verify", damaged, "-q", "--threads", threads)
        assert code == 3
        assert err == [
            f"shardckpt: error: '{flipped.file}': {flipped.message()}: the file was damaged "
            "after it was written; re-copy it"
        ]


@pytest.mark.parametrize(
    "layout",
    [("out.safetensors", "--to", "full"), ("out-dcp", "--to", "sharded", "--world-size", "3")],
    ids=["full", "dcp-at-3"],
)
def test_a_flipped_bit_a_worker_copies_is_exit_3_and_leaves_nothing(
    src, tmp_path, capsys, pieces, layout
):
    damaged = tmp_path / "damaged"
    copy(src, damaged)
    flipped = flip_in_dcp(damaged, "model.big")
    name, *flags = layout
    dst = tmp_path / name
    code, _, err = cli(capsys, "convert", damaged, dst, *flags, "--threads", "4")
    assert code == 3
    assert len(err) == 1 and err[0].startswith(f"shardckpt: error: '{flipped.file}': ")
    assert flipped.message() in err[0]
    assert pieces and threading.get_ident() not in pieces  # the workers copied it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged"]


@pytest.mark.parametrize("command", ["convert", "verify"])
@pytest.mark.parametrize("threads", ["0", "-2"])
def test_fewer_than_one_thread_is_a_usage_error(src, tmp_path, capsys, command, threads):
    argv = [command, src] + ([tmp_path / "out.pt", "--to", "full"] if command == "convert" else [])
    code, _, err = cli(capsys, *argv, f"--threads={threads}")
    assert code == 2
    assert err == [
        f"shardckpt: error: --threads must be at least 1, not {threads}: leave it out to use "
        "every core the process may run on"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("cores", "local", "want"),
    [(16, None, 16), (16, "4", 4), (16, "8", 2), (2, "8", 1), (16, "x", 16), (3, "2", 1)],
)
def test_the_default_is_the_cores_the_process_may_use_shared_by_its_nodes_ranks(
    monkeypatch, cores, local, want
):
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: set(range(cores)))
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert workers.default_threads() == want


def _cut_at_first_copy(target: str, size: int) -> None:
    """In the warm child: cut ``target`` to ``size`` bytes when a worker first writes a slice it read."""
    stored_copy.PIECE = PIECES
    write_slice = stored_copy._write_slice
    lock = threading.Lock()

    def write_after_cut(*args):
        with lock:
            if os.path.getsize(target) > size:
                os.truncate(target, size)
        return write_slice(*args)

    stored_copy._write_slice = write_after_cut


@pytest.mark.launches
@pytest.mark.parametrize("size", [100, 6_000_000])
@pytest.mark.parametrize(
    "layout",
    [("out.safetensors", "--to", "full"), ("out-dcp", "--to", "sharded", "--world-size", "3")],
    ids=["full", "dcp-at-3"],
)
def test_a_source_cut_short_while_workers_copy_it_is_exit_3_naming_it(
    copied, tmp_path, size, layout
):
    cut = tmp_path / "dcp"
    copy(copied, cut)
    data = cut / "__0_0.distcp"
    name, *flags = layout
    dst = tmp_path / name
    argv = ["convert", cut, dst, *flags, "--threads", "4"]
    done = warm_cli.run(argv, setup=(_cut_at_first_copy, str(data), size))
    assert done.returncode == 3, done.stderr
    assert re.fullmatch(
        rf"shardckpt: error: '{re.escape(str(data))}': truncated while it was read: it now ends "
        rf"at byte \d+, inside the data of 'model\.(big|wide)': {re.escape(SRC_CHANGED)}\n",
        done.stderr,
    ), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


def _slow_copies(delay: float) -> None:
    """In the warm child: each piece a worker copies takes ``delay`` seconds more."""
    stored_copy.PIECE = PIECES
    original = stored_copy.copy_runs

    def slow(*args):
        time.sleep(delay)
        return original(*args)

    fill.copy_runs = slow


@pytest.mark.launches
@pytest.mark.timeout(120)
def test_sigterm_while_workers_copy_exits_143_and_leaves_nothing(src, tmp_path):
    dst = tmp_path / "out.safetensors"
    argv = ["convert", src, dst, "--to", "full", "--threads", "4"]
    proc = warm_cli.start(argv, setup=(_slow_copies, 0.2))
    partial = tmp_path / ".out.safetensors.shardckpt-partial"
    deadline = time.monotonic() + 60
    while not partial.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)  # the workers are copying (twelve pieces of 0.2 s and more, four at a time)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines() == [f"shardckpt: interrupted by SIGTERM: '{dst}' was not written"]
    assert list(tmp_path.iterdir()) == []


def test_one_thread_at_a_time_writes_into_one_file(copied, tmp_path, capsys, pieces, monkeypatch):
    # The kernel lets one writer into a file at a time; threads that waited for it there
    # spun on the CPU (a fifth of a full export's CPU time at two threads).
    inside: dict[int, int] = {}
    most = [0]
    lock = threading.Lock()
    write_slice = stored_copy._write_slice

    def counted(src_fd, part, src_offset, fd, offset, by_kernel):
        ino = os.fstat(fd).st_ino
        with lock:
            inside[ino] = inside.get(ino, 0) + 1
            most[0] = max(most[0], inside[ino])
        try:
            time.sleep(0.002)  # long enough for another worker to arrive meanwhile
            return write_slice(src_fd, part, src_offset, fd, offset, by_kernel)
        finally:
            with lock:
                inside[ino] -= 1

    monkeypatch.setattr(stored_copy, "_write_slice", counted)
    out = tmp_path / "out.safetensors"
    code, _, err = cli(capsys, "convert", copied, out, "--to", "full", "--threads", "4")
    assert code == 0, err
    assert len(set(pieces)) > 1  # several workers copied into the one file
    assert most[0] == 1
    ref = tmp_path / "ref.safetensors"
    assert cli(capsys, "convert", copied, ref, "--to", "full", "--threads", "1", "-q")[0] == 0
    assert out.read_bytes() == ref.read_bytes()
