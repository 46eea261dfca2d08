"""Planning, pure: source index + target layout and world size -> what each rank reads and writes.

No I/O and no collectives happen here, so every rank computes the same plan from the
same inputs, and the plan can be printed (``--dry-run``) or tested without ranks.
Where each byte goes is the writers' part (``shardckpt.state.regions``); the row arithmetic
is torch's own (``regions.dim0_rows``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from shardckpt.core.errors import BadInputError, UsageError
from shardckpt.core.words import counted
from shardckpt.formats import format_named
from shardckpt.formats.base import Index, Rows
from shardckpt.plan.cast import cast_tree
from shardckpt.state.choices import DEFAULT_BUFFER_BYTES, ONLY, OPTIM_KEYS
from shardckpt.state.optim import GroupError, ModelParams, OrderError, RekeyError, rekey
from shardckpt.state.regions import dim0_rows
from shardckpt.state.tree import (
    Path,
    TensorMeta,
    clean_fqn,
    dotted,
    find_optimizers,
    is_tensor_leaf,
    model_prefix,
    prune,
    rename_keys,
    split_model_optim,
    tensor_leaves,
    walk,
)

# Marks a tensor this rank does not read at all (another rank reads the whole of it).
SKIP = "skip"

# What --only keeps: everything, all but optimizer subtrees, or only them.


@dataclass(frozen=True)
class FqnEdit:
    """One ``--rename`` (``repl`` given) or ``--drop`` (``repl`` None) for every FQN."""

    pattern: str
    repl: str | None = None


def parse_edit(option: str, text: str) -> FqnEdit:
    """Return the edit ``--rename REGEX=REPL`` or ``--drop REGEX`` describes; refuse bad regexes."""
    if option == "--drop":
        _compile("--drop", text, text)
        return FqnEdit(text)
    if option != "--rename":
        raise UsageError(f"unknown FQN edit {option!r}", hint="use --rename or --drop")
    # Split at the last '=': FQNs hold none, a replacement may.
    pattern, sep, repl = text.rpartition("=")
    if not sep or not pattern:
        raise UsageError(
            f"--rename {text!r} is not REGEX=REPL",
            hint="write it like --rename '^encoder\\.=backbone.'",
        )
    try:
        re.compile(pattern).sub(repl, "")
    except re.error as exc:
        raise UsageError(
            f"--rename {text!r}: bad regular expression or replacement ({exc})",
            hint="use Python re syntax; escape dots as \\.",
        ) from None
    return FqnEdit(pattern, repl)


@dataclass(frozen=True)
class Selection:
    """Which part of the source goes to DST, and how its keys are named there."""

    only: str = "all"
    filters: tuple[str, ...] = ()
    clean_fqns: bool = True
    optim_keys: str = "keep"
    edits: tuple[FqnEdit, ...] = ()
    """``--rename`` and ``--drop``, applied to every FQN in the order they were given:
    a rename is ``re.sub``; a drop removes an FQN it finds (``re.search``) with its
    optimizer state, and later edits never see it."""
    model: ModelParams | None = None
    """The parameters ``--model`` builds, for param-ID order; None: inferred from SRC."""
    unnest: str | None = None
    """``--unnest KEY``: DST's root is the subtree at top-level ``KEY`` (after the rest of
    the selection, which must leave no other top-level key)."""
    nest: str | None = None
    """``--nest KEY``: DST's root holds the selected tree under ``KEY`` (after ``unnest``)."""
    side: str = ""
    """How ``diff`` names the side these two apply to (``--unnest-a``: ``"-a"``)."""

    def __post_init__(self) -> None:
        if self.only not in ONLY:
            raise UsageError(f"--only must be all, model or optim, not {self.only!r}")
        for option, key in (
            (f"--unnest{self.side}", self.unnest),
            (f"--nest{self.side}", self.nest),
        ):
            if key is not None and not key:
                raise UsageError(f"{option} needs a key", hint=f"write it like {option} model")
        if self.optim_keys not in OPTIM_KEYS:
            raise UsageError(f"--optim-keys must be keep, fqn, id or flat, not {self.optim_keys!r}")

    def fqn_map(self):
        """Return the function ``--rename`` and ``--drop`` apply to an FQN, or None for neither."""
        if not self.edits:
            return None
        edits = [(re.compile(e.pattern), e.repl) for e in self.edits]

        def apply(fqn: str) -> str | None:
            for pattern, repl in edits:
                if repl is not None:
                    fqn = pattern.sub(repl, fqn)
                elif pattern.search(fqn):
                    return None
            return fqn

        return apply


