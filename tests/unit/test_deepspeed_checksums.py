"""A flipped byte in a DeepSpeed save stops ``convert`` (exit 3), as it stops ``verify``.

The DeepSpeed reader took each parameter's fp32 master and Adam moments from its
files' memory maps directly: nothing it read was noted against the CRC-32 ``torch.save``
wrote for each record, so a flipped bit in an optimizer partition went into DST with
exit 0 while ``verify`` of the same save said exit 3. Each piece is now read (``pread``)
and noted, as every other reader's bytes are.
"""

from __future__ import annotations

import damage
import pytest
from deepspeed_files import copy_run, deepspeed_classes
from deepspeed_goldens import run_dir

from shardckpt.cli import run

OPTIM = "optimizer_state_dict"
CASES = [
    # ZeRO-2: a moment in rank 0's flat partition, the fp32 master partition of rank 1.
    (
        "z2-bf16",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        f"{OPTIM}.base_optimizer_state.state.0.exp_avg",
    ),
    (
        "z2-bf16",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        f"{OPTIM}.single_partition_of_fp32_groups.0",
    ),
    # ZeRO-3: its per-rank fp32 flat groups.
    ("z3-fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt", f"{OPTIM}.fp32_flat_groups.0"),
]


@pytest.mark.parametrize(
    ("case", "file", "tensor"), CASES, ids=[c[2].rsplit(".", 2)[-2] + "-" + c[0] for c in CASES]
)
@pytest.mark.parametrize(
    "to",
    [("out.pt", "--to", "full"), ("out", "--to", "sharded", "--world-size", "3")],
    ids=["full", "sharded"],
)
def test_a_flipped_byte_in_a_partition_stops_convert(tmp_path, capsys, case, file, tensor, to):
    src = copy_run(run_dir(case), tmp_path)
    with deepspeed_classes():
        flipped = damage.flip_in_torch_file(src / "global_step3" / file, tensor, weights_only=False)
    dst = tmp_path / to[0]
    code = run(["convert", str(src), str(dst), *to[1:]])
    assert (code, capsys.readouterr().err.strip().splitlines()) == (3, [flipped.line()])
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if ".shardckpt-" in p.name] == []
