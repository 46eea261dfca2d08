"""Signals, kills, a second run, a stalled or dead rank: real processes, real files.

Standalone runs are processes forked from a warm interpreter (``warm_cli``) except where
the interpreter's start-up is what is tested (Ctrl-C while torch is imported); runs
under torchrun are real torchrun launches, the agent forked warm and the ranks fresh.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_cli
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

BIG_FLOATS = 24 * 2**20  # 96 MiB: long enough a run to be caught in the middle


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """Return a 96 MiB torch.save checkpoint in a directory of its own."""
    path = tmp_path_factory.mktemp("big") / "big.pt"
    torch.save({"model": {"w": torch.arange(BIG_FLOATS, dtype=torch.float32)}}, path)
    return path


def shardckpt(*argv, env=None) -> warm_cli.WarmProcess:
    """Start ``python -m shardckpt ARGV`` in its own process, forked warm (``warm_cli``)."""
    return warm_cli.start(argv, env=dict(os.environ, **(env or {})))


def fresh_shardckpt(*argv) -> subprocess.Popen:
    """Start ``python -m shardckpt ARGV`` in a fresh interpreter: its start-up is the test."""
    return subprocess.Popen(
        [sys.executable, "-m", "shardckpt", *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def torchrun(nproc: int, *argv, env=None, through: Path | None = None) -> warm_cli.WarmProcess:
    """Start ``torchrun --nproc-per-node NPROC -m shardckpt ARGV`` (each rank through bash script ``through``).

    The agent forks warm (``warm_cli``); its ranks are fresh interpreters.
    """
    cmd = ["--standalone", f"--nproc-per-node={nproc}"]
    if through is not None:
        cmd += ["--no-python", "bash", str(through), sys.executable]
    cmd += ["-m", "shardckpt", *map(str, argv)]
    return warm_cli.start_torchrun(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Wait until ``path`` exists (the run is writing), failing if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"ended before writing: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """Return the exit code and stderr of ``proc`` once it ends."""
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_mid_run_removes_the_partial_output_and_the_lock(big, tmp_path, sig):
    dst = tmp_path / "out.safetensors"
    proc = shardckpt("convert", big, dst, "--to", "full", "--verify", "--buffer-size", "4MiB")
    wait_for(tmp_path / ".out.safetensors.shardckpt-partial", proc)
    proc.send_signal(sig)
    code, err = finish(proc)
    assert code == 128 + sig, err
    assert err.splitlines() == [f"shardckpt: interrupted by {sig.name}: '{dst}' was not written"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(150)
def test_sigterm_to_torchrun_leaves_nothing_behind(big, tmp_path):
    dst = tmp_path / "out"
    proc = torchrun(2, "convert", big, dst, "--to", "sharded", "--world-size", "4")
    wait_for(tmp_path / ".out.shardckpt-partial", proc)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code != 0
    # torchrun's agent prints its own SignalException stack; no frame is ours, and rank 0
    # says what became of DST.
    assert f"shardckpt: interrupted by SIGTERM: '{dst}' was not written" in err.splitlines(), err
    assert "/shardckpt/" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_the_leftovers_of_a_killed_run_are_removed_by_the_next_run_in_that_directory(big, tmp_path):
    proc = shardckpt("convert", big, tmp_path / "out.pt", "--to", "full", "--buffer-size", "4MiB")
    partial = tmp_path / ".out.pt.shardckpt-partial"
    wait_for(partial, proc)
    proc.kill()
    assert finish(proc)[0] == -signal.SIGKILL
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".out.pt.shardckpt-lock",
        ".out.pt.shardckpt-partial",
    ]
    small = tmp_path.parent / f"{tmp_path.name}-small.pt"
    torch.save({"w": torch.ones(3)}, small)
    code, err = finish(shardckpt("convert", small, tmp_path / "other.pt", "--to", "full", "-q"))
    assert code == 0
    assert err.splitlines() == [
        f"shardckpt: note: removed '{partial}', the partial output of a shardckpt run that was killed"
    ]
    # The dead run's lock file went with it: whoever takes a lock removes its file after.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pt"]


@pytest.mark.timeout(150)
def test_two_runs_to_one_dst_never_leave_it_missing_mixed_or_half_written(tmp_path):
    srcs = []
    for name, value in (("a", 1.0), ("b", 2.0)):
        srcs.append(tmp_path / f"{name}.pt")
        torch.save({"w": torch.full((2**21,), value)}, srcs[-1])
    dst = tmp_path / "out" / "ckpt"
    outcomes = set()
    for _ in range(3):
        procs = [
            shardckpt(
                "convert", src, dst, "--to", "sharded", "--world-size", "1", "--overwrite", "-q"
            )
            for src in srcs
        ]
        results = [finish(p) for p in procs]
        for code, err in results:
            assert code in (0, 4), err
            if code == 4:
                # A run that took the lock after planning may have said a note first.
                said = [ln for ln in err.splitlines() if not ln.startswith("shardckpt: note:")]
                assert said == [
                    f"shardckpt: error: '{dst}': is being written by another shardckpt run ("
                    + err.split("run (", 1)[1].split(")", 1)[0]
                    + "): wait for that run to finish, or write to another DST"
                ]
            outcomes.add(code)
        assert 0 in [code for code, _ in results]
        dcp_to_torch_save(dst, tmp_path / "check.pt")  # torch's own reader of a DCP directory
        got = torch.load(tmp_path / "check.pt")["w"]
        assert torch.equal(got, torch.full((2**21,), 1.0)) or torch.equal(
            got, torch.full((2**21,), 2.0)
        )
        assert sorted(p.name for p in dst.parent.iterdir()) == ["ckpt"]


STALL = """
import os, time
import torch

