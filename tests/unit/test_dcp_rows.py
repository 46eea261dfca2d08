"""Rows of a DCP source are read from the chunks' own bytes, bit-exact with DCP's loader.

``shardckpt.formats.dcp.rows`` reads a batch of rows with ``preadv`` from where torch's
loader says a chunk's storage lies; a chunk it cannot place (not stored row after row)
goes through ``dcp.load``. A full export copies rows stored as they are written from
the mapped chunk instead (``engine.stored_copy``). All are checked against ``dcp_to_torch_save``, torch's own
reading of the same directory.
"""

from __future__ import annotations

import errno
import os
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from reference import assert_trees_equal
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardckpt import api
from shardckpt.core.errors import BadInputError
from shardckpt.core.libc import in_memory
from shardckpt.engine import fill, stored_copy
from shardckpt.formats.dcp import reader as dcp_format
from shardckpt.formats.dcp.reader import DcpReader
from shardckpt.formats.hf.digests import read_digests
from shardckpt.state.checksums import raw_bytes


def _source(tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {
        "model": {
            "w": torch.randn(37, 5, generator=g),
            "half": torch.randn(11, 3, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-(2**40), 2**40, (9,), generator=g),
            "mask": torch.rand(6, 2, generator=g) > 0.5,
            "scale": torch.tensor(0.25, dtype=torch.float64),
            # Stored with the strides of its transpose: not row after row.
            "t": torch.randn(4, 6, generator=g).t(),
            "empty": torch.zeros(0, 4),
        },
        "step": 3,
    }
    dcp.save(state, checkpoint_id=tmp_path / "src", no_dist=True)
    dcp_to_torch_save(tmp_path / "src", tmp_path / "ref.pt")
    return tmp_path / "src", torch.load(tmp_path / "ref.pt", weights_only=True)


def _loads(monkeypatch) -> list[list[str]]:
    """Record the keys of every ``dcp.load`` the reader runs."""
    calls: list[list[str]] = []
    original = DcpReader._load

    def spy(self, state_dict, planner):
        calls.append(sorted(state_dict))
        return original(self, state_dict, planner)

    monkeypatch.setattr(DcpReader, "_load", spy)
    return calls


def test_batches_of_a_few_rows_are_bit_exact_and_only_the_strided_chunk_goes_through_dcp_load(
    tmp_path, monkeypatch
):
    src, ref = _source(tmp_path)
    calls = _loads(monkeypatch)
    # 64 bytes a batch: 'w' (37 rows of 20 bytes) is read 3 rows at a time.
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "out.pt", to="full", buffer_bytes=64))
    assert_trees_equal(torch.load(tmp_path / "out.pt", weights_only=True), ref)
    # Only the transposed tensor, batch by batch (the value 'step' is plain: read without DCP's loader).
    assert calls and all(keys == ["model.t"] for keys in calls)


def test_rows_that_start_inside_a_chunk_are_read_from_their_offset(tmp_path):
    src, ref = _source(tmp_path)
    reader = DcpReader(src)
    metas = {m.key: m for _, m in reader.index().tensors()}
    got = reader.read([metas["model.w"], metas["model.half"]], [(13, 29), (10, 11)], None)
    assert torch.equal(got[0], ref["model"]["w"][13:29])
    assert torch.equal(got[1].view(torch.int16), ref["model"]["half"][10:11].view(torch.int16))


def test_a_chunk_is_located_once_however_many_batches_read_it(tmp_path, monkeypatch):
    src, _ = _source(tmp_path)
    located = []
    original = dcp_format.StoredRows._place

    def count(self, key, offsets, sizes, dtype):
        if (key, offsets) not in self._placed:
            located.append(key)
        return original(self, key, offsets, sizes, dtype)

    monkeypatch.setattr(dcp_format.StoredRows, "_place", count)
    api.convert(
        api.ConvertRequest(src=src, dst=tmp_path / "out.safetensors", to="full", buffer_bytes=64)
    )
    assert sorted(located) == sorted(set(located))
    assert "model.w" in located


