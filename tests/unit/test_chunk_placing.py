"""Placing a DCP source's chunks asks torch's loader once per distinct pickle, not once per chunk.

A save's chunks repeat a few pickles (one per shape and dtype) thousands of times: a
64-rank save of 2,000 tensors holds 94,700 chunks. Each chunk's own zip still says
where its storage lies (the record torch's loader placed the first one's at), and
every byte read is still checked against its record's CRC-32. The sources are written
by torch's own ``dcp.save``.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from shardckpt.cli.app import run
from shardckpt.core.errors import BadInputError
from shardckpt.formats import open_reader
from shardckpt.formats.dcp import rows


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.w": torch.randn(5, 4, generator=gen) for i in range(12)}
    tensors["head"] = torch.randn(3, 7, generator=gen)
    tensors["steps"] = torch.arange(6, dtype=torch.int64)
    return tensors


@pytest.fixture
def loads(monkeypatch) -> list[int]:
    """Return one entry per ``torch.load`` from now on."""
    seen: list[int] = []
    real = torch.load

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return seen


def test_chunks_that_pickle_alike_ask_torchs_loader_once(tmp_path, loads):
    dcp.save({"model": state()}, checkpoint_id=tmp_path / "src", no_dist=True)
    argv = ["convert", str(tmp_path / "src"), str(tmp_path / "o.safetensors"), "--to", "full"]
    assert run([*argv, "-q"]) == 0
    # Three pickles (a 5x4 float, a 3x7 float, a 6-long int64) for 14 chunks.
    assert len(loads) == 3
    got = load_file(tmp_path / "o.safetensors")
    assert sorted(got) == sorted(f"model.{k}" for k in state())
    for name, value in state().items():
        assert torch.equal(got[f"model.{name}"], value), name


def test_each_chunk_is_placed_by_its_own_zip(tmp_path):
    dcp.save({"model": state()}, checkpoint_id=tmp_path / "src", no_dist=True)
    reader = open_reader(tmp_path / "src")
    rows = reader._rows
    md = reader.metadata
    starts = set()
    for index, info in md.storage_data.items():
        meta = md.state_dict_metadata[index.fqn]
        placed = rows._place(
            index.fqn, tuple(index.offset), tuple(meta.size), meta.properties.dtype
        )
        # Inside its own item's bytes, where its own record starts (not the first chunk's).
        assert info.offset <= placed.start < info.offset + info.length
        assert placed.written is not None and placed.written.start == placed.start
        starts.add((info.relative_path, placed.start))
    assert len(starts) == len(md.storage_data) == 14


@pytest.mark.parametrize("kept", [64, 1])
def test_each_data_file_is_opened_once_while_the_files_kept_open_allow(tmp_path, monkeypatch, kept):
    src = tmp_path / "src"
    writer = dcp.FileSystemWriter(src, thread_count=3)
    dcp.save({"model": state()}, storage_writer=writer, no_dist=True)
    files = sorted(p.name for p in src.glob("*.distcp"))
    assert len(files) == 3
    monkeypatch.setattr(rows, "kept_open", lambda: kept)
    opened: list[str] = []
    real = os.open

    def spy(path, *args, **kwargs):
        if str(path).endswith(".distcp"):
            opened.append(os.path.basename(path))
        return real(path, *args, **kwargs)

    reader = open_reader(src)  # its gate opens each data file once, before the spy
    monkeypatch.setattr(rows.os, "open", spy)
    md = reader.metadata
    # Every chunk, twice, taking turns between the files.
    by_file: dict[str, list] = {}
    for index, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    turns = [c for group in zip(*by_file.values()) for c in group]
    for index, info in turns + turns:
        meta = md.state_dict_metadata[index.fqn]
        placed = reader._rows.locate(
            info, index.fqn, tuple(index.offset), tuple(meta.size), meta.properties.dtype
        )
        assert placed is not None and placed.file == info.relative_path
    if kept == 64:
        assert sorted(opened) == files
    else:
        # The first file stays open; the others are opened for each of their chunks.
        first = turns[0][1].relative_path
        others = [info.relative_path for _, info in turns + turns if info.relative_path != first]
        assert opened == [first, *others]
    fds = list(reader._rows._files._fds.values())
    assert len(fds) == min(kept, 3)
    del reader
    gc.collect()
    for fd in fds:  # closed with the reader
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_data_file_swapped_for_a_fifo_after_the_checks_is_refused_not_waited_on(tmp_path):
    src = tmp_path / "src"
    dcp.save({"model": state()}, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    reader = open_reader(src)  # .metadata and the data files pass the gate here
    (src / "__0_0.distcp").unlink()
    os.mkfifo(src / "__0_0.distcp")
    index, info = next(iter(reader.metadata.storage_data.items()))
    meta = reader.metadata.state_dict_metadata[index.fqn]
    with pytest.raises(BadInputError, match="is a FIFO"):
        reader._rows.locate(
            info, index.fqn, tuple(index.offset), tuple(meta.size), meta.properties.dtype
        )
