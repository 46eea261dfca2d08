"""End to end: what one rank alone sees or suffers under a real torchrun (issue 30, items 6, 14, 16).

Each rank runs through ``ranks.sh``: in a mount namespace of its own (``unshare -m``,
root only), it may see its "node's" copy of SRC at the path every rank is given, or DST's
directory read-only, and its stderr goes to a file of its own, so a test can say which
rank printed a line. A ``sitecustomize`` on the ranks' PYTHONPATH sends SIGTERM at a
named step of the run (``SIGNAL_HOOK``), so each timing is hit every time, not by luck.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import warm_cli

# ranks.sh ERRS NODES AT RO CMD...: run CMD as one rank, its stderr into ERRS/rank$RANK.err;
# with NODES, the rank sees NODES/node$RANK at AT; the rank numbered RO sees AT read-only.
RANKS_SH = """\
exec unshare -m --propagation private bash -c '
    errs=$1 nodes=$2 at=$3 ro=$4
    shift 4
    if [ -n "$nodes" ]; then mount --bind "$nodes/node$RANK" "$at" || exit 97; fi
    if [ "$ro" = "$RANK" ]; then
        mount --bind "$at" "$at" && mount -o remount,ro,bind "$at" || exit 97
    fi
    exec "$@" 2>"$errs/rank$RANK.err"' _ "$@"
"""

# Imported by each rank's interpreter at start-up (site.py): at step POINT of the run, the
# rank RANK sends SIGTERM to WHOM (itself, the other ranks, or torchrun's agent), once.
# Several POINT:RANK:WHOM, comma-separated, each fire once where they say.
# With SHARDCKPT_TEST_LINGER=RANK:SECONDS, that rank waits so long once every rank has
# agreed the run failed, before it unwinds: the signal then reaches it on its way out.
SIGNAL_HOOK = """\
import contextlib, os, signal, time

if "SHARDCKPT_TEST_LINGER" in os.environ:
    from shardckpt.core import dist

    lingering, seconds = os.environ["SHARDCKPT_TEST_LINGER"].split(":")
    agree = dist.Runtime.raise_if_any_failed

    def lingered(self, error):
        try:
            return agree(self, error)
        except BaseException:
            if os.environ.get("RANK") == lingering:
                time.sleep(float(seconds))
            raise

    dist.Runtime.raise_if_any_failed = lingered


def firing(rank, whom):
    fired = []

    def fire():
        if fired or os.environ.get("RANK") != rank:
            return
        fired.append(True)
        if whom == "self":
            pids = [os.getpid()]
        elif whom == "agent":
            pids = [os.getppid()]
        else:  # the other ranks: the agent's other children
            agent = os.getppid()
            with open(f"/proc/{agent}/task/{agent}/children") as f:
                pids = [int(p) for p in f.read().split() if int(p) != os.getpid()]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)

    return fire


from shardckpt.core import costs, destination, signals


def hook(point, fire):
    if point in ("write", "finish"):  # entering that phase of the conversion
        phase = costs.Costs.phase

        @contextlib.contextmanager
        def hooked(self, name):
            if name == point:
                fire()
            with phase(self, name):
                yield

        costs.Costs.phase = hooked
    elif point == "rename":  # the rank that renames DST into place, before it does
        rename = destination.Destination._commit

        def hooked(self):
            fire()
            return rename(self)

        destination.Destination._commit = hooked
    elif point == "cleanup":  # the rank that removes the partial output of a failed run, as it does
        close, remove = destination.Destination.close, destination._remove
        closing = []

        def hooked_close(self):
            closing.append(True)
            return close(self)

        def hooked(path):
            if closing:
                fire()
            return remove(path)

        destination.Destination.close = hooked_close
        destination._remove = hooked
    elif point == "closed":  # a failed run's partial output removed, on its way out
        close = destination.Destination.close

        def hooked(self):
            close(self)
            if not self.committed:
                fire()

        destination.Destination.close = hooked
    elif point == "after":  # DST is in place
        complete = signals.completed

        def hooked(what):
            complete(what)
            fire()

        signals.completed = hooked


for spec in os.environ["SHARDCKPT_TEST_SIGNAL"].split(","):
    point, rank, whom = spec.split(":")
    hook(point, firing(rank, whom))
