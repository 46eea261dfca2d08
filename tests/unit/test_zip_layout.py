"""A DCP chunk's zip that repeats an earlier one's bytes is placed without its directory being parsed again.

The chunks of one shape and dtype are the same ``torch.save`` zip but for the storage's
bytes, the serialization id and their CRC-32s (``codecs/zip_layout.py``). What a
repeated zip yields must be what Python's zip reader reads from it, and any other byte
that differs must send it back to the zip reader. The zips are written by
``torch.save``, and the sources by torch's own ``dcp.save``.
"""

from __future__ import annotations

import io
import os
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from shardckpt.cli.app import run
from shardckpt.codecs.zip_layout import ZipLayouts, chunk_own, read_layout
from shardckpt.codecs.zip_records import HELD, FileSlice
from shardckpt.formats import open_reader
from shardckpt.formats.dcp import rows


def saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


@pytest.fixture(params=[5, 10_000], ids=["read-whole", "two-ends-held"])
def zips(tmp_path, request):
    """Return a file holding two ``torch.save`` zips of alike tensors, back to back, and their (start, end).

    A zip of 5 rows is read in one piece; one of 10,000 rows (160 KB) only at its two ends.
    """
    rows = request.param
    first = saved(torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4))
    second = saved(torch.full((rows, 4), 7.5))
    assert len(first) == len(second)
    path = tmp_path / "two.bin"
    path.write_bytes(first + second)
    return path, (0, len(first)), (len(first), 2 * len(first))


def parsed(fd: int, start: int, end: int):
    """Return the zip at [start, end) of ``fd`` as a held slice, its records and its layout."""
    zip_file = FileSlice(fd, start, end, held=HELD)
    records, layout = read_layout(zip_file, end - start, chunk_own)
    return zip_file, records, layout


def test_a_zip_that_repeats_the_layout_yields_what_the_zip_reader_reads_from_it(zips):
    path, a, b = zips
    fd = os.open(path, os.O_RDONLY)
    try:
        _, records_a, layout = parsed(fd, *a)
        assert layout is not None
        _, records_b, _ = parsed(fd, *b)
        got = layout.repeated_by(FileSlice(fd, *b, held=HELD), b[1] - b[0])
    finally:
        os.close(fd)
    assert got == records_b
    # The storages' CRC-32s are the second zip's own, not the first's.
    crc = {r.name: r.crcs for r in records_a}
    storages = [r for r in got if "/data/" in r.name]
    assert storages and all(r.crcs != crc[r.name] for r in storages)


def test_any_other_byte_that_differs_sends_the_zip_back_to_the_zip_reader(zips):
    path, a, b = zips
    data = bytearray(path.read_bytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        _, records_a, layout = parsed(fd, *a)
    finally:
        os.close(fd)
    varying = set()
    for r in records_a:
        if chunk_own(r.name):
            varying |= set(range(r.start, r.start + r.length))
            varying |= {at + i for at in r.crc_at for i in range(4)}
    fixed = [i for i in range(b[1] - b[0]) if i not in varying]
    assert len(fixed) > 500
    flipped_path = path.with_name("flipped.bin")
    for i in fixed:
        data[b[0] + i] ^= 0x01
        flipped_path.write_bytes(data)
        data[b[0] + i] ^= 0x01
        fd = os.open(flipped_path, os.O_RDONLY)
        try:
            assert layout.repeated_by(FileSlice(fd, *b, held=HELD), b[1] - b[0]) is None, i
        finally:
            os.close(fd)
    # Bytes of its own (the storage's) differ freely: they are checked when read.
    storage = next(r for r in records_a if "/data/" in r.name)
    data[b[0] + storage.start] ^= 0x01
    flipped_path.write_bytes(data)
    fd = os.open(flipped_path, os.O_RDONLY)
    try:
        assert layout.repeated_by(FileSlice(fd, *b, held=HELD), b[1] - b[0]) is not None
        assert layout.repeated_by(FileSlice(fd, *b, held=HELD), b[1] - b[0] - 1) is None
    finally:
        os.close(fd)


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {f"layer{i}.w": torch.randn(6, 3, generator=gen) for i in range(10)}


def test_chunks_of_a_kind_are_parsed_once_and_read_bit_exact(tmp_path, monkeypatch):
    dcp.save({"model": state()}, checkpoint_id=tmp_path / "src", no_dist=True)
    parses: list[int] = []
    real = rows._read_kind

    def spy(*args, **kwargs):
        parses.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rows, "_read_kind", spy)
    argv = ["convert", str(tmp_path / "src"), str(tmp_path / "o.safetensors"), "--to", "full"]
    assert run([*argv, "-q"]) == 0
    assert len(parses) == 1  # ten chunks of one kind
    got = load_file(tmp_path / "o.safetensors")
    for name, value in state().items():
        assert torch.equal(got[f"model.{name}"], value), name


