"""The CRC-32 of each tensor that shardckpt writes into a safetensors header, and their check.

safetensors has no checksum. A file shardckpt writes carries one per tensor in its
header's ``__metadata__`` under ``shardckpt.crc32``: 8 lowercase hex digits per tensor,
in the order of the tensors' data in the file (loaders ignore ``__metadata__``). It is
zip's CRC-32 (the one torch writes for its records), not CRC-32C or xxh3: every rank
writes its own rows of each tensor, and only a CRC combines from pieces
(``crc32_combine``) without a pass over the finished file. The digits are written as
zeros with the header and patched in once every rank has written
(``Record.as_text``), so the header's size is known before any data moves.

A CRC-32 of a tensor's bytes is bound to a byte range, not to the tensor's name, dtype
or shape: swapped ``data_offsets``, a dtype or shape that lies, or the tree in
``__metadata__`` re-pointed would read other bytes, or the same bytes otherwise, with
every range's CRC still right. So the header itself carries a checksum too, under
``shardckpt.header_crc32``: the CRC-32 of the header as canonical JSON (sorted keys, no
spaces), every tensor's entry and ``__metadata__`` included, less the two checksum keys
(the digests are patched in after the header is written). A file an earlier shardckpt
wrote has the tensors' digests without it: its bytes are checked as before
(``Digests.bound`` is False), its names, dtypes and shapes are not.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from isal import isal_zlib

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import read_head
from shardckpt.core.lazy_torch import torch
from shardckpt.state.checksums import Written, active, raw_bytes
from shardckpt.state.regions import Record

DIGESTS_KEY = "shardckpt.crc32"
HEADER_KEY = "shardckpt.header_crc32"
_WIDTH = 8
_HEX = re.compile(r"[0-9a-f]*")


def placeholder(count: int) -> str:
    """Return the digests entry of ``count`` tensors before their CRCs are known."""
    return "0" * (_WIDTH * count)


def header_crc(header: dict) -> str:
    """Return the checksum of a safetensors ``header`` (its JSON as a dict), as 8 hex digits.

    Over every tensor's entry and ``__metadata__``, less the digests (patched in later)
    and this checksum itself.
    """
    metadata = {
        k: v
        for k, v in (header.get("__metadata__") or {}).items()
        if k not in (DIGESTS_KEY, HEADER_KEY)
    }
    canonical = {**header, "__metadata__": metadata}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"{isal_zlib.crc32(text.encode('utf-8')):08x}"


def digest_records(raw: bytes, spans: list[tuple[int, int]], file: str) -> list[Record]:
    """Return, for each tensor's data (file offset, length) in data order, the record whose CRC goes into ``raw``.

    ``raw`` is the file's first bytes (length, then the JSON header holding ``placeholder``).
    """
    needle = json.dumps(DIGESTS_KEY).encode() + b':"'
    if raw.count(needle) != 1:
        raise RuntimeError(f"internal: the header of {file!r} holds {DIGESTS_KEY} once")
    at = raw.index(needle) + len(needle)
    return [
        Record(file, start, length, (at + _WIDTH * i,), as_text=True)
        for i, (start, length) in enumerate(spans)
    ]


@dataclass(frozen=True)
class Digests:
    """The digests of one safetensors file shardckpt wrote: each tensor's data and its CRC-32."""

    path: Path
    spans: dict[str, tuple[int, int]]
    """Each tensor's data as (file offset, length)."""
    crcs: dict[str, int]
    bound: bool = True
    """Whether the header's own checksum covers each tensor's name, dtype, shape and place
    (False: a file an earlier shardckpt wrote, whose digests cover bytes only)."""

    def written(self, name: str) -> Written:
        """Return tensor ``name``'s data as a span with its checksum."""
        start, length = self.spans[name]
        where = f"its data at bytes {start}..{start + length}"
        return Written(str(self.path), start, length, (self.crcs[name],), where)

    def note(self, name: str, first_row: int, tensor: torch.Tensor) -> None:
        """Note the bytes of rows from ``first_row`` of tensor ``name``, as read, in the active ledger."""
        ledger = active()
        if ledger is None or not tensor.numel():
            return
        written = self.written(name)
        ledger.expect(written, [name])
        row = tensor[0].numel() * tensor.element_size() if tensor.dim() else 0
        ledger.note(*written.key, first_row * row, raw_bytes(tensor.contiguous()))


def header(path: Path) -> tuple[int, dict]:
    """Return where a safetensors file's data starts, and its JSON header (read through ``read_head``)."""
    (size,) = struct.unpack("<Q", read_head(path, 8))
    return 8 + size, json.loads(read_head(path, 8 + size)[8:])


def read_digests(path: Path) -> Digests | None:
    """Return the digests in the header of ``path``; None when shardckpt did not write any."""
    start, head = header(path)
    meta = head.get("__metadata__") or {}
    text = meta.get(DIGESTS_KEY)
    if text is None:
        return None
    entries = sorted(
        ((info["data_offsets"], name) for name, info in head.items() if name != "__metadata__"),
        key=lambda e: tuple(e[0]),
    )
    if not isinstance(text, str) or len(text) != _WIDTH * len(entries) or not _HEX.fullmatch(text):
        raise BadInputError(
            f"malformed '{DIGESTS_KEY}' header metadata (not {_WIDTH} hex digits per tensor)",
            path=path,
            hint="the file was altered after shardckpt wrote it; re-copy it",
        )
    stored = meta.get(HEADER_KEY)
    if stored is not None and stored != header_crc(head):
        raise BadInputError(
            "its header does not match the checksum written with it: a tensor's name, "
            "dtype, shape or place, or the tree, was changed after shardckpt wrote it",
            path=path,
            hint="the file was altered after it was written; re-copy it",
        )
    spans = {name: (start + a, b - a) for (a, b), name in entries}
    crcs = {
        name: int(text[_WIDTH * i : _WIDTH * (i + 1)], 16) for i, (_, name) in enumerate(entries)
    }
    return Digests(path, spans, crcs, bound=stored is not None)
