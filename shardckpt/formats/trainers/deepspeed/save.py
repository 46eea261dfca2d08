"""Every file of one ZeRO save (a tag directory), read and checked against each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardckpt.core.errors import BadInputError
from shardckpt.formats.trainers.deepspeed import names
from shardckpt.formats.trainers.deepspeed.agreement import check_model_states, check_optim_states
from shardckpt.formats.trainers.deepspeed.lone_file import refuse_lone_file
from shardckpt.formats.trainers.deepspeed.states import (
    ModelStates,
    OptimStates,
    read_model_states,
    read_optim_states,
)

RECOPY = "the files are not of one save; re-copy the checkpoint"


@dataclass(frozen=True)
class ZeroSave:
    """One ZeRO save: its files, each rank's optimizer file and the model-states file(s)."""

    files: names.TagFiles
    optims: tuple[OptimStates, ...]
    """Rank r's optimizer file at index r."""
    models: tuple[ModelStates, ...]
    """The model-states file (ZeRO-1/2), or each rank's (ZeRO-3)."""

    @property
    def stage(self) -> int:
        """Return the ZeRO stage (1, 2 or 3)."""
        return self.optims[0].stage

    @property
    def world_size(self) -> int:
        """Return the number of data-parallel ranks that saved."""
        return len(self.optims)

    @property
    def layout(self) -> str:
        """Return how ``inspect`` describes a tensor kept in the flat partitions."""
        return f"ZeRO-{self.stage} flat over {self.world_size}"


def open_save(src: Path) -> ZeroSave:
    """Return the save ``src`` names (a run directory with ``latest``, or a tag directory), checked."""
    if not src.is_dir():
        refuse_lone_file(src)
        raise BadInputError(
            "is a file, not a DeepSpeed checkpoint directory",
            path=src,
            hint="pass the run directory (with 'latest') or a global_stepN directory",
        )
    files = names.tag_files(names.tag_dir(src), src)
    optims = _optimizer_files(files)
    return ZeroSave(files, optims, _model_files(files, optims))


def _optimizer_files(files: names.TagFiles) -> tuple[OptimStates, ...]:
    """Return every rank's optimizer file; refuse a set that is not one save's."""
    if 0 not in files.optim:
        raise BadInputError(
            "holds no optimizer file of rank 0 (zero_pp_rank_0_mp_rank_00_optim_states.pt)",
            path=files.dir,
            hint="copy every rank's files of the save; a save without ZeRO optimizer "
            "files is read as a torch file (--from torch)",
        )
    first = read_optim_states(files.optim[0])
    names.check_ranks(files, first.world_size)
    optims = (first, *(read_optim_states(files.optim[r]) for r in range(1, first.world_size)))
    for o in optims[1:]:
        if (o.stage, o.world_size, len(o.flat)) != (first.stage, first.world_size, len(first.flat)):
            raise BadInputError(
                f"is of ZeRO stage {o.stage}, {o.world_size} ranks and {len(o.flat)} flat "
                f"groups, where rank 0's file is of {first.stage}, {first.world_size} and "
                f"{len(first.flat)}",
                path=o.path,
                hint=RECOPY,
            )
    return optims


def _model_files(files: names.TagFiles, optims: tuple[OptimStates, ...]) -> tuple[ModelStates, ...]:
    """Return the model-states file(s); refuse ones that do not list what the optimizer files hold."""
    stage, flats = optims[0].stage, len(optims[0].flat)
    if (stage == 3) != files.per_rank_model:
        raise BadInputError(
            f"holds ZeRO stage {stage} optimizer files beside the model-states files "
            f"of stage {'3' if files.per_rank_model else '1/2'}",
            path=files.dir,
            hint=RECOPY,
        )
    models = tuple(read_model_states(files.model[r]) for r in sorted(files.model))
    for m in models[1:]:
        if m.param_shapes != models[0].param_shapes:
            raise BadInputError(
                "lists other parameters (param_shapes) than rank 0's model-states file",
                path=m.path,
                hint=RECOPY,
            )
    if len(models[0].param_shapes) != flats:
        raise BadInputError(
            f"lists {len(models[0].param_shapes)} flat groups of parameters, but the "
            f"optimizer files hold {flats}",
            path=models[0].path,
            hint=RECOPY,
        )
    check_model_states(models)
    check_optim_states(optims, models[0])
    return models
