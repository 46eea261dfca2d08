"""Acceptance: per-rank FSDP2 ``torch.save`` files (``fsdp2-ranks``), written by shardckpt for
any M and by real FSDP2 jobs, load into FSDP2 and convert to what the job holds."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import fsdp2_ranks_jobs as jobs
import ranks
from harness import run_ranks
from reference import assert_trees_equal, load_dcp_into_fsdp2
from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.formats.fsdp2.reader import quiet_mesh_unpickling
from shardckpt.state.tree import walk


@dataclass(frozen=True)
class RankFiles:
    """Per-rank files saved by a real FSDP2 job and the job's full state."""

    dir: Path
    full: dict


def _save(root: Path, world_size: int, id_keyed: bool = False) -> RankFiles:
    root.mkdir()
    full = run_ranks(jobs.save_rank_files, world_size, str(root), id_keyed)[0]
    return RankFiles(root, full)


@pytest.fixture(scope="module")
def ref(fsdp2_ckpt):
    return torch.load(fsdp2_ckpt.ref, weights_only=True)


@pytest.fixture(scope="module")
def job4(tmp_path_factory):
    """Files ``rank{r}.pt`` of a real FSDP2 job at 4 (FQN-keyed optimizer state)."""
    return _save(tmp_path_factory.mktemp("job4") / "ranks", 4)


@pytest.fixture(scope="module")
def at2(fsdp2_ckpt, tmp_path_factory):
    """The session's FSDP2 DCP checkpoint at 4 converted standalone to ``fsdp2-ranks`` at 2."""
    dst = tmp_path_factory.mktemp("at2") / "ranks"
    result = api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=dst, to="local", world_size=2, verify=True))
    assert (result.format, result.layout, result.verified) == ("fsdp2-ranks", "local", True)
    return dst


def names(directory: Path) -> list[str]:
    """Return the sorted file names of a directory."""
    return sorted(p.name for p in directory.iterdir())


def shape_of(leaf) -> tuple:
    """Return what a rank holds of a leaf: type, local shape, placements (or the value)."""
    if isinstance(leaf, DTensor):
        return ("DTensor", tuple(leaf.shape), tuple(leaf.to_local().shape), leaf.placements)
    if isinstance(leaf, torch.Tensor):
        return ("Tensor", tuple(leaf.shape), leaf.dtype)
    return ("value", type(leaf).__name__)


def test_fsdp2_dcp_at_4_to_rank_files_at_2_loads_into_fsdp2_at_2(at2, ref):
    assert names(at2) == ["rank_0.pt", "rank_1.pt"]
    assert_trees_equal(run_ranks(jobs.load_rank_files, 2, str(at2))[0], ref)


def test_each_file_holds_what_rank_r_of_fsdp2_at_2_saves(at2, tmp_path):
    theirs = _save(tmp_path / "job2", 2).dir
    for r in range(2):
        ours = torch.load(at2 / f"rank_{r}.pt", weights_only=True)
        real = torch.load(theirs / f"rank{r}.pt", weights_only=True)
        assert [(p, shape_of(v)) for p, v in walk(ours)] == [(p, shape_of(v)) for p, v in walk(real)]


def test_rank_files_of_a_real_fsdp2_job_at_4_convert_to_its_full_state(job4, tmp_path):
    api.convert(api.ConvertRequest(src=job4.dir, dst=tmp_path / "full.pt", to="full"))
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), job4.full)


def test_rank_files_at_4_to_dcp_at_2_load_into_fsdp2_at_2(job4, tmp_path):
    api.convert(api.ConvertRequest(src=job4.dir, dst=tmp_path / "dcp2", to="sharded", world_size=2))
    assert_trees_equal(load_dcp_into_fsdp2(tmp_path / "dcp2", 2), job4.full)


def test_id_keyed_rank_files_at_4_reshard_to_2_and_load_with_optimizer_load_state_dict(tmp_path):
    job = _save(tmp_path / "job4id", 4, id_keyed=True)
    api.convert(api.ConvertRequest(src=job.dir, dst=tmp_path / "at2", to="local", world_size=2))
    assert_trees_equal(run_ranks(jobs.load_rank_files, 2, str(tmp_path / "at2"), True)[0], job.full)


@pytest.mark.parametrize("to, world_size", [("local", 3), ("full", None)])
def test_two_ranks_convert_rank_files_to_the_same_bytes_as_one(job4, tmp_path, to, world_size):
    kwargs = {"world_size": world_size} if world_size else {}
    api.convert(api.ConvertRequest(src=job4.dir, dst=tmp_path / "one", to=to, **kwargs))
    run_ranks(ranks.convert, 2, str(job4.dir), str(tmp_path / "two"), to, kwargs)
    one, two = tmp_path / "one", tmp_path / "two"
    if to == "local":
        assert names(one) == names(two) == ["rank_0.pt", "rank_1.pt", "rank_2.pt"]
        for name in names(one):
            assert (one / name).read_bytes() == (two / name).read_bytes(), name
    else:
        assert one.read_bytes() == two.read_bytes()


