"""torch's other DCP writers as sources (issue 20 item 3): ``HuggingFaceStorageWriter``'s
per-rank shards and ``FileSystemWriter(serialization_format=SAFETENSORS)``, each saved by an
FSDP2 job on two gloo ranks, read bit-exactly; what torch itself reads back is the reference
where it can (its ``HuggingFaceStorageReader``; its 2.13 ``FileSystemReader`` cannot read the
safetensors-serialized directory, so there the reference is the state the ranks held)."""

from __future__ import annotations

import shutil

import dcp_variants_jobs as jobs
import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import run_ranks
from reference import assert_trees_equal
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardckpt import api
from shardckpt.cli import run
from shardckpt.formats import detect


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Return (the directory holding hf/ and st/, the full state the two ranks held)."""
    root = tmp_path_factory.mktemp("variants")
    state = run_ranks(jobs.save, 2, str(root))[0]
    return root, state


def torch_hf_read(path) -> dict:
    """Return what torch's ``HuggingFaceStorageReader`` loads from ``path`` into full tensors."""
    reader = HuggingFaceStorageReader(str(path))
    metadata = reader.read_metadata()
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
    }
    dcp.load(out, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    return out


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_hf_storage_shards_are_detected_and_read_as_torch_reads_them(saved, tmp_path):
    root, state = saved
    hf = root / "hf"
    assert sorted(p.name for p in hf.iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    assert detect(hf) == "hf-storage"
    index = api.inspect(api.InspectRequest(src=hf)).index
    assert (index.format, index.world_size) == ("hf-storage", 2)
    layouts = {p[0]: m.layout for p, m in index.tensors()}
    assert layouts == {
        "fc.weight": "Shard(0) over 2",
        "out.bias": "Shard(0) over 2",
        "out.weight": "Shard(0) over 2",
        "scale": "full",
    }
    api.convert(api.ConvertRequest(src=hf, dst=tmp_path / "full.pt", to="full", verify=True))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_trees_equal(full, state["model"])
    assert_trees_equal(full, torch_hf_read(hf))


def test_hf_storage_at_3_and_back_equals_the_model(saved, tmp_path):
    root, state = saved
    argv = ["convert", root / "hf", tmp_path / "at3", "--to", "sharded", "--world-size", "3"]
    assert run([str(a) for a in [*argv, "--verify", "-q"]]) == 0
    # torch's own reader of the DCP output at 3.
    dcp_to_torch_save(tmp_path / "at3", tmp_path / "back.pt")
    assert_trees_equal(torch.load(tmp_path / "back.pt", weights_only=True), state["model"])


def test_safetensors_serialized_dcp_converts_to_what_was_saved(saved, tmp_path):
    root, state = saved
    st = root / "st"
    assert detect(st) == "dcp-safetensors"
    found = api.inspect(api.InspectRequest(src=st))
    assert (found.index.format, found.index.world_size) == ("dcp-safetensors", 2)
    assert [(o.path, o.key_type) for o in found.optimizers] == [(("optim",), "fqn")]
    api.convert(api.ConvertRequest(src=st, dst=tmp_path / "full.pt", to="full", verify=True))
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), state)
    # And on to DCP at 3, which torch's own reader takes.
    api.convert(api.ConvertRequest(src=st, dst=tmp_path / "at3", to="sharded", world_size=3, verify=True))
    dcp_to_torch_save(tmp_path / "at3", tmp_path / "back.pt")
    assert_trees_equal(torch.load(tmp_path / "back.pt", weights_only=True), state)


@pytest.fixture
def hf_copy(saved, tmp_path):
    shutil.copytree(saved[0] / "hf", tmp_path / "hf")
    return tmp_path / "hf"


@pytest.fixture
def st_copy(saved, tmp_path):
    shutil.copytree(saved[0] / "st", tmp_path / "st")
    return tmp_path / "st"


def test_a_missing_rank_shard_is_named(hf_copy, capsys):
    (hf_copy / "shard-00001-model-00001-of-00001.safetensors").unlink()
    assert error_of(capsys, ["inspect", hf_copy]) == (
        3,
        f"shardckpt: error: '{hf_copy}': misses shard-00001-model-* of the save: copy every "
        "shard-*.safetensors file of the save into the directory",
    )


def test_a_stray_safetensors_file_is_named_not_skipped(hf_copy, capsys):
    (hf_copy / "model.safetensors").write_bytes(b"")
    assert error_of(capsys, ["inspect", hf_copy]) == (
        3,
        f"shardckpt: error: '{hf_copy}': 'model.safetensors' is no rank shard "
        "(shard-0000R-model-0000K-of-0000N.safetensors): move it out: the checkpoint is the "
        "shard files of one save",
    )


def test_a_truncated_shard_is_named(hf_copy, capsys):
    shard = hf_copy / "shard-00002-model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    code, line = error_of(capsys, ["inspect", hf_copy])
    assert code == 3
    assert line.startswith(f"shardckpt: error: '{shard}': truncated: ")
    assert line.endswith(": re-copy the checkpoint from where it was written")


def test_a_header_that_holds_another_chunk_is_refused(st_copy, capsys):
    data = st_copy / "__1_0.distcp"
    raw = data.read_bytes()
    # Rank 1's chunk of fc.weight starts at row 4; its header says row 3 (same length).
    said = b'model.fc.weight\\": {\\"saved_offsets\\": ['
    assert raw.count(said + b"4, 0]") == 1
    data.write_bytes(raw.replace(said + b"4, 0]", said + b"3, 0]"))
    assert error_of(capsys, ["inspect", st_copy]) == (
        3,
        f"shardckpt: error: '{data}': holds 'model.fc.weight' at [3, 0] as [3, 3] torch.float32, "
        "where .metadata says [4, 0] as [3, 3] torch.float32 (torch's safetensors serialization "
        "keeps one chunk per key in a file): the .metadata and the data files are not one "
        "save; re-copy the checkpoint",
    )


def test_the_variants_are_sources_only(saved, tmp_path, capsys):
    argv = ["convert", saved[0] / "hf", tmp_path / "out", "--to", "sharded"]
    assert error_of(capsys, [*argv, "--format", "hf-storage", "--world-size", "2"]) == (
        2,
        "shardckpt: error: shardckpt reads hf-storage checkpoints but does not write them: "
        "write --format dcp for a sharded output (torch's own loaders read it), or --to full",
    )
    assert not (tmp_path / "out").exists()
