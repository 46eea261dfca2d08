"""``shardckpt convert``: another layout, format or world size, exactly."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from shardckpt.cli.options import (
    ALL_FORMATS,
    CleanFqns,
    DeviceOpt,
    Filters,
    JsonOut,
    Layout,
    Nest,
    Only,
    OptimKeys,
    Quiet,
    TrustPickle,
    Unnest,
    Version,
    Wraps,
    emit,
    in_given_order,
    parse_size,
)
from shardckpt.core.errors import UsageError

EPILOG = (
    "Examples (they run as written after `bash scripts/demo.sh`, on its checkpoint):\n\n"
    "  shardckpt convert .demo/ckpt-dcp .demo/full.pt --to full\n\n"
    "  shardckpt convert .demo/ckpt-dcp .demo/model.safetensors --to full --only model\n\n"
    "  torchrun --standalone --nproc-per-node 2 -m shardckpt convert .demo/full.pt .demo/ckpt-2 --to sharded\n\n"
    "  shardckpt convert .demo/ckpt-dcp .demo/ranks-at-2 --to local --world-size 2\n\n"
    "  shardckpt convert .demo/full.pt .demo/ckpt-at-8 --to sharded --world-size 8\n\n"
    "  shardckpt convert .demo/ckpt-dcp .demo/hf-model --to full --format hf --dtype bf16\n\n"
    "  PYTHONPATH=examples shardckpt convert .demo/ckpt-dcp .demo/plain.pt --to full --optim-keys id --model make_checkpoint:model_and_param_groups\n\n"
    "  PYTHONPATH=examples shardckpt convert .demo/full.pt .demo/fsdp1-local --to local --format fsdp1-local --world-size 2 --only model --model make_checkpoint:build_model --wrap make_checkpoint:Block\n\n"
    "  shardckpt convert .demo/full.pt .demo/small.pt --to full --drop '^blocks\\.1\\.' --rename '^head\\.=lm_head.'\n\n"
    "  shardckpt convert .demo/ckpt-dcp .demo/weights.pt --to full --only model --unnest model\n\n"
    "  shardckpt convert .demo/weights.pt .demo/ckpt-nested --to sharded --world-size 4 --nest model\n\n"
    "  Multi-node, SRC on each node's own disk:\n\n"
    "  torchrun --nnodes 2 --nproc-per-node 8 ... -m shardckpt convert /local/step-100 /shared/full.pt --to full --src-local"
)


def convert(
    ctx: typer.Context,
    src: Annotated[
        str, typer.Argument(metavar="SRC", help="Source checkpoint (format detected; see --from).")
    ],
    dst: Annotated[
        str,
        typer.Argument(
            metavar="DST", help="Destination; written beside its name and renamed when complete."
        ),
    ],
    to: Annotated[
        Layout,
        typer.Option(
            "--to",
            help="Layout of DST: full (one file), sharded (DCP, or --format torch-checkpointing; "
            "one file per rank of --world-size) "
            "or local (per-rank files of one world size: --format fsdp2-ranks (default), "
            "fsdp1-sharded, fsdp1-local).",
        ),
    ],
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            metavar="FORMAT",
            help="Output format; default: torch, or safetensors for *.safetensors; dcp for sharded; "
            "fsdp2-ranks for local. Also: hf (a Hugging Face directory of safetensors shards, "
            "model state only), torch-checkpointing (sharded: torch_checkpointing's "
            "CheckpointManager directory), lightning (sharded: DCP plus Lightning's meta.pt), "
            "fsdp1-sharded, fsdp1-local, torchtitan (a step-N directory torchtitan's "
            "CheckpointManager loads).",
        ),
    ] = None,
    src_format: Annotated[
        str | None,
        typer.Option(
            "--from",
            metavar="FORMAT",
            help=f"Source format, when detection is not wanted: {ALL_FORMATS}.",
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            metavar="M",
            help="Ranks of a sharded or local DST, any M >= 1, whatever the launch; "
            "required standalone, under torchrun default: the launch's.",
        ),
    ] = None,
    only: Annotated[
        Only, typer.Option("--only", help="all, model (everything but optimizers) or optim.")
    ] = Only["all"],
    filters: Filters = None,
    clean_fqns: CleanFqns = True,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Cast model floating-point tensors (ints and bools stay as they are): keep, "
            "bf16, fp16, fp32, or torch's names (bfloat16, float16, float32, torch.bfloat16).",
        ),
    ] = "keep",
    cast_optim: Annotated[
        bool,
        typer.Option(
            "--cast-optim",
            help="With --dtype: also cast optimizer floating state (never its 'step' counters).",
        ),
    ] = False,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            metavar="SIZE",
            help="For --format hf: the most tensor bytes per shard (default 5GB).",
        ),
    ] = None,
    hf_config: Annotated[
        str | None,
        typer.Option(
            "--hf-config",
            metavar="DIR",
            help="For --format hf: copy config.json (and generation, tokenizer and processor "
            "files) from DIR into DST, so from_pretrained loads it; default: a config.json in "
            "or beside SRC.",
        ),
    ] = None,
    optim_keys: Annotated[
        OptimKeys,
        typer.Option(
            "--optim-keys",
            help="Key optimizer state by param ID (plain torch.optim), by FQN (FSDP/DCP), "
            "flat (torch's flatten_optimizer_state_dict form, torchtitan), or keep.",
        ),
    ] = OptimKeys["keep"],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="pkg.module:factory",
            help="pkg.module:factory returning the module or (module, param_groups); "
            "gives the order of param IDs.",
        ),
    ] = None,
    wraps: Wraps = None,
    use_orig_params: Annotated[
        bool,
        typer.Option(
            "--use-orig-params",
            help="Only for --format fsdp1-local output: the layout of FSDP1 with "
            "use_orig_params=True (a source says which it has).",
        ),
    ] = False,
    renames: Annotated[
        list[str] | None,
        typer.Option(
            "--rename",
            metavar="REGEX=REPL",
            help="'REGEX=REPL' applied (re.sub) to every FQN, model and optimizer alike "
            "(repeatable; --rename and --drop apply in the order given).",
        ),
    ] = None,
    drops: Annotated[
        list[str] | None,
        typer.Option(
            "--drop",
            metavar="REGEX",
            help="Drop every FQN this regex finds, with its optimizer state "
            "(repeatable; --rename and --drop apply in the order given).",
        ),
    ] = None,
    unnest: Unnest = None,
    nest: Nest = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace an existing DST: a file, or a directory holding a checkpoint.",
        ),
    ] = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Read the output back and compare every value with SRC before it becomes DST.",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan; write nothing.")
    ] = False,
    buffer_size: Annotated[
        str,
        typer.Option(
            "--buffer-size",
            metavar="SIZE",
            help="Most tensor bytes a process holds at a time (default 256MiB; e.g. 64MiB).",
        ),
    ] = "256MiB",
    src_local: Annotated[
        bool,
        typer.Option(
            "--src-local",
            help="SRC is on each node's own disk (under torchrun): each rank reads the files it "
            "sees and rows move over the collective. Detected anyway; this says it is expected.",
        ),
    ] = False,
    json_out: JsonOut = False,
    quiet: Quiet = False,
    trust_pickle: TrustPickle = False,
    device: DeviceOpt = None,
    version: Version = False,
) -> int:
    """Convert a checkpoint into another layout or format, exactly (bit-identical values)."""
    from shardckpt import api
    from shardckpt.cli import render
    from shardckpt.core.costs import process_seconds
    from shardckpt.core.dist import launch
    from shardckpt.core.progress import Progress

    with launch(device.value if device else None) as runtime:
        request = api.ConvertRequest(
            src=src,
            dst=dst,
            to=to.value,
            format=fmt,
            src_format=src_format,
            world_size=world_size,
            only=only.value,
            filters=filters or (),
            clean_fqns=clean_fqns,
            dtype=dtype,
            cast_optim=cast_optim,
            max_shard_size=(
                parse_size(max_shard_size, "--max-shard-size")
                if max_shard_size is not None
                else None
            ),
            optim_keys=optim_keys.value,
            edits=_fqn_edits(ctx, renames or [], drops or []),
            unnest=unnest,
            nest=nest,
            model=model,
            wraps=wraps or (),
            use_orig_params=use_orig_params,
            overwrite=overwrite,
            dry_run=dry_run,
            verify=verify,
            trust_pickle=trust_pickle,
            buffer_bytes=parse_size(buffer_size, "--buffer-size"),
            src_local=src_local,
            hf_config=hf_config,
        )
        progress = Progress(
            enabled=runtime.coordinator and not quiet and not json_out, desc="convert"
        )
        result = api.convert(request, runtime, progress)
    # The command's wall time, from the process's start: what a user waited for.
    wall = process_seconds()
    if json_out:
        emit(json.dumps(render.convert_json(result, wall)))
    elif not quiet or dry_run:
        emit(render.convert_text(result, wall))
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
