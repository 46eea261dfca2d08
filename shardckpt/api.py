"""The library surface: ``inspect``, ``convert`` and ``diff``, as the CLI and users call them.

Each function takes an optional ``runtime`` (``shardckpt.dist.launch``); without one it
runs standalone. Under several ranks every rank calls the same function with the same
arguments; inputs are validated inside the first agreed step, so a bad input seen by
any rank stops all of them with one error.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardckpt import applies, engine
from shardckpt.cast import CastReader, dtype_name, target_dtype
from shardckpt.compare import DiffResult, compare
from shardckpt.destination import Destination
from shardckpt.dist import Runtime
from shardckpt.errors import (
    IOFailure,
    RemoteRankError,
    ShardckptError,
    UsageError,
    notice,
    source_option,
)
from shardckpt.exchange import SharedReader
from shardckpt.flat_layout import FlatModel
from shardckpt.formats import (
    FILE_SUFFIXES,
    Format,
    Index,
    default_format,
    format_named,
    open_reader,
)
from shardckpt.formats.dcp import as_stored
from shardckpt.formats.hf_config import HfConfig, check_names, config_beside
from shardckpt.formats.hf_config import hf_config as read_hf_config
from shardckpt.model import model_params
from shardckpt.placement import Placement, open_destination
from shardckpt.plan import (
    DEFAULT_BUFFER_BYTES,
    ConvertPlan,
    Selection,
    make_plan,
    matches,
    parse_edit,
    select,
)
from shardckpt.progress import Progress
from shardckpt.sight import look
from shardckpt.tree import (
    OptimizerInfo,
    describe_optimizer,
    find_optimizers,
    flat_hyperparameters,
    is_flat_optimizer,
    parse_flat,
    tensor_leaves,
    walk,
)
from shardckpt.words import counted

LAYOUTS = ("full", "sharded", "local")


# ---------------------------------------------------------------- inspect


@dataclass
class Inspection:
    """What ``inspect`` found: the index, the leaves that pass the filter, optimizers, notes."""

    index: Index
    leaves: list[tuple[tuple, object]]
    optimizers: list[OptimizerInfo]
    warnings: list[str] = field(default_factory=list)
    components: list = field(default_factory=list)
    """A trainer's checkpoint: its parts (``formats.torchtitan.Component``), else empty."""


@source_option("--format")
def inspect(
    src: str | os.PathLike,
    *,
    fmt: str | None = None,
    filters: Sequence[str] = (),
    trust_pickle: bool = False,
    model: str | None = None,
    wraps: Sequence[str] = (),
    runtime: Runtime | None = None,
) -> Inspection:
    """Return the metadata of ``src``: leaves, layouts, optimizer subtrees; reads no tensor data."""
    runtime = runtime or Runtime()
    flat_model = FlatModel(model, tuple(wraps)) if model else None

    def read_index() -> tuple[Index, list[str]]:
        choice = applies.Choice(src_format=fmt, model=model, wraps=tuple(wraps))
        applies.check(applies.INSPECT_RULES, choice)
        reader = open_reader(src, fmt, trust_pickle, flat_model)
        applies.check(applies.INSPECT_RULES, replace(choice, src_format=reader.format))
        return reader.index(), reader.notes()

    index, notes = runtime.agreed(read_index)
    leaves = [(p, leaf) for p, leaf in walk(index.tree) if matches(p, filters)]
    optimizers = [describe_optimizer(index.tree, p) for p in find_optimizers(index.tree)]
    parts = format_named(index.format).components
    return Inspection(
        index,
        leaves,
        optimizers,
        notes + _optimizer_warnings(index.tree, optimizers),
        parts(index.tree) if parts is not None else [],
    )


def _optimizer_warnings(tree: dict, optimizers: list[OptimizerInfo]) -> list[str]:
    """Return notes on optimizer state that names no parameter, and parameters with no state."""
    notes = []
    for info in optimizers:
        node = tree
        for p in info.path:
            node = node[p]
        if is_flat_optimizer(node):
            state, params = _flat_listing(node)
        else:
            state = node.get("state", {}) if isinstance(node.get("state"), dict) else {}
            params = [
                p
                for g in node.get("param_groups", [])
                if isinstance(g, dict)
                for p in g.get("params", [])
            ]
        listed = {str(p) for p in params}
        stray = [k for k in state if str(k) not in listed]
        if params and stray:
            notes.append(
                f"{'.'.join(map(str, info.path))}: state for {counted(len(stray), 'key')} in no param group, "
                f"e.g. {stray[0]!r}"
            )
        keyed = {str(k) for k in state}
        stateless = [p for p in params if p not in state and str(p) not in keyed]
        if state and stateless:
            notes.append(
                f"{'.'.join(map(str, info.path))}: {counted(len(stateless), 'parameter')} without state yet, "
                f"e.g. {stateless[0]!r}"
            )
    return notes


