"""The ``megatron`` format on a checkpoint megatron-core 0.16.1 wrote (``tests/goldens/megatron``).

``gpt-tp2/`` is ``dist_checkpointing.save`` of a tiny GPTModel at TP=2 on 2 gloo ranks
(``make.py`` beside it says how it was made). What shardckpt reads is compared with
what torch's own DCP reader (``dcp_to_torch_save``) and a plain ``torch.load`` of
``common.pt`` give for the same files, run here on the committed golden (trusted: it is
ours); the outputs shardckpt writes are read back by the same torch calls. Megatron's
own load of an output is ``tests/dist/test_megatron.py`` (needs megatron-core).
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import assert_trees_equal
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardckpt import api
from shardckpt.cli import run
from shardckpt.formats import detect
from shardckpt.formats.trainers.megatron.layouts import describe
from shardckpt.state.tree import Chunk

GOLDEN = Path(__file__).resolve().parents[1] / "goldens" / "megatron" / "gpt-tp2"
RNG_KEYS = ["rng_state/shard_0_2", "rng_state/shard_1_2"]
COMMON = {
    "iteration": 7,
    "checkpoint_version": 3.0,
    "args": argparse.Namespace(tensor_model_parallel_size=2, lr=1e-3, seq_length=8),
    "opt_param_scheduler": {"num_steps": 28, "max_lr": 1e-3},
}


def _plain(obj):
    """Return ``obj`` with numpy arrays as tensors, so trees compare with ``assert_trees_equal``."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def torch_reads(ckpt: Path, tmp: Path) -> dict:
    """Return what torch's ``dcp_to_torch_save`` makes of ``ckpt``'s DCP files (every pickle run: ours)."""
    out = tmp / f"torch-{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return _plain(torch.load(out, weights_only=False))


