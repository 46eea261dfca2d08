"""What ``save_pretrained`` writes, read as an ``hf`` source (issue 35 items 1, 2, 3, 5).

transformers 5 writes one ``model.safetensors`` and no index for a model under 50 GB,
shards and an index with ``max_shard_size``; a tied model's ``lm_head.weight`` is left
out of both. Each is read as the model holds it: ``inspect``, ``diff``, ``verify``,
and a ``--to sharded`` DCP that FSDP2 at 2 gloo ranks ``dcp.load``s with the default
(strict) planner, equal to the model. An export's ``config.json`` says the dtype of the
weights written, and a config without ``architectures`` is checked by ``model_type``.
"""

from __future__ import annotations

import json
import os
import shutil

import hf_export_jobs
import pytest
import torch
from harness import run_ranks
from reference import assert_trees_equal
from safetensors.torch import load_file, save_file

from shardckpt.cli.app import run

pytestmark = pytest.mark.trainers
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VARIANTS = [
    pytest.param(
        tied, shards, id=f"{'tied' if tied else 'untied'}-{'shards' if shards else 'one-file'}"
    )
    for tied in (True, False)
    for shards in (False, True)
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """Return {(tied, shards): (directory save_pretrained wrote, the model's state dict)}."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for tied in (True, False):
        model = hf_export_jobs.tiny_llama(tied)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for shards in (False, True):
            path = root / f"{tied}-{shards}"
            model.save_pretrained(path, **({"max_shard_size": "4KB"} if shards else {}))
            out[tied, shards] = path, state
    return out


def cli(capsys, *argv) -> tuple[int, str, str]:
    """Return the exit code, stdout and stderr of ``shardckpt argv``."""
    code = run([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def written_names(path) -> set[str]:
    """Return the tensor names in the safetensors files of ``path``, read by safetensors itself."""
    return {name for f in path.glob("*.safetensors") for name in load_file(f)}


def loads_into_fsdp2(dcp_dir, tied: bool) -> dict:
    """Return the full state of the Llama FSDP2 loads from ``dcp_dir`` at 2 ranks (strict)."""
    return run_ranks(hf_export_jobs.load_dcp_into_fsdp2_llama, 2, str(dcp_dir), tied)[0]


@pytest.mark.parametrize(("tied", "shards"), VARIANTS)
def test_save_pretrained_output_converts_to_a_dcp_fsdp2_loads_equal_to_the_model(
    pretrained, tmp_path, capsys, tied, shards
):
    src, state = pretrained[tied, shards]
    assert (src / "model.safetensors").exists() is not shards  # transformers' own layout
    assert ("lm_head.weight" in written_names(src)) is not tied  # save_pretrained left it out
    code, out, err = cli(capsys, "inspect", src)
    assert (code, err) == (0, "")
    assert "hf" in out.splitlines()[0] and "model.lm_head.weight" in out
    told = (
        "model.lm_head.weight: not in the files (save_pretrained leaves it out): read as "
        "model.model.embed_tokens.weight, which it is tied to"
    )
    assert (told in out) is tied
    from_hf = ["--from", "hf"] if shards else []  # detected, and named
    dst = tmp_path / "init"
    argv = ["convert", src, dst, "--to", "sharded", "--world-size", 2, *from_hf, "--verify", "-q"]
    assert cli(capsys, *argv) == (0, "", "")
    assert_trees_equal(loads_into_fsdp2(dst, tied), state)
    assert cli(capsys, "diff", src, dst, "-q")[0] == 0
    assert cli(capsys, "verify", src, "-q")[0] == 0


def test_tied_weights_come_back_from_model_without_a_config(pretrained, tmp_path, capsys):
    src, state = pretrained[True, False]
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(src / "model.safetensors", bare / "model.safetensors")
    dst = tmp_path / "init"
    argv = ["convert", bare, dst, "--to", "sharded", "--world-size", 2, "-q"]
    # Nothing tells a bare file's ties but --model: the DCP lacks what FSDP2 asks for.
    assert cli(capsys, *argv) == (0, "", "")
    with pytest.raises(
        Exception, match="Missing key in checkpoint state_dict: model.lm_head.weight"
    ):
        loads_into_fsdp2(dst, True)
    shutil.rmtree(dst)
    assert cli(capsys, *argv, "--model", "hf_export_jobs:tiny_llama") == (0, "", "")
    assert_trees_equal(loads_into_fsdp2(dst, True), state)
    # An untied model ties nothing: the file is read as it is.
    code, out, _ = cli(capsys, "inspect", bare)
    assert code == 0 and "lm_head" not in out


def test_a_directory_with_no_weights_names_both_files_from_pretrained_reads(tmp_path, capsys):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    dst = tmp_path / "out"
    code, _, err = cli(
        capsys, "convert", src, dst, "--to", "sharded", "--world-size", 2, "--from", "hf"
    )
    assert code == 3
    assert err.splitlines()[-1] == (
        f"shardckpt: error: '{src}': no 'model.safetensors' or 'model.safetensors.index.json' in "
        "this directory: pass the directory save_pretrained wrote, or --from for another format"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_damaged_model_safetensors_is_refused_naming_it(pretrained, tmp_path, capsys):
    src = tmp_path / "model"
    shutil.copytree(pretrained[False, False][0], src)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, _, err = cli(
        capsys, "convert", src, tmp_path / "out", "--to", "sharded", "--world-size", 2
    )
    assert code == 3
    assert err.splitlines()[-1].startswith(
        f"shardckpt: error: '{src / 'model.safetensors'}': not a readable safetensors file"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_model_safetensors_beside_an_index_is_read_as_from_pretrained_reads_it(
    pretrained, tmp_path, capsys
):
    src = tmp_path / "model"
    shutil.copytree(pretrained[False, True][0], src)
    ones = {k: torch.ones_like(v) for k, v in pretrained[False, True][1].items()}
    save_file(ones, src / "model.safetensors", metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
    assert torch.equal(model.lm_head.weight, ones["lm_head.weight"])  # transformers' choice
    code, out, _ = cli(capsys, "inspect", src)
    assert code == 0 and out.rstrip().endswith(
        "reading model.safetensors, as from_pretrained does; model.safetensors.index.json and "
        "its shards beside it are not read"
    )
    dst = tmp_path / "init"
    assert cli(capsys, "convert", src, dst, "--to", "sharded", "--world-size", 2, "-q")[0] == 0
    assert_trees_equal(loads_into_fsdp2(dst, False), ones)


# ---------------------------------------------------------------- exports


@pytest.fixture(scope="module")
def fsdp2_dcp(pretrained, tmp_path_factory):
    """Return the tied model's FSDP2 DCP, saved at 2 ranks (it holds lm_head.weight)."""
    out = tmp_path_factory.mktemp("fsdp2") / "pytorch_model_fsdp_0"
    run_ranks(hf_export_jobs.save_fsdp2_dcp, 2, str(pretrained[True, False][0]), str(out))
    return out


def config_dir(src, path, **changes):
    """Write ``src``'s config.json with ``changes`` (None removes a key) into ``path``; return it."""
    config = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key, None)
        if value is not None:
            config[key] = value
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_an_fp32_export_under_a_bf16_config_loads_as_fp32_bit_for_bit(
    pretrained, fsdp2_dcp, tmp_path, capsys, key
):
    base, state = pretrained[True, False]
    hub = config_dir(base, tmp_path / "hub", **{"dtype": None, key: "bfloat16"})
    out = tmp_path / "hf"
    argv = ["convert", fsdp2_dcp, out, "--to", "full", "--format", "hf", "--hf-config", hub]
    code, _, err = cli(capsys, *argv, "--verify")
    assert code == 0
    assert err.splitlines() == [
        f"shardckpt: note: '{hub / 'config.json'}' says dtype bfloat16 but DST's weights are "
        "float32: writing float32 in DST's config.json, so from_pretrained loads them as written",
        "shardckpt: note: leaving 'lm_head.weight' out of DST: "
        f"'{hub / 'config.json'}' ties it to 'model.embed_tokens.weight', as save_pretrained does",
    ]
    assert json.loads((out / "config.json").read_text())[key] == "float32"
    assert written_names(out) == written_names(base)  # what save_pretrained writes
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, local_files_only=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_trees_equal(dict(model.state_dict()), state)


