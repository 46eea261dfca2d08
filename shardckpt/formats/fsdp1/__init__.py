"""FSDP1's per-rank files: ``SHARDED_STATE_DICT`` (ShardedTensors) and ``LOCAL_STATE_DICT`` (flat parameters).

``flat_layout`` gets FSDP1's flat-parameter layout for any world size and rank from
FSDP1 itself, wrapping the user's model on fake tensors.
"""

from __future__ import annotations

from shardckpt.formats.format import Format, Ref, always

FSDP1_SHARDED = Format(
    name="fsdp1-sharded",
    layout="local",
    title="FSDP1 sharded",
    reader=Ref("shardckpt.formats.fsdp1.sharded:Fsdp1ShardedReader"),
    writer=Ref("shardckpt.formats.fsdp1.writer:Fsdp1ShardedWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.fsdp1.local:is_fsdp1_sharded"),
    min_world_size=2,
    tells_whole=always,
)

FSDP1_LOCAL = Format(
    name="fsdp1-local",
    layout="local",
    title="FSDP1 local",
    reader=Ref("shardckpt.formats.fsdp1.local:Fsdp1LocalReader"),
    writer=Ref("shardckpt.formats.fsdp1.writer:Fsdp1LocalWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.fsdp1.local:is_fsdp1_local"),
    min_world_size=2,
    needs_model=True,
    tells_whole=always,
)

FORMATS = (FSDP1_SHARDED, FSDP1_LOCAL)
