"""DCP (``torch.distributed.checkpoint``): ``.metadata`` and ``__r_i.distcp`` files.

``reader`` (rows straight from where a stored chunk's bytes lie: ``rows``, after ``check``
of what ``.metadata`` claims) and ``writer`` (DCP's own save planning for M target ranks).
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
    keys_as_str=True,
    tells_whole=Ref("shardckpt.formats.dcp.reader:dcp_tells_whole"),
    src_local=True,
)

FORMATS = (DCP,)