def _flat_listing(node: dict) -> tuple[dict, list[str]]:
    """Return a flattened optimizer's state keys (by FQN, or the whole key) and its parameters."""
    parsed = parse_flat(node)
    state = {
        p.fqn if p.fqn is not None else key: None
        for key, p in parsed.items()
        if p.section == "state"
    }
    return state, list(flat_hyperparameters(node, parsed))


# ---------------------------------------------------------------- convert


@dataclass
class ConvertResult:
    """What ``convert`` wrote (or, with ``dry_run``, would write)."""

    src: str
    dst: str
    format: str
    layout: str
    world_size: int
    tensors: int
    nbytes: int
    values: int
    seconds: float
    dry_run: bool = False
    verified: bool | None = None
    plan: ConvertPlan | None = None


def _check_target(to: str, form: Format, world_size: int | None, model: str | None) -> None:
    if to not in LAYOUTS:
        raise UsageError(f"--to must be one of {', '.join(LAYOUTS)}, not {to!r}")
    if form.layout != to:
        raise UsageError(
            f"--format {form.name} is a {form.layout} layout, not {to}",
            hint=f"pass --to {form.layout}, or a {to} format",
        )
    if form.needs_model and not model:
        raise UsageError(
            f"--format {form.name} needs the model's flat-parameter layout",
            hint="pass --model pkg.module:factory and the --wrap classes training wraps",
        )
    if world_size is not None and world_size < 1:
        raise UsageError(
            f"--world-size must be at least 1, not {world_size}",
            hint="pass the number of ranks that will load the output",
        )


def _target_world_size(to: str, world_size: int | None, runtime: Runtime) -> int:
    """Return the world size DST is for: ``--world-size``, else the launch's (said once).

    Standalone there is no launch to take it from, and a silent 1 would write a
    checkpoint for one rank that an N-rank job cannot resume from as it expects.
    """
    if world_size is not None or to == "full":
        return world_size or runtime.world_size
    if not runtime.distributed:
        raise UsageError(
            f"--to {to} needs --world-size outside torchrun",
            hint="pass --world-size M, the number of ranks that will load DST",
        )
    if runtime.coordinator:
        notice(
            f"writing DST for world size {runtime.world_size}, the launch's "
            "(pass --world-size M for another)"
        )
    return runtime.world_size


def _check_world_size(form: Format, world_size: int) -> None:
    """Refuse a world size the format cannot describe (FSDP1 on one rank runs NO_SHARD)."""
    if world_size < form.min_world_size:
        raise UsageError(
            f"--format {form.name} for --world-size {world_size}: FSDP1 on one rank runs "
            "NO_SHARD, whose state dicts hold whole tensors, not shards",
            hint="convert --to full for a one-rank job (it loads with FULL_STATE_DICT), "
            f"or pass --world-size {form.min_world_size} or more",
        )


def _check_dst_name(dst: str | os.PathLike, form: Format) -> None:
    """Refuse a DST whose file suffix names another format than the one to be written."""
    suffix = Path(dst).suffix.lower()
    named = FILE_SUFFIXES.get(suffix)
    if named is None or named == form.name:
        return
    if form.directory:
        raise UsageError(
            f"--format {form.name} writes a directory, but DST ends in {suffix}, a {named} file",
            path=dst,
            hint=f"name DST without a file suffix, or pass --format {named}",
        )
    raise UsageError(
        f"DST ends in {suffix}, a {named} file, but --format is {form.name}",
        path=dst,
        hint=f"pass --format {named}, or name DST like the {form.name} files it will hold",
    )


def _own_layout(
    form: Format, to: str, dst, src_format: str, model: str | None, world_size: int, runtime
) -> Format:
    """Return the format DST is written in without ``--format``: a trainer's own, for its source.

    A trainer's directory (``Format.keeps_layout``) converted to its layout is what its
    trainer loads only in that trainer's layout; checked as ``--format`` would be, said once.
    """
    own = format_named(default_format(to, dst, src_format))
    if own is form:
        return form
    _check_target(to, own, None, model)
    _check_world_size(own, world_size)
    _check_dst_name(dst, own)
    if runtime.coordinator:
        notice(
            f"writing DST as a {own.title} checkpoint, SRC's own layout "
            f"(pass --format {form.name} for a bare {form.title} one)"
        )
    return own


