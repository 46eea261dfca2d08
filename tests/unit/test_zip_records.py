"""A ``torch.save`` zip's records found from its local headers read together (``FileSlice.hold``).

Where each record's data starts and the CRC-32 written for it must be what Python's zip
reader finds in a file ``torch.save`` wrote; the headers are asked for in one go, those
near each other as one read, so a stand-in of an object on a URL asks for their bytes
alone rather than a block around each.
"""

from __future__ import annotations

import os
import zipfile
import zlib

import torch

from shardckpt.codecs import zip_records


def test_every_record_is_where_pythons_zip_reader_finds_it_read_in_few_preads(
    tmp_path, monkeypatch
):
    # 40 records: small ones (their headers near each other) and large ones (far apart).
    sizes = [3, 70_000, 1, 20_000, 5] * 8
    state = {f"t{i}": torch.arange(n, dtype=torch.float32) for i, n in enumerate(sizes)}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    raw = path.read_bytes()

    asked: list[list[tuple[int, int]]] = []
    single: list[tuple[int, int]] = []
    each, one = zip_records.pread_each, zip_records.pread
    monkeypatch.setattr(zip_records, "pread_each", lambda fd, r: asked.append(r) or each(fd, r))
    monkeypatch.setattr(
        zip_records, "pread", lambda fd, n, at: single.append((at, n)) or one(fd, n, at)
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        records = zip_records.zip_records(fd, 0, len(raw), central=False)
    finally:
        os.close(fd)

    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        assert [r.name for r in records] == [i.filename for i in infos]
        for r, info in zip(records, infos):
            data = raw[r.start : r.start + r.length]
            assert data == zf.read(info)
            assert r.crcs == (zlib.crc32(data), info.CRC)
    # One call for every header; the records far apart (after each large tensor, 8 of 70 KB
    # and 8 of 20 KB) read apart, those near each other as one.
    assert len(asked) == 1
    assert 8 <= len(asked[0]) <= 16 < len(records)
    assert sum(n for _, n in asked[0]) < 64 * len(records) + 8 * 4096
    # No header read one at a time: the only other reads are the zip's two ends (its
    # directory, and the headers there), read once each and held.
    held = zip_records.HELD
    assert single == [(0, held), (len(raw) - held, held)]
