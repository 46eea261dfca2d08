"""A mapping applied to a source's tensors (pure): each output tensor as runs of source elements, and the proof they add up.

Every operation a mapping names moves whole rows, so each output tensor is a list of
``Run``s, "elements [start, stop) of source tensor ``name``", laid end to end in the
output's row-major order: a rename is one run, an expert of a grouped tensor one run of
its slab, a RoPE permutation one run per row. ``forward`` goes source -> Hugging Face,
``backward`` Hugging Face -> source (the same rules, the runs inverted).

Before anything is read, ``prove`` checks the coverage: every element of every source
tensor lands in exactly one output tensor, and every output tensor is wholly written.
A source tensor no rule covers (or whose index lies outside the mapping's ranges), a
tensor the rules expect and the source lacks, or a count on dim 0 that differs from the
config's is exit 3 naming it: nothing is left out unless ``--drop`` says so.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from math import prod

from shardckpt.core.errors import BadInputError
from shardckpt.core.words import counted
from shardckpt.plan.mapping.rules import ArchMap, Rule, pattern
from shardckpt.state.tree import TensorMeta


@dataclass(frozen=True, slots=True)
class Run:
    """Elements [start, stop) of source tensor ``name`` (row-major)."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class Ledger:
    """What a mapping did with the source's bytes: tensors and bytes in, out, dropped."""

    tensors_in: int
    bytes_in: int
    tensors_out: int
    bytes_out: int
    dropped: tuple[str, ...] = ()
    """Source tensors ``--drop`` left out, by name."""
    bytes_dropped: int = 0

    def as_json(self) -> dict:
        """Return the ledger as the ``convert --json`` summary holds it."""
        return {
            "in": {"tensors": self.tensors_in, "bytes": self.bytes_in},
            "out": {"tensors": self.tensors_out, "bytes": self.bytes_out},
            "dropped": {
                "tensors": len(self.dropped),
                "bytes": self.bytes_dropped,
                "names": list(self.dropped),
            },
        }


@dataclass(frozen=True)
class Mapped:
    """The output of a mapping: each tensor's metadata and runs, in rule order, and its ledger."""

    metas: dict[str, TensorMeta]
    """Each output tensor by name (its ``key`` is the name)."""
    runs: dict[str, tuple[Run, ...]]
    ledger: Ledger = field(default_factory=lambda: Ledger(0, 0, 0, 0))


def rope_order(rows: int, heads: int) -> list[int]:
    """Return, for each row of Hugging Face's q/k weight, the row of torchtitan's it is.

    torchtitan's adapter (``_permute``): ``w.view(heads, rows // heads // 2, 2, dim)
    .transpose(1, 2)``: in each head, the pairs (2i, 2i + 1) torchtitan's complex RoPE
    rotates become rows i and i + half, as Hugging Face's ``rotate_half`` rotates them.
    """
    per_head = rows // heads
    half = per_head // 2
    return [h * per_head + 2 * i + j for h in range(heads) for j in range(2) for i in range(half)]


def split_rows(rule: Rule, rows: int, sizes: Mapping[str, int]) -> list[list[int]] | None:
    """Return the rows of a part of ``rows`` rows that each of ``rule``'s targets takes, in order; None when they do not divide."""
    n = len(rule.targets)
    if rule.split == "chunks":
        if rows % n:
            return None
        size = rows // n
        return [list(range(i * size, (i + 1) * size)) for i in range(n)]
    heads, groups = sizes[rule.heads], sizes[rule.groups]  # type: ignore[index]
    if groups <= 0 or heads % groups or rows % (heads + 2 * groups):
        return None
    head = rows // (heads + 2 * groups)
    per_group = heads // groups
    q: list[int] = []
    k: list[int] = []
    v: list[int] = []
    for g in range(groups):
        base = g * (per_group + 2) * head
        q += range(base, base + per_group * head)
        k += range(base + per_group * head, base + (per_group + 1) * head)
        v += range(base + (per_group + 1) * head, base + (per_group + 2) * head)
    return [q, k, v]


