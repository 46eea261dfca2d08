"""Megatron's ShardedObjects: per-rank Python objects that ``torch_dist`` stores pickled in DCP.

Each is a DCP bytes item named ``<key>/shard_<offset>_<shape>`` holding ``torch.save``
of a one-element list (``_extra_state/shard_0_2`` of layer 0 of 2, ``rng_state/shard_1_2``
of tensor-parallel rank 1 of 2). One that holds plain values (``[None]``, a layer's empty
extra state) is read as that list. One that does not (training's ``rng_state`` holds
numpy and torch RNG states) is never unpickled, with or without ``--trust-pickle``: its
value is the ``bytes`` Megatron stored. A ShardedObject is always a list, so a
ShardedObject whose value is ``bytes`` is one carried as stored, and a Megatron output
stores those bytes again as they are.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

from shardckpt.codecs.pickle_scan import DamagedPickle, NotTorchFile, scan_torch_file

_PLAIN = (type(None), bool, int, float, str, bytes)


def is_sharded_object(key: str) -> bool:
    """Return whether DCP key ``key`` is a ShardedObject's (``<key>/shard_<offset>_<shape>``)."""
    return "/shard_" in key


def is_plain(value: object) -> bool:
    """Return whether ``value`` is made of plain Python values only (no tensors, no objects)."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if type(value) is dict:
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


def kept_value(key: str, stored: bytes, loaded: object) -> object:
    """Return the index's value for DCP value ``key``: plain values as read, other ShardedObjects as stored."""
    if is_sharded_object(key) and not is_plain(loaded):
        return bytes(stored)
    return loaded


def stored_as_is(key: str, value: object) -> bytes | None:
    """Return the bytes a Megatron output stores for value ``key``: a carried ShardedObject's own."""
    return bytes(value) if is_sharded_object(key) and isinstance(value, bytes) else None


def carried_note(values: Mapping[str, object]) -> str | None:
    """Return what ``inspect`` says of the ShardedObjects among ``values`` carried as stored bytes."""
    carried = {k: v for k, v in values.items() if stored_as_is(k, v) is not None}
    if not carried:
        return None
    names: set[str] = set()
    for data in carried.values():
        try:
            names |= scan_torch_file(io.BytesIO(data)).globals  # type: ignore[arg-type]
        except (DamagedPickle, NotTorchFile):
            continue
    named = sorted(n for n in names if not n.startswith(("torch.", "collections.", "_codecs.")))
    what = f" (they name {', '.join(named)})" if named else ""
    return (
        f"{', '.join(carried)}: Megatron ShardedObjects kept as the bytes Megatron stored"
        f"{what}, never unpickled; a --format megatron output stores them unchanged, any "
        "other holds them as bytes"
    )
