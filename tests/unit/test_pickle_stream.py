"""``codecs.pickle_stream.dump`` writes ``pickle.dumps``'s bytes, lazy containers and all."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from shardckpt.codecs.pickle_stream import (
    LazyDict,
    LazyList,
    NotStreamable,
    dump,
    filled,
    materialized,
)
from shardckpt.formats.dcp.metadata_file import CHUNK


def streamed(obj, protocol: int = 4) -> bytes:
    out = io.BytesIO()
    dump(obj, out, protocol=protocol)
    return out.getvalue()


PLAIN = {
    "ints": [0, 1, 255, 256, 65535, 65536, -1, -(2**31), 2**31, 2**70, -(2**70)],
    "floats": [0.0, -1.5, float("inf")],
    "flags": (True, False, None),
    "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
    "shared": ["name"] * 3,
    "big_text": "x" * 70_000,
    "big_bytes": b"y" * 70_000,
    "dict_999": {f"k{i}": i for i in range(999)},
    "dict_1000": {f"k{i}": i for i in range(1000)},
    "list_1000": list(range(1000)),
    "list_2500": [str(i) for i in range(2500)],
    "one": [[1]],
    "dtype": torch.float32,
    "size": torch.Size([3, 4]),
}


@pytest.mark.parametrize("protocol", [4, 5])
def test_plain_objects_stream_to_the_c_picklers_bytes(protocol):
    assert streamed(PLAIN, protocol) == pickle.dumps(PLAIN, protocol=protocol)


def _chunks(ranks: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [((r * 3, 0), (3, 48)) for r in range(ranks)]


def _metadata(lazy: bool, ranks: int) -> Metadata:
    props = TensorProperties.create_from_tensor(torch.empty(0))
    entries = {}
    for t in range(40):
        chunks = (
            LazyList(ranks, lambda: (filled(CHUNK, *c) for c in _chunks(ranks)))
            if lazy
            else [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in _chunks(ranks)]
        )
        entries[f"model.layers.{t}.weight"] = TensorStorageMetadata(
            props, torch.Size([3 * ranks, 48]), chunks
        )
    items = lambda: ((f"k{i}", (i, "data")) for i in range(1500))  # noqa: E731
    storage = LazyDict(1500, items) if lazy else dict(items())
    return Metadata(state_dict_metadata=entries, storage_data=storage)


@pytest.mark.parametrize("ranks", [1, 3, 64])
def test_dcp_metadata_given_lazily_streams_to_what_pickle_dump_writes_of_it(ranks):
    expected = pickle.dumps(_metadata(lazy=False, ranks=ranks))
    assert streamed(_metadata(lazy=True, ranks=ranks)) == expected
    assert pickle.dumps(materialized(_metadata(lazy=True, ranks=ranks))) == expected


class _WithItems:
    def __reduce__(self):
        return (_WithItems, (), None, iter([1]))


def test_what_it_cannot_write_as_the_c_pickler_does_is_refused_not_guessed():
    with pytest.raises(NotStreamable):
        streamed([_WithItems()])
    with pytest.raises(NotStreamable):
        streamed([1], protocol=3)
