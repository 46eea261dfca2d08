"""Steps a signal must not cut in two (``signals.sheltered``): the signal waits for the step's end.

Taking DST's lock, removing a partial output and giving the lock back: a SIGTERM in the
middle (under torchrun the agent sends one to every rank as soon as one fails) would leave
the lock file or half the partial output behind (issue 30, item 14).
"""

from __future__ import annotations

import os
import signal

import pytest

from shardckpt.core.destination import Destination
from shardckpt.core.signals import Interrupted, completed, ending, interruptible, sheltered


def test_a_signal_in_a_sheltered_step_is_raised_once_the_step_is_done():
    done = []
    with interruptible(), pytest.raises(Interrupted) as raised:
        with sheltered():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("after the signal")
    assert done == ["after the signal"] and raised.value.exit_code == 143


def test_a_signal_in_the_last_steps_of_a_failing_run_leaves_its_error_to_be_reported():
    with interruptible(), pytest.raises(OSError, match="disk full"):
        try:
            raise OSError("disk full")
        finally:
            with sheltered(raising=False):
                os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_once_the_run_is_failing_leaves_its_error_to_be_reported():
    # Under torchrun the agent's SIGTERM can reach a rank still unwinding from a failure
    # every rank agreed on, before it printed its line; it is the error that ends the run.
    unwound = []
    with interruptible(), pytest.raises(OSError, match="read-only"):
        try:
            ending()
            raise OSError("read-only")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            unwound.append("past the signal")
            with sheltered():  # a sheltered step on the way out raises no held signal either
                os.kill(os.getpid(), signal.SIGINT)
            unwound.append("past the sheltered step")
    assert unwound == ["past the signal", "past the sheltered step"]


def test_a_run_after_a_failing_one_is_interruptible_again():
    with interruptible(), pytest.raises(OSError):
        ending()
        raise OSError("failed")
    with interruptible(), pytest.raises(Interrupted):
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_second_signal_in_a_sheltered_step_after_dst_is_complete_still_exits_0():
    with interruptible(), pytest.raises(Interrupted) as raised:
        completed("'out.pt'")
        with sheltered():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
    assert (raised.value.name, raised.value.exit_code) == ("SIGTERM", 0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_while_a_failed_run_removes_its_partial_output_leaves_nothing(tmp_path, sig):
    dst = Destination(tmp_path / "out", overwrite=False, is_dir=True)
    dst.open()
    (dst.tmp / "__0_0.distcp").write_bytes(b"x" * 100)
    original = os.unlink

    def signalled_unlink(path, *args, **kwargs):
        os.kill(os.getpid(), sig)  # in the middle of removing the partial output
        return original(path, *args, **kwargs)

    with interruptible(), pytest.raises(OSError, match="the run failed"):
        try:
            raise OSError("the run failed")
        finally:
            os.unlink = signalled_unlink
            try:
                dst.close()
            finally:
                os.unlink = original
    assert list(tmp_path.iterdir()) == []
