"""An HF Trainer fine-tuning run with DeepSpeed (goldens: transformers 5.23.0, accelerate 1.15.0,
deepspeed 0.19.8; a tiny Llama with tied embeddings, ZeRO-2 and ZeRO-3 at 2 ranks): its
``checkpoint-N/`` is read as the DeepSpeed save it holds, and exported as a Hugging Face
directory that ``from_pretrained`` loads with ``zero_to_fp32.py``'s weights."""

from __future__ import annotations

import pytest
import torch
from deepspeed_goldens import MOMENTS, bits_equal, run_dir, universal_states, zero_to_fp32

from shardckpt import api
from shardckpt.formats import detect

pytestmark = pytest.mark.trainers
transformers = pytest.importorskip("transformers")

RUNS = ["hf-z2-bf16", "hf-z3-bf16"]


def test_the_goldens_are_trainer_checkpoints():
    for name in RUNS:
        names = {p.name for p in run_dir(name).iterdir()}
        assert {"latest", "global_step3", "config.json", "trainer_state.json"} <= names


@pytest.mark.parametrize("name", RUNS)
def test_the_trainers_checkpoint_is_the_deepspeed_save_it_holds(tmp_path, name):
    assert detect(run_dir(name)) == "deepspeed"
    api.convert(
        api.ConvertRequest(src=run_dir(name), dst=tmp_path / "full.pt", to="full", verify=True)
    )
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    reference = zero_to_fp32(name)
    assert set(full["model"]) == set(reference)
    assert all(bits_equal(full["model"][k], v) for k, v in reference.items())
    # Tied: the head is the embedding, under its own name.
    assert bits_equal(full["model"]["lm_head.weight"], full["model"]["model.embed_tokens.weight"])
    shapes = {k: v.shape for k, v in reference.items() if k != "lm_head.weight"}
    files = universal_states(name, shapes)
    assert set(full["optim"]["state"]) == set(shapes)
    for fqn, state in full["optim"]["state"].items():
        assert all(bits_equal(state[m], files[fqn][m]) for m in MOMENTS), fqn


@pytest.mark.parametrize("name", RUNS)
def test_an_hf_export_loads_with_from_pretrained(tmp_path, name, capsys):
    api.convert(api.ConvertRequest(src=run_dir(name), dst=tmp_path / "hf", to="full", format="hf"))
    # The Trainer keeps config.json beside DeepSpeed's files: the export copies it.
    assert f"copying config.json and 1 other file from '{run_dir(name)}'" in capsys.readouterr().err
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    loaded = model.state_dict()
    reference = zero_to_fp32(name)
    assert set(loaded) == set(reference)
    assert all(bits_equal(loaded[k], v) for k, v in reference.items())
