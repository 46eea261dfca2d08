"""``Runtime.check``'s verdict: one error for every rank, saying where it was seen (pure part)."""

from __future__ import annotations

from shardckpt.core.dist import _first_failure
from shardckpt.core.errors import DestinationExistsError, UsageError

EXISTS = (DestinationExistsError, "already exists", "out", "pass --overwrite to replace it")


def test_no_failure_is_no_error():
    assert _first_failure([("a", None), ("b", None)]) is None


def test_a_failure_every_rank_saw_alike_is_said_as_it_is():
    error = _first_failure([("a", EXISTS), ("b", EXISTS)])
    assert isinstance(error, DestinationExistsError) and error.exit_code == 5
    assert error.line() == "'out': already exists: pass --overwrite to replace it"


def test_a_failure_some_ranks_saw_names_them_their_hosts_and_the_ranks_that_did_not():
    error = _first_failure([("a", None), ("b", EXISTS), ("c", None), ("c", EXISTS)])
    assert error.line() == (
        "'out': already exists (on ranks 1, 3, hosts b, c; not on ranks 0, 2): "
        "pass --overwrite to replace it"
    )


def test_the_lowest_failing_ranks_failure_wins_and_others_are_not_called_clean():
    other = (UsageError, "is a directory that holds no checkpoint", "out", "remove it")
    error = _first_failure([("a", other), ("a", other), ("b", EXISTS)])
    assert isinstance(error, UsageError) and error.exit_code == 2
    assert (
        error.line()
        == "'out': is a directory that holds no checkpoint (on ranks 0-1, host a): remove it"
    )
