"""The DST files one process writes into, each opened once, flushed to disk at the end."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from shardckpt.core.files import writing

Progress = Callable[[int], None]


class DstFiles:
    """The DST files this process writes into under ``root`` (``""`` is ``root`` itself, a one-file DST).

    A file framing created stays open until ``sync``; one written whole (a file job) is
    closed when done and only named for ``sync``, so a process writing a thousand target
    ranks' files never holds a thousand descriptors.
    """

    def __init__(self, root: Path):
        self.root = root
        self._fds: dict[str, int] = {}
        self._done: list[str] = []

    def path(self, file: str) -> Path:
        """Return the path of ``file``."""
        return self.root / file if file else self.root

    def fd(self, file: str) -> int:
        """Return a descriptor of ``file`` for reading and writing (it exists: framing made it)."""
        if file not in self._fds:
            with writing(self.path(file)):
                self._fds[file] = os.open(self.path(file), os.O_RDWR)
        return self._fds[file]

    def create(self, file: str) -> int:
        """Return a descriptor of ``file``, created empty (or emptied) for a file job."""
        with writing(self.path(file)):
            self._fds[file] = os.open(
                self.path(file), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644
            )
        return self._fds[file]

    def done(self, file: str) -> None:
        """Close ``file``, written whole; ``sync`` flushes it later."""
        fd = self._fds.pop(file, None)
        if fd is not None:
            os.close(fd)
        self._done.append(file)

    @property
    def count(self) -> int:
        """Return how many files this process has written into."""
        return len(self._fds) + len(self._done)

    def sync(self, progress: Progress = lambda n: None) -> None:
        """Flush every file written to disk (on a shared filesystem, each rank its own writes)."""
        for file, fd in self._fds.items():
            with writing(self.path(file)):
                os.fsync(fd)
            progress(1)
        for file in self._done:
            with writing(self.path(file)):
                fd = os.open(self.path(file), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            progress(1)

    def close(self) -> None:
        """Close every file still open."""
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
