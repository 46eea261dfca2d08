"""moto's S3 server, checking the checksum a PUT or a part is sent with, as S3 does.

moto 5 stores the ``x-amz-checksum-*`` value a request names without looking at the
bytes (``S3Response._get_checksum``). S3 computes the checksum of the bytes it received
and refuses the request when they differ: ``400 BadDigest``, "The CRC32 you specified
did not match the calculated checksum." Here, a PUT or an UploadPart whose
``x-amz-checksum-ALGORITHM`` header differs from the checksum of its body is refused so;
every other request is moto's own. Run as ``moto_server``:

    python tests/moto_checked.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import sys

import moto.s3.responses as responses
from moto.s3.exceptions import S3ClientError
from moto.s3.utils import compute_checksum

_get_checksum = responses.S3Response._get_checksum


def checked(self, response_headers):
    algorithm = self.headers.get("x-amz-sdk-checksum-algorithm", "")
    sent = self.headers.get(f"x-amz-checksum-{algorithm.lower()}") if algorithm else None
    if sent:
        body = self.body if isinstance(self.body, bytes) else self.raw_body
        computed = compute_checksum(body, algorithm=algorithm.upper())
        if isinstance(computed, bytes):
            computed = computed.decode()
        if computed != sent:
            raise S3ClientError(
                "BadDigest",
                f"The {algorithm.upper()} you specified did not match the calculated checksum.",
            )
    return _get_checksum(self, response_headers)


responses.S3Response._get_checksum = checked

if __name__ == "__main__":
    from moto.server import main

    sys.exit(main())
