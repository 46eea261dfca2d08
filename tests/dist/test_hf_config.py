"""``--hf-config`` (issue 11 item 3): an ``hf`` export of an FSDP2 training checkpoint that
``from_pretrained`` loads, with no missing or unexpected key and bit-identical logits.

The model is a tiny Llama the test builds (no download); two gloo ranks shard it with
FSDP2 and save it with ``dcp.save({"model": get_model_state_dict(model)})``, in the
``pytorch_model_fsdp_0`` directory of a transformers ``Trainer``-like checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil

import hf_export_jobs
import pytest
import torch
from harness import run_ranks

from shardckpt.cli.app import run

pytestmark = pytest.mark.trainers
# No download: the model is built here, and every load names a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
INPUT = torch.tensor([[1, 5, 7, 3, 30, 2, 0]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Return (model directory, Trainer-like checkpoint directory, the model's logits)."""
    root = tmp_path_factory.mktemp("llama")
    model = hf_export_jobs.tiny_llama().eval()
    model.save_pretrained(root / "base")  # config.json, generation_config.json, weights
    with torch.no_grad():
        logits = model(INPUT).logits
    ckpt = root / "checkpoint-2"
    ckpt.mkdir()
    run_ranks(
        hf_export_jobs.save_fsdp2_dcp, 2, str(root / "base"), str(ckpt / "pytorch_model_fsdp_0")
    )
    for name in ("config.json", "generation_config.json"):
        shutil.copy(root / "base" / name, ckpt / name)
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")  # flat, tied weights shared
    (ckpt / "optimizer.pt").write_bytes(b"not copied")
    (ckpt / "trainer_state.json").write_text("{}")
    return root / "base", ckpt, logits


def loads_identically(out, logits) -> bool:
    """Return whether ``from_pretrained(out)`` has every weight and gives ``logits`` exactly."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, local_files_only=True
    )
    assert {k: sorted(v) for k, v in info.items() if k != "error_msgs"} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
    }
    with torch.no_grad():
        return torch.equal(model.eval()(INPUT).logits, logits)


def test_an_export_with_hf_config_loads_with_from_pretrained_bit_identically(saved, tmp_path):
    base, ckpt, logits = saved
    out = tmp_path / "hf"
    argv = ["convert", str(ckpt / "pytorch_model_fsdp_0"), str(out), "--to", "full"]
    assert run([*argv, "--format", "hf", "--hf-config", str(base), "-q"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embed_tokens.weight" in names  # the {"model": ...} nesting is not a prefix
    assert loads_identically(out, logits)


def test_the_trainer_checkpoints_config_beside_src_is_named_in_a_note_and_used_when_passed(
    saved, tmp_path, capsys
):
    # The directory SRC sits in may be a shared download folder: its config is used only
    # when named.
    _, ckpt, logits = saved
    argv = ["convert", str(ckpt / "pytorch_model_fsdp_0"), str(tmp_path / "bare"), "--to", "full"]
    assert run([*argv, "--format", "hf", "-q"]) == 0
    assert capsys.readouterr().err.strip() == (
        f"shardckpt: note: not copying config.json from '{ckpt.resolve()}', the directory SRC "
        f"is in: pass --hf-config '{ckpt.resolve()}' if it is this model's"
    )
    assert not (tmp_path / "bare" / "config.json").exists()
    out = tmp_path / "hf"
    argv = ["convert", str(ckpt / "pytorch_model_fsdp_0"), str(out), "--to", "full"]
    assert run([*argv, "--format", "hf", "--hf-config", str(ckpt), "-q"]) == 0
    assert not (out / "optimizer.pt").exists() and not (out / "trainer_state.json").exists()
    assert loads_identically(out, logits)


def test_a_flat_state_dict_beside_its_config_exports_the_same_names(saved, tmp_path):
    _, ckpt, logits = saved
    out = tmp_path / "hf"
    assert run(["convert", str(ckpt / "pytorch_model.bin"), str(out), "--to", "full"]
               + ["--format", "hf", "--hf-config", str(ckpt), "-q"]) == 0  # fmt: skip
    assert loads_identically(out, logits)


def test_names_the_configs_model_lacks_are_refused_with_the_rename_that_fits(
    saved, tmp_path, capsys
):
    base, ckpt, _ = saved
    argv = ["convert", str(ckpt / "pytorch_model_fsdp_0"), str(tmp_path / "hf"), "--to", "full"]
    argv += ["--format", "hf", "--hf-config", str(base), "--rename", r"^model\.="]
    assert run(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"shardckpt: error: '{base}': --hf-config: the LlamaForCausalLM model of "
        f"'{base / 'config.json'}' has 20 weights DST would lack, e.g. "
        "'model.embed_tokens.weight': add the prefix with --rename '^=model.'"
    )
    assert not (tmp_path / "hf").exists()


def test_a_found_config_that_does_not_fit_is_left_out_with_a_note(saved, tmp_path, capsys):
    _, ckpt, _ = saved
    src = tmp_path / "with-config"  # a DCP directory holding its config.json
    shutil.copytree(ckpt / "pytorch_model_fsdp_0", src)
    shutil.copy(ckpt / "config.json", src / "config.json")
    out = tmp_path / "hf"
    argv = ["convert", str(src), str(out), "--to", "full"]
    assert run([*argv, "--format", "hf", "--rename", r"^model\.=", "-q"]) == 0
    assert capsys.readouterr().err.strip() == (
        f"shardckpt: note: the LlamaForCausalLM model of '{src / 'config.json'}' "
        "has 20 weights DST would lack, e.g. 'model.embed_tokens.weight': not copying it (add "
        "the prefix with --rename '^=model.', or pass --hf-config DIR)"
    )
    assert not (out / "config.json").exists()
