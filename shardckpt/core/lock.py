"""An exclusive lock on a DST for a whole run, held with ``flock`` on ``.NAME.shardckpt-lock``.

``flock`` locks belong to the open file, so the kernel drops them when their process
dies, however it dies (``kill -9`` included): a lock file nobody holds locked is the
sign of a dead run, and whatever that run left beside DST is safe to clean up.

The holder unlinks the lock file before closing it. A process that opened the file
just before the unlink then holds a lock on a file that is gone, so ``acquire`` checks
after locking that the path still names the file it locked, and starts again if not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path


class LockBusy(Exception):
    """Another live process holds the lock; ``owner`` says who, when it wrote it down."""

    def __init__(self, path: Path, owner: str):
        self.path = path
        self.owner = owner
        super().__init__(f"{path} is locked by {owner or 'another process'}")


class FileLock:
    """An exclusive ``flock`` on ``path``, taken by ``acquire`` and given back by ``release``."""

    def __init__(self, path: Path, run: str = ""):
        self.path = path
        # Written into the lock file: ranks that read it back share this filesystem.
        self.run = run
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Return whether this process holds the lock."""
        return self._fd is not None

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock, waiting up to ``wait_s`` seconds; raise ``LockBusy`` if another holds it."""
        deadline = time.monotonic() + wait_s
        while True:
            # O_NOFOLLOW: a symlink planted at the lock's name must not get its target truncated.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise LockBusy(self.path, read_owner(self.path)) from None
                time.sleep(0.05)
                continue
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the previous holder unlinked it after we opened it: try again
        os.ftruncate(fd, 0)
        run = f", run {self.run}" if self.run else ""
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}{run}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock; never raises."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if _same_file(self._fd, self.path):
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def read_owner(path: Path) -> str:
    """Return what the holder of the lock at ``path`` wrote about itself, or "" if it cannot be read."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return path.read_text().strip()
    return ""
