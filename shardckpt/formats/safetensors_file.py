"""``safetensors``: one ``.safetensors`` file holding every tensor whole.

Tensors are named by their dotted path (``model.layers.0.weight``). The tree's shape
and its plain values (optimizer hyper-parameters, step counters) ride in the header's
``__metadata__`` under ``shardckpt`` as typed JSON, so ``dcp -> safetensors -> dcp`` is
lossless. A file without that entry (any other writer's) reads as a flat tree.

Reading uses the ``safetensors`` library (``get_slice`` reads just a rank's rows).
Writing streams: the header is known from metadata alone, so it is written first and
each tensor's bytes follow as they arrive, in the layout the format specifies
(8-byte little-endian header length, JSON header padded to 8 bytes, then data).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from shardckpt.errors import BadInputError, UsageError
from shardckpt.formats.base import FullWriter, Index, Reader, Rows, contiguous_bytes, too_deep
from shardckpt.formats.files import os_error, source_file, writing
from shardckpt.formats.values import UnencodableValue, decode_tree, encode_tree
from shardckpt.tree import TensorMeta, dotted, walk

TREE_KEY = "shardckpt"

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def tensor_meta(path: Path, key: str, sl) -> TensorMeta:
    """Return the ``TensorMeta`` of tensor ``key`` from its ``safe_open`` slice."""
    dtype = DTYPES.get(sl.get_dtype())
    if dtype is None:
        raise BadInputError(
            f"tensor {key!r} has dtype {sl.get_dtype()}, which shardckpt does not handle",
            path=path,
            hint="convert it with the safetensors library first",
        )
    return TensorMeta(key, tuple(sl.get_shape()), dtype)


class SafetensorsReader(Reader):
    """Reads a ``.safetensors`` file: the header for metadata, ``get_slice`` for rows."""

    format = "safetensors"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        source_file(self.src)
        try:
            with safe_open(self.src, framework="pt") as f:
                self._metas = {k: tensor_meta(self.src, k, f.get_slice(k)) for k in f.keys()}
                self._header_metadata = f.metadata() or {}
        except BadInputError:
            raise
        except OSError as exc:
            raise os_error(exc, self.src) from None
        except Exception as exc:
            raise BadInputError(
                f"not a readable safetensors file ({type(exc).__name__}: {exc})",
                path=self.src,
                hint="the file is truncated or in another format; name its format "
                "(convert --from, inspect --format)",
            ) from None

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
        out = []
        with safe_open(self.src, framework="pt") as f:
            for meta, r in zip(metas, rows):
                out.append(
                    f.get_tensor(meta.key)
                    if r is None or not meta.shape
                    else f.get_slice(meta.key)[r[0] : r[1]]
                )
        return out


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


class SafetensorsFile:
    """One ``.safetensors`` file written by streaming: header from metadata, then tensor bytes."""

    def __init__(self, path: Path, entries: Sequence[tuple[str, TensorMeta]], metadata: dict):
        header: dict = {"__metadata__": metadata}
        offset = 0
        for name, meta in entries:
            if meta.dtype not in DTYPE_NAMES:
                raise UsageError(
                    f"'{name}' has dtype {meta.dtype}, which safetensors cannot store",
                    hint="write --format torch",
                )
            header[name] = {
                "dtype": DTYPE_NAMES[meta.dtype],
                "shape": list(meta.shape),
                "data_offsets": [offset, offset + meta.nbytes],
            }
            offset += meta.nbytes
        self._order = [meta.key for _, meta in entries]
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.path = path
        with writing(path):
            self._file = open(path, "wb")
            try:
                self._file.write(struct.pack("<Q", len(raw)) + raw)
            except BaseException:
                self._file.close()
                raise
        self._next = 0

    @property
    def complete(self) -> bool:
        """Return whether every tensor of the header has been written."""
        return self._next == len(self._order)

    def write(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        """Append one tensor's bytes; calls come in header order."""
        if self._order[self._next] != meta.key:
            raise RuntimeError(
                f"internal: expected tensor {self._order[self._next]}, got {meta.key}"
            )
        self._next += 1
        with writing(self.path):
            self._file.write(contiguous_bytes(tensor))

    def close(self) -> None:
        """Flush the file to disk and close it."""
        with writing(self.path):
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            finally:
                self._file.close()

    def abandon(self) -> None:
        """Close the file unfinished; never raises."""
        with contextlib.suppress(OSError):
            self._file.close()


class SafetensorsWriter(FullWriter):
    """Writes one ``.safetensors`` file holding the whole tree, its structure in the header."""

    def __init__(self, path: Path, tree: dict):
        super().__init__(path, tree)
        names = tensor_names(tree)
        try:
            encoded = json.dumps(encode_tree(tree, lambda p, _: names[p]), separators=(",", ":"))
        except UnencodableValue as exc:
            raise UsageError(
                str(exc), hint="write --format torch, or leave it out with --filter/--only"
            ) from None
        entries = [(names[p], leaf) for p, leaf in walk(tree) if isinstance(leaf, TensorMeta)]
        self._file = SafetensorsFile(path, entries, {"format": "pt", TREE_KEY: encoded})

    def write(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        self._file.write(meta, tensor)

    def close(self) -> None:
        self._file.close()

    def abandon(self) -> None:
        self._file.abandon()
