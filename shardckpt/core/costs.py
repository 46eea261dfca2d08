"""What a run cost: seconds per phase, bytes read and written, peak resident memory.

Each process keeps its own ``Costs``; the command gathers them to rank 0, which reports
the phases' wall time as the slowest rank's, the bytes summed over ranks and the peak
resident memory of each rank (``convert --json``'s ``costs``, the summary line).

Resident memory (``ru_maxrss``) is not what a memory cap counts: a cgroup is charged the
page cache a process fills too (SRC's pages it read or mapped, DST's it wrote), and not the
pages of libraries another cgroup loaded first. Where a process runs in a memory cgroup of
its own (a cap per process, as ``tests/conditions.memory_capped`` and ``scripts/bench.py``
make), each rank's report also carries that cgroup's peak charge, the number the kernel
holds against the cap.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("plan", "frame", "write", "flush", "finish", "verify")
"""The phases of a conversion, in order: open SRC and plan; lay DST out; fill it; flush it to
disk; checksums and what comes last (DCP's ``.metadata``); ``--verify``."""


def peak_rss_bytes() -> int:
    """Return this process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cgroup_peak_bytes() -> int | None:
    """Return the peak charge of this process's memory cgroup, None unless the cgroup is its own.

    Its own: no process in it but this one and its children (a cap per process). v1's
    ``memory.max_usage_in_bytes`` or v2's ``memory.peak``.
    """
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                group, counter = Path("/sys/fs/cgroup/memory" + path), "memory.max_usage_in_bytes"
                break
        else:
            path = next(ln.split(":", 2)[2] for ln in lines if ln.startswith("0::"))
            group, counter = Path("/sys/fs/cgroup" + path), "memory.peak"
        if path == "/" or not _all_mine((group / "cgroup.procs").read_text().split()):
            return None
        return int((group / counter).read_text())
    except (OSError, ValueError, StopIteration):
        return None


def _all_mine(pids: list[str]) -> bool:
    """Return whether each of ``pids`` is this process or a child of it."""
    me = os.getpid()
    for pid in map(int, pids):
        if pid != me:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) != me:
                    return False
    return True


def process_seconds() -> float:
    """Return the seconds since this process started (Python's start-up and imports included)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # Field 22, after the command name (which may hold spaces, inside parentheses).
            started = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


# Where /proc cannot say, a command's wall time starts when shardckpt is first imported.
_IMPORTED = time.perf_counter()
_COMMAND_STARTED: list[float | None] = [None]


def start_command(in_process: bool) -> None:
    """Mark a command's start: now for one run inside a longer process (tests, a caller's
    ``cli.run``), else the process's own start (the ``shardckpt`` command)."""
    _COMMAND_STARTED[0] = time.perf_counter() if in_process else None


def command_seconds() -> float:
    """Return the wall seconds of the command running (``start_command``)."""
    started = _COMMAND_STARTED[0]
    return process_seconds() if started is None else time.perf_counter() - started


@dataclass
class Costs:
    """One process's costs of one command."""

    seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds of each phase this process went through."""
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    """CPU seconds (user and system) this process spent in each phase."""
    read_bytes: int = 0
    """Tensor bytes read from SRC to fill DST (``--verify``'s reading is its phase's time)."""
    written_bytes: int = 0
    """Bytes written into DST's files (headers and tensor data)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the wall time of the block inside as phase ``name``."""
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - cpu

    def report(self) -> dict:
        """Return what this process sends rank 0: its phases, bytes, peak resident memory and cgroup charge."""
        return {
            "seconds": dict(self.seconds),
            "cpu_seconds": dict(self.cpu_seconds),
            "read_bytes": self.read_bytes,
            "written_bytes": self.written_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
            "peak_cgroup_bytes": cgroup_peak_bytes(),
        }


def combined(reports: list[dict], wall: float) -> dict:
    """Return the costs of a command from every rank's ``report``, in rank order, and its wall time.

    A phase takes as long as its slowest rank (the ranks wait for each other after each);
    CPU seconds and bytes add up over ranks; memory is each rank's own.
    """
    seconds = {
        p: round(max(r["seconds"].get(p, 0.0) for r in reports), 3)
        for p in PHASES
        if any(p in r["seconds"] for r in reports)
    }
    cpu = {
        p: round(sum(r["cpu_seconds"].get(p, 0.0) for r in reports), 3)
        for p in PHASES
        if any(p in r["cpu_seconds"] for r in reports)
    }
    read = sum(r["read_bytes"] for r in reports)
    written = sum(r["written_bytes"] for r in reports)
    moving = seconds.get("write", 0.0) + seconds.get("flush", 0.0)
    return {
        "wall_seconds": round(wall, 3),
        "phase_seconds": seconds,
        "phase_cpu_seconds": cpu,
        "read_bytes": read,
        "written_bytes": written,
        "write_gb_per_s": round(written / moving / 1e9, 3) if moving > 0 else None,
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in reports],
        "peak_cgroup_bytes": [r.get("peak_cgroup_bytes") for r in reports],
    }
