"""``torch-checkpointing``: a checkpoint directory written by torch_checkpointing's ``CheckpointManager``.

What ``CheckpointManager.save(dir, {"model": msd, "optim": osd, "step": 2})`` writes (0.1.1):

- ``metadata.pkl``: the items saved with a resharder, each tensor's global shape,
  dtype and DTensor placements on the job's mesh, and each rank's file
  (``shardckpt.formats.trainers.torch_checkpointing.metadata``);
- one file per item and rank: ``<item>_<rank>.pt`` (``torch.save`` of that rank's part:
  DTensors, plain tensors and values) by default, or, for an item whose layout says
  ``SafetensorsSerialization``, a ``.safetensors`` file of the rank's local shards,
  named by their dotted path, whose global placement only the metadata tells.

Reading gives ``{item: tree}``. A tensor's chunks are the metadata's (checked against
what each rank's file holds: a file that does not match is an error naming it); a
torch item's values are rank 0's. Items without a resharder are not in the metadata:
their ``<item>_<rank>.pt`` files are found by name, and their value is rank 0's (one
that differs between ranks cannot be carried to another world size, and is refused
when selected). Any other file in the directory is named as unreadable, never skipped.
Rows are read from memory-mapped ``.pt`` files (a URL SRC's by ranges, loaded on the meta
device: ``torch_save.in_place``), and from ``.safetensors`` files by ``pread``
(``safetensors_file.read_rows``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import check_separate, has_file, source_file
from shardckpt.core.torch_internals import local_chunk, mesh_rank
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.formats.fsdp2.reader import quiet_mesh_unpickling
from shardckpt.formats.hf.safetensors_file import data_starts, opened, read_rows, tensor_meta
from shardckpt.formats.torch_save.in_place import load_object_in_place, values
from shardckpt.formats.trainers.torch_checkpointing.metadata import (
    METADATA_FILE,
    SAFETENSORS,
    TORCH,
    Item,
    Sharding,
    read_metadata,
)
from shardckpt.state.tree import Chunk, TensorMeta, dotted, map_leaves, subtree, walk
from shardckpt.state.values import values_equal

_ITEM_FILE = re.compile(r"^(?P<item>.+)_(?P<rank>\d+)\.pt$")


@dataclass(frozen=True)
class _Source:
    """Where one tensor's pieces are: its item, its path in the item, each rank's chunk."""

    item: str
    path: tuple
    chunks: tuple[Chunk, ...]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return values(t.detach()).reshape(-1).contiguous().view(torch.uint8)


def _equal(a: object, b: object) -> bool:
    """Return whether two loaded values are the same, tensors compared bit for bit (NaN too)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and not isinstance(a, DTensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(_bytes(a), _bytes(b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    # NaN equals NaN, and numpy values (an RNG state) compare without raising.
    return values_equal(a, b)


def _label(sharding: Sharding) -> str:
    if sharding.replicated:
        return "full"
    return f"{'×'.join(sharding.placements)} over {'×'.join(map(str, sharding.mesh_shape))}"


class TorchCheckpointingReader(Reader):
    """Reads a torch_checkpointing directory: metadata for the index, rows from each rank's file."""

    format = "torch-checkpointing"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        self.metadata = read_metadata(self.src)
        self.world_size = self.metadata.world_size
        self.items: dict[str, Item | None] = dict(self.metadata.items)
        self._files: dict[str, dict[int, str]] = {
            key: dict(item.files) for key, item in self.metadata.items.items()
        }
        self._find_other_items()
        check_separate(
            {(key, r): self._path(key, r) for key, files in self._files.items() for r in files},
            lambda k: f"rank {k[1]}'s file of item '{k[0]}'",
        )
        self._objects: dict[str, dict[int, object]] = {}
        self._headers: dict[
            tuple[str, int], tuple[Path, dict[str, int], dict[str, TensorMeta]]
        ] = {}
        """Each safetensors file's path, where its tensors' data starts and their metas, by (item, rank)."""
        self._sources: dict[str, _Source] = {}
        self.differing: set[str] = set()
        """Items outside the metadata, holding no DTensor, whose value differs between ranks
        (per-rank state: refused when selected)."""
        self._tree = {key: self._describe(key) for key in sorted(self._files)}

    # ------------------------------------------------------------ files

    def _find_other_items(self) -> None:
        """Find the ``<item>_<rank>.pt`` files of items saved without a resharder; name strays."""
        claimed = {file for files in self._files.values() for file in files.values()}
        found: dict[str, dict[int, str]] = {}
        for entry in sorted(p.name for p in self.src.iterdir()):
            if entry == METADATA_FILE or entry in claimed:
                continue
            match = _ITEM_FILE.match(entry)
            if (
                match is None
                or match["item"] in self._files
                or int(match["rank"]) >= self.world_size
            ):
                raise BadInputError(
                    f"holds '{entry}', which is no part of this torch_checkpointing checkpoint "
                    f"that shardckpt can read (not listed in {METADATA_FILE}, not <item>_<rank>.pt "
                    f"of a rank below {self.world_size})",
                    path=self.src,
                    hint="move it out of the checkpoint directory, or convert a copy without it",
                )
            found.setdefault(match["item"], {})[int(match["rank"])] = entry
        for key, files in found.items():
            missing = sorted(set(range(self.world_size)) - set(files))
            if missing:
                raise BadInputError(
                    f"has no '{key}_{missing[0]}.pt': item '{key}' was saved by every rank of "
                    f"{self.world_size}",
                    path=self.src,
                    hint="copy every file of the checkpoint",
                )
            self._files[key] = files
            self.items[key] = None

    def members(self) -> frozenset[str]:
        return frozenset(
            {METADATA_FILE} | {f for files in self._files.values() for f in files.values()}
        )

    def _path(self, key: str, rank: int) -> Path:
        path = self.src / self._files[key][rank]
        if not has_file(path, self.src):
            raise BadInputError(
                f"missing '{path.name}', rank {rank}'s file of item '{key}' named by {METADATA_FILE}",
                path=self.src,
                hint="copy every file of the checkpoint",
            )
        return path

    def _object(self, key: str, rank: int) -> object:
        """Return rank ``rank``'s ``torch.save`` object of item ``key`` (loaded once).

        Memory-mapped; a URL SRC's file on the meta device, its rows read by ranges
        (``torch_save.in_place.values``).
        """
        objs = self._objects.setdefault(key, {})
        if rank not in objs:
            with quiet_mesh_unpickling():
                objs[rank] = load_object_in_place(self._path(key, rank), self.trust_pickle)
        return objs[rank]

    # ------------------------------------------------------------ index

    def _describe(self, key: str) -> object:
        item = self.items[key]
        if item is not None and item.serialization == SAFETENSORS:
            return self._describe_safetensors(key, item)
        return self._describe_torch(key, item)

    def _header(self, key: str, rank: int) -> tuple[Path, dict[str, int], dict[str, TensorMeta]]:
        """Return rank ``rank``'s safetensors file of item ``key``, where its tensors start, and their metas (read once)."""
        if (key, rank) not in self._headers:
            path = source_file(self._path(key, rank))
            with opened(path, "the file is truncated or damaged; re-copy it") as f:
                metas = {k: tensor_meta(path, k, f.get_slice(k)) for k in f.keys()}
            self._headers[(key, rank)] = (path, data_starts(path), metas)
        return self._headers[(key, rank)]

    def _new_source(
        self, key: str, path: tuple, sharding_chunks, shape, dtype, label
    ) -> TensorMeta:
        name = str(len(self._sources))
        chunks = tuple(Chunk(r, offsets, sizes) for r, (sizes, offsets) in sharding_chunks)
        self._sources[name] = _Source(key, path, chunks)
        return TensorMeta(name, tuple(shape), dtype, label, chunks)

    def _describe_safetensors(self, key: str, item: Item) -> dict:
        tree: dict = {}
        for rank in range(self.world_size):
            path, _, metas = self._header(key, rank)
            held = dict(metas)
            for tpath, sharding in item.tensors.items():
                name, sizes = dotted(tpath), sharding.chunks[rank][0]
                meta = held.pop(name, None)
                if meta is None or meta.shape != sizes or meta.dtype != sharding.dtype:
                    got = "nothing" if meta is None else f"{meta.dtype} {list(meta.shape)}"
                    raise BadInputError(
                        f"'{name}' should be rank {rank}'s {sharding.dtype} shard of shape "
                        f"{list(sizes)} by {METADATA_FILE}, but is {got}",
                        path=path,
                        hint="the files and the metadata are not one save; re-copy the checkpoint",
                    )
            if held:
                raise BadInputError(
                    f"holds '{next(iter(held))}', which {METADATA_FILE} does not list",
                    path=path,
                    hint="the files and the metadata are not one save; re-copy the checkpoint",
                )
        for tpath, sharding in item.tensors.items():
            node = tree
            for k in tpath[:-1]:
                node = node.setdefault(k, {})
            node[tpath[-1]] = self._new_source(
                key, tpath, self._chunks(sharding), sharding.shape, sharding.dtype, _label(sharding)
            )
        return tree

    def _chunks(self, sharding: Sharding):
        # A replicated tensor is read from rank 0 alone.
        ranks = [0] if sharding.replicated else range(self.world_size)
        return [(r, sharding.chunks[r]) for r in ranks]

    def _describe_torch(self, key: str, item: Item | None) -> object:
        first = self._object(key, 0)
        listed = item.tensors if item is not None else {}

        def leaf(path: tuple, value: object) -> object:
            if not isinstance(value, torch.Tensor):
                return value
            sharding = listed.get(path)
            if sharding is None and item is not None:
                raise BadInputError(
                    f"holds tensor '{dotted(path)}', which {METADATA_FILE} does not list",
                    path=self._path(key, 0),
                    hint="the files and the metadata are not one save; re-copy the checkpoint",
                )
            if sharding is None:
                return self._unlisted(key, path, value)
            for rank in range(self.world_size):
                self._check_local(key, rank, path, sharding)
            return self._new_source(
                key, path, self._chunks(sharding), sharding.shape, sharding.dtype, _label(sharding)
            )

        tree = map_leaves(first, leaf) if isinstance(first, dict) else leaf((), first)
        if item is not None:
            seen = {
                p
                for p, v in walk(first if isinstance(first, dict) else {})
                if isinstance(v, torch.Tensor)
            }
            missing = sorted(set(listed) - seen, key=str)
            if missing:
                raise BadInputError(
                    f"has no tensor '{dotted(missing[0])}', which {METADATA_FILE} lists",
                    path=self._path(key, 0),
                    hint="the files and the metadata are not one save; re-copy the checkpoint",
                )
        elif not any(isinstance(v, DTensor) for _, v in walk({"": first})) and not all(
            _equal(first, self._object(key, r)) for r in range(1, self.world_size)
        ):
            # A DTensor's shards differ by nature; anything else must be one value.
            self.differing.add(key)
        return tree

    def _at(self, key: str, rank: int, path: tuple) -> object:
        obj = self._object(key, rank)
        try:
            return subtree(obj, path) if path else obj
        except (KeyError, IndexError, TypeError):
            return None

    def _check_local(self, key: str, rank: int, path: tuple, sharding: Sharding) -> None:
        """Refuse a rank's file whose tensor at ``path`` is not the shard the metadata says.

        A DTensor tells which rank saved it and where its shard lies; both must be what
        the metadata gives this rank, or another rank's rows would be read as its own.
        """
        t = self._at(key, rank, path)
        local = t.to_local() if isinstance(t, DTensor) else t
        sizes, offsets = sharding.chunks[rank]
        if isinstance(t, DTensor):
            self._check_saved_by(key, rank, path, t)
            _, held_offsets = local_chunk(t)
            if held_offsets != offsets and 0 not in sizes:
                raise BadInputError(
                    f"'{dotted(path)}' is the shard at {list(held_offsets)}, but "
                    f"{METADATA_FILE} gives rank {rank} the one at {list(offsets)}",
                    path=self._path(key, rank),
                    hint="the files and the metadata are not one save; re-copy the checkpoint",
                )
        if (
            not isinstance(local, torch.Tensor)
            or tuple(local.shape) != sizes
            or local.dtype != sharding.dtype
        ):
            got = (
                "nothing"
                if not isinstance(local, torch.Tensor)
                else f"{local.dtype} {list(local.shape)}"
            )
            raise BadInputError(
                f"'{dotted(path)}' should be rank {rank}'s {sharding.dtype} shard of shape "
                f"{list(sizes)} by {METADATA_FILE}, but is {got}",
                path=self._path(key, rank),
                hint="the files and the metadata are not one save; re-copy the checkpoint",
            )

    def _check_saved_by(self, key: str, rank: int, path: tuple, t: DTensor) -> None:
        """Refuse a DTensor in rank ``rank``'s file that another rank saved (its mesh says so)."""
        held = mesh_rank(t.device_mesh)
        if held is not None and held != rank:
            raise BadInputError(
                f"holds rank {held}'s shard of '{dotted(path)}', but it is rank {rank}'s file",
                path=self._path(key, rank),
                hint="the files are not one save; re-copy the checkpoint",
            )

    def _unlisted(self, key: str, path: tuple, value: torch.Tensor) -> TensorMeta:
        """Describe a tensor of an item the metadata does not list: DTensor chunks, else rank 0's."""
        if not isinstance(value, DTensor):
            shape = tuple(value.shape)
            return self._new_source(
                key, path, [(0, (shape, (0,) * len(shape)))], shape, value.dtype, "full"
            )
        chunks = []
        for rank in range(self.world_size):
            t = self._at(key, rank, path)
            if not isinstance(t, DTensor) or t.shape != value.shape or t.dtype != value.dtype:
                raise BadInputError(
                    f"'{dotted(path)}' is not the {value.dtype} DTensor of shape "
                    f"{list(value.shape)} rank 0 has",
                    path=self._path(key, rank),
                    hint="every rank's file must come from the same save",
                )
            self._check_saved_by(key, rank, path, t)
            chunks.append((rank, local_chunk(t)))
        placements = "×".join(type(p).__name__ for p in value.placements)
        return self._new_source(
            key,
            path,
            chunks,
            tuple(value.shape),
            value.dtype,
            f"{placements} over {self.world_size}",
        )

    def index(self) -> Index:
        serializations = {
            key: (item.serialization if item is not None else TORCH)
            for key, item in self.items.items()
        }
        return Index(
            self.format, str(self.src), self.world_size, self._tree, serializations=serializations
        )

    def notes(self) -> list[str]:
        return [
            f"item '{key}' differs between ranks (per-rank state): rank 0's is shown, and "
            "convert refuses it unless --filter leaves it out"
            for key in sorted(self.differing)
        ]

    def check_selected(self, tree: dict) -> None:
        for key in sorted(self.differing & set(tree)):
            raise BadInputError(
                f"item '{key}' differs between ranks ('{self._files[key][0]}' vs the others): "
                "per-rank state cannot be carried to another world size",
                path=self.src,
                hint="leave it out: select the other items with --filter 'ITEM.*' (repeatable)",
            )

    # ------------------------------------------------------------ rows

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return [self._read_one(m, r) for m, r in zip(metas, rows)]

    def _local_rows(self, source: _Source, rank: int, lo: int, hi: int) -> torch.Tensor:
        """Return rows [lo, hi) of rank ``rank``'s local shard of a tensor (all of a 0-d one)."""
        item = self.items[source.item]
        if item is not None and item.serialization == SAFETENSORS:
            # By pread, never a mapping: a URL SRC's stand-in maps as zeros.
            path, starts, metas = self._header(source.item, rank)
            meta = metas[dotted(source.path)]
            return read_rows(path, starts, [meta], [(lo, hi) if meta.shape else None], None)[0]
        t = self._at(source.item, rank, source.path)
        local = t.to_local() if isinstance(t, DTensor) else t.detach()
        return values(local if local.dim() == 0 else local[lo:hi])

    def _read_one(self, meta: TensorMeta, rows: Rows) -> torch.Tensor:
        source = self._sources[meta.key]
        if not meta.shape:
            return self._local_rows(source, source.chunks[0].rank, 0, 0)
        start, stop = rows if rows is not None else (0, meta.shape[0])
        out = torch.empty((stop - start, *meta.shape[1:]), dtype=meta.dtype)
        seen: set[tuple] = set()
        for c in source.chunks:
            if (c.offsets, c.sizes) in seen or 0 in c.sizes:
                continue
            seen.add((c.offsets, c.sizes))
            lo, hi = max(start, c.offsets[0]), min(stop, c.offsets[0] + c.sizes[0])
            if lo >= hi:
                continue
            dst = (slice(lo - start, hi - start),) + tuple(
                slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:])
            )
            out[dst] = self._local_rows(source, c.rank, lo - c.offsets[0], hi - c.offsets[0])
        return out


__all__ = ["TorchCheckpointingReader"]