def test_a_bf16_export_under_a_float32_config_says_bfloat16(
    pretrained, fsdp2_dcp, tmp_path, capsys
):
    base, state = pretrained[True, False]
    out = tmp_path / "hf"
    argv = ["convert", fsdp2_dcp, out, "--to", "full", "--format", "hf", "--hf-config", base]
    code, _, err = cli(capsys, *argv, "--dtype", "bf16", "--verify")
    assert code == 0 and "writing bfloat16 in DST's config.json" in err
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.bfloat16
    assert_trees_equal(
        dict(model.state_dict()), {k: v.to(torch.bfloat16) for k, v in state.items()}
    )


def test_an_export_in_the_configs_dtype_copies_config_json_unchanged(
    pretrained, fsdp2_dcp, tmp_path, capsys
):
    base, _ = pretrained[True, False]
    out = tmp_path / "hf"
    argv = ["convert", fsdp2_dcp, out, "--to", "full", "--format", "hf", "--hf-config", base]
    code, _, err = cli(capsys, *argv)
    assert code == 0 and "dtype" not in err
    assert (out / "config.json").read_bytes() == (base / "config.json").read_bytes()


def test_a_config_without_architectures_checks_names_by_model_type(
    pretrained, fsdp2_dcp, tmp_path, capsys
):
    base, _ = pretrained[True, False]
    plain = config_dir(base, tmp_path / "plain", architectures=None)
    out = tmp_path / "hf"
    argv = ["convert", fsdp2_dcp, out, "--to", "full", "--format", "hf", "--hf-config", plain]
    code, _, err = cli(capsys, *argv, "--drop", "model.norm.weight")
    assert code == 2
    assert err.splitlines()[-1] == (
        f"shardckpt: error: '{plain}': --hf-config: the LlamaForCausalLM (model_type 'llama') "
        f"model of '{plain / 'config.json'}' has 1 weight DST would lack, e.g. "
        "'model.norm.weight': check that these weights belong to that model, or --rename them "
        "to its names"
    )
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["plain"]
    assert cli(capsys, *argv, "-q")[0] == 0  # every weight: the check passes by model_type
    assert transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


