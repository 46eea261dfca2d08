"""Leaf-by-leaf comparison of two checkpoints of any formats (``diff`` and ``--verify``).

Each rank compares only its rows of every tensor, batch by batch; the per-tensor
verdicts and largest differences are reduced across ranks, so no process reads or
holds either checkpoint whole.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field

from shardckpt.core import lazy_torch
from shardckpt.core.lazy_torch import torch
from shardckpt.engine.exchange import SharedReader
from shardckpt.engine.side_by_side import pieces, side_by_side
from shardckpt.engine.stored_compare import same_stored
from shardckpt.formats.base import Reader
from shardckpt.plan.plan import SKIP, batches, rows_to_read
from shardckpt.state.choices import DEFAULT_BUFFER_BYTES
from shardckpt.state.tree import Path, TensorMeta, containers, walk
from shardckpt.state.values import tensors_differ, values_equal


@dataclass(frozen=True)
class Difference:
    """One differing leaf: its path, why it differs and, for tensors, the largest |a - b|."""

    path: Path
    reason: str
    max_abs_diff: float | None = None


@dataclass(frozen=True)
class Cast:
    """Tensors compared in a dtype wider than one side's (``diff --cast``): A's, B's, the one used."""

    dtype_a: torch.dtype
    dtype_b: torch.dtype
    wider: torch.dtype


class TorchNeeded(Exception):
    """Raised by a comparison in a process without torch where some pairs must be compared by value.

    Their readers read metadata into stand-ins (``state.dtypes``), which torch's path
    cannot read tensors with: the caller imports torch, opens both sides again and compares
    with ``settled``, the pairs already found to hold the same bytes, left out.
    """

    def __init__(self, settled: frozenset):
        super().__init__("some tensors differ in their bytes: compared by value, with torch")
        self.settled = settled


@dataclass
class DiffResult:
    """What ``diff`` found: the differing leaves, how many were compared, and casts made."""

    differences: list[Difference] = field(default_factory=list)
    compared: int = 0
    casts: dict[Cast, int] = field(default_factory=dict)
    """With ``cast``: each dtype change and how many tensors it was made for."""

    @property
    def equal(self) -> bool:
        """Return whether no leaf differs."""
        return not self.differences


def compare(
    a: Reader,
    tree_a: dict,
    b: Reader,
    tree_b: dict,
    runtime,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    cast: bool = False,
    progress=lambda n: None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    settled: frozenset = frozenset(),
) -> DiffResult:
    """Return how ``tree_a`` (read through ``a``) differs from ``tree_b`` (through ``b``).

    With ``cast``, floating tensors whose dtypes differ are compared in the wider of the
    two (an fp32 checkpoint against its bf16 export), and the change is counted once per
    pair of dtypes in ``DiffResult.casts``, not reported per tensor. Every tensor present
    on both sides is read and compared (its checksums checked as it is read): a digest a
    file carries vouches for no byte that was not checked against it. The two sides' batches together hold at most ``buffer_bytes`` of tensor data.

    In one process, a pair whose bytes lie in both sides' files as they are is compared
    as bytes (``stored_compare``); only the others become tensors. Without torch
    imported, those raise ``TorchNeeded``; ``settled``: the paths of pairs a pass before
    found to hold the same bytes, not read again.
    """
    leaves_a, leaves_b = dict(walk(tree_a)), dict(walk(tree_b))
    result = DiffResult(compared=len(set(leaves_a) | set(leaves_b)))
    # Structure first: a list on one side and a dict with the same keys on the other
    # hold leaves at the same paths, but they are not the same checkpoint.
    kinds_b = dict(containers(tree_b))
    for path, kind in containers(tree_a):
        if kinds_b.get(path, kind) != kind:
            result.differences.append(Difference(path, f"a {kind} in A, a {kinds_b[path]} in B"))
    pairs: list[tuple[Path, TensorMeta, TensorMeta]] = []
    wider_of: dict[Path, torch.dtype] = {}
    for path in list(leaves_a) + [p for p in leaves_b if p not in leaves_a]:
        if path not in leaves_b:
            result.differences.append(Difference(path, "only in A"))
        elif path not in leaves_a:
            result.differences.append(Difference(path, "only in B"))
        else:
            x, y = leaves_a[path], leaves_b[path]
            wider = _wider(x, y) if cast else None
            if wider is not None:
                key = Cast(x.dtype, y.dtype, wider)
                result.casts[key] = result.casts.get(key, 0) + 1
                wider_of[path] = wider
                # Compared as metadata in the wider dtype; read in their own.
                x, y = (dataclasses.replace(m, dtype=wider) for m in (x, y))
            reason = _leaf_difference(x, y)
            if reason:
                result.differences.append(Difference(path, reason))
            elif isinstance(leaves_a[path], TensorMeta):
                pairs.append((path, leaves_a[path], leaves_b[path]))
    rules = _Rules(atol, rtol, wider_of, buffer_bytes)
    # A reader whose reads are collectives needs every rank in the same rounds.
    collective = isinstance(a, SharedReader) or isinstance(b, SharedReader)
    for path, ma, _ in pairs:
        if path in settled:
            progress(ma.nbytes)
    pairs = [pair for pair in pairs if pair[0] not in settled]
    if not collective and runtime.world_size == 1:
        left = _by_stored_bytes(a, b, pairs, wider_of, progress)
        if left and not lazy_torch.loaded():
            same = {path for path, _, _ in pairs} - {path for path, _, _ in left}
            raise TorchNeeded(frozenset(same) | settled)
        pairs = left
    read = _compare_in_rounds if collective else _compare_side_by_side
    worst = read(a, b, pairs, runtime, rules, progress) if pairs else []
    for (path, _, _), (bad, diff) in zip(pairs, worst):
        if bad:
            result.differences.append(Difference(path, "values differ", diff))
    order: dict[Path, int] = {}
    for p in [*(p for p, _ in containers(tree_a)), *leaves_a, *leaves_b]:
        order.setdefault(p, len(order))
    result.differences.sort(key=lambda d: order[d.path])
    return result


