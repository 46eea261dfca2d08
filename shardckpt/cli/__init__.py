"""The command line: the Typer app (``app``), one module per command, shared option types,
rendering. Builds a request and calls the library; imports torch only when a command runs.

``run(argv)`` runs the CLI in this process and returns the exit code (tests, embedding).
"""

from __future__ import annotations

from shardckpt.cli.app import app, run

__all__ = ["app", "run"]