def test_a_config_whose_model_transformers_does_not_know_says_the_check_did_not_run(
    pretrained, fsdp2_dcp, tmp_path, capsys
):
    base, _ = pretrained[True, False]
    odd = config_dir(base, tmp_path / "odd", architectures=None, model_type="not-a-model")
    out = tmp_path / "hf"
    argv = ["convert", fsdp2_dcp, out, "--to", "full", "--format", "hf", "--hf-config", odd]
    code, _, err = cli(capsys, *argv, "--drop", "model.norm.weight")
    assert code == 0
    assert err.splitlines()[0] == (
        f"shardckpt: note: '{odd / 'config.json'}': not checking DST's weight names against "
        "the model it describes: it names no 'architectures', and transformers knows no "
        "model_type 'not-a-model'"
    )


def test_ties_a_config_says_but_no_model_tells_are_named_in_a_note(pretrained, tmp_path, capsys):
    src = tmp_path / "model"
    shutil.copytree(pretrained[True, False][0], src)
    config = json.loads((src / "config.json").read_text())
    config.pop("architectures")
    (src / "config.json").write_text(json.dumps({**config, "model_type": "not-a-model"}))
    told = (
        f"'{src / 'config.json'}' ties the word embeddings, but which weights cannot be told "
        "(it names no 'architectures', and transformers knows no model_type 'not-a-model'): a "
        "tied weight save_pretrained left out is not given back (pass convert --model "
        "pkg.module:factory)"
    )
    code, out, _ = cli(capsys, "inspect", src)
    assert code == 0 and told in out and "lm_head" not in out.replace(told, "")
    dst = tmp_path / "init"
    argv = ["convert", src, dst, "--to", "sharded", "--world-size", 2]
    assert cli(capsys, *argv, "-q")[2] == f"shardckpt: note: {told}"
    shutil.rmtree(dst)
    assert cli(capsys, *argv, "-q", "--model", "hf_export_jobs:tiny_llama") == (0, "", "")
    assert_trees_equal(loads_into_fsdp2(dst, True), pretrained[True, False][1])


