"""Functions the dist tests run on every gloo rank (importable by spawned ranks)."""

from __future__ import annotations

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


def convert_on_storage(src: str, dst: str, to: str, kwargs: dict, env: dict) -> dict:
    """Run ``api.convert`` between URLs on this rank (``env``: the store's); return what it read and uploaded."""
    import os
    import tempfile

    from shardckpt.core import remote_files, uploads

    # The pooled rank runs later tests too: the store's environment and the test's own
    # TMPDIR (removed when the test ends) are this call's only.
    before, tempdir = {k: os.environ.get(k) for k in env}, tempfile.tempdir
    os.environ.update(env)
    tempfile.tempdir = None
    uploaded: dict[str, list[str]] = {"data": [], "commit": []}
    whole, commit = uploads.Uploads.whole, uploads.commit

    def recorded_whole(self, name, path, size):  # every file this rank sends, as it ends
        uploaded["data"].append(name)
        return whole(self, name, path, size)

    def recorded_commit(local, store, last):
        uploaded["commit"] += last
        return commit(local, store, last)

    uploads.Uploads.whole, uploads.commit = recorded_whole, recorded_commit
    remote_files.requests.count = remote_files.requests.bytes = 0
    try:
        convert(src, dst, to, kwargs)
    finally:
        uploads.Uploads.whole, uploads.commit = whole, commit
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        tempfile.tempdir = tempdir
    uploaded["data"] = [n for n in uploaded["data"] if n not in uploaded["commit"]]
    return {**uploaded, "ranged_bytes": remote_files.requests.bytes}
