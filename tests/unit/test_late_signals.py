"""A signal just after DST is complete does not fail the conversion (issue 23, item 7).

Ctrl-C a moment after success used to exit 130 with a complete, correct DST: a script
saw a failure for a finished conversion. While DST is moved into place every signal
waits; once it is there, the first one is held until the summary is printed and the
run exits 0 with a note; a second ends the run at once, still exit 0 (DST is whole).
A signal before that still stops the run (130) and leaves no DST.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardckpt.api import conversion
from shardckpt.cli.app import run
from shardckpt.core import destination


@pytest.fixture
def src(tmp_path):
    torch.save({"model": {"w": torch.arange(21.0).reshape(7, 3)}, "step": 3}, tmp_path / "src.pt")
    return tmp_path / "src.pt"


def signals_at(monkeypatch, method: str, *signums: int) -> None:
    """Send ``signums`` to this process at the end of ``Destination.<method>``."""
    original = getattr(destination.Destination, method)

    def then_signal(self):
        original(self)
        for signum in signums:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(destination.Destination, method, then_signal)


def converted(capsys, src, dst) -> tuple[int, str, list[str]]:
    code = run(["convert", str(src), str(dst), "--to", "full"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def note(name: str, dst) -> str:
    return (
        f"shardckpt: note: {name} came after '{dst}' was complete: the conversion finished, exit 0"
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_just_after_dst_is_in_place_waits_and_exits_0(
    capsys, monkeypatch, src, tmp_path, signum
):
    signals_at(monkeypatch, "commit", signum)
    dst = tmp_path / "out.pt"
    code, out, err = converted(capsys, src, dst)
    assert (code, err) == (0, [note(signal.Signals(signum).name, dst)])
    assert out.startswith(f"wrote {dst}: 1 tensor")  # the summary was still printed
    assert torch.equal(torch.load(dst)["model"]["w"], torch.arange(21.0).reshape(7, 3))


def test_a_second_signal_ends_the_run_at_once_still_exit_0(capsys, monkeypatch, src, tmp_path):
    signals_at(monkeypatch, "commit", signal.SIGINT, signal.SIGINT)
    dst = tmp_path / "out.pt"
    code, out, err = converted(capsys, src, dst)
    assert (code, out, err) == (0, "", [note("SIGINT", dst)])
    assert torch.load(dst)["step"] == 3


def test_signals_while_dst_is_moved_into_place_wait_for_it(capsys, monkeypatch, src, tmp_path):
    # Between the renames: DST would be left moved aside, or called not written.
    signals_at(monkeypatch, "_commit", signal.SIGINT, signal.SIGTERM)
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"")  # an old DST, moved aside and removed by the commit
    code = run(["convert", str(src), str(dst), "--to", "full", "--overwrite"])
    captured = capsys.readouterr()
    assert (code, captured.err.strip().splitlines()) == (0, [note("SIGINT", dst)])
    assert captured.out.startswith(f"wrote {dst}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pt", "src.pt"]


def test_a_signal_before_dst_is_complete_still_stops_the_run(capsys, monkeypatch, src, tmp_path):
    # The last step before the ranks agree to put DST in place (from then on signals wait).
    original = conversion.check_reads

    def then_signal(*args):
        original(*args)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(conversion, "check_reads", then_signal)
    dst = tmp_path / "out.pt"
    code, out, err = converted(capsys, src, dst)
    assert (code, out, err) == (
        130,
        "",
        [f"shardckpt: interrupted by SIGINT: '{dst}' was not written"],
    )
    assert not dst.exists()


def test_the_suite_gives_its_processes_the_terminal_s_signal_defaults():
    """`nohup bash scripts/test.sh` (SIGHUP ignored) and a background job (SIGINT ignored)
    pass the signal tests: conftest restores the defaults for this process and its children.

    shardckpt keeps an ignored signal ignored, as a `nohup` user expects, so without this
    every test that sends SIGHUP or SIGINT to a shardckpt it started would fail there.
    """
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # What an exec'd child inherits: its own view of SIGHUP, from /proc (SigIgn is a mask).
    ignored = next(
        line for line in open(f"/proc/{os.getpid()}/status") if line.startswith("SigIgn:")
    )
    assert not int(ignored.split()[1], 16) & (1 << (signal.SIGHUP - 1))
