"""torchrun's failure summary, as torch's own code builds it from the ranks' error files (issue 35 item 8).

Each rank that fails leaves its one line in the error file torchrun gives it; torchrun
prints a block per failed rank and calls the one with the earliest timestamp (whole
seconds; a tie goes to the lowest rank) the root cause. A rank stopped by another rank's
error must not be that root cause: the summary would then say 'rank 1 failed: ...' at
the place meant for what happened.
"""

from __future__ import annotations

import json
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shardckpt.cli.app import report
from shardckpt.core.errors import BadInputError, RemoteRankError

CAUSE = BadInputError("the bytes of 'w' do not match their checksum", path="ckpt/__1_0.distcp")
LINE = f"shardckpt: error: {CAUSE.line()}"


def _fail_on(monkeypatch, tmp_path, rank: int, error) -> ProcessFailure:
    """Report ``error`` as rank ``rank`` under torchrun; return torch's record of that rank."""
    error_file = tmp_path / f"{rank}" / "error.json"
    error_file.parent.mkdir()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", str(rank))
    report(error)
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=3, error_file=str(error_file))


@pytest.mark.parametrize("cause", [0, 1])
def test_the_root_cause_is_the_rank_where_the_error_happened(monkeypatch, tmp_path, capsys, cause):
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)  # both records in the same second
    failures = {}
    for rank in (0, 1):
        error = CAUSE if rank == cause else RemoteRankError(cause, CAUSE.line(), 3)
        failures[rank] = _fail_on(monkeypatch, tmp_path, rank, error)
    summary = ChildFailedError("shardckpt", failures)
    assert summary.get_first_failure()[0] == cause
    root = summary.format_msg().split("Root Cause (first observed failure):")[1]
    assert f"rank      : {cause} (local_rank: {cause})" in root
    assert f"  traceback : {LINE}\n" in root
    # Printed once, on rank 0's stderr, by whichever rank 0 is.
    assert capsys.readouterr().err == (f"{LINE}\n" if cause == 0 else "")
    for rank in failures:
        message = json.loads((tmp_path / f"{rank}" / "error.json").read_text())["message"]
        assert "\n" not in message["extraInfo"]["py_callstack"]
