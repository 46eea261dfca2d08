"""Megatron's golden converted by 2 real gloo ranks: the same bytes as one process writes.

The ranks split the rows of a full file and the target ranks' DCP files; ``common.pt`` and
``metadata.json`` are the coordinator's. No megatron-core needed (its own load of the
output is ``test_megatron.py``'s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ranks
from harness import run_ranks
from rank_bytes import file_hashes

from shardckpt import api

GOLDEN = Path(__file__).resolve().parents[1] / "goldens" / "megatron" / "gpt-tp2"
CASES = {
    "full": ("full.pt", "full", {}),
    "megatron": ("at3", "sharded", {"format": "megatron", "world_size": 3}),
    "dcp": ("dcp", "sharded", {"format": "dcp", "world_size": 3}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_write_what_one_writes(tmp_path, case):
    src = str(GOLDEN)
    name, to, kwargs = CASES[case]
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "n1" / name, to=to, **kwargs))
    run_ranks(ranks.convert, 2, src, str(tmp_path / "n2" / name), to, {**kwargs, "verify": True})
    one = file_hashes(tmp_path / "n1" / name)
    assert one and file_hashes(tmp_path / "n2" / name) == one
