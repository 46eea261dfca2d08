"""Opening a DCP source reads, checks and unpickles its ``.metadata`` once, not once per look.

Telling the format (safetensors-serialized DCP? torchtitan's?) and opening the reader
each look at ``.metadata``; a 1,024-rank save's takes about a minute to check and
unpickle. The checkpoints are written by torch's own ``dcp.save``.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.core.errors import UnsafePickleError
from shardckpt.formats import open_reader
from shardckpt.formats.dcp import reader as dcp_reader


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Return the list of directories whose ``.metadata`` is read (and checked, and unpickled) from now on."""
    seen: list[str] = []
    real = dcp_reader._read_metadata

    def spy(path, trust_pickle, extra):
        seen.append(path.name)
        return real(path, trust_pickle, extra)

    monkeypatch.setattr(dcp_reader, "_read_metadata", spy)
    return seen


def test_detecting_and_opening_a_dcp_source_reads_its_metadata_once(tmp_path, reads):
    dcp.save({"model": {"w": torch.arange(6.0)}}, checkpoint_id=tmp_path / "a", no_dist=True)
    reader = open_reader(tmp_path / "a")
    assert reader.format == "dcp" and reads == ["a"]
    assert tuple(reader.index().tree["model"]["w"].shape) == (6,)
    # A second opening reads it again: nothing outlives the opening (the file may change).
    shutil.rmtree(tmp_path / "a")
    dcp.save({"model": {"w": torch.arange(8.0)}}, checkpoint_id=tmp_path / "a", no_dist=True)
    reader = open_reader(tmp_path / "a")
    assert reads == ["a", "a"]
    assert tuple(reader.index().tree["model"]["w"].shape) == (8,)


def test_a_refused_metadata_is_refused_by_the_reader_not_remembered_as_read(tmp_path, reads):
    dcp.save({"model": {"w": torch.arange(6.0)}}, checkpoint_id=tmp_path / "a", no_dist=True)
    md = (tmp_path / "a" / ".metadata").read_bytes()
    # The same metadata with one global renamed to one DCP metadata never holds.
    bad = md.replace(b"TensorStorageMetadata", b"TensorStorageMetadatX", 1)
    assert bad != md
    (tmp_path / "a" / ".metadata").write_bytes(bad)
    with pytest.raises(UnsafePickleError, match="TensorStorageMetadatX"):
        open_reader(tmp_path / "a", "dcp")
    assert reads == ["a"]
