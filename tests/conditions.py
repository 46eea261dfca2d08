"""Real adverse conditions for tests: a full disk, an unreadable file.

Both need privileges a CI machine may not give; each helper skips, with the reason,
where it cannot make the condition for real.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tiny_disk(size: str = "256k") -> Iterator[Path]:
    """Yield a directory on a fresh tmpfs of ``size`` bytes (root only; skip otherwise)."""
    where = Path(tempfile.mkdtemp(prefix="shardckpt-full-"))
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a small tmpfs to fill ({proc.stderr.strip() or 'not root'})")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


@contextmanager
def public_dir() -> Iterator[Path]:
    """Yield a directory every user can enter, for files an unprivileged run must find."""
    where = Path(tempfile.mkdtemp(prefix="shardckpt-public-"))
    where.chmod(0o755)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def run_unprivileged(argv: list, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``python -m shardckpt ARGV`` as a user that file permissions apply to.

    As root (whom permissions do not stop) it runs as ``nobody`` through ``setpriv``;
    skip when that is not possible here.
    """
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip(
                "running as root without setpriv: cannot drop privileges to test permissions"
            )
        prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    env = dict(os.environ, HOME=str(cwd))  # nothing of root's home is the child's to write
    probe = [*prefix, sys.executable, "-c", "import shardckpt"]
    if subprocess.run(probe, capture_output=True, cwd=cwd, env=env).returncode != 0:
        pytest.skip("an unprivileged user cannot run this checkout's python")
    cmd = [*prefix, sys.executable, "-m", "shardckpt", *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
