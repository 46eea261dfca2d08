"""What safe loading still reads, and how narrowly: DCP metadata, ShardedTensor files, detection.

DCP's ``.metadata`` is unpickled with exact ``(module, name)`` pairs; ShardedTensor
files with torch's ``weights_only`` loader and a ``getattr`` that answers one lookup;
detection reads a rank file's opcodes and loads nothing.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import PurePosixPath

import pickle_payloads as payloads
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata

from shardckpt.cli.app import run
from shardckpt.formats import detect
from shardckpt.formats.dcp import plain_metadata
from shardckpt.formats.dcp.reader import _VOCABULARY, _MetadataUnpickler, read_metadata
from shardckpt.formats.fsdp1.sharded_tensor_record import ShardedTensorRecord
from shardckpt.formats.ranks.sharded_tensor_load import (
    StoredShardedTensor,
    _process_group_state,
    _ProcessGroupState,
    load_rank_file,
    safe_globals,
)


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def save_dcp(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def trained_adamw() -> dict:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(4, 3)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def test_metadata_of_real_dcp_saves_reads_without_trust(tmp_path):
    state = {
        **trained_adamw(),
        "bf16": torch.ones(7, 3, dtype=torch.bfloat16),
        "ints": torch.arange(5),
        "mask": torch.tensor([True, False]),
        "channels_last": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "values": {"epoch": 3, "name": "run-1", "betas": (0.9, 0.95), "none": None, "lr": 0.5},
    }
    save_dcp(state, tmp_path / "ckpt")
    raw = (tmp_path / "ckpt" / ".metadata").read_bytes()
    trusted = pickle.loads(raw)
    # torch's own classes, where the stand-ins do not read a pickle:
    safe = _MetadataUnpickler(io.BytesIO(raw), base=_VOCABULARY).load()
    assert safe.state_dict_metadata == trusted.state_dict_metadata
    assert safe.planner_data == trusted.planner_data
    assert safe.storage_data == trusted.storage_data
    assert str(safe.storage_meta.checkpoint_id) == str(tmp_path / "ckpt")
    # What read_metadata gives, torch loaded or not: the plain stand-ins, holding the same.
    plain = read_metadata(tmp_path / "ckpt", trust_pickle=False)
    assert isinstance(plain, plain_metadata.Metadata)
    assert plain.planner_data == trusted.planner_data
    assert list(plain.state_dict_metadata) == list(trusted.state_dict_metadata)
    for key, entry in trusted.state_dict_metadata.items():
        mine = plain.state_dict_metadata[key]
        assert type(mine).__name__ == type(entry).__name__, key
        if hasattr(entry, "size"):
            assert tuple(mine.size) == tuple(entry.size)
            assert str(mine.properties.dtype) == str(entry.properties.dtype)
            assert [(tuple(c.offsets), tuple(c.sizes)) for c in mine.chunks] == [
                (tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks
            ]
    assert {
        (i.fqn, tuple(i.offset or ()), i.index): (s.relative_path, s.offset, s.length)
        for i, s in plain.storage_data.items()
    } == {
        (i.fqn, tuple(i.offset or ()), i.index): (s.relative_path, s.offset, s.length)
        for i, s in trusted.storage_data.items()
    }
    assert run(["inspect", str(tmp_path / "ckpt")]) == 0


def test_metadata_names_are_exact_pairs_never_attribute_paths():
    assert all("." not in name for _, name in _VOCABULARY)


def test_a_dotted_name_under_a_metadata_module_is_refused(capsys, tmp_path):
    marker = tmp_path / "PAYLOAD-RAN"
    ckpt = payloads.dcp_with_metadata(tmp_path / "ckpt", payloads.dotted_stack_global(marker))
    assert error_of(capsys, ["inspect", ckpt]) == (
        3,
        f"shardckpt: error: '{ckpt / '.metadata'}': metadata references "
        "torch.distributed.checkpoint.metadata.os.system, which DCP metadata never holds: "
        "pass --trust-pickle only if you trust this file",
    )
    assert not marker.exists()


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_a_saved_path_reads_as_a_pure_path_from_any_python(module):
    # Python 3.13 pickles a PosixPath as pathlib._local.PosixPath (3.12 and 3.14: pathlib).
    pk = f"\x80\x02c{module}\nPosixPath\nX\x04\x00\x00\x00/ckp\x85R.".encode("latin-1")
    path = _MetadataUnpickler(io.BytesIO(pk)).load()
    assert type(path) is PurePosixPath and path == PurePosixPath("/ckp")


def sharded_rank_file(path, *, flat: bool = False, legacy: bool = False) -> None:
    """Write rank 0's file of a 2-rank FSDP1 job: SHARDED_STATE_DICT, or LOCAL (``flat``)."""
    key = "layer._flat_param" if flat else "layer.weight"
    local = torch.arange(6.0).reshape(2, 3)
    record = ShardedTensorRecord(local, (4, 3), torch.float32, [(0, 0, 2), (1, 2, 2)], 0, 2)
    state = {"model": {key: record, "buf": torch.ones(2)}, "epoch": 1}
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)