def stalls_on_rank_1():
    if os.environ.get("RANK") == "1":
        time.sleep(300)
    return torch.nn.Linear(3, 7)

def dies_on_rank_1():
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), 9)
    return torch.nn.Linear(3, 7)
"""


@pytest.fixture
def stalling(tmp_path):
    (tmp_path / "stall_model.py").write_text(STALL)
    torch.save({"model": {"weight": torch.ones(7, 3), "bias": torch.ones(7)}}, tmp_path / "s.pt")
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.timeout(150)
def test_a_stalled_rank_ends_the_run_within_the_timeout_with_one_line(tmp_path, stalling):
    env = dict(stalling, SHARDCKPT_TIMEOUT="5")
    argv = ["convert", tmp_path / "s.pt", tmp_path / "o.pt", "--to", "full"]
    start = time.monotonic()
    proc = torchrun(2, *argv, "--model", "stall_model:stalls_on_rank_1", env=env)
    code, err = finish(proc)
    elapsed = time.monotonic() - start
    assert code != 0
    # torchrun's own ChildFailedError stack follows any failure; no frame in it is ours.
    assert "/shardckpt/" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("shardckpt: error:")]
    assert errors == [
        "shardckpt: error: rank 0 waited 5 s for the other ranks and gave up: a rank stalled or "
        "died (its error, if any, is above); raise SHARDCKPT_TIMEOUT if a rank is only slow"
    ]
    assert "gloo" not in err.lower() and "GLHF" not in err, err
    # torchrun and two interpreters start in ~10 s here; the wait itself is the 5 s asked for.
    assert elapsed < 45, elapsed
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.timeout(150)
def test_a_rank_that_dies_gives_the_survivor_one_line_not_a_traceback(tmp_path, stalling):
    argv = ["convert", tmp_path / "s.pt", tmp_path / "o.pt", "--to", "full"]
    proc = torchrun(2, *argv, "--model", "stall_model:dies_on_rank_1", env=stalling)
    code, err = finish(proc)
    assert code != 0
    assert "/shardckpt/" not in err, err
    assert not (tmp_path / "o.pt").exists()


# Runs the command it is given; on rank 1 the worker then stays up, as a rank on another
# node looks to this node's torchrun: its process is gone, and no agent here noticed.
OUTLIVE = '"$@"\ncode=$?\n[ "$RANK" = 1 ] && exec sleep 120\nexit $code\n'

# What gloo says of a peer that went away, once its own text is cut to the cause.
PEER_GONE = (
    r"Read error \[127\.0\.0\.1\]:\d+: Connection reset by peer"
    r"|Connection closed by peer \[127\.0\.0\.1\]:\d+"
)


@pytest.mark.timeout(150)
def test_a_peer_that_died_unseen_gives_the_survivor_one_ascii_line_of_ours(tmp_path, stalling):
    # gloo's own text is a source location, then advice and an emoji ("... GLHF! ..."):
    # the survivor's line keeps only the cause, in words of its own.
    (tmp_path / "outlive.sh").write_text(OUTLIVE)
    argv = ["convert", tmp_path / "s.pt", tmp_path / "o.pt", "--to", "full"]
    argv += ["--model", "stall_model:dies_on_rank_1"]
    code, err = finish(torchrun(2, *argv, env=stalling, through=tmp_path / "outlive.sh"))
    assert code != 0
    assert "/shardckpt/" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("shardckpt: error:")]
    assert len(errors) == 1, err
    line = errors[0]
    assert line.isascii() and "GLHF" not in line and ".cc:" not in line, line
    assert re.fullmatch(
        rf"shardckpt: error: rank 0 lost contact with another rank \(({PEER_GONE})\): "
        r"another rank died; its error, if it printed one, is above",
        line,
    ), line
    # No DST, no partial output, no lock file left beside it.
    assert [p.name for p in tmp_path.iterdir() if "o.pt" in p.name] == []


STARTING = ("convert", "nothing-here", "nothing.pt", "--to", "full")
"""A command that imports torch at its start (a torch DST: ``api.conversion.needs_torch``) and then stops at once (SRC is missing)."""

MISSING = (
    "shardckpt: error: 'nothing-here': no such file or directory: check the path of the checkpoint"
)


@pytest.fixture(scope="module")
def start_up() -> float:
    """Return how long ``STARTING`` runs here, to its exit 3: its start-up, torch's import most of it."""
    finish(fresh_shardckpt(*STARTING))  # the first start reads torch's files from disk
    begun = time.monotonic()
    code, err = finish(fresh_shardckpt(*STARTING))
    assert (code, err.splitlines()) == (3, [MISSING])
    return time.monotonic() - begun


@pytest.mark.timeout(120)
@pytest.mark.parametrize("part", [0.25, 0.5, 0.75])
def test_ctrl_c_while_starting_up_exits_130_with_one_line(start_up, part):
    # convert to a torch file imports torch at its start (inspect and verify of most sources,
    # and a plain safetensors export, import none).
    # The signal lands at a part of the start-up measured on this machine: a fixed delay
    # (it was 1.5 s) comes after the exit on a quiet machine, where the start takes 1.3 s.
    # A start that happens to be quicker than the measured one has exited by then (exit 3),
    # or is tearing torch down after its error: that try says nothing, and the next lands
    # at half the delay.
    delay = part * start_up
    for _ in range(4):
        proc = fresh_shardckpt(*STARTING)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        code, err = finish(proc)
        if (code, err.splitlines()) != (3, [MISSING]):
            break
        delay /= 2
    else:
        pytest.fail(f"the command exited within {delay * 2:.2f} s four times")
    assert (code, err.splitlines()) == (130, ["shardckpt: interrupted by SIGINT"])
