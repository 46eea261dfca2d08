"""``metadata.pkl`` of a torch_checkpointing checkpoint: read without running code, and written.

torch_checkpointing (0.1.1) pickles ``DistributedMetadata.to_dict()``: plain dicts,
lists, tuples, strings, ints and None, no class at all::

    {"version": "2.0", "world_size": W, "metadata": {item: {
        "nested_path_to_metadata": {'["state","fc.weight","exp_avg"]': [
            {"ranks": (0, 1), "sharding_metadata": {"type": "DTensorShardingMetadata",
             "data": {"dtype": "torch.float32", "global_shape": [7, 3], "stride": [3, 1],
                      "placements": [{"type": "Shard", "dim": 0}],
                      "mesh_spec": {"device_type": "cpu", "mesh_shape": (2,),
                                    "mesh_data": (0, 1), "mesh_dim_names": None}}}}]},
        "rank_to_layout_info": {0: {"file_path": "model_0.safetensors",
                                    "serialization_format": {"type": "SafetensorsSerialization"}},
                                1: None}}}}

Only items saved with a resharder are listed; a layout of None is the library's
default, ``<item>_<rank>.pt`` written with ``torch.save``. The file is unpickled by an
unpickler that refuses every class and callable (``_PlainValues``), so a file that is
anything but such values is refused, not run; every field is checked before use.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from shardckpt.codecs.pickle_bounds import check_pickle
from shardckpt.core.errors import BadInputError, UnsafePickleError
from shardckpt.core.files import os_error, source_file
from shardckpt.core.torch_internals import shard_chunk
from shardckpt.core.words import clipped, counted, shown
from shardckpt.formats.trainers.torch_checkpointing.detect import METADATA_FILE

VERSION = "2.0"
SAFETENSORS = "SafetensorsSerialization"
TORCH = "TorchSerialization"
DTENSOR = "DTensorShardingMetadata"


class _Named(pickle.UnpicklingError):
    """A pickle that names a class or callable, or data outside itself: code, not plain values."""


class _PlainValues(pickle.Unpickler):
    """Unpickles plain values only: any class or callable the pickle names is refused."""

    def find_class(self, module: str, name: str):
        raise _Named(f"names {clipped(f'{module}.{name}')}")

    def persistent_load(self, pid):
        raise _Named("refers to data outside the pickle")


@dataclass(frozen=True)
class Sharding:
    """How one tensor of an item is laid over the ranks: global shape, dtype, each rank's chunk."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[str, ...]
    """``Shard(d)`` / ``Replicate`` per mesh dimension, as labels."""
    mesh_shape: tuple[int, ...]
    chunks: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]
    """Each rank's ``(sizes, offsets)``."""

    @property
    def replicated(self) -> bool:
        """Return whether every rank holds the whole tensor."""
        return all(p == "Replicate" for p in self.placements)


@dataclass(frozen=True)
class Item:
    """One item of the checkpoint the metadata lists: its tensors' shardings and its files."""

    tensors: dict[tuple, Sharding]
    files: dict[int, str]
    """Each rank's file, relative to the checkpoint directory."""
    serialization: str
    """``SafetensorsSerialization`` or ``TorchSerialization``."""


@dataclass(frozen=True)
class Metadata:
    """What ``metadata.pkl`` says: the world size and the items saved with a resharder."""

    world_size: int
    items: dict[str, Item]


class _Lie(Exception):
    """A field of the metadata that is not what torch_checkpointing writes."""


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Lie(what)


def _index(value, what: str, stop: int) -> int:
    """Return ``value`` when it is an int from 0 to ``stop - 1``; a bool (an int to Python) is not."""
    _need(
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value < stop,
        f"{what} is {shown(value)}, not an int from 0 to {stop - 1}",
    )
    return value


def _ints(value, what: str) -> tuple[int, ...]:
    _need(
        isinstance(value, (list, tuple))
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value),
        f"{what} is not a list of sizes",
    )
    return tuple(value)


def _dtype(name) -> torch.dtype:
    _need(
        isinstance(name, str) and name.startswith("torch."), f"dtype {shown(name)} is not torch's"
    )
    dtype = getattr(torch, name[len("torch.") :], None)
    _need(isinstance(dtype, torch.dtype), f"dtype {name!r} is not torch's")
    return dtype


def _placements(raw, mesh_dims: int, ndim: int) -> tuple[str, ...]:
    _need(isinstance(raw, list) and len(raw) == mesh_dims, "placements do not match the mesh")
    out = []
    for p in raw:
        _need(isinstance(p, dict), "a placement is not a mapping")
        kind = p.get("type")
        if kind == "Replicate":
            out.append("Replicate")
            continue
        _need(kind == "Shard", f"a placement of type {shown(kind)} is not Shard or Replicate")
        _need(ndim > 0, "a Shard placement of a 0-d tensor")
        out.append(f"Shard({_index(p.get('dim'), 'the dim of a Shard placement', ndim)})")
    return tuple(out)


