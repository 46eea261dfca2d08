"""``fsdp2-ranks``: a directory of per-rank ``torch.save`` files holding FSDP2/DTensor state dicts.

Each file is what one rank of an FSDP2 job writes with
``torch.save({"model": model.state_dict(), "optim": osd}, f"{dir}/rank_{r}.pt")``: its
parameters and optimizer state as DTensors (this rank's local shard, the global shape,
the placements and the job's device mesh), buffers and 0-dim ``step`` tensors as plain
tensors, plain values as they are. Files are named by rank (``shardckpt.formats.ranks.rank_names``).

Reading unpickles every file's pickle with ``weights_only=True`` (DTensor, DeviceMesh and
the placements are on torch's own allow-list; ``_StridedShard`` is on ours where torch's
lacks it, before 2.12: ``torch_internals.missing_safe_globals``) and memory-maps the
tensor data, so the index costs no tensor reads but the plain tensors compared to check
that the files are one save of one job (``rank_set``), and a rank touches only the bytes
of the rows it reads.
Writing is ``shardckpt.formats.fsdp2.writer``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardckpt.core.errors import BadInputError
from shardckpt.core.torch_internals import local_chunk, mesh_rank, mesh_world_size, strided_shard
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.formats.ranks.rank_names import present_rank_files
from shardckpt.formats.ranks.rank_set import check_one_save, job_world_size
from shardckpt.formats.torch_save.in_place import load_in_place, values
from shardckpt.state.tree import Chunk, TensorMeta, map_leaves, subtree, walk


@contextlib.contextmanager
def quiet_mesh_unpickling() -> Iterator[None]:
    """Silence DeviceMesh's warning that a pickled mesh's process groups do not exist here.

    The conversion never runs a collective on a source's mesh, so the missing groups
    are expected, not a problem worth a log line per tensor.
    """
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def describe_placements(placements: Sequence, mesh_shape: Sequence[int]) -> str:
    """Return a layout label such as ``Shard(0) over 4`` or ``Replicate×Shard(0) over 2×2``."""
    names = "×".join(_placement_name(p) for p in placements)
    return f"{names} over {'×'.join(str(s) for s in mesh_shape)}"


def _placement_name(p) -> str:
    strided = strided_shard()
    if strided is not None and isinstance(p, strided):
        return f"_StridedShard({p.dim}, sf={p.split_factor})"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate"
    return type(p).__name__


@dataclass(frozen=True)
class _Source:
    """Where one tensor's pieces are: its path in each file and which file holds which chunk."""

    part: str
    path: tuple
    chunks: tuple[Chunk, ...]
    """One per file for a DTensor; just rank 0's whole tensor for a plain one."""


