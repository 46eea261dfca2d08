"""Trainers' checkpoint directories, each read as one tree and written back at M.

accelerate's ``save_state`` directories, Lightning's sharded checkpoints, torchtitan's
``step-N``, torch_checkpointing's ``CheckpointManager`` directories and megatron-core's
``torch_dist`` directories (``megatron/``), veRL's ``FSDPCheckpointManager`` directories
(``verl/``), and DeepSpeed ZeRO saves, read only (``deepspeed/``). Converted to their own layout without ``--format``, each is written in its
own format again (``keeps_layout``). ``parts`` joins
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
    detect=Ref("shardckpt.formats.trainers.torch_checkpointing.detect:is_torch_checkpointing_dir"),
    tells_whole=always,
    keeps_layout=True,
    commit_last=("metadata.pkl",),
)

LIGHTNING = Format(
    name="lightning",
    layout="sharded",
    title="Lightning",
    reader=Ref("shardckpt.formats.trainers.lightning:LightningReader"),
    writer=Ref("shardckpt.formats.trainers.lightning:LightningWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.lightning_meta:looks_like"),
    keys_as_str=True,
    tells_whole=Ref("shardckpt.formats.dcp.reader:dcp_tells_whole"),
    keeps_layout=True,
    commit_last=(".metadata",),
)

ACCELERATE = Format(
    name="accelerate",
    layout="sharded",
    title="accelerate",
    reader=Ref("shardckpt.formats.trainers.accelerate:AccelerateReader"),
    writer=Ref("shardckpt.formats.trainers.accelerate:AccelerateWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.accelerate_names:looks_like"),
    keys_as_str=True,
    tells_whole=Ref("shardckpt.formats.dcp.reader:dcp_tells_whole"),
    carries_files=True,
    keeps_layout=True,
    commit_last=(".metadata",),
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
    keeps_layout=True,
    commit_last=(".metadata",),
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
    keeps_layout=True,
    commit_last=(".metadata", "metadata.json"),
)

VERL = Format(
    name="verl",
    layout="local",
    title="veRL",
    reader=Ref("shardckpt.formats.trainers.verl.reader:VerlReader"),
    writer=Ref("shardckpt.formats.trainers.verl.writer:VerlWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.verl.names:is_verl"),
    tells_whole=always,
    carries_files=True,
    reads_with_model=True,
    keeps_layout=True,
)

VERL_FSDP1 = Format(
    name="verl-fsdp1",
    layout="local",
    title="veRL FSDP1",
    reader=Ref("shardckpt.formats.trainers.verl.reader:VerlReader"),
    writer=Ref("shardckpt.formats.trainers.verl.writer:VerlFsdp1Writer"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.verl.names:is_verl_fsdp1"),
    min_world_size=2,
    tells_whole=always,
    carries_files=True,
    reads_with_model=True,
    keeps_layout=True,
)

# DeepSpeed's ZeRO saves: per-rank files, read at any world size and written at M.
DEEPSPEED = Format(
    name="deepspeed",
    layout="local",
    title="DeepSpeed ZeRO",
    reader=Ref("shardckpt.formats.trainers.deepspeed.reader:DeepSpeedReader"),
    writer=Ref("shardckpt.formats.trainers.deepspeed.writer:DeepSpeedWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.trainers.deepspeed.detect:is_deepspeed_dir"),
    tells_whole=always,
    refuses_part=Ref("shardckpt.formats.trainers.deepspeed.lone_file:refuse_lone_file"),
)

DEEPSPEED_MODULE = Format(
    name="deepspeed-module",
    layout="local",
    title="DeepSpeed ZeRO (module weights)",
    reader=Ref("shardckpt.formats.trainers.deepspeed.reader:DeepSpeedModuleReader"),
    writer=Ref("shardckpt.formats.trainers.deepspeed.not_written:NotWritten"),
    written=False,
    directory=True,
    detect=Ref("shardckpt.formats.trainers.deepspeed.detect:never"),
    tells_whole=always,
)

DEEPSPEED_UNIVERSAL = Format(
    name="deepspeed-universal",
    layout="local",
    title="DeepSpeed universal",
    reader=Ref("shardckpt.formats.trainers.deepspeed.universal:UniversalReader"),
    writer=Ref("shardckpt.formats.trainers.deepspeed.not_written:NotWritten"),
    written=False,
    directory=True,
    detect=Ref("shardckpt.formats.trainers.deepspeed.detect:is_universal_checkpoint"),
    tells_whole=always,
)

FORMATS = (
    TORCH_CHECKPOINTING,
    LIGHTNING,
    ACCELERATE,
    TORCHTITAN,
    MEGATRON,
    VERL,
    VERL_FSDP1,
    DEEPSPEED,
    DEEPSPEED_MODULE,
    DEEPSPEED_UNIVERSAL,
)
