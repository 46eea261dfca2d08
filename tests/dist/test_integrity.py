"""Acceptance: a byte flipped in tensor data torch wrote is found by convert, diff and verify.

torch writes a CRC-32 for every zip record and never reads it. Each checkpoint here is
written by torch itself (``dcp.save`` by FSDP2, ``torch.save`` of the full state, FSDP2
and FSDP1 jobs saving their per-rank files on gloo ranks); one byte of one tensor's data
is flipped where torch's own loader says that tensor lies (``damage.py``), and every
command must exit 3 with the line that names the file, the tensor and the record. The
same files unflipped pass.
"""

from __future__ import annotations

from pathlib import Path

import damage
import fsdp1_jobs
import fsdp2_ranks_jobs
import pytest
import ranks
from harness import run_ranks

from shardckpt.cli.app import run

FSDP1_MODEL = ["--model", "fsdp1_jobs:build_model", "--wrap", "fsdp1_jobs:Block"]


@pytest.fixture(scope="module")
def rank_files(tmp_path_factory) -> Path:
    """FSDP2 per-rank files (``fsdp2/``) and FSDP1's (``local/``, ``sharded/``), saved by 2-rank jobs."""
    root = tmp_path_factory.mktemp("rank_files")
    (root / "fsdp2").mkdir()
    run_ranks(fsdp2_ranks_jobs.save_rank_files, 2, str(root / "fsdp2"), timeout=300)
    run_ranks(fsdp1_jobs.save, 2, str(root), False, timeout=300)
    return root


def cli(capsys, *argv) -> tuple[int, list[str]]:
    """Run the CLI in this process; return its exit code and stderr lines."""
    code, _, err = run_cli(capsys, *argv)
    return code, err


