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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

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


def _row_runs(name: str, meta: TensorMeta, order: Iterable[int]) -> list[Run]:
    """Return runs taking ``meta``'s rows in ``order``, adjacent rows joined into one run."""
    row = meta.numel // meta.shape[0]
    out: list[Run] = []
    for r in order:
        if out and out[-1].stop == r * row:
            out[-1] = Run(name, out[-1].start, (r + 1) * row)
        else:
            out.append(Run(name, r * row, (r + 1) * row))
    return out


class _Context:
    """A mapping at given sizes: its ranges' indices, each rule's name patterns."""

    def __init__(self, amap: ArchMap, sizes: Mapping[str, int], where: str):
        self.amap = amap
        self.sizes = sizes
        self.where = where
        self.ranges = amap.range_values(sizes)

    def match(self, names: Iterable[str], side: str) -> tuple[dict, list[str], list[str]]:
        """Return ``{name: (rule, indices)}`` for each name of ``side`` a rule covers, the names none covers, and why."""
        patterns = [(rule, pattern(rule, side)) for rule in self.amap.rules]
        found: dict[str, tuple[Rule, dict[str, int]]] = {}
        uncovered, why = [], []
        for name in names:
            hits = []
            outside = None
            for rule, pat in patterns:
                m = pat.fullmatch(name)
                if m is None:
                    continue
                indices = {k: int(v) for k, v in m.groupdict().items()}
                bad = [k for k, v in indices.items() if v not in self.ranges[k]]
                if bad:
                    outside = outside or (bad[0], indices[bad[0]])
                else:
                    hits.append((rule, indices))
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

    def expected(self, rule: Rule, side: str) -> list[dict[str, int]]:
        """Return every index combination ``rule`` expects names of ``side`` for."""
        keys = rule.placeholders(side)
        if side == "target" and rule.unstack is not None:
            keys = [k for k in keys if k != rule.unstack]
        combos = itertools.product(*(self.ranges[k] for k in keys))
        return [dict(zip(keys, combo)) for combo in combos]


def forward(
    amap: ArchMap, sizes: Mapping[str, int], source: Mapping[str, TensorMeta], where: str
) -> Mapped:
    """Return the Hugging Face tensors ``amap`` makes of ``source`` (name to meta), proven."""
    ctx = _Context(amap, sizes, where)
    found, uncovered, why = ctx.match(source, "source")
    _refuse_uncovered(uncovered, why, source, where)
    _refuse_missing(ctx, "source", set(source))
    metas: dict[str, TensorMeta] = {}
    runs: dict[str, tuple[Run, ...]] = {}

    def put(name: str, meta: TensorMeta, parts: list[Run]) -> None:
        if name in metas:
            raise BadInputError(
                f"maps two tensors to '{name}'", path=amap.file, hint="fix the mapping's 'to' names"
            )
        metas[name] = TensorMeta(name, meta.shape, meta.dtype)
        runs[name] = tuple(parts)

    for rule in amap.rules:
        for name, (r, indices) in found.items():
            if r is not rule:
                continue
            meta = source[name]
            if rule.unstack is not None:
                count = len(ctx.ranges[rule.unstack])
                _check_dim0(meta, name, count, f"{rule.unstack}s", where)
                slab = meta.numel // count if count else 0
                for k, index in enumerate(ctx.ranges[rule.unstack]):
                    out = rule.target.format(**indices, **{rule.unstack: index})
                    part = TensorMeta(out, meta.shape[1:], meta.dtype)
                    put(out, part, [Run(name, k * slab, (k + 1) * slab)])
            elif rule.rope is not None:
                heads = sizes[rule.rope]
                _check_rope(meta, name, heads, rule.rope, where)
                order = rope_order(meta.shape[0], heads)
                put(rule.target.format(**indices), meta, _row_runs(name, meta, order))
            else:
                put(rule.target.format(**indices), meta, [Run(name, 0, meta.numel)])
    mapped = Mapped(metas, runs)
    prove(mapped, source, where)
    return mapped


def backward(
    amap: ArchMap, sizes: Mapping[str, int], hf: Mapping[str, TensorMeta], where: str
) -> Mapped:
    """Return the source-family tensors ``amap`` makes of Hugging Face's ``hf`` (name to meta), proven."""
    ctx = _Context(amap, sizes, where)
    found, uncovered, why = ctx.match(hf, "target")
    _refuse_uncovered(uncovered, why, hf, where)
    _refuse_missing(ctx, "target", set(hf))
    metas: dict[str, TensorMeta] = {}
    runs: dict[str, tuple[Run, ...]] = {}
    for rule in amap.rules:
        mine = {n: idx for n, (r, idx) in found.items() if r is rule}
        if rule.unstack is not None:
            groups: dict[str, list[tuple[int, str]]] = {}
            for name, indices in mine.items():
                own = {k: v for k, v in indices.items() if k != rule.unstack}
                groups.setdefault(rule.source.format(**own), []).append(
                    (indices[rule.unstack], name)
                )
            for out, parts in groups.items():
                parts.sort()
                first = hf[parts[0][1]]
                for _, name in parts:
                    _check_alike(hf[name], first, name, parts[0][1], where)
                shape = (len(parts), *first.shape)
                metas[out] = TensorMeta(out, shape, first.dtype)
                runs[out] = tuple(Run(name, 0, hf[name].numel) for _, name in parts)
            continue
        for name, indices in mine.items():
            meta = hf[name]
            out = rule.source.format(**indices)
            metas[out] = TensorMeta(out, meta.shape, meta.dtype)
            if rule.rope is not None:
                heads = sizes[rule.rope]
                _check_rope(meta, name, heads, rule.rope, where)
                order = rope_order(meta.shape[0], heads)
                inverse = [0] * len(order)
                for hf_row, titan_row in enumerate(order):
                    inverse[titan_row] = hf_row
                runs[out] = tuple(_row_runs(name, meta, inverse))
            else:
                runs[out] = (Run(name, 0, meta.numel),)
    mapped = Mapped(metas, runs)
    prove(mapped, hf, where)
    return mapped


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


def _refuse_missing(ctx: _Context, side: str, names: set[str]) -> None:
    missing = []
    for rule in ctx.amap.rules:
        text = getattr(rule, side)
        for indices in ctx.expected(rule, side):
            if side == "target" and rule.unstack is not None:
                for index in ctx.ranges[rule.unstack]:
                    name = text.format(**indices, **{rule.unstack: index})
                    if name not in names:
                        missing.append(name)
                continue
            name = text.format(**indices)
            if name not in names:
                missing.append(name)
    if missing:
        raise BadInputError(
            f"lacks {counted(len(missing), 'tensor')} the mapping '{ctx.amap.name}' expects at "
            f"its config's sizes, e.g. '{missing[0]}'",
            path=ctx.where,
            hint="pass the config of this model (--hf-config), or --map the mapping of its "
            "architecture",
        )


def _check_dim0(meta: TensorMeta, name: str, count: int, what: str, where: str) -> None:
    if not meta.shape or meta.shape[0] != count:
        held = meta.shape[0] if meta.shape else 0
        raise BadInputError(
            f"'{name}' holds {held} {what} on dim 0, and the config says {count}",
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


def _check_alike(meta: TensorMeta, first: TensorMeta, name: str, other: str, where: str) -> None:
    if (meta.shape, meta.dtype) != (first.shape, first.dtype):
        raise BadInputError(
            f"'{name}' is {list(meta.shape)} {meta.dtype}, unlike '{other}' "
            f"({list(first.shape)} {first.dtype}), which it is stacked with",
            path=where,
            hint="every expert of a layer must have one shape and dtype",
        )
