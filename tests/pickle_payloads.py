"""Hand-written malicious pickles, and checkpoints of every pickling format that carry them.

Each payload, if anything runs it, creates the file ``marker``; a test that finds no
marker after a command has shown that the command never ran it. The pickles are
written opcode by opcode, so each holds exactly the trick it is named after:

- ``reduce-os-system`` / ``reduce-exec``: the classic ``__reduce__``, a global callable
  called with a command.
- ``dotted-stack-global`` / ``dotted-global``: protocol 4 names ``os.system`` as an
  attribute path under a module DCP metadata legitimately uses.
- ``getattr-chain``: only names a loader of ShardedTensor files once allowed
  (``builtins.getattr``, ``_rebuild_from_type_v2``, ``ShardMetadata``), walking
  ``ShardMetadata.__init__.__builtins__`` to ``eval``.
"""

from __future__ import annotations

import io
import pickle
import shlex
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
SHARDED_TENSOR = ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")


def _str(text: str) -> bytes:
    data = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _tuple(*items: bytes) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def _call(func: bytes, *args: bytes) -> bytes:
    return func + _tuple(*args) + pickle.REDUCE


def _proto(n: int) -> bytes:
    return pickle.PROTO + bytes([n])


def _shell(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def _python(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


def reduce_os_system(marker: Path) -> bytes:
    """Return ``os.system("touch marker")`` as ``pickle.dumps`` writes a ``__reduce__`` to it."""
    return _proto(2) + _call(_global("os", "system"), _str(_shell(marker))) + pickle.STOP


def reduce_exec(marker: Path) -> bytes:
    """Return ``builtins.exec`` of code that creates ``marker``."""
    return _proto(2) + _call(_global("builtins", "exec"), _str(_python(marker))) + pickle.STOP


def dotted_stack_global(marker: Path) -> bytes:
    """Return ``os.system`` reached as ``torch.distributed.checkpoint.metadata`` + ``"os.system"``."""
    func = _str(DCP_METADATA_MODULE) + _str("os.system") + pickle.STACK_GLOBAL
    return _proto(4) + _call(func, _str(_shell(marker))) + pickle.STOP


def dotted_global(marker: Path) -> bytes:
    """Return the same attribute path as a GLOBAL opcode (protocol 4 traverses it too)."""
    func = _global(DCP_METADATA_MODULE, "os.system")
    return _proto(4) + _call(func, _str(_shell(marker))) + pickle.STOP


def getattr_chain(marker: Path) -> bytes:
    """Return ``eval`` reached from allowed names through ``getattr``, then called.

    ``getattr(getattr(ShardMetadata.__init__, "__builtins__"), "get")`` is a bound method
    no allow-list names, but ``_rebuild_from_type_v2(func, type, args, state)`` (allowed
    by default) calls any ``func`` it is given: once to fetch ``eval``, once to run it.
    """
    getattr_ = _global("builtins", "getattr")

    def attr(obj: bytes, name: str) -> bytes:
        return _call(getattr_, obj, _str(name))

    rebuild = _global("torch._tensor", "_rebuild_from_type_v2")
    anchor = _global("torch.distributed._shard.metadata", "ShardMetadata")
    builtin_type = attr(getattr_, "__class__")
    builtins_get = attr(attr(attr(anchor, "__init__"), "__builtins__"), "get")
    eval_ = _call(rebuild, builtins_get, builtin_type, _tuple(_str("eval")), pickle.EMPTY_DICT)
    ran = _call(rebuild, eval_, builtin_type, _tuple(_str(_python(marker))), pickle.EMPTY_DICT)
    return _proto(2) + ran + pickle.STOP


PAYLOADS: dict[str, Callable[[Path], bytes]] = {
    "reduce-os-system": reduce_os_system,
    "reduce-exec": reduce_exec,
    "dotted-stack-global": dotted_stack_global,
    "dotted-global": dotted_global,
    "getattr-chain": getattr_chain,
}


def as_state_dict(payload: bytes, *, flat_param: bool = False) -> bytes:
    """Return ``payload`` as the value of a state dict that detection takes for FSDP1.

    The dict first names ShardedTensor and (``flat_param``) a ``_flat_param`` key, so a
    directory of such files is detected as ``fsdp1-sharded`` or ``fsdp1-local`` and the
    payload reaches that format's reader; its value is the payload's object.
    """
    assert payload.startswith(pickle.PROTO) and payload.endswith(pickle.STOP)
    proto, body = payload[:2], payload[2:-1]
    key = "layer._flat_param" if flat_param else "layer.weight"
    return (
        proto
        + pickle.EMPTY_DICT
        + _str(key)
        + _global(*SHARDED_TENSOR)
        + pickle.SETITEM
        + _str("evil")
        + body
        + pickle.SETITEM
        + pickle.STOP
    )


def with_data_pkl(torch_file: Path, pickle_bytes: bytes) -> None:
    """Replace the pickle of a ``torch.save`` zip with ``pickle_bytes``; keep its other records."""
    with zipfile.ZipFile(torch_file) as zf:
        records = [(info.filename, zf.read(info)) for info in zf.infolist()]
    with zipfile.ZipFile(torch_file, "w", zipfile.ZIP_STORED) as zf:
        for name, data in records:
            zf.writestr(name, pickle_bytes if name.endswith("/data.pkl") else data)


def torch_file(path: Path, pickle_bytes: bytes) -> Path:
    """Write a ``torch.save`` file whose pickle is ``pickle_bytes``; return its path."""
    torch.save({"w": torch.ones(2)}, path)
    with_data_pkl(path, pickle_bytes)
    return path


def rank_dir(path: Path, pickle_bytes: bytes, world_size: int = 2) -> Path:
    """Write a directory of ``rank_{r}.pt`` files, each with ``pickle_bytes`` as its pickle."""
    path.mkdir()
    for rank in range(world_size):
        torch_file(path / f"rank_{rank}.pt", pickle_bytes)
    return path


def dcp_dir(path: Path) -> Path:
    """Write a small DCP checkpoint with one tensor and one non-tensor value (``epoch``)."""
    dcp.save({"w": torch.arange(6.0), "epoch": 3}, checkpoint_id=path, no_dist=True)
    return path


def dcp_with_metadata(path: Path, pickle_bytes: bytes) -> Path:
    """Write a DCP checkpoint whose ``.metadata`` is ``pickle_bytes``."""
    dcp_dir(path)
    (path / ".metadata").write_bytes(pickle_bytes)
    return path


def dcp_with_value(path: Path, value_bytes: bytes, key: str = "epoch") -> Path:
    """Write a DCP checkpoint whose value ``key`` is stored as ``value_bytes``.

    The bytes go at the end of the value's ``.distcp`` file and ``.metadata`` is
    re-written to point there, exactly as if DCP had stored them.
    """
    dcp_dir(path)
    md_file = path / ".metadata"
    with open(md_file, "rb") as f:
        md = pickle.load(f)
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    data_file = path / info.relative_path
    info.offset = data_file.stat().st_size
    info.length = len(value_bytes)
    with open(data_file, "ab") as f:
        f.write(value_bytes)
    with open(md_file, "wb") as f:
        pickle.dump(md, f)
    return path


def torch_save_bytes(pickle_bytes: bytes) -> bytes:
    """Return what ``torch.save`` writes for a value, with ``pickle_bytes`` as its pickle."""
    buf = io.BytesIO()
    torch.save(3, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        records = [(info.filename, zf.read(info)) for info in zf.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for name, data in records:
            zf.writestr(name, pickle_bytes if name.endswith("/data.pkl") else data)
    return out.getvalue()
