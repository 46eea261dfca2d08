"""``torch-checkpointing`` without the library: what shardckpt writes reads back exactly, and
metadata that is not what the library writes is refused with one line (the library's own
saves and loads are tests/dist/test_torch_checkpointing.py)."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from reference import assert_trees_equal
from safetensors.torch import save_file

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.formats import detect
from shardckpt.formats.trainers.torch_checkpointing.metadata import (
    SAFETENSORS,
    TORCH,
    metadata_bytes,
    sharding_dict,
)


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


# ---------------------------------------------------------------- each rank its own file

RECOPY_METADATA = "re-copy it from where the checkpoint was saved"
NOT_ONE_SAVE = "the files and the metadata are not one save; re-copy the checkpoint"
SEPARATE = (
    "copy each file itself into the checkpoint directory, from where the checkpoint was saved"
)


def even_tree() -> dict:
    """Return a tree whose tensors split evenly over 2 ranks: shapes alone cannot tell ranks apart."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"fc.weight": torch.randn(8, 3, generator=g)},
        "optim": {
            "state": {"fc.weight": {"exp_avg": torch.randn(8, 3, generator=g)}},
            "param_groups": [{"lr": 0.1, "params": ["fc.weight"]}],
        },
    }


@pytest.fixture
def even(tmp_path):
    """Return a torch-checkpointing directory of ``even_tree()`` at 2, its items saved with torch.save."""
    torch.save(even_tree(), tmp_path / "full.pt")
    dst = tmp_path / "even"
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "full.pt",
            dst=dst,
            to="sharded",
            format="torch-checkpointing",
            world_size=2,
        )
    )
    return dst


@pytest.fixture
def safetensors_items(tmp_path):
    """Return a directory as the library saves a safetensors item at 2: local shards, placed by the metadata."""
    root = tmp_path / "st"
    root.mkdir()
    weight = even_tree()["model"]["fc.weight"]
    for rank in range(2):
        save_file(
            {"fc.weight": weight[4 * rank : 4 * rank + 4].clone()},
            root / f"model_{rank}.safetensors",
        )
    files = {r: (f"model_{r}.safetensors", SAFETENSORS) for r in range(2)}
    paths = {("fc.weight",): sharding_dict((8, 3), torch.float32, 2, True)}
    (root / "metadata.pkl").write_bytes(
        metadata_bytes(2, {"model": {"paths": paths, "files": files}})
    )
    return root


def edit_metadata(directory, edit) -> None:
    meta = pickle.loads((directory / "metadata.pkl").read_bytes())
    edit(meta)
    (directory / "metadata.pkl").write_bytes(pickle.dumps(meta))


def refused(capsys, src, tmp_path) -> tuple[int, str]:
    """Return the exit code and error line of converting ``src`` to a full file; DST must not exist."""
    out = tmp_path / "dst"
    out.mkdir()
    result = error_of(capsys, ["convert", src, out / "full.pt", "--to", "full"])
    assert list(out.iterdir()) == []  # no DST, no partial output, no lock file
    return result


def not_usable(directory, what: str) -> str:
    return (
        f"shardckpt: error: '{directory / 'metadata.pkl'}': is not torch_checkpointing metadata "
        f"shardckpt can use: {what}: {RECOPY_METADATA}"
    )


def test_a_hand_made_safetensors_item_reads_back_exactly(safetensors_items, tmp_path):
    api.convert(api.ConvertRequest(src=safetensors_items, dst=tmp_path / "back.pt", to="full"))
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert_trees_equal(back, {"model": {"fc.weight": even_tree()["model"]["fc.weight"]}})


def _layout(file: str, kind: str = TORCH) -> dict:
    return {"file_path": file, "serialization_format": {"type": kind}}


def _rank_1_reads_rank_0s(meta):
    meta["metadata"]["model"]["rank_to_layout_info"][1] = _layout("model_0.pt")


def _optim_reads_models(meta):
    meta["metadata"]["optim"]["rank_to_layout_info"][0] = _layout("model_0.pt")


@pytest.mark.parametrize(
    "edit, gone, what",
    [
        (_rank_1_reads_rank_0s, "model_1.pt", "item 'model' gives ranks 0 and 1 the same file 'model_0.pt'"),
        (_optim_reads_models, "optim_0.pt",
         "'model_0.pt' is named for rank 0 of item 'model' and for rank 0 of item 'optim'"),
    ],
    ids=["one item", "two items"],
)  # fmt: skip
def test_metadata_that_gives_two_ranks_one_file_is_refused_naming_both(
    even, capsys, tmp_path, edit, gone, what
):
    # Before, rank 1's rows were rank 0's, with exit 0: both shards are 4x3.
    edit_metadata(even, edit)
    (even / gone).unlink()
    assert refused(capsys, even, tmp_path) == (3, not_usable(even, what))


def test_safetensors_files_shared_by_two_ranks_are_refused(safetensors_items, capsys, tmp_path):
    def both_read_rank_0s(meta):
        meta["metadata"]["model"]["rank_to_layout_info"][1] = _layout(
            "model_0.safetensors", SAFETENSORS
        )

    edit_metadata(safetensors_items, both_read_rank_0s)
    # Rank 1's own file stays: with it gone, the metadata's world size would not match
    # the files present, refused first (test_claimed_sizes).
    assert refused(capsys, safetensors_items, tmp_path) == (
        3,
        not_usable(
            safetensors_items,
            "item 'model' gives ranks 0 and 1 the same file 'model_0.safetensors'",
        ),
    )


