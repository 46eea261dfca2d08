"""Rows of a source not every rank sees: read where their files are, sent where they are needed.

``SharedReader`` stands in front of a source's reader when SRC is not one filesystem
every rank sees (``shardckpt.core.sight``). Each of its reads is a collective: every rank
calls it once per engine step (or comparison round), with what it needs or nothing.

  1) (all ranks) every rank's requests, ``(key, rows)`` pairs, are gathered;
  2) (all ranks, pure: ``assign``) each request is cut where the files that hold it
     change (``Reader.files_for``), and each piece goes to a rank that sees its files:
     the asker itself when it can, else the one with the least to send so far. The
     pieces a rank sends are spread over rounds of at most ``limit`` bytes;
  3) per round (all ranks): each rank reads what it sends and what it asked of itself
     (``agreed``, so a failed read stops every rank at once), the bytes go over one
     ``all_to_all`` (NCCL between GPUs, gloo on CPU), and each asker copies them in.

A rank holds, besides its own batch, at most ``limit`` bytes it sends (a single row
bigger than that goes alone) and what it receives, which is part of its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from shardckpt.codecs.tensor_bytes import contiguous_bytes
from shardckpt.core.lazy_torch import torch
from shardckpt.core.sight import Sight
from shardckpt.formats.base import Index, Reader, Rows, read_grouped, rows_shape
from shardckpt.state.regions import row_elements
from shardckpt.state.tree import TensorMeta

Request = tuple[str, Rows]
FilesFor = Callable[[TensorMeta, Rows], list[tuple[Rows, frozenset[str]]]]


@dataclass(frozen=True)
class Piece:
    """Rows ``rows`` of request ``index`` of rank ``asker``, read and sent by ``sender`` in ``round``."""

    asker: int
    index: int
    key: str
    rows: Rows
    at: int
    """Byte offset of these rows in the asker's tensor for the request."""
    nbytes: int
    sender: int
    round: int


def assign(
    asks: Sequence[Sequence[Request]],
    metas: Mapping[str, TensorMeta],
    files_for: FilesFor,
    sight: Sight,
    limit: int,
) -> list[Piece]:
    """Return who reads and sends each piece of every rank's requests, and in which round (pure)."""
    load = [0] * len(asks)
    rounds: list[list[int]] = [[] for _ in asks]  # bytes each rank sends, per round
    pieces = []
    for asker, requests in enumerate(asks):
        for index, (key, rows) in enumerate(requests):
            meta = metas[key]
            first = rows[0] if rows is not None else 0
            row_bytes = row_elements(meta) * meta.dtype.itemsize
            for part, files in files_for(meta, rows):
                size = meta.nbytes if part is None else (part[1] - part[0]) * row_bytes
                at = 0 if part is None else (part[0] - first) * row_bytes
                if sight.sees(asker, files):
                    sender, when = asker, 0
                else:
                    readers = sight.readers(files)
                    if not readers:
                        raise sight.unseen(files)
                    sender = min(readers, key=lambda r: (load[r], r))
                    load[sender] += size
                    when = _round(rounds[sender], size, limit)
                pieces.append(Piece(asker, index, key, part, at, size, sender, when))
    return pieces


def _round(sent: list[int], size: int, limit: int) -> int:
    """Return the first round with room for ``size`` more bytes (a new one if none), and take it."""
    for i, total in enumerate(sent):
        if total == 0 or total + size <= limit:
            sent[i] += size
            return i
    sent.append(size)
    return len(sent) - 1


class SharedReader(Reader):
    """Reads through ``inner`` on the ranks that see each file; every read is a collective."""

    def __init__(self, inner: Reader, sight: Sight, metas: Mapping[str, TensorMeta], limit: int):
        super().__init__(inner.src, inner.trust_pickle)
        self.format = inner.format
        self.inner = inner
        self.sight = sight
        self.metas = dict(metas)
        self.limit = limit

    def index(self) -> Index:
        return self.inner.index()

    def check_selected(self, tree: dict) -> None:
        self.inner.check_selected(tree)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return self.read_spans(list(zip(metas, rows)), runtime)

    def read_spans(
        self, requests: Sequence[tuple[TensorMeta, Rows]], runtime
    ) -> list[torch.Tensor]:
        mine = [(m.key, r) for m, r in requests]
        asks = runtime.all_gather(mine)
        pieces = assign(asks, self.metas, self.inner.files_for, self.sight, self.limit)
        out = [torch.empty(rows_shape(m, r), dtype=m.dtype) for m, r in requests]
        targets = [contiguous_bytes(t) for t in out]
        for when in range(max((p.round for p in pieces), default=-1) + 1):
            here = [p for p in pieces if p.round == when]
            self._round(here, targets, runtime)
        return out

    def _round(self, pieces: list[Piece], targets: list[memoryview], runtime) -> None:
        me, world = runtime.rank, runtime.world_size
        reads = [p for p in pieces if p.sender == me]
        got = runtime.agreed(lambda: self._read(reads))
        for p in reads:
            if p.asker == me:
                targets[p.index][p.at : p.at + p.nbytes] = got.pop(p)
        if all(p.sender == p.asker for p in pieces):
            return  # every rank read its own: nothing crosses (the same answer on every rank)
        sends = [[p for p in reads if p.asker == r and r != me] for r in range(world)]
        send_sizes = [sum(p.nbytes for p in ps) for ps in sends]
        # The send buffer's pages are taken as it fills, and each read is let go once
        # copied: the rows sent are held about once, not twice.
        buffer = torch.empty(sum(send_sizes), dtype=torch.uint8)
        window = contiguous_bytes(buffer)
        at = 0
        for p in (p for ps in sends for p in ps):
            window[at : at + p.nbytes] = got.pop(p)
            at += p.nbytes
        recvs = [[p for p in pieces if p.asker == me and p.sender == r != me] for r in range(world)]
        came = runtime.all_to_all(buffer, send_sizes, [sum(p.nbytes for p in ps) for ps in recvs])
        view = contiguous_bytes(came)
        at = 0
        for p in (p for ps in recvs for p in ps):
            targets[p.index][p.at : p.at + p.nbytes] = view[at : at + p.nbytes]
            at += p.nbytes

    def _read(self, pieces: list[Piece]) -> dict[Piece, memoryview]:
        """Read the pieces this rank sends (to itself or others) through the inner reader."""
        requests = [(self.metas[p.key], p.rows) for p in pieces]
        tensors = read_grouped(self.inner, requests, self.sight.runtime)
        return {p: contiguous_bytes(t) for p, t in zip(pieces, tensors)}


__all__ = ["Piece", "SharedReader", "assign"]
