"""The real library, live: a ZeRO save DeepSpeed makes now reads as DeepSpeed's own tools read
it. Runs only where deepspeed (with huggingface_hub, which its zero_to_fp32.py imports) is
installed, ``pip install -e '.[deepspeed]'``: CI reads the goldens instead, since the first
DeepSpeed launch on a machine compiles an op for minutes (tests/goldens/deepspeed/README.md)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepspeed_goldens import GOLDENS, MOMENTS, bits_equal, run_dir, universal_states, zero_to_fp32

from shardckpt import api

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(1800)]
pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')"
)
pytest.importorskip("huggingface_hub", reason="zero_to_fp32.py imports huggingface_hub")


def make_module():
    """Return the goldens' make.py as a module."""
    spec = importlib.util.spec_from_file_location("deepspeed_make", GOLDENS / "make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["z2-bf16", "z3-fp32"])
def test_a_save_deepspeed_makes_now_converts_as_zero_to_fp32_and_ds_to_universal_read_it(
    tmp_path, name
):
    make_module().make(name, tmp_path)
    api.convert(api.ConvertRequest(src=run_dir(name, tmp_path), dst=tmp_path / "full.pt", to="full", verify=True))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    reference = zero_to_fp32(name, tmp_path)
    assert reference and all(bits_equal(full["model"][k], v) for k, v in reference.items())
    files = universal_states(name, root=tmp_path)
    assert set(files) == set(full["optim"]["state"])
    for fqn, state in full["optim"]["state"].items():
        for moment in MOMENTS:
            assert bits_equal(state[moment], files[fqn][moment]), (fqn, moment)
