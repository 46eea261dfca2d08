"""FSDP2's per-rank files: what ``torch.save(model.state_dict())`` writes on each rank (DTensors)."""

from __future__ import annotations

from shardckpt.formats.format import Format, Ref, always

FSDP2_RANKS = Format(
    name="fsdp2-ranks",
    layout="local",
    title="FSDP2 per-rank",
    reader=Ref("shardckpt.formats.fsdp2.reader:Fsdp2RanksReader"),
    writer=Ref("shardckpt.formats.fsdp2.writer:Fsdp2RanksWriter"),
    directory=True,
    # Asked after FSDP1's: any per-rank directory that is not FSDP1's is FSDP2's.
    detect=Ref("shardckpt.formats.ranks.rank_names:is_rank_dir"),
    default_for="local",
    tells_whole=always,
)

FORMATS = (FSDP2_RANKS,)
