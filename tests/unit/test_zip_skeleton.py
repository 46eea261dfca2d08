"""The blob of one tensor (DCP's item) laid out without torch's fake tensors, as torch lays it out."""

from __future__ import annotations

import io
import os
import tempfile

import pytest
import torch

from shardckpt.codecs import zip_skeleton

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.int64,
    torch.bool,
    torch.complex64,
]
SHAPES = [(), (0,), (1,), (3, 5), (7, 0, 3), (2, 3, 4, 5), (1 << 20, 3), (100_000, 100_000)]


def _laid_out(placeholder: torch.Tensor) -> tuple[bytes, bytes, int, int]:
    """Return what ``torch.save`` under ``skip_data`` writes around the data, and where the data lies."""
    with tempfile.TemporaryFile() as f:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(placeholder, f)
        end, fd = f.tell(), f.fileno()
        (entry,) = zip_skeleton._data_records(fd, 0, end)
        head = os.pread(fd, entry.start, 0)
        tail = os.pread(fd, end - entry.start - entry.length, entry.start + entry.length)
    return head, tail, entry.start, entry.length


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_an_unbacked_tensor_is_laid_out_as_torchs_fake_tensor_is(shape, dtype):
    # 100,000 x 100,000 is 10-160 GB: the placeholder takes none of it.
    with zip_skeleton.fake_mode():
        fake = torch.empty(shape, dtype=dtype)
    assert _laid_out(zip_skeleton.unbacked(shape, dtype)) == _laid_out(fake)


@pytest.mark.parametrize("shape", [(0,), (3, 5), (1000, 17)], ids=str)
def test_a_blob_filled_with_the_data_is_what_torch_saves_and_loads(shape):
    real = torch.randn(shape)
    saved = io.BytesIO()
    torch.save(real, saved)
    blob = zip_skeleton.tensor_blob(shape, torch.float32)
    data = real.numpy().tobytes()
    assert blob.data.length == len(data)
    filled = bytearray(blob.head + data + blob.tail)
    with tempfile.TemporaryFile() as f:
        f.write(filled)
        record = zip_skeleton.write_blob(f.fileno(), 0, blob, "x")
        zip_skeleton.patch_crc(f.fileno(), record, zip_skeleton.crc32(data))
        f.seek(0)
        back = torch.load(f, weights_only=True)
    assert torch.equal(back, real)
