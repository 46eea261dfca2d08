"""Outputs that appear only when complete: written beside DST, renamed into place.

Protocol (in this order):
  1) (every rank) ``check()`` before any collective, looking only: refuse a DST that is
     SRC, inside SRC or around it, the current directory or one around it, an existing
     DST without --overwrite, and with --overwrite a directory that holds no checkpoint.
  2) (coordinator; with DST on the nodes' own disks, the lowest rank of each node:
     ``placement.py``) ``open()`` takes the exclusive lock on DST for the whole run
     (``shardckpt.core.lock``), repairs what a killed run left in DST's directory, checks
     DST again under the lock and makes the staging path ``tmp``.
  3) (every rank) writers write under ``tmp``; ``--verify`` reads it back there.
  4) (the ranks that opened) ``commit()`` renames ``tmp`` onto DST (an old DST, with --overwrite,
     is moved aside first and removed after); then ``close()`` removes ``tmp`` if it is
     still there and gives the lock back. ``close()`` runs on every exit path.

A run killed at any point leaves DST as it was or complete: ``.NAME.shardckpt-partial``
is only ever a partial output, and ``.NAME.shardckpt-old`` is the previous DST, put back
by the next run when the kill fell between the two renames of ``commit()``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from shardckpt.core.errors import (
    DestinationExistsError,
    IOFailure,
    ShardckptError,
    UsageError,
    notice,
)
from shardckpt.core.lock import FileLock, LockBusy, read_owner

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.shardckpt-(?P<kind>partial|old)$")


def _real(path: str | os.PathLike) -> Path:
    """Return ``path`` with symlinks resolved; a symlink loop stays as it is instead of raising."""
    return Path(os.path.realpath(path))


def _lexists(path: Path) -> bool:
    """Return whether ``path`` is there, a dangling symlink included."""
    return os.path.lexists(path)


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _source_paths(src: Path) -> list[Path]:
    """Return SRC and, for a directory, every entry in it, each with symlinks resolved."""
    paths = [_real(src)]
    with contextlib.suppress(OSError):
        if src.is_dir():
            paths += [_real(entry) for entry in src.iterdir()]
    return paths


class Destination:
    """A DST path, the partial path beside it that becomes DST on commit, and the lock on both."""

    def __init__(
        self,
        dst: str | os.PathLike,
        *,
        overwrite: bool,
        is_dir: bool,
        srcs: tuple[Path, ...] = (),
        holds_checkpoint: Callable[[Path], bool] = lambda _directory: False,
    ):
        self.dst = Path(dst)
        self.overwrite = overwrite
        self.is_dir = is_dir
        self.srcs = srcs
        # Asked of an existing directory DST before --overwrite replaces it; the formats
        # know what a checkpoint is, so the caller supplies it (refuse, when it does not).
        self._holds_checkpoint = holds_checkpoint
        name = self.dst.name
        self.tmp = self.dst.with_name(f".{name}.shardckpt-partial") if name else self.dst
        self._old = self.dst.with_name(f".{name}.shardckpt-old") if name else self.dst
        # The run's token in the lock file tells which ranks see this DST (``placement.py``).
        self.run = uuid.uuid4().hex
        self._lock = (
            FileLock(self.dst.with_name(f".{name}.shardckpt-lock"), self.run) if name else None
        )
        self._committed = False

    # ------------------------------------------------------------ 1) every rank

    def check(self) -> None:
        """Raise when DST may not be written; does no I/O beyond looking."""
        dst = _real(self.dst)
        cwd = _real(os.getcwd())
        if self.dst.name in ("", ".", "..") or _within(cwd, dst):
            raise UsageError(
                "DST is the current directory or a directory around it",
                path=self.dst,
                hint="name a new file or directory for the output",
            )
        for src in self.srcs:
            if _within(dst, _real(src)):
                raise UsageError(
                    "DST is SRC or inside it",
                    path=self.dst,
                    hint="write the conversion somewhere else; SRC is never modified",
                )
            # SRC's entries too: replacing DST must not delete a file SRC links to.
            if any(_within(path, dst) for path in _source_paths(src)):
                raise UsageError(
                    f"DST holds SRC ('{src}')",
                    path=self.dst,
                    hint="write the conversion somewhere else; SRC is never modified",
                )
        self._check_existing()

    def _check_existing(self) -> None:
        if not _lexists(self.dst):
            return
        if not self.overwrite:
            raise DestinationExistsError(
                "already exists", path=self.dst, hint="pass --overwrite to replace it"
            )
        if self.dst.is_dir() and not self.dst.is_symlink() and not self._holds_checkpoint(self.dst):
            raise UsageError(
                "is a directory that holds no checkpoint, so --overwrite will not replace it",
                path=self.dst,
                hint="remove it yourself if you mean it, or choose another DST",
            )

    # ------------------------------------------------------------ 2)-4) coordinator

    def _make_parent(self) -> None:
        """Create DST's missing parent directories, and say so: a mistyped path shows at once."""
        parent = self.dst.parent
        if parent.is_dir():
            return
        parent.mkdir(parents=True, exist_ok=True)
        notice(f"created '{parent}', the missing parent directory of DST")

    def open(self) -> None:
        """Lock DST, repair what killed runs left beside it, and make the staging path."""
        assert self._lock is not None  # check() refused a DST without a name
        try:
            self._make_parent()
            self._lock.acquire(wait_s=1.0)
        except LockBusy as busy:
            raise IOFailure(
                f"is being written by another shardckpt run ({busy.owner or 'owner unknown'})",
                path=self.dst,
                hint="wait for that run to finish, or write to another DST",
            ) from None
        except OSError as exc:
            raise _cannot_prepare(exc, self.dst) from None
        try:
            self._repair_leftovers()
            self._check_existing()
            _remove(self.tmp)
            if self.is_dir:
                self.tmp.mkdir()
        except ShardckptError:
            raise
        except OSError as exc:
            raise _cannot_prepare(exc, self.dst) from None

    def commit(self) -> None:
        """Move the complete output onto DST."""
        try:
            if _lexists(self.dst):
                _remove(self._old)
                os.replace(self.dst, self._old)
            os.replace(self.tmp, self.dst)
            self._committed = True
            _remove(self._old)
            _sync_directory(self.dst.parent)
        except OSError as exc:
            raise IOFailure(
                f"cannot move the finished output into place ({exc.strerror or exc})",
                path=self.dst,
                hint="check permissions of its directory",
            ) from None

    def sees(self, run: str) -> bool:
        """Return whether the lock file here was written by the run whose token is ``run``."""
        if self._lock is None:
            return False
        return read_owner(self._lock.path).endswith(f", run {run}")

    @property
    def committed(self) -> bool:
        """Return whether the output is in place at DST."""
        return self._committed

    def close(self) -> None:
        """Remove an uncommitted partial output and give the lock back; never raises."""
        if self._lock is None or not self._lock.held:
            return
        if not self._committed:
            with contextlib.suppress(OSError):
                _remove(self.tmp)
        self._lock.release()

    def _repair_leftovers(self) -> None:
        """Remove partial outputs of dead runs in DST's directory; put back a DST a dead run moved aside."""
        protected = [p for src in self.srcs for p in _source_paths(src)]
        for entry in sorted(self.dst.parent.iterdir()):
            found = _LEFTOVER.match(entry.name)
            if found is None or found.group("name") in (".", ".."):
                continue
            if any(_within(p, _real(entry)) for p in protected):
                continue
            name, kind = found.group("name"), found.group("kind")
            owner = (
                None
                if name == self.dst.name
                else FileLock(entry.with_name(f".{name}.shardckpt-lock"))
            )
            try:
                if owner is not None:
                    owner.acquire()  # we hold our own DST's lock already
                _repair(entry, entry.with_name(name), kind)
            except (LockBusy, OSError):
                # A live run owns it, or it is not ours to touch: not this run's concern.
                continue
            finally:
                if owner is not None:
                    owner.release()


def _repair(leftover: Path, dst: Path, kind: str) -> None:
    """Remove ``leftover`` of a dead run, or put it back at ``dst`` when it is DST moved aside."""
    if kind == "old" and not _lexists(dst):
        os.replace(leftover, dst)
        notice(
            f"put back '{dst}' from '{leftover.name}': a run with --overwrite was killed "
            "while replacing it"
        )
        return
    _remove(leftover)
    what = "partial output" if kind == "partial" else "replaced output"
    notice(f"removed '{leftover}', the {what} of a shardckpt run that was killed")


def _cannot_prepare(exc: OSError, dst: Path) -> ShardckptError:
    return IOFailure(
        f"cannot prepare the output ({exc.strerror or exc})",
        path=dst,
        hint="check that the directory is writable and has free space",
    )


def _sync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable: a rename lives in the directory, not the file."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif _lexists(path):
        path.unlink()