def _row_runs(name: str, base: int, row: int, order: Iterable[int]) -> list[Run]:
    """Return runs taking rows of ``row`` elements in ``order`` from element ``base`` of ``name``, adjacent rows joined."""
    out: list[Run] = []
    for r in order:
        start = base + r * row
        if out and out[-1].stop == start:
            out[-1] = Run(name, out[-1].start, start + row)
        else:
            out.append(Run(name, start, start + row))
    return out


class _Context:
    """A mapping at given sizes: its ranges' indices, each rule's name patterns."""

    def __init__(self, amap: ArchMap, sizes: Mapping[str, int], where: str):
        self.amap = amap
        self.sizes = sizes
        self.where = where
        self.ranges = amap.range_values(sizes)

    def match(self, names: Iterable[str], side: str) -> tuple[dict, list[str], list[str]]:
        """Return ``{name: (rule, target, indices)}`` for each name of ``side`` a rule covers, the names none covers, and why."""
        patterns = [
            (rule, t, pattern(rule, side, t))
            for rule in self.amap.rules
            for t in (range(len(rule.targets)) if side == "target" else (0,))
        ]
        found: dict[str, tuple[Rule, int, dict[str, int]]] = {}
        uncovered, why = [], []
        for name in names:
            hits = []
            outside = None
            for rule, t, pat in patterns:
                m = pat.fullmatch(name)
                if m is None:
                    continue
                indices = {k: int(v) for k, v in m.groupdict().items()}
                bad = [k for k, v in indices.items() if v not in self.ranges[k]]
                if bad:
                    outside = outside or (bad[0], indices[bad[0]])
                else:
                    hits.append((rule, t, indices))
            if len(hits) == 1:
                found[name] = hits[0]
                continue
            if len(hits) > 1:
                raise BadInputError(
                    f"two rules map '{name}': '{hits[0][0].source}' and '{hits[1][0].source}'",
                    path=self.amap.file,
                    hint="make the rules' names or ranges tell them apart",
                )
            uncovered.append(name)
            if outside is not None:
                r = self.ranges[outside[0]]
                why.append(
                    f"its {outside[0]} {outside[1]} is outside the mapping's "
                    f"{r.start}..{r.stop - 1}"
                )
            else:
                why.append("no rule of the mapping names it")
        return found, uncovered, why

    def expected(self, rule: Rule) -> list[dict[str, int]]:
        """Return every index combination of ``rule``'s source names."""
        keys = rule.placeholders("source")
        combos = itertools.product(*(self.ranges[k] for k in keys))
        return [dict(zip(keys, combo)) for combo in combos]


def forward(
    amap: ArchMap, sizes: Mapping[str, int], source: Mapping[str, TensorMeta], where: str
) -> Mapped:
    """Return the Hugging Face tensors ``amap`` makes of ``source`` (name to meta), proven."""
    ctx = _Context(amap, sizes, where)
    found, uncovered, why = ctx.match(source, "source")
    _refuse_uncovered(uncovered, why, source, where)
    _refuse_missing(ctx, set(source))
    metas: dict[str, TensorMeta] = {}
    runs: dict[str, tuple[Run, ...]] = {}
    for rule in amap.rules:
        for name, (r, _, indices) in found.items():
            if r is rule:
                for out, meta, parts in _outputs(ctx, rule, name, source[name], indices):
                    if out in metas:
                        raise BadInputError(
                            f"maps two tensors to '{out}'",
                            path=amap.file,
                            hint="fix the mapping's 'to' names",
                        )
                    metas[out], runs[out] = meta, tuple(parts)
    mapped = Mapped(metas, runs)
    prove(mapped, source, where)
    return mapped


