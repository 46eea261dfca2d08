"""Pickles that would unpickle for hours or into gigabytes, in every container that unpickles.

Each bomb (``tests/pickle_payloads.py``) names nothing unsafe: a few hundred bytes whose
objects are reused through the memo, so that hashing, printing or walking what they
build never ends, or a ``data.pkl`` that inflates to 2 GiB. Every command refuses each
one in seconds, with exit 3 and one line naming the file, ``--trust-pickle`` or not
(a size is not a question of trust), and leaves no DST.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import tarfile
import time
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import pickle_payloads as payloads
import pytest
import torch

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.codecs import pickle_bounds
from shardckpt.codecs.pickle_bounds import MAX_DEPTH, MIN_PARTS, PARTS_PER_BYTE, check_pickle
from shardckpt.core.errors import BadInputError

TOO_LARGE = re.compile(
    r"holds a pickle too large to be a checkpoint's \(it builds ([\d,]+) objects, each "
    r"counted at every use; ([\d,]+) bytes of pickle may build ([\d,]+)\): no training job "
    r"writes such a pickle; do not load this file, with --trust-pickle or without"
)
TOO_DEEP = (
    "its tree of dicts and lists is nested too deeply to walk: shardckpt reads trees a few "
    "hundred levels deep; this one was not written by a training job"
)


def _torch_checkpointing(path: Path, pickle_bytes: bytes) -> Path:
    """Write a torch_checkpointing directory of 2 ranks whose ``metadata.pkl`` is ``pickle_bytes``."""
    path.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(4, 3)}, "epoch": 1}, path / "full.pt")
    api.convert(
        api.ConvertRequest(
            src=path / "full.pt",
            dst=path / "tcp",
            to="sharded",
            format="torch-checkpointing",
            world_size=2,
        )
    )
    (path / "tcp" / "metadata.pkl").write_bytes(pickle_bytes)
    return path / "tcp"


def _accelerate(path: Path, pickle_bytes: bytes) -> Path:
    """Write an accelerate ``save_state`` directory whose ``scheduler.bin`` pickle is ``pickle_bytes``."""
    path.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save's own, while building
        payloads.dcp_dir(path / "pytorch_model_fsdp_0")
    payloads.torch_file(path / "scheduler.bin", pickle_bytes)
    return path


def _legacy_torch_file(path: Path, pickle_bytes: bytes) -> Path:
    """Write a ``torch.save(_use_new_zipfile_serialization=False)`` stream whose object pickle is ``pickle_bytes``."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    head = [MAGIC_NUMBER, PROTOCOL_VERSION, {"protocol_version": PROTOCOL_VERSION}]
    stream = b"".join(pickle.dumps(value, 2) for value in head)
    path.write_bytes(stream + pickle_bytes + pickle.dumps([], 2))  # no storages
    return path


CARRIERS = {
    **payloads.CARRIERS,
    "torch-legacy": payloads.Carrier(
        lambda d, pk: _legacy_torch_file(d / "legacy.pt", pk), "torch", lambda src: src
    ),
    # torch.load unpickles the first pickle of any file that is no zip before it can tell.
    "plain-pickle": payloads.Carrier(
        lambda d, pk: (d / "plain.pt").write_bytes(pk) and d / "plain.pt", "torch", lambda src: src
    ),
    "torch-checkpointing-metadata": payloads.Carrier(
        lambda d, pk: _torch_checkpointing(d / "ckpt", pk),
        "torch-checkpointing",
        lambda src: src / "metadata.pkl",
    ),
    "accelerate-scheduler": payloads.Carrier(
        lambda d, pk: _accelerate(d / "ckpt", pk), "accelerate", lambda src: src / "scheduler.bin"
    ),
}


def carried(carrier: str, pickle_bytes: bytes) -> bytes:
    """Return the pickle the refused file of ``carrier`` holds when it carries ``pickle_bytes``."""
    if carrier in ("fsdp1-sharded", "fsdp1-local"):
        return payloads.as_state_dict(pickle_bytes, flat_param=carrier == "fsdp1-local")
    return pickle_bytes


def run_timed(capsys, argv) -> tuple[int, list[str], float]:
    """Return the exit code, stderr lines and seconds of one in-process command."""
    start = time.monotonic()
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines(), time.monotonic() - start


def assert_too_large(line: str, refused: Path, pickle_bytes: bytes) -> None:
    """Assert ``line`` refuses ``refused`` as too large, counting the bytes of ``pickle_bytes``."""
    prefix = f"shardckpt: error: '{refused}': "
    assert line.startswith(prefix), line
    found = TOO_LARGE.fullmatch(line[len(prefix) :])
    assert found, line
    built, length, allowed = (int(g.replace(",", "")) for g in found.groups())
    assert length == len(pickle_bytes)
    assert allowed == max(MIN_PARTS, PARTS_PER_BYTE * length) < built


