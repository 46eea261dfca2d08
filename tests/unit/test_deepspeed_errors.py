"""DeepSpeed checkpoints that are not whole or not what DeepSpeed writes: one line naming the
file (or directory) and the fix, exit 3 (2 for a usage error), and never a tensor of fewer
elements than the save says. The damaged files are copies of the goldens with one field
changed (``tests/deepspeed_files.py``); no pickle of a DeepSpeed checkpoint is ever run."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path

import pickle_payloads as payloads
import pytest
import torch
from deepspeed_files import copy_run, edit_file, stage_enum
from deepspeed_goldens import run_dir, tag_dir, universal_dir

from shardckpt.cli import run

OPTIM = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
RECOPY = "the files are not of one save; re-copy the checkpoint"


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def converting(capsys, src: Path, *extra) -> tuple[int, str]:
    """Return (exit code, last line) of ``convert SRC --to full``."""
    return error_of(capsys, ["convert", src, src.parent / "out.pt", "--to", "full", *extra])


@pytest.fixture
def damaged(tmp_path) -> Callable[[str, Callable[[Path], object]], Path]:
    """Return a maker of a copy of a golden run, changed by ``mutate(tag_dir)``."""

    def make(name: str, mutate: Callable[[Path], object]) -> Path:
        run_copy = copy_run(run_dir(name), tmp_path)
        mutate(run_copy / "global_step3")
        return run_copy

    return make


def on_optim(rank: int, edit: Callable[[dict], object]) -> Callable[[Path], object]:
    """Return a mutation that edits the ``optimizer_state_dict`` of rank ``rank``'s optimizer file."""
    return lambda tag: edit_file(
        tag / OPTIM.format(rank), lambda sd: edit(sd["optimizer_state_dict"])
    )


# ------------------------------------------------------------------ one file alone


