"""``--format deepspeed``: a ZeRO save written for M ranks is, file by file, what DeepSpeed itself
saves at M once it has loaded it, and reads back as the run it came from.

The references are DeepSpeed's own: ``tests/goldens/deepspeed/written/CASE-MM/`` is what a
DeepSpeed 0.19.8 job at M saved with ``engine.save_checkpoint`` after
``engine.load_checkpoint`` of shardckpt's conversion of golden ``CASE`` (``written.py``),
and ``CASE-MM.held.pt`` the fp32 masters that job held, gathered by DeepSpeed. Every tensor
and value of every file must be equal: DeepSpeed recomputes its partitions, paddings,
``param_slice_mappings`` and file names for M itself, so a layout it would cut otherwise
differs there. ``tests/dist/test_deepspeed_write_live.py`` runs DeepSpeed itself where it is
installed. Refusals: one line, exit 2, no DST and nothing staged left behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from deepspeed_files import differences
from deepspeed_goldens import MOMENTS, WRITTEN, bits_equal, gathered, run_dir, universal_states

from shardckpt import api
from shardckpt.cli import run

ENTRIES = sorted(p.name for p in WRITTEN.iterdir() if p.is_dir())


def _convert(src: Path, dst: Path, world_size: int, *extra: str) -> int:
    argv = ["convert", str(src), str(dst), "--to", "local", "--format", "deepspeed"]
    return run([*argv, "--world-size", str(world_size), *extra])


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_file_is_what_deepspeed_saves_at_m_once_it_loaded_it(tmp_path, entry):
    case, m = entry.rsplit("-M", 1)
    dst = tmp_path / "ds"
    assert _convert(run_dir(case), dst, int(m)) == 0
    assert (dst / "latest").read_text() == (WRITTEN / entry / "latest").read_text().strip()
    assert differences(dst, WRITTEN / entry) == []


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_masters_deepspeed_loaded_are_the_runs(entry):
    case, _ = entry.rsplit("-M", 1)
    held = torch.load(WRITTEN / f"{entry}.held.pt", weights_only=True)
    assert held["global_steps"] == 3
    for fqn, master in gathered(case)["fp32"].items():
        assert bits_equal(held["fp32"][fqn], master), fqn


@pytest.mark.parametrize(
    "case,m", [("z1-bf16", 5), ("z2-fp32", 2), ("z3-bf16", 3), ("z3-fp32-sub3", 4), ("z2-fp16", 1)]
)
def test_a_conversion_reads_back_as_the_run_it_came_from(tmp_path, case, m):
    """Any stage, dtype and M: what shardckpt reads of DST (checked against zero_to_fp32 and ds_to_universal) is SRC."""
    result = api.convert(
        api.ConvertRequest(
            src=run_dir(case),
            dst=tmp_path / "ds",
            to="local",
            format="deepspeed",
            world_size=m,
            verify=True,
        )
    )
    assert result.verified
    assert api.diff(api.DiffRequest(a=run_dir(case), b=tmp_path / "ds")).equal


@pytest.mark.parametrize(
    "case,extra,message",
    [
        (
            "z2-bf16-rr3",
            (),
            "SRC ran with zero_optimization.round_robin_gradients, whose flat order depends on "
            "the world size: --format deepspeed does not write it: write --to sharded (DCP) or "
            "--to full instead",
        ),
        (
            "z1-bf16-fp32acc",
            (),
            "SRC's ds_config runs ZeRO-1 in bf16 with fp32 gradient accumulation, which DeepSpeed "
            "trains with its BF16_Optimizer, whose files --format deepspeed does not write: write "
            "--to sharded (DCP) or --to full instead",
        ),
    ],
)
def test_a_run_deepspeed_would_lay_out_otherwise_is_refused(tmp_path, capsys, case, extra, message):
    src = shutil.copytree(run_dir(case), tmp_path / "src")
    assert _convert(src, tmp_path / "ds", 2, *extra) == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1] == f"shardckpt: error: '{src}': {message}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ("--only", "model"),
            "--format deepspeed needs SRC's 'optim': DeepSpeed loads the module and its optimizer's "
            "partitions together: convert the whole checkpoint (no --only, --filter or --drop of it); "
            "weights at the root of SRC go under --nest model",
        ),
        (
            ("--drop", "model.fc1.bias"),
            "--format deepspeed writes the module's 'fc1.bias', and the tree does not hold it: "
            "convert the whole checkpoint, without --drop or --filter of 'model'",
        ),
        (
            ("--filter", "model.*"),
            "--format deepspeed needs SRC's 'optim': DeepSpeed loads the module and its optimizer's "
            "partitions together: convert the whole checkpoint (no --only, --filter or --drop of it); "
            "weights at the root of SRC go under --nest model",
        ),
        (
            ("--zero-stage", "4"),
            "--zero-stage must be 1, 2 or 3, not 4: DeepSpeed's ZeRO stages with an optimizer "
            "partitioned over the ranks",
        ),
    ],
)
def test_a_tree_without_what_deepspeed_loads_is_refused(tmp_path, capsys, extra, message):
    src = shutil.copytree(run_dir("z2-bf16"), tmp_path / "src")
    assert _convert(src, tmp_path / "ds", 3, *extra) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"shardckpt: error: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_source_that_is_not_a_deepspeed_save_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    assert (
        run(
            [
                "convert",
                str(run_dir("z2-bf16")),
                str(src),
                "--to",
                "sharded",
                "--world-size",
                "2",
                "-q",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert _convert(src, tmp_path / "ds", 2) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"shardckpt: error: '{src}': is not a DeepSpeed save, and --format deepspeed needs the "
        "module's layout (its buffers, frozen and tied parameters, dtypes), which a DeepSpeed "
        "save's model-states file gives: pass --model pkg.module:factory building the trained model"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _fsdp2_dcp(tmp_path: Path, case: str) -> Path:
    """Return a DCP checkpoint of a golden's model and FQN-keyed optimizer alone, as FSDP2 saves one."""
    src = tmp_path / "src"
    argv = ["convert", str(run_dir(case)), str(src), "--to", "sharded", "--world-size", "2"]
    assert run([*argv, "--filter", "model.*", "--filter", "optim.*", "-q"]) == 0
    return src


