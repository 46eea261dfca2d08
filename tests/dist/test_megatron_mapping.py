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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

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


MOE_CONFIG = {
    **CONFIG,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def _job(*argv, experts: int = 0, tied: bool = False, qkv_bias: bool = False) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MEGATRON_EXPERTS": str(experts),
        "MEGATRON_TIED": str(int(tied)),
        "MEGATRON_QKV_BIAS": str(int(qkv_bias)),
    }
    done = subprocess.run(
        [sys.executable, str(JOBS), *map(str, argv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _saved(root: Path, config: dict, experts=0, tied=False, qkv_bias=False) -> Path:
    root.mkdir(exist_ok=True)  # the job's file store lies in it
    _job(root, experts=experts, tied=tied, qkv_bias=qkv_bias)
    (root / "config").mkdir()
    (root / "config" / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("megatron"), CONFIG)


def _logits_match(root: Path, hf: Path) -> dict:
    """Load ``hf`` with ``from_pretrained`` (no key missing or unexpected); check its logits are Megatron's; return Megatron's."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    theirs = torch.load(root / "logits.pt", weights_only=True)
    with torch.no_grad():
        ours = model(theirs["tokens"]).logits
    assert theirs["logits"].abs().max() > 0.5
    torch.testing.assert_close(ours, theirs["logits"], atol=1e-5, rtol=1e-5)
    return theirs


def _from_common_pt(root: Path, dst: Path, capsys, name: str, config: dict) -> None:
    """Export ``root/ckpt`` with no --hf-config: the mapping and DST's config.json come from common.pt's args."""
    argv = ["convert", root / "ckpt", dst, "--to", "full", "--format", "hf", "--json"]
    assert run([str(a) for a in argv]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["mapping"]["name"] == name
    assert (
        f"shardckpt: note: writing config.json ({config['architectures'][0]}) from the model "
        f"arguments in '{root / 'ckpt' / 'common.pt'}' (pass --hf-config DIR for another)"
    ) in err.splitlines()
    written = json.loads((dst / "config.json").read_text())
    assert {k: written[k] for k in config} == config
    assert sorted(os.listdir(dst)) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    _logits_match(root, dst)


def _exported_and_back(root: Path, tmp_path: Path, capsys, name: str, tensors: int, experts=0):
    """Export ``root/ckpt`` to hf, compare its logits with Megatron's, map it back and load it into Megatron."""
    argv = ["convert", root / "ckpt", tmp_path / "hf", "--to", "full", "--format", "hf",
            "--hf-config", root / "config", "--json"]  # fmt: skip
    assert run([str(a) for a in argv]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["mapping"]["name"], doc["mapping"]["in"]["tensors"]) == (name, tensors)
    assert doc["mapping"]["in"]["bytes"] == doc["mapping"]["out"]["bytes"]
    theirs = _logits_match(root, tmp_path / "hf")
    _back_loads_into_megatron(theirs, tmp_path, capsys, name, experts)


def _back_loads_into_megatron(
    theirs: dict, tmp_path: Path, capsys, name: str, experts=0, tied=False, qkv_bias=False
):
    """Map ``tmp_path/hf`` back to torch_dist at 2; load it into the Megatron model; check its weights are ``theirs``."""
    back = tmp_path / "torch_dist"
    argv = ["convert", tmp_path / "hf", back, "--to", "sharded", "--format", "megatron",
            "--world-size", "2", "--map", name, "--json"]  # fmt: skip
    assert run([str(a) for a in argv]) == 0
    out, err = capsys.readouterr()
    # A tied model's lm_head.weight is its embedding, given back by the reader: left out, counted.
    assert json.loads(out)["mapping"]["dropped"]["names"] == (["lm_head.weight"] if tied else [])
    assert ("leaving SRC's 'lm_head.weight' out" in err) is tied
    _job(tmp_path, back, experts=experts, tied=tied, qkv_bias=qkv_bias)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    saved = theirs["weights"]
    assert sorted(loaded) == sorted(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.timeout(300)
def test_megatron_gpt_to_hf_loads_with_from_pretrained_and_its_logits_match_megatrons(
    megatron, tmp_path, capsys
):
    """fp32 on CPU, both rotating halves (Megatron's rotate_half and transformers'): the
    same arithmetic in another order; 1e-5 on logits of size ~2 (seen: 2e-6)."""
    _exported_and_back(megatron, tmp_path, capsys, "megatron_gpt", 9)


@pytest.mark.timeout(300)
def test_megatron_gpt_to_hf_without_a_config_takes_its_sizes_from_common_pts_args(
    megatron, tmp_path, capsys
):
    """Megatron-LM saves its arguments (``args``) in common.pt: they size the mapping and
    make DST's config.json, which ``from_pretrained`` loads alone (logits within 1e-5)."""
    _from_common_pt(megatron, tmp_path / "hf", capsys, "megatron_gpt", CONFIG)


@pytest.mark.timeout(300)
def test_common_pt_args_of_a_megatron_lm_before_core_v0_16_are_read_by_their_older_names(
    megatron, tmp_path, capsys
):
    """Before core_v0.16 Megatron-LM saved the norm's epsilon as ``norm_epsilon`` and
    ``--apply-layernorm-1p`` as ``apply_layernorm_1p`` (``layernorm_epsilon`` and
    ``layernorm_zero_centered_gamma`` since): either names the same model."""
    older = {"norm_epsilon": 1e-6, "apply_layernorm_1p": False}
    ckpt = _with_args(
        megatron, tmp_path, layernorm_epsilon=None, layernorm_zero_centered_gamma=None, **older
    )
    argv = ["convert", ckpt, tmp_path / "hf", "--to", "full", "--format", "hf"]
    assert run([str(a) for a in argv]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rms_norm_eps"] == 1e-6
    bent = _with_args(megatron, tmp_path / "bent", layernorm_epsilon=None,
                      layernorm_zero_centered_gamma=None, norm_epsilon=1e-5,
                      apply_layernorm_1p=True)  # fmt: skip
    capsys.readouterr()
    assert run([str(a) for a in ["convert", bent, tmp_path / "hf2", *argv[3:]]]) == 3
    assert "its args say layernorm_zero_centered_gamma=True" in capsys.readouterr().err


def _with_args(megatron: Path, tmp_path: Path, **changes) -> Path:
    """Return a copy of ``megatron/ckpt`` whose common.pt holds args changed by ``changes`` (None: deleted)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(megatron / "ckpt", ckpt)
    common = torch.load(ckpt / "common.pt", weights_only=False)  # written by this test's job
    for field, value in changes.items():
        if value is None:
            delattr(common["args"], field)
        else:
            setattr(common["args"], field, value)
    torch.save(common, ckpt / "common.pt")
    return ckpt


@pytest.mark.parametrize(
    "changes, what",
    [
        (
            {"layernorm_epsilon": None, "num_query_groups": None},
            "its args lack 'layernorm_epsilon', 'num_query_groups', which the model's config.json "
            "needs",
        ),
        (
            {"normalization": "LayerNorm"},
            "its args say normalization='LayerNorm', and the Llama, Qwen 2 and Mixtral models the "
            "Megatron mappings write need normalization='RMSNorm' (the norms are RMSNorm)",
        ),
        (
            {"moe_shared_expert_intermediate_size": 64},
            "its args say moe_shared_expert_intermediate_size=64, and the Llama, Qwen 2 and "
            "Mixtral models the Megatron mappings write need "
            "moe_shared_expert_intermediate_size=None (no shared experts)",
        ),
        (
            {"padded_vocab_size": 256},
            "its args say padded_vocab_size=256, hidden_size=64, and SRC's "
            "'embedding.word_embeddings.weight' is 128x64: they describe another model",
        ),
    ],
    ids=["fields-missing", "layernorm", "shared-experts", "another-vocabulary"],
)
def test_common_pt_args_that_cannot_say_the_config_are_exit_3_naming_what(
    megatron, tmp_path, capsys, changes, what
):
    ckpt = _with_args(megatron, tmp_path, **changes)
    argv = ["convert", ckpt, tmp_path / "hf", "--to", "full", "--format", "hf"]
    assert run([str(a) for a in argv]) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"shardckpt: error: '{ckpt / 'common.pt'}': {what}: pass --hf-config DIR, the directory "
        "of the model's config.json, or --format safetensors to keep Megatron's names"
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.timeout(300)
def test_megatron_moe_gpt_to_mixtral_logits_match_megatrons_and_come_back(tmp_path, capsys):
    """Four experts, top-2 routing over softmax scores, as Mixtral routes (seen: 1.4e-6)."""
    root = _saved(tmp_path / "megatron-moe", MOE_CONFIG, experts=4)
    _exported_and_back(root, tmp_path, capsys, "megatron_moe", 10, experts=4)
    _from_common_pt(root, tmp_path / "from-args", capsys, "megatron_moe", MOE_CONFIG)
    # One expert more than the config says: exit 3 naming the tensor and its expert axis.
    _refused_under(
        root, {**MOE_CONFIG, "num_local_experts": 3}, tmp_path / "three", capsys,
        "'decoder.layers.mlp.experts.experts.linear_fc1.weight' holds 4 experts on dim 1, and "
        "the config says 3: pass the config of this model (--hf-config)",
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_a_qwen2_style_megatron_gpt_with_a_qkv_bias_maps_to_qwen2_and_back(tmp_path, capsys):
    """add_qkv_bias: the fused QKV bias splits per query group as its weight's rows; the
    args make a Qwen2ForCausalLM config.json, from_pretrained loads DST alone (logits
    within 1e-5, as the Llama-style GPT), and back, the same Megatron model loads it."""
    qwen2 = {**CONFIG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    root = _saved(tmp_path / "qwen2", qwen2, qkv_bias=True)
    _from_common_pt(root, tmp_path / "hf", capsys, "megatron_qwen2", qwen2)
    theirs = torch.load(root / "logits.pt", weights_only=True)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in theirs["weights"]
    _back_loads_into_megatron(theirs, tmp_path, capsys, "megatron_qwen2", qkv_bias=True)


def _refused_under(root: Path, config: dict, dst: Path, capsys, what: str) -> None:
    """Check that exporting ``root/ckpt`` under ``config`` is exit 3 saying ``what`` of SRC, and leaves no ``dst``."""
    (root / "config" / "config.json").write_text(json.dumps(config))
    argv = ["convert", root / "ckpt", dst, "--to", "full", "--format", "hf",
            "--hf-config", root / "config"]  # fmt: skip
    assert run([str(a) for a in argv]) == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"shardckpt: error: '{root / 'ckpt'}': {what}"
    assert not dst.exists()


@pytest.mark.timeout(300)
def test_a_tied_megatron_gpt_maps_to_tied_embeddings_and_back(tmp_path, capsys):
    """share_embeddings_and_output_weights: Megatron stores no output layer, its args say
    untie_embeddings_and_output_weights=False, DST's config.json says tie_word_embeddings
    and holds no lm_head.weight, as save_pretrained writes a tied model; from_pretrained
    ties it to the embedding (logits within 1e-5), and back, the tied Megatron model
    loads it with equal weights. The same SRC under a config that does not tie is exit 3."""
    tied = {**CONFIG, "tie_word_embeddings": True}
    root = _saved(tmp_path / "tied", tied, tied=True)
    _from_common_pt(root, tmp_path / "hf", capsys, "megatron_gpt", tied)
    with safe_open(tmp_path / "hf" / "model-00001-of-00001.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    theirs = torch.load(root / "logits.pt", weights_only=True)
    assert "output_layer.weight" not in theirs["weights"]
    _back_loads_into_megatron(theirs, tmp_path, capsys, "megatron_gpt", tied=True)

    _refused_under(
        root, CONFIG, tmp_path / "untied", capsys,
        "lacks 1 tensor the mapping 'megatron_gpt' expects at its config's sizes, e.g. "
        "'output_layer.weight': pass the config of this model (--hf-config), or --map the "
        "mapping of its architecture",
    )  # fmt: skip


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
