"""Functions the dist tests run on every gloo rank (importable by spawned ranks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import reference  # noqa: F401  (makes examples/make_checkpoint.py importable for --model)
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardckpt import api
from shardckpt.core.dist import Runtime
from shardckpt.core.errors import ShardckptError


def world_runtime() -> Runtime:
    """Return the runtime shardckpt's launch would build on this already-joined gloo rank."""
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    return Runtime(
        rank=dist.get_rank(), world_size=world_size, device=torch.device("cpu"), mesh=mesh
    )


def convert(src: str, dst: str, to: str, kwargs: dict) -> dict:
    """Run ``api.convert`` on this rank; return its summary."""
    result = api.convert(
        api.ConvertRequest(src=src, dst=dst, to=to, **kwargs), runtime=world_runtime()
    )
    return {"tensors": result.tensors, "world_size": result.world_size, "verified": result.verified}


def convert_costs(src: str, dst: str, to: str, kwargs: dict) -> dict | None:
    """Run ``api.convert`` on this rank; return what it reports it cost (None off the coordinator)."""
    result = api.convert(
        api.ConvertRequest(src=src, dst=dst, to=to, **kwargs), runtime=world_runtime()
    )
    return result.costs


def convert_own(srcs: list[str], dst: str, to: str, kwargs: dict) -> dict:
    """Run ``api.convert`` from ``srcs[rank]``: each rank its own copy of SRC, as on a node's disk."""
    return convert(srcs[dist.get_rank()], dst, to, kwargs)


def diff(a: str, b: str, options: dict | None = None) -> list:
    """Run ``api.diff`` on this rank (``options``: more of ``DiffRequest``); return the differing paths."""
    request = api.DiffRequest(a=a, b=b, **(options or {}))
    return [(d.path, d.reason) for d in api.diff(request, runtime=world_runtime()).differences]


def convert_expecting_failure(srcs: list[str], dst: str, to: str) -> tuple[str, int, str]:
    """Convert from ``srcs[rank]`` (so ranks can disagree); return (error type, exit code, line)."""
    try:
        api.convert(
            api.ConvertRequest(src=srcs[dist.get_rank()], dst=dst, to=to), runtime=world_runtime()
        )
    except ShardckptError as exc:
        return type(exc).__name__, exc.exit_code, exc.line()
    return "no error", 0, ""


def convert_to_own(src: str, dsts: list[str], to: str, kwargs: dict) -> dict:
    """Run ``api.convert`` into ``dsts[rank]``: each rank writes DST on its own node's disk."""
    return convert(src, dsts[dist.get_rank()], to, kwargs)


def convert_to_own_expecting_failure(
    src: str, dsts: list[str], to: str, kwargs: dict
) -> tuple[str, int, str]:
    """``convert_to_own`` that must fail; return (error type, exit code, line)."""
    try:
        convert_to_own(src, dsts, to, kwargs)
    except ShardckptError as exc:
        return type(exc).__name__, exc.exit_code, exc.line()
    return "no error", 0, ""


def verify(src: str) -> tuple[bool, list[tuple[str, str]], int]:
    """Run ``api.verify`` on this rank; return whether intact, the findings, and the bytes read."""
    result = api.verify(api.VerifyRequest(src=src), runtime=world_runtime())
    return result.intact, [(f.file, f.message) for f in result.damaged], result.bytes


@contextlib.contextmanager
def _on_store(env: dict) -> Iterator[None]:
    """Run the body with the store's environment ``env`` and the test's own TMPDIR, both restored after.

    The pooled rank runs later tests too: the store's environment and the test's own
    TMPDIR (removed when the test ends) are this call's only.
    """
    import os
    import tempfile
    from unittest import mock

    tempdir = tempfile.tempdir
    tempfile.tempdir = None
    try:
        with mock.patch.dict(os.environ, env):
            yield
    finally:
        tempfile.tempdir = tempdir


def convert_on_storage(src: str, dst: str, to: str, kwargs: dict, env: dict) -> dict:
    """Run ``api.convert`` between URLs on this rank (``env``: the store's); return what it read and uploaded."""
    from shardckpt.core import remote_files, uploads

    uploaded: dict[str, list[str]] = {"data": [], "commit": []}
    whole, commit = uploads.Uploads.whole, uploads.commit

    def recorded_whole(self, name, path, size):  # every file this rank sends, as it ends
        uploaded["data"].append(name)
        return whole(self, name, path, size)

    def recorded_commit(local, store, last, sent=None):
        uploaded["commit"] += last
        return commit(local, store, last, sent)

    uploads.Uploads.whole, uploads.commit = recorded_whole, recorded_commit
    remote_files.requests.count = remote_files.requests.bytes = 0
    try:
        with _on_store(env):
            convert(src, dst, to, kwargs)
    finally:
        uploads.Uploads.whole, uploads.commit = whole, commit
    uploaded["data"] = [n for n in uploaded["data"] if n not in uploaded["commit"]]
    return {**uploaded, "ranged_bytes": remote_files.requests.bytes}


def convert_sending_parts(
    src: str, dst: str, to: str, kwargs: dict, env: dict, damaged: int | None = None
) -> dict:
    """Run ``api.convert`` to a URL on this rank; return the parts it sent and the uploads it completed.

    ``damaged``: on this rank, each part from that offset on is sent with a byte changed
    after its CRC-32 was taken (the store refuses it); the error is returned.
    """
    from shardckpt.core import storage, uploads

    sent: list[tuple[str, int]] = []
    completed: list[tuple[str, int]] = []
    send, complete, read_part = (
        uploads.Uploads._send_part,
        uploads.Uploads._complete,
        uploads._read_part,
    )

    def recorded_send(self, name, file, number, offset, length):
        done = send(self, name, file, number, offset, length)
        sent.append((name, number))
        return done

    def recorded_complete(self, name, upload_id, parts):
        complete(self, name, upload_id, parts)
        completed.append((name, len(parts)))

    def changed(fd, offset, length):
        data, crc = read_part(fd, offset, length)
        if offset >= damaged:
            return bytes([data[0] ^ 1]) + data[1:], crc
        return data, crc

    uploads.Uploads._send_part, uploads.Uploads._complete = recorded_send, recorded_complete
    retries = storage.RETRIES
    if damaged is not None and dist.get_rank() == 1:
        uploads._read_part, storage.RETRIES = changed, 1
    error = None
    try:
        with _on_store(env):
            convert(src, dst, to, kwargs)
    except ShardckptError as exc:
        error = (type(exc).__name__, exc.exit_code, exc.line())
    finally:
        uploads.Uploads._send_part, uploads.Uploads._complete = send, complete
        uploads._read_part, storage.RETRIES = read_part, retries
    return {"sent": sorted(sent), "completed": completed, "error": error}