def common_pt(ckpt: Path) -> dict:
    return torch.load(ckpt / "common.pt", weights_only=False)


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def copy(tmp_path) -> Path:
    shutil.copytree(GOLDEN, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_inspect_reads_it_without_trust_pickle_and_says_what_each_chunk_is():
    assert detect(GOLDEN) == "megatron"
    found = api.inspect(api.InspectRequest(src=GOLDEN))
    index = found.index
    assert (index.format, index.world_size) == ("megatron", 2)
    layouts = {p[0]: m.layout for p, m in index.tensors()}
    assert len(layouts) == 17
    # Replicated over TP and saved by rank 0 only: two layers, not a row split over 2 ranks.
    assert layouts["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == (
        "2 stacked layers"
    )
    assert layouts["decoder.layers.mlp.linear_fc1.weight"] == (
        "2 stacked layers, each split in 2 on dim 1"
    )
    assert layouts["decoder.layers.mlp.linear_fc2.weight"] == (
        "2 stacked layers, each split in 2 on dim 2"
    )
    assert layouts["embedding.word_embeddings.weight"] == "split in 2 on dim 0"
    assert layouts["decoder.final_layernorm.weight"] == "full"
    for key, value in COMMON.items():
        assert index.tree[key] == value
    assert [(p.file, p.key) for p in index.parts] == [("common.pt", k) for k in COMMON]
    assert index.tree["decoder.layers.mlp.linear_fc1._extra_state/shard_1_2"] == [None]
    assert all(type(index.tree[k]) is bytes for k in RNG_KEYS)
    assert found.warnings == [
        "rng_state/shard_0_2, rng_state/shard_1_2: Megatron ShardedObjects kept as the bytes "
        "Megatron stored (they name numpy._core.multiarray._reconstruct, numpy.dtype, "
        "numpy.ndarray), never unpickled; a --format megatron output stores them unchanged, "
        "any other holds them as bytes"
    ]


def test_the_rng_state_is_never_unpickled_even_when_pickles_are_trusted():
    tree = api.inspect(api.InspectRequest(src=GOLDEN, trust_pickle=True)).index.tree
    assert all(type(tree[k]) is bytes for k in RNG_KEYS)


def test_full_output_is_what_torch_reads_of_the_dcp_files_and_common_pt(tmp_path):
    api.convert(api.ConvertRequest(src=GOLDEN, dst=tmp_path / "full.pt", to="full", verify=True))
    with torch.serialization.safe_globals([argparse.Namespace]):
        full = torch.load(tmp_path / "full.pt", weights_only=True)
    expected = torch_reads(GOLDEN, tmp_path)
    assert sum(isinstance(v, torch.Tensor) for v in full.values()) == 17
    # A ShardedObject kept as stored is the bytes torch's reader unpickled.
    for key in RNG_KEYS:
        assert_trees_equal(_plain(torch.load(io.BytesIO(full.pop(key)), weights_only=False)),
                           expected.pop(key))  # fmt: skip
    assert_trees_equal(full, {**expected, **COMMON})
    assert_trees_equal({k: full[k] for k in COMMON}, common_pt(GOLDEN))


def test_megatron_output_at_3_holds_the_same_data_common_pt_and_config(tmp_path):
    dst = tmp_path / "at3"
    argv = ["convert", GOLDEN, dst, "--to", "sharded", "--format", "megatron", "--world-size", "3"]
    assert run([str(a) for a in argv] + ["--verify", "-q"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "common.pt",
        "metadata.json",
    ]
    assert (dst / "metadata.json").read_bytes() == (GOLDEN / "metadata.json").read_bytes()
    assert_trees_equal(common_pt(dst), common_pt(GOLDEN))
    # Every tensor and every ShardedObject (the RNG states byte for byte) as torch reads it.
    assert_trees_equal(torch_reads(dst, tmp_path), torch_reads(GOLDEN, tmp_path))
    with open(dst / ".metadata", "rb") as f:
        stored = pickle.load(f).state_dict_metadata
    assert len(stored["output_layer.weight"].chunks) == 3


def test_without_format_a_megatron_source_stays_megatron_and_says_so(tmp_path, capsys):
    dst = tmp_path / "at3"
    argv = ["convert", str(GOLDEN), str(dst), "--to", "sharded", "--world-size", "3", "-q"]
    assert run(argv) == 0
    assert capsys.readouterr().err == (
        "shardckpt: note: writing DST as a Megatron checkpoint, SRC's own layout "
        "(pass --format dcp for a bare DCP one)\n"
    )
    assert {"common.pt", "metadata.json"} <= {p.name for p in dst.iterdir()}


def test_a_full_file_back_to_megatron_puts_values_in_common_pt_and_the_rest_in_dcp(tmp_path):
    api.convert(api.ConvertRequest(src=GOLDEN, dst=tmp_path / "full.pt", to="full"))
    dst = tmp_path / "back"
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "full.pt",
            dst=dst,
            to="sharded",
            format="megatron",
            world_size=2,
            verify=True,
        )
    )
    assert_trees_equal(common_pt(dst), COMMON)
    assert_trees_equal(torch_reads(dst, tmp_path), torch_reads(GOLDEN, tmp_path))
    assert json.loads((dst / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


def test_another_backend_is_refused_naming_it(copy, capsys):
    config = json.loads((copy / "metadata.json").read_text())
    (copy / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "zarr"}))
    assert error_of(capsys, ["inspect", copy]) == (
        3,
        f"shardckpt: error: '{copy / 'metadata.json'}': names Megatron's 'zarr' backend (with "
        "'torch' common state); shardckpt reads 'torch_dist' checkpoints: re-save with "
        "Megatron's --ckpt-format torch_dist, or --from dcp to read the DCP files alone",
    )


def test_a_damaged_config_is_named(copy, capsys):
    (copy / "metadata.json").write_text('{"sharded_backend": ')
    code, line = error_of(capsys, ["inspect", copy])
    assert code == 3
    assert line.startswith(f"shardckpt: error: '{copy / 'metadata.json'}': is not Megatron's ")
    assert line.endswith(": re-copy it from where the checkpoint was written")


