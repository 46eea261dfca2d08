"""Outputs that appear only when complete: written beside DST, renamed into place.

Protocol (all ranks, in this order):
  1) ``check()``  every rank, before any collective: refuse an existing DST without
     --overwrite, and a DST that is or lies inside SRC.
  2) ``prepare()``  rank 0 clears a stale partial output and makes the staging path.
  3) writers write under ``staging.tmp``.
  4) ``commit()``  rank 0 renames the partial output onto DST (the old one, with
     --overwrite, is moved aside first and removed after), or ``abort()`` removes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from shardckpt.errors import DestinationExistsError, IOFailure, UsageError


class Staging:
    """A DST path and the partial path beside it that becomes DST on commit."""

    def __init__(
        self, dst: str | os.PathLike, *, overwrite: bool, is_dir: bool, srcs: tuple[Path, ...] = ()
    ):
        self.dst = Path(dst)
        self.overwrite = overwrite
        self.is_dir = is_dir
        self.srcs = srcs
        self.tmp = self.dst.with_name(f".{self.dst.name}.shardckpt-partial")
        self._old = self.dst.with_name(f".{self.dst.name}.shardckpt-old")

    def check(self) -> None:
        """Raise when DST may not be written; does no I/O beyond looking."""
        dst = Path(os.path.realpath(self.dst))
        for src in self.srcs:
            src = Path(os.path.realpath(src))
            if dst == src or src in dst.parents:
                raise UsageError(
                    "DST is SRC or inside it",
                    path=self.dst,
                    hint="write the conversion somewhere else; SRC is never modified",
                )
        if self.dst.exists() and not self.overwrite:
            raise DestinationExistsError(
                "already exists", path=self.dst, hint="pass --overwrite to replace it"
            )

    def prepare(self) -> None:
        """Clear what a crashed run left and create the partial output's parent (rank 0)."""
        try:
            self.dst.parent.mkdir(parents=True, exist_ok=True)
            _remove(self.tmp)
            if self.is_dir:
                self.tmp.mkdir()
        except OSError as exc:
            raise IOFailure(
                f"cannot prepare the output ({exc.strerror or exc})",
                path=self.dst,
                hint="check that the directory is writable and has free space",
            ) from None

    def commit(self) -> None:
        """Move the complete output onto DST (rank 0)."""
        try:
            if self.dst.exists() or self.dst.is_symlink():
                _remove(self._old)
                os.replace(self.dst, self._old)
            os.replace(self.tmp, self.dst)
            _remove(self._old)
        except OSError as exc:
            raise IOFailure(
                f"cannot move the finished output into place ({exc.strerror or exc})",
                path=self.dst,
                hint="check permissions of its directory",
            ) from None

    def abort(self) -> None:
        """Remove the partial output; never raises (rank 0)."""
        with contextlib.suppress(OSError):
            _remove(self.tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