def run_cli(capsys, *argv) -> tuple[int, str, list[str]]:
    """Run the CLI in this process; return its exit code, stdout and stderr lines."""
    code = run([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def assert_damaged(capsys, flipped: damage.Flipped, *argv) -> None:
    code, err = cli(capsys, *argv)
    assert (code, err) == (3, [flipped.line()])


def assert_clean(capsys, *argv) -> None:
    code, err = cli(capsys, *argv)
    assert (code, err) == (0, [])


def test_a_flipped_byte_in_a_dcp_data_file_stops_convert_and_diff(fsdp2_ckpt, tmp_path, capsys):
    src = damage.copy(fsdp2_ckpt.dcp, tmp_path / "dcp")
    clean = damage.copy(fsdp2_ckpt.dcp, tmp_path / "clean")
    key = "optim.state.embed.weight.exp_avg"
    flipped = damage.flip_in_dcp(src, key, offsets=(25, 0))
    assert flipped.file.name == "__1_0.distcp"
    assert_damaged(capsys, flipped, "convert", src, tmp_path / "full.pt", "--to", "full")
    assert not (tmp_path / "full.pt").exists()
    assert_damaged(capsys, flipped, "verify", src, "-q")
    assert_damaged(capsys, flipped, "inspect", src, "--verify")
    assert_damaged(capsys, flipped, "diff", src, fsdp2_ckpt.ref)
    assert_damaged(capsys, flipped, "diff", clean, src)
    assert_clean(capsys, "convert", clean, tmp_path / "ok.pt", "--to", "full", "-q")
    assert_clean(capsys, "diff", clean, fsdp2_ckpt.ref, "-q")
    assert_clean(capsys, "verify", clean, "-q")


def test_a_flipped_byte_in_a_dcp_data_file_stops_a_two_rank_convert(fsdp2_ckpt, tmp_path):
    src = damage.copy(fsdp2_ckpt.dcp, tmp_path / "dcp")
    flipped = damage.flip_in_dcp(src, "model.head.weight")
    dst = str(tmp_path / "out")
    results = run_ranks(ranks.convert_expecting_failure, 2, [str(src)] * 2, dst, "sharded")
    line = flipped.line().removeprefix("shardckpt: error: ")
    assert results[0] == ("BadInputError", 3, line)
    assert results[1][1] == 3
    assert not Path(dst).exists()


def test_a_flipped_byte_in_a_full_torch_file_stops_convert_and_diff(fsdp2_ckpt, tmp_path, capsys):
    src = damage.copy(fsdp2_ckpt.ref, tmp_path / "full.pt")
    flipped = damage.flip_in_torch_file(src, "model.head.weight")
    out = tmp_path / "out"
    assert_damaged(capsys, flipped, "convert", src, out, "--to", "sharded", "--world-size", 2)
    assert not out.exists()
    assert_damaged(capsys, flipped, "diff", fsdp2_ckpt.dcp, src)
    assert_damaged(capsys, flipped, "verify", src, "-q")
    assert_damaged(capsys, flipped, "inspect", src, "--verify")
    assert_clean(capsys, "convert", fsdp2_ckpt.ref, out, "--to", "sharded", "--world-size", 2, "-q")
    assert_clean(capsys, "verify", fsdp2_ckpt.ref, "-q")


def test_a_flipped_byte_in_a_padded_fsdp2_rank_file_stops_convert_and_diff(
    rank_files, tmp_path, capsys
):
    src = damage.copy(rank_files / "fsdp2", tmp_path / "fsdp2")
    # 97 rows over 2 ranks: rank 1's 48 rows view a storage FSDP2 padded to 49.
    flipped = damage.flip_in_torch_file(src / "rank1.pt", "model.embed.weight")
    assert_damaged(capsys, flipped, "convert", src, tmp_path / "full.pt", "--to", "full")
    assert_damaged(capsys, flipped, "diff", rank_files / "fsdp2", src)
    assert_damaged(capsys, flipped, "verify", src, "-q")
    assert_damaged(capsys, flipped, "inspect", src, "--verify", "--json")
    assert_clean(capsys, "convert", rank_files / "fsdp2", tmp_path / "ok.pt", "--to", "full", "-q")
    assert_clean(capsys, "verify", rank_files / "fsdp2", "-q")


def test_a_flipped_byte_in_an_fsdp1_sharded_rank_file_stops_convert_and_diff(
    rank_files, tmp_path, capsys
):
    src = damage.copy(rank_files / "sharded", tmp_path / "sharded")
    flipped = damage.flip_in_torch_file(
        src / "rank_1.pt", "optim.state.blocks.0.fc_in.weight.exp_avg"
    )
    assert_damaged(capsys, flipped, "convert", src, tmp_path / "full.pt", "--to", "full")
    assert_damaged(capsys, flipped, "diff", src, rank_files / "sharded")
    assert_damaged(capsys, flipped, "verify", src, "-q")
    assert_damaged(capsys, flipped, "inspect", src, "--verify")
    assert_clean(
        capsys, "convert", rank_files / "sharded", tmp_path / "ok.pt", "--to", "full", "-q"
    )
    assert_clean(capsys, "verify", rank_files / "sharded", "-q")


def test_a_flipped_byte_in_an_fsdp1_local_rank_file_stops_convert_and_diff(
    rank_files, tmp_path, capsys
):
    src = damage.copy(rank_files / "local", tmp_path / "local")
    # rank 1, the last: its shard of each flat parameter ends in FSDP1's padding.
    flipped = damage.flip_in_torch_file(src / "rank_1.pt", "model.blocks.1._flat_param")
    out = tmp_path / "full.pt"
    assert_damaged(capsys, flipped, "convert", src, out, "--to", "full", *FSDP1_MODEL)
    assert_damaged(capsys, flipped, "verify", src, "-q")
    assert_damaged(capsys, flipped, "inspect", src, "--verify")
    assert_damaged(capsys, flipped, "diff", src, rank_files / "local")
    clean = rank_files / "local"
    assert_clean(capsys, "convert", clean, out, "--to", "full", "-q", *FSDP1_MODEL)
    assert_clean(capsys, "verify", clean, "-q")


def test_a_flipped_byte_in_a_shardckpt_safetensors_export_stops_convert_and_diff(
    fsdp2_ckpt, tmp_path, capsys
):
    export = tmp_path / "model.safetensors"
    assert_clean(capsys, "convert", fsdp2_ckpt.dcp, export, "--to", "full", "-q")
    src = damage.copy(export, tmp_path / "flipped.safetensors")
    flipped = damage.flip_in_safetensors(src, "optim.state.blocks.1.fc_out.weight.exp_avg_sq")
    assert_damaged(
        capsys, flipped, "convert", src, tmp_path / "out", "--to", "sharded", "--world-size", 3
    )
    assert_damaged(capsys, flipped, "diff", fsdp2_ckpt.dcp, src)
    assert_damaged(capsys, flipped, "verify", src, "-q")
    assert_damaged(capsys, flipped, "inspect", src, "--verify")
    assert_clean(capsys, "diff", fsdp2_ckpt.dcp, export, "-q")
    assert_clean(capsys, "verify", export, "-q")


def test_a_flipped_byte_in_a_shardckpt_hf_export_stops_convert_and_diff(
    fsdp2_ckpt, tmp_path, capsys
):
    export = tmp_path / "hf"
    hf = ["--to", "full", "--format", "hf", "--max-shard-size", "20KB", "-q"]
    assert_clean(capsys, "convert", fsdp2_ckpt.dcp, export, *hf)
    src = damage.copy(export, tmp_path / "flipped")
    flipped = damage.flip_in_safetensors(
        src / "model-00002-of-00003.safetensors", "blocks.0.fc_in.weight"
    )
    assert_damaged(capsys, flipped, "convert", src, tmp_path / "out.pt", "--to", "full")
    assert_damaged(capsys, flipped, "diff", src, fsdp2_ckpt.dcp, "--only", "model")
    assert_damaged(capsys, flipped, "verify", src, "-q")
    assert_clean(capsys, "verify", export, "-q")


def test_diff_of_two_hf_exports_reads_every_tensor_and_finds_a_damaged_one(
    fsdp2_ckpt, tmp_path, capsys
):
    hf = ["--to", "full", "--format", "hf", "-q"]
    assert_clean(capsys, "convert", fsdp2_ckpt.dcp, tmp_path / "a", *hf)
    assert_clean(capsys, "convert", fsdp2_ckpt.dcp, tmp_path / "b", *hf, "--max-shard-size", "20KB")
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert (code, out) == (0, "equal: 25 leaves compared\n")
    flipped = damage.flip_in_safetensors(
        tmp_path / "b" / "model-00002-of-00003.safetensors", "norm.weight"
    )
    # The flipped tensor's digest still agrees with A's: diff reads it all the same (issue
    # 30), so the damage is found, as verify finds it, never called equal.
    assert_damaged(capsys, flipped, "diff", tmp_path / "a", tmp_path / "b")
    assert_damaged(capsys, flipped, "verify", tmp_path / "b", "-q")
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a", tmp_path / "b", "--atol", "1e-30")
    assert (code, out) == (3, "")