@pytest.fixture(scope="module")
def bombed(tmp_path_factory):
    """Return a maker of one checkpoint per (carrier, bomb), shared by the commands run on it."""
    root = tmp_path_factory.mktemp("bombs")
    made: dict[tuple[str, str], Path] = {}

    def get(carrier: str, bomb: str) -> Path:
        if (carrier, bomb) not in made:
            (root / f"{carrier}-{bomb}").mkdir()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # dcp.save's own, while building
                made[carrier, bomb] = CARRIERS[carrier].build(
                    root / f"{carrier}-{bomb}", payloads.BOMBS[bomb]()
                )
        return made[carrier, bomb]

    return get


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trust", [False, True], ids=["safe", "trusted"])
@pytest.mark.parametrize("bomb", payloads.BOMBS)
@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_pickle_bomb_is_refused_in_seconds_naming_its_file(
    capsys, bombed, tmp_path, carrier, bomb, trust
):
    src = bombed(carrier, bomb)
    refused = CARRIERS[carrier].refused(src)
    dst = tmp_path / "out.pt"
    argv = ["convert", src, dst, "--to", "full"] + ["--trust-pickle"] * trust
    code, err, seconds = run_timed(capsys, argv)
    assert code == 3 and len(err) == 1, err
    if bomb == "deep-tuple-key":
        assert err == [f"shardckpt: error: '{refused}': {TOO_DEEP}"]
    else:
        assert_too_large(err[0], refused, carried(carrier, payloads.BOMBS[bomb]()))
    assert seconds < 10
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["inspect", "diff"])
@pytest.mark.parametrize("carrier", ["torch", "dcp-metadata", "torch-checkpointing-metadata"])
def test_inspect_and_diff_refuse_a_pickle_bomb_too(capsys, bombed, carrier, command):
    src = bombed(carrier, "tuple-dag-key")
    argv = ["inspect", src] if command == "inspect" else ["diff", src, src]
    code, err, seconds = run_timed(capsys, argv)
    assert code == 3 and len(err) == 1, err
    assert_too_large(err[0], CARRIERS[carrier].refused(src), payloads.tuple_dag_key())
    assert seconds < 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trust", [False, True], ids=["safe", "trusted"])