def _check_shard_size(max_shard_size: int | None) -> None:
    if max_shard_size is not None and max_shard_size <= 0:
        raise UsageError("--max-shard-size must be positive", hint="write it like 5GB or 500MB")


@source_option("--from")
def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str,
    fmt: str | None = None,
    src_format: str | None = None,
    world_size: int | None = None,
    only: str = "all",
    filters: Sequence[str] = (),
    clean_fqns: bool = True,
    dtype: str = "keep",
    cast_optim: bool = False,
    max_shard_size: int | None = None,
    optim_keys: str = "keep",
    edits: Sequence[tuple[str, str]] = (),
    unnest: str | None = None,
    nest: str | None = None,
    model: str | None = None,
    wraps: Sequence[str] = (),
    use_orig_params: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    verify: bool = False,
    trust_pickle: bool = False,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    src_local: bool = False,
    hf_config: str | os.PathLike | None = None,
    runtime: Runtime | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert ``src`` into ``dst`` with layout ``to``; return what was written.

    ``edits`` are ``("--rename", "REGEX=REPL")`` and ``("--drop", "REGEX")`` pairs,
    applied to every FQN in their order; ``unnest``/``nest`` re-root the selected tree
    (``plan.reroot``); ``model`` is ``pkg.module:factory`` (see
    ``shardckpt.model``), built on the meta device for the order of param IDs; with
    ``wraps`` (FSDP1 ``ModuleWrapPolicy`` classes) it also gives FSDP1 flat-parameter layouts.
    DST appears only complete: written beside it, checked with ``verify``, then renamed.
    Under ``torchrun`` each rank reads only the files of SRC it sees (``shardckpt.sight``);
    ``src_local`` says SRC is on the nodes' own disks, so that is no news worth a notice.
    ``hf_config`` (``--format hf``) is a directory whose ``config.json`` and friends DST
    gets (``shardckpt.formats.hf_config``); without it, one in or beside SRC is used.
    """
    runtime = runtime or Runtime()
    start = time.perf_counter()
    dtype = dtype_name(dtype)
    form = format_named(fmt or default_format(to, dst)) if to in LAYOUTS else None
    destination = Destination(
        dst, overwrite=overwrite, is_dir=form is not None and form.directory, srcs=(Path(src),)
    )

    def prepare():
        nonlocal form
        if form is None:
            raise UsageError(f"--to must be one of {', '.join(LAYOUTS)}, not {to!r}")
        _check_target(to, form, world_size, model)
        target_world = _target_world_size(to, world_size, runtime)
        if to != "full":
            _check_world_size(form, target_world)
        choice = applies.Choice(
            to=to,
            fmt=form.name,
            src_format=src_format,
            only=only,
            dtype=dtype,
            cast_optim=cast_optim,
            optim_keys=optim_keys,
            world_size=world_size,
            max_shard_size=max_shard_size,
            model=model,
            wraps=tuple(wraps),
            use_orig_params=use_orig_params,
            src_local=src_local,
            hf_config=None if hf_config is None else str(hf_config),
            distributed=runtime.distributed,
            nest=nest,
        )
        applies.check(applies.CONVERT_RULES, choice)
        companions = read_hf_config(hf_config) if hf_config is not None else None
        _check_dst_name(dst, form)
        if buffer_bytes <= 0:
            raise UsageError("--buffer-size must be positive")
        cast_to = target_dtype(dtype)
        _check_shard_size(max_shard_size)
        selection = Selection(
            only=only,
            filters=tuple(filters),
            clean_fqns=clean_fqns,
            optim_keys=optim_keys,
            edits=tuple(parse_edit(option, text) for option, text in edits),
            model=model_params(model, clean_fqns) if model else None,
            unnest=unnest,
            nest=nest,
        )
        if not dry_run:
            destination.check()
        flat_model = FlatModel(model, tuple(wraps)) if model else None
        sight = look(src, runtime) if runtime.distributed else None
        partial = sight if sight is not None and not sight.complete else None
        if partial is not None and not src_local and runtime.coordinator:
            notice(
                "the ranks see different files of SRC: each file is read where it is seen "
                "and its rows sent over the collective (pass --src-local to say so and "
                "silence this note)"
            )
        reader = open_reader(src, src_format, trust_pickle, flat_model, sight)
        if fmt is None and nest is None and unnest is None:
            form = _own_layout(form, to, dst, reader.format, model, target_world, runtime)
        applies.check(
            applies.CONVERT_RULES, replace(choice, fmt=form.name, src_format=reader.format)
        )
        source = format_named(reader.format)
        if source.needs_model and flat_model is None:
            raise UsageError(
                f"{source.name} flat parameters need the model to be read",
                path=src,
                hint="pass --model pkg.module:factory and the --wrap classes training wrapped",
            )
        index = reader.index()
        carried = [p.file for p in index.parts if p.key is None]
        if carried and not form.carries_files and runtime.coordinator:
            notice(
                f"not in DST: {', '.join(carried)} ({counted(len(carried), 'file')} SRC "
                f"carries unread; `shardckpt inspect SRC` says what each holds): copy "
                "them yourself if the job that loads DST needs them"
            )
        plan = make_plan(
            index,
            selection,
            form.name,
            target_world,
            buffer_bytes,
            dtype=cast_to,
            cast_optim=cast_optim,
            max_shard_size=max_shard_size,
            flat_model=flat_model,
            use_orig_params=use_orig_params,
        )
        if form.name == "hf":
            plan = _with_hf_config(plan, companions, src, runtime)
        reader.check_selected(plan.tree)
        if runtime.coordinator:
            for note in form.notes(plan.tree, plan.world_size):
                notice(note)
        writer = form.writer(destination.tmp, plan)
        # Reading through the cast also makes --verify compare DST with the cast source.
        if plan.read_as:
            reader = CastReader(reader, plan.read_as)
        if partial is not None:
            reader = SharedReader(reader, partial, plan.metas, plan.buffer_bytes)
        return reader, plan, writer

    reader, plan, writer = runtime.agreed(prepare)
    verified = None
    if not dry_run:
        try:
            placement = open_destination(destination, runtime)
            runtime.agreed(lambda: _check_placement(placement, form, plan, verify, dst))
            writer.placement = placement
            progress = progress or Progress()
            try:
                engine.run(reader, plan, writer, runtime, progress)
                if verify:
                    verified = _verify(
                        reader, plan, destination, runtime, trust_pickle, placement, progress
                    )
            finally:
                progress.close()
            runtime.agreed(lambda: destination.commit() if placement.opener else None)
        except BaseException as exc:
            if runtime.coordinator and not destination.committed:
                # BaseException.add_note is Python 3.11+; __notes__ is what it appends to.
                exc.__notes__ = [*getattr(exc, "__notes__", ()), f"'{dst}' was not written"]
            raise
        finally:
            destination.close()  # on the ranks that opened DST; nothing elsewhere
    return ConvertResult(
        str(src),
        str(dst),
        form.name,
        to,
        plan.world_size,
        len(plan.tensors),
        plan.nbytes,
        plan.num_values,
        time.perf_counter() - start,
        dry_run,
        verified,
        plan,
    )


def _with_hf_config(
    plan: ConvertPlan, companions: HfConfig | None, src, runtime: Runtime
) -> ConvertPlan:
    """Return ``plan`` with the config files an ``hf`` DST gets: named, else found beside SRC."""

    def note(text: str) -> None:
        if runtime.coordinator:
            notice(text)

    if companions is None:
        found = config_beside(src)
        if found is None:
            return plan
        try:
            companions = read_hf_config(found, detected=True)
        except ShardckptError as exc:
            note(f"not copying config.json from '{found}': {exc.line()}")
            return plan
    if not check_names(companions, plan.tree["model"], note):
        return plan
    if companions.detected:
        more = len(companions.files) - 1
        others = f" and {counted(more, 'other file')}" if more else ""
        note(
            f"copying config.json{others} from '{companions.root}', where SRC is "
            "(pass --hf-config DIR for another model's)"
        )
    return replace(plan, hf_config=companions)


def _check_placement(
    placement: Placement, form: Format, plan: ConvertPlan, verify: bool, dst
) -> None:
    """Refuse what DST on several disks cannot hold; say where each target rank's files go."""
    if not placement.several:
        return
    if form.layout == "full":
        raise UsageError(
            f"the ranks write DST to {len(placement.groups)} disks they do not share, and "
            f"--format {form.name} is one full output every rank writes into",
            path=dst,
            hint="write it to a filesystem every rank sees, or run the ranks on one node",
        )
    if verify and not form.src_local:
        raise UsageError(
            f"--verify reads DST back from every rank, and --format {form.name} on disks "
            "the ranks do not share cannot be",
            path=dst,
            hint="drop --verify and run diff on the gathered files, or write DST where "
            "every rank sees it",
        )
    if placement.rank == 0:
        notice(placement.describe(plan.world_size))


