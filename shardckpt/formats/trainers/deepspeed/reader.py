"""``deepspeed``: a ZeRO-1/2/3 save (the run directory with ``latest``, or a ``global_stepN/``) as one tree.

Every rank's optimizer file is opened (memory-mapped; its pickle read with stand-ins,
``unpickle``; ``save``), each trainable parameter's fp32 master weights and Adam moments
become ``Spans`` of the ranks' flat partitions (``trainables``): a read copies just the
rows asked for from the files that hold them. ``deepspeed-module`` reads the same save
with ``model`` the module's own weights and buffers as saved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import source_stat
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.formats.trainers.deepspeed import names
from shardckpt.formats.trainers.deepspeed.assemble import (
    MASTER,
    MODULE,
    Sources,
    job_values,
    model_tree,
    module_tree,
    optim_tree,
)
from shardckpt.formats.trainers.deepspeed.save import open_save
from shardckpt.formats.trainers.deepspeed.states import ModelStates
from shardckpt.formats.trainers.deepspeed.trainables import trainables
from shardckpt.formats.trainers.deepspeed.trainer_files import RNG_FILE, trainer_files
from shardckpt.state.tree import TensorMeta

# What ``engine.save_checkpoint`` copies into the run directory beside the save.
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


class DeepSpeedReader(Reader):
    """Reads a ZeRO save: ``model`` the fp32 master weights (``zero_to_fp32``'s), ``optim`` FQN-keyed."""

    format = "deepspeed"
    view = MASTER

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        source_stat(self.src)
        self.save = open_save(self.src)
        self.sources = Sources()
        self._notes: list[str] = []
        found = trainables(self.save)
        models = self.save.models
        if self.view == MODULE:
            model = self._module(models[0])
        else:
            model = model_tree(models, found, self.sources, self.save.stage == 3, self._notes)
        first = self.save.optims[0]
        self._tree = {
            "model": model,
            "optim": optim_tree(found, first.param_groups, self.sources),
            **job_values(models[0], first.scaler, self.sources),
        }

    def _module(self, model: ModelStates) -> dict:
        if self.save.stage == 3:
            raise BadInputError(
                "is a ZeRO-3 save: its model-states files hold every parameter as a "
                "placeholder, and no 16-bit module weights",
                path=self.save.files.dir,
                hint="read the fp32 master weights (--from deepspeed), with --dtype bf16 to "
                "cast them",
            )
        return module_tree(model, self.sources)

    def index(self) -> Index:
        return Index(self.format, str(self.src), self.save.world_size, self._tree)

    def notes(self) -> list[str]:
        return list(self._notes)

    def members(self) -> frozenset[str]:
        """Return ``latest``, the save's files and the recovery scripts DeepSpeed copies beside them."""
        files = self.save.files
        paths = [*files.model.values(), *files.optim.values()]
        if files.dir != self.src:
            paths += [self.src / names.LATEST]
            paths += [p for n in RECOVERY_SCRIPTS if (p := self.src / n).is_file()]
            # An HF Trainer's checkpoint-N/: its own files are the checkpoint's too.
            carried, _ = trainer_files(self.src, files.dir, self.save.world_size)
            paths += [p for n in carried if (p := self.src / n).is_file()]
            paths += [p for p in self.src.glob("rng_state_*.pth") if RNG_FILE.fullmatch(p.name)]
        return frozenset(p.relative_to(self.src).as_posix() for p in paths)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return self.sources.read(metas, rows)


class DeepSpeedModuleReader(DeepSpeedReader):
    """Reads a ZeRO-1/2 save with ``model`` the module's own weights and buffers as saved."""

    format = "deepspeed-module"
    view = MODULE