@pytest.mark.parametrize("which", ["model.layer0.w", "model.layer7.w"])
def test_a_flipped_byte_in_a_chunks_pickle_fails_whether_or_not_an_alike_chunk_came_first(
    tmp_path, capsys, which
):
    src = tmp_path / "src"
    dcp.save({"model": state()}, checkpoint_id=src, no_dist=True)
    file, at, _ = record_start(src, which, "data.pkl")
    with open(src / file, "r+b") as f:
        f.seek(at + 3)
        byte = f.read(1)
        f.seek(at + 3)
        f.write(bytes([byte[0] ^ 0x04]))
    argv = ["convert", str(src), str(tmp_path / "o.safetensors"), "--to", "full", "-q"]
    assert run(argv) == 3
    err = capsys.readouterr().err
    assert f"cannot read the chunk at [0, 0] of '{which}'" in err
    assert "Bad CRC-32" in err
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("size", [100, 2 * HELD, 2 * HELD + 1, 5 * HELD])
def test_a_slice_read_through_its_held_ends_reads_what_the_file_holds(tmp_path, size):
    data = os.urandom(size + 300)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        held = FileSlice(fd, 100, 100 + size, held=HELD)
        wants = [(0, 30), (size - 22, 22), (size - 5, 50), (HELD - 10, 20), (size // 2, 100)]
        wants += [(size, 4), (size + 10, 4), (0, size)]
        for at, n in wants:
            assert held.pread(n, at) == data[100 + at : 100 + min(at + n, size)], (at, n)
    finally:
        os.close(fd)


def record_start(src, key: str, suffix: str) -> tuple[str, int, str]:
    """Return the file of chunk ``key``, where its record ending in ``suffix`` starts there, and its name."""
    reader = open_reader(src)
    info = next(v for k, v in reader.metadata.storage_data.items() if k.fqn == key)
    whole = (src / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    with zipfile.ZipFile(io.BytesIO(whole)) as zf:
        entry = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    at = entry.header_offset
    name_length = int.from_bytes(whole[at + 26 : at + 28], "little")
    extra = int.from_bytes(whole[at + 28 : at + 30], "little")
    return info.relative_path, info.offset + at + 30 + name_length + extra, entry.filename


@pytest.mark.parametrize("suffix", ["data.pkl", "/data/0"])
@pytest.mark.parametrize("which", ["model.layer0.w", "model.layer7.w"])
def test_verify_finds_a_flipped_byte_in_any_chunk_of_a_kind(tmp_path, capsys, which, suffix):
    src = tmp_path / "src"
    dcp.save({"model": state()}, checkpoint_id=src, no_dist=True)
    file, at, name = record_start(src, which, suffix)
    with open(src / file, "r+b") as f:
        f.seek(at + 2)
        byte = f.read(1)
        f.seek(at + 2)
        f.write(bytes([byte[0] ^ 0x10]))
    assert run(["verify", str(src)]) == 3
    err = capsys.readouterr().err
    assert f"'{which}'" in err
    assert f"record '{name}' at byte {at}" in err


def test_zips_of_one_size_that_take_turns_between_two_kinds_each_repeat_their_own(tmp_path):
    gen = torch.Generator().manual_seed(2)
    kinds = [(4, 2), (2, 4)] * 3  # one length, two pickles, in turns as in a DCP file
    blobs = [saved(torch.randn(shape, generator=gen)) for shape in kinds]
    assert len({len(b) for b in blobs}) == 1 and blobs[0][:200] != blobs[1][:200]
    path = tmp_path / "turns.bin"
    path.write_bytes(b"".join(blobs))
    size = len(blobs[0])
    layouts = ZipLayouts()
    found = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for n, shape in enumerate(kinds):
            zip_file = FileSlice(fd, n * size, (n + 1) * size, held=HELD)
            hit = layouts.find(zip_file, size)
            _, records, layout = parsed(fd, n * size, (n + 1) * size)
            if hit is None:
                layouts.add(layout, shape)
            else:
                assert hit == (records, shape)
            found.append(hit is not None)
    finally:
        os.close(fd)
    assert found == [False, False, True, True, True, True]


def test_a_zip_whose_record_runs_over_its_directory_gets_no_layout(tmp_path):
    """Bytes of a storage's own would hide the directory there: such a zip is always parsed."""
    data = bytearray(saved(torch.arange(20, dtype=torch.float32)))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename)
        directory = zf.start_dir
    # Stretch the storage record over everything up to the directory's end, in its
    # central entry (which the reader takes the size from) and its local header.
    entry = next(
        p
        for p in range(directory, len(data) - 46)
        if data[p : p + 4] == b"PK\x01\x02"
        and int.from_bytes(data[p + 42 : p + 46], "little") == info.header_offset
    )
    stretched = len(data) - (info.header_offset + 30 + len(info.filename) + len(info.extra))
    for field in (entry + 20, entry + 24):  # compressed and uncompressed sizes
        data[field : field + 4] = stretched.to_bytes(4, "little")
    path = tmp_path / "stretched.bin"
    path.write_bytes(bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        zip_file = FileSlice(fd, 0, len(data), held=HELD)
        records, layout = read_layout(zip_file, len(data), chunk_own)
    finally:
        os.close(fd)
    stored = next(r for r in records if "/data/" in r.name)
    assert stored.length == stretched  # the reader took it as stretched
    assert layout is None
