"""The library (torch with it), imported once a command runs, with signals held meanwhile.

The app imports no torch, so ``--help`` and ``--version`` answer at once, nor do
``inspect``, ``verify``, ``diff`` and a plain export of most sources. A command's first
act is ``load()``: torch's import takes seconds, and an exception raised inside it (a Ctrl-C turned into one, in a
callback from torch's C++ side) aborts the process instead of unwinding it, so a signal
then is recorded and acted on after the import.
"""

from __future__ import annotations

from shardckpt.core.signals import deferred


def load(tensors: bool = True) -> None:
    """Import the modules the commands call; a SIGINT, SIGTERM or SIGHUP meanwhile is raised after.

    ``tensors=False``: a command that reads metadata and bytes only (``inspect``,
    ``verify``, ``diff`` until two tensors' bytes differ, ``convert`` unless
    ``api.conversion.needs_torch``) imports its modules as it uses them, and torch only
    where a source or the conversion needs it (``core/lazy_torch.py``, whose import holds
    signals the same way).
    """
    if not tensors:
        return
    with deferred():
        import torch  # noqa: F401

        import shardckpt.api.comparison
        import shardckpt.api.conversion
        import shardckpt.api.inspection
        import shardckpt.api.integrity
        import shardckpt.cli.render
        import shardckpt.core.dist
        import shardckpt.core.progress  # noqa: F401
