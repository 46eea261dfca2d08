"""A signal that Python wraps in another exception still ends the run as interrupted.

Seen in CI (Python 3.11): SIGTERM arrived while a module imported mid-run defined a
dataclass, inside its fields' ``__set_name__``; Python 3.11 turns what ``__set_name__``
raises into ``RuntimeError: Error calling __set_name__ ...``, and the run said
"internal error", exit 4, where it was stopped by the signal: 143.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardckpt.cli.app import run
from shardckpt.core import destination
from shardckpt.core.signals import Interrupted, behind


class _SignalsWhileNamed:
    """A class attribute that sends ``signum`` to this process while its class is made."""

    def __init__(self, signum: int):
        self.signum = signum

    def __set_name__(self, owner, name):
        os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_inside_set_name_ends_the_run_as_interrupted(
    capsys, monkeypatch, tmp_path, signum
):
    src, dst = tmp_path / "src.pt", tmp_path / "out.pt"
    torch.save({"w": torch.arange(6.0)}, src)
    opened = destination.Destination.open

    def open_then_define_a_class(self):
        opened(self)
        type("DefinedMidRun", (), {"field": _SignalsWhileNamed(signum)})

    monkeypatch.setattr(destination.Destination, "open", open_then_define_a_class)
    code = run(["convert", str(src), str(dst), "--to", "full"])
    err = capsys.readouterr().err.strip().splitlines()
    name = signal.Signals(signum).name
    assert (code, err) == (
        128 + signum,
        [f"shardckpt: interrupted by {name}: '{dst}' was not written"],
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]


def test_an_error_raised_while_a_signal_unwinds_the_run_leaves_it_interrupted(
    capsys, monkeypatch, tmp_path
):
    # A cleanup step that fails on the way out (its OSError's context is the signal)
    # does not turn the interruption into an I/O error.
    src, dst = tmp_path / "src.pt", tmp_path / "out.pt"
    torch.save({"w": torch.arange(6.0)}, src)
    opened, closed = destination.Destination.open, destination.Destination.close

    def open_then_signal(self):
        opened(self)
        os.kill(os.getpid(), signal.SIGTERM)

    def close_then_fail(self):
        closed(self)
        raise OSError(5, "Input/output error", str(dst))

    monkeypatch.setattr(destination.Destination, "open", open_then_signal)
    monkeypatch.setattr(destination.Destination, "close", close_then_fail)
    code = run(["convert", str(src), str(dst), "--to", "full"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (code, err) == (143, [f"shardckpt: interrupted by SIGTERM: '{dst}' was not written"])


def test_behind_finds_the_signal_through_causes_and_contexts():
    signalled = Interrupted(signal.SIGTERM)
    try:
        try:
            raise signalled
        except Interrupted as exc:
            try:
                raise RuntimeError("wrapped") from exc
            except RuntimeError:
                raise ValueError("while handling it")  # noqa: B904
    except ValueError as outer:
        assert behind(outer) is signalled
    assert behind(ValueError("no signal")) is None
