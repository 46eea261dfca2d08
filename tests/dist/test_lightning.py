"""Acceptance (issue 11): Lightning Fabric's sharded checkpoints, saved and loaded by Fabric itself.

Fabric (``FSDPStrategy(state_dict_type="sharded")``, FSDP1, and ``ModelParallelStrategy``
with FSDP2) trains a tiny model two steps at 2 gloo ranks and saves; shardckpt inspects it, exports it whole (equal to Lightning's
own consolidation, ``meta.pt``'s extras included) and writes Lightning's layout for 3
ranks, which ``fabric.load`` at 3 takes as it is: the resumed step equals, bit for bit,
the control, Fabric's own load of the 2-rank checkpoint at 3 (DCP reshards it).
"""

from __future__ import annotations

import pytest
import torch
from reference import assert_trees_equal

import lightning_jobs
from harness import run_ranks
from shardckpt import api
from shardckpt.cli import render

pytestmark = pytest.mark.trainers
lightning_load = pytest.importorskip("lightning.fabric.utilities.load")


@pytest.fixture(scope="module", params=["fsdp", "model_parallel"])
def fabric_ckpt(request, tmp_path_factory):
    """Return Fabric's sharded checkpoint saved at 2 ranks after 2 steps, the state it saved, the strategy."""
    root = tmp_path_factory.mktemp(f"lightning_{request.param}")
    path = str(root / "ckpt")
    saved = run_ranks(lightning_jobs.train_and_save, 2, path, 2, request.param, timeout=300)[0]
    return root / "ckpt", saved, request.param


def test_inspect_shows_the_dcp_part_and_what_meta_pt_holds(fabric_ckpt):
    ckpt, _, _ = fabric_ckpt
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]
    insp = api.inspect(api.InspectRequest(src=ckpt))
    assert (insp.index.format, insp.index.world_size) == ("lightning", 2)
    assert [(p.file, p.key) for p in insp.index.parts] == [("meta.pt", "step"), ("meta.pt", "note")]
    assert [o.path for o in insp.optimizers] == [("optimizer",)]
    assert "\nfiles:\n  meta.pt: step (torch)\n  meta.pt: note (torch)\n" in render.inspection_text(
        insp
    )
    assert [(p["file"], p["key"]) for p in render.inspection_json(insp)["parts"]] == [
        ("meta.pt", "step"),
        ("meta.pt", "note"),
    ]


def test_full_equals_lightnings_own_consolidation(fabric_ckpt, tmp_path):
    ckpt, _, _ = fabric_ckpt
    api.convert(api.ConvertRequest(src=ckpt, dst=tmp_path / "full.pt", to="full", verify=True))
    ours = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_trees_equal(ours, lightning_load._load_distributed_checkpoint(ckpt))
    assert (ours["step"], ours["note"]) == (2, "lit")


def test_lightning_layout_at_3_resumes_in_fabric_like_fabrics_own_reshard(fabric_ckpt, tmp_path):
    ckpt, saved, strategy = fabric_ckpt
    out = tmp_path / "at3"
    # No --format: a trainer's checkpoint converted to its layout keeps its trainer's format.
    result = api.convert(api.ConvertRequest(src=ckpt, dst=out, to="sharded", world_size=3, verify=True))
    assert result.format == "lightning"
    assert sorted(p.name for p in out.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "meta.pt",
    ]
    assert torch.load(out / "meta.pt", weights_only=True) == {"step": 2, "note": "lit"}
    control = run_ranks(lightning_jobs.load_and_step, 3, str(ckpt), strategy, timeout=300)[0]
    resumed = run_ranks(lightning_jobs.load_and_step, 3, str(out), strategy, timeout=300)[0]
    assert_trees_equal(control["loaded"], saved)
    assert_trees_equal(resumed, control)
    assert resumed["extras"] == {"step": 2, "note": "lit"}


def test_format_lightning_writes_what_the_default_writes_and_format_dcp_a_bare_dcp(
    fabric_ckpt, tmp_path
):
    ckpt, _, _ = fabric_ckpt
    default = api.convert(api.ConvertRequest(src=ckpt, dst=tmp_path / "default", to="sharded", world_size=3))
    named = api.convert(api.ConvertRequest(src=ckpt, dst=tmp_path / "named", to="sharded", format="lightning", world_size=3))
    bare = api.convert(api.ConvertRequest(src=ckpt, dst=tmp_path / "bare", to="sharded", format="dcp", world_size=3))
    assert (default.format, named.format, bare.format) == ("lightning", "lightning", "dcp")
    names = sorted(p.name for p in (tmp_path / "default").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "named").iterdir())
    for name in names:
        assert (tmp_path / "default" / name).read_bytes() == (
            tmp_path / "named" / name
        ).read_bytes()
    assert "meta.pt" in names and not (tmp_path / "bare" / "meta.pt").exists()
