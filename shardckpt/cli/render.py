"""Turning results into what rank 0 prints: readable tables, or one JSON document."""

from __future__ import annotations

import math
import shutil
import textwrap
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, NamedTuple

from shardckpt.core.progress import human_bytes
from shardckpt.core.words import counted
from shardckpt.state.tree import TensorMeta, dotted, path_to_json

if TYPE_CHECKING:  # the results' modules import torch; ``inspect`` and ``verify`` need neither
    from shardckpt.api import ConvertResult, Inspection, Integrity
    from shardckpt.engine.compare import DiffResult

SCHEMA_VERSION = 1
TABLE_WIDTH = (80, 100)
"""The narrowest and the widest ``inspect`` table: the terminal's width, within these."""


def dtype_name(dtype) -> str:
    """Return ``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def jsonable(value: object) -> object:
    """Return ``value`` in a form ``json.dumps`` writes as strict JSON (tuples as lists)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)


# ---------------------------------------------------------------- inspect


def inspection_json(insp: Inspection, shards: bool = False) -> dict:
    """Return the ``inspect --json`` document (schema 1)."""
    entries = []
    by_dtype: dict[str, int] = defaultdict(int)
    count = total = 0
    for path, leaf in insp.leaves:
        if isinstance(leaf, TensorMeta):
            entry = {
                "path": path_to_json(path),
                "kind": "tensor",
                "shape": list(leaf.shape),
                "dtype": dtype_name(leaf.dtype),
                "nbytes": leaf.nbytes,
                "layout": leaf.layout,
            }
            if shards:
                entry["shards"] = [
                    {"rank": c.rank, "offsets": list(c.offsets), "sizes": list(c.sizes)}
                    for c in (leaf.chunks or ())
                ] or [{"rank": 0, "offsets": [0] * len(leaf.shape), "sizes": list(leaf.shape)}]
            entries.append(entry)
            by_dtype[dtype_name(leaf.dtype)] += leaf.nbytes
            count += 1
            total += leaf.nbytes
        else:
            entries.append({"path": path_to_json(path), "kind": "value", "value": jsonable(leaf)})
    optimizers = [
        {
            "path": path_to_json(o.path),
            "key_type": o.key_type,
            "num_params": o.num_params,
            "state_names": list(o.state_names),
            "num_groups": o.num_groups,
            "param_names": o.param_names,
        }
        for o in insp.optimizers
    ]
    doc = {
        "schema": SCHEMA_VERSION,
        "format": insp.index.format,
        "world_size": insp.index.world_size,
        "entries": entries,
        "optimizers": optimizers,
        "totals": {"tensors": count, "nbytes": total, "by_dtype": dict(sorted(by_dtype.items()))},
        "warnings": insp.warnings,
        "parts": [
            {"file": p.file, "format": p.format, "key": p.key, "note": p.note}
            for p in insp.index.parts
        ],
        "components": [
            {"name": c.name, "kind": c.kind, "keys": list(c.keys), "note": c.note}
            for c in insp.components
        ],
    }
    if insp.integrity is not None:
        doc["verify"] = verify_json(insp.integrity)
    return doc


