"""``torch``: one ``torch.save`` file (``.pt``, ``.pth``, ``.bin``) holding every tensor whole.

Reading memory-maps the file (``torch.load(mmap=True)``), so metadata costs no tensor
reads and each rank touches only its rows. Writing streams: ``torch.save`` writes the
file's skeleton under ``skip_data`` with fake tensors (the real pickle, real storage
records, no bytes), then each tensor's bytes go straight to its record's offset as it
arrives, and the zip checksums are patched at the end. No process ever holds the
whole checkpoint, and the result is an ordinary ``torch.save`` file.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from shardckpt.errors import BadInputError, IOFailure, UnsafePickleError
from shardckpt.formats.base import FullWriter, Index, Reader, Rows, contiguous_bytes, too_deep
from shardckpt.formats.files import os_error, source_file, source_stat, writing
from shardckpt.formats.pickle_scan import TRUST_HINT, judge_failed_load, quiet_protocol_warning
from shardckpt.tree import TensorMeta, map_leaves, walk


def load(
    path: Path, trust_pickle: bool, *, safe_globals: Sequence = (), trusted_pickle=None
) -> object:
    """Return the object in a ``torch.save`` file, memory-mapped, refusing code execution.

    ``safe_globals`` widens torch's ``weights_only`` allow-list for one format;
    ``trusted_pickle`` is the pickle module used with ``--trust-pickle`` (default: pickle).
    A failure is told as unsafe (only then is ``--trust-pickle`` suggested), damaged or
    unreadable (``pickle_scan.judge_failed_load``).
    """
    if stat.S_ISDIR(source_stat(path).st_mode):
        raise BadInputError(
            "is a directory, not a torch.save file",
            path=path,
            hint="pass the file itself, or --format dcp for a DCP directory",
        )
    source_file(path)
    options: dict = {"weights_only": not trust_pickle}
    if trust_pickle and trusted_pickle is not None:
        options["pickle_module"] = trusted_pickle
    try:
        with torch.serialization.safe_globals(list(safe_globals)), quiet_protocol_warning():
            try:
                return torch.load(path, map_location="cpu", mmap=True, **options)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                # Files from torch.save(_use_new_zipfile_serialization=False) cannot be mapped.
                return torch.load(path, map_location="cpu", **options)
    except OSError as exc:
        raise os_error(exc, path) from None
    except Exception as exc:
        failure = judge_failed_load(exc, path, trust_pickle)
    if failure.kind == "refused":
        raise UnsafePickleError(
            f"refused to unpickle ({failure.reason})", path=path, hint=TRUST_HINT
        )
    if failure.kind == "damaged":
        raise BadInputError(
            f"is a damaged torch.save file ({failure.reason})",
            path=path,
            hint="re-copy it from where it was written",
        )
    raise BadInputError(
        f"not a readable torch.save file ({failure.reason})",
        path=path,
        hint="the file is truncated or in another format; name its format "
        "(convert --from, inspect --format)",
    )


def load_dict(path: Path, trust_pickle: bool, **options) -> dict:
    """Return the state dict in a ``torch.save`` file (``load``'s options); refuse any other top level."""
    obj = load(path, trust_pickle, **options)
    if not isinstance(obj, dict):
        raise BadInputError(
            f"holds a {type(obj).__name__}, not a state dict",
            path=path,
            hint="shardckpt reads files whose top level is a dict",
        )
    return obj


class TorchReader(Reader):
    """Reads a whole-tensor ``torch.save`` file through a memory map."""

    format = "torch"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        obj = load_dict(self.src, trust_pickle)
        self._tensors: dict[str, torch.Tensor] = {}
        try:
            self._tree = map_leaves(obj, self._describe)
        except RecursionError:
            raise too_deep(self.src) from None

    def _describe(self, path, leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if type(leaf) is not torch.Tensor and not isinstance(leaf, torch.nn.Parameter):
            raise BadInputError(
                f"'{'.'.join(map(str, path))}' is a {type(leaf).__name__}, not a whole tensor",
                path=self.src,
                hint="per-rank files of a training job need a local-layout --format",
            )
        key = str(len(self._tensors))
        self._tensors[key] = leaf.detach()
        return TensorMeta(key, tuple(leaf.shape), leaf.dtype)

    def index(self) -> Index:
        return Index(self.format, str(self.src), 1, self._tree)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        out = []
        for meta, r in zip(metas, rows):
            t = self._tensors[meta.key]
            out.append(t if r is None else t[r[0] : r[1]])
        return out


class TorchWriter(FullWriter):
    """Streams whole tensors into a ``torch.save`` file laid out by ``torch.save`` itself."""

    def __init__(self, path: Path, tree: dict):
        super().__init__(path, tree)
        metas = [leaf for _, leaf in walk(tree) if isinstance(leaf, TensorMeta)]
        with FakeTensorMode():
            skeleton = map_leaves(
                tree,
                lambda _, leaf: (
                    torch.empty(leaf.shape, dtype=leaf.dtype)
                    if isinstance(leaf, TensorMeta)
                    else leaf
                ),
            )
        # Through a stream, torch names the archive "archive" instead of after the (temporary)
        # file name, so the bytes do not depend on where the file is staged.
        with (
            writing(path),
            torch.serialization.skip_data(materialize_fake_tensors=True),
            open(path, "wb") as stream,
        ):
            torch.save(skeleton, stream)
        self._records = _locate_records(path, metas)
        self._crc: dict[str, int] = {}
        with writing(path):
            self._fd = os.open(path, os.O_RDWR)

    def write(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        name, offset, size = self._records[meta.key]
        data = contiguous_bytes(tensor)
        if len(data) != size:
            raise IOFailure(
                f"internal: {meta.key} has {len(data)} bytes, its record {size}", path=self.path
            )
        written = 0
        with writing(self.path):
            while written < size:
                written += os.pwrite(self._fd, data[written:], offset + written)
        self._crc[name] = zlib.crc32(data)

    def close(self) -> None:
        with writing(self.path):
            try:
                _patch_crcs(self._fd, self.path, self._crc)
                os.fsync(self._fd)
            finally:
                self.abandon()

    def abandon(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def _locate_records(path: Path, metas: list[TensorMeta]) -> dict[str, tuple[str, int, int]]:
    """Map each tensor key to its storage record's (name, data offset, size).

    ``torch.save`` numbers storages in the order its pickler meets them, which is the
    tree order ``walk`` uses; the record sizes are checked so a mismatch cannot pass.
    """
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        prefix = infos[0].filename.split("/", 1)[0]
        data = {i.filename: i for i in infos if i.filename.startswith(f"{prefix}/data/")}
        if len(data) != len(metas):
            raise IOFailure(
                f"internal: torch.save wrote {len(data)} storages for {len(metas)} tensors",
                path=path,
            )
        out = {}
        with open(path, "rb") as f:
            for k, meta in enumerate(metas):
                info = data[f"{prefix}/data/{k}"]
                if info.file_size != meta.nbytes:
                    raise IOFailure(
                        f"internal: storage {k} has {info.file_size} bytes, tensor {meta.key} {meta.nbytes}",
                        path=path,
                    )
                f.seek(info.header_offset)
                header = f.read(30)
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                out[meta.key] = (
                    info.filename,
                    info.header_offset + 30 + name_len + extra_len,
                    info.file_size,
                )
    return out


def _patch_crcs(fd: int, path: Path, crcs: dict[str, int]) -> None:
    """Write each record's CRC-32 into its local header and its central-directory entry."""
    with zipfile.ZipFile(path) as zf:
        infos = {i.filename: i for i in zf.infolist()}
        pos = zf.start_dir
    for name, crc in crcs.items():
        os.pwrite(fd, struct.pack("<I", crc), infos[name].header_offset + 14)
    # Central-directory entries follow each other from start_dir: 46 fixed bytes + name/extra/comment.
    for _ in range(len(infos)):
        fixed = os.pread(fd, 46, pos)
        if fixed[:4] != b"PK\x01\x02":
            raise IOFailure("internal: unexpected zip central directory layout", path=path)
        n, m, k = struct.unpack("<HHH", fixed[28:34])
        name = os.pread(fd, n, pos + 46).decode("utf-8")
        if name in crcs:
            os.pwrite(fd, struct.pack("<I", crcs[name]), pos + 16)
        pos += 46 + n + m + k
