"""The identical-outputs goldens (``tests/goldens/outputs``): every output format written from one
real FSDP2 checkpoint at M = 1, 3, 8 and 64, as the code before issue 21's framing rewrite
wrote it, kept as the SHA-256 of every file (``make.py`` writes them, per torch release).

The source is ``fsdp2-dcp/``: ``tests/reference.make_fsdp2_dcp`` (the example model, FSDP2
on 4 gloo ranks, 2 AdamW steps), committed so that every run converts the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardckpt import api

GOLDENS = Path(__file__).resolve().parent / "goldens" / "outputs"
SOURCE = GOLDENS / "fsdp2-dcp"
HASHES = GOLDENS / "hashes.json"
WORLD_SIZES = (1, 3, 8, 64)
"""The target world sizes M each sharded or local format is written at (where it allows M)."""

_MODEL = {"model": "make_checkpoint:build_model", "wraps": ("make_checkpoint:Block",)}

# name: (--to, request options, whether it is written at each M). FSDP1's formats describe
# two ranks or more; the trainers' options are those each needs from a bare FSDP2 DCP.
FORMATS: dict[str, tuple[str, dict, bool]] = {
    "torch": ("full", {"format": "torch"}, False),
    "safetensors": ("full", {"format": "safetensors"}, False),
    "hf": ("full", {"format": "hf", "max_shard_size": 20_000}, False),
    "dcp": ("sharded", {"format": "dcp"}, True),
    "torch-checkpointing": ("sharded", {"format": "torch-checkpointing"}, True),
    "lightning": ("sharded", {"format": "lightning"}, True),
    "megatron": ("sharded", {"format": "megatron"}, True),
    "accelerate": ("sharded", {"format": "accelerate"}, True),
    "torchtitan": ("sharded", {"format": "torchtitan", "only": "model", "unnest": "model"}, True),
    "fsdp2-ranks": ("local", {"format": "fsdp2-ranks"}, True),
    "fsdp1-sharded": ("local", {"format": "fsdp1-sharded"}, True),
    "fsdp1-local": ("local", {"format": "fsdp1-local", "only": "model", **_MODEL}, True),
    "verl": ("local", {"format": "verl", "optim_keys": "id", "model": _MODEL["model"]}, True),
    "verl-fsdp1": ("local", {"format": "verl-fsdp1", "only": "model", **_MODEL}, True),
}
MIN_WORLD_SIZE = {"fsdp1-sharded": 2, "fsdp1-local": 2, "verl-fsdp1": 2}


def cases() -> dict[str, api.ConvertRequest]:
    """Return every golden output's name (``dcp-M8``, ``torch``) and the request (DST relative) that writes it."""
    out = {}
    for name, (to, options, at_m) in FORMATS.items():
        sizes = [m for m in WORLD_SIZES if m >= MIN_WORLD_SIZE.get(name, 1)] if at_m else [None]
        for m in sizes:
            case = name if m is None else f"{name}-M{m}"
            dst = case + (
                ".pt" if name == "torch" else ".safetensors" if name == "safetensors" else ""
            )
            out[case] = api.ConvertRequest(src=SOURCE, dst=dst, to=to, world_size=m, **options)
    return out


def torch_release() -> str:
    """Return the torch release the hashes of this run are kept under (``2.13.0``: no local tag)."""
    return torch.__version__.split("+")[0]


def recorded() -> dict[str, dict[str, dict[str, str]]]:
    """Return the committed hashes: torch release -> case -> file (relative to DST) -> SHA-256."""
    return json.loads(HASHES.read_text())
