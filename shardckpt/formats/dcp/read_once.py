"""Each DCP ``.metadata`` read once while a reader is opened, whoever asks for it.

Telling a DCP source's format looks at its ``.metadata`` (is it safetensors-serialized?
torchtitan's?), and the reader then reads it: three reads of one file. A 1,024-rank
save's ``.metadata`` (145 MB) takes about a minute to check and unpickle on 2 cores.
Inside ``metadata_read_once`` (``formats.open_reader``), ``reader.read_metadata``
remembers what it read by the file's identity; leaving drops it (the reader keeps its
own). No torch here: the registry enters it before any format is imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_MEMO: ContextVar[dict | None] = ContextVar("shardckpt_dcp_metadata", default=None)


def memo() -> dict | None:
    """Return what was read inside the current ``metadata_read_once``, None outside one."""
    return _MEMO.get()


@contextmanager
def metadata_read_once() -> Iterator[None]:
    """Inside, each ``.metadata`` is read, checked and unpickled once (see the module)."""
    token = _MEMO.set({}) if _MEMO.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _MEMO.reset(token)
