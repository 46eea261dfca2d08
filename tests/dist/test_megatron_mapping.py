"""``--map megatron_gpt``: a Llama-style megatron-core GPT to a Hugging Face model and back, against both libraries.

megatron-core saves the model (GQA, SwiGLU, RMSNorm, RoPE, local spec, CPU) with
``dist_checkpointing.save`` and runs its forward, in its own process
(``tests/megatron_gpt_jobs.py``); shardckpt exports it; transformers'
``from_pretrained`` loads the export and its logits are compared with Megatron's. The
way back is loaded by ``dist_checkpointing.load`` into the same Megatron model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardckpt.cli import run

pytestmark = pytest.mark.trainers
for _needed in ("megatron.core", "psutil", "transformers"):
    if importlib.util.find_spec(_needed) is None:
        pytest.skip(f"could not find '{_needed}'", allow_module_level=True)

JOBS = Path(__file__).resolve().parents[1] / "megatron_gpt_jobs.py"
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 16,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}


def _job(*argv) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(JOBS), *map(str, argv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    _job(root)
    (root / "config").mkdir()
    (root / "config" / "config.json").write_text(json.dumps(CONFIG))
    return root


@pytest.mark.timeout(300)
def test_megatron_gpt_to_hf_loads_with_from_pretrained_and_its_logits_match_megatrons(
    megatron, tmp_path, capsys
):
    """fp32 on CPU, both rotating halves (Megatron's rotate_half and transformers'): the
    same arithmetic in another order; 1e-5 on logits of size ~2 (seen: 2e-6)."""
    argv = ["convert", megatron / "ckpt", tmp_path / "hf", "--to", "full", "--format", "hf",
            "--hf-config", megatron / "config", "--json"]  # fmt: skip
    assert run([str(a) for a in argv]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["mapping"]["name"], doc["mapping"]["in"]["tensors"]) == ("megatron_gpt", 9)
    assert doc["mapping"]["in"]["bytes"] == doc["mapping"]["out"]["bytes"]
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    theirs = torch.load(megatron / "logits.pt", weights_only=True)
    with torch.no_grad():
        ours = model(theirs["tokens"]).logits
    assert theirs["logits"].abs().max() > 0.5
    torch.testing.assert_close(ours, theirs["logits"], atol=1e-5, rtol=1e-5)

    back = tmp_path / "torch_dist"
    argv = ["convert", tmp_path / "hf", back, "--to", "sharded", "--format", "megatron",
            "--world-size", "2", "--map", "megatron_gpt", "-q"]  # fmt: skip
    assert run([str(a) for a in argv]) == 0
    _job(tmp_path, back)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    saved = theirs["weights"]
    assert sorted(loaded) == sorted(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_a_megatron_layer_more_than_the_config_is_exit_3_naming_it(megatron, tmp_path, capsys):
    config = tmp_path / "one-layer"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 1}))
    argv = ["convert", megatron / "ckpt", tmp_path / "hf", "--to", "full", "--format", "hf",
            "--hf-config", config]  # fmt: skip
    assert run([str(a) for a in argv]) == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"shardckpt: error: '{megatron / 'ckpt'}': "
        "'decoder.layers.self_attention.linear_qkv.layer_norm_weight' holds 2 layers on dim 0, "
        "and the config says 1: pass the config of this model (--hf-config)"
    )
    assert sorted(os.listdir(tmp_path)) == ["one-layer"]
