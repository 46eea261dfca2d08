"""Per-rank files are written in steps of at most ``--buffer-size`` of tensor data, whatever their records.

A DCP data file holds each tensor item as one ``torch.save`` record, its CRC-32 in the
record's fields; at one target rank that record is the whole tensor. A record larger
than the buffer goes in parts, its checksum running over them, instead of being read
and held whole: the steps' reads are spied on, and the files are the same bytes at any
buffer. The source is written by torch's own ``dcp.save``.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.cli.app import run
from shardckpt.engine import fill
from shardckpt.engine.dst_files import DstFiles
from shardckpt.state.regions import nbytes

ROW = 48 * 4  # bytes in a row of "w"


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(97, 48, generator=gen), "b": torch.randn(48, generator=gen)}


@pytest.fixture
def src(tmp_path) -> Path:
    dcp.save({"model": state()}, checkpoint_id=tmp_path / "src", no_dist=True)
    return tmp_path / "src"


def files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_record_larger_than_the_buffer_is_read_in_steps_and_written_the_same(
    src, tmp_path, monkeypatch, world_size
):
    read_steps: list[int] = []
    real = fill.read_regions

    def spy(reader, asked, metas, runtime):
        read_steps.append(sum(nbytes(r, metas) for r in asked))
        return real(reader, asked, metas, runtime)

    monkeypatch.setattr(fill, "read_regions", spy)
    argv = ["convert", str(src), "--to", "sharded", "--world-size", str(world_size), "-q"]
    assert run([*argv[:2], str(tmp_path / "small"), *argv[2:], "--buffer-size", "1KiB"]) == 0
    # Whole rows: 1 KiB holds 5 of w's 192-byte rows; no step reads the 18 KiB tensor at once.
    assert max(read_steps) <= 1024 and sum(read_steps) == sum(t.nbytes for t in state().values())
    read_steps.clear()
    assert run([*argv[:2], str(tmp_path / "big"), *argv[2:]]) == 0
    assert len(read_steps) == 1  # the default buffer holds it all
    assert files(tmp_path / "small") == files(tmp_path / "big")
    # And DCP's own loader reads the values back.
    got = {k: torch.empty_like(v) for k, v in state().items()}
    dcp.load({"model": got}, checkpoint_id=tmp_path / "small", no_dist=True)
    for name, value in state().items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_steps_rows_are_written_from_where_they_were_read_not_copied_into_a_second_buffer(
    tmp_path, world_size
):
    # 8 MiB of rows a step: a writer that put them together in a buffer of its own before
    # writing them held each step twice. Python's allocator sees such a buffer (torch's
    # tensors, the rows read, it does not).
    big = torch.arange(2**22, dtype=torch.float32).reshape(4096, 1024)
    dcp.save({"model": {"w": big}}, checkpoint_id=tmp_path / "src", no_dist=True)
    argv = ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "sharded"]
    argv += ["--world-size", str(world_size), "--buffer-size", "8MiB", "--quiet"]
    tracemalloc.start()
    try:
        assert run(argv) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB held by Python beside the rows read"
    got = {"w": torch.empty_like(big)}
    dcp.load({"model": got}, checkpoint_id=tmp_path / "out", no_dist=True)
    assert torch.equal(got["w"], big)


@pytest.mark.parametrize("buffer", ["1KiB", "256MiB"])
def test_the_bytes_a_file_job_says_are_final_are_the_files_last_bytes(
    src, tmp_path, monkeypatch, buffer
):
    # What DST on object storage uploads during the fill: a part is sent once the job says
    # its bytes are final, so no byte it said is final may change after (a CRC-32 field
    # written once its record's data is). At 1 KiB, w's record goes in parts: its bytes
    # become final step by step, not at its end (DCP's items keep their CRC-32s after
    # their data).
    said: list[tuple[str, int, bytes]] = []  # file, final up to, its bytes then
    ends: dict[str, int] = {}

    def final(self, file, upto):
        said.append((file, upto, self.path(file).read_bytes()[:upto]))

    def whole(self, file, size):
        ends[file] = size

    monkeypatch.setattr(DstFiles, "final", final)
    monkeypatch.setattr(DstFiles, "whole", whole)
    out = tmp_path / "out"
    argv = ["convert", str(src), str(out), "--to", "sharded", "--world-size", "1", "-q"]
    assert run([*argv, "--buffer-size", buffer]) == 0
    written = files(out)
    assert ends == {"__0_0.distcp": len(written["__0_0.distcp"])}
    for file, upto, seen in said:
        assert seen == written[file][:upto], (file, upto)
    steps = [upto for _, upto, _ in said]
    assert steps == sorted(steps)  # never back
    assert len(set(steps)) > (18 if buffer == "1KiB" else 0)  # w's 18 KiB a KiB at a time


def test_bytes_under_a_crc32_field_written_after_its_data_are_not_said_final_before_it(
    tmp_path, monkeypatch
):
    # A record whose CRC-32 field lies in its local header, before its data (a torch.save
    # zip's), larger than the buffer: its data goes in steps and the field is written
    # after the last. Until then the job says the file is final only up to the field.
    import struct

    from isal import isal_zlib

    from shardckpt.engine.jobs import JobQueue
    from shardckpt.state.regions import Blob, FileJob, Region
    from shardckpt.state.tree import TensorMeta

    data = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    metas = {"w": TensorMeta("w", (64, 16), torch.float32)}
    head = b"PK\x03\x04" + b"\0" * 4 + b"name"  # the CRC-32 field at 4
    blob = Blob(head, Region("w", 0, data.numel(), "f", 3 + len(head)), b"END", (4,))
    job = FileJob("f", data.nbytes, lambda: ([b"TOP", blob], []))
    said: list[tuple[int, int, bytes]] = []
    monkeypatch.setattr(
        DstFiles, "final", lambda self, f, upto: said.append((upto, *_read(self.path(f), upto)))
    )
    monkeypatch.setattr(DstFiles, "whole", lambda self, f, size: None)
    files_ = DstFiles(tmp_path)
    raw = memoryview(data.numpy().tobytes())
    row = 16 * 4

    def lookup(region):
        return raw[region.start * 4 : region.stop * 4]

    queue = JobQueue([job], files_, 8 * row)  # 8 rows a step
    while not queue.empty:
        for writer, segments in queue.step(metas):
            writer.write(segments, lookup)
    files_.close()
    done = (tmp_path / "f").read_bytes()
    assert done[3 + 4 : 3 + 8] == struct.pack("<I", isal_zlib.crc32(raw))
    for upto, _, seen in said:
        assert seen == done[:upto]
    assert len(said) > 4
    assert [upto for upto, _, _ in said[:-1]] == [3 + 4] * (len(said) - 1)  # held at the field
    assert said[-1][0] == len(done)
    assert max(length for _, length, _ in said) > 3 + len(head) + 4 * row  # though written


def _read(path: Path, upto: int) -> tuple[int, bytes]:
    written = path.read_bytes()
    return len(written), written[:upto]
