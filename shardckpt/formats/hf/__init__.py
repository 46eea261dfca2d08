"""Hugging Face's formats: one ``.safetensors`` file, and a model directory (``model.safetensors``, or shards and their index).

``config`` is ``--hf-config``: the files beside ``config.json`` an ``hf`` DST gets.
"""

from __future__ import annotations

from shardckpt.formats.format import Format, Ref

SAFETENSORS = Format(
    name="safetensors",
    layout="full",
    title="safetensors",
    reader=Ref("shardckpt.formats.hf.safetensors_file:SafetensorsReader"),
    writer=Ref("shardckpt.formats.hf.safetensors_file:SafetensorsWriter"),
    directory=False,
    detect=Ref("shardckpt.formats.hf.safetensors_file:is_safetensors_file"),
    suffixes=(".safetensors",),
    model_root=True,
)

HF = Format(
    name="hf",
    layout="full",
    title="Hugging Face",
    reader=Ref("shardckpt.formats.hf.sharded:HfReader"),
    writer=Ref("shardckpt.formats.hf.sharded:HfWriter"),
    commit_last=("model.safetensors.index.json",),
    directory=True,
    detect=Ref("shardckpt.formats.hf.sharded:is_hf_dir"),
    max_shard_size=True,
    dst_tree=Ref("shardckpt.formats.hf.sharded:model_tree"),
)

FORMATS = (SAFETENSORS, HF)