def _by_stored_bytes(
    a: Reader, b: Reader, pairs: list[Pair], wider_of: dict, progress
) -> list[Pair]:
    """Return the pairs whose stored bytes differ or could not be compared as bytes (one process).

    The rest hold the same bytes on both sides, so they are equal (``stored_compare``):
    read and checked, but never made tensors. A pair compared in a wider dtype is left
    to torch (its bytes differ by definition).
    """
    left = []
    for pair in pairs:
        path, ma, mb = pair
        if path not in wider_of and same_stored(a, ma, b, mb):
            progress(ma.nbytes)
        else:
            left.append(pair)
    return left


def _wider(x: object, y: object) -> torch.dtype | None:
    """Return the dtype two floating tensors of different dtypes are compared in, else None."""
    if not (isinstance(x, TensorMeta) and isinstance(y, TensorMeta)) or x.dtype == y.dtype:
        return None
    if not (x.dtype.is_floating_point and y.dtype.is_floating_point):
        return None
    return torch.promote_types(x.dtype, y.dtype)


def _leaf_difference(x: object, y: object) -> str:
    """Return why two leaves differ without reading tensor data ('' when they may be equal)."""
    tx, ty = isinstance(x, TensorMeta), isinstance(y, TensorMeta)
    if tx != ty:
        return "tensor in one, value in the other"
    if tx:
        if x.shape != y.shape:
            return f"shape {list(x.shape)} vs {list(y.shape)}"
        if x.dtype != y.dtype:
            return f"dtype {str(x.dtype).removeprefix('torch.')} vs {str(y.dtype).removeprefix('torch.')}"
        return ""
    return "" if values_equal(x, y) else f"value {x!r} vs {y!r}"


Pair = tuple[Path, TensorMeta, TensorMeta]


@dataclass(frozen=True)
class _Rules:
    """How the pairs' data are compared: tolerances, the dtype of each cast pair, the buffer."""

    atol: float
    rtol: float
    wider_of: dict[Path, torch.dtype]
    buffer_bytes: int

    def differ(self, path: Path, x: torch.Tensor, y: torch.Tensor) -> tuple[bool, float]:
        """Return whether the data ``x`` and ``y`` at ``path`` differ, and their largest difference."""
        wider = self.wider_of.get(path)
        if wider is not None:
            x, y = x.to(wider), y.to(wider)
        return tensors_differ(x.cpu(), y.cpu(), self.atol, self.rtol)


