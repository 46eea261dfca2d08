"""The ranged reads of a URL SRC's stand-ins (``core.remote_files``): what is asked of the store.

A store stand-in that serves ``cat_file`` from bytes and counts what it is asked for;
the reads go through ``core.remote_files.read_into`` as ``core.files.preadv`` sends them.
"""

from __future__ import annotations

import threading

import pytest

from shardckpt.core import remote_files
from shardckpt.core.remote_files import PART, SMALL, RemoteObject


class Store:
    """An fsspec-like filesystem of in-memory objects that logs each ranged GET."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects
        self.asked: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def cat_file(self, key: str, start: int, end: int) -> bytes:
        with self._lock:
            self.asked.append((key, start, end))
        return self.objects[key][start:end]


@pytest.fixture
def store(tmp_path):
    remote_files.requests.count = remote_files.requests.bytes = 0
    data = {
        "a": bytes(range(256)) * (5 * PART // 256),
        "b": bytes(reversed(range(256))) * (3 * PART // 256),
    }
    fs = Store(data)
    objs = {k: RemoteObject(fs, k, f"s3://b/{k}", len(v)) for k, v in data.items()}
    keys = []
    for name, obj in objs.items():  # their stand-ins, as a run lays them out
        with open(tmp_path / name, "xb") as f:
            f.truncate(obj.size)
        keys.append(remote_files.stand_in(tmp_path / name, obj))
    yield fs, objs
    remote_files.forget(keys)  # the fetching threads end, as at a run's end


def read(obj: RemoteObject, start: int, length: int) -> bytes:
    out = bytearray(length)
    assert remote_files.read_into(obj, memoryview(out), start) == length
    return bytes(out)


def test_two_threads_reading_runs_said_ahead_keep_each_others_parts(store):
    fs, objs = store
    a, b = objs["a"], objs["b"]
    # Two runs of one object and a run of another, said ahead as a batch of copies is.
    runs = [(a, 0, 2 * PART), (a, 2 * PART, 2 * PART), (b, 0, 2 * PART)]
    for obj, start, length in runs:
        remote_files.will_read(obj, [(start, length)])
    got: dict[int, bytes] = {}
    first_done = threading.Event()

    def reader(i: int) -> None:
        obj, start, length = runs[i]
        if i == 0:
            first_done.wait(10)  # the later run of the same object is read first
        got[i] = read(obj, start, length)
        if i == 1:
            first_done.set()

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (obj, start, length) in enumerate(runs):
        assert got[i] == fs.objects[obj.key][start : start + length]
    # Each byte asked for once, in parts of PART: no thread dropped another's.
    assert sorted(fs.asked) == sorted(
        [("a", s, s + PART) for s in range(0, 4 * PART, PART)]
        + [("b", s, s + PART) for s in range(0, 2 * PART, PART)]
    )


def test_consecutive_small_runs_said_ahead_are_one_request_per_part(store):
    fs, objs = store
    a = objs["a"]
    size = 100 << 10  # each below SMALL: alone, each would be a block of its own
    assert size < SMALL
    runs = [(at, size) for at in range(4096, 4096 + 60 * size, size)]
    remote_files.will_read(a, runs)
    for at, length in runs:
        assert read(a, at, length) == fs.objects["a"][at : at + length]
    total = 60 * size
    assert remote_files.requests.bytes == total
    assert len(fs.asked) == -(-total // PART)


def test_a_stand_in_carried_unread_is_copied_with_the_stores_bytes(store, tmp_path):
    # A trainer's reader copies the files it carries (core.copies): a stand-in copies
    # what the store holds, in PART-sized requests asked ahead, never its own zeros.
    from shardckpt.core.copies import copy_file

    fs, objs = store
    copy_file(tmp_path / "b", tmp_path / "b-copy", tmp_path)
    assert (tmp_path / "b-copy").read_bytes() == fs.objects["b"]
    assert sorted(fs.asked) == [("b", n * PART, (n + 1) * PART) for n in range(3)]
