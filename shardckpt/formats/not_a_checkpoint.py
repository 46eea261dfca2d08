"""What a file no format detects is, so its error says what it is instead of listing formats.

A user who passes ``README.md``, a ``config.json`` or a binary by mistake needs to hear
that it is not a checkpoint; a list of every format shardckpt reads would only suggest
that one of them might fit. Judged from the first bytes alone, no pickle touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shardckpt.core.errors import SRC_FORMAT, BadInputError
from shardckpt.core.files import read_head

HEAD_BYTES = 1 << 16
"""How much of a file is looked at: enough for a config.json, never a whole checkpoint."""

_MAGIC = (
    (b"\x7fELF", "an ELF executable"),
    (b"PK\x03\x04", "a zip archive that is not a torch.save file"),
    (b"\x1f\x8b", "a gzip file"),
    (b"%PDF", "a PDF document"),
)


def kind_of(head: bytes, whole: bool) -> str:
    """Return what bytes ``head`` (the whole file when ``whole``) are, as a phrase: 'a text file'."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if b"\x00" in head:
        return "binary data in no format shardckpt knows"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut at the end of the head is still text.
        if whole or exc.start < len(head) - 3:
            return "binary data in no format shardckpt knows"
        text = head[: exc.start].decode("utf-8")
    if whole and text.lstrip()[:1] in ("{", "["):
        try:
            json.loads(text)
            return "a JSON file"
        except ValueError:
            pass
    return "a text file"


def not_a_checkpoint(path: str | os.PathLike) -> BadInputError:
    """Return the error for the file ``path``, which no format detects: what it is, and what to pass."""
    head = read_head(path, HEAD_BYTES + 1)
    kind = kind_of(head[:HEAD_BYTES], whole=len(head) <= HEAD_BYTES)
    return BadInputError(
        f"is {kind}, not a checkpoint",
        path=Path(path),
        hint="pass a checkpoint file (.pt, .bin, .safetensors) or directory (DCP, per-rank "
        f"files, a trainer's), or {SRC_FORMAT} FORMAT for one whose format is not detected",
    )
