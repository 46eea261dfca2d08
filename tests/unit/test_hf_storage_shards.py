"""HF-storage shard directories that no save wrote whole: each refused in one line naming the
file or directory (the real shards torch writes are ``tests/dist/test_dcp_variants.py``)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from shardckpt.cli import run


def shard(path, tensors: dict, offsets: dict) -> None:
    """Write a shard as ``HuggingFaceStorageWriter`` does: the chunks, their offsets in the metadata."""
    info = {k: {"saved_offsets": v} for k, v in offsets.items()}
    save_file(tensors, path, metadata={"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_chunks_that_leave_a_gap_are_named_as_shards_not_as_a_metadata_file(tmp_path, capsys):
    shard(
        tmp_path / "shard-00001-model-00001-of-00001.safetensors",
        {"w": torch.ones(2, 3)},
        {"w": [0, 0]},
    )
    shard(
        tmp_path / "shard-00002-model-00001-of-00001.safetensors",
        {"w": torch.ones(2, 3)},
        {"w": [3, 0]},
    )
    assert error_of(capsys, ["inspect", tmp_path]) == (
        3,
        f"shardckpt: error: '{tmp_path}': the chunks of 'w' cover 12 of its 15 elements: the "
        "shard files are not one save; copy every shard-*.safetensors file of the save into "
        "the directory",
    )


def test_a_header_that_is_not_json_is_named(tmp_path, capsys):
    path = tmp_path / "shard-00001-model-00001-of-00001.safetensors"
    path.write_bytes((10).to_bytes(8, "little") + b"{not json}" + bytes(8))
    code, line = error_of(capsys, ["inspect", tmp_path])
    assert code == 3
    assert line.startswith(
        f"shardckpt: error: '{path}': the safetensors header at byte 0 is not JSON ("
    )


def test_offsets_of_another_rank_count_are_kept_apart_from_the_shapes(tmp_path, capsys):
    path = tmp_path / "shard-00001-model-00001-of-00001.safetensors"
    shard(path, {"w": torch.ones(2, 3)}, {"w": [0]})
    assert error_of(capsys, ["inspect", tmp_path]) == (
        3,
        f"shardckpt: error: '{path}': 'w' has offsets [0] for a 2-dim chunk: re-copy the "
        "checkpoint from where it was written",
    )