def test_inspect_names_the_layout_of_each_tensor(job4, capsys):
    assert run(["inspect", str(job4.dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "fsdp2-ranks" and doc["world_size"] == 4
    layouts = {tuple(e["path"]): e["layout"] for e in doc["entries"] if e["kind"] == "tensor"}
    assert layouts[("model", "embed.weight")] == "Shard(0) over 4"
    assert layouts[("model", "pos_scale")] == "full"
    assert layouts[("optim", "state", "embed.weight", "step")] == "full"
    assert doc["entries"][0]["shape"] == list(job4.full["model"][doc["entries"][0]["path"][1]].shape)


def _error_line(args: list[str], capsys) -> tuple[int, str]:
    code = run(args)
    return code, capsys.readouterr().err.strip()


def test_a_missing_rank_file_is_named(job4, tmp_path, capsys):
    src = shutil.copytree(job4.dir, tmp_path / "ranks")
    (src / "rank2.pt").unlink()
    assert _error_line(["inspect", str(src)], capsys) == (
        3,
        f"shardckpt: error: '{src}': no file for rank 2 of 4 (rank2.pt): copy every rank's file "
        "of the checkpoint",
    )


def test_files_of_different_world_sizes_are_refused(job4, at2, tmp_path, capsys):
    src = tmp_path / "mixed"
    src.mkdir()
    for r in range(2):
        shutil.copy(at2 / f"rank_{r}.pt", src / f"rank{r}.pt")
    for r in range(2, 4):
        shutil.copy(job4.dir / f"rank{r}.pt", src / f"rank{r}.pt")
    assert _error_line(["convert", str(src), str(tmp_path / "out.pt"), "--to", "full"], capsys) == (
        3,
        f"shardckpt: error: '{src / 'rank2.pt'}': its DTensors are over 4 ranks, those of "
        "'rank0.pt' over 2: the directory mixes files of jobs with different world sizes; "
        "keep one job's files",
    )


def test_files_without_dtensors_are_refused(fsdp2_ckpt, tmp_path, capsys):
    src = tmp_path / "plain"
    src.mkdir()
    for r in range(2):
        shutil.copy(fsdp2_ckpt.ref, src / f"rank{r}.pt")
    assert _error_line(["inspect", str(src)], capsys) == (
        3,
        f"shardckpt: error: '{src / 'rank0.pt'}': holds no DTensor, so it is not an FSDP2 "
        "per-rank file: pass a directory of FSDP2 per-rank files, or a full checkpoint file itself",
    )


@pytest.mark.parametrize(
    "kind, fqn, layout",
    [
        ("hsdp", "embed.weight", "Replicate×Shard(0) over 2×2"),
        ("fsdp_tp", "fc_out.weight", "Shard(0)×Shard(1) over 2×2"),
    ],
)
def test_two_d_rank_files_convert_to_the_jobs_full_state(tmp_path, capsys, kind, fqn, layout):
    src = tmp_path / "ranks"
    src.mkdir()
    full = run_ranks(jobs.save_2d_rank_files, 4, str(src), kind)[0]
    assert run(["inspect", str(src), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layouts = {tuple(e["path"]): e["layout"] for e in doc["entries"] if e["kind"] == "tensor"}
    assert layouts[("model", fqn)] == layout
    run_ranks(ranks.convert, 2, str(src), str(tmp_path / "full.pt"), "full", {})
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), full)


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    """Two saves (after steps 2 and 3) of one FSDP2 job at 2: ``step2/`` and ``step3/``."""
    root = tmp_path_factory.mktemp("two_saves")
    run_ranks(jobs.save_two_saves, 2, str(root))
    return root


def test_rank_files_of_two_saves_are_refused_naming_both(two_saves, tmp_path, capsys):
    src = tmp_path / "mixed"
    src.mkdir()
    shutil.copy(two_saves / "step2" / "rank0.pt", src / "rank0.pt")
    shutil.copy(two_saves / "step3" / "rank1.pt", src / "rank1.pt")
    assert _error_line(["convert", str(src), str(tmp_path / "out.pt"), "--to", "full"], capsys) == (
        3,
        f"shardckpt: error: '{src / 'rank1.pt'}': 'optim.state.embed.weight.step' is 3.0 here "
        "but 2.0 in 'rank0.pt': keep one save's rank files in the directory",
    )
    assert not (tmp_path / "out.pt").exists()
    assert run(["convert", str(two_saves / "step3"), str(tmp_path / "one.pt"), "--to", "full"]) == 0


def test_a_dtensor_whose_local_shard_contradicts_its_metadata_is_refused(
    two_saves, tmp_path, capsys
):
    src = shutil.copytree(two_saves / "step3", tmp_path / "edited")
    with quiet_mesh_unpickling():  # the mesh's process groups are not in this process
        state = torch.load(src / "rank1.pt", weights_only=True)
    weight = state["model"]["embed.weight"]  # 97 rows: 49 on rank 0, 48 on rank 1
    # The DTensor still says rank 1 holds 48 rows, but holds one less.
    state["model"]["embed.weight"] = DTensor.from_local(
        weight.to_local()[:-1].clone(),
        weight.device_mesh,
        weight.placements,
        run_check=False,
        shape=weight.shape,
        stride=weight.stride(),
    )
    torch.save(state, src / "edited.tmp")
    os.replace(src / "edited.tmp", src / "rank1.pt")
    assert _error_line(["inspect", str(src)], capsys) == (
        3,
        f"shardckpt: error: '{src / 'rank1.pt'}': 'model.embed.weight' holds a local shard of "
        "[47, 48], but its DTensor gives this rank [48, 48]: the file is damaged or was edited; "
        "re-copy it from where the job saved it",
    )