class Fsdp2RanksReader(Reader):
    """Reads a directory of FSDP2 per-rank files: DTensor metadata for the index, rows from the shards."""

    format = "fsdp2-ranks"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        self.parts = self.present_files()
        with quiet_mesh_unpickling():
            self.objects = {
                part: {r: load_in_place(p, self.trust_pickle) for r, p in files.items()}
                for part, files in self.parts.items()
            }
        self.world_size = self._check_world_size()
        for part, files in self.parts.items():
            objs = self.objects[part]
            check_one_save(list(files.values()), [objs[r] for r in files])
        self._sources: dict[str, _Source] = {}
        self._tree = self._describe()

    def members(self) -> frozenset[str]:
        return frozenset(p.name for files in self.parts.values() for p in files.values())

    def present_files(self) -> dict[str, dict[int, Path]]:
        """Return ``{part: {rank: file}}`` of the files read (a trainer's reader reads some parts only)."""
        return present_rank_files(self.src)

    def _check_world_size(self) -> int:
        """Return the job's world size; every file must be one rank of it, and none may be missing."""
        sizes: dict[tuple[str, int], int] = {}
        for part, objs in self.objects.items():
            for rank, obj in sorted(objs.items()):
                dtensors = [leaf for _, leaf in walk(obj) if isinstance(leaf, DTensor)]
                if not dtensors:
                    continue
                mesh = dtensors[0].device_mesh
                # A pickled mesh has no process group to ask (``mesh.mesh`` and
                # ``get_rank()`` of a slice, FSDP+TP's ``mesh["dp"]``, would): its saved
                # state tells the job's size and the saving rank.
                sizes[(part, rank)] = mesh_world_size(mesh)
                held = mesh_rank(mesh)
                if held is not None and held != rank:
                    raise BadInputError(
                        f"holds rank {held}'s shards, not rank {rank}'s",
                        path=self.parts[part][rank],
                        hint="name each file after the rank that saved it",
                    )
        world_size = job_world_size(self.src, self.parts, sizes, "DTensors")
        if world_size is None:
            first = self.parts[min(self.parts)][min(self.parts[min(self.parts)])]
            raise BadInputError(
                "holds no DTensor, so it is not an FSDP2 per-rank file",
                path=first,
                hint="pass a directory of FSDP2 per-rank files, or a full checkpoint file itself",
            )
        for part in self.objects:
            has = {r for (p, r) in sizes if p == part}
            if has and len(has) != world_size:
                rank = min(set(range(world_size)) - has)
                raise BadInputError(
                    "holds no DTensor, so it is not an FSDP2 per-rank file",
                    path=self.parts[part][rank],
                    hint="pass a directory of FSDP2 per-rank files, or a full checkpoint file itself",
                )
        return world_size

    def _describe(self) -> dict:
        """Return the tree of rank 0's files with ``TensorMeta`` leaves, recording each tensor's chunks."""
        # map_leaves keeps the files' containers as they are (int keys of an ID-keyed optimizer).
        trees = {
            part: map_leaves(objs[0], lambda path, leaf, part=part: self._leaf(part, path, leaf))
            for part, objs in self.objects.items()
        }
        return trees if len(trees) > 1 else next(iter(trees.values()))

    def _leaf(self, part: str, path: tuple, leaf: object) -> object:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        key = str(len(self._sources))
        shape = tuple(leaf.shape)
        if not isinstance(leaf, DTensor):
            self._sources[key] = _Source(part, path, (Chunk(0, (0,) * len(shape), shape),))
            return TensorMeta(key, shape, leaf.dtype, "full", self._sources[key].chunks)
        chunks = tuple(self._chunk(part, rank, path, leaf) for rank in range(self.world_size))
        self._sources[key] = _Source(part, path, chunks)
        layout = describe_placements(leaf.placements, tuple(leaf.device_mesh.shape))
        return TensorMeta(key, shape, leaf.dtype, layout, chunks)

    def _chunk(self, part: str, rank: int, path: tuple, first: DTensor) -> Chunk:
        """Return the chunk rank ``rank``'s file holds of the DTensor at ``path``."""
        file = self.parts[part][rank]
        where = ".".join(map(str, path))
        try:
            t = subtree(self.objects[part][rank], path)
        except (KeyError, IndexError, TypeError):
            t = None
        if not isinstance(t, DTensor) or t.shape != first.shape or t.dtype != first.dtype:
            raise BadInputError(
                f"'{where}' is not the {first.dtype} DTensor of shape {list(first.shape)} rank 0 has",
                path=file,
                hint="every rank's file must come from the same save of the same job",
            )
        if any(isinstance(p, Partial) for p in t.placements):
            raise BadInputError(
                f"'{where}' is a Partial DTensor (a sum still to be reduced across ranks)",
                path=file,
                hint="save it after redistributing to Shard or Replicate placements",
            )
        sizes, offsets = local_chunk(t)
        return Chunk(rank, offsets, sizes)

    def index(self) -> Index:
        return Index(self.format, str(self.src), self.world_size, self._tree)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return [self._read_one(m, r) for m, r in zip(metas, rows)]

    def _local(self, source: _Source, rank: int) -> torch.Tensor:
        t = subtree(self.objects[source.part][rank], source.path)
        return t.to_local() if isinstance(t, DTensor) else t.detach()

    def _rows(self, source: _Source, c: Chunk, lo: int, hi: int) -> torch.Tensor:
        """Return rows [lo, hi) of the tensor from chunk ``c``'s file, their bytes checked as read."""
        return values(self._local(source, c.rank)[lo - c.offsets[0] : hi - c.offsets[0]])

    def _read_one(self, meta: TensorMeta, rows: Rows) -> torch.Tensor:
        """Return rows ``[start, stop)`` (or all) of a tensor, from the files whose chunks hold them."""
        source = self._sources[meta.key]
        if not meta.shape:
            return values(self._local(source, source.chunks[0].rank))
        start, stop = rows if rows is not None else (0, meta.shape[0])
        wanted = (stop - start,) + meta.shape[1:]
        # Replicas hold the same chunk: read each distinct chunk once, from its lowest rank.
        seen: set[tuple] = set()
        pieces = []
        for c in source.chunks:
            if (c.offsets, c.sizes) in seen or 0 in c.sizes:
                continue
            seen.add((c.offsets, c.sizes))
            lo, hi = max(start, c.offsets[0]), min(stop, c.offsets[0] + c.sizes[0])
            if lo < hi:
                pieces.append((c, lo, hi))
        if len(pieces) == 1 and pieces[0][0].sizes[1:] == meta.shape[1:]:
            c, lo, hi = pieces[0]
            if (lo, hi) == (start, stop):
                # One chunk covers the rows: a view of the memory map, nothing copied.
                return self._rows(source, c, lo, hi)
        out = torch.empty(wanted, dtype=meta.dtype)
        for c, lo, hi in pieces:
            dst = (slice(lo - start, hi - start),) + tuple(
                slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:])
            )
            out[dst] = self._rows(source, c, lo, hi)
        return out


__all__ = ["Fsdp2RanksReader", "describe_placements", "quiet_mesh_unpickling"]
