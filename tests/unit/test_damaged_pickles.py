"""A damaged pickle is told to be re-copied, never to be trusted: --trust-pickle would not load it.

Only a pickle refused for what it names may get "pass --trust-pickle only if you trust
this file" (test_malicious.py); a cut, flipped or garbled one is damaged, with or
without --trust-pickle.
"""

from __future__ import annotations

import io
import warnings
import zipfile

import pickle_payloads as payloads
import pytest
import torch

from shardckpt.cli.app import run

RECOPY = "re-copy it from where it was written"


def data_pkl(buffer: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(buffer)) as zf:
        return next(zf.read(n) for n in zf.namelist() if n.endswith("/data.pkl"))


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


STATE = {"w": torch.arange(6.0), "epoch": 3}
# Each damage of a torch.save pickle, and what it is reported as.
DAMAGES = {
    "bad-opcode": (lambda pk: pk[:2] + b"\xff" + pk[3:], "at position 2, opcode b'\\xff' unknown"),
    "cut": (lambda pk: pk[: len(pk) // 2], None),
    "no-stop": (lambda pk: pk[:-1], "pickle exhausted before seeing STOP"),
}


def error_of(capsys, argv) -> tuple[int, list[str]]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def assert_damaged(code: int, err: list[str], file, reason: str | None, hint: str = RECOPY):
    assert code == 3 and len(err) == 1, err
    line = err[0]
    assert "--trust-pickle" not in line
    if reason is not None:
        assert line.endswith(f"({reason}): {hint}"), line
    assert line.startswith(f"shardckpt: error: '{file}': ") and line.endswith(f"): {hint}"), line


@pytest.mark.parametrize("trust", [False, True], ids=["safe", "trusted"])
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_torch_file_pickle_is_damaged_not_unsafe(capsys, tmp_path, damage, trust):
    change, reason = DAMAGES[damage]
    path = payloads.torch_file(tmp_path / "bad.pt", change(data_pkl(saved(STATE))))
    code, err = error_of(capsys, ["inspect", path] + (["--trust-pickle"] if trust else []))
    assert_damaged(code, err, path, reason)
    assert err[0].startswith(f"shardckpt: error: '{path}': is a damaged torch.save file (")


def test_a_bit_flip_in_the_pickle_fails_its_zip_checksum(capsys, tmp_path):
    data = bytearray(saved(STATE))
    data[data.index(data_pkl(bytes(data))) + 10] ^= 1
    (tmp_path / "flip.pt").write_bytes(bytes(data))
    code, err = error_of(capsys, ["inspect", tmp_path / "flip.pt"])
    assert_damaged(code, err, tmp_path / "flip.pt", "zip: Bad CRC-32 for file 'archive/data.pkl'")


def test_a_cut_legacy_torch_file_is_damaged(capsys, tmp_path):
    torch.save(STATE, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    data = (tmp_path / "legacy.pt").read_bytes()
    (tmp_path / "legacy.pt").write_bytes(data[:60])
    code, err = error_of(capsys, ["inspect", tmp_path / "legacy.pt"])
    assert_damaged(code, err, tmp_path / "legacy.pt", None)


@pytest.mark.parametrize(
    "fmt", [None, "fsdp2-ranks", "fsdp1-sharded", "fsdp1-local"], ids=lambda f: f or "detected"
)
def test_a_damaged_rank_file_is_named_and_damaged(capsys, tmp_path, fmt):
    bad_opcode, reason = DAMAGES["bad-opcode"]
    ranks = payloads.rank_dir(tmp_path / "ranks", bad_opcode(data_pkl(saved(STATE))))
    code, err = error_of(capsys, ["inspect", ranks] + (["--from", fmt] if fmt else []))
    assert_damaged(code, err, ranks / "rank_0.pt", reason)


@pytest.mark.parametrize("trust", [False, True], ids=["safe", "trusted"])
def test_a_damaged_dcp_value_is_damaged_not_unsafe(capsys, tmp_path, trust):
    bad_opcode, reason = DAMAGES["bad-opcode"]
    value = payloads.torch_save_bytes(bad_opcode(data_pkl(saved(3))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = payloads.dcp_with_value(tmp_path / "ckpt", value)
    code, err = error_of(capsys, ["inspect", ckpt] + (["--trust-pickle"] if trust else []))
    assert err == [
        f"shardckpt: error: '{ckpt / '__0_0.distcp'}': value 'epoch' is damaged ({reason}): "
        "re-copy the checkpoint from where it was written"
    ]
    assert code == 3


@pytest.mark.parametrize("trust", [False, True], ids=["safe", "trusted"])
@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda md: md[: len(md) // 2], "UnpicklingError: pickle data was truncated"),
        (lambda md: b"\x00" + md[1:], "UnpicklingError: invalid load key, '\\x00'."),
    ],
    ids=["cut", "garbled"],
)
def test_damaged_dcp_metadata_is_damaged_not_unsafe(capsys, tmp_path, damage, reason, trust):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = payloads.dcp_dir(tmp_path / "ckpt")
    md = ckpt / ".metadata"
    md.write_bytes(damage(md.read_bytes()))
    code, err = error_of(capsys, ["inspect", ckpt] + (["--trust-pickle"] if trust else []))
    assert (code, err) == (
        3,
        [
            f"shardckpt: error: '{md}': cannot read DCP metadata ({reason}): the file is damaged "
            "or not written by torch.distributed.checkpoint; re-copy the checkpoint from where "
            "it was written"
        ],
    )
