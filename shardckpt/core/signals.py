"""SIGTERM and SIGHUP end a run the way Ctrl-C (SIGINT) does: by unwinding, so cleanup runs.

Python turns SIGINT into ``KeyboardInterrupt``; by default SIGTERM (what torchrun, a
job scheduler or ``kill`` sends) and SIGHUP (a closed terminal) kill the process on
the spot, leaving a partial output and a lock file behind. Inside ``interruptible()``
all three raise ``Interrupted`` in the main thread, so every ``finally`` on the way out
(the partial output's removal, the lock's release, the process group's teardown) runs.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

from shardckpt.core.errors import in_chain

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """The run was stopped by a signal; ``exit_code`` is the shell's 128 + signal number.

    A BaseException, like ``KeyboardInterrupt``: no ``except Exception`` on the way out
    may swallow it.
    """

    def __init__(self, signum: int, complete: str | None = None, rank: int | None = None):
        self.signum = signum
        self.complete = complete
        """What the run had finished when the signal came (``'out.pt'``): then it is no failure."""
        self.rank = rank
        """Under torchrun, the other rank the signal stopped (this one lost contact with it)."""
        self.exit_code = 0 if complete else 128 + signum
        super().__init__(signal.Signals(signum).name)

    @property
    def name(self) -> str:
        """Return the signal's name, e.g. ``SIGTERM``."""
        return signal.Signals(self.signum).name


# What the run has finished (its DST, in place), signals held meanwhile, and whether
# signals are held at all: while DST is moved into place every signal waits, while a
# step that must not be cut in two runs (``sheltered``), and once the run is failing
# (``ending``).
_complete: list[str] = []
_held: list[int] = []
_holding: list[bool] = []
_sheltering: list[bool] = []
_ending: list[bool] = []


def _raise(signum: int, _frame) -> None:
    if _ending:
        _held.append(signum)  # the run ends with its own error; the signal changes nothing
        return
    if _sheltering or (_holding and not _complete) or (_complete and not _held):
        # Moving DST into place, or the first signal once it is there: it waits.
        _held.append(signum)
        return
    raise Interrupted(signum, _complete[0] if _complete else None)


@contextlib.contextmanager
def committing(what: str) -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while the block puts ``what`` in place; then it is complete.

    A signal in the middle of the renames would leave DST moved aside, or a finished DST
    reported as not written. If the block fails, a signal held meanwhile is raised.
    Blocks nest (every rank holds signals from the agreement to commit until DST is in
    place; the rank that renames holds them again inside): the outermost decides.
    """
    _holding.append(True)
    try:
        yield
    except BaseException as exc:
        _holding.pop()
        if not _holding and _held and not _complete and not _ending:
            raise Interrupted(_held.pop(0)) from exc
        raise
    _holding.pop()
    completed(what)


@contextlib.contextmanager
def sheltered(raising: bool = True) -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while the block runs; raise the first held once it is done.

    For the steps a signal must not cut in two: taking DST's lock and writing who holds
    it, removing a partial output and giving the lock back, the process group's teardown.
    A signal there would leave the lock file, or half of the partial output, behind.
    When the block fails, its own error goes on and a signal held meanwhile only waits.
    ``raising=False``: for the steps of a run that is ending either way (failing, or
    with DST complete): a signal held meanwhile changes nothing, so the error on its way
    out (under torchrun, the first failing rank's line) is still the one reported.
    """
    before = len(_held)
    _sheltering.append(True)
    try:
        yield
    finally:
        _sheltering.pop()
    if not raising or _ending or _sheltering or _holding or len(_held) == before:
        return  # none came, or an outer block decides what a held signal does
    if not _complete:
        raise Interrupted(_held.pop(before))
    if len(_held) > 1:  # DST is in place: the first waits for the summary, a second ends the run
        raise Interrupted(_held[-1], _complete[0])


def ending() -> None:
    """Say the run is failing with an error it has yet to report: from now on signals only wait.

    For ranks under torchrun (a process alone is stopped by a signal as it comes): the
    agent sends SIGTERM to every rank as soon as one exits, which can
    be while another rank still unwinds from the failure every rank agreed on, before
    it printed the line that says what went wrong. That line, and the error's exit
    code, are what the run ends with; a signal raised in its place would lose them.
    The unwinding left (the partial output's removal, the process group's teardown,
    each bounded by ``SHARDCKPT_TIMEOUT``) is short.
    """
    if not _ending:
        _ending.append(True)


def completed(what: str) -> None:
    """Say the run's output (``what``) is complete: a signal from now on does not make it fail.

    The first SIGINT, SIGTERM or SIGHUP is held until the command returns (its summary
    printed) and then only noted; a second ends the run at once. Either way the exit code
    is 0, since DST is whole: a script must not redo, or distrust, a finished conversion.
    """
    if what not in _complete:
        _complete.append(what)


def reopened() -> None:
    """Say the output reported complete was a stand-in for DST (a local copy yet to be uploaded).

    Signals end the run again, as before ``completed``; one held meanwhile does so now.
    """
    _complete.clear()
    if _held and not (_holding or _sheltering or _ending):
        raise Interrupted(_held.pop(0))


def behind(exc: BaseException) -> Interrupted | None:
    """Return the ``Interrupted`` that ``exc`` was raised from or while handling, if any.

    Python wraps what a signal handler raises in some places: an exception inside a
    class body's ``__set_name__`` (a dataclass defined by a module imported mid-run)
    becomes ``RuntimeError: Error calling __set_name__`` on Python 3.11, the signal its
    ``__cause__``. Such a run was still stopped by the signal.
    """
    return in_chain(exc, Interrupted)


def held() -> Interrupted | None:
    """Return the signal held since the output was complete (``completed``), if one came."""
    return Interrupted(_held[0], _complete[0]) if _held and _complete else None


# Signals that arrived before ``interruptible()``, while the CLI was still importing.
_pending: list[int] = []


def _record(signum: int, _frame) -> None:
    _pending.append(signum)


def defer() -> None:
    """Until ``interruptible()`` starts, record SIGINT, SIGTERM and SIGHUP instead of acting.

    Start-up imports torch for seconds, and an exception raised inside some library's
    import can be swallowed by a bare ``except:`` there, so the run would go on. A
    recorded signal is raised as soon as ``interruptible()`` is in place.
    """
    for sig in HANDLED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _record)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` (main thread only)."""
    previous = {}
    _complete.clear()
    _held.clear()
    _holding.clear()
    _sheltering.clear()
    _ending.clear()
    try:
        for sig in HANDLED:
            # An ignored signal stays ignored: `nohup` ignores SIGHUP so the run survives logout.
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, _raise)
    except ValueError:
        pass  # not the main thread (e.g. an embedding application): keep its handlers
    try:
        if _pending:
            raise Interrupted(_pending[0])
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within the block, record SIGINT, SIGTERM and SIGHUP; raise the first as ``Interrupted`` after it.

    For importing torch once a command runs: an exception raised inside torch's import
    (in a callback from its C++ side) aborts the process instead of unwinding it.
    """
    previous = {}
    seen = len(_pending)
    try:
        for sig in HANDLED:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, _record)
    except ValueError:
        pass  # not the main thread: its signals are not ours to defer
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if len(_pending) > seen:
        raise Interrupted(_pending[seen])
