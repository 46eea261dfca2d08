"""Error types that carry their exit code (SPEC "Exit codes") and a fix-it hint."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from shardckpt.core.streams import say

_Found = TypeVar("_Found", bound=BaseException)

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_IO = 4
EXIT_DST_EXISTS = 5

SRC_FORMAT = "<source-format option>"
"""Stands in a hint for the option that names a source's format, which differs by command
(``--from``, diff's ``--from-a``/``--from-b``); ``source_option`` puts it in."""


class ShardckptError(Exception):
    """A failure the user can act on: one line, the file it concerns, and how to fix it."""

    exit_code = EXIT_IO

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, hint: str = ""):
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.hint = hint
        super().__init__(self.line())

    def line(self) -> str:
        """Return the one-line message printed to the user."""
        text = f"'{self.path}': {self.message}" if self.path else self.message
        return f"{text}: {self.hint}" if self.hint else text

    def name_option(self, option: str) -> None:
        """Put ``option`` where the message or hint names the source-format option."""
        self.message = self.message.replace(SRC_FORMAT, option)
        self.hint = self.hint.replace(SRC_FORMAT, option)
        self.args = (self.line(),)


class UsageError(ShardckptError):
    """Options that contradict each other or the source (exit 2)."""

    exit_code = EXIT_USAGE


class UnsupportedTorchError(ShardckptError):
    """The installed torch lacks an internal a conversion needs (exit 2): another release is the fix."""

    exit_code = EXIT_USAGE


class BadInputError(ShardckptError):
    """Missing, truncated, inconsistent or unknown input (exit 3)."""

    exit_code = EXIT_BAD_INPUT


class UnsafePickleError(BadInputError):
    """A pickle that needs code execution to load, refused without --trust-pickle (exit 3)."""


class IOFailure(ShardckptError):
    """Reading or writing failed, or a collective failed on some rank (exit 4)."""

    exit_code = EXIT_IO


class CollectiveFailure(IOFailure):
    """A collective failed on this rank: a peer died or did not answer in time (exit 4).

    Each rank that sees it reports it: no agreement is possible over a broken group.
    """


class PeerFailure(CollectiveFailure):
    """A collective failed because another rank stopped first and said why (exit: that rank's code).

    That rank prints its own line; this one, which only lost contact, prints nothing.
    """

    def __init__(self, rank: int, line: str, exit_code: int):
        self.rank = rank
        self.exit_code = exit_code
        super().__init__(f"rank {rank} failed: {line}")


class DestinationExistsError(ShardckptError):
    """DST is already there and --overwrite was not given (exit 5)."""

    exit_code = EXIT_DST_EXISTS


class RemoteRankError(ShardckptError):
    """Another rank failed first; this rank stops with that rank's error and exit code."""

    def __init__(self, rank: int, line: str, exit_code: int):
        self.rank = rank
        self.exit_code = exit_code
        super().__init__(f"rank {rank} failed: {line}")


def in_chain(exc: BaseException, kind: type[_Found]) -> _Found | None:
    """Return the first ``kind`` among ``exc`` and what it was raised from or while handling.

    Libraries re-raise: torch.save reports a failed write as a RuntimeError raised while
    handling the file's OSError, and Python 3.11 wraps what a class attribute's
    ``__set_name__`` raises (a signal's exception too) in a RuntimeError. The first
    exception of ``kind`` on the way down is what the user can act on.
    """
    seen: set[int] = set()
    here: BaseException | None = exc
    while here is not None and id(here) not in seen:
        if isinstance(here, kind):
            return here
        seen.add(id(here))
        here = here.__cause__ or here.__context__
    return None


def notice(message: str) -> None:
    """Print a one-line notice on stderr: something the user should know that is not an error."""
    say(f"shardckpt: note: {message}")


@contextmanager
def source_option(option: str | Callable[[ShardckptError], str]) -> Iterator[None]:
    """Name the command's source-format option in errors raised inside.

    ``formats/`` cannot know which command reads a source, so its hints write
    ``SRC_FORMAT``; ``option`` is the option's name, or picks it from the error (diff's
    two sources: by the path the error concerns).
    """
    try:
        yield
    except ShardckptError as exc:
        exc.name_option(option if isinstance(option, str) else option(exc))
        raise