def _symlink(directory, name: str, target: str) -> None:
    (directory / name).unlink()
    os.symlink(target, directory / name)


def _hard_link(directory, name: str, target: str) -> None:
    (directory / name).unlink()
    os.link(directory / target, directory / name)


@pytest.mark.parametrize("link", [_symlink, _hard_link], ids=["symlink", "hard link"])
@pytest.mark.parametrize(
    "item, suffix", [("optim", ".pt"), ("model", ".safetensors")], ids=["torch", "safetensors"]
)
def test_a_rank_file_that_is_a_link_to_another_ranks_is_refused(
    even, safetensors_items, capsys, tmp_path, link, item, suffix
):
    src = even if suffix == ".pt" else safetensors_items
    link(src, f"{item}_1{suffix}", f"{item}_0{suffix}")
    assert refused(capsys, src, tmp_path) == (
        3,
        f"shardckpt: error: '{src / f'{item}_1{suffix}'}': is the same file as '{item}_0{suffix}' "
        f"(a symlink or hard link), but rank 1's file of item '{item}' and rank 0's file of "
        f"item '{item}' must be two files: {SEPARATE}",
    )


def test_a_copy_of_rank_0s_file_as_rank_1s_is_refused(even, capsys, tmp_path):
    shutil.copy(even / "model_0.pt", even / "model_1.pt")
    assert refused(capsys, even, tmp_path) == (
        3,
        f"shardckpt: error: '{even / 'model_1.pt'}': holds rank 0's shard of 'fc.weight', but it "
        "is rank 1's file: the files are not one save; re-copy the checkpoint",
    )


def test_metadata_that_places_a_ranks_shard_elsewhere_is_refused(even, capsys, tmp_path):
    # The mesh listed backwards gives rank 0 rows 4-7: before, the halves came out swapped.
    def backwards(meta):
        for groups in meta["metadata"]["model"]["nested_path_to_metadata"].values():
            groups[0]["sharding_metadata"]["data"]["mesh_spec"]["mesh_data"] = (1, 0)

    edit_metadata(even, backwards)
    assert refused(capsys, even, tmp_path) == (
        3,
        f"shardckpt: error: '{even / 'model_0.pt'}': 'fc.weight' is the shard at [0, 0], but "
        f"metadata.pkl gives rank 0 the one at [4, 0]: {NOT_ONE_SAVE}",
    )


# ---------------------------------------------------------------- every field's type


def _weight_data(meta) -> dict:
    groups = meta["metadata"]["model"]["nested_path_to_metadata"]['["fc.weight"]']
    return groups[0]["sharding_metadata"]["data"]


def _set_dim(dim):
    def edit(meta):
        _weight_data(meta)["placements"] = [{"type": "Shard", "dim": dim}]

    return edit


def _group_ranks(meta):
    meta["metadata"]["model"]["nested_path_to_metadata"]['["fc.weight"]'][0]["ranks"] = (True, 1)


def _bool_layout_ranks(meta):
    layouts = meta["metadata"]["model"]["rank_to_layout_info"]
    meta["metadata"]["model"]["rank_to_layout_info"] = {False: layouts[0], True: layouts[1]}


def _float_layout_rank(meta):
    layouts = meta["metadata"]["model"]["rank_to_layout_info"]
    meta["metadata"]["model"]["rank_to_layout_info"] = {0: layouts[0], 1.0: layouts[1]}


def _bool_mesh(meta):
    _weight_data(meta)["mesh_spec"]["mesh_shape"] = (True, 2)


def _bool_world_size(meta):
    meta["world_size"] = True


WEIGHT = "item 'model', tensor [\"fc.weight\"]: "
SHARD_DIM = WEIGHT + "the dim of a Shard placement is {}, not an int from 0 to 1"


@pytest.mark.parametrize(
    "edit, what",
    [
        (_set_dim(True), SHARD_DIM.format("True")),
        (_set_dim(0.0), SHARD_DIM.format("0.0")),
        (_set_dim(-1), SHARD_DIM.format("-1")),
        (_set_dim(2), SHARD_DIM.format("2")),
        (_set_dim("0"), SHARD_DIM.format("'0'")),
        (_set_dim(None), SHARD_DIM.format("None")),
        (_set_dim([0]), SHARD_DIM.format("[0]")),
        (_group_ranks, WEIGHT + "a rank of a sharding group is True, not an int from 0 to 1"),
        (_bool_layout_ranks, "item 'model': a rank of rank_to_layout_info is False, not an int from 0 to 1"),
        (_float_layout_rank, "item 'model': a rank of rank_to_layout_info is 1.0, not an int from 0 to 1"),
        (_bool_mesh, WEIGHT + "mesh_shape is not a list of sizes"),
        (_bool_world_size, "world_size is not a positive int"),
    ],
    ids=["dim True", "dim 0.0", "dim -1", "dim 2 of 2-d", "dim '0'", "dim None", "dim [0]",
         "group rank True", "layout ranks bool", "layout rank 1.0", "mesh_shape bool", "world_size True"],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_refused_naming_it(even, capsys, tmp_path, edit, what):
    edit_metadata(even, edit)
    assert refused(capsys, even, tmp_path) == (3, not_usable(even, what))
