"""Real adverse conditions for tests: a full disk, an unreadable file, a memory cap.

Most need privileges a CI machine may not give; each such helper skips, with the
reason, where it cannot make the condition for real.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import warm_cli


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


@functools.cache
def _runs_shardckpt(prefix: tuple[str, ...]) -> bool:
    """Return whether ``prefix python -c 'import shardckpt'`` works (asked once a session)."""
    probe = [*prefix, sys.executable, "-c", "import shardckpt"]
    with tempfile.TemporaryDirectory() as cwd:
        os.chmod(cwd, 0o755)
        env = dict(os.environ, HOME=cwd)
        return subprocess.run(probe, capture_output=True, cwd=cwd, env=env).returncode == 0


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
    if not _runs_shardckpt(tuple(prefix)):
        pytest.skip("an unprivileged user cannot run this checkout's python")
    cmd = [*prefix, sys.executable, "-m", "shardckpt", *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@dataclass(frozen=True)
class MemoryCap:
    """Memory cgroups ``{base}-{i}``, one per process of a run: ``prefix`` puts a command in its own."""

    base: Path
    processes: int

    @property
    def groups(self) -> list[Path]:
        return [self.base.with_name(f"{self.base.name}-{i}") for i in range(self.processes)]

    @property
    def prefix(self) -> list[str]:
        """A command prefix that runs the command in group ``$LOCAL_RANK`` (0 standalone).

        Under ``torchrun --no-python`` each rank runs the prefix itself, so each rank gets
        a cap of its own (the promise is per process), and torchrun's agent none. (bash's
        ``$BASHPID``, not ``$$``: torchrun rewrites ``$$`` in its arguments to ``$``.)
        """
        script = f'echo $BASHPID > {self.base}-"${{LOCAL_RANK:-0}}"/cgroup.procs && exec "$@"'
        return ["bash", "-c", script, "capped"]

    def peak(self, process: int = 0) -> int:
        """Return the most memory group ``process`` was charged so far (v1 or v2's counter)."""
        group = self.groups[process]
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            text = _read(group / name)
            if text:
                return int(text)
        pytest.skip(f"{group} keeps no peak of its memory use")


@contextmanager
def memory_capped(limit_bytes: int, processes: int = 1) -> Iterator[MemoryCap]:
    """Yield cgroups that cap each of ``processes`` processes (and its children) at ``limit_bytes``.

    Each cap is a fresh cgroup: v1's memory controller, or v2's ``memory.max``; swap is
    capped too where the controller offers it, so going over means the OOM killer.
    Skip with the reason where none can be made (not root, no memory controller).
    """
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    base = f"shardckpt-test-{os.getpid()}-{next(_caps)}"
    if (v1 / "memory.limit_in_bytes").exists():
        root, limits = v1, ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
    elif "memory" in _read(v2 / "cgroup.controllers").split():
        root, limits = v2, ["memory.max", "memory.swap.max"]
    else:
        pytest.skip("no cgroup memory controller on this machine to cap memory with")
    cap = MemoryCap(root / base, processes)
    made: list[Path] = []
    try:
        for group in cap.groups:
            try:
                group.mkdir()
            except OSError as exc:
                pytest.skip(f"cannot make a memory cgroup ({exc.strerror}; needs root)")
            made.append(group)
            for i, limit in enumerate(limits):
                if (group / limit).exists():
                    value = "0" if limit == "memory.swap.max" else str(limit_bytes)
                    (group / limit).write_text(value)
                elif i == 0:
                    pytest.skip(f"{group / limit} is missing")
        yield cap
    finally:
        for group in made:
            with contextlib.suppress(OSError):
                group.rmdir()


_caps = itertools.count()


def idle_charge(argv: list[str]) -> int:
    """Return the memory a cgroup is charged for running ``argv`` uncapped (its peak).

    What importing torch costs depends on the build: about 270 MiB for the CPU wheel,
    560 MiB for a CUDA one, whose libraries are mapped even where no GPU is. A cap
    meant to leave a budget for the work is that floor plus the budget.
    """
    with memory_capped(1 << 50) as cap:
        subprocess.run([*cap.prefix, *argv], check=True, capture_output=True, timeout=120)
        return cap.peak()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def run_capped(argv: list, budget_bytes: int, timeout: float = 120) -> tuple[int, str, float]:
    """Run ``python -m shardckpt ARGV`` with ``budget_bytes`` of address space past torch's import.

    Return its exit code, its last line on stderr and its wall seconds. The cap
    (``RLIMIT_AS``) needs no privilege: a run that would fill memory fails at the cap
    in its own process instead of taking the machine with it, and one that would run
    for hours is killed at ``timeout`` (exit code -9).
    """
    # Forked warm (tests/warm_cli.py): the cap is what the process maps once torch and
    # shardckpt are imported (~650 MiB with the CPU wheel, GiBs with a CUDA build) plus
    # the budget. OMP_NUM_THREADS=1: no thread pool reserving address space.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    done = warm_cli.run(
        argv, env=env, timeout=timeout, setup=(warm_cli.cap_address_space, budget_bytes)
    )
    lines = done.stderr.strip().splitlines()
    return done.returncode, lines[-1] if lines else "", time.monotonic() - start
