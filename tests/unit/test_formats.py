"""Full-file formats: the streaming writers produce what torch and safetensors themselves read."""

from __future__ import annotations

import zipfile

import pytest
import torch
from reference import assert_trees_equal
from safetensors.torch import load_file, save_file

from shardckpt import api
from shardckpt.core.dist import Runtime
from shardckpt.core.progress import Progress
from shardckpt.engine import fill as engine
from shardckpt.formats import detect, open_reader
from shardckpt.formats.base import Reader
from shardckpt.formats.hf.safetensors_file import SafetensorsWriter
from shardckpt.formats.torch_save.file import TorchWriter
from shardckpt.plan.plan import ConvertPlan
from shardckpt.state.tree import TensorMeta, map_leaves, walk


def odd_tree() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return {
        "model": {
            "w": torch.randn(97, 48, generator=g),
            "transposed": base.t(),  # non-contiguous in the source
            "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0, 4),
            "ints": torch.arange(5, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        },
        "optim": {
            "state": {
                "w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(97, 48, generator=g)}
            },
            "param_groups": [
                {"lr": 1e-3, "betas": (0.9, 0.95), "params": ["w"], "foreach": None, "n": 3}
            ],
        },
        "epoch": 7,
    }


class _InMemory(Reader):
    """The tensors of a tree held in memory, read as any source is (rows on demand)."""

    format = "torch"

    def __init__(self, tensors: dict):
        super().__init__("memory")
        self._tensors = tensors

    def index(self):
        raise NotImplementedError

    def read(self, metas, rows, runtime):
        return [
            self._tensors[m.key] if r is None else self._tensors[m.key][r[0] : r[1]]
            for m, r in zip(metas, rows)
        ]


def write_streaming(writer_cls, path, tree):
    """Write ``tree`` with ``writer_cls`` through the engine, as a conversion does."""
    tensors = {}

    def describe(p, leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        key = str(len(tensors))
        tensors[key] = leaf
        return TensorMeta(key, tuple(leaf.shape), leaf.dtype)

    meta_tree = map_leaves(tree, describe)
    metas = [(p, m) for p, m in walk(meta_tree) if isinstance(m, TensorMeta)]
    plan = ConvertPlan("full", "test", 1, meta_tree, tuple(metas), {m.key: m for _, m in metas})
    engine.run(_InMemory(tensors), plan, writer_cls(path, plan), Runtime(), Progress())


def test_torch_writer_output_loads_with_torch_load_and_is_a_valid_zip(tmp_path):
    tree = odd_tree()
    write_streaming(TorchWriter, tmp_path / "out.pt", tree)
    assert zipfile.ZipFile(tmp_path / "out.pt").testzip() is None  # every CRC-32 matches
    assert_trees_equal(torch.load(tmp_path / "out.pt", weights_only=True), tree)


def test_safetensors_writer_output_loads_with_the_safetensors_library(tmp_path):
    tree = odd_tree()
    write_streaming(SafetensorsWriter, tmp_path / "out.safetensors", tree)
    flat = load_file(tmp_path / "out.safetensors")
    expected = {".".join(map(str, p)): t for p, t in walk(tree) if isinstance(t, torch.Tensor)}
    assert_trees_equal(flat, expected)


def test_safetensors_keeps_values_and_structure_through_its_metadata(tmp_path):
    tree = odd_tree()
    write_streaming(SafetensorsWriter, tmp_path / "out.safetensors", tree)
    api.convert(
        api.ConvertRequest(src=tmp_path / "out.safetensors", dst=tmp_path / "back.pt", to="full")
    )
    assert_trees_equal(torch.load(tmp_path / "back.pt", weights_only=True), tree)


def test_foreign_safetensors_reads_as_a_flat_tree(tmp_path):
    save_file({"a.weight": torch.ones(2, 2), "b": torch.zeros(3)}, tmp_path / "x.safetensors")
    index = open_reader(tmp_path / "x.safetensors").index()
    assert [p for p, _ in walk(index.tree)] == [("a.weight",), ("b",)]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_conversion_through_each_full_format_is_exact(tmp_path, fmt):
    src = tmp_path / "src.pt"
    torch.save(odd_tree(), src)
    dst = tmp_path / ("dst.safetensors" if fmt == "safetensors" else "dst.pt")
    api.convert(api.ConvertRequest(src=src, dst=dst, to="full"))
    api.convert(api.ConvertRequest(src=dst, dst=tmp_path / "sharded", to="sharded", world_size=1))
    api.convert(api.ConvertRequest(src=tmp_path / "sharded", dst=tmp_path / "again.pt", to="full"))
    assert_trees_equal(torch.load(tmp_path / "again.pt", weights_only=True), odd_tree())


def test_tied_tensors_keep_their_own_keys_in_every_format(tmp_path):
    w = torch.randn(5, 3)
    torch.save({"embed.weight": w, "head.weight": w}, tmp_path / "tied.pt")
    api.convert(
        api.ConvertRequest(src=tmp_path / "tied.pt", dst=tmp_path / "tied.safetensors", to="full")
    )
    flat = load_file(tmp_path / "tied.safetensors")
    assert torch.equal(flat["embed.weight"], w) and torch.equal(flat["head.weight"], w)


def test_detect_tells_formats_from_their_bytes(tmp_path):
    torch.save({"a": torch.ones(1)}, tmp_path / "weights")
    save_file({"a": torch.ones(1)}, tmp_path / "weights2")
    torch.distributed.checkpoint.save(
        {"a": torch.ones(1)}, checkpoint_id=tmp_path / "d", no_dist=True
    )
    assert (
        detect(tmp_path / "weights"),
        detect(tmp_path / "weights2"),
        detect(tmp_path / "d"),
    ) == ("torch", "safetensors", "dcp")
