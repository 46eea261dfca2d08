"""What the CLI says (issue 10, item 8): torch's dtype names, --version, -h, counts, summaries."""

from __future__ import annotations

import json

import pytest
import torch

from shardckpt import __version__
from shardckpt.cli.app import run


@pytest.fixture
def one(tmp_path):
    """A checkpoint of one tensor and one value."""
    torch.save(
        {"model": {"w": torch.linspace(0, 1, 21).reshape(7, 3)}, "epoch": 1}, tmp_path / "one.pt"
    )
    return tmp_path / "one.pt"


def out_of(capsys, argv) -> tuple[int, str, str]:
    code = run([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", ["bfloat16", "torch.bfloat16", "BF16"])
def test_torch_dtype_names_cast_as_ours_do(one, tmp_path, name):
    assert (
        run(
            [
                "convert",
                str(one),
                str(tmp_path / "ours.pt"),
                "--to",
                "full",
                "--dtype",
                "bf16",
                "-q",
            ]
        )
        == 0
    )
    assert (
        run(["convert", str(one), str(tmp_path / "t.pt"), "--to", "full", "--dtype", name, "-q"])
        == 0
    )
    assert torch.load(tmp_path / "t.pt")["model"]["w"].dtype == torch.bfloat16
    assert (tmp_path / "t.pt").read_bytes() == (tmp_path / "ours.pt").read_bytes()


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float16", torch.float16), ("half", torch.float16), ("float32", torch.float32)],
)
def test_every_torch_name_of_a_supported_dtype_is_accepted(one, tmp_path, name, dtype):
    assert (
        run(["convert", str(one), str(tmp_path / "t.pt"), "--to", "full", "--dtype", name, "-q"])
        == 0
    )
    assert torch.load(tmp_path / "t.pt")["model"]["w"].dtype == dtype


def test_an_unknown_dtype_is_a_usage_error(capsys, one, tmp_path):
    code, _, err = out_of(
        capsys, ["convert", one, tmp_path / "t.pt", "--to", "full", "--dtype", "int8"]
    )
    assert (code, err.strip()) == (
        2,
        "shardckpt: error: --dtype 'int8' is not a dtype it casts to: use keep, bf16, fp16 or "
        "fp32 (or torch's bfloat16, float16, float32)",
    )


@pytest.mark.parametrize("argv", [[], ["inspect"], ["convert"], ["diff"]])
def test_version_is_printed_by_the_app_and_every_command(capsys, argv):
    assert out_of(capsys, [*argv, "--version"]) == (0, f"shardckpt {__version__}\n", "")


@pytest.mark.parametrize("argv", [[], ["inspect"], ["convert"], ["diff"]])
def test_h_is_help_for_the_app_and_every_command(capsys, argv):
    code, short, _ = out_of(capsys, [*argv, "-h"])
    assert code == 0 and short.startswith("Usage: shardckpt")
    assert out_of(capsys, [*argv, "--help"])[1] == short


def test_counts_are_singular_for_one(capsys, one, tmp_path):
    _, out, _ = out_of(capsys, ["inspect", one])
    assert "total: 1 tensor, 84 B" in out
    _, out, _ = out_of(capsys, ["convert", one, tmp_path / "o.pt", "--to", "full", "--dry-run"])
    assert "1 tensor (84 B) and 1 value" in out and "in 1 batch (dry run" in out
    _, out, _ = out_of(capsys, ["diff", one, one])
    assert out.strip() == "equal: 2 leaves compared"


def test_the_summary_of_a_full_output_names_no_world_size(capsys, one, tmp_path):
    _, out, _ = out_of(capsys, ["convert", one, tmp_path / "o.pt", "--to", "full"])
    assert out.startswith(
        f"wrote {tmp_path / 'o.pt'}: 1 tensor (84 B) and 1 value, one torch file in "
    )
    assert "world size" not in out
    argv = ["convert", one, tmp_path / "d", "--to", "sharded", "--world-size", "2"]
    _, out, _ = out_of(capsys, argv)
    assert ", sharded dcp for world size 2 in " in out
    _, out, _ = out_of(capsys, ["convert", one, tmp_path / "j.pt", "--to", "full", "--json"])
    assert json.loads(out)["layout"] == "full"


@pytest.mark.parametrize(
    ("title", "said"),
    [
        ("accelerate", "an accelerate"),
        ("FSDP1 local", "an FSDP1 local"),
        ("HF", "an HF"),
        ("DCP", "a DCP"),
        ("Hugging Face", "a Hugging Face"),
        ("DeepSpeed ZeRO", "a DeepSpeed ZeRO"),
        ("torch", "a torch"),
        ("Megatron", "a Megatron"),
        ("veRL", "a veRL"),
    ],
)
def test_a_format_s_title_is_read_with_its_article(title, said):
    """Notes say "writing DST as an accelerate checkpoint", never "a accelerate"."""
    from shardckpt.core.words import a_or_an

    assert a_or_an(title) == said


def test_every_format_title_gets_the_article_it_is_read_with():
    from shardckpt.core.words import a_or_an
    from shardckpt.formats import FORMATS

    for form in FORMATS.values():
        said = a_or_an(form.title)
        assert said in (f"a {form.title}", f"an {form.title}")
        assert not said.startswith("a a") and not said.startswith("a F")
