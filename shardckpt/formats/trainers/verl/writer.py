"""Writing a veRL ``FSDPCheckpointManager`` directory for M ranks, which veRL's manager loads at M.

Target rank r's ``model_world_size_{M}_rank_{r}.pt`` and ``optim_world_size_{M}_rank_{r}.pt``
hold what rank r of a veRL job at M saves, and rank 0's ``fsdp_config.json`` says M:

- ``verl`` (FSDP2): ``model.state_dict()`` and ``optimizer.state_dict()`` of ``Shard(0)``
  DTensors of r's rows (laid out as ``fsdp2-ranks`` lays them out), the optimizer by ID;
- ``verl-fsdp1``: the model as FSDP1's ``SHARDED_STATE_DICT`` (``fsdp1-sharded``'s
  ShardedTensors) and the optimizer as FSDP1's flat-parameter slices (``flat_optim_write``).

The files SRC carries unread are copied as they are: ``huggingface/`` and, renamed for
M, each rank's ``extra_state`` (``extra_state``).
"""

from __future__ import annotations

import shutil
from abc import abstractmethod
from pathlib import Path

from shardckpt.core.errors import UsageError, notice
from shardckpt.core.files import writing
from shardckpt.formats.base import Frame
from shardckpt.formats.fsdp1.flat_layout import flat_layouts
from shardckpt.formats.fsdp1.writer import Fsdp1ShardedWriter
from shardckpt.formats.ranks.rank_file import Fills, dtensor_placeholders, frame_rank_file
from shardckpt.formats.ranks.target_ranks import TargetRanksWriter, job_mesh, merge_frames
from shardckpt.formats.trainers.parts import sub_plan
from shardckpt.formats.trainers.verl.extra_state import extra_state_copies
from shardckpt.formats.trainers.verl.flat_optim_write import flat_state, unit_ids
from shardckpt.formats.trainers.verl.names import (
    CONFIG_FILE,
    MODEL,
    OPTIM,
    FsdpConfig,
    file_name,
    parse,
    write_config,
)
from shardckpt.state.optim import key_type
from shardckpt.state.tree import PARAM_NAMES


class _VerlDirWriter(TargetRanksWriter):
    """What both FSDP versions' directories share: the per-rank files of each part, the rest copied."""

    version = 0
    format = ""
    optim_keys = ""
    """The optimizer key type the version's files hold (``optim.key_type``)."""
    keys_hint = ""
    """How to get an optimizer keyed so."""

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        self._check_tree(plan.tree)
        src = Path(plan.src)
        carried = [p.file for p in plan.parts if p.key is None]
        self.copied = [(src / n, n) for n in carried if n != CONFIG_FILE and parse(n) is None]
        self.extra, self.note = extra_state_copies(src, carried, plan.world_size)
        self.every_copy = (CONFIG_FILE,) + tuple(
            name for path, name in [*self.copied, *self.extra] if not path.is_dir()
        )

    def _check_tree(self, tree: dict) -> None:
        """Refuse what veRL's manager cannot load: other top-level keys, optimizer keys of another kind."""
        other = [k for k in tree if k not in (MODEL, OPTIM)]
        if other:
            raise UsageError(
                f"--format {self.format} holds a model and an optimizer ('{MODEL}', "
                f"'{OPTIM}'), and top-level key {other[0]!r} is neither",
                hint="--filter it out, --nest/--unnest the tree, or write --format fsdp2-ranks",
            )
        if MODEL not in tree:
            raise UsageError(
                f"--format {self.format} needs the model ('{MODEL}'): veRL's manager loads it first",
                hint="drop --only optim, or select the model with --filter",
            )
        if OPTIM in tree and key_type(tree[OPTIM]) not in (self.optim_keys, "empty"):
            raise UsageError(
                f"--format {self.format} writes the optimizer keyed by {self.optim_keys}, "
                f"and this one is keyed by {key_type(tree[OPTIM])}",
                hint=self.keys_hint,
            )

    def frame_rank(self, rank: int) -> Frame:
        frames = [
            self.frame_part(part, rank, self.root / file_name(part, self.plan.world_size, rank))
            for part in (MODEL, OPTIM)
            if part in self.plan.tree
        ]
        return merge_frames(frames)

    @abstractmethod
    def frame_part(self, part: str, rank: int, path: Path) -> Frame:
        """Create target rank ``rank``'s file of ``part`` at ``path``; return what fills it."""

    def finish(self) -> None:
        with writing(self.root / CONFIG_FILE):
            write_config(self.root, FsdpConfig(self.version, self.plan.world_size))
        for src, name in [*self.copied, *self.extra]:
            with writing(self.root / name):
                if src.is_dir():
                    shutil.copytree(src, self.root / name)
                else:
                    shutil.copyfile(src, self.root / name)
        if self.note:
            notice(self.note)


class VerlWriter(_VerlDirWriter):
    """A veRL directory at M in FSDP2's layout: DTensor state dicts, the optimizer by param ID."""

    version = 2
    format = "verl"
    optim_keys = "id"
    keys_hint = (
        "add --optim-keys id (with --model when SRC lists parameters in another order than "
        "the model's, as FSDP1 does)"
    )

    def frame_part(self, part: str, rank: int, path: Path) -> Frame:
        fills: Fills = {}
        sub = sub_plan(self.plan, self.plan.format, self.plan.tree[part])
        state = dtensor_placeholders(sub, rank, job_mesh(self.plan.world_size, rank), fills)
        return frame_rank_file(path, state, fills)


class _ModelFiles(Fsdp1ShardedWriter):
    """FSDP1's ``SHARDED_STATE_DICT`` of the model, in the file veRL names."""

    path = Path()

    def rank_path(self, rank: int) -> Path:
        return self.path


class VerlFsdp1Writer(_VerlDirWriter):
    """A veRL directory at M in FSDP1's layout: ShardedTensor model, flat-parameter optimizer slices."""

    version = 1
    format = "verl-fsdp1"
    optim_keys = "fqn"
    keys_hint = "drop --optim-keys (or pass --optim-keys fqn, with --model for an ID-keyed SRC)"

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        if OPTIM in plan.tree and plan.flat_model is None:
            raise UsageError(
                "--format verl-fsdp1 lays the optimizer out in FSDP1's flat parameters, "
                "which only the model's FSDP1 wrapping gives",
                hint="pass --model pkg.module:factory and --wrap the classes veRL wraps, or "
                "--only model",
            )
        self.model_files = _ModelFiles(root, sub_plan(plan, plan.format, plan.tree[MODEL]))

    def frame_part(self, part: str, rank: int, path: Path) -> Frame:
        if part == MODEL:
            self.model_files.path = path
            return self.model_files.frame_rank(rank)
        optim = self.plan.tree[OPTIM]
        layouts = flat_layouts(self.plan.flat_model, self.plan.world_size, rank, False)
        ids, groups = unit_ids(optim, layouts)
        fills: Fills = {}
        state = {
            ids[u]: flat_state(optim, lay, rank, fills)
            for u, lay in sorted(enumerate(layouts), key=lambda ul: ids[ul[0]])
        }
        param_groups = [
            {**{k: v for k, v in g.items() if k not in ("params", PARAM_NAMES)}, "params": p}
            for g, p in zip(optim["param_groups"], groups)
        ]
        return frame_rank_file(path, {"state": state, "param_groups": param_groups}, fills)