def inspection_text(insp: Inspection, shards: bool = False, width: int = TABLE_WIDTH[1]) -> str:
    """Return the readable ``inspect`` report: leaves table (``width`` columns), optimizers, totals."""
    doc = inspection_json(insp, shards)
    lines = [f"{insp.index.src}: format {doc['format']}, world size {doc['world_size'] or '-'}", ""]
    rows: list[_Row] = [_Row("PATH", ("SHAPE", "DTYPE", "BYTES", "LAYOUT / VALUE"))]
    for e, (_, leaf) in zip(doc["entries"], insp.leaves):
        name = dotted(tuple(e["path"]))
        if e["kind"] == "tensor":
            shape = "x".join(map(str, e["shape"])) or "()"
            rows.append(_Row(name, (shape, e["dtype"], human_bytes(e["nbytes"]), e["layout"])))
            rows += [
                _Row("", (), f"  rank {s['rank']} at {s['offsets']} size {s['sizes']}", 1)
                for s in e.get("shards", [])
            ]
        else:
            rows.append(_Row(name, (), repr(leaf), 4))
    lines += _table(rows, width)
    for o in doc["optimizers"]:
        lines += [
            "",
            f"optimizer {dotted(tuple(o['path'])) or '(top level)'}: keys {o['key_type']}, "
            f"{counted(o['num_params'], 'param')}, {counted(o['num_groups'], 'param group')}, "
            f"state {', '.join(o['state_names']) or '(none yet)'}"
            + (", param names stored (--optim-keys needs no --model)" if o["param_names"] else ""),
        ]
    if doc["parts"]:
        lines += ["", "files:"]
        lines += [
            f"  {p['file']}: "
            + (
                f"{p['key']} ({p['format']})"
                if p["key"] is not None
                else f"carried unread, {p['note']}"
            )
            for p in doc["parts"]
        ]
    if doc["components"]:
        lines += ["", f"{doc['format']} parts:"]
        for c in doc["components"]:
            note = f", {c['note']}" if c["note"] else ""
            lines.append(f"  {c['name']}: {c['kind']}{note}")
    t = doc["totals"]
    lines += [
        "",
        f"total: {counted(t['tensors'], 'tensor')}, {human_bytes(t['nbytes'])}"
        + "".join(f"; {k} {human_bytes(v)}" for k, v in t["by_dtype"].items()),
    ]
    lines += [f"warning: {w}" for w in doc["warnings"]]
    if insp.integrity is not None:
        lines += ["", verify_text(insp.integrity)]
    return "\n".join(lines)


_GAP = "  "
_MIN_PATH = 24
_MIN_VALUE = 12


def table_width() -> int:
    """Return the width ``inspect``'s table fits: the terminal's, within ``TABLE_WIDTH`` (not a terminal: the widest)."""
    narrowest, widest = TABLE_WIDTH
    return min(widest, max(narrowest, shutil.get_terminal_size((widest, 24)).columns))


class _Row(NamedTuple):
    """A row of ``inspect``'s table: the path, then a cell per column, or one text from column ``at``."""

    path: str
    cells: tuple[str, ...]
    text: str = ""
    at: int = 1


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _wrapped(text: str, room: int) -> list[str]:
    """Return ``text`` in lines of at most ``room`` columns, broken between words."""
    if len(text) <= room:
        return [text]
    return textwrap.wrap(text, room, break_on_hyphens=False) or [""]


def _table(rows: list[_Row], width: int) -> list[str]:
    """Return ``rows`` as lines of at most ``width`` columns where the paths allow it.

    Paths are never cut (they are copied into --filter, --drop, --rename): one longer
    than its column is printed alone, its cells on the next line. The path column is as
    wide as keeps the table shortest; a layout longer than the room left wraps within
    it, and a value is shortened to it.
    """
    header = rows[0].cells
    cells = [r.cells for r in rows if r.cells]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header) - 1)]
    lead = sum(len(_GAP) + w for w in widths) + len(
        _GAP
    )  # the path column's end to the last's start
    longest = max(len(r.path) for r in rows)
    widest = max(min(_MIN_PATH, longest), width - lead - len(header[-1]))
    fits = sorted({min(len(r.path), widest) for r in rows} | {min(_MIN_PATH, longest)})

    def last(row: _Row, column: int) -> list[str]:
        room = max(len(header[-1]), width - column - lead)
        if not row.cells:
            return [_short(row.text, max(_MIN_VALUE, room))]
        return _wrapped(row.cells[-1], room)

    # Rows alike in path length and last cell make the table equally tall: count them once.
    kinds = Counter((len(r.path), r.cells[-1] if r.cells else None) for r in rows)

    def height(column: int) -> int:
        room = max(len(header[-1]), width - column - lead)
        return sum(
            n * ((size > column) + (len(_wrapped(cell, room)) if cell is not None else 1))
            for (size, cell), n in kinds.items()
        )

    column = min(reversed(fits), key=height)
    lines = []
    for row in rows:
        path = row.path
        if len(path) > column:
            lines.append(path)
            path = ""
        if row.cells:
            first, *more = last(row, column)
            middle = "".join(c.ljust(w) + _GAP for c, w in zip(row.cells, widths))
            lines.append((path.ljust(column) + _GAP + middle + first).rstrip())
            lines += [" " * (column + lead) + text for text in more]
        else:
            start = column + sum(len(_GAP) + w for w in widths[: row.at - 1]) + len(_GAP)
            text = last(row, column)[0] if row.at == len(header) else row.text
            lines.append((path.ljust(start) + text).rstrip())
    return lines


