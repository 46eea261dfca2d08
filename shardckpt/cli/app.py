"""The Typer app: wires the commands (``cli/inspect.py``, ``convert.py``, ``diff.py``, ``verify.py``), runs them, reports errors."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import threading
import time
from typing import NoReturn

import typer

from shardckpt.cli import convert as convert_command
from shardckpt.cli import diff as diff_command
from shardckpt.cli import inspect as inspect_command
from shardckpt.cli import verify as verify_command
from shardckpt.cli.options import HELP_OPTIONS, RawArgsCommand, Version
from shardckpt.core.costs import start_command
from shardckpt.core.errors import (
    EXIT_USAGE,
    BadInputError,
    CollectiveFailure,
    IOFailure,
    PeerFailure,
    RemoteRankError,
    ShardckptError,
    UsageError,
)
from shardckpt.core.rank_env import env_rank
from shardckpt.core.signals import Interrupted, behind, held, interruptible
from shardckpt.core.streams import plug, say

app = typer.Typer(
    name="shardckpt",
    help="Convert PyTorch training checkpoints between layouts, formats and world sizes.\n\n"
    "Run standalone, or under torchrun to spread the work over ranks:\n\n"
    # \b: click prints the paragraph as it is, so the command is not split.
    "\b\n  torchrun --nproc-per-node 4 -m shardckpt convert ckpt/step-100 full.pt --to full\n\n"
    "An option that does not apply to the run, or one that takes one value given twice, "
    "is a usage error (exit 2).",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=HELP_OPTIONS,
)


@app.callback()
def _main(version: Version = False) -> None:
    """Convert PyTorch training checkpoints between layouts, formats and world sizes."""


app.command(epilog=inspect_command.EPILOG, cls=RawArgsCommand)(inspect_command.inspect)
app.command(epilog=convert_command.EPILOG, cls=RawArgsCommand)(convert_command.convert)
app.command(epilog=diff_command.EPILOG, cls=RawArgsCommand)(diff_command.diff)
app.command(epilog=verify_command.EPILOG, cls=RawArgsCommand)(verify_command.verify)


def report(error: ShardckptError) -> None:
    """Print ``error`` once: by the rank it started on, or by rank 0 when every rank saw it."""
    # torchrun's root cause is whichever rank exited first, so every rank leaves the line.
    _record_for_torchrun(error)
    if isinstance(error, (RemoteRankError, PeerFailure)):
        return
    first = getattr(error, "first_to_fail", None)
    if first is not None:
        # Told the other ranks through the launch's store (core/dist.py): the first rank
        # to fail prints its line, wherever it is; an error every rank saw, only once.
        if first:
            print(f"shardckpt: error: {error.line()}", file=sys.stderr)
        return
    # A broken group cannot agree on who reports, so every rank that saw it does.
    reported_here = getattr(error, "agreed", False) or isinstance(error, CollectiveFailure)
    if env_rank() != 0 and not reported_here:
        return
    say(f"shardckpt: error: {error.line()}")


def _record_for_torchrun(error: ShardckptError) -> None:
    """Give torchrun's root-cause summary our one-line error instead of a Python stack."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"shardckpt: error: {error.line()}"
    # torchrun's root cause is the failure with the earliest (whole-second) timestamp, ties
    # going to the lowest rank: a rank stopped by another's error dates its record a second
    # later, so the root cause is where the error happened, said as it was.
    when = int(time.time()) + isinstance(error, RemoteRankError)
    record = {
        "message": {
            "message": line,
            "extraInfo": {"py_callstack": line, "timestamp": str(when)},
        }
    }
    # The summary is a courtesy: the error line is already on stderr, so a failed write is ignored.
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(record, f)


def run(argv: list[str] | None = None, whole_process: bool = False) -> int:
    """Run the CLI on ``argv`` and return the exit code (for tests and ``main``).

    ``whole_process``: the process is this command (``main``), so its time counts from the
    process's start; otherwise from this call.
    """
    start_command(in_process=not whole_process)
    try:
        with interruptible():
            code = app(args=argv, prog_name="shardckpt", standalone_mode=False)
            late = held()
        if late is not None:
            _interrupted(late)
        return code if isinstance(code, int) else 0
    except typer.Exit as exc:
        return exc.exit_code
    except (Interrupted, KeyboardInterrupt, typer.Abort) as exc:
        return _interrupted(exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT))
    except Exception as exc:
        # A signal's exception wrapped by Python or a library, or an error raised while
        # one unwound: the run was still stopped by the signal.
        signalled = behind(exc)
        if signalled is not None:
            return _interrupted(signalled, also=getattr(exc, "__notes__", ()))
        return _failed(exc)


