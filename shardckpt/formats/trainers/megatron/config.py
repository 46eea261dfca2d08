"""Megatron's ``metadata.json``: which backends wrote the checkpoint (``CheckpointingConfig``).

megatron-core's ``dist_checkpointing.load`` takes a directory for a distributed
checkpoint only when this file names its backends ("is not a distributed checkpoint"
otherwise); ``torch_dist`` stores tensors with DCP, ``torch`` the common state in
``common.pt``. shardckpt reads and writes that pair only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shardckpt.core.errors import SRC_FORMAT, BadInputError
from shardckpt.core.files import has_file, open_source, os_error, source_file
from shardckpt.formats.dcp.reader import is_dcp_dir

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
_MAX_CONFIG = 1 << 16  # read no more of a file that should hold four short fields

TORCH_DIST = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
"""What megatron-core 0.16 writes for a ``torch_dist`` save (``asdict(CheckpointingConfig)``)."""


def names_backend(src: Path) -> bool:
    """Return whether ``src`` holds a ``metadata.json`` that names a Megatron sharded backend.

    A file that cannot be parsed says no; one that is not a regular file inside ``src``
    (a link out of it, a FIFO) is refused (``has_file``), never opened.
    """
    if not has_file(src / CONFIG_FILE, src):
        return False
    try:
        with os.fdopen(open_source(src / CONFIG_FILE), "rb") as f:
            config = json.loads(f.read(_MAX_CONFIG))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "sharded_backend" in config


def looks_like(src: Path) -> bool:
    """Return whether the DCP directory ``src`` is Megatron's: its ``common.pt`` or ``metadata.json`` beside ``.metadata``.

    Either file says so, so that a directory missing the other, or with a damaged
    ``metadata.json``, is read as Megatron's and refused naming what is wrong.
    """
    return has_file(src / COMMON_FILE, src) or names_backend(src)


def read_config(src: Path) -> dict:
    """Return ``metadata.json`` of a Megatron checkpoint, once it names ``torch_dist`` and ``torch``."""
    path = src / CONFIG_FILE
    try:
        with open(source_file(path, src), "rb") as f:
            text = f.read(_MAX_CONFIG + 1)
        if len(text) > _MAX_CONFIG:
            raise ValueError(f"over {_MAX_CONFIG} bytes, where Megatron writes about 120")
        config = json.loads(text)
    except OSError as exc:
        raise os_error(exc, path) from None
    except ValueError as exc:
        raise BadInputError(
            f"is not Megatron's checkpoint config ({exc})",
            path=path,
            hint="re-copy it from where the checkpoint was written",
        ) from None
    if not isinstance(config, dict) or not all(k in config for k in TORCH_DIST):
        raise BadInputError(
            f"does not name the checkpoint's backends ({', '.join(TORCH_DIST)})",
            path=path,
            hint="re-copy it from where the checkpoint was written",
        )
    backends = (config["sharded_backend"], config["common_backend"])
    if backends != ("torch_dist", "torch"):
        raise BadInputError(
            f"names Megatron's {backends[0]!r} backend (with {backends[1]!r} common state); "
            "shardckpt reads 'torch_dist' checkpoints",
            path=path,
            hint=f"re-save with Megatron's --ckpt-format torch_dist, or {SRC_FORMAT} dcp to "
            "read the DCP files alone",
        )
    return config


def config_bytes(config: dict) -> bytes:
    """Return ``metadata.json``'s bytes as megatron-core writes them (``json.dump`` of the dict)."""
    return json.dumps(config).encode()


def is_megatron_dir(src: Path) -> bool:
    """Return whether ``src`` is a DCP directory that Megatron saved (``looks_like``)."""
    return is_dcp_dir(src) and looks_like(src)
