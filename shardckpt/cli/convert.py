"""``shardckpt convert``: another layout, format or world size, exactly."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from shardckpt.cli import library
from shardckpt.cli.help import examples
from shardckpt.cli.options import (
    BufferSize,
    CleanFqns,
    DeviceOpt,
    Filters,
    JsonOut,
    Nest,
    OnlyOpt,
    Quiet,
    StorageOptions,
    Threads,
    TrustPickle,
    Unnest,
    Version,
    Wraps,
    choice,
    emit,
    in_given_order,
    output_formats,
    parse_size,
    will_emit,
)
from shardckpt.core.errors import UsageError
from shardckpt.state.choices import LAYOUTS, OPTIM_KEYS

EPILOG = examples(
    "shardckpt convert .demo/ckpt-dcp .demo/export.pt --to full",
    "shardckpt convert .demo/ckpt-dcp .demo/model.safetensors --to full --only model",
    "shardckpt convert .demo/export.pt .demo/ckpt-at-8 --to sharded --world-size 8",
    "torchrun --standalone --nproc-per-node 2 -m shardckpt convert .demo/export.pt .demo/ckpt-2 --to sharded",
    "shardckpt convert .demo/ckpt-dcp .demo/ranks-at-2 --to local --world-size 2",
    "shardckpt convert .demo/ckpt-dcp .demo/hf-model --to full --format hf --dtype bf16",
    "PYTHONPATH=examples shardckpt convert .demo/ckpt-dcp .demo/plain.pt --to full --optim-keys id --model make_checkpoint:model_and_param_groups",
)


def convert(
    ctx: typer.Context,
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC",
            help="Checkpoint to read (format detected, or --from): a path or a URL (s3://bucket/prefix).",
        ),
    ],
    dst: Annotated[
        str,
        typer.Argument(
            metavar="DST",
            help="Output, written beside it and renamed when complete (a URL: commit last).",
        ),
    ],
    to: Annotated[
        str,
        choice(
            "--to",
            LAYOUTS,
            "Layout of DST: full (tensors whole), sharded (any world size loads it) or "
            "local (files of one world size).",
        ),
    ],
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            metavar="FORMAT",
            help=f"Output format, the first one by default; {output_formats()}.",
        ),
    ] = None,
    src_format: Annotated[
        str | None,
        typer.Option(
            "--from",
            metavar="FORMAT",
            help="Source format, when detection is not wanted (inspect -h lists them).",
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            metavar="M",
            help="Ranks a sharded or local DST is for; required standalone (under torchrun: "
            "the launch's).",
        ),
    ] = None,
    only: OnlyOpt = "all",
    filters: Filters = None,
    clean_fqns: CleanFqns = True,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Cast model floating-point tensors to bf16, fp16 or fp32 (or torch's names).",
        ),
    ] = "keep",
    cast_optim: Annotated[
        bool,
        typer.Option("--cast-optim", help="With --dtype: cast optimizer state too (never 'step')."),
    ] = False,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            metavar="SIZE",
            help="For --format hf: tensor bytes per shard file (default 5GB).",
        ),
    ] = None,
    hf_config: Annotated[
        str | None,
        typer.Option(
            "--hf-config",
            metavar="DIR",
            help="For --format hf: copy config.json, tokenizer from DIR (else from "
            "Megatron's args).",
        ),
    ] = None,
    map_name: Annotated[
        str | None,
        typer.Option(
            "--map",
            metavar="NAME|FILE.toml",
            help="Map names to Hugging Face's, or back: llama3, qwen3, deepseek_v3, "
            "megatron_gpt, megatron_qwen2, megatron_moe, FILE.toml.",
        ),
    ] = None,
    optim_keys: Annotated[
        str,
        choice(
            "--optim-keys",
            OPTIM_KEYS,
            "Key optimizer state as found, by FQN (FSDP, DCP), by param ID (torch.optim) "
            "or flat (torchtitan).",
        ),
    ] = "keep",
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="pkg.module:factory",
            help="Builds the module or (module, param_groups): IDs, buffers, FSDP1 layouts.",
        ),
    ] = None,
    wraps: Wraps = None,
    use_orig_params: Annotated[
        bool,
        typer.Option(
            "--use-orig-params",
            help="For --format fsdp1-local: the layout of use_orig_params=True.",
        ),
    ] = False,
    zero_stage: Annotated[
        int | None,
        typer.Option(
            "--zero-stage",
            metavar="{1,2,3}",
            help="For --format deepspeed: the ZeRO stage written (default: SRC's).",
        ),
    ] = None,
    renames: Annotated[
        list[str] | None,
        typer.Option(
            "--rename",
            metavar="REGEX=REPL",
            help="re.sub on every FQN (repeatable; with --drop, in the order given).",
        ),
    ] = None,
    drops: Annotated[
        list[str] | None,
        typer.Option(
            "--drop",
            metavar="REGEX",
            help="Drop every FQN this regex finds, with its optimizer state (repeatable).",
        ),
    ] = None,
    unnest: Unnest = None,
    nest: Nest = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace DST when it is a checkpoint (or empty)."),
    ] = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify", help="Compare DST, read back, with SRC before it is put in place."
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be written; write nothing.")
    ] = False,
    buffer_size: BufferSize = "256MiB",
    threads: Threads = None,
    src_local: Annotated[
        bool,
        typer.Option("--src-local", help="Under torchrun: each node has its own SRC."),
    ] = False,
    json_out: JsonOut = False,
    quiet: Quiet = False,
    trust_pickle: TrustPickle = False,
    storage_options: StorageOptions = None,
    device: DeviceOpt = None,
    version: Version = False,
) -> int:
    """Convert a checkpoint into another layout or format, exactly (bit-identical values)."""
    # torch is imported where the conversion needs it (``api.conversion.needs_torch``).
    library.load(tensors=False)
    from shardckpt import api
    from shardckpt.cli import render
    from shardckpt.core.costs import command_seconds
    from shardckpt.core.dist import launch
    from shardckpt.core.progress import Progress

    with launch(device) as runtime:
        if json_out or not quiet or dry_run:
            runtime.check(will_emit)
        request = api.ConvertRequest(
            src=src,
            dst=dst,
            to=to,
            format=fmt,
            src_format=src_format,
            world_size=world_size,
            only=only,
            filters=filters or (),
            clean_fqns=clean_fqns,
            dtype=dtype,
            cast_optim=cast_optim,
            max_shard_size=(
                parse_size(max_shard_size, "--max-shard-size")
                if max_shard_size is not None
                else None
            ),
            optim_keys=optim_keys,
            edits=_fqn_edits(ctx, renames or [], drops or []),
            unnest=unnest,
            nest=nest,
            model=model,
            wraps=wraps or (),
            use_orig_params=use_orig_params,
            zero_stage=zero_stage,
            overwrite=overwrite,
            dry_run=dry_run,
            verify=verify,
            trust_pickle=trust_pickle,
            buffer_bytes=parse_size(buffer_size, "--buffer-size"),
            src_local=src_local,
            hf_config=hf_config,
            storage_options=storage_options or (),
            map=map_name,
            threads=threads,
        )
        progress = Progress(
            enabled=runtime.coordinator and not quiet and not json_out, desc="convert"
        )
        result = api.convert(request, runtime, progress)
    # The command's wall time (the shardckpt command's from the process's start): what a
    # user waited for.
    wall = command_seconds()
    # Printed once DST is in place: a lost summary does not take DST back.
    finished = "" if dry_run else f"the conversion finished and '{dst}' is in place"
    if json_out:
        emit(json.dumps(render.convert_json(result, wall)), finished)
    elif not quiet or dry_run:
        emit(render.convert_text(result, wall), finished)
    return 0


def _fqn_edits(ctx: typer.Context, renames: list[str], drops: list[str]) -> list[tuple[str, str]]:
    """Return ``--rename``/``--drop`` as ``(option, value)`` in the order they were given."""
    edits = in_given_order(ctx, ("--rename", "--drop"))
    # Typer parsed them too; the order found must hold exactly the values it parsed.
    if [v for o, v in edits if o == "--rename"] != renames or [
        v for o, v in edits if o == "--drop"
    ] != drops:
        raise UsageError(
            "cannot tell the order of --rename and --drop",
            hint="write each as --rename=REGEX=REPL or --drop=REGEX",
        )
    return edits