def _failed(exc: Exception) -> int:
    """Report ``exc`` in one line; return its exit code."""
    if isinstance(exc, ShardckptError):
        report(exc)
        return exc.exit_code
    if isinstance(exc, OSError):
        failure = IOFailure(
            exc.strerror or str(exc), path=exc.filename, hint="check free space and permissions"
        )
        failure.agreed = getattr(exc, "agreed", False)
        failure.first_to_fail = getattr(exc, "first_to_fail", None)
        report(failure)
        return failure.exit_code
    # click's usage errors (an unknown option, a missing argument): our one line.
    if hasattr(exc, "format_message") and getattr(exc, "exit_code", None) == EXIT_USAGE:
        failure = _usage(exc)
        report(failure)
        return failure.exit_code
    if os.environ.get("SHARDCKPT_DEBUG"):
        raise exc
    failure = _unexpected(exc)
    failure.first_to_fail = getattr(exc, "first_to_fail", None)
    report(failure)
    return failure.exit_code


def _usage(exc: Exception) -> UsageError:
    """Return click's usage error ``exc`` as our one line: what is wrong, and where help is."""
    possible = sorted(getattr(exc, "possibilities", None) or ())
    if possible:
        # An unknown option close to real ones: click lists them as "Possible options".
        message, hint = f"no such option: {exc.option_name}", f"did you mean {possible[0]}?"
    else:
        # "No such command 'convrt'. Did you mean 'convert'?": the guess becomes the hint.
        message, _, guess = exc.format_message().strip().partition(". Did you mean ")
        message = message[:1].lower() + message[1:].rstrip(".")
        ctx = getattr(exc, "ctx", None)
        hint = (
            f"did you mean {guess}"
            if guess
            else f"see '{ctx.command_path if ctx else 'shardckpt'} -h'"
        )
    return UsageError(message, hint=hint)


def _interrupted(exc: Interrupted, also: tuple[str, ...] | list[str] = ()) -> int:
    """Say once (rank 0) that a signal stopped the run, and what became of DST.

    ``also``: the notes of the exception that wrapped the signal's (what became of DST).
    Under torchrun nothing, when the agent stopped this rank because another one failed
    (``quiet``): that rank's error line is the cause.
    """
    if getattr(exc, "quiet", False):
        return exc.exit_code
    if env_rank() == 0 and exc.complete:
        say(
            f"shardckpt: note: {exc.name} came after {exc.complete} was complete: "
            "the conversion finished, exit 0"
        )
    elif env_rank() == 0:
        notes = "".join(f": {n}" for n in [*getattr(exc, "__notes__", ()), *also])
        where = "" if exc.rank is None else f" on rank {exc.rank}"
        say(f"shardckpt: interrupted by {exc.name}{where}{notes}")
    return exc.exit_code


def _unexpected(exc: Exception) -> ShardckptError:
    """Return the one-line error for an exception no part of shardckpt turned into one."""
    if isinstance(exc, RecursionError):
        return BadInputError(
            "the checkpoint's tree is nested too deeply to walk",
            hint="shardckpt reads trees of nested dicts and lists a few hundred levels deep",
        )
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return IOFailure(
        f"internal error ({detail})",
        hint="please report this; SHARDCKPT_DEBUG=1 shows the traceback",
    )


def main() -> None:
    """Console-script entry point; under torchrun, its ``@record`` names a crashing rank's traceback."""
    plug()
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        _leave(run(whole_process=True))
    # Only torchrun sets the error file, and its launch has imported torch already:
    # --help and --version standalone never wait for torch.
    from torch.distributed.elastic.multiprocessing.errors import record

    _leave(record(run)(whole_process=True))


def _leave(code: int) -> NoReturn:
    """End the process with ``code`` once the command is done, without tearing Python down.

    Freeing every module and torch's C++ state at exit takes about 0.8 s after a
    conversion (0.35 s after ``import torch`` alone), when DST is already in place and
    everything said. ``atexit`` handlers still run and the standard streams are
    flushed; only a thread still running (none of ours outlives the command) makes the
    process wait for it and tear down as usual.
    """
    if any(
        t.is_alive() and not t.daemon
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # A reader gone from a pipe (`| head`) has nothing more to miss.
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
