"""One save of one job: the check every per-rank file of a directory passes before it is read.

The readers of the local formats (``fsdp2-ranks``, ``fsdp1-sharded``, ``fsdp1-local``)
take plain values and whole tensors from rank 0's file and each rank's rows from that
rank's file. A directory that mixes two saves (two steps of one job, or two jobs) would
merge into a checkpoint nobody saved, so each rank's tree is held against rank 0's first:

  - the job's world size, from the sharded tensors each file holds (a DTensor's mesh, a
    ShardedTensor's saved process group), is the same in every file, and every rank
    below it has its file (``job_world_size``);
  - the same paths in containers of the same types;
  - a sharded tensor (DTensor, ShardedTensor) has the same global shape, dtype and
    layout (placements and mesh shape; every rank's shard metadata and the saving world
    size), and each file's local shard is the shape that layout gives its rank;
  - a plain tensor (a buffer, a 0-dim ``step``) has the same shape, dtype and bytes,
    unless the format says each rank holds its own (FSDP1's ``use_orig_params`` pieces);
  - a plain value is equal, with its type (``param_groups``, counters).

Tensors are memory-mapped and compared one at a time, so the check holds no more than
one tensor's pages at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from shardckpt.core.errors import BadInputError
from shardckpt.core.torch_internals import local_chunk
from shardckpt.core.words import shown
from shardckpt.formats.ranks.rank_names import check_complete
from shardckpt.formats.ranks.sharded_tensor_load import StoredShardedTensor
from shardckpt.formats.torch_save.in_place import values
from shardckpt.state.tree import Path as TreePath
from shardckpt.state.tree import dotted, subtree, walk
from shardckpt.state.values import values_equal

MIXED = "keep one save's rank files in the directory"
MIXED_WORLD_SIZES = (
    "the directory mixes files of jobs with different world sizes; keep one job's files"
)
DAMAGED = "the file is damaged or was edited; re-copy it from where the job saved it"

# Which leaves of a tree each rank holds its own of, so they are not compared.
OwnTensors = Callable[[TreePath], bool]


def none_own(path: TreePath) -> bool:
    """Return False: in most formats every rank holds the same plain tensors."""
    return False


def job_world_size(
    src: Path,
    parts: Mapping[str, Mapping[int, Path]],
    sizes: Mapping[tuple[str, int], int],
    what: str,
) -> int | None:
    """Return the world size the files' ``what`` (their sharded tensors) were saved over.

    ``sizes`` holds it per ``(part, rank)`` file that has one. Every such file must say
    the same as the lowest rank's, every rank below it must have its file in every part
    (named like ``rank_names.check_complete`` names a missing one), and none above it.
    None when no file says.
    """
    if not sizes:
        return None
    (part0, rank0), world_size = min(sizes.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    for (part, rank), size in sorted(sizes.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if size != world_size:
            raise BadInputError(
                f"its {what} are over {size} ranks, those of "
                f"'{parts[part0][rank0].name}' over {world_size}",
                path=parts[part][rank],
                hint=MIXED_WORLD_SIZES,
            )
    check_complete(src, dict(parts), world_size)
    for files in parts.values():
        extra = sorted(r for r in files if r >= world_size)
        if extra:
            raise BadInputError(
                f"its {what} are over {world_size} ranks, but the directory has a rank {extra[0]}",
                path=files[extra[0]],
                hint=MIXED_WORLD_SIZES,
            )
    return world_size


def check_one_save(
    files: Sequence[Path], trees: Sequence[Mapping], own: OwnTensors = none_own
) -> None:
    """Raise ``BadInputError`` unless each rank's tree (``trees[r]``, from ``files[r]``) is one save's.

    ``own`` names the leaves each rank holds its own of: neither compared nor required
    in every file.
    """
    first = dict(walk(trees[0]))
    kinds = _containers(trees[0], first)
    for rank, (file, tree) in enumerate(zip(files, trees)):
        leaves = first if rank == 0 else dict(walk(tree))
        if rank:
            shared = {p: v for p, v in first.items() if not own(p)}
            here = {p: v for p, v in leaves.items() if not own(p)}
            _check_paths(file, files[0].name, shared, here, kinds, _containers(tree, leaves))
        for path, leaf in leaves.items():
            _check_local_shard(file, path, leaf, rank)
            if rank and not own(path):
                why = _difference(leaf, first[path], f"in '{files[0].name}'")
                if why:
                    raise BadInputError(f"'{dotted(path)}' {why}", path=file, hint=MIXED)


def _containers(tree: Mapping, leaves: Mapping[TreePath, object]) -> dict[TreePath, type]:
    """Return the type of every container above a leaf, by path (the root included)."""
    out: dict[TreePath, type] = {}
    for path in leaves:
        for depth in range(len(path)):
            prefix = path[:depth]
            if prefix not in out:
                out[prefix] = type(subtree(tree, prefix))
    return out


def _check_paths(
    file: Path,
    first_name: str,
    first: Mapping[TreePath, object],
    leaves: Mapping[TreePath, object],
    kinds: Mapping[TreePath, type],
    here: Mapping[TreePath, type],
) -> None:
    missing = next((p for p in first if p not in leaves), None)
    if missing is not None:
        raise BadInputError(
            f"has no '{dotted(missing)}', which '{first_name}' has", path=file, hint=MIXED
        )
    extra = next((p for p in leaves if p not in first), None)
    if extra is not None:
        raise BadInputError(
            f"has '{dotted(extra)}', which '{first_name}' has not", path=file, hint=MIXED
        )
    for prefix, kind in kinds.items():
        if here.get(prefix, kind) is not kind:
            raise BadInputError(
                f"'{dotted(prefix) or '<root>'}' is {_a(here[prefix].__name__)} here but "
                f"{_a(kind.__name__)} in '{first_name}'",
                path=file,
                hint=MIXED,
            )


def _difference(leaf: object, first: object, there: str) -> str:
    """Return how ``leaf`` differs from rank 0's ``first`` (which is ``there``), or ''."""
    a, b = _describe(leaf), _describe(first)
    if a != b:
        return f"is {a} here but {b} {there}"
    if isinstance(leaf, DTensor):
        return ""
    if isinstance(leaf, StoredShardedTensor):
        same = _shard_layout(leaf) == _shard_layout(first)  # type: ignore[arg-type]
        return "" if same else f"has other shards here than {there}"
    if isinstance(leaf, torch.Tensor):
        if _same_bytes(leaf, first):  # type: ignore[arg-type]
            return ""
        if leaf.dim() == 0:
            return f"is {values(leaf).item()!r} here but {values(first).item()!r} {there}"  # type: ignore[union-attr]
        return f"holds other values here than {there}"
    if values_equal(leaf, first):
        return ""
    return f"is {shown(leaf)} here but {shown(first)} {there}"