def _outputs(
    ctx: _Context, rule: Rule, name: str, meta: TensorMeta, indices: dict[str, int]
) -> Iterator[tuple[str, TensorMeta, list[Run]]]:
    """Yield each tensor ``rule`` makes of source tensor ``name``: its name, meta and runs."""
    where = ctx.where
    if rule.unstack:
        counts = [len(ctx.ranges[r]) for r in rule.unstack]
        for dim, (axis, count) in enumerate(zip(rule.unstack, counts)):
            _check_dim(meta, name, dim, count, f"{axis}s", where)
        slab = meta.numel // prod(counts) if prod(counts) else 0
        combos = itertools.product(*(ctx.ranges[r] for r in rule.unstack))
        pieces = [
            ({**indices, **dict(zip(rule.unstack, combo))}, meta.shape[len(counts) :], k * slab)
            for k, combo in enumerate(combos)
        ]
    else:
        pieces = [(indices, meta.shape, 0)]
    for bound, shape, base in pieces:
        numel = prod(shape)
        row = numel // shape[0] if shape and shape[0] else 1
        if rule.split is not None:
            parts = split_rows(rule, shape[0] if shape else 0, ctx.sizes) if shape else None
            if parts is None:
                raise BadInputError(
                    f"'{name}' has {shape[0] if shape else 0} rows per part, which do not "
                    f"divide as split '{rule.split}' divides them at the config's sizes",
                    path=where,
                    hint="pass the config of this model (--hf-config)",
                )
            for target, rows in zip(rule.targets, parts):
                out = target.format(**bound)
                yield (
                    out,
                    TensorMeta(out, (len(rows), *shape[1:]), meta.dtype),
                    _row_runs(name, base, row, rows),
                )
            continue
        out = rule.targets[0].format(**bound)
        if rule.rope is not None:
            heads = ctx.sizes[rule.rope]
            _check_rope(meta, name, heads, rule.rope, where)
            order = rope_order(shape[0], heads)
            parts_ = _row_runs(name, base, row, order)
        else:
            parts_ = [Run(name, base, base + numel)]
        yield out, TensorMeta(out, tuple(shape), meta.dtype), parts_


def backward(
    amap: ArchMap, sizes: Mapping[str, int], hf: Mapping[str, TensorMeta], where: str
) -> Mapped:
    """Return the source-family tensors ``amap`` makes of Hugging Face's ``hf`` (name to meta), proven.

    The source tensors are inferred from ``hf``'s names and shapes, mapped forward, and
    the forward runs turned around; the forward mapping must give ``hf`` back exactly.
    """
    ctx = _Context(amap, sizes, where)
    found, uncovered, why = ctx.match(hf, "target")
    _refuse_uncovered(uncovered, why, hf, where)
    parts: dict[str, tuple[Rule, dict[str, int], dict[tuple[tuple, int], TensorMeta]]] = {}
    for name, (rule, t, indices) in found.items():
        own = {k: v for k, v in indices.items() if k not in rule.unstack}
        source = rule.source.format(**own)
        index = tuple(indices[r] for r in rule.unstack)
        parts.setdefault(source, (rule, own, {}))[2][(index, t)] = hf[name]
    inferred = {
        source: _inferred(ctx, source, rule, given) for source, (rule, _, given) in parts.items()
    }
    _refuse_missing(ctx, set(inferred))
    there = forward(amap, sizes, inferred, where)
    for name, meta in there.metas.items():
        got = hf.get(name)
        if got is None or (got.shape, got.dtype) != (meta.shape, meta.dtype):
            held = "lacks it" if got is None else f"holds {list(got.shape)} {got.dtype}"
            raise BadInputError(
                f"the mapping expects '{name}' as {list(meta.shape)} {meta.dtype}, and SRC {held}",
                path=where,
                hint="pass the config of this model (--hf-config), or --map the mapping of "
                "its architecture",
            )
    pieces: dict[str, list[tuple[int, Run]]] = {name: [] for name in inferred}
    for out, runs in there.runs.items():
        at = 0
        for run in runs:
            n = run.stop - run.start
            pieces[run.name].append((run.start, Run(out, at, at + n)))
            at += n
    back = {name: tuple(run for _, run in sorted(p)) for name, p in pieces.items()}
    mapped = Mapped(dict(inferred), back)
    prove(mapped, hf, where)
    return mapped


