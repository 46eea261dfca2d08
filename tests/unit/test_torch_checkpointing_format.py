"""``torch-checkpointing`` without the library: what shardckpt writes reads back exactly, and
metadata that is not what the library writes is refused with one line (the library's own
saves and loads are tests/dist/test_torch_checkpointing.py)."""

from __future__ import annotations

import pickle

import pytest
import torch
from reference import assert_trees_equal

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.formats import detect


def training_tree() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"fc.weight": torch.randn(7, 3, generator=g), "norm": torch.randn(5, generator=g)},
        "optim": {
            "state": {"fc.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(7, 3, generator=g)}},
            "param_groups": [{"lr": 0.1, "params": ["fc.weight"]}],
        },
        "epoch": 7,
    }  # fmt: skip


@pytest.fixture
def written(tmp_path):
    """Return a full torch file and the torch-checkpointing directory written from it at 3."""
    torch.save(training_tree(), tmp_path / "full.pt")
    dst = tmp_path / "tcp"
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "full.pt",
            dst=dst,
            to="sharded",
            format="torch-checkpointing",
            world_size=3,
        )
    )
    return tmp_path / "full.pt", dst


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_each_item_gets_a_file_per_rank_and_reads_back_bit_exactly(written, tmp_path):
    full, dst = written
    names = ["metadata.pkl"] + [
        f"{i}_{r}.pt" for i in ("epoch", "model", "optim") for r in range(3)
    ]
    assert sorted(p.name for p in dst.iterdir()) == sorted(names)
    assert detect(dst) == "torch-checkpointing"
    meta = pickle.loads((dst / "metadata.pkl").read_bytes())
    assert (meta["world_size"], sorted(meta["metadata"])) == (3, ["model", "optim"])
    api.convert(api.ConvertRequest(src=dst, dst=tmp_path / "back.pt", to="full"))
    assert_trees_equal(torch.load(tmp_path / "back.pt", weights_only=True), training_tree())


def test_a_top_level_tensor_is_no_item(capsys, tmp_path):
    torch.save({"fc.weight": torch.ones(7, 3)}, tmp_path / "flat.pt")
    argv = ["convert", tmp_path / "flat.pt", tmp_path / "o", "--to", "sharded"]
    assert error_of(capsys, [*argv, "--format", "torch-checkpointing", "--world-size", "2"]) == (
        2,
        "shardckpt: error: 'fc.weight' is a tensor at the top level, and torch_checkpointing "
        "items are the top-level keys of a state dict: convert a checkpoint that nests its "
        "tensors under items such as 'model' and 'optim', or write --format dcp",
    )


def test_an_item_key_that_is_a_path_is_refused(written, capsys):
    _, dst = written
    meta = pickle.loads((dst / "metadata.pkl").read_bytes())
    meta["metadata"]["../model"] = meta["metadata"].pop("model")
    (dst / "metadata.pkl").write_bytes(pickle.dumps(meta))
    assert error_of(capsys, ["inspect", dst]) == (
        3,
        f"shardckpt: error: '{dst / 'metadata.pkl'}': is not torch_checkpointing metadata "
        "shardckpt can use: item key '../model' cannot name a file in the directory: re-copy "
        "it from where the checkpoint was saved",
    )


def test_a_missing_rank_file_is_named(written, capsys):
    _, dst = written
    (dst / "optim_2.pt").unlink()
    assert error_of(capsys, ["inspect", dst]) == (
        3,
        f"shardckpt: error: '{dst}': missing 'optim_2.pt', rank 2's file of item 'optim' "
        "named by metadata.pkl: copy every file of the checkpoint",
    )