@pytest.mark.parametrize(
    "file, what",
    [
        (OPTIM.format(1), "rank 1's slice of the fp32 weights and optimizer state"),
        (
            "mp_rank_00_model_states.pt",
            "the module's 16-bit weights and the layout of the flat partitions, not the fp32 "
            "master weights or the optimizer",
        ),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_one_file_alone_names_the_directory_that_holds_the_checkpoint(capsys, command, file, what):
    path = tag_dir("z2-bf16") / file
    argv = [command, path] + (["/tmp/never.pt", "--to", "full"] if command == "convert" else [])
    assert error_of(capsys, argv) == (
        3,
        f"shardckpt: error: '{path}': is one file of a DeepSpeed ZeRO checkpoint ({what}): pass "
        f"the directory '{run_dir('z2-bf16')}', which shardckpt reads as one DeepSpeed "
        "checkpoint (every rank's files, no pickle run)",
    )


def test_a_zero3_model_states_file_read_as_torch_is_refused_not_emptied(capsys, tmp_path):
    path = tag_dir("z3-bf16") / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    code, line = error_of(
        capsys, ["convert", path, tmp_path / "o.pt", "--to", "full", "--from", "torch"]
    )
    assert (code, line) == (
        3,
        f"shardckpt: error: '{path}': 'module.embed.weight' is a placeholder of 0 elements for "
        "a parameter of shape [11, 6]: a ZeRO-3 model-states file holds no weights: pass the "
        f"directory '{run_dir('z3-bf16')}', which holds every rank's partition of them",
    )
    assert not (tmp_path / "o.pt").exists()


def test_a_zero3_model_states_file_copied_alone_is_refused_as_well(capsys, tmp_path):
    lone = tmp_path / "states.pt"
    shutil.copy(tag_dir("z3-fp32") / "zero_pp_rank_0_mp_rank_00_model_states.pt", lone)
    code, line = converting(capsys, lone)
    assert code == 3 and "'module.embed.weight' is a placeholder of 0 elements" in line


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is not None,
    reason="deepspeed is installed: unpickling finds the module",
)
def test_trust_pickle_names_the_missing_module_not_truncation(capsys):
    path = tag_dir("z2-bf16") / OPTIM.format(0)
    argv = ["inspect", path, "--from", "torch", "--trust-pickle"]
    assert error_of(capsys, argv) == (
        3,
        f"shardckpt: error: '{path}': unpickling it imports the Python module 'deepspeed', "
        f"which is not installed: pass the directory '{run_dir('z2-bf16')}', which shardckpt "
        "reads as one DeepSpeed checkpoint (every rank's files, no pickle run)",
    )


def test_the_module_view_of_a_zero3_save_is_refused(capsys):
    assert converting(capsys, run_dir("z3-bf16"), "--from", "deepspeed-module") == (
        3,
        f"shardckpt: error: '{tag_dir('z3-bf16')}': is a ZeRO-3 save: its model-states files "
        "hold every parameter as a placeholder, and no 16-bit module weights: read the fp32 "
        "master weights (--from deepspeed), with --dtype bf16 to cast them",
    )


@pytest.mark.parametrize("view", ["deepspeed-module", "deepspeed-universal"])
def test_deepspeed_views_are_not_outputs(capsys, tmp_path, view):
    argv = ["convert", run_dir("z2-bf16"), tmp_path / "ds", "--to", "local", "--format", view]
    assert error_of(capsys, [*argv, "--world-size", "2"]) == (
        2,
        "shardckpt: error: shardckpt reads DeepSpeed checkpoints but does not write them: write "
        "--to sharded --format dcp (FSDP2 at M; or accelerate, torchtitan), --to full (torch, "
        "safetensors, hf), or --to local (fsdp2-ranks)",
    )
    assert not (tmp_path / "ds").exists()


# ------------------------------------------------------------------ files of the save


def _swap_two_vectors(sd: dict) -> None:
    group = sd["param_shapes"][1]
    items = list(group.items())
    items[1], items[2] = items[2], items[1]
    sd["param_shapes"][1] = type(group)(items)


def _shorten_flat(osd: dict) -> None:
    osd["fp32_flat_groups"][0] = osd["fp32_flat_groups"][0][:-2].clone()


CASES = {
    "missing rank": (
        "z2-bf16",
        lambda tag: (tag / OPTIM.format(1)).unlink(),
        "{tag}': has no optimizer file of data-parallel rank 1 (found ranks 0): copy every "
        "rank's files of the save",
    ),
    "extra rank": (
        "z2-bf16",
        lambda tag: shutil.copy(tag / OPTIM.format(1), tag / OPTIM.format(2)),
        "{tag}': holds 'bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt', a file of rank 2, but "
        "the save is of 2 ranks: the directory mixes two saves; keep only the files of one",
    ),
    "rank of another world size": (
        "z2-bf16",
        lambda tag: shutil.copy(tag_dir("z2-bf16-rr3") / OPTIM.format(1), tag / OPTIM.format(1)),
        "{tag}/" + OPTIM.format(1) + "': is of ZeRO stage 2, 3 ranks and 2 flat groups, where "
        "rank 0's file is of 2, 2 and 2: " + RECOPY,
    ),
    "truncated": (
        "z2-bf16",
        lambda tag: (tag / OPTIM.format(1)).write_bytes((tag / OPTIM.format(1)).read_bytes()[:3000]),
        "{tag}/" + OPTIM.format(1) + "': is a damaged torch.save file (zip: File is not a zip "
        "file): re-copy it from where it was written",
    ),
    "no model states": (
        "z2-bf16",
        lambda tag: (tag / "mp_rank_00_model_states.pt").unlink(),
        "{tag}': holds no DeepSpeed model-states file (mp_rank_00_model_states.pt): pass the "
        "run directory (with 'latest') or a global_stepN directory",
    ),
    "zero3 rank without model states": (
        "z3-bf16",
        lambda tag: (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink(),
        "{tag}': has no model-states file of data-parallel rank 1 (found ranks 0): copy every "
        "rank's files of the save",
    ),
    "zero2 model states beside zero3": (
        "z3-bf16",
        lambda tag: shutil.copy(tag_dir("z2-bf16") / "mp_rank_00_model_states.pt", tag),
        "{tag}': holds both ZeRO-1/2 (mp_rank_00_model_states.pt) and ZeRO-3 "
        "(zero_pp_rank_R_mp_rank_00_model_states.pt) model-states files: the directory mixes "
        "two saves; keep only the files of one",
    ),
    "tensor parallel": (
        "z2-bf16",
        lambda tag: shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt"),
        "{tag}': holds 'mp_rank_01_model_states.pt', a file of model-parallel rank 1: shardckpt "
        "reads data-parallel ZeRO checkpoints (mp_rank_00 only), not tensor- or "
        "pipeline-parallel ones",
    ),
    "param_shapes of another order": (
        "z2-bf16",
        lambda tag: edit_file(tag / "mp_rank_00_model_states.pt", _swap_two_vectors),
        "{tag}': 'norm.bias' would be 7 elements at 7 of rank 0's partition of group 1, but "
        "param_slice_mappings says nothing: " + RECOPY,
    ),
    "partitions of different sizes": (
        "z2-bf16",
        on_optim(1, lambda osd: osd.__setitem__("group_paddings", [0, 5])),
        "{tag}': the ranks' partitions of group 0 are of different sizes ([74, 76] elements "
        "with their padding): " + RECOPY,
    ),
    "zero3 partition too short": (
        "z3-bf16",
        on_optim(1, _shorten_flat),
        "{tag}': rank 1's flat tensor of sub-group 0 holds 73 elements, but its parameters "
        "take 75 (2 ranks of ceil(numel / 2) each): " + RECOPY,
    ),
    "step differs": (
        "z2-bf16",
        on_optim(1, lambda osd: osd["base_optimizer_state"]["state"][0].__setitem__("step", torch.tensor(4.0))),
        "{tag}': optimizer state 'step' of flat tensor 0 differs between the ranks: " + RECOPY,
    ),
    "moment shorter than the partition": (
        "z2-bf16",
        on_optim(1, lambda osd: osd["base_optimizer_state"]["state"][0].__setitem__("exp_avg", torch.zeros(10))),
        "{tag}/" + OPTIM.format(1) + "': optimizer state 'exp_avg' of flat tensor 0 is not a "
        "1-D tensor as long as the rank's partition: " + RECOPY,
    ),
    "elastic": (
        "z2-bf16",
        on_optim(0, lambda osd: osd.__setitem__("base_optimizer_state", list(osd["base_optimizer_state"]["state"].values()))),
        "{tag}/" + OPTIM.format(0) + "': holds its optimizer state in ZeRO's elastic form (per "
        "group, without param_groups), which the job's hyper-parameters cannot be read from: "
        "save with zero_optimization.elastic_checkpoint false (DeepSpeed's default)",
    ),
    "expert parallel": (
        "z2-bf16",
        on_optim(0, lambda osd: osd.__setitem__("partition_count", [2, 1])),
        "{tag}/" + OPTIM.format(0) + "': partitions its param groups over different numbers "
        "of ranks ([2, 1]): an expert-parallel (MoE) save: shardckpt reads data-parallel ZeRO "
        "checkpoints, without expert parallelism",
    ),
    "stage 0": (
        "z2-bf16",
        on_optim(0, lambda osd: osd.__setitem__("zero_stage", stage_enum(0))),
        "{tag}/" + OPTIM.format(0) + "': is an optimizer file of ZeRO stage 0, which shardckpt "
        "does not read: shardckpt reads ZeRO stages 1, 2 and 3",
    ),
    "fragment address not a count": (
        "z2-bf16",
        on_optim(0, lambda osd: setattr(osd["param_slice_mappings"][0]["embed.weight"], "numel", -3)),
        "{tag}/" + OPTIM.format(0) + "': refused to unpickle (a fragment_address without "
        "non-negative numel and start): the file is not one DeepSpeed wrote, or was changed "
        "after; re-copy the checkpoint",
    ),
    "loss scaler holding a tensor": (
        "z2-bf16",
        on_optim(0, lambda osd: setattr(osd["loss_scaler"], "cur_scale", torch.ones(2))),
        "{tag}/" + OPTIM.format(0) + "': refused to unpickle (a loss scaler whose state is not "
        "a dict of plain values): the file is not one DeepSpeed wrote, or was changed after; "
        "re-copy the checkpoint",
    ),
    "tied to nothing": (
        "z2-bf16",
        lambda tag: edit_file(
            tag / "mp_rank_00_model_states.pt",
            lambda sd: sd["shared_params"].__setitem__("head.weight", "nothing.weight"),
        ),
        "{tag}/mp_rank_00_model_states.pt': 'head.weight' is tied to 'nothing.weight', which "
        "the save does not hold: the model-states file is damaged; re-copy the checkpoint",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_save_that_is_not_whole_or_not_deepspeeds_is_refused(capsys, damaged, case):
    name, mutate, expected = CASES[case]
    src = damaged(name, mutate)
    tag = src / "global_step3"
    assert converting(capsys, src) == (3, "shardckpt: error: '" + expected.format(tag=tag))
    assert not (src.parent / "out.pt").exists()


def test_a_zero3_placeholder_no_metadata_places_is_refused(capsys, damaged):
    def extra(tag: Path) -> None:
        for r in (0, 1):
            path = tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            edit_file(path, lambda sd: sd["module"].__setitem__("extra.weight", torch.empty(0)))

    src = damaged("z3-bf16", extra)
    assert converting(capsys, src) == (
        3,
        f"shardckpt: error: '{src}/global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt': "
        "'extra.weight' is a placeholder of 0 elements, and no metadata of the save says where "
        "its data is: the model-states files are not of one save; re-copy the checkpoint",
    )


@pytest.mark.parametrize(
    "latest, expected",
    [
        (
            "global_step9",
            "'{run}/latest': names the tag 'global_step9', but '{run}/global_step9' is not a "
            "directory: the save did not finish or the directory was moved; pass a tag "
            "directory (global_stepN) that is there",
        ),
        (
            "../elsewhere",
            "'{run}/latest': names '../elsewhere', which is not a directory name: pass the tag "
            "directory (global_stepN) itself",
        ),
    ],
)
def test_a_latest_file_that_names_no_tag_directory_is_refused(capsys, tmp_path, latest, expected):
    src = copy_run(run_dir("z2-fp32"), tmp_path)
    (src / "latest").write_text(latest)
    assert converting(capsys, src) == (3, "shardckpt: error: " + expected.format(run=src))


# ------------------------------------------------------------------ hostile pickles


FOREIGN = (
    "no DeepSpeed checkpoint names it, and shardckpt never runs a DeepSpeed checkpoint's "
    "pickle (not with --trust-pickle either); re-copy the checkpoint"
)
NOT_DEEPSPEEDS = "the file is not one DeepSpeed wrote, or was changed after; re-copy the checkpoint"


@pytest.mark.parametrize("payload", sorted(payloads.PAYLOADS))
@pytest.mark.parametrize("trust", [False, True], ids=["", "trust-pickle"])
def test_a_malicious_pickle_in_a_save_never_runs_even_with_trust_pickle(
    capsys, tmp_path, payload, trust
):
    src = copy_run(run_dir("z2-bf16"), tmp_path)
    marker = tmp_path / "PAYLOAD-RAN"
    evil = src / "global_step3" / OPTIM.format(1)
    payloads.with_data_pkl(evil, payloads.PAYLOADS[payload](marker))
    code, line = converting(capsys, src, *(["--trust-pickle"] if trust else []))
    assert code == 3 and line.startswith(f"shardckpt: error: '{evil}': refused to unpickle (")
    # A payload that names a global is foreign; one that needs an opcode DeepSpeed's pickles
    # never use (protocol 4's STACK_GLOBAL) is not a DeepSpeed file at all.
    assert line.endswith(NOT_DEEPSPEEDS if payload == "dotted-stack-global" else FOREIGN)
    assert not marker.exists()


# ------------------------------------------------------------------ universal checkpoints


def test_a_universal_checkpoint_without_a_parameters_file_is_refused(capsys, tmp_path):
    src = copy_run(universal_dir("z3-bf16"), tmp_path)
    tag = src / "global_step3"
    (tag / "zero" / "fc2.bias" / "fp32.pt").unlink()
    assert converting(capsys, src) == (
        3,
        f"shardckpt: error: '{tag}': has no 'zero/fc2.bias/fp32.pt' for parameter 'fc2.bias': "
        "the universal checkpoint is incomplete; run ds_to_universal again",
    )


def test_a_universal_file_of_another_size_is_refused(capsys, tmp_path):
    src = copy_run(universal_dir("z2-bf16"), tmp_path)
    moment = src / "global_step3" / "zero" / "fc1.weight" / "exp_avg.pt"
    torch.save({"param": torch.zeros(5), "cat_dim": 0}, moment)
    assert converting(capsys, src) == (
        3,
        f"shardckpt: error: '{moment}': holds 5 elements, where the parameter has shape [7, 6]: "
        "the universal checkpoint is incomplete; run ds_to_universal again",
    )
