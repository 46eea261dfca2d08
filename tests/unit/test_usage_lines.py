"""Messages that point the right way (issue 23, item 4): one line each, the exact text.

A layout asked for with a format's name, a typo of a choice, click's own usage errors,
one file of a DCP directory, and files that are no checkpoint at all.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.cli.app import run


def outcome(capsys, *argv) -> tuple[int, list[str]]:
    code = run([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).strip().splitlines()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A small DCP checkpoint as ``dcp.save`` writes it."""
    root = tmp_path_factory.mktemp("usage")
    state = {"model": {"w": torch.arange(21.0).reshape(7, 3)}, "step": 1}
    dcp.save(state, checkpoint_id=root / "ckpt", no_dist=True)
    return root / "ckpt"


LAYOUT = "is not a layout (full, sharded or local)"


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("dcp", "dcp is the default format of --to sharded: pass --to sharded"),
        (
            "safetensors",
            "safetensors is a format of --to full: pass --to full --format safetensors",
        ),
        (
            "fsdp1-sharded",
            "fsdp1-sharded is a format of --to local: pass --to local --format fsdp1-sharded",
        ),
        ("shraded", "did you mean --to sharded?"),
        ("ful", "did you mean --to full?"),
        ("everything", "pass one of full, sharded, local"),
    ],
)
def test_to_names_the_layout_a_format_belongs_to_or_the_one_meant(
    capsys, ckpt, tmp_path, value, hint
):
    assert outcome(capsys, "convert", ckpt, tmp_path / "out", "--to", value) == (
        2,
        [f"shardckpt: error: --to {value!r} {LAYOUT}: {hint}"],
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--only", "modle"],
            "--only 'modle' is not one of all, model, optim: did you mean --only model?",
        ),
        (
            ["--optim-keys", "fqns"],
            "--optim-keys 'fqns' is not one of keep, fqn, id, flat: did you mean --optim-keys fqn?",
        ),
        (["--format", "safetensor"], "unknown format 'safetensor': did you mean safetensors?"),
        (
            ["--format", "sharded"],
            "unknown format 'sharded': sharded is a layout, --to sharded; its formats are dcp, "
            "dcp-safetensors, hf-storage, torch-checkpointing, lightning, megatron, accelerate, "
            "torchtitan",
        ),
        (["--from", "torchs"], "unknown format 'torchs': did you mean torch?"),
    ],
)
def test_a_typo_of_a_choice_gets_did_you_mean(capsys, ckpt, tmp_path, argv, line):
    code, lines = outcome(capsys, "convert", ckpt, tmp_path / "out.pt", "--to", "full", *argv)
    assert (code, lines) == (2, [f"shardckpt: error: {line}"])


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["convert", "@ckpt"], "missing argument 'DST': see 'shardckpt convert -h'"),
        (["inspect"], "missing argument 'SRC': see 'shardckpt inspect -h'"),
        (
            ["convert", "@ckpt", "x.pt", "--bogus"],
            "no such option: --bogus: see 'shardckpt convert -h'",
        ),
        (
            ["convert", "@ckpt", "x.pt", "--to", "full", "--vrify"],
            "no such option: --vrify: did you mean --verify?",
        ),
        (["convrt"], "no such command 'convrt': did you mean 'convert'?"),
        (["diff", "@ckpt"], "missing argument 'B': see 'shardckpt diff -h'"),
    ],
)
def test_clicks_usage_errors_are_one_line_in_our_style(capsys, ckpt, argv, line):
    argv = [str(ckpt) if a == "@ckpt" else a for a in argv]
    assert outcome(capsys, *argv) == (2, [f"shardckpt: error: {line}"])


def test_one_data_file_of_a_dcp_directory_asks_for_the_directory(capsys, ckpt, tmp_path):
    data = ckpt / "__0_0.distcp"
    assert outcome(capsys, "inspect", data) == (
        3,
        [
            f"shardckpt: error: '{data}': is one data file of a DCP checkpoint, not a checkpoint "
            f"alone: pass the directory '{ckpt}', which holds it and the other files of the save"
        ],
    )
    metadata = ckpt / ".metadata"
    code, lines = outcome(capsys, "convert", metadata, tmp_path / "o.pt", "--to", "full")
    assert (code, lines) == (
        3,
        [
            f"shardckpt: error: '{metadata}': is the metadata of a DCP checkpoint, not a "
            f"checkpoint alone: pass the directory '{ckpt}', which holds it and the other files "
            "of the save"
        ],
    )
    lone = shutil.copy(data, tmp_path / "__0_0.distcp")
    assert outcome(capsys, "inspect", lone) == (
        3,
        [
            f"shardckpt: error: '{lone}': is one data file of a DCP checkpoint, not a checkpoint "
            "alone: pass the DCP directory it came from (with its '.metadata' and *.distcp files)"
        ],
    )


NOT_A_CHECKPOINT = (
    "not a checkpoint: pass a checkpoint file (.pt, .bin, .safetensors) or directory (DCP, "
    "per-rank files, a trainer's), or --from FORMAT for one whose format is not detected"
)


def _non_checkpoints(root):
    (root / "README.md").write_text("# shardckpt\n\nConverts checkpoints. Ünïcode too.\n")
    (root / "config.json").write_text(json.dumps({"hidden_size": 48, "vocab_size": 97}))
    (root / "random.bin").write_bytes(bytes(range(256)) * 40)
    shutil.copy(sys.executable, root / "python-elf")
    return {
        "README.md": "a text file",
        "config.json": "a JSON file",
        "random.bin": "binary data in no format shardckpt knows",
        "python-elf": "an ELF executable",
    }


def test_a_file_that_is_no_checkpoint_is_named_for_what_it_is(capsys, tmp_path):
    for name, kind in _non_checkpoints(tmp_path).items():
        assert outcome(capsys, "inspect", tmp_path / name) == (
            3,
            [f"shardckpt: error: '{tmp_path / name}': is {kind}, {NOT_A_CHECKPOINT}"],
        ), name


def test_diff_and_convert_name_their_own_format_option_for_a_non_checkpoint(capsys, ckpt, tmp_path):
    _non_checkpoints(tmp_path)
    readme = tmp_path / "README.md"
    code, lines = outcome(capsys, "convert", readme, tmp_path / "o.pt", "--to", "full")
    assert (code, lines) == (
        3,
        [f"shardckpt: error: '{readme}': is a text file, {NOT_A_CHECKPOINT}"],
    )
    code, lines = outcome(capsys, "diff", ckpt, readme)
    assert (code, lines) == (
        3,
        [
            f"shardckpt: error: '{readme}': is a text file, {NOT_A_CHECKPOINT.replace('--from', '--from-b')}"
        ],
    )
