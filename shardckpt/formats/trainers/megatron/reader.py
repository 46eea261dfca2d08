"""Reading a Megatron ``torch_dist`` checkpoint as one tree: the DCP data and ``common.pt``.

megatron-core's ``dist_checkpointing.save`` splits a state dict in two: its
``ShardedTensor``s and ``ShardedObject``s go to DCP (``.metadata``, ``__R_T.distcp``,
keyed by each one's flat Megatron key), and everything else (``iteration``, ``args``,
the scheduler's state) to ``common.pt``, which rank 0 ``torch.save``s;
``metadata.json`` names the backends. The tree read here is the DCP keys, then
``common.pt``'s (its top-level keys beside them, as Megatron's load merges them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from shardckpt.core.errors import SRC_FORMAT, BadInputError
from shardckpt.core.files import has_file
from shardckpt.formats.base import (
    Index,
    Reader,
    Rows,
    SourcePart,
    StoredItem,
    read_routed,
    rekeyed,
)
from shardckpt.formats.dcp.reader import DcpReader, read_metadata
from shardckpt.formats.torch_save.file import TorchReader
from shardckpt.formats.trainers.megatron.config import COMMON_FILE, read_config
from shardckpt.formats.trainers.megatron.layouts import describe
from shardckpt.formats.trainers.megatron.sharded_objects import carried_note, kept_value
from shardckpt.formats.trainers.megatron.vocabulary import save_plan_vocabulary
from shardckpt.state.tree import TensorMeta, map_leaves

# common.pt's tensors (rarely any) are known to the reader by this prefix, apart from DCP's keys.
_COMMON_KEY = COMMON_FILE + ":"


class MegatronDcpReader(DcpReader):
    """The DCP part: save plans admitted in ``.metadata``, ShardedObjects kept, chunks said as Megatron's."""

    format = "megatron"

    def load_metadata(self):
        return read_metadata(self.src, self.trust_pickle, save_plan_vocabulary())

    def stored_value(self, key: str, stored: bytes, loaded: object) -> object:
        return kept_value(key, stored, loaded)

    def index(self) -> Index:
        index = super().index()

        def relabel(_path, leaf):
            if not isinstance(leaf, TensorMeta):
                return leaf
            layout = describe(leaf.key, leaf.shape, leaf.chunks)
            return dataclasses.replace(leaf, layout=layout) if layout else leaf

        return dataclasses.replace(index, tree=map_leaves(index.tree, relabel))


class MegatronReader(Reader):
    """Reads a Megatron ``torch_dist`` directory: DCP through ``MegatronDcpReader``, ``common.pt`` beside it."""

    format = "megatron"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        self.config = read_config(self.src)
        self._dcp = MegatronDcpReader(self.src, trust_pickle)
        common = self.src / COMMON_FILE
        if not has_file(common, self.src):
            raise BadInputError(
                f"no '{COMMON_FILE}' in this directory",
                path=self.src,
                hint="a Megatron checkpoint has one beside the DCP files (rank 0 writes it); "
                f"re-copy it, or read the DCP part alone with {SRC_FORMAT} dcp",
            )
        self._common = TorchReader(common, trust_pickle)
        self._notes: list[str] = []

    def index(self) -> Index:
        index = self._dcp.index()
        tree = dict(index.tree)

        common: dict = rekeyed(self._common.index().tree, _COMMON_KEY)  # type: ignore[assignment]
        both = [key for key in common if key in tree]
        if both:
            raise BadInputError(
                f"'{both[0]}' is both in {COMMON_FILE} and in the DCP data, and Megatron's "
                "load would keep only one of them",
                path=self.src,
                hint=f"read the DCP part alone with {SRC_FORMAT} dcp",
            )
        tree.update(common)
        parts = tuple(SourcePart(COMMON_FILE, "torch", key) for key in common)
        self._notes = [n for n in [carried_note(index.tree)] if n]
        return Index(self.format, str(self.src), index.world_size, tree, parts=parts)

    def notes(self) -> list[str]:
        return self._notes

    def stored_items(self) -> dict[str, list[StoredItem]]:
        return self._dcp.stored_items()

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        def route(key: str) -> tuple[Reader, str]:
            if key.startswith(_COMMON_KEY):
                return self._common, key[len(_COMMON_KEY) :]
            return self._dcp, key

        return read_routed(route, metas, rows, runtime)
