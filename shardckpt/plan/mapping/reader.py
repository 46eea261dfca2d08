"""A source read through a mapping: its index the mapped tensors, their rows assembled from the source's.

``MappedReader`` wraps the source's reader as ``CastReader`` does, so every writer, the
fill loop, ``--dtype``, ``--verify`` and every rank's share of DST work on the mapped
tensors unchanged. Rows [a, b) of an output tensor are its elements [a * row, b * row):
the runs (``layout.Run``) over them name source elements, read as the source rows that
hold them (adjacent rows joined into one request, one ``read_spans`` call per step), so a
step reads about the bytes it writes: a RoPE-permuted rows' heads, one expert's slab.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from shardckpt.core.lazy_torch import torch
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.plan.mapping.layout import Mapped, Run
from shardckpt.state.tree import TensorMeta


class MappedReader(Reader):
    """Reads the tensors of ``mapped`` from ``inner``, whose tensors ``sources`` names (name to meta)."""

    def __init__(
        self,
        inner: Reader,
        mapped: Mapped,
        sources: Mapping[str, TensorMeta],
        tree: dict,
        world_size: int | None,
    ):
        super().__init__(inner.src, inner.trust_pickle)
        self.format = inner.format
        self.inner = inner
        self.mapped = mapped
        self.sources = dict(sources)
        self._tree = tree
        self._world_size = world_size
        # Where each run starts in its output tensor, for bisecting a row range.
        self._starts = {name: _starts(parts) for name, parts in mapped.runs.items()}

    def index(self) -> Index:
        return Index(self.format, str(self.src), self._world_size, self._tree)

    def members(self) -> frozenset[str]:
        return self.inner.members()

    def notes(self) -> list[str]:
        return self.inner.notes()

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return self.read_spans(list(zip(metas, rows)), runtime)

    def read_spans(
        self, requests: Sequence[tuple[TensorMeta, Rows]], runtime
    ) -> list[torch.Tensor]:
        pieces = [self._pieces(meta, rows) for meta, rows in requests]
        wanted: dict[str, list[tuple[int, int]]] = {}
        for parts in pieces:
            for run in parts:
                wanted.setdefault(run.name, []).append(self._source_rows(run))
        spans = [(name, span) for name, rows in wanted.items() for span in _joined(rows)]
        got = self.inner.read_spans(
            [(self.sources[name], None if span is None else span) for name, span in spans],
            runtime,
        )
        fetched: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for (name, span), tensor in zip(spans, got):
            fetched.setdefault(name, []).append((0 if span is None else span[0], tensor))
        return [
            self._assemble(meta, rows, parts, fetched)
            for (meta, rows), parts in zip(requests, pieces)
        ]

    def _pieces(self, meta: TensorMeta, rows: Rows) -> list[Run]:
        """Return the source runs of ``meta``'s rows ``rows``, cut to them, in order."""
        parts = self.mapped.runs[meta.key]
        if rows is None or not meta.shape:
            return list(parts)
        row = meta.numel // meta.shape[0] if meta.shape[0] else 0
        first, stop = rows[0] * row, rows[1] * row
        starts = self._starts[meta.key]
        out = []
        i = max(0, bisect.bisect_right(starts, first) - 1)
        while i < len(parts) and starts[i] < stop:
            run = parts[i]
            a = max(first, starts[i]) - starts[i]
            b = min(stop, starts[i] + run.stop - run.start) - starts[i]
            if a < b:
                out.append(Run(run.name, run.start + a, run.start + b))
            i += 1
        return out

    def _source_rows(self, run: Run) -> tuple[int, int] | None:
        """Return the rows of its source tensor that hold ``run`` (None: a 0-dim tensor)."""
        meta = self.sources[run.name]
        if not meta.shape:
            return None
        row = meta.numel // meta.shape[0] if meta.shape[0] else 1
        return (run.start // row, -(-run.stop // row))

    def _assemble(
        self,
        meta: TensorMeta,
        rows: Rows,
        parts: list[Run],
        fetched: Mapping[str, list[tuple[int, torch.Tensor]]],
    ) -> torch.Tensor:
        shape = (
            meta.shape if rows is None or not meta.shape else (rows[1] - rows[0], *meta.shape[1:])
        )
        first = parts[0] if parts else None
        dtype = self.sources[first.name].dtype if first is not None else meta.dtype
        out = torch.empty(shape, dtype=dtype)
        flat = out.view(-1)
        at = 0
        for run in parts:
            source = self.sources[run.name]
            row = source.numel // source.shape[0] if source.shape and source.shape[0] else 1
            span = self._source_rows(run)
            base, tensor = next(
                (b, t)
                for b, t in fetched[run.name]
                if span is None or (b <= span[0] and span[1] <= b + (t.shape[0] if t.dim() else 1))
            )
            offset = base * row if source.shape else 0
            n = run.stop - run.start
            flat[at : at + n] = tensor.reshape(-1)[run.start - offset : run.stop - offset]
            at += n
        return out


def _starts(parts: Sequence[Run]) -> list[int]:
    out, at = [], 0
    for run in parts:
        out.append(at)
        at += run.stop - run.start
    return out


def _joined(spans: list[tuple[int, int] | None]) -> list[tuple[int, int] | None]:
    """Return ``spans`` (row ranges of one tensor) merged where they overlap or touch."""
    if any(s is None for s in spans):
        return [None]
    merged: list[tuple[int, int]] = []
    for a, b in sorted(spans):  # type: ignore[type-var]
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged  # type: ignore[return-value]