def test_rows_stored_as_written_are_copied_from_the_mapped_chunk_with_their_digest(
    tmp_path, monkeypatch
):
    src, ref = _source(tmp_path)
    copied = []
    original = stored_copy.copy_runs

    def spy(runs, fd, offset, dst, key, *size):
        copied.append(key)
        return original(runs, fd, offset, dst, key, *size)

    monkeypatch.setattr(fill, "copy_runs", spy)
    monkeypatch.setattr(stored_copy, "MIN_RUN", 1)  # runs of a few bytes copied all the same
    out = tmp_path / "out.safetensors"
    # 64 bytes a batch: the runs of 'w' start and end inside its one chunk.
    api.convert(api.ConvertRequest(src=src, dst=out, to="full", buffer_bytes=64))
    # Every row-major tensor is copied as stored; the transposed one is read, the empty one skipped.
    assert set(copied) == {f"model.{k}" for k in ("w", "half", "ids", "mask", "scale")}
    assert copied.count("model.w") > 1
    digests = read_digests(out)
    assert digests is not None
    with safe_open(out, "pt") as f:
        for name in f.keys():
            got = f.get_tensor(name)
            want = ref["model"][name.split(".", 1)[1]]
            assert raw_bytes(got) == raw_bytes(want.contiguous())
            assert digests.crcs[name] == zlib.crc32(raw_bytes(want.contiguous()))


def test_runs_shorter_than_a_mib_on_average_are_read_not_mapped_and_write_the_same_bytes(
    tmp_path, monkeypatch
):
    src, _ = _source(tmp_path)
    copied = []
    original = stored_copy.copy_runs

    def spy(*args):
        copied.append(args[4])
        return original(*args)

    monkeypatch.setattr(fill, "copy_runs", spy)
    read = tmp_path / "read.safetensors"
    api.convert(api.ConvertRequest(src=src, dst=read, to="full"))
    assert copied == []  # every chunk here is a few hundred bytes
    monkeypatch.setattr(stored_copy, "MIN_RUN", 1)
    mapped = tmp_path / "mapped.safetensors"
    api.convert(api.ConvertRequest(src=src, dst=mapped, to="full"))
    assert copied
    assert read.read_bytes() == mapped.read_bytes()


def test_a_chunk_cut_short_is_not_mapped_and_is_read_as_truncated(tmp_path):
    src, _ = _source(tmp_path)
    reader = DcpReader(src)
    metas = {m.key: m for _, m in reader.index().tensors()}
    w = metas["model.w"]
    # Rows 5..20 of 'w' (5 float32 columns): elements 25..100.
    (run,) = reader.stored_runs(w, 25, 100)
    assert run.length == 15 * 5 * 4
    assert reader.stored_runs(metas["model.t"], 0, 24) is None
    # Cut short after the chunk was located (a new run would refuse the file's size first).
    os.truncate(run.path, run.offset + 10)
    assert reader.stored_runs(w, 25, 100) is None
    with pytest.raises(BadInputError, match="truncated: the data of 'model.w' ends at byte"):
        reader.read([w], [(5, 20)], None)


def test_where_the_kernel_cannot_copy_between_the_files_the_mapped_rows_are_pwritten(
    tmp_path, monkeypatch
):
    src, _ = _source(tmp_path)
    monkeypatch.setattr(stored_copy, "MIN_RUN", 1)
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "kernel.safetensors", to="full"))
    refused = []

    def cross_device(*args):
        refused.append(args)
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(stored_copy.os, "copy_file_range", cross_device)
    monkeypatch.setattr(stored_copy, "in_memory", lambda fd: False)  # the kernel is asked
    out = tmp_path / "pwritten.safetensors"
    api.convert(api.ConvertRequest(src=src, dst=out, to="full", buffer_bytes=64))
    assert refused
    assert out.read_bytes() == (tmp_path / "kernel.safetensors").read_bytes()


