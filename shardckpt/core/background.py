"""Work done beside the conversion in a forked child process: a file that needs no source byte.

Python runs one thread at a time, so a thread that pickles while the engine writes
gets no second core; a forked child does. The child sees the parent's memory as it
was at the fork (copy on write), runs one function, and reports how it ended through
a pipe: nothing (it succeeded) or the pickled exception it raised, which ``wait``
raises again in the parent. The child never returns into the parent's code: it leaves
with ``os._exit``, running no ``atexit`` handler and flushing no inherited buffer.
"""

from __future__ import annotations

import os
import pickle
import signal
import weakref
from collections.abc import Callable


class Background:
    """A function running in a forked child; ``wait`` returns once it ended, raising what it raised."""

    def __init__(self, fn: Callable[[], None]):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; its outcome is checked through the parent
            os.close(read)
            _run_child(fn, write)
        os.close(write)
        self._pid: int | None = pid
        self._read = read
        self.peak_rss_bytes = 0
        # A parent that fails before ``wait`` (another rank's error, Ctrl-C) takes its child down.
        self._reaper = weakref.finalize(self, _reap, pid, read)

    def wait(self) -> None:
        """Return once the child ended; raise the child's exception where it raised one."""
        if self._pid is None:
            return
        chunks = []
        while chunk := os.read(self._read, 1 << 16):
            chunks.append(chunk)
        _, status, usage = os.wait4(self._pid, 0)
        self._pid = None
        self._reaper.detach()
        os.close(self._read)
        self.peak_rss_bytes = usage.ru_maxrss * 1024
        if chunks:
            raise pickle.loads(b"".join(chunks))  # our own child's, never a file's
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise RuntimeError(f"internal: the background process ended with status {code}")


def _run_child(fn: Callable[[], None], write: int) -> None:
    # The parent's handlers (Ctrl-C: remove DST's staging) are the parent's to run.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 0
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - every ending goes back to the parent
        code = 1
        try:
            data = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its line
            data = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(write, view) :]
        except OSError:
            pass
    os._exit(code)


def _reap(pid: int, read: int) -> None:
    """Stop and collect a child whose parent did not wait for it."""
    try:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    os.close(read)
