"""``fsdp1-sharded``: one ``torch.save`` per rank of FSDP1's ``SHARDED_STATE_DICT``.

Each rank's file holds the model state (parameters as ``ShardedTensor``: dim-0 chunks
as ``torch.chunk`` makes them, buffers whole) and, when saved, ``FSDP.optim_state_dict``
under the same state-dict type (per-parameter state as ``ShardedTensor`` too, ``step``
and hyper-parameters whole). Every ``ShardedTensor`` carries the shard metadata of all
ranks and the saving job's world size, so rank 0's file gives the global shapes and the
files are checked to be one save of that job (``rank_set``); rows are read from the
memory-mapped files of the ranks that hold them. Whole tensors and plain values are
taken from rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from shardckpt.core.errors import BadInputError
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.formats.ranks.dim0_split import describe_chunks
from shardckpt.formats.ranks.rank_names import check_complete, present_rank_files
from shardckpt.formats.ranks.rank_set import OwnTensors, check_one_save, job_world_size, none_own
from shardckpt.formats.ranks.sharded_tensor_load import StoredShardedTensor, load_rank_file
from shardckpt.formats.torch_save.in_place import values
from shardckpt.state.tree import Chunk, TensorMeta, dotted, map_leaves, walk

# A dim-0 piece of a ShardedTensor: first row and the rows, held by one rank's file.
Piece = tuple[int, torch.Tensor]


class Fsdp1ShardedReader(Reader):
    """Reads a directory of per-rank ``SHARDED_STATE_DICT`` files (``ShardedTensor`` leaves)."""

    format = "fsdp1-sharded"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        found = self.present_files()
        loaded = {
            part: {r: load_rank_file(p, trust_pickle) for r, p in files.items()}
            for part, files in found.items()
        }
        self.world_size = self._check_world_size(found, loaded)
        for part, files in found.items():
            trees = [loaded[part][r] for r in files]
            check_one_save(list(files.values()), trees, self.own_tensors(trees[0]))
        per_rank = [{part: loaded[part][r] for part in found} for r in range(self.world_size)]
        trees = [objs[""] if list(objs) == [""] else objs for objs in per_rank]
        self.parts = list(found)
        self.files = [[files[r] for files in found.values()] for r in range(self.world_size)]
        self._whole: dict[str, torch.Tensor] = {}
        self._pieces: dict[str, list[Piece]] = {}
        self._tree = map_leaves(trees[0], self._describe)
        self._collect_pieces(trees)

    def members(self) -> frozenset[str]:
        return frozenset(p.name for files in self.files for p in files)

    def present_files(self) -> dict[str, dict[int, Path]]:
        """Return ``{part: {rank: file}}`` of the files read (a trainer's reader reads some parts only)."""
        return present_rank_files(self.src)

    def own_tensors(self, tree: dict) -> OwnTensors:
        """Return which plain tensors of a part's ``tree`` each rank holds its own of: none here."""
        return none_own

    def _check_world_size(self, found: dict[str, dict[int, Path]], loaded: dict) -> int:
        """Return the saving job's world size, which its ShardedTensors know; check the files against it."""
        sizes: dict[tuple[str, int], int] = {}
        for part, objs in loaded.items():
            for rank, tree in objs.items():
                saved = {
                    (leaf.saved_world_size, int(leaf.pg_state.global_rank))
                    for _, leaf in walk(tree)
                    if isinstance(leaf, StoredShardedTensor)
                }
                if not saved:
                    continue
                if len(saved) > 1:
                    raise BadInputError(
                        f"holds ShardedTensors saved as {_ranks_of(saved)}",
                        path=found[part][rank],
                        hint="re-save the file from one rank of one job",
                    )
                ((size, held),) = saved
                if held != rank:
                    raise BadInputError(
                        f"holds rank {held}'s shards, not rank {rank}'s",
                        path=found[part][rank],
                        hint="name each file after the rank that saved it",
                    )
                sizes[(part, rank)] = size
        world_size = job_world_size(self.src, found, sizes, "ShardedTensors")
        # Without a ShardedTensor, the names are all that tell the world size.
        return check_complete(self.src, found) if world_size is None else world_size

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
        layout = describe_chunks(shape, chunks, self.world_size)
        if layout == "full":
            # One rank holds all rows (one rank, or fewer rows than ranks), but it is
            # still a ShardedTensor, split as FSDP1 splits: never a buffer.
            layout = f"Shard(0) over {self.world_size}"
        return TensorMeta(key, shape, leaf.dtype, layout, tuple(chunks))

    def _collect_pieces(self, trees: list[dict]) -> None:
        """Record, for every ShardedTensor, each rank's local shards as (first row, rows)."""
        metas = {p: m for p, m in walk(self._tree) if isinstance(m, TensorMeta)}
        for tree in trees:
            for path, leaf in walk(tree):
                meta = metas.get(path)
                if meta is None or meta.key not in self._pieces:
                    continue
                for shard in leaf.local_shards:  # type: ignore[attr-defined]
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
            return values(t if rows is None else t[rows[0] : rows[1]])
        start, stop = rows if rows is not None else (0, meta.shape[0])
        out = torch.empty((stop - start,) + meta.shape[1:], dtype=meta.dtype)
        covered = 0
        for first, piece in self._pieces[meta.key]:
            lo, hi = max(start, first), min(stop, first + piece.shape[0])
            if lo < hi:
                out[lo - start : hi - start] = values(piece[lo - first : hi - first])
                covered += hi - lo
        if covered != stop - start:
            raise BadInputError(
                f"rows {start}-{stop} of a tensor are not all in the rank files",
                path=self.src,
                hint="the rank files are inconsistent; re-copy them from where they were written",
            )
        return out


def _ranks_of(saved: set[tuple[int, int]]) -> str:
    """Return ``rank 0 of 2 and rank 1 of 4`` for a file's (world size, rank) pairs."""
    return " and ".join(f"rank {r} of {n}" for n, r in sorted(saved))
