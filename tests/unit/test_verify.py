"""``shardckpt verify`` and ``convert --verify`` against checksums: what each reports, in words and JSON.

Checkpoints are written by torch itself (``dcp.save`` without a process group,
``torch.save``); damage is one flipped byte where torch's loader says a tensor lies.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import damage
import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.cli.app import run
from shardckpt.engine import fill


def state() -> dict:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(7, 3), "b": torch.randn(5)},
        "optim": {
            "state": {"w": {"exp_avg": torch.randn(7, 3), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
        },
    }


@pytest.fixture
def ckpt(tmp_path) -> Path:
    dcp.save(state(), checkpoint_id=tmp_path / "dcp", no_dist=True)
    return tmp_path / "dcp"


def cli(capsys, *argv) -> tuple[int, str, list[str]]:
    code = run([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def test_verify_says_intact_and_what_it_read(ckpt, capsys):
    code, out, err = cli(capsys, "verify", ckpt)
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    first, second = out.splitlines()
    assert (code, err) == (0, [])
    assert first.startswith(f"intact: {ckpt} (dcp, 2 files, {size / 1024:.1f} KiB read in ")
    assert second.startswith("  40 records checked against the CRC-32 written with them (")


def test_verify_lists_every_damaged_tensor_and_names_the_first_in_its_error(ckpt, capsys):
    one = damage.flip_in_dcp(ckpt, "model.w")
    two = damage.flip_in_dcp(ckpt, "optim.state.w.exp_avg")
    code, out, err = cli(capsys, "verify", ckpt)
    assert code == 3
    assert out.splitlines()[2:] == [f"  '{f.file}': {f.message()}" for f in (one, two)]
    assert err == [
        f"shardckpt: error: '{one.file}': {one.message()} (1 more damaged, listed on stdout): "
        f"{damage.RECOPY}"
    ]


def test_verify_json_lists_each_damaged_tensor_with_its_record(ckpt, capsys):
    flipped = damage.flip_in_dcp(ckpt, "model.b")
    code, out, _ = cli(capsys, "verify", ckpt, "--json")
    doc = json.loads(out)
    assert code == 3
    assert doc["damaged"] == [
        {
            "file": str(flipped.file),
            "tensors": ["model.b"],
            "where": flipped.where,
            "message": flipped.message(),
        }
    ]
    assert {k: doc[k] for k in ("schema", "src", "format", "world_size", "intact", "files")} == {
        "schema": 1,
        "src": str(ckpt),
        "format": "dcp",
        "world_size": 1,
        "intact": False,
        "files": 2,
    }
    assert doc["bytes"] == doc["checked_bytes"] + doc["unchecked_bytes"]


def test_bytes_a_dcp_data_file_holds_past_its_items_are_found_by_verify_only(ckpt, capsys):
    data = ckpt / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "ab") as f:
        f.write(b"\0" * 10)
    code, out, err = cli(capsys, "verify", ckpt, "-q")
    message = f"bytes {size}..{size + 10} at its end belong to no item of .metadata"
    assert (code, out) == (3, "")
    assert err == [f"shardckpt: error: '{data}': {message}: {damage.RECOPY}"]
    # What no reader reads cannot stop a conversion: its values are all there.
    assert cli(capsys, "convert", ckpt, ckpt.parent / "out.pt", "--to", "full", "-q")[0] == 0


def test_a_flipped_byte_in_a_pickle_record_is_found_by_verify(tmp_path, capsys):
    src = tmp_path / "full.pt"
    torch.save(state(), src)
    with zipfile.ZipFile(src) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/version"))
    start = damage.data_start(src.read_bytes(), info)
    damage.flip(src, start)
    code, out, _ = cli(capsys, "verify", src)
    where = f"record '{info.filename}' at byte {start}"
    assert code == 3
    assert out.splitlines()[2] == (
        f"  '{src}': the bytes do not match the checksum written with them ({where})"
    )


def test_verify_refuses_json_under_quiet(ckpt, capsys):
    code, _, err = cli(capsys, "verify", ckpt, "--json", "-q")
    assert code == 2
    assert err == [
        "shardckpt: error: --json has nothing to print under --quiet, which prints nothing: "
        "drop one of them"
    ]


def test_convert_verify_finds_a_byte_the_disk_changed_after_the_fill(
    ckpt, tmp_path, capsys, monkeypatch
):
    real = fill.run

    def fill_then_flip(reader, plan, writer, *rest):
        real(reader, plan, writer, *rest)
        damage.flip_in_torch_file(writer.root, "model.w")

    monkeypatch.setattr(fill, "run", fill_then_flip)
    dst = tmp_path / "out.pt"
    code, _, err = cli(capsys, "convert", ckpt, dst, "--to", "full", "--verify", "-q")
    assert code == 4 and not dst.exists()
    assert err[0].startswith(
        f"shardckpt: error: '{dst}': --verify read the output back and the bytes of 'model.w' "
        "do not match the checksum written with them (record 'archive/data/0' at byte "
    )
    assert err[0].endswith(
        "in 'out.pt'; nothing was written to DST: the output was damaged as it was written: "
        "check the disk, and run again"
    )


@pytest.fixture
def export(tmp_path) -> Path:
    """Return a safetensors export shardckpt wrote from a file ``torch.save`` wrote."""
    torch.save(state(), tmp_path / "full.pt")
    out = tmp_path / "model.safetensors"
    assert run(["convert", str(tmp_path / "full.pt"), str(out), "--to", "full", "-q"]) == 0
    return out


def test_digests_altered_in_a_safetensors_header_are_refused_by_every_command(export, capsys):
    raw = export.read_bytes()
    at = raw.index(b'"shardckpt.crc32":"') + len(b'"shardckpt.crc32":"')
    export.write_bytes(raw[:at] + b"z" + raw[at + 1 :])  # same length: the header still reads
    line = (
        f"shardckpt: error: '{export}': malformed 'shardckpt.crc32' header metadata "
        "(not 8 hex digits per tensor): the file was altered after shardckpt wrote it; re-copy it"
    )
    for argv in (
        ["verify", export, "-q"],
        ["inspect", export],
        ["convert", export, export.parent / "out.pt", "--to", "full", "-q"],
    ):
        code, out, err = cli(capsys, *argv)
        assert (code, out, err) == (3, "", [line]), argv


def test_a_safetensors_file_cut_short_is_refused_by_verify_naming_it(export, capsys):
    export.write_bytes(export.read_bytes()[:-4])
    code, out, err = cli(capsys, "verify", export, "-q")
    assert (code, out) == (3, "")
    assert err == [
        f"shardckpt: error: '{export}': not a readable safetensors file (SafetensorError: Error "
        "while deserializing header: incomplete metadata, file not fully covered): the file is "
        "truncated or in another format; name its format with --from"
    ]
