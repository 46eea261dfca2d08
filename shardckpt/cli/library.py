"""The library (torch with it), imported once a command runs, with signals held meanwhile.

The app imports no torch, so ``--help`` and ``--version`` answer at once. A command's
first act is ``load()``: torch's import takes seconds, and an exception raised inside
it (a Ctrl-C turned into one, in a callback from torch's C++ side) aborts the process
instead of unwinding it, so a signal then is recorded and acted on after the import.
"""

from __future__ import annotations

from shardckpt.core.signals import deferred


def load() -> None:
    """Import the modules the commands call; a SIGINT, SIGTERM or SIGHUP meanwhile is raised after."""
    with deferred():
        import shardckpt.api
        import shardckpt.cli.render
        import shardckpt.core.dist
        import shardckpt.core.progress  # noqa: F401
