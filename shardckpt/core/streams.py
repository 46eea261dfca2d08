"""The standard streams: stdout carries the output a command owes, stderr only courtesies.

A stream that is missing or failing never changes what a run does to DST, nor the exit
code of its outcome, except stdout when a command has output to give there:

- stderr closed (``2>&-``) or failing (``2>/dev/full``): lines for it are lost, nothing
  else changes (a conversion still exits 0, a bad input still 3).
- stdout closed (``>&-``) while a command has output to print: exit 4 before it starts
  (``stdout_closed``), so a ``convert --json`` writes no DST it could not report.
- stdout failing as the output is printed (``>/dev/full``, an I/O error): exit 4, the
  line saying the output was lost (``out`` raises; ``cli/options.emit`` says it). A reader gone from a pipe (``| head``) has
  what it asked for: that is no error.

``plug`` puts ``/dev/null`` on a standard descriptor the process started without, so the
first file it opens (DST's) cannot become descriptor 1 or 2 and take what C code
(torch's warnings, a library's prints) writes there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

_CLOSED: set[int] = set()
"""The standard descriptors the process started without (``plug``)."""


def plug() -> None:
    """Put ``/dev/null`` on each of descriptors 0, 1 and 2 that is closed; give Python a stderr to write to."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            _CLOSED.add(fd)
    if sys.stderr is None:
        sys.stderr = _null_text()


def say(line: str) -> None:
    """Print ``line`` on stderr; where stderr is closed or fails, the line is lost and nothing else changes."""
    if sys.stderr is None:
        return  # print(file=None) would print on stdout
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        # Whatever else was buffered is lost with it: a later flush (at exit) must not
        # fail again and turn the run's exit code into Python's 120.
        sys.stderr = _null_text()


def stdout_closed() -> bool:
    """Return whether the process started without stdout (``>&-``)."""
    return sys.stdout is None or 1 in _CLOSED


def out(text: str) -> None:
    """Print ``text`` on stdout, flushed; raise the ``OSError`` that kept it from being written.

    A reader gone from a pipe (EPIPE) took what it wanted: that is no error.
    """
    if sys.stdout is None:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError as exc:
        sys.stdout = _null_text()  # what is still buffered would fail again at exit
        if exc.errno != errno.EPIPE:
            raise


def _null_text():
    """Return a text stream that takes everything and keeps nothing."""
    with contextlib.suppress(OSError):
        return open(os.devnull, "w")
    return None
