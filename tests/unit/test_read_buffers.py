"""Reads land in a buffer placed within a page as the file's bytes are (``core.read_buffers``).

A ``bytearray`` of MiBs starts 16 bytes into a page, and reading page-aligned file bytes
into it ran at a fifth of the page cache's speed (4K aliasing; docs/benchmark.md). The
full export's copies and ``verify``'s scan read through a ``ReadBuffer``: every read's
buffer address matches its file offset within a page.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.cli.app import run
from shardckpt.core.read_buffers import PAGE, ReadBuffer
from shardckpt.engine import scan, stored_compare, stored_copy

pytestmark = pytest.mark.quick


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_a_read_gets_the_buffer_placed_as_its_file_offset_is():
    buffer = ReadBuffer(3 * PAGE)
    for offset in (0, 16, PAGE - 16, PAGE + 1000, 7 * PAGE + 4000):
        view = buffer.for_read(offset)
        assert address(view) % PAGE == offset % PAGE
        assert len(view) == 3 * PAGE
        assert len(buffer.for_read(offset, 100)) == 100
        assert len(buffer.for_read(offset, 10 * PAGE)) == 3 * PAGE


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("aligned") / "dcp"
    gen = torch.Generator().manual_seed(7)
    model = {"w": torch.randn(1 << 20, generator=gen), "b": torch.randn(333, generator=gen)}
    dcp.save({"model": model}, checkpoint_id=path, no_dist=True)
    return path


def spy(monkeypatch, module, name) -> list[tuple[int, int]]:
    """Record (buffer address, file offset) within a page for each read ``module.name`` makes."""
    seen: list[tuple[int, int]] = []
    real = getattr(module, name)

    def reading(fd, data, at, *rest):
        seen.append((address(data) % PAGE, at % PAGE))
        return real(fd, data, at, *rest)

    monkeypatch.setattr(module, name, reading)
    return seen


def test_a_full_exports_copies_read_into_a_buffer_placed_as_the_file_is(src, tmp_path, monkeypatch):
    seen = spy(monkeypatch, stored_copy, "read_exactly")
    assert run(["convert", str(src), str(tmp_path / "out.safetensors"), "--to", "full", "-q"]) == 0
    assert seen and all(buffer == file for buffer, file in seen), seen
    assert any(file for _, file in seen)  # a read that does not start a page was placed too


def test_diffs_reads_of_both_sides_land_in_buffers_placed_as_the_files_are(
    src, tmp_path, monkeypatch
):
    other = tmp_path / "other.safetensors"
    assert run(["convert", str(src), str(other), "--to", "full", "-q"]) == 0
    seen = spy(monkeypatch, stored_compare, "read_exactly")
    assert run(["diff", str(src), str(other), "-q"]) == 0
    assert len(seen) > 2 and all(buffer == file for buffer, file in seen), seen


def test_verify_reads_into_a_buffer_placed_as_the_file_is(src, monkeypatch):
    seen = spy(monkeypatch, scan, "preadv")
    assert run(["verify", str(src), "-q"]) == 0
    assert len(seen) > 1 and all(buffer == file for buffer, file in seen), seen
