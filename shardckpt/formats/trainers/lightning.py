"""``lightning``: a Lightning sharded checkpoint, a DCP directory plus Lightning's ``meta.pt``.

Fabric's ``FSDPStrategy(state_dict_type="sharded")`` and ``ModelParallelStrategy``, and
the Trainer's FSDP and ModelParallel strategies, ``dcp.save`` the state of modules and
optimizers, and rank 0 ``torch.save``s everything else (a step counter, the Trainer's
loops and callbacks) to ``meta.pt`` beside it. Lightning's own consolidation
(``_load_distributed_checkpoint``) loads the DCP tree and updates its top level with
``meta.pt``'s dict; this format's tree is that same merge. ``meta.pt`` is read as any
``torch.save`` file is (``torch_file``: ``weights_only`` unless ``--trust-pickle``).

Written at M target ranks: the DCP part by ``dcp_write`` and ``meta.pt`` as a
``torch.save`` skeleton that the coordinator fills, which is what Fabric's ``load``
at M reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import torch

from shardckpt.core.errors import SRC_FORMAT, BadInputError
from shardckpt.core.files import has_file
from shardckpt.formats.base import (
    Frame,
    Index,
    Reader,
    Rows,
    SourcePart,
    StoredItem,
    Writer,
    read_routed,
    rekeyed,
)
from shardckpt.formats.dcp.reader import DcpReader
from shardckpt.formats.dcp.writer import DcpWriter
from shardckpt.formats.ranks.target_ranks import merge_frames
from shardckpt.formats.torch_save.file import (
    TorchReader,
    whole_file,
)
from shardckpt.formats.trainers.lightning_meta import META_FILE
from shardckpt.state.tree import TensorMeta, is_optimizer, tensor_leaves, walk

"""Lightning's ``_METADATA_FILENAME``: what is neither a module's nor an optimizer's state."""

# meta.pt's tensors are known to the reader by this prefix, apart from DCP's flat keys.
_META_KEY = META_FILE + ":"


class LightningReader(Reader):
    """Reads the DCP part through ``DcpReader`` and ``meta.pt`` through ``TorchReader``, as one tree."""

    format = "lightning"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        self._dcp = DcpReader(self.src, trust_pickle)
        meta = self.src / META_FILE
        if not has_file(meta, self.src):
            raise BadInputError(
                f"no '{META_FILE}' in this directory",
                path=self.src,
                hint=f"a Lightning checkpoint has one beside the DCP files; read the DCP part "
                f"alone with {SRC_FORMAT} dcp",
            )
        self._meta = TorchReader(meta, trust_pickle)

    def index(self) -> Index:
        index = self._dcp.index()
        tree = dict(index.tree)

        meta: dict = rekeyed(self._meta.index().tree, _META_KEY)  # type: ignore[assignment]
        both = [key for key in meta if key in tree]
        if both:
            raise BadInputError(
                f"'{both[0]}' is both in {META_FILE} and in the DCP data, and Lightning's "
                f"consolidation would keep only {META_FILE}'s",
                path=self.src,
                hint=f"read the DCP part alone with {SRC_FORMAT} dcp",
            )
        # Lightning merges with dict.update: the DCP keys first, then meta.pt's.
        tree.update(meta)
        parts = tuple(SourcePart(META_FILE, "torch", key) for key in meta)
        return Index(self.format, str(self.src), index.world_size, tree, parts=parts)

    def members(self) -> frozenset[str]:
        return self._dcp.members() | {META_FILE}

    def stored_items(self) -> dict[str, list[StoredItem]]:
        return self._dcp.stored_items()

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        def route(key: str) -> tuple[Reader, str]:
            if key.startswith(_META_KEY):
                return self._meta, key[len(_META_KEY) :]
            return self._dcp, key

        return read_routed(route, metas, rows, runtime)


def in_meta(key: object, value: object) -> bool:
    """Return whether Lightning keeps top-level entry ``key`` in ``meta.pt`` rather than in DCP.

    Lightning stores the state of each module and optimizer with DCP and everything else
    in ``meta.pt``. A tree from elsewhere says neither, so: an optimizer state dict, and a
    mapping of nothing but tensors (a module's state dict), are DCP's; the rest is meta.
    """
    if is_optimizer(value):
        return False
    if isinstance(value, Mapping) and value:
        return not all(isinstance(leaf, TensorMeta) for _, leaf in walk(value, (key,)))
    return True


def split_parts(tree: dict, parts: Sequence[SourcePart]) -> tuple[dict, dict]:
    """Return ``tree``'s top level split into the DCP part and the ``meta.pt`` part.

    ``parts`` (a source's ``Index.parts``) says which keys a Lightning source read
    from its ``meta.pt``; for any other source, ``in_meta`` decides.
    """
    from_meta = {p.key for p in parts if p.file == META_FILE and p.key is not None}
    dcp_part, meta_part = {}, {}
    for key, value in tree.items():
        meta = key in from_meta if from_meta else in_meta(key, value)
        (meta_part if meta else dcp_part)[key] = value
    return dcp_part, meta_part


def _part_plan(plan, tree: dict):
    """Return ``plan`` narrowed to ``tree``, one part of its tree."""
    tensors = tuple(tensor_leaves(tree))
    return dataclasses.replace(
        plan, tree=tree, tensors=tensors, metas=MappingProxyType({m.key: m for _, m in tensors})
    )


class LightningWriter(Writer):
    """The DCP part at M target ranks (``DcpWriter``), and ``meta.pt`` filled by the coordinator.

    ``meta.pt`` is always written, ``{}`` at least: Lightning tells a sharded checkpoint
    by it. Its tensors (rarely any) are all filled by the coordinator, so that where
    ranks write to their own disks it is whole on the coordinator's and copied to the
    others, as DCP's ``.metadata`` is.
    """

    every_copy = (".metadata", META_FILE)

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        dcp_part, self._meta = split_parts(plan.tree, plan.parts)
        self._dcp = DcpWriter(root, _part_plan(plan, dcp_part))

    def frame(self, runtime) -> Frame:
        self._dcp.placement = self.placement
        frame = self._dcp.frame(runtime)
        meta = runtime.agreed(lambda: self._frame_meta() if runtime.coordinator else None)
        return merge_frames([frame, meta]) if meta is not None else frame

    def _frame_meta(self) -> Frame:
        """Write ``meta.pt``'s ``torch.save`` skeleton; return the regions that fill its tensors."""
        return whole_file(self.root / META_FILE, self._meta, META_FILE)

    def finish(self) -> None:
        self._dcp.finish()


__all__ = ["META_FILE", "LightningReader", "LightningWriter", "in_meta", "split_parts"]
