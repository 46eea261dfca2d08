"""An output does not depend on how many processes wrote it: byte-identical at N = 1, 2 and 3.

Every rank writes its own part of DST (its rows of a full file, the files of the
target ranks it acts for), so this is what shows the parts fit together the same way
whatever the split: three processes for four target ranks split every tensor and the
rank files unevenly. The ranks are real gloo ranks (``harness.run_ranks``) running
``api.convert`` as the CLI does under torchrun (the CLI itself under torchrun is
tests/e2e/test_torchrun_cli.py's).
"""

from __future__ import annotations

import pytest
import ranks
from harness import run_ranks
from rank_bytes import file_hashes

from shardckpt import api

MODEL = {
    "only": "model",
    "model": "make_checkpoint:build_model",
    "wraps": ["make_checkpoint:Block"],
}
CASES = {
    "torch": ("full.pt", "full", {}),
    "safetensors": ("full.safetensors", "full", {}),
    "hf": ("hf", "full", {"format": "hf", "max_shard_size": 20_000}),
    "dcp": ("dcp", "sharded", {"world_size": 4}),
    "fsdp2-ranks": ("ranks", "local", {"world_size": 4}),
    "fsdp1-sharded": ("fsdp1s", "local", {"format": "fsdp1-sharded", "world_size": 4}),
    "fsdp1-local": ("fsdp1l", "local", {"format": "fsdp1-local", "world_size": 4, **MODEL}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", list(CASES))
def test_the_output_is_byte_identical_at_one_two_and_three_processes(fsdp2_ckpt, tmp_path, fmt):
    name, to, kwargs = CASES[fmt]
    outputs = {}
    for n in (1, 2, 3):
        dst = tmp_path / f"n{n}" / name
        if n == 1:
            api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=dst, to=to, **kwargs))
        else:
            run_ranks(ranks.convert, n, str(fsdp2_ckpt.dcp), str(dst), to, kwargs)
        outputs[n] = file_hashes(dst)
    assert outputs[1], "nothing was written"
    assert outputs[2] == outputs[1]
    assert outputs[3] == outputs[1]
