"""`inspect`'s table fits 80 to 100 columns for HF/Llama names, paths whole (issue 35 item 8).

A 2-layer Llama with its AdamW state printed 158 columns: every row padded to the
longest optimizer-state path, then a 60-character value. A path longer than its column
is now printed whole on a line of its own, its cells on the next; values are shortened
to what is left; ``--json`` is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_export_jobs import tiny_llama
from torch.distributed.checkpoint.state_dict import get_state_dict

from shardckpt.api import Inspection
from shardckpt.cli import render
from shardckpt.cli.app import run
from shardckpt.formats.base import Index
from shardckpt.state.tree import TensorMeta, dotted, walk

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 2-layer Llama and its AdamW state after a step, as FSDP2 saves them with DCP."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 37, (1, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    root = tmp_path_factory.mktemp("llama") / "ckpt"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root, no_dist=True)
    return root, [name for name, _ in model.named_parameters()]


def table(text: str) -> list[str]:
    """Return the table's lines: from the header to the first blank line."""
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("PATH ")))
    return lines[start : lines.index("", start)]


def inspect_out(capsys, *argv) -> str:
    assert run(["inspect", *map(str, argv)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


@pytest.mark.parametrize(("columns", "width"), [(None, 100), ("200", 100), ("80", 80), ("90", 90)])
def test_a_llama_table_fits_the_width_with_every_path_whole(
    capsys, monkeypatch, llama, columns, width
):
    llama, _ = llama
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    rows = table(inspect_out(capsys, llama))
    doc = json.loads(inspect_out(capsys, llama, "--json"))
    assert max(len(line) for line in rows) <= width
    paths = [dotted(tuple(e["path"])) for e in doc["entries"]]
    assert "optim.state.model.layers.1.post_attention_layernorm.weight.exp_avg_sq" in paths
    # Each path starts a line, whole, in order; a wrapped one's cells follow on the next.
    starts = [line.split()[0] for line in rows[1:] if not line.startswith(" ")]
    assert starts == paths
    for i, line in enumerate(rows[1:], 1):
        if line.startswith(" "):
            assert not rows[i - 1].startswith(" ")  # at most one line of cells per path
    tensors = [e for e in doc["entries"] if e["kind"] == "tensor"]
    assert sum(" float32 " in f" {line} " for line in rows) == len(tensors)


def test_json_is_as_it_was(capsys, llama):
    """--json holds every value whole: the text table's shortening never reaches it."""
    llama, names = llama
    doc = json.loads(inspect_out(capsys, llama, "--json"))
    params = next(e for e in doc["entries"] if e["path"] == ["optim", "param_groups", 0, "params"])
    assert params["value"] == names
    assert set(doc) >= {"schema", "format", "world_size", "entries", "optimizers", "totals"}


def _llama_7b_index() -> Index:
    """Llama-7B's names and shapes, bf16, as FSDP2 at 8 ranks shards them (metadata only)."""
    model: dict = {"model.embed_tokens.weight": (32000, 4096)}
    for i in (0, 31):
        for name, shape in [
            ("self_attn.q_proj.weight", (4096, 4096)),
            ("mlp.gate_proj.weight", (11008, 4096)),
            ("post_attention_layernorm.weight", (4096,)),
        ]:
            model[f"model.layers.{i}.{name}"] = shape
    model["lm_head.weight"] = (32000, 4096)
    meta = {
        k: TensorMeta(k, shape, torch.bfloat16, "Shard(0) over 8") for k, shape in model.items()
    }
    state = {
        k: {"step": TensorMeta(k, (), torch.float32), "exp_avg": m, "exp_avg_sq": m}
        for k, m in meta.items()
    }
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(model)}]
    tree = {"model": meta, "optim": {"state": state, "param_groups": groups}, "step": 1000}
    return Index(format="dcp", src="ckpt", world_size=8, tree=tree)


@pytest.mark.parametrize("width", [80, 100])
@pytest.mark.parametrize("shards", [False, True])
def test_llama_7b_shapes_and_sizes_fit_too(width, shards):
    index = _llama_7b_index()
    insp = Inspection(index=index, leaves=list(walk(index.tree)), optimizers=[])
    rows = table(render.inspection_text(insp, shards, width))
    assert max(len(line) for line in rows) <= width, "\n".join(rows)
    words = " ".join(rows).split()
    for path, _ in walk(index.tree):
        assert dotted(path) in words


@pytest.mark.parametrize("columns", ["80", "100"])
def test_a_long_layout_wraps_within_its_column(capsys, monkeypatch, columns):
    """Megatron's layouts ('2 stacked layers, each split in 2 on dim 1') run long: they wrap
    in the last column, under themselves, rather than narrow the path column for all."""
    monkeypatch.setenv("COLUMNS", columns)
    golden = Path(__file__).parents[1] / "goldens" / "megatron" / "gpt-tp2"
    rows = table(inspect_out(capsys, golden))
    assert max(len(line) for line in rows) <= int(columns)
    at = rows[0].index("LAYOUT / VALUE")
    start = next(
        i for i, line in enumerate(rows) if line.startswith("decoder.layers.mlp.linear_fc1.weight")
    )
    cells = rows[start] if rows[start].split()[1:] else rows[start + 1]
    end = rows.index(cells) + 1
    while end < len(rows) and rows[end][:at].strip() == "" and rows[end][at:].strip():
        end += 1  # the layout's further lines
    layout = " ".join(line[at:].strip() for line in rows[rows.index(cells) : end])
    assert layout == "2 stacked layers, each split in 2 on dim 1"
    if columns == "100":  # room for the paths that fit beside their cells
        assert rows[1].split()[:2] == ["embedding.word_embeddings.weight", "64x16"]
