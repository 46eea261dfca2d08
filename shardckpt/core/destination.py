"""Outputs that appear only when complete: written beside DST, renamed into place.

Protocol (in this order):
  1) (every rank) ``check()`` before any collective, looking and reading metadata only:
     refuse a DST that is SRC, inside SRC or around it, the current directory or one
     around it, an existing DST without --overwrite, and with --overwrite one that does
     not read as a checkpoint or holds anything besides its files.
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
import stat
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from shardckpt.core.errors import (
    DestinationExistsError,
    IOFailure,
    ShardckptError,
    UsageError,
    notice,
)
from shardckpt.core.lock import FileLock, LockBusy, read_owner
from shardckpt.core.signals import committing, sheltered

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.shardckpt-(?P<kind>partial|old)$")
_OURS = re.compile(r"^\..+\.shardckpt-(?:partial|old|lock)$")
"""What shardckpt leaves beside an output it writes: staging, moved-aside old output, lock."""

CheckpointFiles = Callable[[Path], "tuple[str, frozenset[str]] | None"]
"""How ``--overwrite`` asks what a path holds (``formats.checkpoint_files``): the title of
the checkpoint it reads as and the files it is made of, None when it names no format;
raises when a format it names does not read."""


def _no_checkpoints(_path: Path) -> tuple[str, frozenset[str]] | None:
    return None


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


def written_by_another(owner: str, dst: str | os.PathLike) -> IOFailure:
    """Return the one-line error for a DST whose lock another live run holds (``owner``: who, "" unknown)."""
    return IOFailure(
        f"is being written by another shardckpt run ({owner or 'owner unknown'})",
        path=dst,
        hint="wait for that run to finish, or write to another DST",
    )


class Destination:
    """A DST path, the partial path beside it that becomes DST on commit, and the lock on both."""

    def __init__(
        self,
        dst: str | os.PathLike,
        *,
        overwrite: bool,
        is_dir: bool,
        srcs: tuple[Path, ...] = (),
        checkpoint_files: CheckpointFiles = _no_checkpoints,
    ):
        self.dst = Path(dst)
        self.overwrite = overwrite
        self.is_dir = is_dir
        self.srcs = srcs
        self.checkpoint_files = checkpoint_files
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
        """Raise when DST may not be written; writes nothing (with --overwrite, reads DST's metadata)."""
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
        self._check_existing(locked=False)

    def _check_existing(self, *, locked: bool) -> None:
        if not _lexists(self.dst):
            return
        if not self.overwrite:
            raise DestinationExistsError(
                "already exists", path=self.dst, hint="pass --overwrite to replace it"
            )
        if self.dst.is_symlink():
            return  # replaced, never followed: removing the link loses nothing
        before = _identity(self.dst)
        why = self._not_replaceable()
        # Unlocked, another run may be renaming its output onto DST while it is read:
        # a DST that changed under the reading is judged again under the lock, in open().
        if why is not None and (locked or _identity(self.dst) == before):
            raise UsageError(
                f"{why}, so --overwrite will not replace it",
                path=self.dst,
                hint="remove it yourself if you mean it, or choose another DST",
            )

    def _not_replaceable(self) -> str | None:
        """Return what DST holds that is no checkpoint's file, or None when it may be replaced.

        Replaced is an empty file or directory, and what reads as a checkpoint (metadata
        only) and, for a directory, holds nothing else: every entry, down the tree and
        links not followed, is a file of that checkpoint or shardckpt's own leftover.
        """
        try:
            st = self.dst.lstat()
            is_dir = stat.S_ISDIR(st.st_mode)
            if (st.st_size == 0 and stat.S_ISREG(st.st_mode)) or (
                is_dir and not any(self.dst.iterdir())
            ):
                return None
            found = self.checkpoint_files(self.dst)
            if found is None:
                return f"is a {'directory' if is_dir else 'file'} that holds no checkpoint"
            title, members = found
            stranger = _stranger(self.dst, members) if is_dir else None
        except Exception as exc:  # noqa: BLE001 - whatever stops the reading, DST is not known safe
            return f"does not read as the checkpoint it looks like ({self._reason(exc)})"
        if stranger is not None:
            return f"holds '{stranger}', which is no part of the {title} checkpoint in it"
        return None

    def _reason(self, exc: Exception) -> str:
        """Return why reading DST failed, naming the file inside DST it concerns."""
        if isinstance(exc, OSError):
            path, what = exc.filename, exc.strerror or type(exc).__name__
        elif isinstance(exc, ShardckptError):
            path, what = exc.path, exc.message
        else:
            first = (str(exc).strip().splitlines() or [""])[0]
            path, what = None, f"{type(exc).__name__}: {first}".rstrip(": ")
        if path is None or Path(path) == self.dst:
            return what
        return f"'{os.path.relpath(path, self.dst)}': {what}"

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
            # A signal between creating the lock file and holding it would leave the file.
            with sheltered():
                self._lock.acquire(wait_s=1.0)
        except LockBusy as busy:
            raise written_by_another(busy.owner, self.dst) from None
        except OSError as exc:
            raise _cannot_prepare(exc, self.dst) from None
        try:
            self._repair_leftovers()
            self._check_existing(locked=True)
            _remove(self.tmp)
            if self.is_dir:
                self.tmp.mkdir()
        except ShardckptError:
            raise
        except OSError as exc:
            raise _cannot_prepare(exc, self.dst) from None

    def commit(self) -> None:
        """Move the complete output onto DST (signals wait meanwhile; after it, they fail nothing)."""
        with committing(f"'{self.dst}'"):
            self._commit()

    def _commit(self) -> None:
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
        """Remove an uncommitted partial output and give the lock back; never raises.

        A signal meanwhile waits until both are done: under torchrun the agent's SIGTERM
        to every rank follows one rank's failure at once, while the others are here. The
        run ends either way, failed or with DST complete, so it changes nothing after.
        """
        if self._lock is None or not self._lock.held:
            return
        with sheltered(raising=False):
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


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Return what tells ``path``'s entry apart from one renamed onto it (None when gone)."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _stranger(directory: Path, members: frozenset[str]) -> str | None:
    """Return the first entry under ``directory`` that is neither one of ``members`` nor ours.

    ``members`` are files, relative to ``directory``. A directory is walked when members
    lie in it, and named (ending in ``/``) when none do; a link is an entry of its own,
    never followed, so removing it removes the link alone.
    """
    holders = {str(parent) + "/" for m in members for parent in PurePosixPath(m).parents}
    return _first_stranger(directory, members, holders, "")


def _first_stranger(
    directory: Path, members: frozenset[str], holders: set[str], under: str
) -> str | None:
    """Return ``_stranger`` of ``directory``, which lies at ``under`` in the checkpoint."""
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        name = under + entry.name
        is_dir = entry.is_dir(follow_symlinks=False)
        if (name in members and not is_dir) or _OURS.match(entry.name):
            continue
        if name + "/" not in holders:
            return name + "/" if is_dir else name
        if is_dir and (found := _first_stranger(Path(entry.path), members, holders, name + "/")):
            return found
    return None


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
