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
from shardckpt.core.signals import Interrupted, completed, interruptible, sheltered


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