def test_a_config_too_large_to_be_megatrons_is_not_read_whole(copy, capsys):
    (copy / "metadata.json").write_text(json.dumps({"sharded_backend": "x" * (1 << 17)}))
    assert error_of(capsys, ["inspect", copy]) == (
        3,
        f"shardckpt: error: '{copy / 'metadata.json'}': is not Megatron's checkpoint config "
        "(over 65536 bytes, where Megatron writes about 120): re-copy it from where the "
        "checkpoint was written",
    )


def test_a_missing_common_pt_is_named(copy, capsys):
    (copy / "common.pt").unlink()
    assert error_of(capsys, ["inspect", copy]) == (
        3,
        f"shardckpt: error: '{copy}': no 'common.pt' in this directory: a Megatron checkpoint "
        "has one beside the DCP files (rank 0 writes it); re-copy it, or read the DCP part "
        "alone with --from dcp",
    )


class Hostile:
    """Something a pickle could name that is no part of Megatron's metadata."""


def test_metadata_naming_anything_beyond_the_save_plans_is_refused(copy, capsys):
    with open(copy / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.all_local_plans.append(Hostile())
    with open(copy / ".metadata", "wb") as f:
        pickle.dump(md, f)
    assert error_of(capsys, ["inspect", copy]) == (
        3,
        f"shardckpt: error: '{copy / '.metadata'}': metadata references "
        "test_megatron_format.Hostile, which DCP metadata never holds: pass --trust-pickle "
        "only if you trust this file",
    )


def test_common_pt_naming_a_class_is_refused_naming_the_file(copy, capsys):
    torch.save({**COMMON, "hostile": Hostile()}, copy / "common.pt")
    assert error_of(capsys, ["inspect", copy]) == (
        3,
        f"shardckpt: error: '{copy / 'common.pt'}': refused to unpickle (names "
        "test_megatron_format.Hostile, not on the weights-only allow-list): pass "
        "--trust-pickle only if you trust this file",
    )


def test_a_key_in_both_common_pt_and_dcp_is_refused(copy, capsys):
    torch.save({**COMMON, "output_layer.weight": 1}, copy / "common.pt")
    assert error_of(capsys, ["inspect", copy]) == (
        3,
        f"shardckpt: error: '{copy}': 'output_layer.weight' is both in common.pt and in the "
        "DCP data, and Megatron's load would keep only one of them: read the DCP part alone "
        "with --from dcp",
    )


def _grid(shape, pieces, rank_of=lambda i: i):
    """Return the chunks of ``shape`` cut in ``pieces`` equal parts per dim."""
    import itertools

    sizes = tuple(s // p for s, p in zip(shape, pieces))
    return [
        Chunk(rank_of(i), tuple(c * z for c, z in zip(cell, sizes)), sizes)
        for i, cell in enumerate(itertools.product(*(range(p) for p in pieces)))
    ]


def test_layouts_name_layer_stacks_and_splits_and_leave_other_shapes_to_dcp():
    assert describe("decoder.layers.mlp.linear_fc1.weight", (4, 8, 6), _grid((4, 8, 6), (4, 2, 1))) == (
        "4 stacked layers, each split in 2 on dim 1"
    )  # fmt: skip
    assert describe("decoder.layers.x.bias", (1, 6), _grid((1, 6), (1, 1))) == "1 stacked layer"
    # A numbered layer is one layer's tensor: its dim 0 is the tensor's own.
    assert describe("decoder.layers.0.w", (4, 6), _grid((4, 6), (4, 1))) == "split in 4 on dim 0"
    assert describe("w", (4, 6), _grid((4, 6), (2, 3))) == "split in 2 on dim 0, 3 on dim 1"
    uneven = [Chunk(0, (0, 0), (3, 6)), Chunk(1, (3, 0), (1, 3)), Chunk(1, (3, 3), (1, 3))]
    assert describe("w", (4, 6), uneven) is None
