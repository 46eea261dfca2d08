"""``safetensors``: one ``.safetensors`` file holding every tensor whole.

Tensors are named by their dotted path (``model.layers.0.weight``). The tree's shape
and its plain values (optimizer hyper-parameters, step counters) ride in the header's
``__metadata__`` under ``shardckpt`` as typed JSON, so ``dcp -> safetensors -> dcp`` is
lossless. A file without that entry (any other writer's) reads as a flat tree.

Reading uses the ``safetensors`` library (``get_slice`` reads just a rank's rows).
Writing: the header is known from metadata alone, so the coordinator writes it and
sizes the file; then every rank writes its rows of each tensor at their offsets, in
the layout the format specifies (8-byte little-endian header length, JSON header
padded to 8 bytes, then data).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from shardckpt.codecs.json_values import UnencodableValue, decode_tree, encode_tree
from shardckpt.core.errors import SRC_FORMAT, BadInputError, UsageError
from shardckpt.core.files import (
    SRC_CHANGED,
    is_remote_file,
    open_source,
    os_error,
    read_exactly,
    read_head,
    source_file,
    writing,
)
from shardckpt.core.lazy_torch import torch
from shardckpt.formats.base import Frame, Index, Reader, Rows, StoredRun, Writer
from shardckpt.formats.hf.digests import (
    DIGESTS_KEY,
    HEADER_KEY,
    Digests,
    digest_records,
    header_crc,
    placeholder,
    read_digests,
)
from shardckpt.state.checksums import raw_bytes
from shardckpt.state.dtypes import dtype_named
from shardckpt.state.regions import Record, Region, spread, whole
from shardckpt.state.tree import TensorMeta, dotted, too_deep, walk

TREE_KEY = "shardckpt"

# safetensors' name of each dtype it stores, by torch's name (``state/dtypes.py``).
SAFETENSORS_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}
TORCH_NAMES = {name: torch_name for torch_name, name in SAFETENSORS_NAMES.items()}


def safetensors_name(dtype) -> str | None:
    """Return safetensors' name of ``dtype`` (torch's or a ``Dtype``), None where it stores none."""
    return SAFETENSORS_NAMES.get(str(dtype).removeprefix("torch."))


def dtype_of(name: str):
    """Return the dtype safetensors calls ``name`` (``dtype_named``), None for one shardckpt does not handle."""
    torch_name = TORCH_NAMES.get(name)
    return dtype_named(torch_name) if torch_name is not None else None


def tensor_meta(path: Path, key: str, sl) -> TensorMeta:
    """Return the ``TensorMeta`` of tensor ``key`` from its ``safe_open`` slice."""
    dtype = dtype_of(sl.get_dtype())
    if dtype is None:
        raise BadInputError(
            f"tensor {key!r} has dtype {sl.get_dtype()}, which shardckpt does not handle",
            path=path,
            hint="convert it with the safetensors library first",
        )
    return TensorMeta(key, tuple(sl.get_shape()), dtype)


@contextmanager
def opened(path: Path, hint: str) -> Iterator:
    """Yield ``safe_open(path)``; a failure while it is open becomes one line naming ``path``.

    For its header: keys, dtypes, shapes, ``__metadata__``. Opened for numpy, which the
    header reads alike and which imports no torch (``framework="pt"`` does, at once).
    The stand-in of an object of a URL SRC (``core.files.is_remote_file``) is not mapped:
    the library checks a local copy of its header alone (``_header_copy``, a sparse file
    of the object's size), and its tensors are read through ``pread`` (``RoutedFile``).
    """
    try:
        if is_remote_file(path):
            with _header_copy(path) as copy, safe_open(copy, framework="numpy") as f:
                yield RoutedFile(path, f)
        else:
            with safe_open(path, framework="numpy") as f:
                yield f
    except BadInputError:
        raise
    except OSError as exc:
        raise os_error(exc, path) from None
    except Exception as exc:
        raise BadInputError(
            f"not a readable safetensors file ({type(exc).__name__}: {exc})", path=path, hint=hint
        ) from None


MAX_HEADER = 100 << 20
"""The largest header the safetensors library reads (its ``HeaderTooLarge``)."""


@contextmanager
def _header_copy(path: Path) -> Iterator[Path]:
    """Yield a private sparse file of ``path``'s size holding only its header: what ``safe_open`` checks."""
    head = read_head(path, 8)
    size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    raw = read_head(path, 8 + min(size, MAX_HEADER + 1))
    with tempfile.TemporaryDirectory(prefix="shardckpt-header-") as tmp:
        copy = Path(tmp) / "header.safetensors"
        with open(copy, "wb") as f:
            f.write(raw)
            f.truncate(os.path.getsize(path))
        yield copy


class RoutedFile:
    """``safe_open``'s handle of a stand-in's header copy, whose tensors are read from the stand-in itself.

    Its names, dtypes, shapes and metadata are the library's; a tensor or rows of one
    (``get_tensor``, ``get_slice(name)[a:b]``) are read with ``read_rows``, never from the
    copy (whose data is zeros).
    """

    def __init__(self, path: Path, handle):
        self.path = path
        self._handle = handle
        self._starts = data_starts(path)

    def __getattr__(self, name: str):
        return getattr(self._handle, name)

    def get_slice(self, key: str) -> RoutedSlice:
        return RoutedSlice(self, key, self._handle.get_slice(key))

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.get_slice(key)[:]

    def rows(self, key: str, rows: Rows) -> torch.Tensor:
        meta = tensor_meta(self.path, key, self._handle.get_slice(key))
        return read_rows(self.path, self._starts, [meta], [rows], None)[0]


class RoutedSlice:
    """``get_slice`` of a ``RoutedFile``: dtype and shape from the header, rows read on indexing."""

    def __init__(self, file: RoutedFile, key: str, handle):
        self._file, self._key, self._handle = file, key, handle

    def get_dtype(self) -> str:
        return self._handle.get_dtype()

    def get_shape(self) -> list[int]:
        return self._handle.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        shape = self.get_shape()
        if index is Ellipsis or index == () or not shape:
            return self._file.rows(self._key, None)
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a stand-in's tensor is read whole or by a range of rows")
        start, stop, _ = index.indices(shape[0])
        return self._file.rows(self._key, (start, max(start, stop)))


class SafetensorsReader(Reader):
    """Reads a ``.safetensors`` file: the header for metadata, ``get_slice`` for rows."""

    format = "safetensors"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        source_file(self.src)
        hint = f"the file is truncated or in another format; name its format with {SRC_FORMAT}"
        with opened(self.src, hint) as f:
            self._metas = {k: tensor_meta(self.src, k, f.get_slice(k)) for k in f.keys()}
            self._header_metadata = f.metadata() or {}
        self.digests = read_digests(self.src)
        self._starts = data_starts(self.src)

    def index(self) -> Index:
        encoded = self._header_metadata.get(TREE_KEY)
        if encoded is None:
            return Index(self.format, str(self.src), 1, dict(self._metas))
        try:
            tree = decode_tree(json.loads(encoded), self._metas.__getitem__)
        except RecursionError:
            raise too_deep(self.src) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise BadInputError(
                f"malformed '{TREE_KEY}' header metadata ({exc})",
                path=self.src,
                hint="the file was altered after shardckpt wrote it",
            ) from None
        return Index(self.format, str(self.src), 1, tree)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return read_rows(self.src, self._starts, metas, rows, self.digests)

    def stored_runs(self, meta: TensorMeta, start: int, stop: int) -> list[StoredRun] | None:
        """Return where elements [start, stop) of ``meta`` lie in the file: one run, as they are."""
        stored = self._metas.get(meta.key)
        return stored_run(self.src, self._starts, stored, meta, start, stop, self.digests)


def data_starts(path: Path) -> dict[str, int]:
    """Return the byte of ``path`` where each tensor's data starts (the header ``opened`` just checked)."""
    head = read_head(path, 8)
    size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    try:
        header = json.loads(read_head(path, 8 + size)[8:])
        return {
            key: 8 + size + int(entry["data_offsets"][0])
            for key, entry in header.items()
            if key != "__metadata__"
        }
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise BadInputError(
            f"not a readable safetensors file ({type(exc).__name__}: {exc})",
            path=path,
            hint=SRC_CHANGED,
        ) from None


def read_rows(
    path: Path,
    starts: dict[str, int],
    metas: Sequence[TensorMeta],
    rows: Sequence[Rows],
    digests: Digests | None,
) -> list[torch.Tensor]:
    """Return the rows of each tensor of ``metas`` from ``path``, checked against its digest if it has one.

    Read with ``pread``, never through a mapping (the safetensors library maps the file):
    a file cut short since it was opened gives a short read, exit 3 naming it, where a
    mapping would fault (SIGBUS) and kill the process with its partial output left.
    """
    if sys.byteorder != "little":
        raise UsageError(
            f"safetensors data is little-endian and this machine is {sys.byteorder}-endian",
            path=path,
            hint="convert on a little-endian machine",
        )
    out = []
    fd = open_source(path)
    try:
        for meta, r in zip(metas, rows):
            first, stop = (0, 0) if r is None or not meta.shape else r
            shape = meta.shape if r is None or not meta.shape else (stop - first, *meta.shape[1:])
            tensor = torch.empty(shape, dtype=meta.dtype)
            row = math.prod(meta.shape[1:]) * meta.dtype.itemsize if meta.shape else 0
            data = raw_bytes(tensor)
            read_exactly(
                fd, data, starts[meta.key] + first * row, path, f"the data of {meta.key!r}"
            )
            if digests is not None:
                digests.note(meta.key, first, tensor)
            out.append(tensor)
    finally:
        os.close(fd)
    return out


def stored_run(
    path: Path,
    starts: dict[str, int],
    stored: TensorMeta | None,
    meta: TensorMeta,
    start: int,
    stop: int,
    digests: Digests | None,
) -> list[StoredRun] | None:
    """Return where elements [start, stop) of ``meta`` lie in ``path``, as tensor ``stored``.

    Safetensors data is each tensor's bytes whole, little-endian, in row-major order: a
    tensor's elements are one run of the file, copied as they lie (``engine.stored_copy``)
    and checked against ``digests`` as ``read_rows`` checks them. None where they are not
    what is to be written: another dtype or shape, or a big-endian machine.
    """
    if stored is None or (stored.dtype, stored.shape) != (meta.dtype, meta.shape):
        return None
    if sys.byteorder != "little":
        return None  # read_rows says why, naming the file
    size = meta.dtype.itemsize
    written = None if digests is None else digests.written(stored.key)
    return [StoredRun(path, starts[stored.key] + start * size, (stop - start) * size, written)]


def tensor_names(tree: dict) -> dict[tuple, str]:
    """Return the unique safetensors name of each tensor path: its dotted form."""
    names: dict[tuple, str] = {}
    seen: dict[str, tuple] = {}
    for path, leaf in walk(tree):
        if isinstance(leaf, TensorMeta):
            name = dotted(path)
            if name in seen:
                raise UsageError(
                    f"paths {list(seen[name])} and {list(path)} both print as '{name}'",
                    hint="rename one with --rename, or write --format torch",
                )
            seen[name] = path
            names[path] = name
    return names


@dataclass(frozen=True)
class Header:
    """A ``.safetensors`` file laid out from metadata: its header bytes and where each tensor goes."""

    raw: bytes
    """Header length (8 bytes, little-endian), then the JSON header padded to 8 bytes."""
    regions: tuple[Region, ...]
    """Each tensor's place in the file, in header order."""
    size: int
    """The file's final size."""
    records: tuple[Record, ...] = ()
    """Each tensor's data, whose CRC-32 is patched into the header's digests (``formats.hf.digests``)."""

    def write(self, path: Path) -> None:
        """Create ``path`` with this header, at its final size (the data area sparse until filled)."""
        with writing(path), open(path, "wb") as f:
            f.write(self.raw)
            f.truncate(self.size)


def layout(entries: Sequence[tuple[str, TensorMeta]], metadata: dict, file: str = "") -> Header:
    """Return the layout of a file of ``entries`` (name, meta) in order; refuse what it cannot store.

    The header's ``__metadata__`` gets a CRC-32 per tensor (``formats.hf.digests``),
    zeros until the data is in, and the CRC-32 of the header itself.
    """
    header: dict = {"__metadata__": {**metadata, DIGESTS_KEY: placeholder(len(entries))}}
    offset = 0
    for name, meta in entries:
        if safetensors_name(meta.dtype) is None:
            raise UsageError(
                f"'{name}' has dtype {meta.dtype}, which safetensors cannot store",
                hint="write --format torch",
            )
        header[name] = {
            "dtype": safetensors_name(meta.dtype),
            "shape": list(meta.shape),
            "data_offsets": [offset, offset + meta.nbytes],
        }
        offset += meta.nbytes
    header["__metadata__"][HEADER_KEY] = header_crc(header)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw = struct.pack("<Q", len(raw) + (-len(raw) % 8)) + raw + b" " * (-len(raw) % 8)
    spans = [(len(raw) + header[name]["data_offsets"][0], meta.nbytes) for name, meta in entries]
    records = digest_records(raw, spans, file)
    regions = tuple(
        whole(meta, file, start, record)
        for (_, meta), (start, _), record in zip(entries, spans, records)
    )
    return Header(raw, regions, len(raw) + offset, tuple(records))


class SafetensorsWriter(Writer):
    """Writes one ``.safetensors`` file holding the whole tree, its structure in the header."""

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        tree = plan.tree
        names = tensor_names(tree)
        try:
            encoded = json.dumps(encode_tree(tree, lambda p, _: names[p]), separators=(",", ":"))
        except UnencodableValue as exc:
            raise UsageError(
                str(exc), hint="write --format torch, or leave it out with --filter/--only"
            ) from None
        entries = [(names[p], leaf) for p, leaf in walk(tree) if isinstance(leaf, TensorMeta)]
        self._header = layout(entries, {"format": "pt", TREE_KEY: encoded})

    def frame(self, runtime) -> Frame:
        runtime.agreed(lambda: self._header.write(self.root) if runtime.coordinator else None)
        return framed([self._header], self.plan.metas, runtime)


def framed(headers: Sequence[Header], metas, runtime) -> Frame:
    """Return a process's part of filling safetensors files: its rows; the coordinator patches the digests."""
    regions = [r for header in headers for r in header.regions]
    mine = spread(regions, metas, runtime.rank, runtime.world_size)
    records = [r for header in headers for r in header.records] if runtime.coordinator else []
    return Frame(mine, records)


def is_safetensors_file(path: Path) -> bool:
    """Return whether file ``path`` starts with a safetensors header: its size, then ``{``."""
    head = read_head(path, 9)
    return (
        len(head) == 9
        and head[8:9] == b"{"
        and struct.unpack("<Q", head[:8])[0] < os.path.getsize(path)
    )
