"""Acceptance: every source converts to ``fsdp2-ranks`` files that FSDP2 at M loads and trains on.

Sources: a ``torch.save`` file (also one whose tensors view one shared storage), a
safetensors file, FSDP2's DCP at 4, the DCP of FSDP2 over a 2 x 1 replicate x shard mesh
(every tensor stored whole) and FSDP2's own per-rank files. The output is loaded by a
real FSDP2 job at M (``torch.load`` + ``load_state_dict`` + ``set_optimizer_state_dict``,
then one training step), read back as a source and compared with SRC, and each file
must hold only its own rank's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import fsdp1_jobs
import fsdp2_ranks_jobs as jobs
from harness import run_ranks
from rank_bytes import assert_each_file_holds_only_its_own_bytes
from reference import assert_trees_equal, load_dcp_into_fsdp2
from shardckpt import api
from shardckpt.cli.app import run

MODEL = "fsdp2_ranks_jobs:build_model"


@dataclass(frozen=True)
class Source:
    """A checkpoint to convert, whether its format tells buffers apart, and the full state it holds."""

    path: Path
    full: dict
    needs_model: bool


def _packed(full: dict) -> dict:
    """Return ``full`` with every model tensor a view into one flat storage, at an offset."""
    model = full["model"]
    flat = torch.cat([t.reshape(-1) for t in model.values()])
    views, start = {}, 0
    for name, t in model.items():
        views[name] = flat[start : start + t.numel()].view(t.shape)
        start += t.numel()
    return {**full, "model": views}


@pytest.fixture(scope="module")
def sources(fsdp2_ckpt, tmp_path_factory) -> dict[str, Source]:
    root = tmp_path_factory.mktemp("sources")
    ref = torch.load(fsdp2_ckpt.ref, weights_only=True)
    torch.save(_packed(ref), root / "views.pt")
    api.convert(api.ConvertRequest(src=fsdp2_ckpt.ref, dst=root / "full.safetensors", to="full"))
    (root / "whole").mkdir()
    whole_full = run_ranks(jobs.save_replicated_dcp, 2, str(root / "whole" / "dcp"))[0]
    (root / "ranks").mkdir()
    ranks_full = run_ranks(jobs.save_rank_files, 4, str(root / "ranks"))[0]
    return {
        "torch": Source(fsdp2_ckpt.ref, ref, True),
        "torch-views": Source(root / "views.pt", ref, True),
        "safetensors": Source(root / "full.safetensors", ref, True),
        "dcp": Source(fsdp2_ckpt.dcp, ref, False),
        "dcp-whole": Source(root / "whole" / "dcp", whole_full, True),
        "fsdp2-ranks": Source(root / "ranks", ranks_full, False),
    }


@pytest.mark.parametrize(
    "kind, world_size",
    [
        ("torch", 1),
        ("torch", 2),
        ("torch", 3),
        ("torch-views", 1),
        ("torch-views", 2),
        ("safetensors", 2),
        ("dcp", 1),
        ("dcp", 2),
        ("dcp-whole", 1),
        ("dcp-whole", 2),
        ("fsdp2-ranks", 2),
    ],
)
def test_rank_files_from_every_source_load_into_fsdp2_train_and_read_back(
    sources, tmp_path, kind, world_size
):
    src = sources[kind]
    dst = tmp_path / "ranks"
    model = {"model": MODEL} if src.needs_model else {}
    api.convert(api.ConvertRequest(src=src.path, dst=dst, to="local", world_size=world_size, **model))
    assert sorted(p.name for p in dst.iterdir()) == [f"rank_{r}.pt" for r in range(world_size)]
    # A DTensor's pickled DeviceMesh brings a few small tensors of its own.
    assert_each_file_holds_only_its_own_bytes(dst, slack=256)
    rank0 = torch.load(dst / "rank_0.pt", weights_only=True)
    # FSDP2's own files: parameters DTensors, buffers plain tensors.
    assert isinstance(rank0["model"]["embed.weight"], DTensor)
    assert type(rank0["model"]["pos_scale"]) is torch.Tensor
    loaded = run_ranks(jobs.load_rank_files, world_size, str(dst))[0]
    assert_trees_equal(loaded, src.full)
    assert api.diff(api.DiffRequest(a=dst, b=src.path)).equal


@pytest.mark.parametrize("kind, world_size", [("dcp", 2), ("dcp-whole", 2), ("safetensors", 3)])
def test_fsdp1_local_files_from_fsdp2_checkpoints_load_into_fsdp1_and_train(
    sources, tmp_path, kind, world_size
):
    src = sources[kind]
    dst = tmp_path / "local"
    result = api.convert(api.ConvertRequest(src=src.path, dst=dst, to="local", format="fsdp1-local", world_size=world_size, only="model", model=MODEL, wraps=["fsdp1_jobs:Block"], verify=True))
    assert result.verified is True
    assert_each_file_holds_only_its_own_bytes(dst)
    loaded = run_ranks(fsdp1_jobs.load_local, world_size, str(dst), False)[0]
    assert_trees_equal(loaded, src.full["model"])


@pytest.mark.parametrize("fmt", ["fsdp1-sharded", "fsdp1-local"])
def test_fsdp1_outputs_for_one_rank_are_refused(sources, tmp_path, capsys, fmt):
    # FSDP1 on one rank runs NO_SHARD: its state dicts hold whole tensors, which
    # neither ShardedTensors nor flat parameters would load into.
    argv = ["convert", str(sources["dcp"].path), str(tmp_path / "out"), "--to", "local"]
    argv += ["--format", fmt, "--world-size", "1", "--model", MODEL, "--wrap", "fsdp1_jobs:Block"]
    assert (run(argv), capsys.readouterr().err.strip()) == (
        2,
        f"shardckpt: error: --format {fmt} for --world-size 1: FSDP1 on one rank runs "
        "NO_SHARD, whose state dicts hold whole tensors, not shards: convert --to full for a "
        "one-rank job (it loads with FULL_STATE_DICT), or pass --world-size 2 or more",
    )
    assert list(tmp_path.iterdir()) == []  # refused before DST was locked or staged


@pytest.mark.parametrize("kind", ["torch", "dcp-whole"])
def test_a_local_output_of_a_source_that_stores_buffers_like_parameters_asks_for_the_model(
    sources, tmp_path, capsys, kind
):
    src = sources[kind]
    why = {
        "torch": "a torch checkpoint stores every tensor whole",
        "dcp-whole": "this DCP checkpoint stores every tensor as one whole chunk",
    }[kind]
    code = run(["convert", str(src.path), str(tmp_path / "out"), "--to", "local", "--world-size", "1"])
    assert (code, capsys.readouterr().err.strip()) == (
        2,
        f"shardckpt: error: '{src.path}': cannot tell parameters (split across ranks) from "
        f"buffers (whole on every rank): {why} (25 such tensors, e.g. 'model.pos_scale'): "
        "pass --model pkg.module:factory building the trained model",
    )
    assert not (tmp_path / "out").exists()


def test_optimizer_state_alone_needs_no_model(sources, tmp_path):
    src = sources["torch"].path
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "optim", to="local", world_size=2, only="optim"))
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "optim.pt", to="full", only="optim"))
    assert api.diff(api.DiffRequest(a=tmp_path / "optim", b=tmp_path / "optim.pt")).equal


def test_the_model_keeps_buffers_whole_in_a_dcp_output_as_fsdp2_saves_them(sources, tmp_path):
    src = sources["dcp-whole"]
    dst = tmp_path / "dcp2"
    api.convert(api.ConvertRequest(src=src.path, dst=dst, to="sharded", world_size=2, model=MODEL))
    chunks = {
        key: len(md.chunks)
        for key, md in dcp.FileSystemReader(dst).read_metadata().state_dict_metadata.items()
        if hasattr(md, "chunks")
    }
    assert chunks["model.pos_scale"] == 1 and chunks["model.embed.weight"] == 2
    assert_trees_equal(load_dcp_into_fsdp2(dst, 2), src.full)
