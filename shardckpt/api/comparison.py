"""``diff``: whether two checkpoints of any formats hold the same, leaf by leaf."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from shardckpt.api.requests import DiffRequest
from shardckpt.api.storage import named, on_storage
from shardckpt.core import lazy_torch
from shardckpt.core.dist import Runtime
from shardckpt.core.errors import ShardckptError, source_option
from shardckpt.core.progress import Progress
from shardckpt.engine.compare import DiffResult, TorchNeeded, compare
from shardckpt.engine.read_checks import check_reads
from shardckpt.formats import format_named, open_reader
from shardckpt.formats.dcp.reader import as_stored
from shardckpt.plan.selection import Selection, lift_model, select
from shardckpt.state.checksums import checking
from shardckpt.state.tree import (
    dotted,
    find_optimizers,
    model_prefix,
    tensor_leaves,
    walk,
)


@dataclass
class DiffReport(DiffResult):
    """What ``diff`` found, and what the user is told beside it (a side compared by its
    ``model`` subtree; a hint when the two are rooted apart)."""

    notes: tuple[str, ...] = ()


def diff(
    request: DiffRequest, runtime: Runtime | None = None, progress: Progress | None = None
) -> DiffReport:
    """Return how checkpoints ``a`` and ``b`` differ, leaf by leaf, after the same FQN cleaning.

    ``only`` and ``filters`` select the same part of both sides as ``convert`` would
    write; with ``cast`` floating tensors of different dtypes compare in the wider one.
    ``unnest_a``/``nest_a`` (and ``_b``) then re-root one side as ``convert`` does, so
    trees rooted differently (a flat state dict, ``{"model": ...}``) compare.
    """
    runtime = runtime or Runtime()
    with on_storage(request, runtime, srcs=("a", "b")) as run, checking():
        try:
            return named(_diff(run.request, runtime, progress), run)
        except TorchNeeded as bytes_differ:
            # Both sides again, read with torch: the pairs found equal are not read twice.
            lazy_torch.load()
            return named(_diff(run.request, runtime, progress, bytes_differ.settled), run)


def _diff(
    request: DiffRequest,
    runtime: Runtime,
    progress: Progress | None,
    settled: frozenset = frozenset(),
) -> DiffReport:
    request.check()
    a, b = request.a, request.b
    torch_before = lazy_torch.loaded()

    def open_both():
        with source_option("--from-a"):
            ra = open_reader(a, request.format_a, request.trust_pickle)
        with source_option("--from-b"):
            return ra, open_reader(b, request.format_b, request.trust_pickle)

    sel = Selection(
        clean_fqns=request.clean_fqns, only=request.only, filters=tuple(request.filters)
    )
    sel_a = replace(sel, unnest=request.unnest_a, nest=request.nest_a, side="-a")
    sel_b = replace(sel, unnest=request.unnest_b, nest=request.nest_b, side="-b")
    ra, rb = runtime.agreed(open_both)

    def selected() -> tuple[dict, dict]:
        tree_a, tree_b = select(ra.index(), sel_a), select(rb.index(), sel_b)
        ra.check_selected(tree_a)
        rb.check_selected(tree_b)
        if format_named(ra.format).keys_as_str or format_named(rb.format).keys_as_str:
            # DCP hands every mapping key back as str: compare both sides in that form,
            # so ID-keyed state (0 vs "0") is not a difference.
            return as_stored(tree_a), as_stored(tree_b)
        return tree_a, tree_b

    with source_option(lambda exc: _side_option(exc, a, b)):
        tree_a, tree_b = runtime.agreed(selected)
        if not torch_before and lazy_torch.loaded():
            # One side needed torch to open (a legacy torch file, a pickle the stand-ins
            # do not read) after the other named its dtypes by stand-ins: both again, with it.
            raise TorchNeeded(settled)
        notes: tuple[str, ...] = ()
        if request.only == "model" and not _rerooted(request):
            tree_a, tree_b, notes = _model_against_root(tree_a, tree_b)
        progress = progress or Progress()
        progress.begin(sum(m.nbytes for _, m in tensor_leaves(tree_a)), "compare")
        try:
            result = compare(
                ra,
                tree_a,
                rb,
                tree_b,
                runtime,
                atol=request.atol,
                rtol=request.rtol,
                cast=request.cast,
                progress=progress,
                buffer_bytes=request.buffer_bytes,
                settled=settled,
            )
        finally:
            progress.close()
        # A damaged record is bad input, not a difference: either side's.
        check_reads(runtime, a)
        check_reads(runtime, b)
    if not result.equal and request.only == "all" and not _rerooted(request):
        notes = (*notes, *_hint(tree_a, tree_b, result))
    return DiffReport(**{f.name: getattr(result, f.name) for f in fields(result)}, notes=notes)


def _rerooted(request: DiffRequest) -> bool:
    """Return whether either side is re-rooted by ``--unnest-a`` ... ``--nest-b``."""
    return any((request.unnest_a, request.nest_a, request.unnest_b, request.nest_b))


def _model_against_root(tree_a: dict, tree_b: dict) -> tuple[dict, dict, tuple[str, ...]]:
    """Return the trees ``--only model`` compares, and a note when one side was lifted.

    ``convert --only model`` writes one file with the model's FQNs at its root; a side
    that holds a ``model`` subtree compared with a side that holds none is compared by
    that subtree, as the export was made from it.
    """
    in_a, in_b = bool(model_prefix(tree_a)), bool(model_prefix(tree_b))
    if in_a == in_b:
        return tree_a, tree_b, ()
    side, other = ("A", "B") if in_a else ("B", "A")
    lifted, beside = lift_model(tree_a if in_a else tree_b)
    left = f" (left out beside it: {', '.join(repr(k) for k in beside)})" if beside else ""
    note = (
        f"--only model: comparing {side}'s 'model' subtree with {other}'s root, as "
        f"convert --only model writes one file{left}"
    )
    return (lifted, tree_b, (note,)) if in_a else (tree_a, lifted, (note,))


def _hint(tree_a: dict, tree_b: dict, result: DiffResult) -> tuple[str, ...]:
    """Return the hint for trees that differ only in what ``--only model`` leaves out.

    A model-only export against its checkpoint: either the export holds the checkpoint's
    ``model`` subtree at its root, or every difference is optimizer state one side lacks.
    """
    for side, other, full, flat in (("A", "B", tree_a, tree_b), ("B", "A", tree_b, tree_a)):
        if not model_prefix(full) or model_prefix(flat):
            continue
        model = {dotted(p[1:]) for p, _ in walk(full) if p[:1] == ("model",)}
        names = {dotted(p) for p, _ in walk(flat)}
        if names and names <= model:
            return (
                f"{other} holds {side}'s model state at its root (a model-only export): "
                "pass --only model to compare them",
            )
    optim = [o for t in (tree_a, tree_b) for o in find_optimizers(t)]
    if optim and all(
        d.reason in ("only in A", "only in B") and any(d.path[: len(o)] == o for o in optim)
        for d in result.differences
    ):
        return ("only one side holds this optimizer state: pass --only model to compare the rest",)
    return ()


def _side_option(error: ShardckptError, a: str | os.PathLike, b: str | os.PathLike) -> str:
    """Return diff's format option for the side whose files ``error`` concerns."""
    if error.path is not None:
        where = Path(error.path).resolve()
        for side, option in ((b, "--from-b"), (a, "--from-a")):
            root = Path(side).resolve()
            if where == root or root in where.parents:
                return option
    return "--from-a or --from-b"
