"""``deepspeed-universal``: what DeepSpeed's ``ds_to_universal`` writes, read as the same tree as the save.

A universal tag directory holds, per trainable parameter, ``zero/<fqn>/fp32.pt`` and
one file per optimizer state (``exp_avg.pt``, ``exp_avg_sq.pt``; ZeRO-1/2 also
``step.pt``): ZeRO-1/2's as ``{"param": tensor of the parameter's shape, "cat_dim": 0}``,
ZeRO-3's in a flat form, the bare 1-D tensor (its shape is the model-states files'
``param_shapes``). ``zero/optimizer_state.pt`` keeps the param groups (and, from ZeRO-3,
rank 0's optimizer state, whose ``step`` is each sub-group's), and the model-states files
are copied beside: buffers, frozen and tied parameters are read from them as from the save.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import check_separate, has_file, source_entry, source_file, source_stat
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.formats.torch_save.in_place import values
from shardckpt.formats.trainers.deepspeed import names
from shardckpt.formats.trainers.deepspeed.agreement import check_model_states
from shardckpt.formats.trainers.deepspeed.assemble import (
    Sources,
    Stored,
    Trainable,
    job_values,
    model_tree,
    optim_tree,
)
from shardckpt.formats.trainers.deepspeed.sources import Whole
from shardckpt.formats.trainers.deepspeed.states import (
    ModelStates,
    bad,
    read_model_states,
    scaler_of,
    world_size_of,
)
from shardckpt.formats.trainers.deepspeed.unpickle import load_dict_file, load_file
from shardckpt.state.tree import TensorMeta

MASTER_FILE = "fp32.pt"
_RECOPY = "the universal checkpoint is incomplete; run ds_to_universal again"


def _tensor_file(path: Path, shape: tuple[int, ...]) -> torch.Tensor:
    """Return the tensor of one per-parameter file, in ``shape``; refuse one of another size.

    A URL SRC's file is on the meta device (``load_file``): its bytes are read when a
    rank reads its rows of it, so a view is kept; a tensor no view reshapes is read here.
    """
    obj = load_file(path)
    t = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(t, torch.Tensor) or t.numel() != math.prod(shape):
        got = f"{t.numel()} elements" if isinstance(t, torch.Tensor) else type(t).__name__
        raise BadInputError(
            f"holds {got}, where the parameter has shape {list(shape)}",
            path=path,
            hint=_RECOPY,
        )
    t = t.detach()
    if t.device.type == "meta" and not t.is_contiguous():
        t = values(t)
    return t.reshape(shape)


def _world_size(path: Path, common: dict, files: names.TagFiles, model: ModelStates) -> int:
    """Return the world size ``partition_count`` says, once the model-states files agree with it.

    The count is a few bytes of a pickle (10**12 as easily as 2): it must be the number
    of ZeRO-3 model-states files, and the ``dp_world_size`` the model-states file saved.
    """
    world_size = world_size_of(path, common.get("partition_count"))
    names.check_model_ranks(files, world_size)
    if model.dp_world_size is not None and model.dp_world_size != world_size:
        raise BadInputError(
            f"partitions over {world_size} ranks, but '{model.path.name}' was saved by "
            f"{model.dp_world_size} (dp_world_size)",
            path=path,
            hint=_RECOPY,
        )
    return world_size


class UniversalReader(Reader):
    """Reads a ``ds_to_universal`` directory: the same tree as the ZeRO save it was made from."""

    format = "deepspeed-universal"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        source_stat(self.src)
        self.dir = names.universal_tag_dir(self.src)
        common_path = self.dir / names.UNIVERSAL_DIR / names.UNIVERSAL_OPTIM
        if not has_file(common_path, self.src):
            raise BadInputError(
                f"has no '{names.UNIVERSAL_DIR}/{names.UNIVERSAL_OPTIM}'",
                path=self.dir,
                hint="pass the directory ds_to_universal wrote (its --output_folder), or the "
                "one holding latest_universal",
            )
        common = load_dict_file(common_path)
        self.stage = common.get("zero_stage") or 1
        self.files = files = names.tag_files(self.dir, self.src)
        models = [read_model_states(files.model[r]) for r in sorted(files.model)]
        check_model_states(models)
        self.world_size = _world_size(common_path, common, files, models[0])
        groups = common.get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise bad(common_path, "'param_groups' is not a list of param groups")
        self.sources = Sources()
        found = self._trainables(models[0], groups, self._steps(common, common_path))
        self._tree = {
            "model": model_tree(models, found, self.sources, placeholders=self.stage == 3),
            "optim": optim_tree(found, groups, self.sources),
            **job_values(models[0], scaler_of(common), self.sources),
        }

    def _steps(self, common: dict, path: Path) -> dict[int, torch.Tensor]:
        """Return ZeRO-3's step counter of each sub-group (rank 0's optimizer state); {} for ZeRO-1/2."""
        if self.stage != 3:
            return {}
        osd = common.get("optimizer_state_dict")
        state = osd.get("state") if isinstance(osd, dict) else None
        if not isinstance(state, dict):
            raise bad(path, "has no ZeRO-3 'optimizer_state_dict' with its 'state'")
        return {
            s: v["step"]
            for s, v in state.items()
            if isinstance(v, dict) and isinstance(v.get("step"), torch.Tensor)
        }

    def _group_of(self, flats: int, groups: list[dict]) -> dict[int, int]:
        """Return the param group of each flat group (ZeRO-3: sub-group, as ``params`` lists them)."""
        if self.stage != 3:
            return {g: g for g in range(flats)}
        return {s: g for g, group in enumerate(groups) for s in group.get("params", [])}

    def _trainables(
        self, model: ModelStates, groups: list[dict], steps: dict[int, torch.Tensor]
    ) -> list[Trainable]:
        group_of = self._group_of(len(model.param_shapes), groups)
        layout = f"universal, ZeRO-{self.stage} of {self.world_size}"
        files = {fqn: self._param_files(model, fqn) for fqn in model.trainable}
        self._check_separate(files)
        out = []
        for flat, shapes in enumerate(model.param_shapes):
            if flat not in group_of or group_of[flat] >= len(groups):
                raise BadInputError(
                    f"no param group holds flat group {flat} of the model-states file",
                    path=self.dir / names.UNIVERSAL_DIR / names.UNIVERSAL_OPTIM,
                    hint=_RECOPY,
                )
            for fqn, shape in shapes:
                out.append(
                    self._trainable(fqn, shape, group_of[flat], steps.get(flat), layout, files[fqn])
                )
        return out

    def _param_files(self, model: ModelStates, fqn: str) -> list[Path]:
        """Return the files of parameter ``fqn`` (``fp32.pt`` first), each through the source gate.

        The name is a directory of ``zero/``: one path component, never ``..`` or a
        path, so a model-states file cannot make the reader open files outside SRC.
        """
        if fqn in ("", ".", "..") or "/" in fqn or "\0" in fqn:
            raise bad(
                model.path,
                f"'param_shapes' names {names.shown(fqn)}, which is not a parameter name "
                f"(ds_to_universal keeps each in a directory '{names.UNIVERSAL_DIR}/<name>')",
            )
        where = self.dir / names.UNIVERSAL_DIR / fqn
        if not (os.path.lexists(where / MASTER_FILE) and source_entry(where, self.src)):
            raise BadInputError(
                f"has no '{names.UNIVERSAL_DIR}/{fqn}/{MASTER_FILE}' for parameter '{fqn}'",
                path=self.dir,
                hint=_RECOPY,
            )
        found = [source_file(where / MASTER_FILE, self.src)]
        for name in sorted(names.listing(where), key=lambda n: (n != "step.pt", n)):
            if name != MASTER_FILE and name.endswith(".pt"):
                found.append(source_file(where / name, self.src))
        return found

    def _check_separate(self, files: dict[str, list[Path]]) -> None:
        """Refuse two names of one file among every file the reader opens (a link would read as another's)."""
        zero = self.dir / names.UNIVERSAL_DIR
        every = [zero / names.UNIVERSAL_OPTIM, *(p for paths in files.values() for p in paths)]
        every += self.files.model.values()
        check_separate({str(p.relative_to(self.dir)): p for p in every}, lambda name: f"'{name}'")

    def _trainable(
        self, fqn: str, shape: tuple[int, ...], group: int, step, layout: str, files: list[Path]
    ) -> Trainable:
        master = _tensor_file(files[0], shape)
        states: dict = {}
        if step is not None:
            states["step"] = Stored(Whole(step.detach()), (), step.dtype, "full")
        for file in files[1:]:
            name = file.name.removesuffix(".pt")
            t = _tensor_file(file, () if name == "step" else shape)
            states[name] = Stored(
                Whole(t), tuple(t.shape), t.dtype, "full" if name == "step" else layout
            )
        return Trainable(fqn, group, Stored(Whole(master), shape, master.dtype, layout), states)

    def index(self) -> Index:
        return Index(self.format, str(self.src), self.world_size, self._tree)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return self.sources.read(metas, rows)
