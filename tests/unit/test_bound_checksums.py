"""Checksums vouch only for bytes checked against them, under the names they were written for
(issue 30, items 1 and 2).

1. ``diff ORIGINAL DAMAGED`` of two safetensors or hf outputs shardckpt wrote took equal
   digests for equal bytes and said "equal", exit 0, with a flipped bit in one side: diff
   now reads every tensor it calls equal, checking its checksum, and a damaged side is
   exit 3 whichever side it is.
2. A header whose ``data_offsets`` of two same-size tensors are swapped, a dtype or shape
   that lies, or the tree in ``__metadata__`` re-pointed, passed ``verify``, ``inspect
   --verify`` and ``convert --verify`` with the tensors swapped: each byte range still
   matched its CRC. The header now carries a checksum of its own, so every command that
   reads such a file refuses it, exit 3 naming it, and writes nothing.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import damage
import pytest
import torch

from shardckpt.cli.app import run
from shardckpt.formats.hf.sharded import INDEX_FILE

HEADER_LIE = (
    "its header does not match the checksum written with it: a tensor's name, dtype, shape "
    "or place, or the tree, was changed after shardckpt wrote it: the file was altered after "
    "it was written; re-copy it"
)


def cli(capsys, *argv) -> tuple[int, str, list[str]]:
    code = run([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


@pytest.fixture
def src(tmp_path) -> Path:
    """A torch.save checkpoint with two tensors of one size and dtype (7x3 and 97x48 too)."""
    torch.manual_seed(0)
    model = {
        "a": torch.randn(9, 4),
        "b": torch.randn(9, 4),
        "w": torch.randn(97, 48),
        "v": torch.randn(7, 3),
    }
    torch.save({"model": model, "step": 3}, tmp_path / "src.pt")
    return tmp_path / "src.pt"


def export(src: Path, kind: str) -> Path:
    """Return a safetensors file or an hf directory (several shards) shardckpt wrote from ``src``."""
    if kind == "safetensors":
        out = src.parent / "out.safetensors"
        argv = ["convert", src, out, "--to", "full", "-q"]
    else:
        out = src.parent / "out-hf"
        argv = ["convert", src, out, "--to", "full", "--format", "hf", "-q"]
        argv += ["--max-shard-size", "10KB"]
    assert run([str(a) for a in argv]) == 0
    return out


def files_of(out: Path) -> list[Path]:
    """Return the safetensors files of an export, in name order."""
    return [out] if out.is_file() else sorted(out.glob("*.safetensors"))


def file_holding(out: Path, name: str) -> Path:
    """Return the safetensors file of ``out`` that holds tensor ``name``."""
    if out.is_file():
        return out
    return out / json.loads((out / INDEX_FILE).read_text())["weight_map"][name]


def name_in(out: Path, key: str) -> str:
    """Return the name tensor ``model.key`` has in ``out`` (hf keeps the model's names alone)."""
    return f"model.{key}" if out.is_file() else key


def rewrite_header(file: Path, change: Callable[[dict], None]) -> None:
    """Rewrite ``file``'s JSON header as ``change`` alters it, the data as it was."""
    raw = file.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + size])
    change(head)
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])


def nothing_left(directory: Path, dst: Path) -> None:
    """Assert no DST, no partial output and no lock of ``dst`` in ``directory``."""
    assert not dst.exists()
    assert not [p for p in directory.iterdir() if ".shardckpt-" in p.name]


# ---------------------------------------------------------------- 1. diff reads what it calls equal


@pytest.mark.parametrize("kind", ["safetensors", "hf"])
@pytest.mark.parametrize("key", ["a", "b", "w", "v"])
@pytest.mark.parametrize("damaged_side", ["a", "b"])
def test_diff_of_an_output_and_its_damaged_copy_is_never_equal(
    src, tmp_path, capsys, kind, key, damaged_side
):
    original = export(src, kind)
    copy = tmp_path / ("copy" + ("" if original.is_dir() else ".safetensors"))
    damage.copy(original, copy)
    flipped = damage.flip_in_safetensors(file_holding(copy, name_in(copy, key)), name_in(copy, key))
    sides = [original, copy] if damaged_side == "b" else [copy, original]
    code, out, err = cli(capsys, "diff", *sides)
    assert code == 3, (out, err)
    assert len(err) == 1 and err[0].startswith(f"shardckpt: error: '{flipped.file}': ")
    assert "do not match the checksum written with them" in err[0]
    assert f"'{name_in(copy, key)}'" in err[0] and out == ""