# ---------------------------------------------------------------- convert


def convert_json(result: ConvertResult, wall: float | None = None) -> dict:
    """Return the ``convert --json`` summary; ``seconds`` is ``wall`` (the command's) when given."""
    seconds = result.seconds if wall is None else wall
    doc = {
        "src": result.src,
        "dst": result.dst,
        "format": result.format,
        "layout": result.layout,
        "world_size": result.world_size,
        "tensors": result.tensors,
        "nbytes": result.nbytes,
        "values": result.values,
        "seconds": round(seconds, 3),
        "dry_run": result.dry_run,
    }
    if result.verified is not None:
        doc["verified"] = result.verified
    if result.dry_run and result.plan is not None:
        doc["batches"] = len(result.plan.batches)
    if result.plan is not None and result.plan.mapping is not None:
        doc["mapping"] = jsonable(result.plan.mapping)
    if result.costs is not None:
        doc["costs"] = {**result.costs, "wall_seconds": round(seconds, 3)}
    return doc


def convert_text(result: ConvertResult, wall: float | None = None) -> str:
    """Return the one-paragraph ``convert`` summary (or the plan, for ``--dry-run``).

    Its time is ``wall`` (the command's, start-up included) when given; what each phase
    took, the bytes moved and the peak memory follow.
    """
    what = (
        f"{counted(result.tensors, 'tensor')} ({human_bytes(result.nbytes)}) and "
        f"{counted(result.values, 'value')}, {_output(result)}"
    )
    if result.dry_run:
        batches = len(result.plan.batches) if result.plan else 0
        text = (
            f"would write {result.dst}: {what}, in {counted(batches, 'batch', 'batches')} "
            "(dry run: nothing written)"
        )
        return text + _mapping_line(result)
    seconds = result.seconds if wall is None else wall
    text = f"wrote {result.dst}: {what} in {seconds:.1f} s"
    if result.costs is not None:
        text += f" ({cost_phrase(result.costs)})"
    text += "; verified equal to the source" if result.verified else ""
    return text + _mapping_line(result)


def _mapping_line(result: ConvertResult) -> str:
    """Return the ledger of ``--map`` on a line of its own, or nothing without a mapping."""
    if result.plan is None or result.plan.mapping is None:
        return ""
    return "\n" + mapping_phrase(result.plan.mapping)


def mapping_phrase(mapping: dict) -> str:
    """Return the ledger line: ``mapped with 'llama3': 56 tensors (1.0 MiB) in, 56 out, 0 dropped``."""
    held = mapping["dropped"]
    dropped = f", dropped {counted(held['tensors'], 'tensor')} ({human_bytes(held['bytes'])})"
    return (
        f"mapped with '{mapping['name']}' ({mapping['direction']}): every element of "
        f"{counted(mapping['in']['tensors'], 'tensor')} ({human_bytes(mapping['in']['bytes'])}) "
        f"in {counted(mapping['out']['tensors'], 'tensor')} "
        f"({human_bytes(mapping['out']['bytes'])}) of DST{dropped if held['tensors'] else ''}"
    )


def cost_phrase(costs: dict) -> str:
    """Return ``plan 0.4, frame 0.1, write 2.0, flush 0.3, finish 0.1 s; read 1.0 GiB, ...``."""
    phases = ", ".join(f"{name} {sec:.1f}" for name, sec in costs["phase_seconds"].items())
    rates = costs.get("write_gb_per_s")
    rate = f" at {rates:.2f} GB/s" if rates else ""
    peaks = costs["peak_rss_bytes"]
    peak = f"peak RSS {human_bytes(max(peaks))}"
    if len(peaks) > 1:
        peak += f" (largest of {len(peaks)} ranks; smallest {human_bytes(min(peaks))})"
    charged = [b for b in costs.get("peak_cgroup_bytes") or () if b is not None]
    if charged:
        peak += f", cgroup peak {human_bytes(max(charged))}"
    return (
        f"{phases} s; read {human_bytes(costs['read_bytes'])}, wrote "
        f"{human_bytes(costs['written_bytes'])}{rate}; {peak}"
    )


