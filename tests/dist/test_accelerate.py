"""accelerate's ``save_state`` directories, saved and loaded by accelerate itself on gloo ranks.

One torchrun at 2 processes trains and saves every variant (``tests/accelerate_train.py``);
shardckpt reads each directory whole, writes ``--to full`` and an accelerate directory at
3; one torchrun at 3 resumes from the original (accelerate's own resharding load, the
control) and from the converted directory, and takes a step. FSDP1 with
FULL_STATE_DICT is not here: accelerate's own save of it fails on CPU (it forces
``offload_to_cpu``, which FSDP1 cannot do without a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ranks
import torch
import warm_cli
from harness import run_ranks
from rank_bytes import file_hashes

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.cli.render import inspection_json

pytest.importorskip("accelerate")
pytestmark = pytest.mark.trainers

SCRIPT = Path(__file__).resolve().parents[1] / "accelerate_train.py"
VARIANTS = {
    "fsdp2-sharded": ("2", "SHARDED_STATE_DICT"),
    "fsdp1-sharded": ("1", "SHARDED_STATE_DICT"),
    "fsdp2-full": ("2", "FULL_STATE_DICT"),
    "fsdp1-full": ("1", "FULL_STATE_DICT"),
}


def _torchrun(nproc: int, *argv: str) -> None:
    # torchrun's agent forks warm (warm_cli); its ranks run the script in fresh interpreters.
    cmd = ["--standalone", f"--nproc-per-node={nproc}", str(SCRIPT), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = warm_cli.run_torchrun(cmd, env=env, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Return a directory holding each variant's ``save_state`` at 2 processes and its control."""
    root = tmp_path_factory.mktemp("accelerate")
    _torchrun(2, "save", *(f"{v}:{t}:{root / name}" for name, (v, t) in VARIANTS.items()))
    return root


@pytest.fixture(scope="module")
def resumed(saved) -> dict[str, list[dict]]:
    """Return, per variant, what a job at 3 holds after resuming from the original and from shardckpt's output."""
    jobs = []
    for name, (version, state_dict) in VARIANTS.items():
        out = saved / f"{name}.m3"
        argv = ["convert", str(saved / name), str(out), "--to", "sharded", "--format", "accelerate"]
        assert run([*argv, "--world-size", "3", "--quiet"]) == 0
        # The output is accelerate's SHARDED_STATE_DICT layout, whatever the source's.
        jobs += [f"{version}:{state_dict}:{saved / name}", f"{version}:SHARDED_STATE_DICT:{out}"]
    _torchrun(3, "resume", str(saved / "resumed.pt"), *jobs)
    runs = torch.load(saved / "resumed.pt", weights_only=True)
    return {name: runs[2 * i : 2 * i + 2] for i, name in enumerate(VARIANTS)}


def _equal(a, b) -> bool:
    """Return whether two trees are equal: tensors bit for bit, keys compared as str."""
    if isinstance(a, dict) and isinstance(b, dict):
        sa, sb = {str(k): v for k, v in a.items()}, {str(k): v for k, v in b.items()}
        return sa.keys() == sb.keys() and all(_equal(sa[k], sb[k]) for k in sa)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", VARIANTS)
def test_verify_reads_every_file_save_state_wrote_and_finds_it_intact(saved, name):
    result = api.verify(api.VerifyRequest(src=saved / name))
    files = [p for p in (saved / name).rglob("*") if p.is_file()]
    assert (result.intact, result.files) == (True, len(files))
    assert result.bytes == sum(p.stat().st_size for p in files) and result.checked > 0


@pytest.mark.parametrize("name", VARIANTS)
def test_inspect_shows_every_part_and_names_the_files_it_does_not_read(saved, name):
    insp = api.inspect(api.InspectRequest(src=saved / name))
    doc = inspection_json(insp)
    assert (doc["format"], doc["world_size"]) == ("accelerate", 2)
    assert list(insp.index.tree) == ["model", "optimizer", "scheduler"]
    assert [o["path"] for o in doc["optimizers"]] == [["optimizer"]]
    sharded = VARIANTS[name][1] == "SHARDED_STATE_DICT"
    model, optim = (
        ("pytorch_model_fsdp_0", "optimizer_0")
        if sharded
        else ("pytorch_model_fsdp.bin", "optimizer.bin")
    )
    part_format = "dcp" if sharded else "torch"
    rng = "RNG state of one rank (pickled numpy objects)"
    assert doc["parts"] == [
        {"file": model, "format": part_format, "key": "model", "note": ""},
        {"file": optim, "format": part_format, "key": "optimizer", "note": ""},
        {"file": "scheduler.bin", "format": "torch", "key": "scheduler", "note": ""},
        {"file": "random_states_0.pkl", "format": "file", "key": None, "note": rng},
        {"file": "random_states_1.pkl", "format": "file", "key": None, "note": rng},
    ]


