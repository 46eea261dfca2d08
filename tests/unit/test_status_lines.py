"""A line where silence would puzzle (issue 23, item 6): planning, and a launch larger than its work.

On a terminal, a conversion whose metadata reading and planning keep it silent for more
than a second says what it is doing, a line per phase; quick work says nothing, and
neither does a log. Under torchrun, more processes than target ranks, or more CPU ranks
than cores, is said once.
"""

from __future__ import annotations

import time

import pytest
import torch

from shardckpt.api import conversion
from shardckpt.api.launch_notes import crowded_cores, idle_ranks, launch_notes
from shardckpt.cli.app import run
from shardckpt.core import progress as progress_module
from shardckpt.core.dist import Runtime
from shardckpt.core.progress import Progress


def terminal_progress(after: float) -> Progress:
    """Return a Progress that acts as on a terminal (capsys's stderr is none)."""
    progress = Progress(enabled=False, desc="convert", status_after=after)
    progress.enabled = True
    return progress


def status_lines(err: str) -> list[str]:
    return [
        line for line in err.splitlines() if line.startswith("shardckpt: ") and line.endswith("...")
    ]


def test_a_silent_phase_says_what_it_is_and_later_phases_follow_at_once(capsys):
    progress = terminal_progress(0.05)
    progress.status("reading SRC's metadata")
    time.sleep(0.5)
    progress.status("planning DST for 1,024 target ranks")
    progress.close()
    assert status_lines(capsys.readouterr().err) == [
        "shardckpt: reading SRC's metadata...",
        "shardckpt: planning DST for 1,024 target ranks...",
    ]


def test_quick_work_says_nothing(capsys):
    progress = terminal_progress(0.3)
    progress.status("reading SRC's metadata")
    progress.status("planning DST")
    progress.close()
    time.sleep(0.6)
    assert capsys.readouterr().err == ""


def test_a_log_gets_no_status_line(capsys):
    progress = Progress(enabled=True, status_after=0.0)  # stderr is no terminal here
    progress.status("reading SRC's metadata")
    time.sleep(0.2)
    progress.close()
    assert capsys.readouterr().err == ""


def test_a_slow_plan_on_a_terminal_says_so(capsys, monkeypatch, tmp_path):
    torch.save({"w": torch.ones(8, 3)}, tmp_path / "w.pt")
    monkeypatch.setattr(progress_module, "STATUS_AFTER_S", 0.05)
    monkeypatch.setattr(progress_module.sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.delenv("CI", raising=False)  # CI keeps its logs free of terminal lines
    make_plan = conversion.make_plan
    said = []

    def slow_plan(*args, **kwargs):
        # What thousands of target ranks cost: long enough for the status line to be said,
        # however late a loaded machine runs its timer.
        deadline = time.monotonic() + 30
        while not any("planning DST" in e for e in said) and time.monotonic() < deadline:
            time.sleep(0.05)
            said.append(capsys.readouterr().err)
        return make_plan(*args, **kwargs)

    monkeypatch.setattr(conversion, "make_plan", slow_plan)
    argv = ["convert", tmp_path / "w.pt", tmp_path / "dcp", "--to", "sharded", "--world-size", "8"]
    assert run([str(a) for a in argv]) == 0
    lines = status_lines("".join(said) + capsys.readouterr().err)
    assert lines[-1] == "shardckpt: planning DST for 8 target ranks..."
    assert lines[:-1] in ([], ["shardckpt: reading SRC's metadata..."])


def test_more_processes_than_target_ranks_are_said_idle():
    assert idle_ranks(4, "sharded", 2) == (
        "4 ranks launched for --world-size 2: 2 of them have no target rank's files to write "
        "(launch --nproc-per-node 2 or fewer; the output is the same)"
    )
    assert idle_ranks(3, "local", 2).startswith(
        "3 ranks launched for --world-size 2: 1 of them has"
    )
    assert idle_ranks(2, "sharded", 2) is None and idle_ranks(16, "full", 1) is None


def test_more_cpu_ranks_than_cores_are_said_to_wait():
    assert crowded_cores(16, 2) == (
        "16 CPU ranks on this node share 2 cores, so they wait for each other (launch "
        "--nproc-per-node 2 or fewer; the output is the same)"
    )
    assert crowded_cores(2, 2) is None


def test_launch_notes_are_said_once_by_rank_0_under_torchrun(capsys, monkeypatch):
    monkeypatch.setattr("shardckpt.api.launch_notes.usable_cores", lambda: 2)
    assert launch_notes(4, "sharded", 2, "cuda") == [idle_ranks(4, "sharded", 2)]
    assert launch_notes(4, "full", 1, "cpu", local_ranks=4) == [crowded_cores(4, 2)]

    class Plan:
        layout, world_size = "sharded", 2

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for rank in (0, 1):
        conversion._note_idle_ranks(Plan(), Runtime(rank=rank, world_size=4, mesh=object()))
    assert capsys.readouterr().err.splitlines() == [
        f"shardckpt: note: {idle_ranks(4, 'sharded', 2)}",
        f"shardckpt: note: {crowded_cores(4, 2)}",
    ]
    conversion._note_idle_ranks(Plan(), Runtime())  # standalone: nothing to say
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_launch_that_fits_says_nothing(capsys, monkeypatch, world_size):
    monkeypatch.setattr("shardckpt.api.launch_notes.usable_cores", lambda: 2)
    assert launch_notes(world_size, "sharded", 2, "cpu", local_ranks=world_size) == []
