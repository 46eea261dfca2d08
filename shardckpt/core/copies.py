"""Files of a source copied into DST unread: through the source-file gate, keeping their modes.

A trainer's directory carries files shardckpt does not read (RNG states, a sampler, a
user's logs); ``--hf-config`` copies a model's tokenizer and config files. Each is
copied only when it passes the gate of ``files.py`` (a regular file inside its
directory once symlinks are resolved), and a directory only when nothing under it fails
it: the whole tree is walked before its first byte is copied.

A copy keeps its source's permission bits (narrowed by the umask, never widened): a
0600 file stays private in DST. A directory also gets its owner's ``rwx``, so that the
run can fill it and a failed run can remove it.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardckpt.core.files import (
    os_error,
    source_entry,
    source_file,
    source_stream,
    source_tree,
    will_read,
    writing,
)

_CHUNK = 1 << 20


def copy_file(src: Path, dst: Path, within: Path) -> None:
    """Copy the regular file ``src`` of ``within`` to the new file ``dst``, flushed to disk.

    A failed read names ``src``; a failed write (a full disk) names ``dst``. Read through
    ``core.files`` (``source_stream``): the stand-in of a URL SRC's object copies the
    store's bytes, asked for ahead in large ranged requests, never the stand-in's zeros.
    """
    source_file(src, within)
    with source_stream(src) as fin, writing(dst):
        st = os.fstat(fin.fileno())
        will_read(src, [(0, st.st_size)] if st.st_size else [])
        mode = st.st_mode & 0o777
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as fout:
            while chunk := _read(fin, src):
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())


def copy_entry(src: Path, dst: Path, within: Path) -> None:
    """Copy ``src``, a regular file or a directory of ``within``, to ``dst`` (nothing is there yet)."""
    if not source_entry(src, within):
        copy_file(src, dst, within)
        return
    entries = source_tree(src, within)  # all of it checked before the first copy
    _make_dir(src, dst)
    for name, is_dir in entries:
        if is_dir:
            _make_dir(src / name, dst / name)
        else:
            copy_file(src / name, dst / name, within)


def _make_dir(src: Path, dst: Path) -> None:
    """Create ``dst`` with the permission bits of the directory ``src``, plus its owner's."""
    try:
        mode = os.stat(src).st_mode & 0o777
    except OSError as exc:
        raise os_error(exc, src) from None
    with writing(dst):
        os.mkdir(dst, mode | 0o700)


def _read(f, src: Path) -> bytes:
    """Return the next chunk of ``f`` (``b""`` at its end); a failed read names ``src``."""
    try:
        return f.read(_CHUNK)
    except OSError as exc:
        raise os_error(exc, src) from None
