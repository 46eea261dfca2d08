"""Safetensors headers found inside DCP's files, and the DCP metadata that places their data.

torch writes safetensors for DCP two ways, both with each chunk's offsets in the header's
``__metadata__`` (``DCP_SHARDING_INFO``: ``{fqn: {"saved_offsets": [...]}}``):

- ``FileSystemWriter(serialization_format=SAFETENSORS)``: each ``.distcp`` file holds
  the rank's pickled values, then one safetensors blob of its tensors; ``.metadata``
  gives every tensor entry of a file the blob's first byte and the tensor's length, so
  its entries overlap and none points at its data (torch 2.13's own reader cannot read
  it back);
- ``HuggingFaceStorageWriter(save_distributed=True)``: one safetensors file per rank
  (``shard-0000R-model-0000K-of-N.safetensors``), no ``.metadata`` at all.

Either way the header says where each chunk's data lies; ``Entry.start`` is that byte.
Headers are parsed here (bounded, every field checked), not by the safetensors library,
since a blob inside a ``.distcp`` starts at an offset the library cannot open at.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import os_error, source_stream
from shardckpt.core.lazy_torch import torch
from shardckpt.formats.hf.safetensors_file import TORCH_NAMES
from shardckpt.state.dtypes import dtype_named

SHARDING_INFO = "DCP_SHARDING_INFO"
"""torch's ``_hf_utils.CUSTOM_METADATA_KEY``: each tensor's chunk offsets, as JSON."""
_MAX_HEADER = 100 << 20  # the safetensors library's own limit on a header's size
_RECOPY = "re-copy the checkpoint from where it was written"


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors header: what it is, and where its data lies in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    """Where the chunk sits in the whole tensor (``saved_offsets``; zeros where not said)."""
    start: int
    """Byte of the file where its data starts."""
    length: int


def read_header(path: Path, at: int = 0) -> dict[str, Entry]:
    """Return the tensors of the safetensors header at byte ``at`` of ``path``, each checked."""
    try:
        with source_stream(path) as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(at)
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(_MAX_HEADER, size - at - 8):
                raise _bad(path, f"no safetensors header at byte {at}")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise os_error(exc, path) from None
    except ValueError as exc:
        raise _bad(path, f"the safetensors header at byte {at} is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"the safetensors header at byte {at} is not a JSON object")
    data = at + 8 + n
    saved = _sharding_info(path, header.pop("__metadata__", None))
    entries = {name: _entry(path, name, spec, data, saved) for name, spec in header.items()}
    ends = sorted((e.start, e.start + e.length, name) for name, e in entries.items())
    if ends and ends[-1][1] > size:
        raise _bad(path, f"truncated: {ends[-1][2]!r} ends at byte {ends[-1][1]} of {size}")
    return entries


def _sharding_info(path: Path, metadata: object) -> dict[str, tuple[int, ...]]:
    """Return each tensor's ``saved_offsets`` from the header's ``__metadata__`` (none: {})."""
    if metadata is None:
        return {}
    try:
        info = json.loads(metadata[SHARDING_INFO]) if SHARDING_INFO in metadata else {}
        return {k: _ints(v["saved_offsets"]) for k, v in info.items()}
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise _bad(path, f"malformed {SHARDING_INFO} in the safetensors header ({exc!r})") from None


def _ints(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{value!r} is not a list of non-negative ints")
    return tuple(value)


def _entry(path: Path, name: str, spec: object, data: int, saved: dict) -> Entry:
    """Return header entry ``name`` once its dtype, shape and byte range agree."""
    try:
        dtype = dtype_named(TORCH_NAMES[spec["dtype"]])  # type: ignore[index]
        shape = _ints(spec["shape"])  # type: ignore[index]
        begin, end = _ints(spec["data_offsets"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError) as exc:
        raise _bad(path, f"the safetensors entry of {name!r} is malformed ({exc!r})") from None
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise _bad(
            path,
            f"the safetensors entry of {name!r} holds {end - begin} bytes for a "
            f"{list(shape)} {dtype} tensor",
        )
    offsets = saved.get(name, (0,) * len(shape))
    if len(offsets) != len(shape):
        raise _bad(path, f"{name!r} has offsets {list(offsets)} for a {len(shape)}-dim chunk")
    return Entry(dtype, shape, offsets, data + begin, end - begin)


def _bad(path: Path, message: str) -> BadInputError:
    return BadInputError(message, path=path, hint=_RECOPY)
