"""Checks that a DCP ``.metadata`` describes SRC's data files, before any data moves.

DCP's loader believes ``.metadata``: a chunk list with a gap leaves that part of the
target as ``torch.empty`` left it, two keys pointed at one byte range read the same
bytes, a ``relative_path`` with ``..`` reads outside SRC, two data files that are one
file (a symlink or hard link) give one rank's bytes for another's, and a shape of 10**12
rows is allocated before a byte is read. ``check_metadata`` refuses each of these with one
line that names the file (``.metadata``, or the data file) and the key, so ``inspect``,
``convert`` and ``diff`` stop before reading. It reads no data (one ``stat`` per data
file) and costs O(n log n) in the number of chunks and values.

What it cannot see: bytes changed inside a data file's range (the CRC-32 of each
item's records is checked as they are read: ``state.checksums``); and a chunk whose
stored tensor is larger than ``.metadata`` says is read as its leading part.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import check_separate, outside, source_file
from shardckpt.formats.dcp import METADATA_FILE
from shardckpt.formats.dcp.plain_metadata import is_a
from shardckpt.state.dtypes import is_dtype

_DAMAGED = (
    "the .metadata is damaged or was not written by torch.distributed.checkpoint; "
    "re-copy the checkpoint from where it was written"
)
_RECOPY = "re-copy it from where the checkpoint was written"
# A list index in a path pads the list with None up to it (as DCP's own set_element
# does for the empty dicts its writer drops from a list). Bounded by the number of
# entries plus this, so a lying index cannot make the tree larger than the metadata.
_LIST_SLACK = 1 << 16

Ints = tuple[int, ...]


def check_metadata(md, src: Path, elsewhere: Mapping[str, int] | None = None) -> None:
    """Raise ``BadInputError`` unless ``md`` describes the data files in ``src`` exactly.

    ``elsewhere`` holds the sizes of data files other ranks see (``shardckpt.core.sight``):
    one this process does not see is checked against that size instead of refused as missing.
    """
    where = src / METADATA_FILE
    entries = _entries(md, where)
    _check_paths(md, entries, where)
    boxes: dict[str, tuple[Ints, list[tuple[Ints, Ints]], int]] = {}
    for key, entry in entries.items():
        if is_a(entry, "TensorStorageMetadata"):
            boxes[key] = _check_tensor(key, entry, where)
    _check_storage(md, entries, boxes, src, where, elsewhere or {})


def _bad(message: str, path: str | os.PathLike, hint: str = _DAMAGED) -> BadInputError:
    return BadInputError(message, path=path, hint=hint)


def _ints(value: object) -> Ints | None:
    """Return ``value`` as a tuple of ints (a torch.Size, tuple or list of them), else None."""
    if not isinstance(value, (tuple, list)):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return tuple(value)


def _show(value: object) -> str:
    """Return ``value`` for an error line: a sequence as a list, anything else by its repr."""
    if isinstance(value, (tuple, list)):
        return repr(list(value))
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a damaged object may not even print
        return f"a {type(value).__name__}"


def _entries(md, where: Path) -> dict:
    """Return ``state_dict_metadata`` once its keys and entries have DCP's types."""
    entries = getattr(md, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise _bad("state_dict_metadata is not a dict", where)
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise _bad(f"key {key!r} is a {type(key).__name__}, not a str", where)
        if not (is_a(entry, "TensorStorageMetadata") or is_a(entry, "BytesStorageMetadata")):
            raise _bad(f"{key!r} is described by a {type(entry).__name__}", where)
    for name in ("planner_data", "storage_data"):
        value = getattr(md, name, None)  # Metadata's class defaults them to None
        if value is not None and not isinstance(value, dict):
            raise _bad(f"{name} is a {type(value).__name__}, not a dict", where)
    return entries


# ---------------------------------------------------------------- paths in the tree


class _Node:
    """One container of the tree the paths build: its children, or the key stored there."""

    __slots__ = ("children", "kind", "key", "path")

    def __init__(self) -> None:
        self.children: dict[str | int, _Node] = {}
        self.kind: type | None = None  # str (a mapping) or int (a list), from the first child
        self.key: str | None = None
        self.path: tuple = ()


def _check_paths(md, entries: dict, where: Path) -> None:
    """Refuse paths that are not tuples of keys, or that collide once built into a tree.

    Every key's path (``planner_data``, or ``(key,)`` without one) must end at its own
    leaf: not at another key's leaf, not inside one, not above one, and a container's
    children are all mapping keys (str) or all list indices (int), as ``tree.build``
    needs. A ``planner_data`` entry without a ``state_dict_metadata`` entry is how
    ``dcp_write`` records an empty mapping torch's loader must not see; its key is
    then the path's dotted form, as DCP's flattening names it.
    """
    paths = dict(md.planner_data or {})
    max_index = len(entries) + len(paths) + _LIST_SLACK
    root = _Node()
    for key in list(paths) + [k for k in entries if k not in paths]:
        path = paths.get(key, (key,))
        if not isinstance(key, str):
            raise _bad(f"planner_data key {key!r} is a {type(key).__name__}, not a str", where)
        if not _is_path(path):
            raise _bad(
                f"the path of {key!r} is {path!r}, not a tuple of str keys and list indices", where
            )
        path = tuple(path)
        too_far = [p for p in path if isinstance(p, int) and p >= max_index]
        if too_far:
            raise _bad(f"the path of {key!r} {path!r} has list index {too_far[0]}", where)
        if key not in entries and key != ".".join(map(str, path)):
            raise _bad(f"planner_data names {key!r}, which .metadata does not store", where)
        _insert(root, key, path, where)


def _is_path(path: object) -> bool:
    """Return whether ``path`` is DCP's form of a path: str keys and list indices from a str."""
    if not isinstance(path, (tuple, list)) or not path or not isinstance(path[0], str):
        return False
    return all(
        isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and p >= 0)
        for p in path
    )


