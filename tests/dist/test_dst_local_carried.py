"""Files an accelerate source carries, written to DST on the nodes' own disks: each node's
copy keeps the source's permission bits (issue 24 item 2), as a shared DST does."""

from __future__ import annotations

import stat
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ranks
from harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def test_a_private_carried_file_stays_private_on_every_nodes_disk(tmp_path):
    src = tmp_path / "checkpoint_0"
    src.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": {"w": torch.arange(21.0).reshape(7, 3)}},
            checkpoint_id=src / "pytorch_model_fsdp_0",
            no_dist=True,
        )
    for rank in (0, 1):
        torch.save({"step": 2, "rank": rank}, src / f"random_states_{rank}.pkl")
        (src / f"random_states_{rank}.pkl").chmod(0o600)
    dsts = []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        dsts.append(str(tmp_path / f"node{node}" / "out"))
    kwargs = {"format": "accelerate", "world_size": 2}
    run_ranks(ranks.convert_to_own, 2, str(src), dsts, "sharded", kwargs)
    for dst in map(Path, dsts):
        for rank in (0, 1):
            copied = dst / f"random_states_{rank}.pkl"
            assert copied.read_bytes() == (src / copied.name).read_bytes()
            assert stat.S_IMODE(copied.stat().st_mode) == 0o600