@pytest.mark.parametrize("case,m,stage", [("z2-bf16", 3, None), ("z3-fp32", 4, "1")])
def test_a_dcp_source_is_written_with_the_module_model_builds(tmp_path, capsys, case, m, stage):
    src = _fsdp2_dcp(tmp_path, case)
    capsys.readouterr()
    extra = ["--model", "deepspeed_model:build", "--verify"] + (
        ["--zero-stage", stage] if stage else []
    )
    assert _convert(src, tmp_path / "ds", m, *extra) == 0
    err = capsys.readouterr().err
    assert f"SRC is not a DeepSpeed save: writing ZeRO-{stage or 2}" in err
    assert "load DST with engine.load_checkpoint(DST, load_lr_scheduler_states=False)" in err
    assert (tmp_path / "ds" / "latest").read_text() == "global_step0"
    full = tmp_path / "ds.pt"
    assert run(["convert", str(tmp_path / "ds"), str(full), "--to", "full", "-q"]) == 0
    written = torch.load(full, weights_only=True)
    moments = universal_states(case)
    for fqn, master in gathered(case)["fp32"].items():
        assert bits_equal(written["model"][fqn], master), fqn
        for moment in MOMENTS:
            assert bits_equal(written["optim"]["state"][fqn][moment], moments[fqn][moment])
    assert written["global_steps"] == 0 and written["ds_config"]["zero_optimization"] == {
        "stage": int(stage or 2)
    }


