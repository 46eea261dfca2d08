"""The worker threads one process moves bytes on (``--threads``), and how they share its buffer.

The calls that move a checkpoint's bytes let go of Python's lock while they run:
``os.pread``/``preadv``, ``os.pwrite``, ``os.copy_file_range`` and isal's ``crc32`` (on
more than a few KiB; ``isal_zlib`` calls ``PyEval_SaveThread``). So one process keeps
every core it may use busy with a pool of threads, each reading, checksumming and
writing its own pieces, while the main thread plans the next ones: one process per node
is the fast launch, not one per core. Each piece's result (a CRC-32) is combined in
the order of the pieces, never in the order they finish, so DST is the same bytes, and
every checksum the same, whatever the number of threads.

The threads share the one ``--buffer-size``: each holds a slice buffer
(``slice_bytes``: 4 MiB, less where the buffer is small), and a step's rows read
through the reader get what the slices leave (``rows_budget``).
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from shardckpt.engine import stored_copy

MIN_SLICE = 64 << 10
"""The smallest slice, however small the buffer: below it a slice costs more in calls than in bytes."""


def default_threads() -> int:
    """Return the threads a process uses by default: the cores it may run on, shared by the ranks on its node.

    ``os.sched_getaffinity`` (a ``taskset`` or a container's CPU set narrows it), divided
    by ``LOCAL_WORLD_SIZE`` under torchrun (each rank gets its share of the node), at least 1.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        ranks = 1
    return max(1, cores // max(1, ranks))


def slice_bytes(buffer_bytes: int, threads: int) -> int:
    """Return each worker's slice: ``stored_copy.SLICE``, or an eighth of the buffer over all threads where that is less."""
    share = buffer_bytes // (8 * threads) // MIN_SLICE * MIN_SLICE
    return min(stored_copy.SLICE, max(MIN_SLICE, share))


def rows_budget(buffer_bytes: int, threads: int) -> int:
    """Return the bytes a step's rows may hold: the buffer less every worker's slice (half of it at least)."""
    return max(buffer_bytes - threads * slice_bytes(buffer_bytes, threads), buffer_bytes // 2, 1)


class Workers:
    """A pool of ``count`` threads; with one, each piece of work runs on the calling thread as it is given."""

    def __init__(self, count: int):
        self.count = count
        self.stopping = threading.Event()
        """Set once work failed or the run is being stopped: long work looks at it between blocks."""
        self._pool = (
            ThreadPoolExecutor(max_workers=count, thread_name_prefix="shardckpt-worker")
            if count > 1
            else None
        )

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on a worker, in a copy of this thread's context (the command's ledger)."""
        run = contextvars.copy_context().run
        if self._pool is not None:
            return self._pool.submit(run, fn, *args)
        done: Future = Future()
        try:
            done.set_result(run(fn, *args))
        except Exception as exc:  # raised by ``results``, as a worker's would be
            done.set_exception(exc)
        return done

    def results(self, futures: Iterable[Future]) -> list:
        """Return each future's result, in order; on the first error, none left running, then raise it.

        Work not started is cancelled and work running is waited for, so no worker writes
        into DST after the error (or a signal) has begun to take the run down.
        """
        futures = list(futures)
        try:
            return [f.result() for f in futures]
        except BaseException:
            self.drain(futures)
            raise

    def drain(self, futures: Iterable[Future]) -> None:
        """Cancel the work of ``futures`` not started and wait for the work running; raise nothing."""
        self.stopping.set()
        futures = list(futures)
        for f in futures:
            f.cancel()
        wait(futures)

    def close(self) -> None:
        """Stop the threads, once the work given to them is done."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
