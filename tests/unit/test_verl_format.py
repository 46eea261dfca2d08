"""veRL's FSDPCheckpointManager directories, read from goldens veRL 0.9.1 wrote (tests/goldens/verl).

Each golden's ``reference.pt`` is torch's full state of the job that saved it
(``get_state_dict(..., full_state_dict=True)``), taken by ``make.py`` at save time.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from pickle_payloads import PAYLOADS, with_data_pkl
from reference import assert_trees_equal
from verl_models import GOLDENS, WRAP

from shardckpt import api
from shardckpt.core.errors import BadInputError, UnsafePickleError, UsageError
from shardckpt.formats import detect
from shardckpt.formats.trainers.verl.extra_state import extra_state_copies
from shardckpt.formats.trainers.verl.names import file_name

FSDP2 = GOLDENS / "fsdp2" / "global_step_2"
FSDP1 = GOLDENS / "fsdp1" / "global_step_2"

# The FSDP2 golden's rank files pickle DTensor device meshes as torch 2.13.0 wrote them,
# naming a class torch 2.11 lacks: there, reading them is refused (the last test).
_NEW_MESH = "torch.distributed._mesh_layout._FlatLayout"
try:
    from torch.distributed._mesh_layout import _FlatLayout  # noqa: F401

    MESHES_READ = True
except ImportError:
    MESHES_READ = False
reads_fsdp2_meshes = pytest.mark.skipif(
    not MESHES_READ, reason=f"this torch lacks {_NEW_MESH}, which the FSDP2 golden pickles"
)


def _reference(kind: str) -> dict:
    return torch.load(GOLDENS / kind / "reference.pt", weights_only=True)


def test_both_goldens_are_detected_by_their_fsdp_version():
    assert (detect(FSDP2), detect(FSDP1)) == ("verl", "verl-fsdp1")


@reads_fsdp2_meshes
def test_inspect_reads_no_pickle_of_extra_state_and_lists_it_carried():
    insp = api.inspect(api.InspectRequest(src=FSDP2))
    assert (insp.index.format, insp.index.world_size) == ("verl", 2)
    parts = {p.file: (p.key, p.format) for p in insp.index.parts}
    assert parts["model_world_size_2_rank_*.pt"] == ("model", "fsdp2-ranks")
    assert parts["optim_world_size_2_rank_*.pt"] == ("optim", "fsdp2-ranks")
    assert parts["extra_state_world_size_2_rank_1.pt"] == (None, "file")
    assert parts["huggingface"] == (None, "file")
    assert insp.optimizers[0].key_type == "id"


@reads_fsdp2_meshes
def test_fsdp2_to_full_with_fqn_keys_equals_torchs_full_state_dict(tmp_path):
    api.convert(
        api.ConvertRequest(src=FSDP2, dst=tmp_path / "full.pt", to="full", optim_keys="fqn")
    )
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), _reference("fsdp2"))


def test_fsdp1_optimizer_without_model_is_refused_with_the_reason(tmp_path):
    with pytest.raises(UsageError) as info:
        api.convert(api.ConvertRequest(src=FSDP1, dst=tmp_path / "full.pt", to="full"))
    assert info.value.line() == (
        f"'{FSDP1}': holds FSDP1's optimizer state as each rank's slices of flat parameters, "
        "and only the model's FSDP1 wrapping says which parameter each element belongs to: "
        "pass --model pkg.module:factory and --wrap the classes veRL wrapped (its decoder "
        "layer class), or --only model"
    )
    assert info.value.exit_code == 2


def test_fsdp1_model_alone_needs_no_model(tmp_path):
    api.convert(api.ConvertRequest(src=FSDP1, dst=tmp_path / "model.pt", to="full", only="model"))
    out = torch.load(tmp_path / "model.pt", weights_only=True)
    # One file of the model alone holds it at its root, as load_state_dict takes it.
    assert_trees_equal(out, _reference("fsdp1")["model"])


@pytest.mark.trainers
def test_fsdp1_to_full_with_model_equals_torchs_full_state_dict(tmp_path):
    pytest.importorskip("transformers")
    model = "verl_models:qwen2"
    api.convert(
        api.ConvertRequest(
            src=FSDP1, dst=tmp_path / "full.pt", to="full", model=model, wraps=[WRAP]
        )
    )
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), _reference("fsdp1"))


@reads_fsdp2_meshes
def test_resharded_at_3_keeps_verls_layout_and_copies_extra_state_unread(tmp_path, capsys):
    out = tmp_path / "at3"
    result = api.convert(api.ConvertRequest(src=FSDP2, dst=out, to="local", world_size=3))
    assert (result.format, result.world_size) == ("verl", 3)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        [file_name(part, 3, r) for part in ("model", "optim", "extra_state") for r in range(3)]
        + ["fsdp_config.json", "huggingface"]
    )
    assert (
        out / "fsdp_config.json"
    ).read_text() == '{\n    "FSDP_version": 2,\n    "world_size": 3\n}'
    for rank, source in ((0, 0), (1, 1), (2, 0)):
        copied = (out / file_name("extra_state", 3, rank)).read_bytes()
        assert copied == (FSDP2 / file_name("extra_state", 2, source)).read_bytes()
    assert "1 rank of 3 (2) had none in SRC and get rank 0's extra_state" in capsys.readouterr().err
    api.convert(api.ConvertRequest(src=out, dst=tmp_path / "back.pt", to="full", optim_keys="fqn"))
    assert_trees_equal(torch.load(tmp_path / "back.pt", weights_only=True), _reference("fsdp2"))


@reads_fsdp2_meshes
def test_format_fsdp2_ranks_still_writes_bare_rank_files(tmp_path):
    result = api.convert(
        api.ConvertRequest(
            src=FSDP2, dst=tmp_path / "bare", to="local", format="fsdp2-ranks", world_size=3
        )
    )
    assert result.format == "fsdp2-ranks"
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == [
        "rank_0.pt",
        "rank_1.pt",
        "rank_2.pt",
    ]


@reads_fsdp2_meshes
@pytest.mark.trainers
def test_an_fqn_keyed_optimizer_is_refused_by_the_verl_writer(tmp_path):
    pytest.importorskip("transformers")
    api.convert(
        api.ConvertRequest(src=FSDP2, dst=tmp_path / "full.pt", to="full", optim_keys="fqn")
    )
    with pytest.raises(UsageError, match="add --optim-keys id") as info:
        api.convert(
            api.ConvertRequest(
                src=tmp_path / "full.pt",
                dst=tmp_path / "out",
                to="local",
                format="verl",
                world_size=2,
                model="verl_models:qwen2",
            )
        )
    assert info.value.exit_code == 2


def test_extra_state_for_fewer_ranks_says_which_are_left_out(tmp_path):
    carried = [file_name("extra_state", 4, r) for r in range(4)] + ["huggingface"]
    copies, note = extra_state_copies(tmp_path, carried, 2)
    assert [(src.name, name) for src, name in copies] == [
        (file_name("extra_state", 4, 0), file_name("extra_state", 2, 0)),
        (file_name("extra_state", 4, 1), file_name("extra_state", 2, 1)),
    ]
    assert (
        note == "the extra_state of SRC's 2 ranks 2, 3 is not in DST (a job of 2 has no such rank)"
    )


def test_a_broken_fsdp_config_is_named(tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(FSDP2, src)
    (src / "fsdp_config.json").write_text('{"FSDP_version": 3}')
    with pytest.raises(Exception, match='does not hold {"FSDP_version": 1 or 2') as info:
        api.inspect(api.InspectRequest(src=src))
    assert info.value.exit_code == 3


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


@reads_fsdp2_meshes
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("part", ["model", "optim"])
def test_a_malicious_pickle_in_a_rank_file_is_refused_and_never_run(payload, part, tmp_path):
    src = _copy(FSDP2, tmp_path)
    marker = tmp_path / "ran"
    with_data_pkl(src / file_name(part, 2, 1), PAYLOADS[payload](marker))
    with pytest.raises(UnsafePickleError) as info:
        api.convert(api.ConvertRequest(src=src, dst=tmp_path / "out.pt", to="full"))
    assert info.value.exit_code == 3 and str(info.value.path) == str(src / file_name(part, 2, 1))
    assert not marker.exists()


def test_a_missing_optimizer_rank_file_is_named(tmp_path):
    src = _copy(FSDP1, tmp_path)
    (src / file_name("optim", 2, 1)).unlink()
    with pytest.raises(BadInputError) as info:
        api.inspect(api.InspectRequest(src=src))
    assert info.value.line() == (
        f"'{src}': no file for rank 1 of 2 (optim_world_size_2_rank_1.pt): "
        "copy every rank's file of the checkpoint"
    )


def test_files_of_two_world_sizes_are_refused(tmp_path):
    src = _copy(FSDP2, tmp_path)
    shutil.copyfile(src / file_name("model", 2, 0), src / file_name("model", 4, 3))
    with pytest.raises(BadInputError, match="holds veRL files of jobs of 2, 4 ranks"):
        api.inspect(api.InspectRequest(src=src))


def test_a_flat_slice_of_another_size_is_refused(tmp_path):
    src = _copy(FSDP1, tmp_path)
    path = src / file_name("optim", 2, 1)
    state = torch.load(path, weights_only=True)
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"][:-1].clone()
    torch.save(state, path)
    with pytest.raises(BadInputError) as info:
        api.inspect(api.InspectRequest(src=src))
    assert info.value.exit_code == 3
    assert "'state.0.exp_avg' is [449], not the flat slice of 450 elements rank 0 holds" in (
        info.value.line()
    )


@pytest.mark.trainers
def test_a_wrap_that_makes_other_units_is_refused(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(BadInputError) as info:
        api.convert(
            api.ConvertRequest(
                src=FSDP1, dst=tmp_path / "full.pt", to="full", model="verl_models:qwen2"
            )
        )
    assert info.value.line() == (
        f"'{FSDP1 / file_name('optim', 2, 0)}': holds state for 3 flat parameters, but "
        "--model/--wrap wrap the model in 1 FSDP units: pass the --wrap classes veRL wrapped "
        "(each decoder layer is one unit)"
    )


def test_a_source_without_extra_state_says_how_to_load_without_it(tmp_path):
    assert extra_state_copies(tmp_path, ["huggingface"], 2) == (
        [],
        "SRC has no extra_state files (lr scheduler and RNG state), which veRL's manager "
        "loads on every rank: load DST with checkpoint.load_contents=['model', 'optimizer']",
    )


@pytest.mark.skipif(MESHES_READ, reason="this torch reads the FSDP2 golden's meshes")
def test_meshes_a_newer_torch_pickled_are_refused_with_one_line(tmp_path):
    with pytest.raises(UnsafePickleError, match=_NEW_MESH):
        api.inspect(api.InspectRequest(src=FSDP2))
