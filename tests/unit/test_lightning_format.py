"""The ``lightning`` format in one process: directories saved by Lightning's own two calls.

Lightning's sharded save is ``_distributed_checkpoint_save`` (``dcp.save``) of the
modules' and optimizers' state, then ``torch.save`` of everything else to ``meta.pt``;
these tests make such directories with exactly those calls, and compare with
Lightning's own consolidation (``_load_distributed_checkpoint``). The whole training
run with Fabric at 2 and 3 ranks is ``tests/dist/test_lightning.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from reference import assert_trees_equal

from shardckpt import api
from shardckpt.core.errors import BadInputError, UnsafePickleError
from shardckpt.formats import detect
from shardckpt.formats.trainers.lightning import in_meta
from shardckpt.state.tree import TensorMeta

pytestmark = pytest.mark.trainers

lightning_load = pytest.importorskip("lightning.fabric.utilities.load")
lightning_fsdp = pytest.importorskip("lightning.fabric.strategies.fsdp")


@dataclasses.dataclass
class Settings:
    """A user's object in meta.pt: weights_only cannot rebuild it."""

    depth: int = 2


def model_state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"fc.weight": torch.randn(7, 3, generator=gen), "fc.bias": torch.randn(7, generator=gen)}


def save_like_lightning(path: Path, state: dict, meta: dict) -> Path:
    """Save ``state`` and ``meta`` as Lightning's sharded ``save_checkpoint`` does."""
    path.mkdir(parents=True)
    lightning_fsdp._distributed_checkpoint_save(state, path)
    torch.save(meta, path / lightning_load._METADATA_FILENAME)
    return path


def test_a_dcp_directory_with_meta_pt_is_detected_as_lightning(tmp_path):
    ckpt = save_like_lightning(tmp_path / "ckpt", {"model": model_state()}, {"step": 3})
    assert detect(ckpt) == "lightning"
    (ckpt / "meta.pt").unlink()
    assert detect(ckpt) == "dcp"
    with pytest.raises(BadInputError) as info:
        api.inspect(api.InspectRequest(src=ckpt, format="lightning"))
    assert info.value.line() == (
        f"'{ckpt}': no 'meta.pt' in this directory: a Lightning checkpoint has one beside the "
        "DCP files; read the DCP part alone with --from dcp"
    )


def test_meta_pt_extras_with_tensors_and_int_keys_convert_as_lightning_consolidates(tmp_path):
    meta = {"step": 3, "rng": torch.arange(5, dtype=torch.uint8), "sched": {0: 0.5, 1: (1, 2)}}
    ckpt = save_like_lightning(tmp_path / "ckpt", {"model": model_state()}, meta)
    index = api.inspect(api.InspectRequest(src=ckpt)).index
    assert (index.format, [(p.file, p.key) for p in index.parts]) == (
        "lightning",
        [("meta.pt", "step"), ("meta.pt", "rng"), ("meta.pt", "sched")],
    )
    api.convert(api.ConvertRequest(src=ckpt, dst=tmp_path / "full.pt", to="full", verify=True))
    consolidated = lightning_load._load_distributed_checkpoint(ckpt)
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), consolidated)
    # Back to Lightning's layout at 2: meta.pt keeps its keys' types and its tensors.
    api.convert(
        api.ConvertRequest(
            src=ckpt,
            dst=tmp_path / "at2",
            to="sharded",
            format="lightning",
            world_size=2,
            verify=True,
        )
    )
    assert_trees_equal(torch.load(tmp_path / "at2" / "meta.pt", weights_only=True), meta)
    assert_trees_equal(lightning_load._load_distributed_checkpoint(tmp_path / "at2"), consolidated)


def test_an_unsafe_meta_pt_is_named_with_the_trust_hint(tmp_path):
    ckpt = save_like_lightning(
        tmp_path / "ckpt", {"model": model_state()}, {"step": 3, "settings": Settings()}
    )
    with pytest.raises(UnsafePickleError) as info:
        api.inspect(api.InspectRequest(src=ckpt))
    assert info.value.line() == (
        f"'{ckpt / 'meta.pt'}': refused to unpickle (names test_lightning_format.Settings, "
        "not on the weights-only allow-list): pass --trust-pickle only if you trust this file"
    )
    trusted = api.inspect(api.InspectRequest(src=ckpt, trust_pickle=True)).index.tree
    assert trusted["settings"] == Settings()


def test_a_key_in_both_parts_is_refused_rather_than_one_dropped(tmp_path):
    ckpt = save_like_lightning(
        tmp_path / "ckpt", {"model": model_state(), "step": torch.tensor(1)}, {"step": 3}
    )
    with pytest.raises(BadInputError) as info:
        api.inspect(api.InspectRequest(src=ckpt))
    assert info.value.line() == (
        f"'{ckpt}': 'step' is both in meta.pt and in the DCP data, and Lightning's "
        "consolidation would keep only meta.pt's: read the DCP part alone with --from dcp"
    )


def test_a_tree_from_elsewhere_keeps_module_and_optimizer_state_in_dcp(tmp_path):
    """A consolidated file back to Lightning's layout: what Lightning would put where."""
    model = torch.nn.Linear(3, 7)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    optim.step()
    full = {
        "model": model.state_dict(),
        "optimizer": optim.state_dict(),
        "step": 1,
        "rng": torch.arange(3),
        "loops": {"fit": {"epoch": 0, "best": torch.tensor(0.5)}},
    }
    torch.save(full, tmp_path / "full.pt")
    out = tmp_path / "lit"
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "full.pt", dst=out, to="sharded", format="lightning", world_size=2
        )
    )
    meta = torch.load(out / "meta.pt", weights_only=True)
    assert list(meta) == ["step", "rng", "loops"]
    # DCP stores every key as str: the optimizer's param IDs come back as "0", "1".
    state = {str(k): v for k, v in full["optimizer"]["state"].items()}
    expected = {**full, "optimizer": {**full["optimizer"], "state": state}}
    assert_trees_equal(lightning_load._load_distributed_checkpoint(out), expected)


def test_in_meta_is_lightnings_rule_for_a_tree_that_does_not_say():
    w = TensorMeta("w", (7, 3), torch.float32)
    assert not in_meta("model", {"fc.weight": w})
    assert not in_meta("optimizer", {"state": {}, "param_groups": []})
    assert in_meta("step", 3)
    assert in_meta("rng", w)
    assert in_meta("loops", {"epoch": 0, "best": w})
    assert in_meta("callbacks", {})
