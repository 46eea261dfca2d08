"""``--format deepspeed`` under a launch of N ranks: each process writes the files of the target
ranks it acts for (ZeRO-3: their model-states files too), and together they are DeepSpeed's own
save at M (``tests/goldens/deepspeed/written``), file for file."""

from __future__ import annotations

import pytest
import ranks
from deepspeed_files import differences
from deepspeed_goldens import WRITTEN, run_dir
from harness import run_ranks


@pytest.mark.parametrize("entry", ["z2-bf16-M3", "z3-fp32-M3"])
def test_two_ranks_write_what_deepspeed_saves_at_m(tmp_path, entry):
    case, m = entry.rsplit("-M", 1)
    dst = tmp_path / "ds"
    options = {"format": "deepspeed", "world_size": int(m), "buffer_bytes": 256, "verify": True}
    results = run_ranks(ranks.convert, 2, str(run_dir(case)), str(dst), "local", options)
    assert all(r["verified"] for r in results)
    assert differences(dst, WRITTEN / entry) == []
