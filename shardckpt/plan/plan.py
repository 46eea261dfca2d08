"""Planning, pure: selected tree + target layout and world size -> what each rank reads and writes.

No I/O and no collectives happen here, so every rank computes the same plan from the
same inputs, and the plan can be printed (``--dry-run``) or tested without ranks.
Where each byte goes is the writers' part (``shardckpt.state.regions``); the row arithmetic
is torch's own (``regions.dim0_rows``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from shardckpt.core.errors import UsageError
from shardckpt.core.lazy_torch import torch
from shardckpt.core.words import a_or_an, counted
from shardckpt.formats import format_named
from shardckpt.formats.base import Index, Rows
from shardckpt.plan.cast import cast_tree
from shardckpt.plan.selection import Selection, check_values, select_noting
from shardckpt.state.choices import DEFAULT_BUFFER_BYTES
from shardckpt.state.optim import ModelParams
from shardckpt.state.regions import dim0_rows
from shardckpt.state.tree import (
    Path,
    TensorMeta,
    dotted,
    find_optimizers,
    model_prefix,
    tensor_leaves,
    walk,
)

# Marks a tensor this rank does not read at all (another rank reads the whole of it).
SKIP = "skip"


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
    return f"{a_or_an(form.title)} checkpoint{of_one_rank} stores every tensor whole"


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
    notes: tuple[str, ...] = ()
    """What the selection did that the user is told once (``--only model`` re-rooting DST)."""
    zero_stage: int | None = None
    """For ``deepspeed``: the ZeRO stage written (``--zero-stage``); None: SRC's."""
    mapping: Mapping[str, object] | None = None
    """With an architecture mapping (``--map``): its name, file and ledger (``plan.mapping``)."""

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
    selected, notes = select_noting(index, selection)
    tree = form.dst_tree(selected, index.src)
    tree, read_as = cast_tree(tree, dtype, cast_optim)
    check_values(tree, index.src)
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
            or (selection.nest is None and selection.unnest is None and not notes and p.key in tree)
        ),
        MappingProxyType(dict(index.serializations or {}) if index.format == form.name else {}),
        hf_config,
        notes,
    )
