"""Writing a Megatron ``torch_dist`` checkpoint at M: DCP data, ``common.pt`` and ``metadata.json``.

The DCP part is ``DcpWriter``'s, at M target ranks (Megatron's loader reshards DCP at
any parallel layout, so what matters is the keys and global shapes, which stay
Megatron's flat keys); a ShardedObject carried as stored (``StoredPickle``) is stored
again as the same bytes. ``common.pt`` is a ``torch.save`` skeleton filled by the
coordinator, and ``metadata.json`` names the backends, so that
``dist_checkpointing.load`` takes the directory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from shardckpt.core.files import writing
from shardckpt.formats.base import Frame, SourcePart, Writer
from shardckpt.formats.dcp.writer import DcpWriter
from shardckpt.formats.ranks.target_ranks import merge_frames
from shardckpt.formats.torch_save.file import whole_file
from shardckpt.formats.trainers.megatron.config import (
    COMMON_FILE,
    CONFIG_FILE,
    TORCH_DIST,
    config_bytes,
    names_backend,
    read_config,
)
from shardckpt.formats.trainers.megatron.sharded_objects import is_sharded_object, stored_as_is
from shardckpt.formats.trainers.parts import sub_plan
from shardckpt.state.tree import TensorMeta, walk


def in_common(key: object, value: object) -> bool:
    """Return whether Megatron's save would put top-level entry ``key`` in ``common.pt``.

    ``dist_checkpointing.save`` stores ShardedTensors and ShardedObjects with DCP and
    everything else in ``common.pt``. A tree from elsewhere says neither: what holds
    tensors, and a ShardedObject's key, go to DCP; plain values to ``common.pt``.
    """
    if isinstance(key, str) and is_sharded_object(key):
        return False
    return not any(isinstance(leaf, TensorMeta) for _, leaf in walk(value, (key,)))


def split_common(tree: Mapping, parts: Sequence[SourcePart]) -> tuple[dict, dict]:
    """Return ``tree``'s top level split into the DCP part and the ``common.pt`` part.

    ``parts`` (a source's ``Index.parts``) says which keys a Megatron source read from
    its ``common.pt``; for any other source, ``in_common`` decides.
    """
    from_common = {p.key for p in parts if p.file == COMMON_FILE and p.key is not None}
    dcp_part, common = {}, {}
    for key, value in tree.items():
        kept = key in from_common if from_common else in_common(key, value)
        (common if kept else dcp_part)[key] = value
    return dcp_part, common


class _ShardedObjectsWriter(DcpWriter):
    """DCP's writer, storing a ShardedObject carried as stored as its own bytes."""

    def stored_bytes(self, key: str, value: object) -> bytes | None:
        return stored_as_is(key, value)


class MegatronWriter(Writer):
    """The DCP part at M target ranks, ``common.pt`` filled by the coordinator, ``metadata.json`` last.

    ``common.pt`` is always written (``{}`` at least): Megatron's loader reads it first.
    """

    every_copy = (".metadata", COMMON_FILE, CONFIG_FILE)

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        dcp_part, self._common = split_common(plan.tree, plan.parts)
        self._dcp = _ShardedObjectsWriter(root, sub_plan(plan, plan.format, dcp_part))

    def frame(self, runtime) -> Frame:
        self._dcp.placement = self.placement
        frame = self._dcp.frame(runtime)
        common = runtime.agreed(lambda: self._frame_common() if runtime.coordinator else None)
        return merge_frames([frame, common]) if common is not None else frame

    def _frame_common(self) -> Frame:
        """Write ``common.pt``'s ``torch.save`` skeleton; return the regions that fill its tensors."""
        return whole_file(self.root / COMMON_FILE, self._common, COMMON_FILE)

    def finish(self) -> None:
        self._dcp.finish()
        # SRC's own config where SRC is Megatron's (its versions kept), else torch_dist's.
        src = Path(self.plan.src)
        config = read_config(src) if src.is_dir() and names_backend(src) else TORCH_DIST
        path = self.root / CONFIG_FILE
        with writing(path), open(path, "wb") as f:
            f.write(config_bytes(config))