@pytest.mark.parametrize("kind", ["safetensors", "hf"])
def test_diff_of_two_intact_outputs_reads_every_tensor_and_says_equal(src, tmp_path, capsys, kind):
    original = export(src, kind)
    copy = tmp_path / ("copy" + ("" if original.is_dir() else ".safetensors"))
    damage.copy(original, copy)
    code, out, err = cli(capsys, "diff", original, copy, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["equal"] is True and "by_digest" not in doc


# ------------------------------------------------------- 2. the header is covered by a checksum


def swap_offsets(first: str, second: str) -> Callable[[dict], None]:
    def change(head: dict) -> None:
        head[first]["data_offsets"], head[second]["data_offsets"] = (
            head[second]["data_offsets"],
            head[first]["data_offsets"],
        )

    return change


def set_field(name: str, field: str, value) -> Callable[[dict], None]:
    def change(head: dict) -> None:
        head[name][field] = value

    return change


def repoint_tree(head: dict) -> None:
    meta = head["__metadata__"]
    tree = meta["shardckpt"].replace('"model.a"', '"@"').replace('"model.b"', '"model.a"')
    meta["shardckpt"] = tree.replace('"@"', '"model.b"')


def change_value(head: dict) -> None:
    meta = head["__metadata__"]
    meta["shardckpt"] = meta["shardckpt"].replace('{"value":3}', '{"value":4}')


def lies(kind: str) -> dict[str, tuple[str, Callable[[dict], None]]]:
    """Return each header lie: the tensor whose file it is told in, and the change."""
    a, b, w, v = (("model." if kind == "safetensors" else "") + k for k in "abwv")
    out = {
        "swapped offsets": (a, swap_offsets(a, b)),
        "dtype F32 -> I32": (w, set_field(w, "dtype", "I32")),
        "shape transposed": (w, set_field(w, "shape", [48, 97])),
        "shape 7x3 -> 3x7": (v, set_field(v, "shape", [3, 7])),
    }
    if kind == "safetensors":
        out["tree re-pointed"] = (a, repoint_tree)
        out["plain value changed"] = (a, change_value)
    return out


CASES = [(kind, lie) for kind in ("safetensors", "hf") for lie in lies(kind)]


@pytest.mark.parametrize(("kind", "lie"), CASES, ids=[f"{k}-{lie}" for k, lie in CASES])
def test_a_header_that_lies_is_refused_by_every_command_that_reads_it(
    src, tmp_path, capsys, kind, lie
):
    out = export(src, kind)
    name, change = lies(kind)[lie]
    if kind == "hf" and lie == "swapped offsets":
        # hf shards by size: 'a' and 'b' must lie in one file for their offsets to swap.
        assert file_holding(out, "a") == file_holding(out, "b")
    file = file_holding(out, name)
    rewrite_header(file, change)
    line = f"shardckpt: error: '{file}': {HEADER_LIE}"
    dst = tmp_path / "dst.pt"
    for argv in (
        ["verify", out, "-q"],
        ["inspect", out, "--verify"],
        ["convert", out, dst, "--to", "full", "--verify", "-q"],
        ["convert", out, dst, "--to", "full", "-q"],
        ["diff", out, src, "--only", "model", "-q"],
    ):
        code, stdout, err = cli(capsys, *argv)
        assert (code, stdout, err) == (3, "", [line]), argv
        nothing_left(tmp_path, dst)


@pytest.mark.parametrize("kind", ["safetensors", "hf"])
def test_every_file_an_export_writes_carries_a_header_checksum_that_holds(src, capsys, kind):
    out = export(src, kind)
    for file in files_of(out):
        raw = file.read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        assert "shardckpt.header_crc32" in json.loads(raw[8 : 8 + size])["__metadata__"]
    code, stdout, err = cli(capsys, "verify", out, "-q")
    assert (code, err) == (0, [])


def test_a_file_an_earlier_shardckpt_wrote_still_reads_and_its_bytes_are_still_checked(
    src, tmp_path, capsys
):
    """Files from before the header checksum (issue 22's digests alone) stay readable."""
    out = export(src, "safetensors")
    rewrite_header(out, lambda head: head["__metadata__"].pop("shardckpt.header_crc32"))
    assert cli(capsys, "verify", out, "-q")[0] == 0
    damage.flip_in_safetensors(out, "model.w")
    code, _, err = cli(capsys, "verify", out, "-q")
    assert code == 3 and "model.w" in "".join(err)