def _inferred(
    ctx: _Context, source: str, rule: Rule, given: dict[tuple[tuple, int], TensorMeta]
) -> TensorMeta:
    """Return the source tensor ``rule`` would map to ``given`` (its targets by (unstacked indices, target))."""
    first = next(iter(given.values()))
    one = next(iter(given))[0]
    if rule.split is not None:
        rows = sum(m.shape[0] for (i, _), m in given.items() if i == one and m.shape)
        shape = (rows, *first.shape[1:])
    else:
        shape = first.shape
    counts = tuple(len(ctx.ranges[r]) for r in rule.unstack)
    return TensorMeta(source, (*counts, *shape), first.dtype)


def prove(mapped: Mapped, source: Mapping[str, TensorMeta], where: str) -> None:
    """Check that ``mapped``'s runs take every element of ``source`` exactly once and fill every output.

    Raises ``BadInputError`` naming the first tensor that is not so; the rules make it
    so by construction, and this is the check that they did.
    """
    taken: dict[str, list[tuple[int, int]]] = {name: [] for name in source}
    for out, parts in mapped.runs.items():
        if sum(p.stop - p.start for p in parts) != mapped.metas[out].numel:
            raise BadInputError(
                f"'{out}' would not be wholly written by the mapping",
                path=where,
                hint="fix the mapping's rules for it",
            )
        for p in parts:
            taken[p.name].append((p.start, p.stop))
    for name, spans in taken.items():
        at = 0
        for start, stop in sorted(spans):
            if start != at:
                what = "read twice" if start < at else "left unread"
                raise BadInputError(
                    f"elements {min(start, at)}.. of '{name}' would be {what} by the mapping",
                    path=where,
                    hint="fix the mapping's rules for it, or --drop it",
                )
            at = stop
        if at != source[name].numel:
            raise BadInputError(
                f"elements {at}.. of '{name}' would be left unread by the mapping",
                path=where,
                hint="fix the mapping's rules for it, or --drop it",
            )


def _refuse_uncovered(
    names: list[str], why: list[str], source: Mapping[str, TensorMeta], where: str
) -> None:
    if names:
        size = sum(source[n].nbytes for n in names)
        raise BadInputError(
            f"{counted(len(names), 'tensor')} ({size} bytes) the mapping does not cover, e.g. "
            f"'{names[0]}' ({why[0]}): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}",
            path=where,
            hint="pass the config of this model (--hf-config), --drop what is not to be "
            "exported, or --map a mapping that covers it",
        )


def _refuse_missing(ctx: _Context, names: set[str]) -> None:
    missing = [
        rule.source.format(**indices)
        for rule in ctx.amap.rules
        for indices in ctx.expected(rule)
        if rule.source.format(**indices) not in names
    ]
    if missing:
        raise BadInputError(
            f"lacks {counted(len(missing), 'tensor')} the mapping '{ctx.amap.name}' expects at "
            f"its config's sizes, e.g. '{missing[0]}'",
            path=ctx.where,
            hint="pass the config of this model (--hf-config), or --map the mapping of its "
            "architecture",
        )


def _check_dim(meta: TensorMeta, name: str, dim: int, count: int, what: str, where: str) -> None:
    if len(meta.shape) <= dim or meta.shape[dim] != count:
        held = meta.shape[dim] if len(meta.shape) > dim else 0
        raise BadInputError(
            f"'{name}' holds {held} {what} on dim {dim}, and the config says {count}",
            path=where,
            hint="pass the config of this model (--hf-config)",
        )


def _check_rope(meta: TensorMeta, name: str, heads: int, size: str, where: str) -> None:
    if len(meta.shape) != 2 or heads <= 0 or meta.shape[0] % (2 * heads):
        raise BadInputError(
            f"'{name}' of shape {list(meta.shape)} is not {heads} heads ({size}) of an even "
            "number of rows each",
            path=where,
            hint="pass the config of this model (--hf-config)",
        )
