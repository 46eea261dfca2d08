"""moto's S3 server, serving a ranged GET from the range alone: as S3 does, for bench_s3.py.

moto 5 answers a ranged GET by reading the whole object into memory, under the object's
lock, and slicing it (``S3Response._handle_range_header`` on ``FakeKey.value``): a 4 MiB
range of a 336 MiB object costs 0.32 s there against 0.07 s from a 4 MiB object, and
ranged GETs of one object never overlap. S3 serves a range at the cost of the range.
Here, during a GET with one ``Range``, an object's value is a view that reads only the
bytes sliced from it; every other request is moto's own. Run as ``moto_server``:

    python scripts/bench_moto.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import sys
import threading

import moto.s3.models as models
import moto.s3.responses as responses

_here = threading.local()


class _Ranged:
    """An object's value that reads only the bytes sliced from it."""

    def __init__(self, key):
        self.key = key

    def __len__(self) -> int:
        return self.key.contentsize

    def __bool__(self) -> bool:
        return self.key.contentsize > 0

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))


_value = models.FakeKey.value


def _ranged_value(key):
    return _Ranged(key) if getattr(_here, "ranged", False) else _value.fget(key)


models.FakeKey.value = property(_ranged_value, _value.fset)
_key_response = responses.S3Response.key_response


def key_response(self, request, full_url, headers):
    wanted = request.headers.get("range") or ""
    _here.ranged = request.method == "GET" and wanted.startswith("bytes=") and "," not in wanted
    try:
        return _key_response(self, request, full_url, headers)
    finally:
        _here.ranged = False


responses.S3Response.key_response = key_response

if __name__ == "__main__":
    from moto.server import main

    sys.exit(main())
