"""The source rows a step's regions lie in, read with one ``read_spans`` call, as bytes per region."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from shardckpt.codecs.tensor_bytes import contiguous_bytes
from shardckpt.formats.base import Reader
from shardckpt.state.regions import Region, nbytes, row_elements, rows_of
from shardckpt.state.tree import TensorMeta

GAP_BYTES = 64 * 1024
"""Rows of one tensor this far apart or closer are read as one span, gap included: a process
acts for every N-th target rank (``Placement.targets``), so its shards of a small tensor lie
a shard apart, and one read per shard (a thousand target ranks' worth) costs more than
reading the rows between them. What the gaps add is capped at the bytes the step needs."""


def read_regions(
    reader: Reader, batch: Sequence[Region], metas: Mapping[str, TensorMeta], runtime
) -> tuple[Callable[[Region], memoryview], int]:
    """Read the rows ``batch``'s regions lie in; return a lookup (region -> its bytes) and the bytes read.

    Regions of one tensor whose rows touch or overlap (one tensor's shards of
    consecutive target ranks) are read once, and so are rows at most ``GAP_BYTES`` apart;
    rows further apart are separate requests. One ``read_spans`` call per step, on every rank, even with
    nothing to read: a reader whose reads are collectives (``exchange.SharedReader``)
    needs every rank in each.
    """
    spans: dict[str, list[list[int] | None]] = {}
    needed = extra = 0
    for region in batch:
        if region.stop <= region.start:
            continue
        meta = metas[region.key]
        rows = rows_of(region, meta)
        known = spans.setdefault(region.key, [])
        needed += nbytes(region, metas)
        if rows is None:
            known[:] = [None]
            continue
        last = known[-1] if known else None
        if last is not None and rows[0] <= last[1] and last[0] <= rows[1]:
            # The common case, regions in row order: grow the last span.
            last[0], last[1] = min(last[0], rows[0]), max(last[1], rows[1])
            continue
        if last is not None and rows[0] > last[1]:
            gap = (rows[0] - last[1]) * (row_elements(meta) or 1) * meta.dtype.itemsize
            if gap <= GAP_BYTES and extra + gap <= needed:
                extra += gap
                last[1] = rows[1]
                continue
        for span in known:
            if span is not None and rows[0] <= span[1] and span[0] <= rows[1]:
                span[0], span[1] = min(span[0], rows[0]), max(span[1], rows[1])
                break
        else:
            known.append(list(rows))
    asked = [(key, k) for key, v in spans.items() for k in range(len(v))]
    requests = [
        (metas[key], None if spans[key][k] is None else tuple(spans[key][k])) for key, k in asked
    ]
    tensors = reader.read_spans(requests, runtime)
    got: dict[tuple[str, int], tuple[memoryview, int]] = {}
    read = 0
    for place, tensor in zip(asked, tensors):
        data = contiguous_bytes(tensor)
        got[place] = (data, tensor.element_size())
        read += len(data)

    def lookup(region: Region) -> memoryview:
        meta = metas[region.key]
        rows = rows_of(region, meta)
        for k, span in enumerate(spans[region.key]):
            if span is None or span[0] <= rows[0] and rows[1] <= span[1]:
                first = 0 if span is None else span[0] * row_elements(meta)
                data, size = got[(region.key, k)]
                out = data[(region.start - first) * size : (region.stop - first) * size]
                if len(out) != nbytes(region, metas):
                    raise RuntimeError(
                        f"internal: read {len(out)} bytes of '{meta.key}' for a region of "
                        f"{nbytes(region, metas)}"
                    )
                return out
        raise RuntimeError(f"internal: no read holds a region of '{region.key}'")

    return lookup, read
