"""A ``config.json`` out of proportion with SRC (issue 24 item 6): the model built to check DST's
names is never larger than DST could match, so a config claiming 200,000 layers is refused
in seconds, naming config.json and the count, instead of building for hours."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_export_jobs import tiny_llama

from shardckpt.cli.app import run
from shardckpt.formats.hf.config import build_limit

pytestmark = pytest.mark.trainers
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TENSORS = 21  # tiny_llama: 2 layers of 9 weights, embeddings, norm, tied lm_head
LIMIT = build_limit(TENSORS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Return (its model directory, a flat torch.save of its weights) for a tiny Llama."""
    root = tmp_path_factory.mktemp("llama")
    model = tiny_llama()
    model.save_pretrained(root / "base")
    torch.save(model.state_dict(), root / "weights.pt")
    assert len(model.state_dict()) == TENSORS
    return root / "base", root / "weights.pt"


def hostile_config(base, path, **changes) -> dict:
    """Write ``base``'s config.json with ``changes`` (None removes a key) into directory ``path``."""
    config = json.loads((base / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return config


def export(capsys, src, dst, *options) -> tuple[int, str, float]:
    """Return the exit code, last stderr line and wall seconds of an hf export of ``src``."""
    start = time.monotonic()
    code = run(["convert", str(src), str(dst), "--to", "full", "--format", "hf", *options])
    seconds = time.monotonic() - start
    lines = capsys.readouterr().err.strip().splitlines()
    return code, lines[-1] if lines else "", seconds


def refusal(config_dir, claim: str) -> str:
    """Return the one line an explicit --hf-config out of proportion is refused with."""
    return (
        f"shardckpt: error: '{config_dir / 'config.json'}': {claim}: a model that large is not "
        f"built to check DST's {TENSORS} tensors (at most {LIMIT} weights): pass --hf-config "
        "the directory of the model these weights belong to"
    )


@pytest.mark.parametrize(
    "changes, claim",
    [
        # The example: transformers builds 200,000 Llama layers on the meta device.
        ({"num_hidden_layers": 200_000}, "num_hidden_layers is 200000"),
        # GPT-2's name for the count, under an architecture with it.
        (
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 10**9},
            "n_layer is 1000000000",
        ),
        # Qwen2's config itself makes a list entry per layer when layer_types is absent.
        (
            {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "layer_types": None,
             "num_hidden_layers": 10**9},
            "num_hidden_layers is 1000000000",
        ),
        # A count inside a sub-config is a count too.
        ({"text_config": {"num_hidden_layers": 10**12}}, "num_hidden_layers is 1000000000000"),
        # transformers' PretrainedConfig makes a dict entry per label.
        (
            {"num_labels": 10**12},
            "num_labels is 1000000000000, more than the 592 elements of DST's largest tensor",
        ),
    ],
)  # fmt: skip
def test_a_config_claiming_counts_out_of_proportion_is_refused_before_transformers_reads_it(
    llama, tmp_path, capsys, changes, claim
):
    base, weights = llama
    hostile_config(base, tmp_path / "cfg", **changes)
    out = tmp_path / "hf"
    code, line, seconds = export(capsys, weights, out, "--hf-config", tmp_path / "cfg")
    assert (code, line) == (3, refusal(tmp_path / "cfg", claim))
    assert seconds < 30
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "cfg"]


def test_a_model_that_outgrows_the_limit_while_built_is_refused_there(llama, tmp_path, capsys):
    base, weights = llama
    # 900 layers is a count under the limit, but 9 weights each is far over it.
    hostile_config(base, tmp_path / "cfg", num_hidden_layers=900)
    out = tmp_path / "hf"
    code, line, seconds = export(capsys, weights, out, "--hf-config", tmp_path / "cfg")
    claim = "the LlamaForCausalLM model it describes has more weights than DST"
    assert (code, line) == (3, refusal(tmp_path / "cfg", claim))
    assert seconds < 30
    assert not out.exists()


def test_the_models_own_config_is_built_under_the_limit_and_copied(llama, tmp_path, capsys):
    base, weights = llama
    code, line, _ = export(capsys, weights, tmp_path / "hf", "--hf-config", base, "-q")
    assert (code, line) == (
        0,
        f"shardckpt: note: leaving 'lm_head.weight' out of DST: '{base / 'config.json'}' ties "
        "it to 'model.embed_tokens.weight', as save_pretrained does",
    )
    assert (tmp_path / "hf" / "config.json").read_bytes() == (base / "config.json").read_bytes()


def test_a_config_in_src_out_of_proportion_is_left_out_with_a_note(llama, tmp_path, capsys):
    # Only a config inside a directory SRC is picked up by itself (one beside SRC is not).
    base, weights = llama
    ckpt = tmp_path / "checkpoint-9"
    dcp.save(torch.load(weights, weights_only=True), checkpoint_id=ckpt, no_dist=True)
    hostile_config(base, ckpt, num_hidden_layers=200_000)
    out = tmp_path / "hf"
    code, line, seconds = export(capsys, ckpt, out, "-q")
    assert (code, line) == (
        0,
        f"shardckpt: note: '{ckpt.resolve() / 'config.json'}': num_hidden_layers is 200000: a "
        f"model that large is not built to check DST's {TENSORS} tensors (at most {LIMIT} "
        "weights): not copying it (pass --hf-config DIR)",
    )
    assert seconds < 30
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
