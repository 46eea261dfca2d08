"""A shell environment like a user's after `source .venv/bin/activate`, for this checkout.

The README and the examples call `shardckpt`, `torchrun` and `python` by name. Tests
put a directory of three small wrappers first on PATH, each running the interpreter
that runs the tests, with this checkout first on PYTHONPATH: what they run is this
tree's code whatever the venv's own `shardckpt` script points to (another clone, or
none), in CI and on a developer's machine alike.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_WRAPPERS = {
    "python": [],
    "shardckpt": ["-m", "shardckpt"],
    "torchrun": ["-m", "torch.distributed.run"],
}


def user_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """Return os.environ with `python`, `shardckpt` and `torchrun` first on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, args in _WRAPPERS.items():
        wrapper = bin_dir / name
        argv = " ".join(f"'{a}'" for a in [sys.executable, *args])
        # This checkout goes first on PYTHONPATH inside the wrapper too, so that a
        # command line's own `PYTHONPATH=examples shardckpt ...` still runs this tree.
        wrapper.write_text(
            f"#!/bin/sh\nPYTHONPATH='{REPO}'${{PYTHONPATH:+:$PYTHONPATH}}\n"
            f'export PYTHONPATH\nexec {argv} "$@"\n'
        )
        wrapper.chmod(0o755)
    env = dict(os.environ)
    # Each test says what it wants of these; the developer's shell must not decide.
    for name in ("OMP_NUM_THREADS", "N", "M", "JQ"):
        env.pop(name, None)
    pythonpath = [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(pythonpath),
        # A stalled gloo rank fails the test in a minute rather than at the default 300 s.
        SHARDCKPT_TIMEOUT="60",
        **extra,
    )
    return env