def _describe(leaf: object) -> str:
    """Return what a leaf is, without its values: kind, dtype, shape and layout."""
    if isinstance(leaf, DTensor):
        placements = ", ".join(str(p) for p in leaf.placements)
        mesh = "×".join(str(s) for s in leaf.device_mesh.shape)
        return _a(f"{_dtype(leaf)} DTensor {list(leaf.shape)} ({placements} over {mesh})")
    if isinstance(leaf, StoredShardedTensor):
        return _a(
            f"{_dtype(leaf)} ShardedTensor {list(leaf.shape)} of a job of "
            f"{leaf.saved_world_size} ranks"
        )
    if isinstance(leaf, torch.Tensor):
        return _a(f"{_dtype(leaf)} tensor {list(leaf.shape)}")
    return "a plain value"


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'AEIOUaeiou' else 'a'} {noun}"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _shard_layout(leaf: StoredShardedTensor) -> list[tuple]:
    return [
        (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement))
        for m in leaf.shards_metadata
    ]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return whether two plain tensors of one shape and dtype hold the same bytes (NaNs included)."""
    return torch.equal(_as_bytes(a), _as_bytes(b))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return values(t.detach()).contiguous().reshape(-1).view(torch.uint8)


def _check_local_shard(file: Path, path: TreePath, leaf: object, rank: int) -> None:
    """Refuse a sharded tensor whose local shard is not what its own metadata gives this rank.

    The readers slice rows out of local shards by that metadata; a shard of another
    size would give wrong rows or fail deep inside a copy.
    """
    if isinstance(leaf, DTensor):
        sizes, _ = local_chunk(leaf)
        local = tuple(leaf.to_local().shape)
        if local != sizes:
            raise BadInputError(
                f"'{dotted(path)}' holds a local shard of {list(local)}, but its DTensor "
                f"gives this rank {list(sizes)}",
                path=file,
                hint=DAMAGED,
            )
    elif isinstance(leaf, StoredShardedTensor):
        layout = {
            (tuple(m.shard_offsets), tuple(m.shard_sizes)): m.placement.rank()
            for m in leaf.shards_metadata
        }
        for shard in leaf.local_shards:
            md = shard.metadata
            key = (tuple(md.shard_offsets), tuple(md.shard_sizes))
            local = tuple(shard.tensor.shape)
            if layout.get(key) != rank or local != key[1] or shard.tensor.dtype != leaf.dtype:
                raise BadInputError(
                    f"'{dotted(path)}' holds a local shard of {list(local)} "
                    f"{_dtype(shard.tensor)} at {list(key[0])}, which its ShardedTensor "
                    f"does not give rank {rank}",
                    path=file,
                    hint=DAMAGED,
                )


__all__ = ["OwnTensors", "check_one_save", "job_world_size", "none_own"]