"""


def _can_unshare() -> bool:
    probe = ["unshare", "-m", "--propagation", "private", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe).returncode == 0


needs_namespaces = pytest.mark.skipif(
    not _can_unshare(), reason="cannot make a mount namespace here (unshare -m needs root)"
)


class Launch:
    """A torchrun launch of 2 ranks through ``ranks.sh``, each rank's stderr kept apart."""

    def __init__(self, tmp_path: Path):
        self.dir = tmp_path / "launch"
        self.errs = self.dir / "errs"
        self.errs.mkdir(parents=True)
        (self.dir / "ranks.sh").write_text(RANKS_SH)
        (self.dir / "hook").mkdir()
        (self.dir / "hook" / "sitecustomize.py").write_text(SIGNAL_HOOK)

    def run(
        self,
        *args,
        nodes: Path | None = None,
        at: Path | None = None,
        read_only: int | None = None,
        signal_at: str | None = None,
        linger: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Return torchrun's run of ``shardckpt ARGS``, finished."""
        cmd = ["--standalone", "--nproc-per-node=2", "--no-python", "bash"]
        cmd += [str(self.dir / "ranks.sh"), str(self.errs), str(nodes or ""), str(at or "")]
        cmd += ["" if read_only is None else str(read_only)]
        cmd += [sys.executable, "-m", "shardckpt", *map(str, args)]
        env = dict(os.environ, OMP_NUM_THREADS="1", SHARDCKPT_TIMEOUT="60")
        if signal_at is not None:
            hook = str(self.dir / "hook")
            env.update(
                SHARDCKPT_TEST_SIGNAL=signal_at,
                PYTHONPATH=f"{hook}{os.pathsep}{env.get('PYTHONPATH', '')}",
            )
            if linger is not None:
                env["SHARDCKPT_TEST_LINGER"] = linger
        return warm_cli.run_torchrun(cmd, env=env, timeout=150)

    def said(self, rank: int) -> list[str]:
        """Return the lines of ours rank ``rank`` printed on stderr."""
        text = (self.errs / f"rank{rank}.err").read_text()
        return [line for line in text.splitlines() if line.startswith("shardckpt:")]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def converting(
    tmp_path: Path, src: Path, to: tuple[str, ...], **options
) -> tuple[Launch, Path, subprocess.CompletedProcess]:
    """Return the launch, DST and torchrun's run of ``convert SRC DST`` into ``tmp_path/out``.

    ``to``: DST's name in ``out``, then the options; ``options``: those of ``Launch.run``.
    """
    out = tmp_path / "out"
    out.mkdir()
    dst = out / to[0]
    launch = Launch(tmp_path)
    return launch, dst, launch.run("convert", src, dst, *to[1:], "--quiet", at=out, **options)


# ---------------------------------------------------------------- 16) the failing rank's line


@needs_namespaces
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "to",
    [
        ("out.pt", "--to", "full"),
        ("out", "--to", "sharded", "--world-size", "2"),
        ("out", "--to", "local", "--world-size", "2"),
    ],
    ids=["full torch file", "dcp", "fsdp2-ranks"],
)
def test_the_rank_that_cannot_write_prints_its_own_line_and_no_rank_says_lost_contact(
    fsdp2_ckpt, tmp_path, to
):
    launch, dst, proc = converting(tmp_path, fsdp2_ckpt.dcp, to, read_only=1)
    out = dst.parent
    assert proc.returncode == 1, proc.stderr  # torchrun's, for any failing worker
    (line,) = launch.said(1)
    assert re.fullmatch(
        rf"shardckpt: error: '{re.escape(str(out))}/\.{to[0]}\.shardckpt-partial[^']*': "
        r"writing failed \(Read-only file system\): check the disk and the filesystem it is on",
        line,
    ), line
    assert launch.said(0) == []  # rank 0 lost contact with it, and knows why: silent
    assert "lost contact" not in proc.stderr and "stalled" not in proc.stderr
    # torchrun's root-cause summary (whichever rank ended first) names rank 1's error.
    root = proc.stderr.split("Root Cause")[-1]
    said = line.removeprefix("shardckpt: error: ")
    assert re.search(rf"(rank\s*: 1 .*\n.*\n.*\n.*: |rank 1 failed: ){re.escape(said)}", root), root
    assert leftovers(out) == []


# ---------------------------------------------------------------- 6) other bytes, same size


def _node_copies(tmp_path: Path, src: Path) -> Path:
    """Return the directory of node0 and node1, each with a copy of ``src`` under its name."""
    nodes = tmp_path / "nodes"
    for node in (0, 1):
        (nodes / f"node{node}").mkdir(parents=True)
        if src.is_dir():
            shutil.copytree(src, nodes / f"node{node}" / src.name)
        else:
            shutil.copy(src, nodes / f"node{node}" / src.name)
    return nodes


def _renamed_in_metadata(file: Path) -> Path:
    """Rename a tensor in DCP's ``.metadata`` to another name of the same length."""
    raw = file.read_bytes()
    assert b"embed" in raw
    file.write_bytes(raw.replace(b"embed", b"embex"))
    return file


