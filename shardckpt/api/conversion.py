"""``convert``: another layout, format or world size, exactly, in named steps.

Call order (every rank makes every call, with the same request):
  1) ``validate`` (an agreed step: a bad input seen by any rank stops all of them with
     one error): the request, the output format, the option rules, no I/O but configs.
  2) ``Destination.check`` (unless a dry run), judged by each rank where it sees DST
     (its node's disk) and agreed in one collective before anything waits on every rank.
  3) ``prepare`` (an agreed step): open SRC, plan, lay out DST's writer.
  4) ``write`` (not on a dry run): open DST, fill it (``engine.fill``), ``--verify`` it,
     rename it into place; on any failure no DST is left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from shardckpt.api import applies
from shardckpt.api.launch_notes import launch_notes
from shardckpt.api.mapping import mapped_source, without_edits
from shardckpt.api.requests import ConvertRequest
from shardckpt.api.storage import named, on_storage
from shardckpt.api.verification import verify_output
from shardckpt.core import lazy_torch
from shardckpt.core.costs import Costs, combined
from shardckpt.core.destination import Destination
from shardckpt.core.dist import Runtime
from shardckpt.core.errors import (
    CollectiveFailure,
    ShardckptError,
    UsageError,
    notice,
    source_option,
)
from shardckpt.core.placement import Placement, open_destination
from shardckpt.core.progress import Progress
from shardckpt.core.sight import Sight, agree_on_metadata, look, noting_metadata
from shardckpt.core.signals import committing
from shardckpt.core.words import a_or_an, counted
from shardckpt.engine import fill
from shardckpt.engine.exchange import SharedReader
from shardckpt.engine.read_checks import check_reads
from shardckpt.formats import (
    FILE_SUFFIXES,
    Format,
    checkpoint_files,
    default_format,
    format_named,
    open_reader,
)
from shardckpt.formats.base import Reader, Writer
from shardckpt.formats.hf.config import (
    CONFIG_FILE,
    HfConfig,
    check_names,
    config_beside,
    config_in,
    with_dtype,
)
from shardckpt.formats.hf.config import hf_config as read_hf_config
from shardckpt.formats.hf.sharded import HfReader
from shardckpt.formats.hf.tied import module_ties
from shardckpt.plan.cast import CastReader, dtype_name, target_dtype
from shardckpt.plan.plan import ConvertPlan, make_plan
from shardckpt.plan.selection import Selection, parse_edit
from shardckpt.plan.world_limits import check_rank_work
from shardckpt.plan.world_limits import check_world_size as check_most_ranks
from shardckpt.state.checksums import checking
from shardckpt.state.choices import LAYOUTS
from shardckpt.state.model import model_params

if TYPE_CHECKING:
    from shardckpt.formats.fsdp1.flat_layout import FlatModel


def _flat_model(request: ConvertRequest) -> FlatModel | None:
    """Return the FSDP1 flat layout of ``--model`` (torch's ``nn`` imported only then), or None."""
    if not request.model:
        return None
    from shardckpt.formats.fsdp1.flat_layout import FlatModel

    return FlatModel(request.model, tuple(request.wraps))


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
    costs: dict | None = None
    """What the run cost (``core.costs.combined``): phase seconds, bytes, each rank's peak
    resident memory; on the coordinator, None elsewhere and for a dry run."""


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` made: the output's format, the source's reader, the plan, DST's writer."""

    form: Format
    reader: Reader
    plan: ConvertPlan
    writer: Writer


@source_option("--from")
def convert(
    request: ConvertRequest, runtime: Runtime | None = None, progress: Progress | None = None
) -> ConvertResult:
    """Convert ``request.src`` into ``request.dst`` with layout ``request.to``; return what was written.

    DST appears only complete: written beside it, checked with ``verify``, then renamed.
    Under ``torchrun`` each rank reads only the files of SRC it sees (``core.sight``).
    Every CRC-32 written with SRC's records is checked as they are read (``checking``).
    """
    runtime = runtime or Runtime()
    form = output_format(request)
    if needs_torch(request, form):
        lazy_torch.load()
    commits = form.commit_last if form is not None else ()
    with on_storage(request, runtime, dst="dst", commits=commits) as run:
        with checking(), noting_metadata():
            result = _convert(run.request, runtime, progress)
        run.commits = format_named(result.format).commit_last  # a trainer's own layout too
        run.publish()
        return named(result, run)


COPIED_AS_THEY_LIE = ("safetensors", "hf")
"""The formats a full DST is written in from SRC's bytes alone: each tensor's bytes and a
header that names its dtype, no torch object made (a ``torch.save`` or DCP DST's pickles
and planners are torch's)."""


def needs_torch(request: ConvertRequest, form: Format | None) -> bool:
    """Return whether ``request`` makes tensors whatever SRC holds: torch is then imported before SRC is opened.

    A full safetensors or hf export, with no cast, mapping (``--map``, ``--hf-config``) or
    model, copies each tensor's bytes as they lie in SRC (``engine.stored_copy``) and needs
    no torch, whose import is most of a small export's time (8 s on a CUDA build). Anything else imports it first, so
    that SRC's dtypes are named by torch throughout the run; an export that meets a tensor
    SRC does not keep as it is to be written (a transposed view) imports it there, and reads
    that tensor through torch as before.
    """
    return not (
        form is not None
        and form.name in COPIED_AS_THEY_LIE
        and request.to == "full"
        and request.dtype == "keep"
        and not request.cast_optim
        and request.model is None
        and request.map is None
        # An hf DST with --hf-config is mapped by a shipped mapping whose rules name SRC.
        and request.hf_config is None
    )


def _convert(request: ConvertRequest, runtime: Runtime, progress: Progress | None) -> ConvertResult:
    start = time.perf_counter()
    costs = Costs()
    form = output_format(request)
    destination = Destination(
        request.dst,
        overwrite=request.overwrite,
        is_dir=form is not None and form.directory,
        srcs=(Path(request.src),),
        checkpoint_files=checkpoint_files,
    )
    with costs.phase("plan"):
        valid = runtime.agreed(lambda: validate(request, form, runtime))
        if not request.dry_run:
            # Each rank judges DST where it sees it (its node's disk): the verdicts are shared
            # before anything that waits on every rank (listing SRC, reading it) starts.
            runtime.check(destination.check)
    progress = progress or Progress()
    try:
        with costs.phase("plan"):
            prepared = runtime.agreed(
                lambda: prepare(request, valid, destination, runtime, progress)
            )
        # Before any data moves: a rank that read another copy of SRC's metadata stops all.
        agree_on_metadata(runtime, request.src)
        if not request.dry_run:
            _note_idle_ranks(prepared.plan, runtime)
        verified = (
            None
            if request.dry_run
            else write(request, prepared, destination, runtime, progress, costs)
        )
    finally:
        progress.close()
    plan = prepared.plan
    reports = None if request.dry_run else _cost_reports(costs, runtime)
    return ConvertResult(
        str(request.src),
        str(request.dst),
        prepared.form.name,
        request.to,
        plan.world_size,
        len(plan.tensors),
        plan.nbytes,
        plan.num_values,
        time.perf_counter() - start,
        request.dry_run,
        verified,
        plan,
        combined(reports, time.perf_counter() - start) if reports else None,
    )


def _cost_reports(costs: Costs, runtime: Runtime) -> list[dict] | None:
    """Return every rank's costs on the coordinator; None when a rank left once DST was in place.

    A signal that comes after DST is in place fails nothing: a rank that a second one
    ends leaves without its report, and the summary goes without costs.
    """
    try:
        return runtime.gather(costs.report())
    except CollectiveFailure:
        return None


def output_format(request: ConvertRequest) -> Format | None:
    """Return the format DST is written in (``--format``, else the layout's default); None for a bad ``--to``."""
    if request.to not in LAYOUTS:
        return None
    return format_named(request.format or default_format(request.to, request.dst))


# ---------------------------------------------------------------- 1) validate


@dataclass(frozen=True)
class Valid:
    """What ``validate`` made of a request: the output format, world size, rules' view, selection."""

    form: Format
    world_size: int
    choice: applies.Choice
    companions: HfConfig | None
    cast_to: object
    """The dtype model tensors are cast to (``torch.dtype``), or None."""
    selection: Selection


def validate(request: ConvertRequest, form: Format | None, runtime: Runtime) -> Valid:
    """Check the request against the output format and the option rules; read ``--hf-config``."""
    request.check()
    assert form is not None  # check() refuses the --to that has none
    _check_output(request, form)
    world_size = _target_world_size(request, runtime)
    if request.to != "full":
        _check_world_size(form, world_size)
    choice = _choice(request, form, runtime)
    applies.check(applies.CONVERT_RULES, choice)
    companions = read_hf_config(request.hf_config) if request.hf_config is not None else None
    _check_dst_name(request.dst, form)
    cast_to = target_dtype(choice.dtype)
    return Valid(form, world_size, choice, companions, cast_to, _selection(request))


# ---------------------------------------------------------------- 3) prepare


def prepare(
    request: ConvertRequest,
    valid: Valid,
    destination: Destination,
    runtime: Runtime,
    progress: Progress | None = None,
) -> Prepared:
    """Open SRC, plan, and make DST's writer."""
    progress = progress or Progress()
    progress.status("reading SRC's metadata")
    form, choice = valid.form, valid.choice
    flat_model = _flat_model(request)
    sight = _source_sight(request, runtime)
    reader = open_reader(request.src, request.src_format, request.trust_pickle, flat_model, sight)
    if isinstance(reader, HfReader):
        if request.model:
            reader.tie(module_ties(request.model, request.clean_fqns))
        elif reader.untold is not None and runtime.coordinator:
            notice(reader.untold)
    if request.format is None and request.nest is None and request.unnest is None:
        form = _own_layout(request, form, reader.format, valid.world_size, runtime)
    applies.check(applies.CONVERT_RULES, replace(choice, fmt=form.name, src_format=reader.format))
    mapped = mapped_source(
        reader,
        spec=request.map,
        output=form.name,
        companions=valid.companions,
        selection=valid.selection,
        coordinator=runtime.coordinator,
    )
    if mapped is not None:
        if sight is not None and not sight.complete:
            raise UsageError(
                "--map reads SRC's files on every rank, and the ranks see different files of it",
                path=request.src,
                hint="convert where every rank sees all of SRC (a shared filesystem)",
            )
        reader = mapped.reader
        valid = replace(valid, selection=without_edits(valid.selection))
    if format_named(reader.format).needs_model and flat_model is None:
        raise UsageError(
            f"{reader.format} flat parameters need the model to be read",
            path=request.src,
            hint="pass --model pkg.module:factory and the --wrap classes training wrapped",
        )
    selection = replace(valid.selection, model_root=_model_root(request, form))
    progress.status(_planning(request, valid.world_size))
    plan = _plan(request, reader, form, valid, selection, flat_model, runtime)
    if request.to != "full":
        _check_rank_work(plan, form)
    if mapped is not None:
        plan = replace(plan, mapping=mapped.summary)
    if form.name == "hf":
        companions = mapped.made_config if mapped and mapped.made_config else valid.companions
        plan = _with_hf_config(plan, companions, request.src, runtime)
    if request.zero_stage is not None:
        plan = replace(plan, zero_stage=request.zero_stage)
    reader.check_selected(plan.tree)
    if runtime.coordinator:
        for note in (*plan.notes, *form.notes(plan.tree, plan.world_size)):
            notice(note)
    writer = form.writer(destination.tmp, plan)
    return Prepared(form, _reading(reader, plan, sight), plan, writer)


def _own_layout(
    request: ConvertRequest, form: Format, src_format: str, world_size: int, runtime: Runtime
) -> Format:
    """Return the format DST is written in without ``--format``: a trainer's own, for its source.

    A trainer's directory (``Format.keeps_layout``) converted to its layout is what its
    trainer loads only in that trainer's layout; checked as ``--format`` would be, said once.
    """
    own = format_named(default_format(request.to, request.dst, src_format))
    if own is form:
        return form
    _check_output(request, own)
    _check_world_size(own, world_size)
    _check_dst_name(request.dst, own)
    if runtime.coordinator:
        notice(
            f"writing DST as {a_or_an(own.title)} checkpoint, SRC's own layout "
            f"(pass --format {form.name} for a bare {form.title} one)"
        )
    return own


def _check_output(request: ConvertRequest, form: Format) -> None:
    """Refuse an output format of another layout, or one that needs a model not given."""
    if form.layout != request.to:
        raise UsageError(
            f"--format {form.name} is a {form.layout} layout, not {request.to}",
            hint=f"pass --to {form.layout}, or a {request.to} format",
        )
    if form.needs_model and not request.model:
        raise UsageError(
            f"--format {form.name} needs the model's flat-parameter layout",
            hint="pass --model pkg.module:factory and the --wrap classes training wraps",
        )


def _check_dst_name(dst, form: Format) -> None:
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


def _target_world_size(request: ConvertRequest, runtime: Runtime) -> int:
    """Return the world size DST is for: ``--world-size``, else the launch's (said once).

    Standalone there is no launch to take it from, and a silent 1 would write a
    checkpoint for one rank that an N-rank job cannot resume from as it expects.
    """
    if request.world_size is not None or request.to == "full":
        return request.world_size or runtime.world_size
    if not runtime.distributed:
        raise UsageError(
            f"--to {request.to} needs --world-size outside torchrun",
            hint="pass --world-size M, the number of ranks that will load DST",
        )
    if runtime.coordinator:
        notice(
            f"writing DST for world size {runtime.world_size}, the launch's "
            "(pass --world-size M for another)"
        )
    return runtime.world_size


def _check_world_size(form: Format, world_size: int) -> None:
    """Refuse a world size the format cannot describe (FSDP1 on one rank runs NO_SHARD), or too many ranks."""
    check_most_ranks(world_size)
    if world_size < form.min_world_size:
        raise UsageError(
            f"--format {form.name} for --world-size {world_size}: FSDP1 on one rank runs "
            "NO_SHARD, whose state dicts hold whole tensors, not shards",
            hint="convert --to full for a one-rank job (it loads with FULL_STATE_DICT), "
            f"or pass --world-size {form.min_world_size} or more",
        )


def _check_rank_work(plan: ConvertPlan, form: Format) -> None:
    """Refuse a world size out of proportion with what each rank would hold (``world_limits``)."""
    metas = [m for _, m in plan.tensors]
    if form.needs_model:  # FSDP1's flat parameters are split by elements, not rows
        parts = sum(m.numel for m in metas)
        what = f"SRC's tensors hold {parts} elements in all"
    else:
        parts = max((m.shape[0] for m in metas if m.shape), default=0)
        what = f"SRC's tensors have at most {parts} rows"
    check_rank_work(plan.world_size, parts, what, len(metas) + plan.num_values)


def _choice(request: ConvertRequest, form: Format, runtime: Runtime) -> applies.Choice:
    """Return what the option rules judge: the request's options, the output, the launch."""
    return applies.Choice(
        to=request.to,
        fmt=form.name,
        src_format=request.src_format,
        only=request.only,
        dtype=dtype_name(request.dtype),
        cast_optim=request.cast_optim,
        optim_keys=request.optim_keys,
        world_size=request.world_size,
        max_shard_size=request.max_shard_size,
        model=request.model,
        wraps=tuple(request.wraps),
        use_orig_params=request.use_orig_params,
        zero_stage=request.zero_stage,
        src_local=request.src_local,
        hf_config=None if request.hf_config is None else str(request.hf_config),
        distributed=runtime.distributed,
        nest=request.nest,
    )


def _selection(request: ConvertRequest) -> Selection:
    """Return what of SRC's tree is written, and under which keys."""
    return Selection(
        only=request.only,
        filters=tuple(request.filters),
        clean_fqns=request.clean_fqns,
        optim_keys=request.optim_keys,
        edits=tuple(parse_edit(option, text) for option, text in request.edits),
        model=model_params(request.model, request.clean_fqns) if request.model else None,
        unnest=request.unnest,
        nest=request.nest,
    )


def _note_idle_ranks(plan: ConvertPlan, runtime: Runtime) -> None:
    """Say once (rank 0) when the launch has more processes than work for them."""
    if runtime.distributed and runtime.coordinator:
        for note in launch_notes(
            runtime.world_size, plan.layout, plan.world_size, runtime.device_type
        ):
            notice(note)


def _planning(request: ConvertRequest, world_size: int) -> str:
    """Return what the status line says while DST is planned (the long part at thousands of ranks)."""
    if request.to == "full":
        return "planning DST"
    return f"planning DST for {world_size:,} target {'rank' if world_size == 1 else 'ranks'}"


def _model_root(request: ConvertRequest, form: Format) -> bool:
    """Return whether DST's root is the ``model`` subtree: ``--only model`` to one file a model loads.

    ``model.load_state_dict`` takes the model's FQNs at the root; a file of
    ``model.embed.weight`` ... would need unnesting by every user who loads it.
    """
    return (
        request.only == "model"
        and form.model_root
        and request.unnest is None
        and request.nest is None
    )


def _source_sight(request: ConvertRequest, runtime: Runtime) -> Sight | None:
    """Return which ranks see which of SRC's files when they do not all see all of them."""
    sight = look(request.src, runtime) if runtime.distributed else None
    partial = sight if sight is not None and not sight.complete else None
    if partial is not None and not request.src_local and runtime.coordinator:
        notice(
            "the ranks see different files of SRC: each file is read where it is seen "
            "and its rows sent over the collective (pass --src-local to say so and "
            "silence this note)"
        )
    return sight


def _plan(
    request: ConvertRequest,
    reader: Reader,
    form: Format,
    valid: Valid,
    selection: Selection,
    flat_model: FlatModel | None,
    runtime: Runtime,
) -> ConvertPlan:
    """Return the frozen plan of DST in ``form``: the selected tree, its tensors, who writes what."""
    index = reader.index()
    carried = [p.file for p in index.parts if p.key is None]
    # A DST of model weights alone (hf, --only model) has no use for a job's RNG states,
    # sampler or the like: naming them there would only say what nobody lost.
    weights_only = form.name == "hf" or selection.only == "model"
    if carried and not form.carries_files and not weights_only and runtime.coordinator:
        notice(
            f"not in DST: {', '.join(carried)} ({counted(len(carried), 'file')} SRC "
            f"carries unread; `shardckpt inspect SRC` says what each holds): copy "
            "them yourself if the job that loads DST needs them"
        )
    return make_plan(
        index,
        selection,
        form.name,
        valid.world_size,
        request.buffer_bytes,
        dtype=valid.cast_to,
        cast_optim=request.cast_optim,
        max_shard_size=request.max_shard_size,
        flat_model=flat_model,
        use_orig_params=request.use_orig_params,
    )


def _with_hf_config(
    plan: ConvertPlan, companions: HfConfig | None, src, runtime: Runtime
) -> ConvertPlan:
    """Return ``plan`` with the config files an ``hf`` DST gets: named, else found in SRC."""

    def note(text: str) -> None:
        if runtime.coordinator:
            notice(text)

    if companions is None:
        found = config_in(src)
        if found is None:
            # The directory SRC sits in may be a shared download folder: another model's.
            if (beside := config_beside(src)) is not None:
                note(
                    f"not copying config.json from '{beside}', the directory SRC is in: pass "
                    f"--hf-config '{beside}' if it is this model's"
                )
            return plan
        try:
            companions = read_hf_config(found, detected=True)
        except ShardckptError as exc:
            note(f"not copying config.json from '{found}': {exc.line()}")
            return plan
    tensors = plan.tree["model"]
    checked = check_names(companions, tensors, note)
    if checked is None:
        return plan
    companions = with_dtype(checked, tensors, note)
    for name, source in companions.tied.items():
        note(
            f"leaving '{name}' out of DST: '{companions.root / CONFIG_FILE}' ties it to "
            f"'{source}', as save_pretrained does"
        )
    if companions.made:
        note(
            f"writing config.json ({', '.join(companions.config['architectures'])}) from the "
            f"model arguments in '{Path(src) / 'common.pt'}' (pass --hf-config DIR for another)"
        )
    if companions.detected:
        more = len(companions.files) - 1
        others = f" and {counted(more, 'other file')}" if more else ""
        note(
            f"copying config.json{others} from '{companions.root}', where SRC is "
            "(pass --hf-config DIR for another model's)"
        )
    return replace(plan, hf_config=companions)


def _reading(reader: Reader, plan: ConvertPlan, sight: Sight | None) -> Reader:
    """Return ``reader`` as the fill loop reads it: through the cast, and the exchange of unseen rows."""
    # Reading through the cast also makes --verify compare DST with the cast source.
    if plan.read_as:
        reader = CastReader(reader, plan.read_as)
    if sight is not None and not sight.complete:
        reader = SharedReader(reader, sight, plan.metas, plan.buffer_bytes)
    return reader


# ---------------------------------------------------------------- 2) write


def write(
    request: ConvertRequest,
    prepared: Prepared,
    destination: Destination,
    runtime: Runtime,
    progress: Progress | None,
    costs: Costs | None = None,
) -> bool | None:
    """Open DST, fill it, verify it and rename it into place; return whether it was verified."""
    costs = costs or Costs()
    form, reader, plan, writer = prepared.form, prepared.reader, prepared.plan, prepared.writer
    verified = None
    try:
        placement = open_destination(destination, runtime)
        runtime.agreed(lambda: _check_placement(placement, form, plan, request))
        writer.placement = placement
        progress = progress or Progress()
        # Laying out DST's files (DCP's own planning, at M target ranks) comes before the bar.
        progress.status(_planning(request, plan.world_size))
        try:
            fill.run(reader, plan, writer, runtime, progress, costs, request.threads)
            with costs.phase("finish"):  # SRC's checksums judged: a record each chunk
                check_reads(runtime, request.src)
            if request.verify:
                with costs.phase("verify"):
                    verified = verify_output(
                        reader,
                        replace(plan, tree=writer.written_tree(plan.tree)),
                        destination,
                        runtime,
                        request.trust_pickle,
                        placement,
                        progress,
                    )
                    check_reads(runtime, request.src)  # again: records read whole only now
        finally:
            progress.close()
        # Every rank holds signals from the agreement that DST is whole until it is in
        # place: a signal to one rank can neither leave the renames half-done nor fail a run
        # whose DST another rank has put in place already.
        with committing(f"'{request.dst}'"):
            runtime.agreed(lambda: None)  # every rank wrote (and verified) its part
            runtime.agreed(lambda: destination.commit() if placement.opener else None)
    except BaseException as exc:
        if runtime.coordinator and not destination.committed:
            # BaseException.add_note is Python 3.11+; __notes__ is what it appends to.
            exc.__notes__ = [*getattr(exc, "__notes__", ()), f"'{request.dst}' was not written"]
        raise
    finally:
        destination.close()  # on the ranks that opened DST; nothing elsewhere
    return verified


def _check_placement(
    placement: Placement, form: Format, plan: ConvertPlan, request: ConvertRequest
) -> None:
    """Refuse what DST on several disks cannot hold; say where each target rank's files go."""
    if not placement.several:
        return
    if form.layout == "full":
        raise UsageError(
            f"the ranks write DST to {len(placement.groups)} disks they do not share, and "
            f"--format {form.name} is one full output every rank writes into",
            path=request.dst,
            hint="write it to a filesystem every rank sees, or run the ranks on one node",
        )
    if request.verify and not form.src_local:
        raise UsageError(
            f"--verify reads DST back from every rank, and --format {form.name} on disks "
            "the ranks do not share cannot be",
            path=request.dst,
            hint="drop --verify and run diff on the gathered files, or write DST where "
            "every rank sees it",
        )
    if placement.rank == 0:
        notice(placement.describe(plan.world_size))