def test_a_trainer_checkpoint_converts_its_model_and_names_the_state_left_behind(
    pretrained, tmp_path, capsys
):
    # transformers' Trainer saves checkpoint-N/ as save_pretrained's output plus its state.
    src = tmp_path / "checkpoint-4"
    shutil.copytree(pretrained[True, False][0], src)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        (src / name).write_bytes(b"{}")
    code, out, _ = cli(capsys, "inspect", src)
    assert code == 0
    assert (
        "  optimizer.pt: carried unread, a transformers Trainer's state, not model weights" in out
    )
    dst = tmp_path / "init"
    code, _, err = cli(capsys, "convert", src, dst, "--to", "sharded", "--world-size", 2, "-q")
    assert (code, err) == (
        0,
        "shardckpt: note: not in DST: optimizer.pt, rng_state.pth, scheduler.pt, "
        "trainer_state.json (4 files SRC carries unread; `shardckpt inspect SRC` says what each "
        "holds): copy them yourself if the job that loads DST needs them",
    )
    assert_trees_equal(loads_into_fsdp2(dst, True), pretrained[True, False][1])


def test_an_fsdp_trainer_checkpoint_names_its_optimizer_bin_and_checks_its_bytes(tmp_path, capsys):
    # Under FSDP with full state dicts the Trainer saves its optimizer as optimizer.bin and
    # FSDP's copy of the model as pytorch_model_fsdp.bin (tests/trainer_saves.py): carried
    # unread as its other state is, named in the note and checked by verify.
    import damage
    import trainer_saves

    src = trainer_saves.save("trainer-fsdp", tmp_path / "checkpoint-2")
    code, out, _ = cli(capsys, "inspect", src)
    assert code == 0
    assert (
        "  optimizer.bin: carried unread, a transformers Trainer's state, not model weights\n"
        "  pytorch_model_fsdp.bin: carried unread, a transformers Trainer's FSDP copy of the "
        "model, for its resume (the weights are read from the safetensors)\n"
    ) in out
    code, _, err = cli(capsys, "convert", src, tmp_path / "model.pt", "--to", "full", "-q")
    assert (code, err) == (
        0,
        "shardckpt: note: not in DST: optimizer.bin, pytorch_model_fsdp.bin, rng_state.pth, "
        "scheduler.pt, trainer_state.json, training_args.bin (6 files SRC carries unread; "
        "`shardckpt inspect SRC` says what each holds): copy them yourself if the job that "
        "loads DST needs them",
    )
    tensor = "state.model.norm.weight.exp_avg"
    flipped = damage.flip_in_torch_file(src / "optimizer.bin", tensor)
    said = f"the bytes do not match the checksum written with them ({flipped.where})"
    code, _, err = cli(capsys, "verify", src)
    assert (code, err) == (3, f"shardckpt: error: '{src}/optimizer.bin': {said}: {damage.RECOPY}")
