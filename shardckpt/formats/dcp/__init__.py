"""DCP (``torch.distributed.checkpoint``): ``.metadata`` and ``__r_i.distcp`` files.

``reader`` (rows straight from where a stored chunk's bytes lie: ``rows``, after ``check``
of what ``.metadata`` claims) and ``writer`` (DCP's own save planning for M target ranks).
What torch's other DCP writers store, read through the same reader (sources only,
``read_only``): ``safetensors_dcp`` (``serialization_format=SAFETENSORS``, its chunks
placed by ``safetensors_header``) and ``hf_storage`` (``HuggingFaceStorageWriter``'s
per-rank shards, no ``.metadata``), rows from their raw data (``raw_rows``).
"""

from __future__ import annotations

from shardckpt.formats.format import Format, Ref

METADATA_FILE = ".metadata"

DCP = Format(
    name="dcp",
    layout="sharded",
    title="DCP",
    reader=Ref("shardckpt.formats.dcp.reader:DcpReader"),
    writer=Ref("shardckpt.formats.dcp.writer:DcpWriter"),
    directory=True,
    detect=Ref("shardckpt.formats.dcp.reader:is_dcp_dir"),
    default_for="sharded",
    commit_last=(".metadata",),
    keys_as_str=True,
    tells_whole=Ref("shardckpt.formats.dcp.reader:dcp_tells_whole"),
    src_local=True,
    refuses_part=Ref("shardckpt.formats.dcp.lone_file:refuse_lone_file"),
    notes=Ref("shardckpt.formats.dcp.notes:flat_tree_notes"),
)

DCP_SAFETENSORS = Format(
    name="dcp-safetensors",
    layout="sharded",
    title="safetensors-serialized DCP",
    reader=Ref("shardckpt.formats.dcp.safetensors_dcp:DcpSafetensorsReader"),
    writer=Ref("shardckpt.formats.dcp.read_only:ReadOnlyWriter"),
    written=False,
    directory=True,
    detect=Ref("shardckpt.formats.dcp.safetensors_dcp:is_safetensors_dcp_dir"),
    keys_as_str=True,
    tells_whole=Ref("shardckpt.formats.dcp.reader:dcp_tells_whole"),
)

HF_STORAGE = Format(
    name="hf-storage",
    layout="sharded",
    title="Hugging Face storage",
    reader=Ref("shardckpt.formats.dcp.hf_storage:HfStorageReader"),
    writer=Ref("shardckpt.formats.dcp.read_only:ReadOnlyWriter"),
    written=False,
    directory=True,
    detect=Ref("shardckpt.formats.dcp.hf_storage_names:looks_like"),
    tells_whole=Ref("shardckpt.formats.dcp.reader:dcp_tells_whole"),
)

FORMATS = (DCP, DCP_SAFETENSORS, HF_STORAGE)
