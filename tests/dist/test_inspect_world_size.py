"""inspect names the world size a DCP checkpoint was split for (issue 10, item 7).

DCP stores no data for ranks that held nothing, so a checkpoint for 32 ranks of small
tensors names fewer ranks in its ``.metadata``; the chunk sizes (``ceil(n / N)`` rows)
and the data files still tell N. Checked on checkpoints torch itself wrote: FSDP2 at 5
ranks, and DCP written for 32 ranks.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed.checkpoint as dcp
from reference import make_fsdp2_dcp

from shardckpt.cli.app import run
from shardckpt.formats.ranks.dim0_split import torch_split


def inspected(capsys, src) -> dict:
    assert run(["inspect", str(src), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def split_layouts(doc: dict) -> dict[str, str]:
    return {
        ".".join(map(str, e["path"])): e["layout"]
        for e in doc["entries"]
        if e["kind"] == "tensor" and e["layout"] != "full"
    }


@pytest.fixture(scope="module")
def fsdp2_at_5(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2_at_5")
    return make_fsdp2_dcp(root / "dcp", root / "ref.pt", world_size=5, steps=1).dcp


@pytest.fixture(scope="module")
def dcp_at_32(fsdp2_ckpt, tmp_path_factory):
    dst = tmp_path_factory.mktemp("at32") / "dcp"
    argv = ["convert", str(fsdp2_ckpt.dcp), str(dst), "--to", "sharded", "--world-size", "32"]
    assert run([*argv, "-q"]) == 0
    return dst


def test_a_real_fsdp2_run_at_5_reads_shard_over_5(fsdp2_at_5, capsys):
    doc = inspected(capsys, fsdp2_at_5)
    layouts = split_layouts(doc)
    assert doc["world_size"] == 5
    assert layouts and set(layouts.values()) == {"Shard(0) over 5"}, layouts


def test_dcp_written_for_32_ranks_reads_shard_over_32(dcp_at_32, capsys):
    doc = inspected(capsys, dcp_at_32)
    md = dcp.FileSystemReader(dcp_at_32).read_metadata()
    # The premise: ranks that hold nothing of a tensor, whose chunk DCP stores empty.
    assert any(
        c.sizes[0] == 0 for e in md.state_dict_metadata.values() for c in getattr(e, "chunks", [])
    )
    assert doc["world_size"] == 32
    assert set(split_layouts(doc).values()) == {"Shard(0) over 32"}


def test_without_the_files_of_empty_ranks_the_label_says_at_least(dcp_at_32, tmp_path, capsys):
    # The embedding alone (97 rows in chunks of 4) leaves the last ranks without data.
    copy = tmp_path / "dcp"
    argv = ["convert", str(dcp_at_32), str(copy), "--to", "sharded", "--world-size", "32"]
    assert run([*argv, "--only", "model", "--filter", "model.embed.weight", "-q"]) == 0
    md = dcp.FileSystemReader(copy).read_metadata()
    named = {info.relative_path for info in md.storage_data.values()}
    for f in copy.glob("*.distcp"):
        if f.name not in named:
            f.unlink()  # a writer that leaves out the files of ranks with no data
    doc = inspected(capsys, copy)
    low = doc["world_size"]
    assert low < 32
    shapes = {".".join(map(str, e["path"])): e["shape"] for e in doc["entries"] if e["kind"] == "tensor"}
    for path, layout in split_layouts(doc).items():
        assert layout in ("Shard(0) over 32", f"Shard(0) over ≥{low}"), (path, layout)
        # What it says is true: torch splits this tensor the same at the bound and at 32.
        assert torch_split(shapes[path][0], low) == torch_split(shapes[path][0], 32), path
    assert f"Shard(0) over ≥{low}" in split_layouts(doc).values()
    # Still a whole checkpoint: the files left out held nothing.
    assert run(["convert", str(copy), str(tmp_path / "back.pt"), "--to", "full", "-q"]) == 0