def _sharding(packed, world_size: int) -> Sharding:
    _need(isinstance(packed, dict), "sharding metadata is not a mapping")
    _need(packed.get("type") == DTENSOR, f"sharding metadata of type {shown(packed.get('type'))}")
    data = packed.get("data")
    _need(isinstance(data, dict), "sharding metadata has no data")
    shape = _ints(data.get("global_shape"), "global_shape")
    mesh = data.get("mesh_spec")
    _need(isinstance(mesh, dict), "mesh_spec is not a mapping")
    mesh_shape = _ints(mesh.get("mesh_shape"), "mesh_shape")
    ranks = _ints(mesh.get("mesh_data"), "mesh_data")
    _need(
        len(ranks) == math.prod(mesh_shape) and sorted(ranks) == list(range(world_size)),
        f"the mesh {list(ranks)} is not the job's {world_size} ranks",
    )
    placements = _placements(data.get("placements"), len(mesh_shape), len(shape))
    chunks = {}
    for index, rank in enumerate(ranks):
        coordinate = list(_unravel(index, mesh_shape))
        chunks[rank] = shard_chunk(shape, mesh_shape, coordinate, placements)
    return Sharding(shape, _dtype(data.get("dtype")), placements, mesh_shape, chunks)


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def _path(text) -> tuple:
    try:
        path = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        path = None
    _need(
        isinstance(path, list)
        and path
        and all(
            isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)
            for k in path
        ),
        f"nested path {shown(text)} is not a JSON list of keys",
    )
    return tuple(path)


def plain_file_name(name: str) -> bool:
    """Return whether ``name`` names a file directly inside a directory (no path, not . or ..)."""
    return name not in ("", ".", "..") and "\0" not in name and Path(name).name == name


def _item(key: str, raw, world_size: int) -> Item:
    _need(isinstance(raw, dict), f"item {key!r} is not a mapping")
    _need(plain_file_name(f"{key}_0.pt"), f"item key {key!r} cannot name a file in the directory")
    layouts = raw.get("rank_to_layout_info")
    _need(isinstance(layouts, dict), f"item {key!r} has no rank_to_layout_info mapping")
    for rank in layouts:
        _index(rank, f"item {key!r}: a rank of rank_to_layout_info", world_size)
    _need(
        len(layouts) == world_size,
        f"item {key!r} does not name a file for each of the {world_size} ranks",
    )
    files, kinds = {}, set()
    for rank, layout in layouts.items():
        if layout is None:
            files[rank], kind = f"{key}_{rank}.pt", TORCH
        else:
            _need(isinstance(layout, dict), f"item {key!r}: rank {rank}'s layout is not a mapping")
            file, form = layout.get("file_path"), layout.get("serialization_format")
            kind = form.get("type") if isinstance(form, dict) else None
            _need(
                isinstance(file, str) and plain_file_name(file),
                f"item {key!r}: rank {rank}'s file {shown(file)} is not a file name in the directory",
            )
            _need(
                kind in (SAFETENSORS, TORCH),
                f"item {key!r} is stored as {shown(kind)}; shardckpt reads safetensors and torch.save",
            )
            files[rank] = file
        kinds.add(kind)
    _need(len(kinds) == 1, f"item {key!r} is stored in several serializations")
    paths = raw.get("nested_path_to_metadata")
    _need(isinstance(paths, dict), f"item {key!r} has no nested_path_to_metadata")
    tensors = {}
    for text, groups in paths.items():
        path = _path(text)
        try:
            tensors[path] = _tensor(groups, world_size)
        except _Lie as exc:
            raise _Lie(f"item {key!r}, tensor {text}: {exc}") from None
    return Item(tensors, files, kinds.pop())


def _tensor(groups, world_size: int) -> Sharding:
    """Return the sharding the ranks' groups describe for one tensor; every rank must say the same."""
    _need(isinstance(groups, list) and groups, "it has no sharding groups")
    shardings = {}
    for group in groups:
        _need(isinstance(group, dict), "a sharding group is not a mapping")
        sharding = _sharding(group.get("sharding_metadata"), world_size)
        ranks = group.get("ranks")
        _need(isinstance(ranks, (list, tuple)), "the ranks of a sharding group are not a list")
        for rank in ranks:
            shardings[_index(rank, "a rank of a sharding group", world_size)] = sharding
    _need(set(shardings) == set(range(world_size)), "it is not described for every rank")
    first = shardings[0]
    _need(
        all((s.shape, s.dtype, s.chunks) == (first.shape, first.dtype, first.chunks)
            for s in shardings.values()),
        "it is described differently on different ranks",
    )  # fmt: skip
    return first


