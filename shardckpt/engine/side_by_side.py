"""Two sources read side by side: each in a thread of its own, a batch ahead of the comparison.

``diff`` and ``--verify`` read the same tensors of two checkpoints. Each side is read by
a thread of its own (``preadv`` and isal's CRC-32 let go of the GIL while they work), one
batch ahead of the caller, which compares the batch before meanwhile (``memcmp`` lets go
of it too). Each side's batches are read into two buffers in turn (``Arena``), allocated
once: memory allocated afresh for every read has each page zeroed by the kernel on first
touch, which cost as much as reading the bytes.

A tensor bigger than a batch is read in windows of rows. Each side holds two batches
(the one compared and the one read): with batches of a quarter of ``--buffer-size``,
the process holds at most that, as ``convert`` does.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from math import prod

from shardckpt.core.lazy_torch import torch
from shardckpt.formats.base import Reader, Rows, rows_shape
from shardckpt.state.regions import row_elements
from shardckpt.state.tree import TensorMeta

ALIGN = 64
"""Bytes each tensor cut from an arena is aligned to (any dtype's, and a cache line)."""


@dataclass(frozen=True)
class Piece:
    """Rows ``rows`` of the ``pair``-th pair of tensors (A's meta and B's), compared as one."""

    pair: int
    meta_a: TensorMeta
    meta_b: TensorMeta
    rows: Rows

    def nbytes(self, meta: TensorMeta) -> int:
        """Return the bytes of the piece's rows of ``meta`` (A's or B's)."""
        return prod(rows_shape(meta, self.rows)) * meta.dtype.itemsize


def pieces(pairs: Sequence[tuple[TensorMeta, TensorMeta, Rows]], limit: int) -> list[list[Piece]]:
    """Return the pairs' rows in batches of at most ``limit`` bytes a side (a bigger row goes alone).

    A tensor bigger than ``limit`` is cut into windows of rows; a batch holds at most one
    piece of a tensor, as a reader takes each tensor once per call. Empty tensors have
    nothing to compare and are left out.
    """
    out: list[list[Piece]] = []
    size, keys = limit, set()
    for i, (ma, mb, rows) in enumerate(pairs):
        for window in _windows(ma, mb, rows, limit):
            piece = Piece(i, ma, mb, window)
            n = max(piece.nbytes(ma), piece.nbytes(mb))
            if size + n > limit or ("a", ma.key) in keys or ("b", mb.key) in keys:
                out.append([])
                size, keys = 0, set()
            out[-1].append(piece)
            size += n
            keys |= {("a", ma.key), ("b", mb.key)}
    return out


def _windows(ma: TensorMeta, mb: TensorMeta, rows: Rows, limit: int) -> list[Rows]:
    """Return ``rows`` of a pair cut into windows of at most ``limit`` bytes a side (one row at least)."""
    if not ma.shape:
        return [rows]
    lo, hi = rows if rows is not None else (0, ma.shape[0])
    row_bytes = row_elements(ma) * max(ma.dtype.itemsize, mb.dtype.itemsize)
    if hi <= lo or row_bytes == 0:
        return []
    step = max(1, limit // row_bytes)
    if rows is None and step >= hi:
        return [None]
    return [(start, min(start + step, hi)) for start in range(lo, hi, step)]


class Arena:
    """One buffer, allocated on first use and kept, cut into the tensors of one batch at a time."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._buffer: torch.Tensor | None = None

    def tensors(self, metas: Sequence[TensorMeta], rows: Sequence[Rows]) -> list[torch.Tensor]:
        """Return empty contiguous tensors for ``rows`` of each of ``metas``, views of the buffer."""
        if self._buffer is None:
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        out, at = [], 0
        for meta, r in zip(metas, rows):
            shape = rows_shape(meta, r)
            n = prod(shape) * meta.dtype.itemsize
            view = self._buffer[at : at + n].view(meta.dtype).view(shape)
            out.append(view)
            at += -(-n // ALIGN) * ALIGN
        return out


def arena_bytes(batches: Sequence[Sequence[Piece]], side: str) -> int:
    """Return the buffer the largest batch needs on one side (``"a"`` or ``"b"``), alignment included."""
    need = 0
    for batch in batches:
        metas = [p.meta_a if side == "a" else p.meta_b for p in batch]
        need = max(need, sum(-(-p.nbytes(m) // ALIGN) * ALIGN for p, m in zip(batch, metas)))
    return need


def side_by_side(
    a: Reader, b: Reader, batches: Sequence[Sequence[Piece]], runtime
) -> Iterator[tuple[Sequence[Piece], list[torch.Tensor], list[torch.Tensor]]]:
    """Yield each batch with A's and B's tensors of its pieces, the next batch read meanwhile.

    The tensors are views of buffers used again two batches later: the caller is done
    with them when it asks for the next batch. Each side is read by one thread, in
    order; a read that fails raises here, once the batch it belongs to is reached.
    """
    size_a, size_b = arena_bytes(batches, "a"), arena_bytes(batches, "b")
    arenas = ((Arena(size_a), Arena(size_a)), (Arena(size_b), Arena(size_b)))
    with (
        ThreadPoolExecutor(1, thread_name_prefix="read-a") as thread_a,
        ThreadPoolExecutor(1, thread_name_prefix="read-b") as thread_b,
    ):

        def start(k: int) -> tuple[Future, Future]:
            batch, rows = batches[k], [p.rows for p in batches[k]]
            metas_a, metas_b = [p.meta_a for p in batch], [p.meta_b for p in batch]
            # A copy of the context, so the reads note their bytes in this command's ledger.
            return (
                thread_a.submit(_in_context(), _read, a, metas_a, rows, arenas[0][k % 2], runtime),
                thread_b.submit(_in_context(), _read, b, metas_b, rows, arenas[1][k % 2], runtime),
            )

        ahead = start(0) if batches else None
        for k, batch in enumerate(batches):
            assert ahead is not None
            done_a, done_b = ahead
            xs, ys = done_a.result(), done_b.result()
            ahead = start(k + 1) if k + 1 < len(batches) else None
            yield batch, xs, ys


def _in_context():
    """Return ``run`` of a copy of this thread's context (the checksum ledger, among others)."""
    return contextvars.copy_context().run


def _read(
    reader: Reader,
    metas: Sequence[TensorMeta],
    rows: Sequence[Rows],
    arena: Arena,
    runtime,
) -> list[torch.Tensor]:
    """Return ``reader``'s tensors of ``rows`` of ``metas``, read into ``arena`` where it can."""
    return reader.read_into(metas, rows, arena.tensors(metas, rows), runtime)