def _kernel_copies(monkeypatch) -> list[int]:
    """Count the kernel copies asked for (their lengths) from here on."""
    asked: list[int] = []
    kernel_copy = os.copy_file_range

    def counted(src, dst, count, *args):
        asked.append(count)
        return kernel_copy(src, dst, count, *args)

    monkeypatch.setattr(stored_copy.os, "copy_file_range", counted)
    return asked


def test_into_a_filesystem_held_in_memory_the_slices_are_pwritten_from_the_buffer(
    tmp_path, monkeypatch
):
    # On tmpfs pwrite from the buffer just read and CRC'd costs less CPU than the kernel's
    # copy; elsewhere (ext4) the kernel's copy costs less. The same bytes either way.
    src, _ = _source(tmp_path)
    monkeypatch.setattr(stored_copy, "MIN_RUN", 1)
    asked = _kernel_copies(monkeypatch)
    monkeypatch.setattr(stored_copy, "in_memory", lambda fd: False)
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "kernel.safetensors", to="full"))
    assert asked
    del asked[:]
    monkeypatch.setattr(stored_copy, "in_memory", lambda fd: True)
    out = tmp_path / "pwritten.safetensors"
    api.convert(api.ConvertRequest(src=src, dst=out, to="full"))
    assert asked == []
    assert out.read_bytes() == (tmp_path / "kernel.safetensors").read_bytes()


def _filesystem_type(path) -> str:
    """Return the type of the filesystem ``path`` lies on: its mount's in /proc/self/mountinfo."""
    where = os.path.realpath(path)
    best, kind = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4].replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[fields.index("-") + 1]
    return kind


def test_a_filesystem_held_in_memory_is_told_as_mountinfo_tells_it(tmp_path):
    places = [tmp_path] + [p for p in (Path("/dev/shm"),) if p.is_dir()]
    for place in places:
        fd = os.open(place, os.O_RDONLY)
        try:
            assert in_memory(fd) == (_filesystem_type(place) in ("tmpfs", "ramfs")), place
        finally:
            os.close(fd)


@pytest.mark.skipif(
    not Path("/dev/shm").is_dir() or _filesystem_type("/dev/shm") != "tmpfs",
    reason="no tmpfs at /dev/shm",
)
def test_an_export_into_tmpfs_asks_the_kernel_for_no_copy_and_writes_the_same_bytes(
    tmp_path, monkeypatch
):
    src, _ = _source(tmp_path)
    monkeypatch.setattr(stored_copy, "MIN_RUN", 1)
    ref = tmp_path / "ref.safetensors"
    api.convert(api.ConvertRequest(src=src, dst=ref, to="full"))
    asked = _kernel_copies(monkeypatch)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        out = Path(shm) / "out.safetensors"
        api.convert(api.ConvertRequest(src=src, dst=out, to="full"))
        assert out.read_bytes() == ref.read_bytes()
    assert asked == []


def test_a_run_longer_than_a_slice_is_read_a_slice_at_a_time_and_writes_the_same_bytes(
    tmp_path, monkeypatch
):
    """A stored run is read (pread) and copied a slice at a time: memory per run is one
    slice, whatever the run's length, and the bytes and CRCs are those of one piece."""
    src, _ = _source(tmp_path)
    monkeypatch.setattr(stored_copy, "MIN_RUN", 1)
    whole = tmp_path / "whole.safetensors"
    api.convert(api.ConvertRequest(src=src, dst=whole, to="full"))
    read = []
    original = stored_copy._read_slice

    def spy(*args):
        part = original(*args)
        read.append(len(part))
        return part

    monkeypatch.setattr(stored_copy, "_read_slice", spy)
    monkeypatch.setattr(stored_copy, "SLICE", 64)
    out = tmp_path / "slices.safetensors"
    api.convert(api.ConvertRequest(src=src, dst=out, to="full"))
    # 'w' is one run of 740 bytes: eleven slices of 64 and one of 36.
    assert max(read) == 64 and read.count(64) >= 11
    assert out.read_bytes() == whole.read_bytes()
    assert read_digests(out).crcs == read_digests(whole).crcs
