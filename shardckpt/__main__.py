"""Where ``shardckpt``, ``python -m shardckpt`` and ``torchrun -m shardckpt`` start.

The CLI imports torch, which takes seconds. A signal in that time must end the process
with the shell's code and one line, not a traceback from inside an import, so signals
are recorded (``shardckpt.core.signals.defer``) before anything heavy is imported.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Run the CLI; a signal while it starts up ends it as soon as it can act on it."""
    try:
        from shardckpt.core import signals, streams

        # First: a closed stderr must not become the first file opened (see streams).
        streams.plug()
        signals.defer()
        from shardckpt.cli.app import main as cli_main
    except KeyboardInterrupt:  # before defer() took over: a fraction of a millisecond
        print("shardckpt: interrupted by SIGINT", file=sys.stderr)
        sys.exit(130)
    cli_main()


if __name__ == "__main__":
    main()