def test_a_model_that_trains_other_parameters_is_refused(tmp_path, capsys):
    src = _fsdp2_dcp(tmp_path, "z2-fp32")
    capsys.readouterr()
    assert _convert(src, tmp_path / "ds", 3, "--model", "deepspeed_model:build_unfrozen") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "shardckpt: error: the module --model builds trains 'frozen.weight' (it requires grad), "
        "and SRC's optimizer does not hold it: check --model against `shardckpt inspect SRC`"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_overwrite_replaces_a_deepspeed_save_and_nothing_beside_it(tmp_path, capsys):
    dst = tmp_path / "ds"
    assert _convert(run_dir("z2-bf16"), dst, 3, "-q") == 0
    assert _convert(run_dir("z2-bf16"), dst, 2, "-q", "--overwrite") == 0
    assert sorted(p.name for p in (dst / "global_step3").iterdir()) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt",
    ]
    (dst / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert _convert(run_dir("z2-bf16"), dst, 4, "-q", "--overwrite") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"shardckpt: error: '{dst}': holds 'notes.txt', which is no part of the DeepSpeed ZeRO "
        "checkpoint in it, so --overwrite will not replace it: remove it yourself if you mean it, "
        "or choose another DST"
    )
    assert (dst / "notes.txt").read_text() == "mine"
    assert len(list((dst / "global_step3").iterdir())) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


@pytest.mark.parametrize(
    "m,rng,note",
    [
        (1, ["rng_state_0.pth"], "not carried: rng_state_1.pth (no such rank at world size 1)"),
        (
            3,
            ["rng_state_0.pth", "rng_state_1.pth"],
            "SRC holds no RNG state of rank 2: the Trainer resumes it with a fresh RNG",
        ),
    ],
)
def test_an_hf_trainer_checkpoint_keeps_the_trainers_files_at_m(tmp_path, capsys, m, rng, note):
    src = run_dir("hf-z2-bf16")
    dst = tmp_path / "checkpoint-3"
    assert _convert(src, dst, m, "--verify") == 0
    assert f"shardckpt: note: {note}" in capsys.readouterr().err.splitlines()
    trainer = ["config.json", "generation_config.json", "model.safetensors"]
    trainer += ["trainer_state.json", "training_args.bin"]
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        [*trainer, *rng, "global_step3", "latest"]
    )
    for name in [*trainer, *rng]:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert len(list((dst / "global_step3").glob("bf16_zero_pp_rank_*_optim_states.pt"))) == m
    # The whole checkpoint-N is DST's: written again over it, nothing is left over.
    assert _convert(src, dst, 2, "-q", "--overwrite") == 0
    assert sorted(p.name for p in dst.glob("rng_state_*.pth")) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]


def test_weights_alone_give_the_masters_and_no_optimizer_state(tmp_path, capsys):
    weights = tmp_path / "weights.safetensors"
    argv = ["convert", str(run_dir("z2-fp32")), str(weights), "--to", "full"]
    assert run([*argv, "--filter", "model.*", "--unnest", "model", "-q"]) == 0
    capsys.readouterr()
    model = ["--model", "deepspeed_model:build_with_groups"]
    assert _convert(weights, tmp_path / "ds", 3, *model) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "shardckpt: error: --format deepspeed needs SRC's 'model': DeepSpeed loads the module and "
        "its optimizer's partitions together: convert the whole checkpoint (no --only, --filter "
        "or --drop of it); weights at the root of SRC go under --nest model"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors"]
    assert _convert(weights, tmp_path / "ds", 3, *model, "--nest", "model", "--verify") == 0
    assert (
        "shardckpt: note: SRC holds no optimizer: DST's optimizer files hold the fp32 master "
        "weights and no optimizer state; load DST with engine.load_checkpoint(DST, "
        "load_optimizer_states=False, load_lr_scheduler_states=False)"
    ) in capsys.readouterr().err.splitlines()
    assert (
        run(["convert", str(tmp_path / "ds"), str(tmp_path / "ds.pt"), "--to", "full", "-q"]) == 0
    )
    written = torch.load(tmp_path / "ds.pt", weights_only=True)
    for fqn, master in gathered("z2-fp32")["fp32"].items():
        assert bits_equal(written["model"][fqn], master), fqn
    assert written["optim"]["state"] == {}
    assert [g["params"] for g in written["optim"]["param_groups"]] == gathered("z2-fp32")[
        "group_fqns"
    ]