def _insert(root: _Node, key: str, path: tuple, where: Path) -> None:
    node = root
    for i, part in enumerate(path):
        if node.key is not None:
            raise _collision(node, key, path, where)
        if node.kind is None:
            node.kind = type(part)
        elif node.kind is not type(part):
            raise _bad(
                f"the path of {key!r} {path!r} mixes list indices and mapping keys at {path[:i]!r}",
                where,
            )
        node = node.children.setdefault(part, _Node())
    if node.key is not None or node.children:
        other = node if node.key is not None else _a_leaf_below(node)
        raise _collision(other, key, path, where)
    node.key, node.path = key, path


def _a_leaf_below(node: _Node) -> _Node:
    while node.key is None:
        node = next(iter(node.children.values()))
    return node


def _collision(other: _Node, key: str, path: tuple, where: Path) -> BadInputError:
    return _bad(f"the paths of {other.key!r} {other.path!r} and {key!r} {path!r} collide", where)


# ---------------------------------------------------------------- chunks of a tensor


def _check_tensor(key: str, entry, where: Path) -> tuple[Ints, list[tuple[Ints, Ints]], int]:
    """Return (shape, chunk boxes, itemsize) once the chunks tile the tensor exactly."""
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    if not is_dtype(dtype):
        raise _bad(f"{key!r} has dtype {dtype!r}, not a torch dtype", where)
    shape = _ints(getattr(entry, "size", None))
    if shape is None or any(s < 0 for s in shape):
        raise _bad(f"{key!r} has shape {_show(getattr(entry, 'size', None))}", where)
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, (list, tuple)):
        raise _bad(f"{key!r} has no chunk list", where)
    boxes = []
    for chunk in chunks:
        offsets = (
            _ints(getattr(chunk, "offsets", None)) if is_a(chunk, "ChunkStorageMetadata") else None
        )
        sizes = _ints(getattr(chunk, "sizes", None)) if offsets is not None else None
        if sizes is None or len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _bad(
                f"a chunk of {key!r} {list(shape)} has offsets "
                f"{_show(getattr(chunk, 'offsets', None))} and sizes "
                f"{_show(getattr(chunk, 'sizes', None))}",
                where,
            )
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise _bad(
                f"the chunk at {list(offsets)} of {key!r} (sizes {list(sizes)}) "
                f"lies outside its shape {list(shape)}",
                where,
            )
        boxes.append((offsets, sizes))
    pair = _first_overlap(boxes)
    if pair is not None:
        a, b = pair
        raise _bad(f"the chunks at {list(a[0])} and {list(b[0])} of {key!r} overlap", where)
    covered = sum(math.prod(sizes) for _, sizes in boxes)
    if covered != math.prod(shape):
        raise _bad(
            f"the chunks of {key!r} cover {covered} of its {math.prod(shape)} elements", where
        )
    return shape, boxes, dtype.itemsize


def _first_overlap(boxes: list[tuple[Ints, Ints]]) -> tuple | None:
    """Return two boxes that share an element, or None; exact for boxes of any rank.

    A sweep along one axis: boxes sorted by their start there, each compared only with
    the boxes still open at its start. The axis is the one with the most distinct
    starts, so DCP's usual dim-0 chunks keep one box open (O(n log n)), and a 2-D grid
    (FSDP over rows, TP over columns) keeps at most one row or column of it open.
    """
    boxes = [b for b in boxes if math.prod(b[1]) > 0]
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return boxes[0], boxes[1]
    axis = max(range(ndim), key=lambda d: len({off[d] for off, _ in boxes}))
    open_boxes: list[tuple[Ints, Ints]] = []
    for box in sorted(boxes, key=lambda b: b[0][axis]):
        start = box[0][axis]
        open_boxes = [b for b in open_boxes if b[0][axis] + b[1][axis] > start]
        for other in open_boxes:
            if all(
                o1 < o2 + s2 and o2 < o1 + s1
                for o1, s1, o2, s2 in zip(box[0], box[1], other[0], other[1])
            ):
                return other, box
        open_boxes.append(box)
    return None