@pytest.mark.parametrize("only", [["--format", "hf"], ["--only", "model"]])
def test_a_weights_only_export_says_nothing_of_the_rng_files_it_has_no_use_for(
    saved, only, tmp_path, capsys
):
    """An hf export, or --only model, of a save_state directory holds the model's weights:
    the job's RNG states mean nothing there, and no note names them (issue 35, item 7)."""
    src = saved / next(iter(VARIANTS))
    dst = tmp_path / ("hf" if "hf" in only else "model.safetensors")
    assert run(["convert", str(src), str(dst), "--to", "full", *only, "--quiet"]) == 0
    assert "random_states" not in capsys.readouterr().err


@pytest.mark.parametrize("name", VARIANTS)
def test_full_output_equals_merge_weights_and_torchs_full_optimizer(saved, name, tmp_path, capsys):
    from accelerate.utils import merge_fsdp_weights
    from safetensors.torch import load_file

    src = saved / name
    assert run(["convert", str(src), str(tmp_path / "full.pt"), "--to", "full", "--quiet"]) == 0
    assert capsys.readouterr().err == (
        "shardckpt: note: not in DST: random_states_0.pkl, random_states_1.pkl (2 files SRC "
        "carries unread; `shardckpt inspect SRC` says what each holds): copy them yourself "
        "if the job that loads DST needs them\n"
    )
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert list(full) == ["model", "optimizer", "scheduler"]
    if VARIANTS[name][1] == "SHARDED_STATE_DICT":
        merge_fsdp_weights(str(src / "pytorch_model_fsdp_0"), str(tmp_path / "merged"))
        merged = load_file(tmp_path / "merged" / "model.safetensors")
    else:  # accelerate's FULL_STATE_DICT save is its own consolidation
        merged = torch.load(src / "pytorch_model_fsdp.bin", weights_only=True)
    assert _equal(full["model"], merged)
    control = torch.load(f"{src}.control.pt", weights_only=True)
    assert _equal(full["model"], control["model"])
    assert _equal(full["optimizer"], control["optimizer"])
    assert _equal(full["scheduler"], torch.load(src / "scheduler.bin", weights_only=True))


@pytest.mark.parametrize("name", VARIANTS)
def test_load_state_at_3_resumes_from_the_output_as_from_accelerates_own_reshard(
    saved, resumed, name
):
    control, converted = resumed[name]
    saved_state = torch.load(f"{saved / name}.control.pt", weights_only=True)
    assert _equal(converted["loaded"], saved_state)
    if VARIANTS[name][1] == "FULL_STATE_DICT":
        # accelerate's FULL load broadcasts param_groups as objects: betas come back a list.
        for group in control["loaded"]["optimizer"]["param_groups"]:
            group["betas"] = tuple(group["betas"])
        for group in control["optimizer"]["param_groups"]:
            group["betas"] = tuple(group["betas"])
    assert _equal(control["loaded"], saved_state)
    assert _equal(converted, control)


def test_output_at_3_copies_the_other_files_byte_for_byte(saved, resumed):
    src, out = saved / "fsdp2-sharded", saved / "fsdp2-sharded.m3"
    assert sorted(p.name for p in out.iterdir()) == [
        "optimizer_0",
        "pytorch_model_fsdp_0",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]
    for name in ("random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert sorted(p.name for p in (out / "optimizer_0").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
    ]


def test_output_for_fewer_ranks_names_the_rng_files_of_ranks_it_no_longer_has(
    saved, tmp_path, capsys
):
    argv = ["convert", str(saved / "fsdp2-sharded"), str(tmp_path / "one")]
    assert run([*argv, "--to", "sharded", "--format", "accelerate", "--world-size", "1"]) == 0
    assert (
        "shardckpt: note: random_states_1.pkl copied unchanged, for a rank a job of 1 does "
        "not have\n"
    ) in capsys.readouterr().err
    insp = api.inspect(api.InspectRequest(src=tmp_path / "one"))
    assert insp.index.world_size == 1


def test_a_sharded_and_a_full_save_of_one_job_are_the_same_tree(saved):
    assert run(["diff", str(saved / "fsdp2-sharded"), str(saved / "fsdp2-full")]) == 0


def test_two_processes_write_the_same_accelerate_directory_as_one(saved, resumed, tmp_path):
    dst = tmp_path / "at3"
    kwargs = {"format": "accelerate", "world_size": 3}
    run_ranks(ranks.convert, 2, str(saved / "fsdp2-sharded"), str(dst), "sharded", kwargs)
    assert file_hashes(dst) == file_hashes(saved / "fsdp2-sharded.m3")