def _verify(
    reader,
    plan: ConvertPlan,
    destination: Destination,
    runtime: Runtime,
    trust_pickle: bool,
    placement: Placement,
    progress: Progress,
):
    """Read the staged output back and compare it with SRC; raise if anything differs."""
    dst = destination.dst
    # DCP hands every mapping key back as str; compare with what it can hold, on both
    # sides (a format that is partly DCP, Lightning's, keeps its other part's keys).
    as_str = format_named(plan.format).keys_as_str
    expected = as_stored(plan.tree) if as_str else plan.tree

    def written_reader():
        # On several disks, each rank sees its disk's part of the output, as of a node-local SRC.
        sight = look(destination.tmp, runtime) if placement.several else None
        written = open_reader(destination.tmp, plan.format, trust_pickle, plan.flat_model, sight)
        index = written.index()
        if sight is not None and not sight.complete:
            metas = {m.key: m for _, m in index.tensors()}
            written = SharedReader(written, sight, metas, plan.buffer_bytes)
        tree = select(index, Selection(clean_fqns=False))
        return written, as_stored(tree) if as_str else tree

    try:
        with source_option("--format"):
            written, tree = runtime.agreed(written_reader)
        progress.begin(sum(m.nbytes for _, m in tensor_leaves(expected)), "verify")
        check = compare(reader, expected, written, tree, runtime, progress=progress)
    except ShardckptError as exc:
        if isinstance(exc, RemoteRankError):
            raise
        raise IOFailure(
            f"--verify could not read the output back ({exc.line()}); nothing was written to DST",
            path=dst,
            hint="please report this",
        ) from None
    if not check.equal:
        first = check.differences[0]
        raise IOFailure(
            f"--verify found {len(check.differences)} differing leaves, first "
            f"'{'.'.join(map(str, first.path))}' ({first.reason}); nothing was written to DST",
            path=dst,
            hint="the output did not read back equal to SRC; please report this",
        )
    return True


