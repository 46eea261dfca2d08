"""SIGTERM while a large, legitimate pickle is read: the run ends in seconds, whatever reads it.

The pickle check that runs before every load (``formats/pickle_bounds.py``) is Python and
acts on a signal between opcodes; the loads it lets through are bounded. Torch's
weights-only loader is Python too; DCP's metadata unpickler is C, but each storage entry
calls Python (``MetadataIndex.__hash__``, ``TensorStorageMetadata.__setstate__``), where
the signal is acted on. Each test sends SIGTERM to a real process at the moment it has
read the file (inotify tells), and times how long the process takes to end.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import warm_cli
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shardckpt.formats.dcp.reader import _MetadataUnpickler

_IN_CLOSE_NOWRITE = 0x10


def _dcp_metadata(tensors: int, chunks: int) -> Metadata:
    """Return DCP metadata of ``tensors`` tensors of ``chunks`` row chunks each, as FSDP2 saves."""
    state, storage = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t // 8}.mlp.w{t % 8}"
        pieces = [
            ChunkStorageMetadata(torch.Size([64 * c, 0]), torch.Size([64, 256]))
            for c in range(chunks)
        ]
        state[fqn] = TensorStorageMetadata(
            TensorProperties(), torch.Size([64 * chunks, 256]), pieces
        )
        for c, piece in enumerate(pieces):
            storage[MetadataIndex(fqn, piece.offsets)] = _StorageInfo(
                f"__{c}_0.distcp", t * 65536, 65536
            )
    return Metadata(state, planner_data={k: ("model", k) for k in state}, storage_data=storage)  # fmt: skip


@pytest.fixture(scope="module")
def large_dcp(tmp_path_factory) -> Path:
    """Return a DCP directory whose ``.metadata`` describes 4000 tensors of 8 chunks (5 MB)."""
    src = tmp_path_factory.mktemp("large") / "ckpt"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(_dcp_metadata(4000, 8)))
    return src


@pytest.fixture(scope="module")
def large_torch(tmp_path_factory) -> Path:
    """Return a ``torch.save`` file of 40000 small tensors: seconds of weights-only unpickling."""
    path = tmp_path_factory.mktemp("large") / "many.pt"
    torch.save({f"layers.{i}.w": torch.zeros(2) for i in range(40_000)}, path)
    return path


def _closed_after_reading(path: Path):
    """Return a watch that tells when some process closes ``path`` after reading it."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(path), _IN_CLOSE_NOWRITE) >= 0

    def wait(proc: subprocess.Popen, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not select.select([fd], [], [], 0.05)[0]:
            assert proc.poll() is None, f"ended before reading {path}: {proc.communicate()}"
            assert time.monotonic() < deadline, f"{path} was never read"
        os.close(fd)

    return wait


def _start(*argv) -> warm_cli.WarmProcess:
    """Start ``python -m shardckpt ARGV`` in its own process, forked warm (``warm_cli``)."""
    return warm_cli.start(argv, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _seconds_to_end(proc: subprocess.Popen) -> tuple[float, int, str]:
    """Send SIGTERM; return how long ``proc`` took to end, its exit code and stderr."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return time.monotonic() - sent, proc.returncode, err


@pytest.mark.timeout(180)
@pytest.mark.parametrize("source", ["large_dcp", "large_torch"])
def test_sigterm_while_a_large_pickle_is_read_ends_the_run_in_seconds(request, tmp_path, source):
    src = request.getfixturevalue(source)
    read = src / ".metadata" if source == "large_dcp" else src
    dst = tmp_path / "out.pt"
    # large_dcp has no data files: a run not signalled in time ends with exit 3 on its
    # own. On a loaded machine this process can be scheduled too late to send SIGTERM
    # while the other still unpickles; such a try shows nothing and is made again.
    for _ in range(3):
        watch = _closed_after_reading(read)
        proc = _start("convert", src, dst, "--to", "full")
        watch(proc)
        seconds, code, err = _seconds_to_end(proc)
        if not (code == 3 and "missing data file" in err):
            break
    assert (code, err.splitlines()) == (143, ["shardckpt: interrupted by SIGTERM"])
    assert seconds < 5
    assert list(tmp_path.iterdir()) == []


class _Signalled(Exception):
    pass


def _raise(signum, frame):
    raise _Signalled


@pytest.mark.timeout(180)
def test_dcp_metadata_unpickling_in_c_acts_on_a_signal_in_the_middle(large_dcp):
    # The load alone, without the check before it: C, where a signal waits for Python code.
    raw = (large_dcp / ".metadata").read_bytes()
    start = time.monotonic()
    _MetadataUnpickler(io.BytesIO(raw)).load()
    whole = time.monotonic() - start
    stream = io.BytesIO(raw)
    previous = signal.signal(signal.SIGUSR1, _raise)
    try:
        threading.Timer(whole / 10, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(_Signalled):
            _MetadataUnpickler(stream).load()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    # Where the load stopped, not how long it took: a loaded machine delays the timer's
    # thread, but a signal acted on only at the end would find every byte read.
    assert stream.tell() < len(raw), (stream.tell(), len(raw))
