"""The files of one DeepSpeed save must agree, and agree with their module (issue 30, items 4, 5, 7).

4. Files of two runs in one tag directory (an fp32 run's rank-1 optimizer file in an
   fp16 run, a bf16 run's ZeRO-3 model-states file in an fp32 run) were read as one save:
   exit 0 with tensors from the other run. Every file carries ``ds_config`` and
   ``ds_version``, the optimizer files their param groups and loss scaler: they must agree.
5. ``param_shapes`` ``[6, 11]`` for a module tensor of 11x6 was believed: weights and
   moments written transposed. A module tensor that holds data must have its listed shape.
7. Partitions stored as float64 or int64 were cast silently: they must be fp32.

Every case is built from files the real DeepSpeed 0.19.8 wrote (tests/goldens/deepspeed),
and each is refused by convert and verify with exit 3 and one line naming the file,
leaving no DST, partial output or lock.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from deepspeed_files import copy_run, edit_file
from deepspeed_goldens import run_dir

from shardckpt.cli import run

OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL_1_2 = "mp_rank_00_model_states.pt"
MODEL_3 = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
TAG = "global_step3"
RECOPY = "the files are not of one save; re-copy the checkpoint"
CHANGED = "the file was changed after DeepSpeed wrote it; re-copy the checkpoint"
NOT_DS = "the file is not one DeepSpeed wrote, or was changed after; re-copy the checkpoint"


def cli(capsys, *argv) -> tuple[int, list[str]]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def refused_everywhere(capsys, src: Path, tmp_path: Path, line: str) -> None:
    """Assert convert and verify of ``src`` are exit 3 with ``line`` alone, writing nothing."""
    dst = tmp_path / "out.safetensors"
    for argv in (
        ["convert", src, dst, "--to", "full", "-q"],
        ["convert", src, tmp_path / "out-dcp", "--to", "sharded", "--world-size", "3", "-q"],
        ["verify", src, "-q"],
    ):
        assert cli(capsys, *argv) == (3, [line]), argv
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]


def tag_of(tmp_path: Path, golden: str) -> tuple[Path, Path]:
    """Return a copy of golden run ``golden`` (under tmp_path/run) and its tag directory."""
    (tmp_path / "run").mkdir()
    src = copy_run(run_dir(golden), tmp_path / "run")
    return src, src / TAG


def first_matrix(path: Path) -> tuple[str, tuple[int, ...]]:
    """Return the first non-square 2-D parameter param_shapes lists in a model-states file."""
    found: list = []

    def look(sd: dict) -> None:
        for shapes in sd["param_shapes"]:
            for name, shape in shapes.items():
                if len(shape) == 2 and shape[0] != shape[1] and not found:
                    found.append((name, tuple(shape)))

    edit_file(path, look)
    return found[0]


# ------------------------------------------------------------------ 4. two runs in one tag


MIXES = {
    # (golden run, the file taken from another run, that run): the file holds another config.
    "fp32 optimizer file in an fp16 run": ("z2-fp16", OPTIM.format(1), "z2-fp32"),
    "fp16 optimizer file in an fp32 run": ("z2-fp32", OPTIM.format(1), "z2-fp16"),
    "fp32-accumulating bf16 file in a bf16 run": (
        "z1-bf16",
        "bf16_" + OPTIM.format(1),
        "z1-bf16-fp32acc",
    ),
    "bf16 ZeRO-3 model states in an fp32 run": ("z3-fp32", MODEL_3.format(1), "z3-bf16"),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_files_of_two_runs_in_one_tag_directory_are_refused_naming_both(tmp_path, capsys, mix):
    golden, name, other = MIXES[mix]
    src, tag = tag_of(tmp_path, golden)
    shutil.copyfile(run_dir(other) / TAG / name, tag / name)
    first = tag / (MODEL_3.format(0) if "model" in name else MODEL_1_2)
    line = (
        f"shardckpt: error: '{tag / name}': holds another 'ds_config' than '{first}': the two "
        f"files are of different saves: {RECOPY}"
    )
    refused_everywhere(capsys, src, tmp_path, line)


def _set_version(sd: dict) -> None:
    sd["ds_version"] = "0.18.0"


def _lr(sd: dict) -> None:
    sd["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0]["lr"] *= 2


def _scale(sd: dict) -> None:
    sd["optimizer_state_dict"]["loss_scaler"].cur_scale = 1024


EDITS: dict[str, tuple[str, str, Callable[[dict], None], str, str]] = {
    # (golden, the file edited, the edit, what the message says differs, the file it names)
    "another ds_version in an optimizer file": (
        "z2-fp32",
        OPTIM.format(1),
        _set_version,
        "'ds_version'",
        MODEL_1_2,
    ),
    "another ds_version in a ZeRO-3 model-states file": (
        "z3-fp32",
        MODEL_3.format(1),
        _set_version,
        "'ds_version'",
        MODEL_3.format(0),
    ),
    "other param groups in rank 1's optimizer file": (
        "z2-fp32",
        OPTIM.format(1),
        _lr,
        "optimizer param_groups",
        OPTIM.format(0),
    ),
    "another loss scale in rank 1's optimizer file": (
        "z2-fp16",
        OPTIM.format(1),
        _scale,
        "loss scaler",
        OPTIM.format(0),
    ),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_files_that_disagree_on_the_job_are_refused_naming_both(tmp_path, capsys, case):
    golden, name, edit, what, other = EDITS[case]
    src, tag = tag_of(tmp_path, golden)
    edit_file(tag / name, edit)
    line = (
        f"shardckpt: error: '{tag / name}': holds another {what} than '{tag / other}': the "
        f"two files are of different saves: {RECOPY}"
    )
    refused_everywhere(capsys, src, tmp_path, line)


@pytest.mark.parametrize(
    ("golden", "dtype"), [("z2-bf16", torch.float32), ("z2-fp32", torch.float16)]
)
def test_a_module_in_another_dtype_than_its_config_trains_in_is_refused(
    tmp_path, capsys, golden, dtype
):
    src, tag = tag_of(tmp_path, golden)
    name, _ = first_matrix(tag / MODEL_1_2)

    def cast(sd: dict) -> None:
        sd["module"][name] = sd["module"][name].to(dtype)

    edit_file(tag / MODEL_1_2, cast)
    trains = torch.bfloat16 if golden == "z2-bf16" else torch.float32
    line = (
        f"shardckpt: error: '{tag / MODEL_1_2}': holds '{name}' as {dtype}, but its ds_config "
        f"trains in {trains}: the file is not of the save its config describes: {RECOPY}"
    )
    refused_everywhere(capsys, src, tmp_path, line)


# --------------------------------------------------------------- 5. param_shapes that lie


@pytest.mark.parametrize("golden", ["z1-fp32", "z2-fp32", "z2-bf16"])
@pytest.mark.parametrize("lie", ["transposed", "other numel"])
def test_param_shapes_that_contradict_the_module_are_refused(tmp_path, capsys, golden, lie):
    src, tag = tag_of(tmp_path, golden)
    name, (rows, cols) = first_matrix(tag / MODEL_1_2)
    told = (cols, rows) if lie == "transposed" else (rows + 1, cols)

    def lie_about(sd: dict) -> None:
        for shapes in sd["param_shapes"]:
            if name in shapes:
                shapes[name] = torch.Size(told)

    edit_file(tag / MODEL_1_2, lie_about)
    line = (
        f"shardckpt: error: '{tag / MODEL_1_2}': lists '{name}' as {list(told)} in param_shapes, "
        f"but its module holds it as {[rows, cols]}: the partitions would be cut into the "
        f"wrong shape: {CHANGED}"
    )
    refused_everywhere(capsys, src, tmp_path, line)


# ------------------------------------------------------------ 7. partitions that are not fp32


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("golden", ["z2-fp32", "z3-fp32"])
def test_partitions_stored_in_another_dtype_than_fp32_are_refused(tmp_path, capsys, golden, dtype):
    src, tag = tag_of(tmp_path, golden)
    field = "fp32_flat_groups" if golden.startswith("z3") else "single_partition_of_fp32_groups"

    def recast(sd: dict) -> None:
        osd = sd["optimizer_state_dict"]
        osd[field] = [t.to(dtype) for t in osd[field]]

    edit_file(tag / OPTIM.format(1), recast)
    line = (
        f"shardckpt: error: '{tag / OPTIM.format(1)}': '{field}' holds {dtype} partitions, "
        f"where DeepSpeed keeps fp32: {NOT_DS}"
    )
    refused_everywhere(capsys, src, tmp_path, line)


@pytest.mark.parametrize("golden", ["z2-fp32", "z1-fp32"])
def test_moments_stored_in_another_dtype_than_fp32_are_refused(tmp_path, capsys, golden):
    src, tag = tag_of(tmp_path, golden)

    def recast(sd: dict) -> None:
        state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"]
        state[0]["exp_avg_sq"] = state[0]["exp_avg_sq"].double()

    edit_file(tag / OPTIM.format(0), recast)
    line = (
        f"shardckpt: error: '{tag / OPTIM.format(0)}': the base optimizer's 'exp_avg_sq' of "
        f"flat group 0 is torch.float64, where DeepSpeed keeps fp32: {NOT_DS}"
    )
    refused_everywhere(capsys, src, tmp_path, line)


@pytest.mark.parametrize("golden", ["z1-bf16-fp32acc", "z2-fp16", "z3-bf16", "z3-fp32-sub3"])
def test_every_real_save_still_reads(tmp_path, capsys, golden):
    src, _ = tag_of(tmp_path, golden)
    assert cli(capsys, "convert", src, tmp_path / "out.safetensors", "--to", "full", "-q") == (
        0,
        [],
    )