# ---------------------------------------------------------------- diff


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    fmt_a: str | None = None,
    fmt_b: str | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    clean_fqns: bool = True,
    only: str = "all",
    filters: Sequence[str] = (),
    cast: bool = False,
    unnest_a: str | None = None,
    nest_a: str | None = None,
    unnest_b: str | None = None,
    nest_b: str | None = None,
    trust_pickle: bool = False,
    runtime: Runtime | None = None,
    progress: Progress | None = None,
) -> DiffResult:
    """Return how checkpoints ``a`` and ``b`` differ, leaf by leaf, after the same FQN cleaning.

    ``only`` and ``filters`` select the same part of both sides as ``convert`` would
    write; with ``cast`` floating tensors of different dtypes compare in the wider one.
    ``unnest_a``/``nest_a`` (and ``_b``) then re-root one side as ``convert`` does, so
    trees rooted differently (a flat state dict, ``{"model": ...}``) compare.
    """
    runtime = runtime or Runtime()
    for name, tol in (("--atol", atol), ("--rtol", rtol)):
        if not (tol >= 0 and math.isfinite(tol)):
            raise UsageError(f"{name} must be a finite number >= 0, not {tol}")

    def open_both():
        with source_option("--format-a"):
            ra = open_reader(a, fmt_a, trust_pickle)
        with source_option("--format-b"):
            return ra, open_reader(b, fmt_b, trust_pickle)

    sel = Selection(clean_fqns=clean_fqns, only=only, filters=tuple(filters))
    sel_a = replace(sel, unnest=unnest_a, nest=nest_a, side="-a")
    sel_b = replace(sel, unnest=unnest_b, nest=nest_b, side="-b")
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
        progress = progress or Progress()
        progress.begin(sum(m.nbytes for _, m in tensor_leaves(tree_a)), "compare")
        try:
            return compare(
                ra, tree_a, rb, tree_b, runtime, atol=atol, rtol=rtol, cast=cast, progress=progress
            )
        finally:
            progress.close()


def _side_option(error: ShardckptError, a: str | os.PathLike, b: str | os.PathLike) -> str:
    """Return diff's format option for the side whose files ``error`` concerns."""
    if error.path is not None:
        where = Path(error.path).resolve()
        for side, option in ((b, "--format-b"), (a, "--format-a")):
            root = Path(side).resolve()
            if where == root or root in where.parents:
                return option
    return "--format-a or --format-b"