def _check_unshared(items: dict[str, Item]) -> None:
    """Refuse metadata that names one file for two ranks (of one item or two).

    Each rank's shard is read from the file named for it, so a shared file would give
    one rank's rows to both: a wrong result, not an error, unless refused here.
    """
    owner: dict[str, tuple[str, int]] = {}
    for key, item in items.items():
        for rank, file in item.files.items():
            first = owner.setdefault(file, (key, rank))
            if first[0] == key and first[1] != rank:
                raise _Lie(f"item '{key}' gives ranks {first[1]} and {rank} the same file '{file}'")
            if first[0] != key:
                raise _Lie(
                    f"'{file}' is named for rank {first[1]} of item '{first[0]}' and for "
                    f"rank {rank} of item '{key}'"
                )


def _files_beside(root: Path) -> int:
    """Return how many entries ``root`` holds besides ``metadata.pkl``."""
    try:
        with os.scandir(root) as entries:
            return sum(1 for entry in entries if entry.name != METADATA_FILE)
    except OSError as exc:
        raise os_error(exc, root) from None


def read_metadata(root: Path) -> Metadata:
    """Return what ``root/metadata.pkl`` says; refuse anything but torch_checkpointing's plain values."""
    path = root / METADATA_FILE
    try:
        raw = source_file(path, root).read_bytes()
    except OSError as exc:
        raise os_error(exc, path) from None
    check_pickle(raw, path, metadata=True)
    try:
        data = _PlainValues(io.BytesIO(raw)).load()
    except _Named as exc:
        raise UnsafePickleError(
            f"refused to unpickle ({exc}; torch_checkpointing writes plain values only)",
            path=path,
            hint="shardckpt runs no code from metadata.pkl, with --trust-pickle or without; "
            "use the metadata.pkl torch_checkpointing wrote",
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, RecursionError, MemoryError) as exc:  # fmt: skip
        raise BadInputError(
            f"not torch_checkpointing metadata ({type(exc).__name__}: {exc})",
            path=path,
            hint="the file is damaged, or was not written by torch_checkpointing; re-copy it",
        ) from None
    try:
        _need(isinstance(data, dict), "the top level is not a mapping")
        _need(
            data.get("version") == VERSION, f"version {shown(data.get('version'))}, not {VERSION!r}"
        )
        world_size = data.get("world_size")
        _need(
            isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1,
            "world_size is not a positive int",
        )
        # Every rank saves a file of each item, so a world size past the files there is a
        # lie, refused before anything is sized by it (a set of 10**12 ranks fills memory).
        files = _files_beside(root)
        _need(
            world_size <= max(files, 1),
            f"world_size is {world_size}, but the directory holds {counted(files, 'file')} "
            f"besides {METADATA_FILE}, and each rank saves a file of each item",
        )
        items = data.get("metadata")
        _need(isinstance(items, dict), "metadata is not a mapping of items")
        parsed = {}
        for key, raw_item in items.items():
            _need(isinstance(key, str) and key, f"item key {shown(key)} is not a name")
            parsed[key] = _item(key, raw_item, world_size)
        _check_unshared(parsed)
    except _Lie as exc:
        raise BadInputError(
            f"is not torch_checkpointing metadata shardckpt can use: {exc}",
            path=path,
            hint="re-copy it from where the checkpoint was saved",
        ) from None
    except RecursionError:
        raise BadInputError(
            "nests too deeply to be torch_checkpointing metadata", path=path, hint="re-copy it"
        ) from None
    return Metadata(world_size, parsed)


def sharding_dict(shape: tuple[int, ...], dtype: torch.dtype, world_size: int, split: bool) -> dict:
    """Return the packed ``DTensorShardingMetadata`` of a tensor on a 1-D CPU mesh of ``world_size``.

    ``split``: ``Shard(0)`` as FSDP2 holds parameters; else ``Replicate`` (a plain tensor,
    as the library describes one).
    """
    stride = list(torch.empty(shape, device="meta").stride())
    placement = {"type": "Shard", "dim": 0} if split else {"type": "Replicate"}
    return {
        "type": DTENSOR,
        "data": {
            "dtype": str(dtype),
            "global_shape": list(shape),
            "mesh_spec": {
                "device_type": "cpu",
                "mesh_shape": (world_size,),
                "mesh_data": tuple(range(world_size)),
                "mesh_dim_names": None,
            },
            "placements": [placement],
            "stride": stride,
        },
    }


def metadata_bytes(world_size: int, items: dict[str, dict]) -> bytes:
    """Return ``metadata.pkl`` for ``items``: ``{item: {"paths": {path: sharding dict}, "files":
    {rank: (file, serialization) or None}}}``, as torch_checkpointing pickles it."""
    out = {}
    for key, item in items.items():
        out[key] = {
            "nested_path_to_metadata": {
                json.dumps(list(path), separators=(",", ":")): [
                    {"sharding_metadata": sharding, "ranks": tuple(range(world_size))}
                ]
                for path, sharding in item["paths"].items()
            },
            "rank_to_layout_info": {
                rank: None
                if layout is None
                else {"file_path": layout[0], "serialization_format": {"type": layout[1]}}
                for rank, layout in item["files"].items()
            },
        }
    return pickle.dumps({"metadata": out, "world_size": world_size, "version": VERSION})
