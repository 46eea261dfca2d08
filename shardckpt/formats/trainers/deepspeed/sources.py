"""Where a tensor of a DeepSpeed checkpoint is read from, and reading rows of it.

A ``Spans`` source is a tensor whose elements lie in pieces of 1-D tensors: a
parameter's fp32 master weights (or one Adam moment) in the ranks' flat partitions,
in element order. Rows [a, b) of it are elements [a * row, b * row), read piece by
piece from the files (``pread``, never through the mapping: ``state.checksums.checked``),
so a read touches only the bytes of those rows, wherever a rank's partition begins or
ends, and each piece is noted against the CRC-32 of the record it lies in: a flipped
bit is exit 3, a file cut short since it was opened is exit 3 naming it. A ``Whole``
source is a tensor saved as it is (a buffer, a frozen parameter, the step counter),
sliced by rows and read the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardckpt.formats.base import Rows
from shardckpt.formats.torch_save.in_place import values
from shardckpt.state.tree import TensorMeta


@dataclass(frozen=True)
class Span:
    """Elements [start, start + numel) of a tensor: at offset ``at`` of the 1-D tensor ``flat``."""

    flat: torch.Tensor
    at: int
    start: int
    numel: int


@dataclass(frozen=True)
class Spans:
    """A tensor kept as spans of flat tensors, covering its elements in order."""

    spans: tuple[Span, ...]

    def read(self, meta: TensorMeta, rows: Rows) -> torch.Tensor:
        """Return ``rows`` of the tensor (all of it for None), of ``meta``'s shape and dtype."""
        shape = meta.shape
        row = math.prod(shape[1:]) if shape else 1
        first, last = rows if rows is not None else (0, shape[0] if shape else 1)
        lo, hi = first * row, last * row
        out_shape = (last - first, *shape[1:]) if shape else ()
        inside = [s for s in self.spans if s.start < hi and s.start + s.numel > lo]
        if len(inside) == 1 and inside[0].flat.dtype == meta.dtype:
            # One span holds every element asked for: read as it lies, no second copy.
            s = inside[0]
            return values(s.flat[s.at + lo - s.start : s.at + hi - s.start]).view(out_shape)
        out = torch.empty(hi - lo, dtype=meta.dtype)
        for s in inside:
            a, b = max(lo, s.start), min(hi, s.start + s.numel)
            out[a - lo : b - lo] = values(s.flat[s.at + a - s.start : s.at + b - s.start])
        return out.view(out_shape)


@dataclass(frozen=True)
class Whole:
    """A tensor saved whole (of any strides), read by rows and cast to the meta's dtype."""

    tensor: torch.Tensor

    def read(self, meta: TensorMeta, rows: Rows) -> torch.Tensor:
        """Return ``rows`` of the tensor (all of it for None) in ``meta``'s dtype."""
        t = self.tensor if rows is None or not meta.shape else self.tensor[rows[0] : rows[1]]
        t = values(t)
        return t if t.dtype == meta.dtype else t.to(meta.dtype)


Source = Spans | Whole


def spans_of(flat_of: Callable[[int, int], torch.Tensor], pieces: Sequence) -> Spans:
    """Return the ``Spans`` of ``pieces`` (``partitions.Piece``); ``flat_of(rank, flat)`` is the tensor each lies in."""
    return Spans(tuple(Span(flat_of(p.rank, p.flat), p.at, p.start, p.numel) for p in pieces))
