"""The Typer app: wires the subcommands of ``shardckpt/commands/``, runs them, reports errors."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import typer

from shardckpt.commands import convert as convert_command
from shardckpt.commands import diff as diff_command
from shardckpt.commands import inspect as inspect_command
from shardckpt.dist import env_rank
from shardckpt.errors import IOFailure, RemoteRankError, ShardckptError

app = typer.Typer(
    name="shardckpt",
    help="Convert PyTorch training checkpoints between layouts, formats and world sizes.\n\n"
    "Run standalone, or under torchrun to spread the work over ranks:\n\n"
    "  torchrun --nproc-per-node 4 -m shardckpt convert ckpt/step-100 full.pt --to full",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

app.command(epilog=inspect_command.EPILOG)(inspect_command.inspect)
app.command(epilog=convert_command.EPILOG)(convert_command.convert)
app.command(epilog=diff_command.EPILOG)(diff_command.diff)


def report(error: ShardckptError) -> None:
    """Print ``error`` once: by the rank it started on, or by rank 0 when every rank saw it."""
    # torchrun's root cause is whichever rank exited first, so every rank leaves the line.
    _record_for_torchrun(error)
    if isinstance(error, RemoteRankError):
        return
    if env_rank() != 0 and not getattr(error, "agreed", False):
        return
    print(f"shardckpt: error: {error.line()}", file=sys.stderr)


def _record_for_torchrun(error: ShardckptError) -> None:
    """Give torchrun's root-cause summary our one-line error instead of a Python stack."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"shardckpt: error: {error.line()}"
    record = {
        "message": {
            "message": line,
            "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
        }
    }
    # The summary is a courtesy: the error line is already on stderr, so a failed write is ignored.
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(record, f)


def run(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` and return the exit code (for tests and ``main``)."""
    try:
        code = app(args=argv, prog_name="shardckpt", standalone_mode=False)
        return code if isinstance(code, int) else 0
    except ShardckptError as exc:
        report(exc)
        return exc.exit_code
    except OSError as exc:
        failure = IOFailure(
            exc.strerror or str(exc), path=exc.filename, hint="check free space and permissions"
        )
        failure.agreed = getattr(exc, "agreed", False)
        report(failure)
        return failure.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        return 130
    except Exception as exc:
        # Typer's usage errors (bad option, missing argument) know how to show themselves.
        if not (hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int)):
            raise
        if env_rank() == 0:
            exc.show()
        return exc.exit_code


def main() -> None:
    """Console-script entry point; torchrun's ``@record`` names a crashing rank's traceback."""
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(run)())