# ---------------------------------------------------------------- storage


def _check_storage(
    md, entries: dict, boxes: dict, src: Path, where: Path, elsewhere: Mapping[str, int]
) -> None:
    """Refuse storage that is missing, outside SRC, past a file's end, or shared by two keys or files."""
    stored = _storage_index(md, where)
    # relative path -> [(offset, end, key)] of every entry with bytes.
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for key, entry in entries.items():
        if is_a(entry, "BytesStorageMetadata"):
            info = stored.get((key, None))
            if info is None:
                raise _bad(f"no storage entry for the value {key!r}", where)
            continue
        _, chunk_boxes, itemsize = boxes[key]
        for offsets, sizes in chunk_boxes:
            needed = math.prod(sizes) * itemsize
            if needed == 0:
                continue
            info = stored.get((key, offsets))
            if info is None:
                raise _bad(f"no storage entry for the chunk at {list(offsets)} of {key!r}", where)
            # torch.save of a tensor holds at least its bytes (unless an extension such
            # as compression transformed them); so a shape claiming more is refused here,
            # before anything of that size is allocated.
            if not info.transform_descriptors and needed > info.length:
                raise _bad(
                    f"the chunk at {list(offsets)} of {key!r} needs {needed} bytes "
                    f"but {info.length} are stored for it",
                    where,
                )
    sizes: dict[str, int] = {}
    for (key, _), info in stored.items():
        name = info.relative_path
        if name not in sizes:
            sizes[name] = _data_file_size(src, name, key, where, elsewhere)
        end = info.offset + info.length
        if end > sizes[name]:
            raise _bad(
                f"truncated: {key!r} is stored at bytes {info.offset}..{end} "
                f"but the file has {sizes[name]} bytes",
                src / name,
                _RECOPY,
            )
        if info.length:
            ranges.setdefault(name, []).append((info.offset, end, key))
    # Each saving rank wrote its own file: two names of one file would read one rank's
    # bytes as another's, at offsets that may well be in range.
    here = {name: src / name for name in sizes if os.path.lexists(src / name)}
    check_separate(here, lambda name: f"'{name}'")
    for name, spans in ranges.items():
        _check_disjoint(name, spans, where)


def _storage_index(md, where: Path) -> dict[tuple[str, Ints | None], object]:
    """Return ``storage_data`` by (key, chunk offsets or None), once its entries are well formed."""
    stored = {}
    for index, info in (md.storage_data or {}).items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if not is_a(index, "MetadataIndex") or not isinstance(fqn, str):
            raise _bad(f"storage_data has a key {type(index).__name__} for {_show(fqn)}", where)
        offsets = None if offset is None else _ints(offset)
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        transforms = getattr(info, "transform_descriptors", None)
        if not (
            isinstance(name, str)
            and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)
            )
            and (transforms is None or _is_str_list(transforms))
        ):
            raise _bad(
                f"the storage entry of {fqn!r} has relative_path {_show(name)}, "
                f"offset {_show(offset)}, length {_show(length)}",
                where,
            )
        stored[(fqn, offsets)] = info
    return stored


def _is_str_list(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(v, str) for v in value)
    )


def _data_file_size(
    src: Path, name: str, key: str, where: Path, elsewhere: Mapping[str, int]
) -> int:
    """Return the size of data file ``name``, once it is a regular file inside ``src``.

    A file only other ranks see has the size they listed (a listing holds only regular
    files inside SRC: ``sight.listing``).
    """
    parts = PurePosixPath(name).parts
    if not name or "\0" in name or PurePosixPath(name).is_absolute() or ".." in parts:
        raise _bad(
            f"{key!r} is stored at {name!r}, outside the checkpoint directory",
            where,
            "refusing to read it; re-copy the checkpoint from where it was written",
        )
    path = src / name
    if not os.path.lexists(path) and name in elsewhere:
        return elsewhere[name]
    if not os.path.lexists(path):
        raise _bad(
            f"missing data file '{name}' named by .metadata",
            src,
            "copy every *.distcp file of the checkpoint",
        )
    if (real := outside(path, src)) is not None:
        raise _bad(
            f"links outside the checkpoint directory (to '{real}'), and .metadata stores {key!r} in it",
            path,
            "copy the data files into the checkpoint directory instead of linking to them",
        )
    return source_file(path, src).stat().st_size


def _check_disjoint(name: str, spans: list[tuple[int, int, str]], where: Path) -> None:
    """Refuse two storage entries that share bytes of one file (two keys, one storage)."""
    spans.sort()
    last_end, last_key = -1, ""
    for start, end, key in spans:
        if start < last_end:
            raise _bad(f"{last_key!r} and {key!r} are stored in the same bytes of '{name}'", where)
        if end > last_end:
            last_end, last_key = end, key
