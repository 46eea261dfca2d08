"""DST files: what a step wrote is handed to the disk at once, and flushed at the end."""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import pytest

from shardckpt.engine import dst_files
from shardckpt.engine.dst_files import DstFiles


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_writeback_is_started_through_libcs_sync_file_range_with_its_real_signature(tmp_path):
    start = dst_files._START_WRITEBACK
    assert start is not None
    path = tmp_path / "f"
    path.write_bytes(b"x" * 3 * 4096)
    fd = os.open(path, os.O_RDWR)
    try:
        # 64-bit offsets and lengths: a range past 2 GiB is taken as it is, not truncated.
        assert start(fd, 4096, 2**33, dst_files._SYNC_FILE_RANGE_WRITE) == 0
    finally:
        os.close(fd)
    assert start(fd, 0, 4096, dst_files._SYNC_FILE_RANGE_WRITE) == -1
    assert ctypes.get_errno() == errno.EBADF


def test_bytes_handed_to_the_disk_early_are_in_the_file_after_sync(tmp_path):
    (tmp_path / "out").write_bytes(b"\0" * 8192)
    files = DstFiles(tmp_path)
    try:
        fd = files.fd("out")
        os.pwrite(fd, b"abc", 5000)
        files.written("out", 5000, 3)
        files.sync()
    finally:
        files.close()
    assert (tmp_path / "out").read_bytes()[4999:5004] == b"\0abc\0"


class _Interrupted(Exception):
    """What the signal handler raises (``core.signals.Interrupted`` in a run)."""


def test_a_signal_while_the_writeback_thread_starts_leaves_close_nothing_to_join(
    tmp_path, monkeypatch
):
    # Seen under load: SIGTERM arrived while Thread.start() waited for the thread to run,
    # and close() then joined a thread that never started: exit 4 instead of 143.
    def interrupted_start(self):
        raise _Interrupted

    monkeypatch.setattr(dst_files.threading.Thread, "start", interrupted_start)
    if dst_files._START_WRITEBACK is None:
        pytest.skip("no sync_file_range here: no writeback thread is started")
    (tmp_path / "out").write_bytes(b"\0" * 16)
    files = DstFiles(tmp_path)
    files.fd("out")
    with pytest.raises(_Interrupted):
        files.written("out", 0, 16)
    files.close()  # raised RuntimeError: cannot join thread before it is started
    monkeypatch.undo()
    files = DstFiles(tmp_path)
    files.fd("out")
    files.written("out", 0, 16)  # a later run starts its thread as usual
    files.sync()
    files.close()
