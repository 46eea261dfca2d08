"""Benchmark `shardckpt convert` into every layout against `cp -r` and dcp_to_torch_save.

    python scripts/bench.py [--size-gb 1.0] [--nproc 1,2] [--layouts all] [--world-size 4]
                            [--mem-cap 1.5GiB] [--buffer-size 256MiB] [--workdir .bench]
                            [--tmpfs] [--threads 1,2,4] [--rounds R]
                            [--keep] [--warmup] [--repeat R] [--json] [--source dcp]
    python scripts/bench.py --scale [--tensors 2000] [--world-sizes 8,64,256,1024] ...
    python scripts/bench.py --s3 [--size-gb 1.0] [--world-size 3]   (bench_s3.py)

With --scale (first), the scale axis instead: a source of 2,000 small tensors resharded to
many target ranks, wall, phases and peak RSS per process (``bench_scale.py``).

With --source deepspeed the source is a ZeRO-2 bf16 run saved by DeepSpeed (model +
AdamW, about SIZE_GB; ``bench_deepspeed.py``) and the reference DeepSpeed's own
``zero_to_fp32.py``, whose weights every output's ``model`` is checked against: that
needs deepspeed installed in this interpreter.

Builds (or reuses) an FSDP2 DCP checkpoint of about SIZE_GB (model + AdamW) in WORKDIR,
then runs each case as its own process tree: the two references (torch's
dcp_to_torch_save and `cp -r`, uncapped), then `shardckpt convert` into each layout for
each launch size N (N=1 standalone, N>1 under torchrun); the layout ``verify`` is
``shardckpt verify SRC`` instead (reads every byte, writes nothing), and ``inspect``
``shardckpt inspect SRC`` (metadata only: what starting a command costs). One markdown table
on stdout (or one JSON document with --json); progress and failures on stderr.

- Threads: with --threads 1,2,4 each shardckpt case runs once per thread count
  (``--threads T`` on convert and verify; without it, shardckpt's default: the cores
  the process may use, shared by the ranks on the node).
- Rounds: with --rounds R every case after the reference runs R times, the cases taking
  turns (round 1: every case, then round 2 ...), so that the load other processes put
  on the machine falls on every case alike; each row is the round of median wall time.
- CPU: each case's user + system seconds (all its processes, from the kernel's
  accounting of reaped children) and CPU seconds per GB of source, beside wall time:
  on a fast disk or tmpfs, the CPU a byte costs is what bounds the speed. Put WORKDIR
  on a tmpfs (``--tmpfs``, or ``--workdir /dev/shm/bench``) to take the disk out of the
  numbers; the header names WORKDIR's filesystem.

- Memory cap: with --mem-cap, each converting process (the standalone process, or
  each torchrun rank; never torchrun's agent) runs in a memory cgroup of its own
  (v1 `memory.limit_in_bytes` + `memory.memsw.limit_in_bytes`, or v2 `memory.max` +
  `memory.swap.max`), made under this process's own cgroup and removed after the
  case: the promise is memory per process. A case the OOM killer hit reads "OOM". Without root or a writable memory
  controller the cases run uncapped and the header says why.
- Peak RSS: VmHWM (the kernel's high-water mark of resident memory) of every process of
  the case, read from /proc every 50 ms; the table shows the largest worker's (N>1) or
  the process's (N=1), never torchrun's agent.
- Exactness: every output is compared, bit for bit and outside the timed part, with
  torch's own reading of the source (dcp_to_torch_save's file, memory-mapped).

The source is read from the page cache (it was just written, or read by the previous
case), so the numbers measure conversion work rather than cold-disk reads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import bench_deepspeed
import torch
import torch.distributed.tensor  # noqa: F401  (puts DTensor on torch.load's allow-list)
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor, Shard

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
BUILD_NPROC = 2
"""Ranks of the job that saves the source checkpoint."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# torchrun sets OMP_NUM_THREADS=1 for its workers anyway, with a banner on stderr;
# setting it ourselves for torchrun cases only silences the banner.
TORCHRUN_ENV = {"OMP_NUM_THREADS": "1"}
DCP_TO_TORCH_SAVE = (
    "import sys\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
)
COPY_CASES = ("cp -r", "cp -r && sync")
TMPFS = Path("/dev/shm")
"""Where --tmpfs puts WORKDIR."""
SAMPLE_INTERVAL_S = 0.05
RSS_SLACK_BYTES = 300 * 2**20
"""The fixed part of the RSS target (importing torch alone costs ~0.3 GiB)."""
SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One output of `shardckpt convert`: its flags and what it is called on disk."""

    flags: tuple[str, ...]
    """--to and --format for this output."""
    dst_name: str
    """File or directory name of the output in WORKDIR."""
    per_rank: bool = False
    """True when the output is for --world-size M ranks."""
    command: str = "convert"
    """The shardckpt command: convert, verify (which reads SRC and writes nothing) or inspect."""


LAYOUTS = {
    "full-safetensors": Layout(
        flags=("--to", "full", "--format", "safetensors"), dst_name="out.safetensors"
    ),
    "full-torch": Layout(flags=("--to", "full", "--format", "torch"), dst_name="out.pt"),
    "hf": Layout(flags=("--to", "full", "--format", "hf"), dst_name="out-hf"),
    "sharded": Layout(
        flags=("--to", "sharded", "--format", "dcp"), dst_name="out-dcp", per_rank=True
    ),
    "local": Layout(
        flags=("--to", "local", "--format", "fsdp2-ranks"), dst_name="out-ranks", per_rank=True
    ),
    # Not an output: `shardckpt verify SRC`, every byte of SRC read and checked once.
    "verify": Layout(flags=(), dst_name="verify-writes-nothing", command="verify"),
    # Not an output: `shardckpt inspect SRC`, the metadata alone: the command's start-up.
    "inspect": Layout(flags=(), dst_name="inspect-writes-nothing", command="inspect"),
}


# ---------------------------------------------------------------------------- cases


@dataclass(kw_only=True, slots=True)
class Case:
    """One benchmarked command."""

    name: str
    """Row label in the table: the program that converts."""
    nproc: int
    """Processes that convert: 1 standalone, N under torchrun (N workers + the agent)."""
    layout: str
    """A key of LAYOUTS, or "copy" for `cp -r`."""
    argv: list[str]
    """The command, run from the repository root (each rank's, under ``launcher``)."""
    launcher: list[str] = field(default_factory=list)
    """torchrun, which runs ``argv`` on each rank; empty for a standalone command."""
    dst: Path
    """What the command writes; removed before the case and after its check."""
    world_size: int | None = None
    """M of a sharded or local output."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to the inherited environment."""
    capped: bool = False
    """Run under --mem-cap (the references run uncapped: dcp_to_torch_save needs the
    whole checkpoint in memory, and neither is what the cap is about)."""
    threads: int | None = None
    """shardckpt's --threads; None: its default."""


def shardckpt_argv() -> list[str]:
    """Return the shardckpt console script that belongs to this interpreter's env.

    Without one (an env that imports shardckpt from PYTHONPATH, as the one with
    deepspeed for --source deepspeed may), ``python -m shardckpt`` of this interpreter.
    """
    beside = Path(sys.executable).parent / "shardckpt"
    found = str(beside) if beside.exists() else shutil.which("shardckpt")
    return [found] if found else [sys.executable, "-m", "shardckpt"]


def reference_cases(src: Path, workdir: Path, source: str = "dcp") -> list[Case]:
    """Return the exactness reference (dcp_to_torch_save, or zero_to_fp32.py for a DeepSpeed
    source), `cp -r` and `cp -r && sync`."""
    if source == "deepspeed":
        out = workdir / "ref-zero_to_fp32"
        reference = Case(
            name=bench_deepspeed.REFERENCE,
            nproc=1,
            layout="full-torch",
            argv=bench_deepspeed.reference_argv(src, out),
            dst=out,
            env=bench_deepspeed.DS_ENV,
        )
    else:
        reference = Case(
            name="dcp_to_torch_save",
            nproc=1,
            layout="full-torch",
            argv=[sys.executable, "-c", DCP_TO_TORCH_SAVE, str(src), str(workdir / "ref.pt")],
            dst=workdir / "ref.pt",
        )
    return [
        reference,
        Case(
            name="cp -r",
            nproc=1,
            layout="copy",
            argv=["cp", "-r", str(src), str(workdir / "copy")],
            dst=workdir / "copy",
        ),
        # shardckpt fsyncs what it wrote before it renames it into place; `cp -r` leaves
        # its bytes in the page cache. This row is the copy that is on disk at the end.
        Case(
            name="cp -r && sync",
            nproc=1,
            layout="copy",
            argv=["sh", "-c", 'cp -r "$0" "$1" && sync', str(src), str(workdir / "copy")],
            dst=workdir / "copy",
        ),
    ]


def shardckpt_case(
    src: Path, workdir: Path, nproc: int, layout: str, args, threads: int | None = None
) -> Case:
    """Return `shardckpt convert SRC` into layout, standalone or under torchrun at nproc."""
    spec = LAYOUTS[layout]
    dst = workdir / spec.dst_name
    flags = [*spec.flags, "--buffer-size", args.buffer_size, "--overwrite", "--quiet"]
    world_size = args.world_size if spec.per_rank else None
    if world_size:
        flags += ["--world-size", str(world_size)]
    more = [] if threads is None else ["--threads", str(threads)]
    convert = ["convert", str(src), str(dst), *flags, *more]
    if spec.command == "verify":
        convert = ["verify", str(src), "--quiet", *more]
    if spec.command == "inspect":
        convert = ["inspect", str(src)]  # reads no tensor data: no threads to give
    if nproc == 1:
        return Case(
            name="shardckpt",
            nproc=1,
            layout=layout,
            argv=[*shardckpt_argv(), *convert],
            dst=dst,
            world_size=world_size,
            capped=True,
            threads=threads,
        )
    return Case(
        name="torchrun -m shardckpt",
        nproc=nproc,
        layout=layout,
        # --no-python: each rank runs argv as given, so that under --mem-cap it first
        # moves itself into a cgroup of its own.
        launcher=[*TORCHRUN, f"--nproc-per-node={nproc}", "--no-python"],
        argv=[sys.executable, "-m", "shardckpt", *convert],
        dst=dst,
        world_size=world_size,
        env=TORCHRUN_ENV,
        capped=True,
        threads=threads,
    )


# ----------------------------------------------------------------------- memory cap


# Run by each converting process: join cgroup slot $LOCAL_RANK (0 standalone) under
# the case's cgroup ($0), then exec the command, which is charged from its first byte.
# bash's $BASHPID, not $$: torchrun rewrites "$$" in its arguments to "$".
ENTER_SLOT = 'echo $BASHPID > "$0/slot${LOCAL_RANK:-0}/cgroup.procs" && exec "$@"'


@dataclass(kw_only=True, slots=True)
class Cgroup:
    """A case's memory cgroup: one capped slot per converting process; remove() it after."""

    path: Path
    version: int
    """1 (the legacy memory controller) or 2 (the unified hierarchy)."""
    slots: int

    def wrap(self, argv: list[str]) -> list[str]:
        """Return argv run by a shell that first moves itself into its process's slot."""
        return ["bash", "-c", ENTER_SLOT, str(self.path), *argv]

    def _slots(self) -> list[Path]:
        return [self.path / f"slot{i}" for i in range(self.slots)]

    def oom_kills(self) -> int:
        """Return how many processes the OOM killer has killed in this case's slots."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        return sum(read_keyed(slot / name).get("oom_kill", 0) for slot in self._slots())

    def peak_bytes(self) -> int | None:
        """Return the largest slot's peak charge (page cache included), if the kernel keeps one."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return max(int((slot / name).read_text()) for slot in self._slots())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        """Kill what is left in the slots (an orphaned worker) and delete them."""
        for group in [*self._slots(), self.path]:
            for _ in range(100):
                pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
            # The kernel may still be uncharging the last exited process: EBUSY for a moment.
            for _ in range(100):
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                log(f"could not remove cgroup {group}; remove it with rmdir")


@dataclass(kw_only=True, slots=True)
class MemoryCap:
    """Where capped cases get their cgroups, or why they cannot."""

    limit: int | None
    """--mem-cap in bytes; None when not asked for."""
    parent: Path | None = None
    """The cgroup the per-case cgroups are made in; None when unavailable."""
    version: int = 0
    unavailable: str | None = None
    """Why no cap can be applied, when one was asked for."""

    @property
    def applies(self) -> bool:
        """Return whether capped cases really run in a cgroup."""
        return self.parent is not None

    def status(self, case: Case) -> str:
        """Return the capped column for case: yes, no or unavailable."""
        if not case.capped or self.limit is None:
            return "no"
        return "yes" if self.applies else "unavailable"

    def create(self, name: str, slots: int) -> Cgroup:
        """Return a new cgroup under parent with ``slots`` children, each capped, with no swap."""
        assert self.parent is not None and self.limit is not None
        top = self.parent / name
        top.mkdir()
        if self.version == 2:
            enable_memory_controller(top)
        for i in range(slots):
            self._limited(top / f"slot{i}")
        return Cgroup(path=top, version=self.version, slots=slots)

    def _limited(self, path: Path) -> None:
        """Make cgroup ``path`` limited to limit bytes, with no swap."""
        assert self.limit is not None
        path.mkdir()
        try:
            if self.version == 1:
                (path / "memory.limit_in_bytes").write_text(str(self.limit))
                # memsw counts memory + swap; equal to the limit, it forbids swapping
                # out. It exists only with swap accounting, and must come second
                # (the kernel keeps memsw >= limit).
                if (path / "memory.memsw.limit_in_bytes").exists():
                    (path / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
            else:
                (path / "memory.max").write_text(str(self.limit))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
        except OSError:
            path.rmdir()
            raise

    def describe(self) -> str:
        """Return the cap line of the report header."""
        if self.limit is None:
            return "none (no --mem-cap)"
        size = f"{self.limit / 2**30:.2f} GiB per converting process"
        if not self.applies:
            return f"{size} asked, cap unavailable: {self.unavailable}; cases ran uncapped"
        return (
            f"{size}, no swap (cgroup v{self.version}, one cgroup per process under {self.parent})"
        )


def probe_cap(limit: int | None) -> MemoryCap:
    """Return a MemoryCap for limit, tried out by making and removing a cgroup."""
    cap = MemoryCap(limit=limit)
    if limit is None:
        return cap
    if os.geteuid() != 0:
        cap.unavailable = "not root (creating a memory cgroup needs root)"
        return cap
    reasons = []
    for version, parent in cgroup_parents():
        trial = MemoryCap(limit=limit, parent=parent, version=version)
        try:
            if version == 2:
                enable_memory_controller(parent)
            trial.create(f"shardckpt-bench-probe-{os.getpid()}", 1).remove()
        except OSError as e:
            reasons.append(f"{parent}: {e.strerror or e}")
            continue
        return trial
    cap.unavailable = "; ".join(reasons) or "no memory cgroup controller is mounted"
    return cap


def cgroup_parents() -> Iterator[tuple[int, Path]]:
    """Yield (version, directory) where a per-case memory cgroup could be made."""
    # This process's own cgroup first: the cases then stay inside whatever limit this
    # benchmark itself runs under, and a delegated subtree is often the only writable
    # place. The hierarchy's root second.
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        own[controllers] = path
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount, fstype, options, *_ = line.split()
        if fstype == "cgroup" and "memory" in options.split(","):
            version = 1
            path = next((p for c, p in own.items() if "memory" in c.split(",")), "/")
        elif fstype == "cgroup2" and "memory" in read_words(Path(mount) / "cgroup.controllers"):
            version, path = 2, own.get("", "/")
        else:
            continue
        mine = Path(mount) / path.lstrip("/")
        for parent in dict.fromkeys([mine, Path(mount)]):
            if parent.is_dir():
                yield version, parent


def enable_memory_controller(parent: Path) -> None:
    """Make cgroup v2's memory controller available to parent's children."""
    if "memory" not in read_words(parent / "cgroup.subtree_control"):
        (parent / "cgroup.subtree_control").write_text("+memory")


def read_words(path: Path) -> list[str]:
    """Return the whitespace-separated words of a file, or none when it cannot be read."""
    try:
        return path.read_text().split()
    except OSError:
        return []


def read_keyed(path: Path) -> dict[str, int]:
    """Return a cgroup file of `key value` lines as a dict (empty when unreadable)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split() for line in lines) if v.isdigit()}


# --------------------------------------------------------------------- peak memory


@dataclass(kw_only=True, slots=True)
class ProcessPeak:
    """The memory high-water marks of one process of a case."""

    pid: int
    role: str
    """process (a standalone case), agent (torchrun's) or worker (a torchrun rank)."""
    command: str
    peak_rss_gib: float
    """VmHWM at the last look: the kernel's own peak of the resident set."""
    peak_anon_gib: float
    """Largest RssAnon seen: resident memory not backed by a file (VmHWM also counts
    pages of memory-mapped files, such as a source read through mmap)."""


class PeakSampler:
    """Reads the memory peaks of a process and its descendants every 50 ms until stop().

    Not wait4's ru_maxrss: that is one number for the child and every descendant it
    reaped (torchrun's agent mixed with its workers), and Linux carries it across
    execve, so every child would start from this process's own resident set at the
    fork (torch and the memory-mapped reference). VmHWM belongs to one address space
    and starts afresh at exec. Sampling only decides which processes are seen: VmHWM
    itself is kept by the kernel, so a peak between two samples is not missed, only
    growth in a process's last 50 ms before it exits.
    """

    def __init__(self, root: int, nproc: int) -> None:
        self._root = root
        self._torchrun = nproc > 1
        self._peaks: dict[int, ProcessPeak] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> list[ProcessPeak]:
        """Stop sampling; return the peaks of every process seen, root first."""
        self._done.set()
        self._thread.join()
        return sorted(self._peaks.values(), key=lambda p: (p.pid != self._root, p.pid))

    def _run(self) -> None:
        while True:
            for pid in [self._root, *descendants(self._root)]:
                self._sample(pid)
            # Checked after a sample, so even a process that lived < 50 ms is seen once.
            if self._done.wait(SAMPLE_INTERVAL_S):
                return

    def _sample(self, pid: int) -> None:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return  # exited between the listing and the read
        fields = dict(re.findall(r"^(VmHWM|RssAnon):\s+(\d+) kB", status, re.MULTILINE))
        if "VmHWM" not in fields:
            return  # a zombie: its memory is gone, its last sample stands
        hwm, anon = int(fields["VmHWM"]) / 2**20, int(fields.get("RssAnon", 0)) / 2**20
        seen = self._peaks.get(pid)
        if seen is None:
            role = ("agent" if pid == self._root else "worker") if self._torchrun else "process"
            seen = self._peaks[pid] = ProcessPeak(
                pid=pid, role=role, command="", peak_rss_gib=0.0, peak_anon_gib=0.0
            )
        # The root is `sh` until it execs the command; keep the name of what ran longest.
        seen.command = command.strip()[:200] or seen.command
        seen.peak_rss_gib = max(seen.peak_rss_gib, hwm)
        seen.peak_anon_gib = max(seen.peak_anon_gib, anon)


def descendants(pid: int) -> list[int]:
    """Return the pids of pid's children, their children, and so on."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def children(pid: int) -> list[int]:
    """Return pid's child processes (from every one of its threads)."""
    if not HAVE_CHILDREN_FILES:
        return [p for p, parent in parents().items() if parent == pid]
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(k) for k in task.read_text().split()]
        except OSError:
            pass
    return kids


def parents() -> dict[int, int]:
    """Return every process's parent pid, read from /proc/*/stat."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name in parentheses may hold spaces: the fields follow the last ")".
            found[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return found


# /proc/PID/task/TID/children needs CONFIG_PROC_CHILDREN; without it, scan all of /proc.
HAVE_CHILDREN_FILES = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


# ------------------------------------------------------------------------- measuring


@dataclass(kw_only=True, slots=True)
class Result:
    """What one timed run of a case measured."""

    case: str
    nproc: int
    layout: str
    world_size: int | None
    """M of a sharded or local output."""
    returncode: int
    threads: int | None = None
    """shardckpt's --threads (per process); None: its default, or not shardckpt."""
    oom: bool
    """The OOM killer killed a process of the case (in its cgroup)."""
    wall_s: float
    """Wall-clock seconds from spawning the process to reaping it."""
    gb_per_s: float
    """Source bytes (1 GB = 1e9 bytes) over wall_s."""
    cpu_s: float
    """User + system CPU seconds of the case's processes (torchrun's agent included),
    from the kernel's accounting of reaped children."""
    cpu_s_per_gb: float
    """cpu_s over the source's GB: what the work costs apart from waiting."""
    peak_rss_gib: float
    """Largest VmHWM of one worker (N>1) or of the process (N=1); never the agent's."""
    processes: list[ProcessPeak]
    """Every process seen, with its peaks."""
    capped: str
    """yes, no, or unavailable (a cap was asked for and could not be applied)."""
    cgroup_peak_gib: float | None
    """The case's cgroup's own peak charge, page cache of written files included."""
    dst_bytes: int
    """Size of what the case wrote: a sanity check that it wrote the whole thing."""
    exact: str = "–"
    """yes / no: the output equals torch's reading of the source bit for bit; ref: it is
    that reading; –: not checked (a failed case, or `cp -r`)."""
    difference: str | None = None
    """Where the output first differs from the reference, when exact is no."""
    walls_s: list[float] = field(default_factory=list)
    """Every timed run's wall_s, when --repeat or --rounds asked for several."""
    cpus_s: list[float] = field(default_factory=list)
    """Every round's cpu_s, with --rounds."""
    vs_dcp_to_torch_save: float | None = None
    """wall_s over dcp_to_torch_save's (None if either failed)."""
    vs_reference: float | None = None
    """wall_s over the reference's: dcp_to_torch_save, or zero_to_fp32.py for --source deepspeed."""
    vs_copy: float | None = None
    vs_copy_synced: float | None = None
    """wall_s over `cp -r && sync`'s (None if either failed)."""
    """wall_s over `cp -r`'s (None if either failed)."""

    @property
    def ok(self) -> bool:
        """Return whether the command exited 0."""
        return self.returncode == 0

    @property
    def outcome(self) -> str:
        """Return the result column: ok, OOM, or failed (exit N)."""
        if self.oom:
            return "OOM"
        return "ok" if self.ok else f"failed (exit {self.returncode})"


def measure(case: Case, src_bytes: int, cap: MemoryCap) -> Result:
    """Run case once as a fresh process tree; return its wall time and memory peaks."""
    remove(case.dst)
    # Dirty pages of earlier cases are written back now, not during this one.
    os.sync()
    cgroup = (
        cap.create(f"shardckpt-bench-{os.getpid()}", case.nproc)
        if cap.status(case) == "yes"
        else None
    )
    argv = [*case.launcher, *(cgroup.wrap(case.argv) if cgroup else case.argv)]
    try:
        with tempfile.TemporaryFile() as stderr:
            cpu_before = children_cpu_s()
            start = time.perf_counter()
            try:
                env = {**os.environ, **case.env}
                proc = subprocess.Popen(
                    argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr
                )
            except FileNotFoundError as e:
                # Reported as a failed row (127, as a shell would), so the other cases run.
                log(f"cannot run {case.name}: {e}")
                return failed_to_start(case, cap)
            sampler = PeakSampler(proc.pid, case.nproc)
            returncode = proc.wait()
            wall = time.perf_counter() - start
            # The case's processes are all reaped by now (torchrun reaps its workers, so
            # their time is in the agent's), and this script starts no other child meanwhile.
            cpu = children_cpu_s() - cpu_before
            processes = sampler.stop()
            if returncode != 0:
                report_failure(case, returncode, stderr)
        oom = cgroup is not None and (cgroup.oom_kills() > 0 or returncode in (-9, 137))
        cgroup_peak = cgroup.peak_bytes() if cgroup else None
    finally:
        if cgroup:
            cgroup.remove()
    measured = [p for p in processes if p.role != "agent"]
    return Result(
        case=case.name,
        nproc=case.nproc,
        layout=case.layout,
        world_size=case.world_size,
        threads=case.threads,
        returncode=returncode,
        oom=oom,
        wall_s=wall,
        gb_per_s=src_bytes / 1e9 / wall,
        cpu_s=cpu,
        cpu_s_per_gb=cpu / (src_bytes / 1e9),
        peak_rss_gib=max((p.peak_rss_gib for p in measured), default=0.0),
        processes=processes,
        capped=cap.status(case),
        cgroup_peak_gib=None if cgroup_peak is None else cgroup_peak / 2**30,
        dst_bytes=tree_bytes(case.dst),
    )


def children_cpu_s() -> float:
    """Return the user + system CPU seconds of this process's reaped children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def failed_to_start(case: Case, cap: MemoryCap) -> Result:
    """Return the result of a case whose program does not exist (exit 127)."""
    return Result(
        case=case.name,
        nproc=case.nproc,
        layout=case.layout,
        world_size=case.world_size,
        returncode=127,
        oom=False,
        wall_s=0.0,
        gb_per_s=0.0,
        cpu_s=0.0,
        cpu_s_per_gb=0.0,
        peak_rss_gib=0.0,
        processes=[],
        capped=cap.status(case),
        cgroup_peak_gib=None,
        dst_bytes=0,
    )


def report_failure(case: Case, returncode: int, stderr) -> None:
    """Log a failed case's exit status and the last lines it wrote to stderr."""
    stderr.seek(0)
    tail = stderr.read().decode(errors="replace").splitlines()[-15:]
    log(f"{case.name} (N={case.nproc}, {case.layout}) exited {returncode}; its stderr ends:")
    for line in tail:
        print(f"    {line}", file=sys.stderr)


def run_case(case: Case, args, src_bytes: int, cap: MemoryCap, check) -> Result:
    """Run case (warm-up, then --repeat timed runs, each checked); return its row."""
    label = f"{case.name} (N={case.nproc}, {case.layout})"
    if args.warmup:
        log(f"warm-up: {label}")
        measure(case, src_bytes, cap)
    runs = []
    for i in range(args.repeat):
        log(f"timing ({i + 1}/{args.repeat}): {label}")
        run = measure(case, src_bytes, cap)
        writes = case.layout not in LAYOUTS or LAYOUTS[case.layout].command == "convert"
        if run.ok and check is not None and writes:
            # Outside the timed part: measure() has returned.
            run.difference = check(case)
            run.exact = "no" if run.difference else "yes"
            if run.difference:
                log(f"{label}: output differs from the reference: {run.difference}")
        runs.append(run)
    return best(runs)


def checked_run(case: Case, args, src_bytes: int, cap: MemoryCap, check) -> Result:
    """Run case once, timed, then (outside the timing) check what it wrote."""
    run = measure(case, src_bytes, cap)
    # `cp -r` (layout "copy") writes what is not checked; verify writes nothing.
    writes = case.layout in LAYOUTS and LAYOUTS[case.layout].command == "convert"
    if run.ok and check is not None and writes:
        run.difference = check(case)
        run.exact = "no" if run.difference else "yes"
        if run.difference:
            log(f"{case.name} (N={case.nproc}, {case.layout}): output differs: {run.difference}")
    return run


def in_rounds(cases: list[Case], args, src_bytes: int, cap: MemoryCap, check) -> list[Result]:
    """Run every case ``args.rounds`` times, the cases taking turns; return each case's median round."""
    runs: list[list[Result]] = [[] for _ in cases]
    for r in range(args.rounds):
        for case, seen in zip(cases, runs):
            log(
                f"round {r + 1}/{args.rounds}: {case.name} (N={case.nproc}, {case.layout}, threads {case.threads or 'default'})"
            )
            seen.append(checked_run(case, args, src_bytes, cap, check))
            remove(case.dst)
    return [median(seen) for seen in runs]


def median(runs: list[Result]) -> Result:
    """Return the run of median wall time (the first failed one if any); peaks are the max over all."""
    failed = [r for r in runs if not r.ok]
    chosen = failed[0] if failed else sorted(runs, key=lambda r: r.wall_s)[(len(runs) - 1) // 2]
    chosen.peak_rss_gib = max(r.peak_rss_gib for r in runs)
    inexact = [r for r in runs if r.exact == "no"]
    if inexact:
        chosen.exact, chosen.difference = "no", inexact[0].difference
    chosen.walls_s = [r.wall_s for r in runs]
    chosen.cpus_s = [r.cpu_s for r in runs]
    return chosen


def best(runs: list[Result]) -> Result:
    """Return the fastest run, or the first failed one; peaks are the max over all."""
    failed = [r for r in runs if not r.ok]
    # The fastest run is the one least disturbed by other load on the machine; memory
    # is not disturbed that way, so the worst case is the honest one.
    chosen = failed[0] if failed else min(runs, key=lambda r: r.wall_s)
    chosen.peak_rss_gib = max(r.peak_rss_gib for r in runs)
    inexact = [r for r in runs if r.exact == "no"]
    if inexact:
        chosen.exact, chosen.difference = "no", inexact[0].difference
    chosen.walls_s = [r.wall_s for r in runs]
    return chosen


def add_ratios(results: list[Result]) -> None:
    """Fill in each result's wall time relative to dcp_to_torch_save and to cp -r."""
    walls = {r.case: r.wall_s for r in results if r.ok}
    torch_wall, copy_wall = walls.get("dcp_to_torch_save"), walls.get("cp -r")
    # The reference is the first case (see main).
    reference_wall = results[0].wall_s if results and results[0].ok else None
    synced_wall = walls.get("cp -r && sync")
    for r in results:
        if not r.ok:
            continue
        r.vs_dcp_to_torch_save = r.wall_s / torch_wall if torch_wall else None
        r.vs_reference = r.wall_s / reference_wall if reference_wall else None
        r.vs_copy = r.wall_s / copy_wall if copy_wall else None
        r.vs_copy_synced = r.wall_s / synced_wall if synced_wall else None


# ----------------------------------------------------------------------- exactness


class Reference:
    """torch's own reading of the source (dcp_to_torch_save's file), to check outputs by."""

    def __init__(self, path: Path, world_size: int, part: str | None = None) -> None:
        # Memory-mapped: the tensors stay in the page cache, not in this process's heap.
        self.tree = torch.load(path, mmap=True, weights_only=True)
        self.world_size = world_size
        # zero_to_fp32.py writes the model alone: an output is checked on its `part` only.
        self.part = part
        if part is not None:
            self.tree = {part: self.tree}

    def check(self, case: Case) -> str | None:
        """Return where case's output first differs from the reference, or None if equal."""
        try:
            if self.part is not None and case.layout == "full-safetensors":
                with safe_open(case.dst, "pt") as f:
                    names = [n for n in f.keys() if n.startswith(f"{self.part}.")]
                    return first_flat_difference(dict(dotted(self.tree)), names, f.get_tensor)
            if self.part is not None and case.layout != "hf":
                return first_difference(self.tree, {self.part: self._read(case)[self.part]})
            return self._check(case.layout, case.dst)
        # CheckpointException (DCP's reader failing) is a BaseException, not an Exception.
        except (Exception, CheckpointException) as e:
            # An output that cannot be read is not exact; the other cases still run.
            return f"cannot read the output: {type(e).__name__}: {str(e).splitlines()[0]}"

    def _read(self, case: Case) -> object:
        """Return a torch, DCP or fsdp2-ranks output as one tree."""
        if case.layout == "full-torch":
            return torch.load(case.dst, mmap=True, weights_only=True)
        if case.layout == "sharded":
            return load_dcp(case.dst)
        return load_fsdp2_ranks(case.dst, self.world_size)

    def _check(self, layout: str, dst: Path) -> str | None:
        if layout == "full-torch":
            return first_difference(self.tree, torch.load(dst, mmap=True, weights_only=True))
        if layout == "sharded":
            return first_difference(self.tree, load_dcp(dst))
        if layout == "local":
            return first_difference(self.tree, load_fsdp2_ranks(dst, self.world_size))
        if layout == "full-safetensors":
            # Tensors only: the tree's plain values live in shardckpt's own metadata.
            with safe_open(dst, "pt") as f:
                return first_flat_difference(dict(dotted(self.tree)), f.keys(), f.get_tensor)
        if layout == "hf":
            return first_flat_difference(dict(dotted(self.tree["model"])), *open_hf(dst))
        raise ValueError(f"no check for layout {layout!r}")


def load_dcp(path: Path) -> dict:
    """Return a DCP checkpoint read as dcp_to_torch_save reads it (without its torch.save)."""
    tree: dict = {}
    _load_state_dict(
        tree,
        storage_reader=FileSystemReader(path),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return tree


def load_fsdp2_ranks(path: Path, world_size: int) -> object:
    """Return the whole tree of rank_0.pt … rank_{M-1}.pt: each DTensor's shards joined."""
    found = sorted(p.name for p in path.glob("*.pt"))
    wanted = sorted(f"rank_{r}.pt" for r in range(world_size))
    if found != wanted:
        raise ValueError(f"rank files {found}, expected {wanted}")
    # Unpickling a DeviceMesh outside a job warns, once per file, that torch.compile
    # could not find its process groups; nothing here compiles.
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    trees = [
        torch.load(path / f"rank_{r}.pt", mmap=True, weights_only=True) for r in range(world_size)
    ]
    return join_ranks(trees)


def join_ranks(trees: list) -> object:
    """Return one tree from the same tree on every rank: DTensors become whole tensors."""
    first = trees[0]
    if isinstance(first, DTensor):
        if any(p != Shard(0) for p in first.placements):
            raise ValueError(f"placements {first.placements}: only Shard(0) can be joined")
        return torch.cat([t.to_local() for t in trees])
    if isinstance(first, Mapping):
        return {k: join_ranks([t[k] for t in trees]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(join_ranks([t[i] for t in trees]) for i in range(len(first)))
    # Plain tensors and values are the same on every rank: rank 0's stand for all.
    return first


def open_hf(path: Path) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """Return the tensor names of a Hugging Face directory and a reader of one tensor."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shards: dict[str, object] = {}

    def read(name: str) -> torch.Tensor:
        shard = weight_map[name]
        if shard not in shards:
            shards[shard] = safe_open(path / shard, "pt")
        return shards[shard].get_tensor(name)

    return list(weight_map), read


def dotted(tree: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (dotted path, tensor) for every tensor in tree, the names safetensors gets."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from dotted(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from dotted(value, f"{prefix}.{i}" if prefix else str(i))


def first_flat_difference(
    ref: dict[str, torch.Tensor], names: Iterable[str], read: Callable[[str], torch.Tensor]
) -> str | None:
    """Return the first difference between ref and the tensors read by name, or None."""
    names = list(names)
    if set(names) != set(ref):
        return key_difference(set(ref), set(names), "")
    for name in names:
        difference = first_difference(ref[name], read(name), name)
        if difference:
            return difference
    return None


def first_difference(ref: object, out: object, path: str = "") -> str | None:
    """Return where and how out differs from ref (tensors bit for bit), or None."""
    where = path or "the top level"
    if isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor):
        if (ref.dtype, ref.shape) != (out.dtype, out.shape):
            return f"{where}: {ref.dtype} {list(ref.shape)} vs {out.dtype} {list(out.shape)}"
        return None if same_bits(ref, out) else f"{where}: values differ"
    if isinstance(ref, Mapping) and isinstance(out, Mapping):
        if set(ref) != set(out):
            return key_difference(set(ref), set(out), path)
        for key in ref:
            difference = first_difference(ref[key], out[key], f"{path}.{key}" if path else key)
            if difference:
                return difference
        return None
    if type(ref) is not type(out):
        return f"{where}: {type(ref).__name__} vs {type(out).__name__}"
    if isinstance(ref, (list, tuple)):
        if len(ref) != len(out):
            return f"{where}: {len(ref)} items vs {len(out)}"
        for i, (a, b) in enumerate(zip(ref, out)):
            difference = first_difference(a, b, f"{path}.{i}" if path else str(i))
            if difference:
                return difference
        return None
    both_nan = isinstance(ref, float) and ref != ref and out != out
    return None if ref == out or both_nan else f"{where}: {ref!r} vs {out!r}"


def key_difference(ref: set, out: set, path: str) -> str:
    """Return which keys only the reference or only the output has under path."""
    missing, extra = sorted(map(str, ref - out)), sorted(map(str, out - ref))
    parts = [f"missing {missing[:3]}" if missing else "", f"extra {extra[:3]}" if extra else ""]
    return f"{path or 'the top level'}: " + ", ".join(p for p in parts if p)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return whether two tensors of one dtype and shape hold the same bytes."""
    # Bytes rather than torch.equal: -0.0 must differ from 0.0, and a NaN equal itself.
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ------------------------------------------------------------------------- source


def ensure_source(workdir: Path, size_gb: float) -> Path:
    """Return a DCP checkpoint of size_gb in workdir, building it if it is not there."""
    src = workdir / f"dcp-{size_gb:g}gb"
    if (src / ".metadata").is_file():
        log(f"reusing {src}")
        return src
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"building {src} with {BUILD_NPROC} ranks ...")
    argv = [*TORCHRUN, f"--nproc-per-node={BUILD_NPROC}", str(SCRIPTS / "bench_make_ckpt.py")]
    env = {**os.environ, **TORCHRUN_ENV}
    # stdout is kept for the table or JSON document.
    subprocess.run(
        [*argv, str(src), f"--size-gb={size_gb}"], cwd=ROOT, env=env, stdout=sys.stderr, check=True
    )
    return src


def largest_tensor(src: Path) -> tuple[str, int]:
    """Return the dotted path and byte size of the source's largest tensor (from .metadata)."""
    metadata = FileSystemReader(src).read_metadata().state_dict_metadata
    sizes = {
        path: entry.size.numel() * entry.properties.dtype.itemsize
        for path, entry in metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    path = max(sizes, key=sizes.__getitem__)
    return path, sizes[path]


def tree_bytes(path: Path) -> int:
    """Return the total size of the files under path (or of path itself)."""
    if path.is_file():
        return path.stat().st_size
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    """Delete a file or directory tree if it exists."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def cleanup(paths: Iterable[Path], workdir: Path) -> None:
    """Delete paths, and workdir if that leaves it empty."""
    # Only what this script wrote: --workdir may name a directory holding other things.
    for path in paths:
        remove(path)
    try:
        workdir.rmdir()
    except OSError:
        pass


# ------------------------------------------------------------------------- report


def environment(workdir: Path | None = None) -> dict[str, object]:
    """Return what the numbers depend on besides the code."""
    mem_total_kib = read_keyed_kib(Path("/proc/meminfo")).get("MemTotal", 0)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "ram_gib": round(mem_total_kib / 2**20, 1),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "commit": git_commit(),
        "workdir_fs": filesystem(workdir) if workdir else "?",
    }


def filesystem(path: Path) -> str:
    """Return the type of the filesystem path lies on (tmpfs, ext4, ...), from /proc/mounts."""
    best, kind = "", "?"
    target = os.path.realpath(path)
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, fields[2]
    return kind


def read_keyed_kib(path: Path) -> dict[str, int]:
    """Return /proc/meminfo-style `Key:   N kB` lines as a dict of KiB."""
    return {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+)", path.read_text(), re.MULTILINE)}


def git_commit() -> str:
    """Return the checkout's commit, noting uncommitted changes to the package."""

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short=12", "HEAD").strip() or "unknown"
    # Only the code that runs counts: an edited benchmark page does not change the numbers.
    if git("status", "--porcelain", "--", "shardckpt", "pyproject.toml").strip():
        commit += " + uncommitted changes in shardckpt/"
    return commit


def header(doc: dict) -> str:
    """Return the lines above the table: machine, source, buffer, RSS target, cap."""
    env, src = doc["environment"], doc["source"]
    gib = 2**30
    lines = [
        f"machine: {env['cpus']} CPUs, {env['ram_gib']} GiB RAM, {env['machine']}, "
        f"Linux {env['kernel']}; Python {env['python']}, torch {env['torch']}; "
        f"shardckpt at {env['commit']}; WORKDIR on {env['workdir_fs']}",
        f"source: {src['bytes'] / 1e9:.3f} GB ({src['bytes'] / gib:.2f} GiB) {src['kind']} "
        f"(model + AdamW, saved by {BUILD_NPROC} ranks); largest tensor "
        f"{src['largest_tensor']} = {src['largest_tensor_bytes'] / 2**20:.1f} MiB",
        f"buffer: --buffer-size {doc['buffer_size']}; RSS target per process: buffer + 10% "
        f"of the largest tensor + 300 MiB = {doc['rss_target_bytes'] / gib:.2f} GiB",
        f"memory cap: {doc['cap']}",
        f"sharded and local outputs at M={doc['world_size']}; "
        + (
            f"median of {doc['rounds']} rounds (every case once a round, taking turns)"
            if doc.get("rounds")
            else f"best of {doc['repeat']} timed run(s)"
        )
        + f"; peak RSS: VmHWM every {SAMPLE_INTERVAL_S * 1000:.0f} ms, largest worker "
        "(N>1) or the process (N=1)",
    ]
    if doc["cap_bytes"] is not None:
        lines[3] += f"; the source is {src['bytes'] / doc['cap_bytes']:.2f}x the cap"
    return "\n".join(f"- {line}" for line in lines)


def table(results: list[Result]) -> str:
    """Return the results as a Markdown table; the ratio column is to the reference (first) case."""

    def ratio(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}x"

    lines = [
        f"| case | N | threads | layout | wall s | GB/s | CPU s | CPU s/GB | × cp -r "
        f"| × cp -r && sync | × {results[0].case} | peak RSS/process GiB | capped | result | exact |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in results:
        layout = r.layout if r.world_size is None else f"{r.layout} (M={r.world_size})"
        speed = f"{r.gb_per_s:.2f}" if r.ok else "–"
        threads = (
            "–" if r.case in COPY_CASES or r.case == results[0].case else r.threads or "default"
        )
        lines.append(
            f"| {r.case} | {r.nproc} | {threads} | {layout} | {r.wall_s:.2f} | {speed} "
            f"| {r.cpu_s:.2f} | {r.cpu_s_per_gb:.2f} | {ratio(r.vs_copy)} | {ratio(r.vs_copy_synced)} | {ratio(r.vs_reference)} "
            f"| {r.peak_rss_gib:.2f} "
            f"| {r.capped} | {r.outcome} | {r.exact} |"
        )
    return "\n".join(lines)


def log(message: str) -> None:
    """Print a progress line to stderr, keeping stdout for the table or JSON."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- main


def parse_size(text: str) -> int:
    """Return the bytes a size such as 1.5GiB, 256MiB, 4GB or 1000 stands for."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].upper() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: try 1.5GiB, 256MiB or 4GB")
    return int(float(match[1]) * SIZE_UNITS[match[2].upper()])


def parse_nproc(text: str) -> list[int]:
    """Return the launch sizes of a comma-separated list such as 1,2,4,8."""
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want launch sizes >= 1, e.g. 1,2,4,8")
    return sizes


def parse_layouts(text: str) -> list[str]:
    """Return the layouts of a comma-separated list, or all of them for 'all'."""
    names = list(LAYOUTS) if text == "all" else text.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown layout {unknown[0]!r}: choose from {', '.join(LAYOUTS)} or all"
        )
    return names


def parse_args() -> argparse.Namespace:
    """Return the command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--size-gb", type=float, default=1.0, help="model + AdamW state, GB (default 1.0)")
    add(
        "--nproc",
        type=parse_nproc,
        default=[1, 2],
        help="launch sizes N (default 1,2; 1: no torchrun)",
    )
    add(
        "--layouts",
        type=parse_layouts,
        default=list(LAYOUTS),
        help=f"comma-separated: {', '.join(LAYOUTS)} (default all)",
    )
    add("--world-size", type=int, default=4, help="M of the sharded and local outputs (default 4)")
    add(
        "--mem-cap", type=parse_size, help="memory cgroup limit of each shardckpt case, e.g. 1.5GiB"
    )
    add("--buffer-size", default="256MiB", help="passed to shardckpt convert (default 256MiB)")
    add("--workdir", type=Path, default=ROOT / ".bench")
    add(
        "--tmpfs",
        action="store_true",
        help=f"WORKDIR on tmpfs ({TMPFS}/shardckpt-bench): no disk in the numbers, only CPU",
    )
    add(
        "--threads",
        type=parse_nproc,
        help="shardckpt's --threads, one case per count, e.g. 1,2,4 (default: its own default)",
    )
    add(
        "--rounds",
        type=int,
        default=0,
        help="run the cases R times taking turns and report each one's median (paired runs)",
    )
    add("--keep", action="store_true", help="keep the source checkpoint for the next run")
    add("--warmup", action="store_true", help="run each case once untimed")
    add("--repeat", type=int, default=1, help="timed runs per case; the fastest is reported")
    add("--json", action="store_true", help="print one JSON document")
    add(
        "--source",
        choices=("dcp", "deepspeed"),
        default="dcp",
        help="dcp: an FSDP2 DCP checkpoint (default); deepspeed: a ZeRO-2 bf16 run, "
        "against zero_to_fp32.py (needs deepspeed)",
    )
    args = parser.parse_args()
    if args.size_gb <= 0:
        parser.error(f"--size-gb must be positive, got {args.size_gb}")
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.rounds < 0:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.tmpfs:
        if not TMPFS.is_dir():
            parser.error(f"--tmpfs: there is no {TMPFS} on this machine; pass --workdir")
        args.workdir = TMPFS / "shardckpt-bench"
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    try:
        args.buffer_bytes = parse_size(args.buffer_size)
    except argparse.ArgumentTypeError as e:
        parser.error(f"--buffer-size: {e}")
    return args


def main() -> int:
    """Run the benchmark; return 0 when every case succeeded exactly, else 1."""
    args = parse_args()
    workdir = args.workdir.resolve()
    cap = probe_cap(args.mem_cap)
    if cap.unavailable:
        log(f"cap unavailable: {cap.unavailable}; the shardckpt cases run uncapped")
    deepspeed = args.source == "deepspeed"
    try:
        if deepspeed:
            src = bench_deepspeed.ensure_source(workdir, args.size_gb, TORCHRUN, log)
        else:
            src = ensure_source(workdir, args.size_gb)
    except subprocess.CalledProcessError as e:
        log(f"building the source checkpoint failed (exit {e.returncode}); output above")
        return 1
    src_bytes = tree_bytes(src)
    largest_path, largest_bytes = (
        bench_deepspeed if deepspeed else sys.modules[__name__]
    ).largest_tensor(src)
    log(f"source: {src} ({src_bytes / 1e9:.3f} GB, largest tensor {largest_bytes} B)")

    ref_case, *copy_cases = reference_cases(src, workdir, args.source)
    convert_cases = [
        shardckpt_case(src, workdir, n, layout, args, threads)
        for n in args.nproc
        for layout in args.layouts
        for threads in args.threads or [None]
    ]
    results = []
    try:
        results.append(run_case(ref_case, args, src_bytes, cap, check=None))
        if results[0].ok:
            results[0].exact = "ref"
            if deepspeed:
                ref_file = ref_case.dst / bench_deepspeed.REFERENCE_FILE
                reference = Reference(ref_file, args.world_size, part="model")
            else:
                reference = Reference(ref_case.dst, args.world_size)
            check = reference.check
        else:
            log(f"{ref_case.name} failed: outputs cannot be checked (exact: –)")
            check = None
        if args.rounds:
            results += in_rounds([*copy_cases, *convert_cases], args, src_bytes, cap, check)
        else:
            for copy_case in copy_cases:
                results.append(run_case(copy_case, args, src_bytes, cap, check=None))
                remove(copy_case.dst)
            for case in convert_cases:
                results.append(run_case(case, args, src_bytes, cap, check=check))
                remove(case.dst)
    finally:
        outputs = [ref_case.dst, *(c.dst for c in [*copy_cases, *convert_cases])]
        sources = [] if args.keep else [src, src.with_name(src.name + ".partial")]
        cleanup([*outputs, *sources], workdir)
    add_ratios(results)

    doc = {
        "environment": environment(workdir),
        "source": {
            "kind": "DeepSpeed ZeRO-2 bf16 run" if deepspeed else "FSDP2 DCP checkpoint (fp32)",
            "path": str(src),
            "bytes": src_bytes,
            "largest_tensor": largest_path,
            "largest_tensor_bytes": largest_bytes,
        },
        "buffer_size": args.buffer_size,
        "rss_target_bytes": args.buffer_bytes + largest_bytes // 10 + RSS_SLACK_BYTES,
        "cap": cap.describe(),
        "cap_bytes": args.mem_cap,
        "cap_applied": cap.applies,
        "world_size": args.world_size,
        "repeat": args.repeat,
        "rounds": args.rounds,
        "results": [asdict(r) | {"result": r.outcome} for r in results],
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(header(doc) + "\n")
        print(table(results))
    return 0 if all(r.ok and r.exact != "no" for r in results) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--scale"]:
        # The scale axis (many small tensors, many target ranks): its own cases and table.
        import bench_scale

        sys.exit(bench_scale.main(sys.argv[2:]))
    if sys.argv[1:2] == ["--s3"]:
        # SRC and DST on S3 (a moto server on loopback): against copying and download-convert-upload.
        import bench_s3

        sys.exit(bench_s3.main(sys.argv[2:]))
    sys.exit(main())