def _output(result: ConvertResult) -> str:
    """Return what DST is: ``one torch file``, ``a full hf directory``, ``sharded dcp for 8 ranks``."""
    if result.layout == "full":
        # Whole tensors are for any world size: the launch's size says nothing about DST.
        return "a full hf directory" if result.format == "hf" else f"one {result.format} file"
    return f"{result.layout} {result.format} for world size {result.world_size}"


# ---------------------------------------------------------------- diff


def diff_json(result: DiffResult) -> dict:
    """Return the ``diff --json`` document (``casts`` only after ``--cast``)."""
    doc = {
        "equal": result.equal,
        "compared": result.compared,
        "differences": [
            {"path": path_to_json(d.path), "reason": d.reason, "max_abs_diff": d.max_abs_diff}
            for d in result.differences
        ],
    }
    if result.casts:
        doc["casts"] = [
            {
                "a": dtype_name(c.dtype_a),
                "b": dtype_name(c.dtype_b),
                "as": dtype_name(c.wider),
                "tensors": n,
            }
            for c, n in result.casts.items()
        ]
    return doc


def _cast_lines(result: DiffResult) -> list[str]:
    """Return one line per dtype change ``--cast`` made: what was compared as what."""
    return [
        f"compared {counted(n, 'tensor')} of {dtype_name(c.dtype_a)} in A and {dtype_name(c.dtype_b)} "
        f"in B as {dtype_name(c.wider)}"
        for c, n in result.casts.items()
    ]


def diff_text(result: DiffResult) -> str:
    """Return the readable ``diff`` report: 'equal', or each differing path."""
    if result.equal:
        return "\n".join(
            [
                *_cast_lines(result),
                f"equal: {counted(result.compared, 'leaf', 'leaves')} compared",
            ]
        )
    n = len(result.differences)
    lines = [
        *_cast_lines(result),
        f"{n} of {counted(result.compared, 'leaf', 'leaves')} {'differs' if n == 1 else 'differ'}:",
    ]
    for d in result.differences:
        extra = f", max abs diff {d.max_abs_diff:g}" if d.max_abs_diff is not None else ""
        lines.append(f"  {dotted(d.path)}: {d.reason}{extra}")
    return "\n".join(lines)


# ---------------------------------------------------------------- verify


def verify_json(result: Integrity) -> dict:
    """Return the ``verify --json`` report."""
    return {
        "schema": SCHEMA_VERSION,
        "src": result.src,
        "format": result.format,
        "world_size": result.world_size,
        "intact": result.intact,
        "files": result.files,
        "bytes": result.bytes,
        "checked": result.checked,
        "checked_bytes": result.checked_bytes,
        "unchecked_bytes": result.unchecked_bytes,
        "seconds": round(result.seconds, 3),
        "read_seconds": round(result.read_seconds, 3),
        "damaged": [
            {"file": f.file, "tensors": list(f.tensors), "where": f.where, "message": f.message}
            for f in result.damaged
        ],
    }


def verify_text(result: Integrity) -> str:
    """Return the ``verify`` report: intact or damaged, what was read and checked, every finding."""
    rate = result.bytes / result.read_seconds if result.read_seconds > 0 else 0.0
    lines = [
        f"{'intact' if result.intact else 'damaged'}: {result.src} ({result.format}, "
        f"{counted(result.files, 'file')}, {human_bytes(result.bytes)} read in "
        f"{result.read_seconds:.1f} s at {human_bytes(rate)}/s, {result.seconds:.1f} s in all)",
        f"  {counted(result.checked, 'record')} checked against the CRC-32 written with them "
        f"({human_bytes(result.checked_bytes)}); {human_bytes(result.unchecked_bytes)} carry "
        "no checksum",
    ]
    lines += [f"  '{f.file}': {f.message}" for f in result.damaged]
    return "\n".join(lines)
