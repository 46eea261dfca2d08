"""A pickle that passed ``check_pickle`` is not scanned again; one that failed is refused every time.

A DCP save's chunks repeat a few ``data.pkl``s (one per shape) thousands of times; the
verdict is a function of the bytes alone, so it is remembered by their digest.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict

import pickle_payloads as payloads
import pytest
import torch

from shardckpt.codecs import pickle_bounds
from shardckpt.codecs.pickle_bounds import check_pickle, check_torch_file
from shardckpt.core.errors import BadInputError


@pytest.fixture
def scans(monkeypatch) -> list[int]:
    """Return the lengths of the pickles scanned from now on, nothing remembered before."""
    monkeypatch.setattr(pickle_bounds, "_PASSED", OrderedDict())
    seen: list[int] = []
    real = pickle_bounds._scan

    def spy(data):
        seen.append(len(data))
        return real(data)

    monkeypatch.setattr(pickle_bounds, "_scan", spy)
    return seen


def test_a_pickle_that_passed_is_not_scanned_again(scans):
    data = pickle.dumps({"step": 3, "lr": [0.1] * 50}) + b"trailing"
    check_pickle(data, "a")
    check_pickle(data, "b")
    check_pickle(bytearray(data), "c")
    assert scans == [len(data)]
    # A stream at a record's start is left after its STOP, remembered or not.
    for _ in range(2):
        stream = io.BytesIO(data)
        check_pickle(stream, "d")
        assert stream.tell() == len(data) - len(b"trailing")
    assert scans == [len(data)]


def test_a_pickle_that_failed_is_refused_again_and_scanned_again(scans):
    bomb = payloads.BOMBS["tuple-dag-key"]()
    for path in ("first", "second"):
        with pytest.raises(BadInputError, match="too large to be a checkpoint's") as err:
            check_pickle(bomb, path)
        assert err.value.path == path
    assert scans == [len(bomb), len(bomb)]


def test_a_torch_file_of_a_known_shape_scans_its_data_pkl_once(tmp_path, scans):
    for name in ("a.pt", "b.pt"):  # the same pickle, other bytes and serialization id
        torch.save(torch.randn(4, 3), tmp_path / name)
    for name in ("a.pt", "b.pt", "a.pt"):
        check_torch_file(tmp_path / name, tmp_path / name)
    assert len(scans) == 1
