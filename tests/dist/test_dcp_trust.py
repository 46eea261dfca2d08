"""A lying ``.metadata`` of a real FSDP2 / FSDP+TP checkpoint stops every rank with one line,
and empty mappings written as DCP load back into FSDP2 at another world size."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import empty_mapping_jobs
import meshes
import ranks
from harness import run_ranks
from reference import assert_trees_equal
from shardckpt import api
from shardckpt.cli.app import run

DAMAGED = (
    "the .metadata is damaged or was not written by torch.distributed.checkpoint; "
    "re-copy the checkpoint from where it was written"
)


def edit(ckpt, change) -> None:
    """Apply ``change`` to the ``Metadata`` object in ``ckpt/.metadata`` and write it back."""
    path = ckpt / ".metadata"
    md = pickle.loads(path.read_bytes())
    change(md)
    path.write_bytes(pickle.dumps(md))


def drop_middle_row(md) -> None:
    # gate_down.weight is 3x7: FSDP2 at 4 stored rows 0, 1, 2 and an empty chunk.
    chunks = md.state_dict_metadata["model.blocks.0.gate_down.weight"].chunks
    chunks[:] = [c for c in chunks if list(c.offsets) != [1, 0]]


def test_a_dropped_chunk_is_refused_instead_of_written_as_uninitialised_memory(
    capsys, fsdp2_ckpt, tmp_path
):
    shutil.copytree(fsdp2_ckpt.dcp, tmp_path / "src")
    edit(tmp_path / "src", drop_middle_row)
    code = run(["convert", str(tmp_path / "src"), str(tmp_path / "out.pt"), "--to", "full"])
    assert (code, capsys.readouterr().err.strip().splitlines()[-1]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'src' / '.metadata'}': the chunks of "
        f"'model.blocks.0.gate_down.weight' cover 14 of its 21 elements: {DAMAGED}",
    )
    assert not (tmp_path / "out.pt").exists()


def test_a_lying_metadata_stops_every_rank_with_the_one_error(fsdp2_ckpt, tmp_path):
    shutil.copytree(fsdp2_ckpt.dcp, tmp_path / "src")
    edit(tmp_path / "src", drop_middle_row)
    src = str(tmp_path / "src")
    results = run_ranks(ranks.convert_expecting_failure, 2, [src, src], str(tmp_path / "out"), "sharded")
    line = (
        f"'{tmp_path / 'src' / '.metadata'}': the chunks of "
        f"'model.blocks.0.gate_down.weight' cover 14 of its 21 elements: {DAMAGED}"
    )
    assert results == [("BadInputError", 3, line), ("RemoteRankError", 3, f"rank 0 failed: {line}")]
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory):
    """Return a DCP directory saved by FSDP (dp 2) over tensor parallelism (tp 2)."""
    root = tmp_path_factory.mktemp("fsdp_tp")
    run_ranks(meshes.train_fsdp_tp, 4, str(root / "dcp"), str(root / "ref.pt"))
    return root / "dcp"


def test_two_d_chunks_that_overlap_are_refused(capsys, fsdp_tp, tmp_path):
    # fc_out.weight (48x6) is Shard(0) over dp and Shard(1) over tp: a 2x2 grid of 24x3 chunks.
    shutil.copytree(fsdp_tp, tmp_path / "src")

    def shift_column(md):
        (chunk,) = [
            c
            for c in md.state_dict_metadata["model.fc_out.weight"].chunks
            if list(c.offsets) == [24, 3]
        ]
        chunk.offsets = torch.Size([24, 2])

    assert run(["inspect", str(tmp_path / "src")]) == 0
    capsys.readouterr()
    edit(tmp_path / "src", shift_column)
    assert run(["inspect", str(tmp_path / "src")]) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"shardckpt: error: '{tmp_path / 'src' / '.metadata'}': the chunks at [24, 0] and "
        f"[24, 2] of 'model.fc_out.weight' overlap: {DAMAGED}"
    )


def test_empty_mappings_written_as_dcp_resume_fsdp2_at_another_world_size(tmp_path):
    run_ranks(empty_mapping_jobs.save_full_state, 2, str(tmp_path / "ref.pt"))
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert ref["optim"]["state"] == {}  # SGD without momentum keeps no state
    api.convert(api.ConvertRequest(src=tmp_path / "ref.pt", dst=tmp_path / "dcp", to="sharded", world_size=3))

    assert api.diff(api.DiffRequest(a=tmp_path / "ref.pt", b=tmp_path / "dcp")).equal
    assert [o.path for o in api.inspect(api.InspectRequest(src=tmp_path / "dcp")).optimizers] == [("optim",)]
    resumed = run_ranks(empty_mapping_jobs.resume, 3, str(tmp_path / "dcp"))[0]
    assert_trees_equal(resumed, ref)
    # torch's converter sees every {} but the top-level one (see dcp_write._SavePlanner).
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    assert_trees_equal(
        torch.load(tmp_path / "back.pt", weights_only=True),
        {k: v for k, v in ref.items() if k != "extra"},
    )