def _compare_side_by_side(
    a: Reader, b: Reader, pairs: list[Pair], runtime, rules: _Rules, progress
) -> list[tuple[bool, float]]:
    """Return (differs, max |a-b|) per pair, each rank comparing its rows, both sides read at once."""
    wanted = _rows_of_this_rank(pairs, runtime)
    mine = [i for i, r in enumerate(wanted) if r != SKIP]
    flags = torch.zeros(len(pairs), dtype=torch.float64)
    diffs = torch.zeros(len(pairs), dtype=torch.float64)

    def run() -> None:
        # A quarter of the buffer a batch: each side holds the batch compared and the one read.
        limit = max(1, rules.buffer_bytes // 4)
        batches = pieces([(*pairs[i][1:], wanted[i]) for i in mine], limit)
        left = Counter(p.pair for batch in batches for p in batch)
        progress(sum(pairs[i][1].nbytes for n, i in enumerate(mine) if not left[n]))
        with closing(side_by_side(a, b, batches, runtime)) as stream:
            for batch, xs, ys in stream:
                for piece, x, y in zip(batch, xs, ys):
                    i = mine[piece.pair]
                    bad, diff = rules.differ(pairs[i][0], x, y)
                    flags[i] = max(float(flags[i]), 1.0 if bad else 0.0)
                    diffs[i] = max(float(diffs[i]), diff)
                    left[piece.pair] -= 1
                    if not left[piece.pair]:
                        progress(piece.meta_a.nbytes)

    # One agreement for the whole comparison: ranks read different numbers of batches.
    runtime.agreed(run)
    return _over_ranks(runtime, flags, diffs)


def _compare_in_rounds(
    a: Reader, b: Reader, pairs: list[Pair], runtime, rules: _Rules, progress
) -> list[tuple[bool, float]]:
    """Return (differs, max |a-b|) per pair, read a batch of both sides at a time, as every rank does."""
    worst: list[tuple[bool, float]] = []
    for group in batches([ma for _, ma, _ in pairs], max(1, rules.buffer_bytes // 2)):
        chunk = pairs[len(worst) : len(worst) + len(group)]
        worst += _compare_rows(a, b, chunk, runtime, rules)
        progress(sum(m.nbytes for m in group))
    return worst


def _rows_of_this_rank(pairs: list[Pair], runtime) -> list:
    """Return the rows of each pair's A side this rank compares (``SKIP``: none)."""
    return [
        rows_to_read(ma, runtime.world_size, runtime.rank, whole_on_coordinator=True)
        for _, ma, _ in pairs
    ]


def _over_ranks(runtime, flags: torch.Tensor, diffs: torch.Tensor) -> list[tuple[bool, float]]:
    """Return each pair's (differs, max |a-b|), the largest over the ranks."""
    runtime.max_over_ranks(flags)
    runtime.max_over_ranks(diffs)
    return [(bool(f), float(d)) for f, d in zip(flags.tolist(), diffs.tolist())]


def _compare_rows(
    a: Reader, b: Reader, chunk: list[Pair], runtime, rules: _Rules
) -> list[tuple[bool, float]]:
    """Return (differs, max |a-b|) per tensor, each rank comparing its rows, reduced over ranks."""
    wanted = _rows_of_this_rank(chunk, runtime)
    mine = [(ma, mb, r, p) for (p, ma, mb), r in zip(chunk, wanted) if r != SKIP]

    def read_both():
        # Called on every rank even with nothing to read: a reader whose reads are
        # collectives (exchange.SharedReader) needs every rank in each.
        xs = a.read([m for m, _, _, _ in mine], [r for _, _, r, _ in mine], runtime)
        ys = b.read([m for _, m, _, _ in mine], [r for _, _, r, _ in mine], runtime)
        return xs, ys

    xs, ys = runtime.agreed(read_both)
    flags = torch.zeros(len(chunk), dtype=torch.float64)
    diffs = torch.zeros(len(chunk), dtype=torch.float64)
    it = iter(zip(xs, ys, (path for *_, path in mine)))
    for i, r in enumerate(wanted):
        if r == SKIP:
            continue
        x, y, path = next(it)
        bad, diff = rules.differ(path, x, y)
        flags[i] = 1.0 if bad else 0.0
        diffs[i] = diff
    return _over_ranks(runtime, flags, diffs)