def test_a_data_pkl_that_inflates_to_2_gib_is_refused_without_being_inflated(
    capsys, tmp_path, trust
):
    bomb = payloads.deflated_torch_file(tmp_path / "bomb.pt")
    assert bomb.stat().st_size < 3 * 2**20
    dst = tmp_path / "out.pt"
    tracemalloc.start()
    try:
        argv = ["convert", bomb, dst, "--to", "full"] + ["--trust-pickle"] * trust
        code, err, seconds = run_timed(capsys, argv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (code, err) == (
        3,
        [
            f"shardckpt: error: '{bomb}': record 'archive/data.pkl' is compressed (deflate), "
            "which torch.save never writes: save it again with torch.save, or re-zip it "
            "without compression (zip -0)"
        ],
    )
    assert seconds < 10 and peak < 64 * 2**20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.pt"]


@pytest.mark.parametrize(
    "records, named",
    [
        (lambda name: True, "zipped/data.pkl"),
        (lambda name: name == "zipped/data/0", "zipped/data/0"),
    ],
    ids=["every-record", "a-tensor-record"],
)
def test_a_re_zipped_torch_file_is_refused_not_read_as_compressed_bytes(
    capsys, tmp_path, records, named
):
    # Memory-mapped, a compressed tensor record would read as the tensor's bytes.
    path = tmp_path / "zipped.pt"
    torch.save({"w": torch.arange(6.0)}, path)
    payloads.rezipped(path, records)
    code, err, _ = run_timed(capsys, ["inspect", path])
    assert (code, err) == (
        3,
        [
            f"shardckpt: error: '{path}': record '{named}' is compressed (deflate), which "
            "torch.save never writes: save it again with torch.save, or re-zip it without "
            "compression (zip -0)"
        ],
    )


def test_a_zip_record_that_claims_more_bytes_than_the_file_holds_is_damaged(capsys, tmp_path):
    path = tmp_path / "claims.pt"
    torch.save({"w": torch.arange(6.0)}, path)
    data = bytearray(path.read_bytes())
    central = data.index(b"PK\x01\x02")  # data.pkl's entry comes first
    data[central + 20 : central + 28] = struct.pack("<II", 2**31, 2**31)  # both sizes
    path.write_bytes(bytes(data))
    code, err, _ = run_timed(capsys, ["inspect", path])
    assert (code, err) == (
        3,
        [
            f"shardckpt: error: '{path}': is a damaged torch.save file (zip: record "
            f"'claims/data.pkl' claims 2,147,483,648 bytes, which a file of {len(data):,} bytes "
            "cannot hold): re-copy it from where it was written"
        ],
    )


def test_a_torch_file_of_the_tar_format_is_refused_as_what_it_is(capsys, tmp_path):
    # With --trust-pickle, torch.load would unpickle its members: the bomb among them.
    path = tmp_path / "old.pt"
    with tarfile.open(path, "w:") as tar:
        for name, data in (
            ("pickle", payloads.tuple_dag_key()),
            ("storages", b""),
            ("tensors", b""),
        ):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    code, err, seconds = run_timed(capsys, ["inspect", path, "--from", "torch", "--trust-pickle"])
    assert (code, err) == (
        3,
        [
            f"shardckpt: error: '{path}': is a torch.save file in the tar format of torch "
            "before 0.1.10, which shardckpt does not read: load it with that torch and save it "
            "again with a current one"
        ],
    )
    assert seconds < 10


def test_a_version_that_is_a_megabyte_string_is_quoted_in_a_few_characters(capsys, tmp_path):
    src = _torch_checkpointing(tmp_path / "ckpt", b"")
    meta = {"version": "x" * 2**20, "world_size": 2, "metadata": {}}
    (src / "metadata.pkl").write_bytes(pickle.dumps(meta))
    code, err, _ = run_timed(capsys, ["inspect", src])
    assert (code, err) == (
        3,
        [
            f"shardckpt: error: '{src / 'metadata.pkl'}': is not torch_checkpointing metadata "
            "shardckpt can use: version 'xxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxx', not '2.0': "
            "re-copy it from where the checkpoint was saved"
        ],
    )


@pytest.mark.parametrize("trust", [False, True], ids=["safe", "trusted"])
@pytest.mark.parametrize("payload", payloads.PAYLOADS)
def test_a_metadata_pkl_that_names_code_is_refused_as_unsafe_not_damaged(
    capsys, tmp_path, payload, trust
):
    marker = tmp_path / "PAYLOAD-RAN"
    src = _torch_checkpointing(tmp_path / "ckpt", payloads.PAYLOADS[payload](marker))
    code, err, _ = run_timed(capsys, ["inspect", src] + ["--trust-pickle"] * trust)
    assert not marker.exists(), "the payload ran"
    named = {
        "reduce-os-system": "os.system",
        "reduce-exec": "builtins.exec",
        "dotted-stack-global": "torch.distributed.checkpoint.metadata.os.system",
        "dotted-global": "torch.distributed.checkpoint.metadata.os.system",
        "getattr-chain": "torch._tensor._rebuild_from_type_v2",
    }[payload]
    assert (code, err) == (
        3,
        [
            f"shardckpt: error: '{src / 'metadata.pkl'}': refused to unpickle (names {named}; "
            "torch_checkpointing writes plain values only): shardckpt runs no code from "
            "metadata.pkl, with --trust-pickle or without; use the metadata.pkl "
            "torch_checkpointing wrote"
        ],
    )


# The gate itself, on real checkpoints' pickles and on the shapes a count could get wrong.


def test_real_checkpoints_pickles_build_far_less_than_one_object_per_byte(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    model = torch.nn.Transformer(16, 2, 2, 2, batch_first=True)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 3, 16), torch.zeros(1, 2, 16)).sum().backward()
    optim.step()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path / "m.pt")
    with zipfile.ZipFile(tmp_path / "m.pt") as zf:
        saved = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    chunks = [ChunkStorageMetadata(torch.Size([64 * c, 0]), torch.Size([64, 32])) for c in range(8)]
    metadata = Metadata(
        {f"layers.{t}.w": TensorStorageMetadata(TensorProperties(), torch.Size([512, 32]), chunks)
         for t in range(500)},
        storage_data={MetadataIndex(f"layers.{t}.w", c.offsets): _StorageInfo("__0_0.distcp", 0, 1)
                      for t in range(500) for c in chunks},
    )  # fmt: skip
    for data in (saved, pickle.dumps(metadata)):
        shape, end = pickle_bounds._scan(data)
        built, depth = shape.measure()
        assert end == len(data) and built < len(data) / 2 and depth < 20
        check_pickle(data, "real")
        check_pickle(data[: len(data) // 2], "cut")  # the loader calls a cut pickle damaged


def test_a_list_that_holds_itself_is_counted_once():
    loop: list = [1, 2]
    loop.append(loop)
    check_pickle(pickle.dumps({"loop": loop, "again": loop}), "cycle")


@pytest.mark.parametrize("depth", [MAX_DEPTH - 10, MAX_DEPTH + 1])
def test_nesting_is_refused_just_past_the_limit(depth):
    data = payloads.deep_tuple_key(depth)
    if depth <= MAX_DEPTH:
        check_pickle(data, "deep")
    else:
        with pytest.raises(BadInputError, match="nested too deeply"):
            check_pickle(data, "deep")


def test_a_key_hashed_in_each_of_many_dropped_dicts_is_counted_at_each():
    # Each dict alone is under the limit, and none is in the result; each insertion hashes.
    data = payloads.one_key_in_many_dicts(levels=18, dicts=64)
    assert len(data) < 1000
    with pytest.raises(BadInputError, match=r"it builds 33,554,497 objects"):
        check_pickle(data, "many")
    check_pickle(payloads.one_key_in_many_dicts(levels=18, dicts=1), "one")
