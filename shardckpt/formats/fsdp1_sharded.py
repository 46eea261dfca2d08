"""``fsdp1-sharded``: one ``torch.save`` per rank of FSDP1's ``SHARDED_STATE_DICT``.

Each rank's file holds the model state (parameters as ``ShardedTensor``: dim-0 chunks
as ``torch.chunk`` makes them, buffers whole) and, when saved, ``FSDP.optim_state_dict``
under the same state-dict type (per-parameter state as ``ShardedTensor`` too, ``step``
and hyper-parameters whole). Every ``ShardedTensor`` carries the shard metadata of all
ranks, so rank 0's file gives the global shapes; rows are read from the memory-mapped
files of the ranks that hold them. Whole tensors and plain values are taken from rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardckpt.errors import BadInputError
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.formats.dcp import describe_chunks
from shardckpt.formats.rank_names import rank_files
from shardckpt.formats.sharded_tensor_load import StoredShardedTensor, load_rank_file
from shardckpt.tree import Chunk, TensorMeta, dotted, map_leaves, walk

# A dim-0 piece of a ShardedTensor: first row and the rows, held by one rank's file.
Piece = tuple[int, torch.Tensor]


class Fsdp1ShardedReader(Reader):
    """Reads a directory of per-rank ``SHARDED_STATE_DICT`` files (``ShardedTensor`` leaves)."""

    format = "fsdp1-sharded"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        by_stem = rank_files(self.src)
        self.world_size = len(next(iter(by_stem.values())))
        per_rank = [
            {stem: load_rank_file(files[r], trust_pickle) for stem, files in by_stem.items()}
            for r in range(self.world_size)
        ]
        trees = [objs[""] if list(objs) == [""] else objs for objs in per_rank]
        self.parts = list(by_stem)
        self.files = [[files[r] for files in by_stem.values()] for r in range(self.world_size)]
        self._whole: dict[str, torch.Tensor] = {}
        self._pieces: dict[str, list[Piece]] = {}
        self._tree = map_leaves(trees[0], self._describe)
        self._collect_pieces(trees)

    def _describe(self, path, leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        key = str(len(self._whole) + len(self._pieces))
        if not isinstance(leaf, StoredShardedTensor):
            self._whole[key] = leaf.detach()
            return TensorMeta(key, tuple(leaf.shape), leaf.dtype)
        shape = tuple(leaf.shape)
        chunks = []
        for md in leaf.shards_metadata:
            offsets = tuple(md.shard_offsets)
            if any(offsets[1:]) or tuple(md.shard_sizes[1:]) != shape[1:]:
                raise BadInputError(
                    f"'{dotted(path)}' is not split along dim 0",
                    path=self.src,
                    hint="fsdp1-sharded reads FSDP1's dim-0 ShardedTensors",
                )
            chunks.append(Chunk(md.placement.rank(), offsets, tuple(md.shard_sizes)))
        self._pieces[key] = []
        self._check_world_size(path, leaf)
        layout = describe_chunks(shape, chunks, self.world_size)
        return TensorMeta(key, shape, leaf.dtype, layout, tuple(chunks))

    def _check_world_size(self, path, leaf: StoredShardedTensor) -> None:
        if leaf.saved_world_size != self.world_size:
            raise BadInputError(
                f"'{dotted(path)}' was saved by a job of {leaf.saved_world_size} ranks, "
                f"but the directory holds files of {self.world_size} ranks",
                path=self.src,
                hint="keep only one checkpoint's rank files in the directory",
            )

    def _collect_pieces(self, trees: list[dict]) -> None:
        """Record, for every ShardedTensor, each rank's local shards as (first row, rows)."""
        metas = {p: m for p, m in walk(self._tree) if isinstance(m, TensorMeta)}
        for rank, tree in enumerate(trees):
            for path, leaf in walk(tree):
                meta = metas.get(path)
                if meta is None or meta.key not in self._pieces:
                    continue
                if not isinstance(leaf, StoredShardedTensor):
                    raise BadInputError(
                        f"'{dotted(path)}' is a ShardedTensor in rank 0's file but not in rank {rank}'s",
                        path=self.files[rank][0],
                        hint="keep only one checkpoint's rank files in the directory",
                    )
                self._check_world_size(path, leaf)
                for shard in leaf.local_shards:
                    self._pieces[meta.key].append(
                        (int(shard.metadata.shard_offsets[0]), shard.tensor)
                    )

    def index(self) -> Index:
        return Index(self.format, str(self.src), self.world_size, self._tree)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return [self._read_one(m, r) for m, r in zip(metas, rows)]

    def _read_one(self, meta: TensorMeta, rows: Rows) -> torch.Tensor:
        if meta.key in self._whole:
            t = self._whole[meta.key]
            return t if rows is None else t[rows[0] : rows[1]]
        start, stop = rows if rows is not None else (0, meta.shape[0])
        out = torch.empty((stop - start,) + meta.shape[1:], dtype=meta.dtype)
        covered = 0
        for first, piece in self._pieces[meta.key]:
            lo, hi = max(start, first), min(stop, first + piece.shape[0])
            if lo < hi:
                out[lo - start : hi - start] = piece[lo - first : hi - first]
                covered += hi - lo
        if covered != stop - start:
            raise BadInputError(
                f"rows {start}-{stop} of a tensor are not all in the rank files",
                path=self.src,
                hint="the rank files are inconsistent; re-copy them from where they were written",
            )
        return out
