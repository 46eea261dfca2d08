"""Run a function on W real gloo ranks in separate processes and collect the results.

Starting a rank is costly (importing torch takes ~3 s of CPU and the first FSDP/DCP
call warms caches), so the ranks of each world size are kept as a pool and reused by the next ``run_ranks`` call (the idea of torch's
``MultiProcContinuousTest``): each call joins a fresh process group over a fresh
FileStore and destroys it at the end. Any failure kills that pool; the next call
spawns a new one. Global state a function changes (default dtype, RNG seed) does
persist into later calls on the same pool, so functions should not change it.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankError(RuntimeError):
    """A rank raised, died or did not finish in time; the message names the rank."""


def _worker(rank: int, world_size: int, tasks: mp.Queue, results: mp.Queue) -> None:
    """Serve jobs: join the job's gloo group, run it, send the result or traceback."""
    import torch
    import torch.distributed as dist

    # W ranks share a couple of cores; intra-op threads would only oversubscribe them.
    torch.set_num_threads(1)
    parent = mp.parent_process()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            # The test run was killed without running atexit (SIGKILL, os._exit):
            # exit rather than linger as an orphan holding a few hundred MB.
            if parent is not None and not parent.is_alive():
                return
            continue
        if task is None:
            return
        job, store_path, payload = task
        try:
            fn, args = pickle.loads(payload)
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
            value = fn(*args)
            # gloo can abort at teardown while a peer is still finishing a send: leave
            # together, and report only after teardown so that such a death is seen.
            dist.barrier()
            dist.destroy_process_group()
            # Plain pickle, not the queue's: torch's shared-memory tensor reductions
            # need the sender alive, and an unpicklable value must fail here, loudly.
            results.put((job, rank, True, pickle.dumps(value)))
        except BaseException:
            results.put((job, rank, False, traceback.format_exc()))
            results.close()
            results.join_thread()
            # Skip interpreter shutdown: peers may be blocked in a collective with us
            # and a graceful gloo teardown could hang; the parent kills them all.
            os._exit(1)


def _describe_exit(code: int | None) -> str:
    """Return 'exit code N' or 'signal SIGNAME' for a process exit code."""
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


# Imported once by the fork server; modules that are not importable are skipped.
_PRELOAD = [
    "torch",
    "torch._dynamo",  # imported lazily by the first fully_shard: ~1 s per rank
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.format_utils",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.run",  # torchrun's agent (tests/warm_cli.py)
    # What ``python -m shardckpt`` imports before it runs a command (tests/warm_cli.py).
    "shardckpt.api",
    "shardckpt.cli.app",
]


def fork_server() -> mp.context.ForkServerContext:
    """Return the forkserver context whose server imported ``_PRELOAD`` once.

    Ranks (``_Pool``) and warm CLI processes (``warm_cli``) fork from it instead of
    each spending ~3 s of CPU importing torch: a 4-rank pool starts in ~0.2 s instead
    of ~5 s on 2 cores. The server is started by the first process started from it.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Pool:
    """``world_size`` spawned rank processes that run one job at a time together."""

    _jobs = itertools.count()

    def __init__(self, world_size: int) -> None:
        # Ranks fork from a clean server process that imported torch once (as DataLoader
        # workers fork after `import torch`).
        ctx = fork_server()
        self.world_size = world_size
        self.results: mp.Queue = ctx.Queue()
        self.tasks: list[mp.Queue] = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_worker, args=(rank, world_size, self.tasks[rank], self.results))
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.daemon = True
            proc.start()

    def kill(self) -> None:
        """Kill every rank process and wait for it."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()

    def run(self, payload: bytes, timeout: float) -> list[Any]:
        """Return the job's result per rank; raise RankError if any rank fails."""
        job = next(self._jobs)
        with tempfile.TemporaryDirectory(prefix="shardckpt-ranks-") as tmp:
            for task in self.tasks:
                task.put((job, os.path.join(tmp, "store"), payload))
            values: dict[int, Any] = {}
            errors: dict[int, str] = {}
            deadline = time.monotonic() + timeout
            while len(values) < self.world_size and not errors:
                if self._receive(job, values, errors, wait=0.05):
                    continue
                if self._dead(values, errors) or time.monotonic() > deadline:
                    break
            if len(values) == self.world_size:
                return [values[rank] for rank in range(self.world_size)]
            # A rank killed by a signal makes its peers raise "connection reset": wait
            # a moment so that the root cause is reported along with what it caused.
            grace = min(time.monotonic() + 1.0, max(deadline, time.monotonic()))
            while time.monotonic() < grace and (
                len(values) + len(errors) + len(self._dead(values, errors)) < self.world_size
            ):
                self._receive(job, values, errors, wait=0.05)
            raise RankError(self._failure(values, errors, timeout))

    def _receive(self, job: int, values: dict, errors: dict, wait: float) -> bool:
        """Record one message of ``job`` if one arrives within ``wait`` s; say if one did."""
        try:
            msg_job, rank, ok, payload = self.results.get(timeout=wait)
        except queue.Empty:
            return False
        if msg_job == job:
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
        return True

    def _dead(self, values: dict, errors: dict) -> list[int]:
        """Return the ranks that exited without sending this job's message."""
        return [
            rank
            for rank, proc in enumerate(self.procs)
            if rank not in values and rank not in errors and proc.exitcode is not None
        ]

    def _failure(self, values: dict, errors: dict, timeout: float) -> str:
        """Return the error message: deaths first (root causes), then tracebacks."""
        n = self.world_size
        lines = [
            f"rank {rank} of {n} died with {_describe_exit(self.procs[rank].exitcode)} "
            "before reporting a result"
            for rank in self._dead(values, errors)
        ]
        lines += [f"rank {rank} of {n} raised:\n{tb}" for rank, tb in errors.items()]
        pending = [r for r in range(n) if r not in values and r not in errors]
        if not lines:
            lines = [f"ranks {pending} of {n} still running after {timeout:g} s"]
        return "\n".join(lines)


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _kill_pools() -> None:
    """Kill every pooled rank process (at interpreter exit)."""
    while _POOLS:
        _POOLS.popitem()[1].kill()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120
) -> list[Any]:
    """Return ``[fn(*args) on rank r for r in range(world_size)]`` run on real gloo ranks.

    ``fn`` (a module-level function), ``args`` and the results must be picklable. On
    a raising rank, a dead rank or ``timeout`` seconds elapsed, every rank is killed
    and RankError names the ranks with their tracebacks or exit signals.
    """
    payload = pickle.dumps((fn, args))  # fails here, not silently in a feeder thread
    if world_size not in _POOLS:
        _POOLS[world_size] = _Pool(world_size)
    pool = _POOLS[world_size]
    try:
        return pool.run(payload, timeout)
    except BaseException:
        # Survivors may be blocked in a collective forever: never reuse this pool.
        del _POOLS[world_size]
        pool.kill()
        raise
