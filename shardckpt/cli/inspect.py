"""``shardckpt inspect``: what a checkpoint holds, from metadata only."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from shardckpt.cli import library
from shardckpt.cli.help import examples
from shardckpt.cli.options import (
    Filters,
    JsonOut,
    SrcFormat,
    StorageOptions,
    TrustPickle,
    Version,
    Wraps,
    emit,
    will_emit,
)

EPILOG = examples(
    "shardckpt inspect .demo/ckpt-dcp",
    "shardckpt inspect .demo/ckpt-dcp --json --filter 'model.blocks.0.*'",
    "shardckpt inspect .demo/ckpt-dcp --shards",
    "shardckpt inspect .demo/ckpt-dcp --verify",
)


def inspect(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC",
            help="Checkpoint: a file (.pt, .bin, .safetensors) or directory (DCP, per-rank "
            "files, a trainer's), local or a URL (s3://bucket/prefix).",
        ),
    ],
    fmt: SrcFormat = None,
    filters: Filters = None,
    shards: Annotated[
        bool, typer.Option("--shards", help="List every stored shard: rank, offsets, sizes.")
    ] = False,
    json_out: JsonOut = False,
    trust_pickle: TrustPickle = False,
    storage_options: StorageOptions = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="pkg.module:factory",
            help="Builds the module: names what fsdp1-local flat parameters hold.",
        ),
    ] = None,
    wraps: Wraps = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Also read every byte and check it against the checksums written with it, "
            "as `shardckpt verify` does (exit 3 when damaged).",
        ),
    ] = False,
    version: Version = False,
) -> int:
    """Show what a checkpoint holds, from metadata only: leaves, shapes, dtypes, layouts, optimizers."""
    library.load(tensors=False)
    from shardckpt import api
    from shardckpt.cli import render
    from shardckpt.cli.verify import raise_if_damaged
    from shardckpt.core.dist import launch
    from shardckpt.core.progress import Progress

    request = api.InspectRequest(
        src=src,
        format=fmt,
        filters=filters or (),
        trust_pickle=trust_pickle,
        model=model,
        wraps=wraps or (),
        verify=verify,
        storage_options=storage_options or (),
    )
    with launch("cpu") as runtime:
        runtime.check(will_emit)
        bar = Progress(enabled=runtime.coordinator and not json_out, desc="inspect --verify")
        result = api.inspect(request, runtime, bar)
    emit(
        json.dumps(render.inspection_json(result, shards))
        if json_out
        else render.inspection_text(result, shards, render.table_width())
    )
    if result.integrity is not None:
        raise_if_damaged(result.integrity, listed=True)
    return 0