def _other_step(file: Path) -> Path:
    """Save ``file`` again with its ``step`` value changed (the same pickle length)."""
    tree = torch.load(file, weights_only=True)
    tree["step"] += 1
    torch.save(tree, file)
    return file


def _renamed_in_rank_files(rank_0: Path) -> Path:
    """Rename a tensor in every fsdp2-ranks file beside ``rank_0``: another save, whole in itself."""
    for file in sorted(rank_0.parent.glob("rank_*.pt")):
        _renamed_in_torch_zip(file)
    return rank_0


def _renamed_in_torch_zip(file: Path) -> Path:
    """Rename a tensor in a ``torch.save`` zip's pickle, in place, its CRC-32s made to match."""
    raw = bytearray(file.read_bytes())
    with zipfile.ZipFile(file) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data.pkl"))
    head = info.header_offset
    name_len, extra_len = struct.unpack("<HH", raw[head + 26 : head + 30])
    start = head + 30 + name_len + extra_len
    data = bytes(raw[start : start + info.file_size])
    assert b"embed" in data
    data = data.replace(b"embed", b"embex")
    raw[start : start + len(data)] = data
    crc = struct.pack("<I", zlib.crc32(data))
    raw[head + 14 : head + 18] = crc  # the local header's
    entry = raw.find(b"PK\x01\x02" + raw[head + 4 : head + 12])  # the central directory's
    while raw[entry + 46 : entry + 46 + name_len] != info.filename.encode():
        entry = raw.find(b"PK\x01\x02", entry + 4)
    raw[entry + 16 : entry + 20] = crc
    file.write_bytes(bytes(raw))
    return file


@needs_namespaces
@pytest.mark.timeout(200)
@pytest.mark.parametrize("variant", ["dcp .metadata", "torch file", "fsdp2-ranks file"])
def test_a_rank_whose_copy_of_src_has_other_metadata_of_the_same_size_stops_every_rank(
    fsdp2_ckpt, tmp_path, variant
):
    made = tmp_path / "made"
    made.mkdir()
    if variant == "dcp .metadata":
        src = shutil.copytree(fsdp2_ckpt.dcp, made / "step-2")
        change = _renamed_in_metadata
        named = ".metadata"
    elif variant == "torch file":
        src = made / "full.pt"
        torch.save({"model": torch.load(fsdp2_ckpt.ref)["model"], "step": 3}, src)
        change = _other_step
        named = ""
    else:
        src = made / "ranks"
        ok = warm_cli.run(
            ["convert", fsdp2_ckpt.dcp, src, "--to", "local", "--world-size", "2", "-q"]
        )
        assert ok.returncode == 0, ok.stderr
        change = _renamed_in_rank_files
        named = "rank_0.pt"
    nodes = _node_copies(tmp_path, src)
    theirs = nodes / "node1" / src.name
    changed = change(theirs / named if named else theirs)
    mine = nodes / "node0" / src.name / named if named else nodes / "node0" / src.name
    assert changed.stat().st_size == mine.stat().st_size  # the sizes agree: only bytes differ
    assert changed.read_bytes() != mine.read_bytes()
    at = tmp_path / "src"  # empty here; each rank sees its node's copy of SRC in it
    at.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    launch = Launch(tmp_path)
    seen = at / src.name
    proc = launch.run(
        "convert", seen, out / "full.pt", "--to", "full", "--verify", nodes=nodes, at=at
    )
    assert proc.returncode == 1, proc.stderr
    path = seen / named if named else seen
    assert launch.said(0) == [
        f"shardckpt: error: '{path}': holds other metadata on rank 1 than on rank 0, which "
        "read another copy of it: a DST planned from both would mix them: the ranks' copies "
        "of SRC differ; copy it again from where the job saved it"
    ]
    assert launch.said(1) == []
    # Every rank stopped with exit 3 (bad input), as torchrun's summary of each says.
    codes = re.findall(r"exitcode\s*: (\d+)", proc.stderr)
    assert codes and set(codes) == {"3"}, proc.stderr
    assert leftovers(out) == [] and leftovers(at) == []


# ---------------------------------------------------------------- 14) SIGTERM late in a run

TO_FULL = ("full.pt", "--to", "full")
TO_SHARDED = ("resharded", "--to", "sharded", "--world-size", "3", "--verify")

# (step, the rank that reaches it and signals, whom it signals, the conversion)
BEFORE_DST = [
    ("write", "1", "self", TO_FULL),
    ("write", "0", "agent", TO_SHARDED),
    ("finish", "1", "self", TO_SHARDED),
    ("finish", "0", "other", TO_FULL),
    ("finish", "1", "agent", TO_FULL),
]
AFTER_DST = [
    ("rename", "0", "self", TO_FULL),
    ("rename", "0", "other", TO_SHARDED),
    ("rename", "0", "agent", TO_FULL),
    ("after", "1", "self", TO_SHARDED),
    ("after", "0", "other", TO_FULL),
    ("after", "0", "agent", TO_SHARDED),
]


