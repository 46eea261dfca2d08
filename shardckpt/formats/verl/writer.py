"""Writing a veRL ``FSDPCheckpointManager`` directory for M ranks, which veRL's manager loads at M.

Target rank r's ``model_world_size_{M}_rank_{r}.pt`` and ``optim_world_size_{M}_rank_{r}.pt``
hold what rank r of an FSDP2 job at M saves (``model.state_dict()``, ``optimizer.state_dict()``:
``Shard(0)`` DTensors of r's rows, laid out as ``fsdp2-ranks`` lays them out); rank 0's
``fsdp_config.json`` says M. The files SRC carries unread are copied as they are:
``huggingface/`` and, renamed for M, each rank's ``extra_state`` (``extra_state``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shardckpt.errors import UsageError, notice
from shardckpt.formats.base import Frame
from shardckpt.formats.files import writing
from shardckpt.formats.parts import sub_plan
from shardckpt.formats.rank_file import Fills, dtensor_placeholders, frame_rank_file
from shardckpt.formats.verl.extra_state import extra_state_copies
from shardckpt.formats.verl.names import (
    CONFIG_FILE,
    MODEL,
    OPTIM,
    FsdpConfig,
    file_name,
    parse,
    write_config,
)
from shardckpt.optim import key_type
from shardckpt.target_ranks import TargetRanksWriter, job_mesh, merge_frames


class VerlWriter(TargetRanksWriter):
    """A veRL directory at M (FSDP2's layout): per-rank model and optimizer files, the rest copied."""

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        _check_tree(plan.tree)
        src = Path(plan.src)
        carried = [p.file for p in plan.parts if p.key is None]
        self.copied = [(src / n, n) for n in carried if n != CONFIG_FILE and parse(n) is None]
        self.extra, self.note = extra_state_copies(src, carried, plan.world_size)
        self.every_copy = (CONFIG_FILE,) + tuple(
            name for path, name in [*self.copied, *self.extra] if not path.is_dir()
        )

    def frame_rank(self, rank: int) -> Frame:
        mesh = job_mesh(self.plan.world_size, rank)
        frames = []
        for part in (MODEL, OPTIM):
            if part not in self.plan.tree:
                continue
            fills: Fills = {}
            sub = sub_plan(self.plan, self.plan.format, self.plan.tree[part])
            state = dtensor_placeholders(sub, rank, mesh, fills)
            path = self.root / file_name(part, self.plan.world_size, rank)
            frames.append(frame_rank_file(path, state, fills))
        return merge_frames(frames)

    def finish(self) -> None:
        with writing(self.root / CONFIG_FILE):
            write_config(self.root, FsdpConfig(2, self.plan.world_size))
        for src, name in [*self.copied, *self.extra]:
            with writing(self.root / name):
                if src.is_dir():
                    shutil.copytree(src, self.root / name)
                else:
                    shutil.copyfile(src, self.root / name)
        if self.note:
            notice(self.note)


def _check_tree(tree: dict) -> None:
    """Refuse what veRL's FSDP2 manager cannot load: other top-level keys, an FQN-keyed optimizer."""
    other = [k for k in tree if k not in (MODEL, OPTIM)]
    if other:
        raise UsageError(
            f"--format verl holds a model and an optimizer ('{MODEL}', '{OPTIM}'), and "
            f"top-level key {other[0]!r} is neither",
            hint="--filter it out, --nest/--unnest the tree, or write --format fsdp2-ranks",
        )
    if MODEL not in tree:
        raise UsageError(
            f"--format verl needs the model ('{MODEL}'): veRL's manager loads it first",
            hint="drop --only optim, or select the model with --filter",
        )
    if OPTIM in tree and key_type(tree[OPTIM]) not in ("id", "empty"):
        raise UsageError(
            "--format verl writes the optimizer as optimizer.state_dict() keys it, by param "
            f"ID, and this one is keyed by {key_type(tree[OPTIM])}",
            hint="add --optim-keys id (with --model when SRC lists parameters in another "
            "order than the model's, as FSDP1 does)",
        )
