"""Trainers' checkpoint directories, each read as one tree and written back at M.

accelerate's ``save_state`` directories, Lightning's sharded checkpoints, torchtitan's
``step-N``, torch_checkpointing's ``CheckpointManager`` directories and megatron-core's
``torch_dist`` directories (``megatron/``). ``parts`` joins
several checkpoints of other formats into one tree (and writes them back as several).
"""

from __future__ import annotations

from shardckpt.formats.format import Format, Ref, always

TORCH_CHECKPOINTING = Format(
    name="torch-checkpointing",
    layout="sharded",
    title="torch_checkpointing",
    reader=Ref("shardckpt.formats.trainers.torch_checkpointing.reader:TorchCheckpointingReader"),
    writer=Ref("shardckpt.formats.trainers.torch_checkpointing.writer:TorchCheckpointingWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.torch_checkpointing.reader:is_torch_checkpointing_dir"),
    tells_whole=always,
)

LIGHTNING = Format(
    name="lightning",
    layout="sharded",
    title="Lightning",
    reader=Ref("shardckpt.formats.trainers.lightning:LightningReader"),
    writer=Ref("shardckpt.formats.trainers.lightning:LightningWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.lightning:looks_like"),
    keys_as_str=True,
    tells_whole=Ref("shardckpt.formats.dcp.reader:dcp_tells_whole"),
)

ACCELERATE = Format(
    name="accelerate",
    layout="sharded",
    title="accelerate",
    reader=Ref("shardckpt.formats.trainers.accelerate:AccelerateReader"),
    writer=Ref("shardckpt.formats.trainers.accelerate:AccelerateWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.accelerate:looks_like"),
    keys_as_str=True,
    tells_whole=Ref("shardckpt.formats.dcp.reader:dcp_tells_whole"),
    carries_files=True,
)

TORCHTITAN = Format(
    name="torchtitan",
    layout="sharded",
    title="torchtitan",
    reader=Ref("shardckpt.formats.trainers.torchtitan:TorchtitanReader"),
    writer=Ref("shardckpt.formats.dcp.writer:DcpWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.torchtitan:looks_like"),
    keys_as_str=True,
    tells_whole=Ref("shardckpt.formats.dcp.reader:dcp_tells_whole"),
    dst_tree=Ref("shardckpt.formats.trainers.torchtitan:titan_tree"),
    src_local=True,
    components=Ref("shardckpt.formats.trainers.torchtitan:components"),
    notes=Ref("shardckpt.formats.trainers.torchtitan:world_size_notes"),
)

MEGATRON = Format(
    name="megatron",
    layout="sharded",
    title="Megatron",
    reader=Ref("shardckpt.formats.trainers.megatron.reader:MegatronReader"),
    writer=Ref("shardckpt.formats.trainers.megatron.writer:MegatronWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.megatron.config:is_megatron_dir"),
    keys_as_str=True,
)

FORMATS = (TORCH_CHECKPOINTING, LIGHTNING, ACCELERATE, TORCHTITAN, MEGATRON)