def _case_id(case) -> str:
    step, rank, whom, to = case
    return f"{step} on rank {rank} to {whom}, {to[2]}"


@needs_namespaces
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", BEFORE_DST, ids=map(_case_id, BEFORE_DST))
def test_sigterm_before_dst_is_in_place_leaves_no_dst_partial_or_lock(fsdp2_ckpt, tmp_path, case):
    step, rank, whom, to = case
    launch, dst, proc = converting(tmp_path, fsdp2_ckpt.dcp, to, signal_at=f"{step}:{rank}:{whom}")
    assert_interrupted_and_not_written(launch, dst, proc)


def assert_interrupted_and_not_written(launch: Launch, dst: Path, proc) -> None:
    """Torchrun failed; rank 0 alone said the run was interrupted and DST not written; nothing left."""
    assert proc.returncode == 1, proc.stderr
    # Rank 0 says it once; "on rank 1" when rank 0 learnt it from rank 1 before its own came.
    (line,) = launch.said(0)
    assert re.fullmatch(
        rf"shardckpt: interrupted by SIGTERM( on rank 1)?: '{re.escape(str(dst))}' was not written",
        line,
    ), line
    assert launch.said(1) == []
    assert leftovers(dst.parent) == []


@needs_namespaces
@pytest.mark.timeout(200)
def test_the_agents_sigterm_once_rank_0_removed_its_partial_output_keeps_its_line(
    fsdp2_ckpt, tmp_path
):
    # Rank 1 stops as it enters `finish`; rank 0's collective fails, it removes its
    # partial output and unwinds, where torchrun's SIGTERM (rank 1 has exited) reaches
    # it: made certain here by rank 0 signalling itself once its partial output is gone.
    # It was seen once in 31 runs as a bare "interrupted by SIGTERM", the new signal's,
    # without what became of DST.
    spec = "finish:1:self,closed:0:self"
    launch, dst, proc = converting(tmp_path, fsdp2_ckpt.dcp, TO_SHARDED, signal_at=spec)
    assert_interrupted_and_not_written(launch, dst, proc)


@needs_namespaces
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", AFTER_DST, ids=map(_case_id, AFTER_DST))
def test_sigterm_once_dst_is_being_put_in_place_fails_nothing(fsdp2_ckpt, tmp_path, case):
    step, rank, whom, to = case
    launch, dst, proc = converting(tmp_path, fsdp2_ckpt.dcp, to, signal_at=f"{step}:{rank}:{whom}")
    out = dst.parent
    if whom != "agent":  # torchrun's agent, signalled itself, exits non-zero whatever its ranks did
        assert proc.returncode == 0, proc.stderr
    note = (
        f"shardckpt: note: SIGTERM came after '{dst}' was complete: the conversion finished, exit 0"
    )
    signalled_0 = whom == "agent" or (rank == "0") == (whom == "self")
    assert launch.said(0) == ([note] if signalled_0 else [])
    assert launch.said(1) == []
    assert leftovers(out) == [dst.name]
    assert warm_cli.run(["diff", fsdp2_ckpt.dcp, dst]).returncode == 0


@needs_namespaces
@pytest.mark.timeout(200)
@pytest.mark.parametrize("whom", ["self", "agent"])
@pytest.mark.parametrize("to", [TO_FULL, TO_SHARDED], ids=["full", "sharded"])
def test_sigterm_while_a_failed_run_removes_its_partial_output_leaves_neither_it_nor_the_lock(
    fsdp2_ckpt, tmp_path, to, whom
):
    # What torchrun does once a rank fails: SIGTERM to the others, which are cleaning up.
    # The failing rank lingers after the failure is agreed, so the agent's SIGTERM (sent
    # once rank 0 or the agent is stopped) comes before it printed its line, every time.
    launch, dst, proc = converting(
        tmp_path,
        fsdp2_ckpt.dcp,
        to,
        read_only=1,
        signal_at=f"cleanup:0:{whom}",
        linger="1:3",
    )
    out = dst.parent
    assert proc.returncode == 1, proc.stderr
    (line,) = launch.said(1)  # the failing rank's own line, alone
    assert line.startswith(f"shardckpt: error: '{out}/.{dst.name}.shardckpt-partial"), line
    assert "writing failed (Read-only file system)" in line, line
    assert launch.said(0) == []  # stopped because rank 1 failed: its line says why
    assert leftovers(out) == []