def _compile(option: str, text: str, pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(
            f"{option} {text!r}: bad regular expression ({exc})",
            hint="use Python re syntax; escape dots as \\.",
        ) from None


def _collision(src: str, exc: KeyError, after: str, hint: str) -> BadInputError:
    first, second, name = exc.args[0]
    return BadInputError(
        f"'{first}' and '{second}' both become '{name}' after {after}", path=src, hint=hint
    )


def select(index: Index, selection: Selection) -> dict:
    """Return the tree DST will hold: FQN cleaning, optimizer keys and renames, ``--only``, ``--filter``.

    Rekeying sees the whole source, so the model state that tells param IDs apart is
    there even when ``--only optim`` leaves it out of DST.
    """
    tree = index.tree
    if selection.clean_fqns:
        try:
            tree = rename_keys(tree, clean_fqn)
        except KeyError as exc:
            raise _collision(
                index.src, exc, "FQN cleaning", "pass --no-clean-fqns to keep the keys as they are"
            ) from None
    tree = _rekey(index.src, tree, selection)
    tree = split_model_optim(tree, selection.only)
    if selection.filters:
        tree = prune(tree, lambda path, _: matches(path, selection.filters))
    if not isinstance(tree, Mapping):
        tree = {}
    return reroot(dict(tree), selection, index.src)


def reroot(tree: dict, selection: Selection, src: str) -> dict:
    """Return ``tree`` lifted out of its top-level ``--unnest`` key, then nested under ``--nest``.

    Both act on the tree the rest of the selection left, so ``--filter``, ``--only`` and
    ``--rename`` name paths as SRC has them. Lifting out a key while others remain
    beside it would drop them unseen: that is refused, naming them.
    """
    option = f"--unnest{selection.side}"
    if selection.unnest is not None:
        key = selection.unnest
        if key not in tree:
            have = ", ".join(f"'{k}'" for k in tree) or "none"
            raise UsageError(
                f"{option} {key}: the selected tree has no top-level '{key}' (it has {have})",
                path=src,
                hint="pass one of its top-level keys (`shardckpt inspect` shows them)",
            )
        value = tree[key]
        if not isinstance(value, Mapping):
            what = "tensor" if isinstance(value, TensorMeta) else type(value).__name__
            raise UsageError(
                f"{option} {key}: '{key}' is a {what}, not a subtree",
                path=src,
                hint="pass a top-level key that holds a dict",
            )
        others = [k for k in tree if k != key]
        if others:
            names = ", ".join(f"'{k}'" for k in others)
            raise UsageError(
                f"{option} {key} would leave out the other top-level keys beside it: {names}",
                path=src,
                hint=f"select '{key}' alone first, e.g. --filter '{key}.*'",
            )
        tree = dict(value)
    if selection.nest is not None:
        tree = {selection.nest: tree}
    return tree


def _rekey(src: str, tree: dict, selection: Selection) -> dict:
    """Return ``tree`` with ``--rename``/``--drop`` applied and optimizers keyed as asked."""
    fqn_map = selection.fqn_map()
    if selection.optim_keys == "keep" and fqn_map is None:
        return tree
    if selection.optim_keys != "keep" and not find_optimizers(tree):
        raise UsageError(
            f"--optim-keys {selection.optim_keys}: the checkpoint holds no optimizer state",
            path=src,
            hint="drop --optim-keys (it applies to dicts with 'state' and 'param_groups')",
        )
    try:
        return rekey(tree, selection.optim_keys, fqn_map, selection.model)
    except KeyError as exc:
        raise _collision(
            src, exc, "--rename/--drop", "change the --rename patterns so names stay distinct"
        ) from None
    except OrderError as exc:
        hint = (
            "check that --model builds the trained model and its param groups"
            if selection.model is not None
            else "pass --model pkg.module:factory returning (module, param_groups)"
        )
        what = (
            "the param groups of a flattened optimizer"
            if isinstance(exc, GroupError)
            else "the FQN of each optimizer param ID"
        )
        raise UsageError(f"cannot tell {what}: {exc}", path=src, hint=hint) from None
    except RekeyError as exc:
        raise BadInputError(
            f"inconsistent optimizer state: {exc}",
            path=src,
            hint="check the optimizer with `shardckpt inspect`",
        ) from None


def _holds_tensor(value: object) -> bool:
    if is_tensor_leaf(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(k) or _holds_tensor(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False


def _check_values(tree: dict, src: str) -> None:
    """Refuse a plain value that holds tensors: no writer can stream tensors from inside one.

    Tensors are carried where DCP's traversal finds them, in dicts and lists; a tensor
    inside a tuple (or a set) is part of a value, and would be pickled whole or lost.
    """
    for path, leaf in walk(tree):
        if not isinstance(leaf, TensorMeta) and _holds_tensor(leaf):
            raise BadInputError(
                f"'{dotted(path)}' is a {type(leaf).__name__} holding tensors, "
                "which shardckpt cannot carry",
                path=src,
                hint="keep tensors in dicts and lists, or leave this out with --filter/--only",
            )


def matches(path: Path, globs: Sequence[str]) -> bool:
    """Return whether the dotted form of ``path`` matches any glob (no globs: everything)."""
    name = dotted(path)
    return not globs or any(fnmatch.fnmatchcase(name, g) for g in globs)


def is_sharded(meta: TensorMeta) -> bool:
    """Return whether a tensor is split across ranks (0-dim tensors stay whole, as in FSDP2)."""
    return len(meta.shape) > 0


def stays_whole(meta: TensorMeta) -> bool:
    """Return whether a source that tells (``Format.tells_whole``) held ``meta`` whole on every rank."""
    return not is_sharded(meta) or meta.layout == "full"


def whole_tensors(
    index: Index, tree: dict, layout: str, model: ModelParams | None, told: bool
) -> frozenset[str]:
    """Return the keys of the tensors a sharded or local DST keeps whole on every rank.

    0-dim tensors always stay whole. A source that tells (``told``: per-rank files, a
    DCP of several ranks that stores chunks) keeps whole what it held whole. Otherwise ``--model`` tells: its buffers, and tensors outside the model and
    optimizer state (a loop's extra state), stay whole; its parameters and optimizer
    state are split, as FSDP splits them. Without ``--model`` every tensor with a
    dimension is split, which a ``dcp`` output may do (DCP reshards on load) but a local
    output may not: FSDP loads a buffer only as a plain tensor, so that is refused.
    """
    tensors = tensor_leaves(tree)
    if told:
        return frozenset(m.key for _, m in tensors if stays_whole(m))
    optimizers = find_optimizers(tree)
    untold = [
        (p, m)
        for p, m in tensors
        if is_sharded(m) and not any(p[: len(o)] == o for o in optimizers)
    ]
    if model is None:
        if layout == "local" and untold:
            raise UsageError(
                f"cannot tell parameters (split across ranks) from buffers (whole on every "
                f"rank): {_stores_alike(index)} ({counted(len(untold), 'such tensor')}, e.g. "
                f"'{dotted(untold[0][0])}')",
                path=index.src,
                hint="pass --model pkg.module:factory building the trained model",
            )
        return frozenset(m.key for _, m in tensors if not is_sharded(m))
    params = set(model.fqns) | set(model.aliases)
    buffers = set(model.buffers)
    where = model_prefix(tree)
    whole = {m.key for _, m in tensors if not is_sharded(m)}
    for path, meta in untold:
        if path[: len(where)] != where:
            whole.add(meta.key)  # beside the model state: not FSDP's to shard
            continue
        fqn = dotted(path[len(where) :])
        if fqn in buffers:
            whole.add(meta.key)
        elif fqn not in params:
            raise UsageError(
                f"'{dotted(path)}' is neither a parameter nor a buffer of the --model model",
                path=index.src,
                hint="check that --model builds the trained model, or --rename/--drop the "
                "checkpoint's keys to match it",
            )
    return frozenset(whole)


def _stores_alike(index: Index) -> str:
    """Return why ``index`` cannot tell parameters from buffers, for an error line."""
    form = format_named(index.format)
    if (index.world_size or 1) > 1:
        return f"this {form.title} checkpoint stores every tensor as one whole chunk"
    of_one_rank = " of one rank" if form.layout != "full" else ""
    return f"a {form.title} checkpoint{of_one_rank} stores every tensor whole"


def rows_to_read(
    meta: TensorMeta, world_size: int, rank: int, *, whole_on_coordinator: bool
) -> Rows | str:
    """Return what ``rank`` reads of ``meta``: its rows, the whole tensor (None), or ``SKIP``.

    Tensors that stay whole are read by every rank for a sharded DST (each rank's state
    dict holds them, as in training) but only by rank 0 for a full DST.
    """
    if world_size == 1:
        return None
    if is_sharded(meta):
        return dim0_rows(meta.shape, world_size, rank)
    if whole_on_coordinator and rank != 0:
        return SKIP
    return None


def batches(
    metas: Sequence[TensorMeta], limit: int = DEFAULT_BUFFER_BYTES
) -> list[list[TensorMeta]]:
    """Return consecutive groups of tensors of at most ``limit`` bytes (a bigger one goes alone)."""
    out: list[list[TensorMeta]] = []
    size = limit
    for meta in metas:
        if size + meta.nbytes > limit or not out:
            out.append([])
            size = 0
        out[-1].append(meta)
        size += meta.nbytes
    return out


@dataclass(frozen=True)
class ConvertPlan:
    """A conversion decided, once, before any data moves: DST's tree, its tensors, who keeps what whole."""

    layout: str
    format: str
    world_size: int
    """The target world size M of a sharded or local DST (the launch's for a full one)."""
    tree: dict
    tensors: tuple[tuple[Path, TensorMeta], ...]
    metas: Mapping[str, TensorMeta]
    """Each tensor of DST by its reader key."""
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    """The most tensor bytes a process reads and writes at a time (``--buffer-size``)."""
    read_as: Mapping[str, torch.dtype] = field(default_factory=dict)
    """The source dtype of each tensor ``--dtype`` casts, by reader key."""
    max_shard_size: int | None = None
    """For ``hf``: the most tensor bytes per shard file (None: the format's default)."""
    whole: frozenset[str] = frozenset()
    """Keys of the tensors a sharded or local DST keeps whole on every rank (``whole_tensors``)."""
    flat_model: object | None = None
    """For FSDP1's flat parameters: the ``FlatModel`` (``--model``/``--wrap``) that lays them out."""
    use_orig_params: bool = False
    """For ``fsdp1-local``: the layout of FSDP1 with ``use_orig_params=True``."""
    src: str = ""
    """SRC, for a writer that copies files of it (``Index.parts``)."""
    parts: tuple = ()
    """SRC's ``Index.parts``: which file gave which top-level key, and the files carried
    unread; the keyed ones are left out when ``--nest``/``--unnest`` moved the top level."""
    serializations: Mapping[str, str] = field(default_factory=dict)
    """For ``torch-checkpointing`` from itself: how the source serialized each item."""
    hf_config: object | None = None
    """For ``hf``: the ``formats.hf_config.HfConfig`` whose files DST gets beside the weights."""

    @property
    def batches(self) -> list[list[TensorMeta]]:
        """Return the batches one process moves the tensors in (what ``--dry-run`` counts)."""
        return batches([m for _, m in self.tensors], self.buffer_bytes)

    @property
    def nbytes(self) -> int:
        """Return the bytes of tensor data DST will hold."""
        return sum(m.nbytes for _, m in self.tensors)

    @property
    def num_values(self) -> int:
        """Return the number of plain (non-tensor) leaves DST will hold."""
        return sum(1 for _, leaf in walk(self.tree) if not isinstance(leaf, TensorMeta))


def make_plan(
    index: Index,
    selection: Selection,
    fmt: str,
    world_size: int,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    *,
    dtype: torch.dtype | None = None,
    cast_optim: bool = False,
    max_shard_size: int | None = None,
    flat_model: object | None = None,
    use_orig_params: bool = False,
    hf_config: object | None = None,
) -> ConvertPlan:
    """Return the plan that moves ``index``'s selected part into format ``fmt`` at ``world_size``."""
    form = format_named(fmt)
    tree = form.dst_tree(select(index, selection), index.src)
    tree, read_as = cast_tree(tree, dtype, cast_optim)
    _check_values(tree, index.src)
    tensors = tuple(tensor_leaves(tree))
    if not tensors and not any(True for _ in walk(tree)):
        raise UsageError(
            "nothing is selected",
            path=index.src,
            hint="check --only and --filter against `shardckpt inspect`",
        )
    whole = (
        whole_tensors(
            index, tree, form.layout, selection.model, format_named(index.format).tells_whole(index)
        )
        if form.layout != "full"
        else frozenset()
    )
    return ConvertPlan(
        form.layout,
        form.name,
        world_size,
        tree,
        tensors,
        MappingProxyType({m.key: m for _, m in tensors}),
        buffer_bytes,
        MappingProxyType(dict(read_as)),
        max_shard_size,
        whole,
        flat_model,
        use_orig_params,
        index.src,
        tuple(
            p
            for p in index.parts
            if p.key is None
            or (selection.nest is None and selection.unnest is None and p.key in tree)
        ),
        MappingProxyType(dict(index.serializations or {}) if index.format == form.name else {}),
        hf_config,
    )
