"""An S3 server on loopback for the object-storage tests: moto's, started once per test process.

``s3`` (a session fixture) starts moto's server (``moto_checked.py``: moto's own, which
also checks the CRC-32 each upload is sent with, as S3 does) on loopback and points the
standard AWS environment at it (``AWS_ENDPOINT_URL``, fake credentials), so shardckpt
and torch's ``FsspecReader``/``FsspecWriter`` reach it as they would reach S3; a test
that uses it is skipped, with the reason, where s3fs or moto is not installed or the
server does not start. ``S3.bucket()`` makes a bucket of its own for each test.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3:
    """The running server: its endpoint, an s3fs filesystem on it, and buckets made for tests."""

    def __init__(self, endpoint: str):
        import s3fs

        self.endpoint = endpoint
        self.fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)

    def bucket(self) -> str:
        """Return the name of a new, empty bucket."""
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.fs.mkdir(name)
        return name

    def keys(self, prefix: str) -> list[str]:
        """Return every object under ``prefix`` (``bucket/...``), fresh from the server."""
        self.fs.invalidate_cache()
        return sorted(self.fs.find(prefix))

    def open_uploads(self, bucket: str) -> list[str]:
        """Return the keys of the multipart uploads open in ``bucket``."""
        return [u["Key"] for u in self.fs.list_multipart_uploads(bucket)]

    def put_dir(self, local: Path, prefix: str) -> None:
        """Upload every file under ``local`` to ``prefix``."""
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            self.fs.put_file(str(path), f"{prefix}/{path.relative_to(local).as_posix()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint, timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def s3() -> Iterator[S3]:
    """Yield the moto server on loopback, with the AWS environment pointed at it."""
    for module in ("s3fs", "moto"):
        try:
            __import__(module)
        except ImportError:
            pytest.skip(f"{module} is not installed (pip install -e '.[s3,s3-server]')")
    # moto's server, checking each PUT's and part's checksum against its bytes as S3 does.
    server = [sys.executable, str(Path(__file__).with_name("moto_checked.py"))]
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*server, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not _up(endpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.skip(f"moto_server did not start on {endpoint}")
        time.sleep(0.2)
    try:
        with mock.patch.dict(os.environ, ENV, AWS_ENDPOINT_URL=endpoint):
            yield S3(endpoint)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def own_tmpdir(monkeypatch) -> Iterator[Path]:
    """Give the test's runs a ``TMPDIR`` of their own: where SRC's copies and DST's staging go.

    Tests assert that a run leaves no copy behind; in the shared one, a run of another
    pytest worker (any URL SRC) would show there. Subprocesses inherit it through the
    environment. A short path under the system's own: torch's launchers put sockets there.
    """
    import tempfile
    from multiprocessing import util

    util.get_temp_dir()  # this process's own, made once and kept: not in the one removed below
    own = Path(tempfile.mkdtemp(prefix="sck-", dir=tempfile.gettempdir()))
    monkeypatch.setenv("TMPDIR", str(own))
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    yield own
    # Removed when the session ends, not now: a process started while this test ran
    # (the ranks' pool, a fork server) keeps this TMPDIR for the tests that follow.
    atexit.register(shutil.rmtree, own, ignore_errors=True)