def test_sharded_tensor_files_load_without_the_real_getattr(tmp_path):
    allowed = dict(
        (e[1], e[0]) if isinstance(e, tuple) else (e.__qualname__, e) for e in safe_globals()
    )
    assert getattr not in allowed.values()
    assert allowed["builtins.getattr"] is _process_group_state
    sharded_rank_file(tmp_path / "rank_0.pt")
    tree = load_rank_file(tmp_path / "rank_0.pt", trust_pickle=False)
    weight = tree["model"]["layer.weight"]
    assert isinstance(weight, StoredShardedTensor) and weight.saved_world_size == 2
    assert isinstance(weight.pg_state, _ProcessGroupState) and weight.pg_state.global_rank == 0
    assert torch.equal(weight.local_shards[0].tensor, torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize(
    "owner, name",
    [
        (StoredShardedTensor, "__init__"),
        (ShardMetadata, "ProcessGroupState"),
        (StoredShardedTensor, 3),
    ],
)
def test_getattr_answers_only_process_group_state(owner, name):
    assert _process_group_state(StoredShardedTensor, "ProcessGroupState") is _ProcessGroupState
    with pytest.raises(pickle.UnpicklingError, match="only looks up ProcessGroupState"):
        _process_group_state(owner, name)


def test_a_getattr_chain_in_a_sharded_tensor_file_is_refused(capsys, tmp_path):
    marker = tmp_path / "PAYLOAD-RAN"
    pk = payloads.as_state_dict(payloads.getattr_chain(marker))
    ranks = payloads.rank_dir(tmp_path / "ranks", pk)
    assert error_of(capsys, ["inspect", ranks, "--from", "fsdp1-sharded"]) == (
        3,
        f"shardckpt: error: '{ranks / 'rank_0.pt'}': refused to unpickle (getattr of '__init__', "
        "where a ShardedTensor only looks up ProcessGroupState): "
        "pass --trust-pickle only if you trust this file",
    )
    assert not marker.exists()


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_detection_tells_rank_formats_apart_and_loads_nothing(tmp_path, monkeypatch, legacy):
    for name, flat in (("sharded", False), ("local", True)):
        (tmp_path / name).mkdir()
        for rank in (0, 1):
            sharded_rank_file(tmp_path / name / f"rank_{rank}.pt", flat=flat, legacy=legacy)
    (tmp_path / "plain").mkdir()
    for rank in (0, 1):
        path = tmp_path / "plain" / f"rank_{rank}.pt"
        torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=not legacy)

    def no_load(*args, **kwargs):
        raise AssertionError("detection loaded a file")

    monkeypatch.setattr(torch, "load", no_load)
    monkeypatch.setattr(pickle, "load", no_load)
    assert [detect(tmp_path / d) for d in ("sharded", "local", "plain")] == [
        "fsdp1-sharded",
        "fsdp1-local",
        "fsdp2-ranks",
    ]
