"""Two tensors compared by the bytes they are stored as, without torch (``diff`` at one process).

Where both sides store a tensor's elements as they are (``Reader.stored_runs``: a DCP
chunk's rows, a safetensors tensor, a ``torch.save`` storage's record) and have one
dtype and shape, the same bytes are the same tensor under any tolerance
(``state.values.tensors_differ`` says so before it computes anything). Here both sides'
runs are read a slice at a time into two small buffers, checked as every read is (each
slice noted against its record's CRC-32 in the active ledger) and compared with
``memcmp``. Only a pair whose bytes differ is then compared by value, through torch:
``-0.0`` and ``0.0``, or NaNs of different payloads, or values within a tolerance, are
told apart there as before. So ``diff`` of two equal checkpoints never imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack

from shardckpt.core.files import open_source, read_exactly
from shardckpt.core.libc import address_of, same_memory
from shardckpt.core.read_buffers import ReadBuffer
from shardckpt.engine.stored_copy import SLICE, data_of, fetch_ahead, run_names, slice_buffer
from shardckpt.formats.base import Reader, StoredRun
from shardckpt.state.checksums import active
from shardckpt.state.tree import TensorMeta

MIN_RUN = 64 << 10
"""The fewest bytes a side's runs hold on average to be compared here, when they are more
than ``FEW_RUNS``: a tensor cut into many small runs (a DCP chunk's rows, of a tensor
sharded along its columns) costs a read per run, more than torch's path."""
FEW_RUNS = 64
"""Runs read one by one whatever their size: a small tensor saved by several ranks."""


def same_stored(a: Reader, ma: TensorMeta, b: Reader, mb: TensorMeta) -> bool | None:
    """Return whether ``ma`` (read through ``a``) and ``mb`` (through ``b``) hold the same bytes.

    None where either side's bytes do not lie in its files as they are, or lie in runs
    too many and too short to read one by one (``MIN_RUN``): the caller compares that pair by value.
    Of one dtype and shape only (the caller checked). Stops at the first slice that differs.
    """
    if not ma.numel:
        return True
    runs_a = a.stored_runs(ma, 0, ma.numel)
    runs_b = b.stored_runs(mb, 0, mb.numel)
    if not _worth_reading(runs_a, ma) or not _worth_reading(runs_b, mb):
        return None
    fetch_ahead(runs_a)
    fetch_ahead(runs_b)
    with ExitStack() as files:
        side_a = _Side(runs_a, ma.key, files, slice_buffer(SLICE, 0))
        side_b = _Side(runs_b, mb.key, files, slice_buffer(SLICE, 1))
        for lo, hi in _slices(runs_a, runs_b):
            side_a.read(lo, hi)
            side_b.read(lo, hi)
            if not same_memory(side_a.address, side_b.address, hi - lo):
                return False
    return True


def _worth_reading(runs: Sequence[StoredRun] | None, meta: TensorMeta) -> bool:
    """Return whether ``runs`` hold all of ``meta``'s bytes, in few runs or long ones (``MIN_RUN``)."""
    if runs is None or sum(run.length for run in runs) != meta.nbytes:
        return False
    return len(runs) <= FEW_RUNS or meta.nbytes >= MIN_RUN * len(runs)


def _slices(runs_a: Sequence[StoredRun], runs_b: Sequence[StoredRun]) -> Iterator[tuple[int, int]]:
    """Yield the byte ranges of the tensor read at a time: cut where either side's run ends, at most ``SLICE`` long."""
    cuts = {0}
    for runs in (runs_a, runs_b):
        at = 0
        for run in runs:
            at += run.length
            cuts.add(at)
    edges = sorted(cuts)
    for lo, hi in zip(edges, edges[1:]):
        for start in range(lo, hi, SLICE):
            yield start, min(hi, start + SLICE)


class _Side:
    """One side's runs, read by the tensor's byte ranges into one buffer and noted in the ledger."""

    def __init__(self, runs: Sequence[StoredRun], key: str, files: ExitStack, buffer: ReadBuffer):
        self._runs = list(runs)
        self._starts = []
        at = 0
        for run in self._runs:
            self._starts.append(at)
            at += run.length
        self._key = key
        self._files = files
        self._fds: dict[os.PathLike, int] = {}
        self.address = 0
        """Where ``read`` put the bytes it read last."""
        self._buffer = buffer
        self._ledger = active()
        self._run = 0
        if self._ledger is not None:
            for run in self._runs:
                if run.written is not None:
                    self._ledger.expect(run.written, self._names(run))

    def read(self, lo: int, hi: int) -> None:
        """Read bytes [lo, hi) of the tensor to ``address``; they lie in one run (``_slices`` cut them so)."""
        while self._starts[self._run] + self._runs[self._run].length <= lo:
            self._run += 1
        run = self._runs[self._run]
        at = run.offset + lo - self._starts[self._run]
        part = self._buffer.for_read(at, hi - lo)
        self.address = address_of(part)
        what = data_of(self._names(run))
        read_exactly(self._fd(run.path), part, at, run.path, what)
        if self._ledger is not None and run.written is not None:
            self._ledger.note(*run.written.key, at - run.written.start, part)

    def _names(self, run: StoredRun) -> list[str]:
        return run_names(run, self._key)

    def _fd(self, path: os.PathLike) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = open_source(path)
            self._files.callback(os.close, fd)
        return fd
