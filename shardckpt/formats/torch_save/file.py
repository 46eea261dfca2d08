"""``torch``: one ``torch.save`` file (``.pt``, ``.pth``, ``.bin``) holding every tensor whole.

Reading memory-maps the file (``torch.load(mmap=True)``), so metadata costs no tensor
reads and each rank touches only its rows. Writing: the coordinator writes the file's
``torch.save`` skeleton (``zip_skeleton``: the real pickle, a record per tensor, no
bytes), every rank writes its rows of each tensor at their record's offset, and the
zip checksums are combined and patched at the end. No process ever holds the whole
checkpoint, and the result is an ordinary ``torch.save`` file.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardckpt.codecs.pickle_bounds import check_torch_file
from shardckpt.codecs.pickle_scan import (
    ATTRIBUTE_BAGS,
    TRUST_HINT,
    DamagedPickle,
    judge_failed_load,
    quiet_protocol_warning,
)
from shardckpt.codecs.torch_pickle import NotPlain, plain_torch_file, stand_ins
from shardckpt.codecs.zip_skeleton import fake_mode, unbacked, write_skeleton
from shardckpt.core.errors import SRC_FORMAT, BadInputError, UnsafePickleError
from shardckpt.core.files import (
    SourceStream,
    is_remote_file,
    os_error,
    read_head,
    source_file,
    source_stat,
    writing,
)
from shardckpt.core.lazy_torch import loaded, torch
from shardckpt.core.torch_internals import missing_safe_globals, storage_key, stored_offset
from shardckpt.formats.base import Frame, Index, Reader, Rows, StoredRun, Writer
from shardckpt.formats.torch_save.mapped import (
    MappedRecord,
    expect_mapped,
    mapped_records,
    read_record_into,
    record_view,
    record_written,
    stored_records,
)
from shardckpt.formats.trainers.deepspeed.lone_file import pointer_hint, refuse_placeholders
from shardckpt.state.checksums import Written, active, checked, raw_bytes
from shardckpt.state.dtypes import dtype_named
from shardckpt.state.plain_tensor import PlainTensor
from shardckpt.state.regions import Region, spread
from shardckpt.state.tree import TensorMeta, dotted, map_leaves, tensor_leaves, too_deep, walk


def load(
    path: Path,
    trust_pickle: bool,
    *,
    safe_globals: Sequence = (),
    trusted_pickle=None,
    lazy: bool = False,
) -> object:
    """Return the object in a ``torch.save`` file, memory-mapped, refusing code execution.

    ``safe_globals`` widens torch's ``weights_only`` allow-list for one format (every
    load allows the DTensor classes newer torch releases allow, ``missing_safe_globals``);
    ``trusted_pickle`` is the pickle module used with ``--trust-pickle`` (default: pickle).
    A failure is told as unsafe (only then is ``--trust-pickle`` suggested), damaged or
    unreadable (``pickle_scan.judge_failed_load``). Before torch sees the file, its
    pickles pass ``pickle_bounds.check_torch_file``, trusted or not.

    The stand-in of an object of a URL SRC (``core.files.is_remote_file``) is never
    mapped (a mapping reads zeros): torch reads it through ``source_stream``, its tensors
    on the meta device with ``lazy`` (their bytes are read later, by ranges:
    ``TorchReader``), else whole into memory.
    """
    checked_file(path)
    options: dict = {"weights_only": not trust_pickle}
    allowed = [*missing_safe_globals(), *ATTRIBUTE_BAGS, *safe_globals]
    if trust_pickle and trusted_pickle is not None:
        options["pickle_module"] = trusted_pickle
    try:
        with torch.serialization.safe_globals(allowed), quiet_protocol_warning():
            if is_remote_file(path):
                with _Unmapped(SourceStream(path), buffer_size=64 << 10) as stream:
                    where = "meta" if lazy else "cpu"
                    return torch.load(stream, map_location=where, **options)
            try:
                obj = torch.load(path, map_location="cpu", mmap=True, **options)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                # Files from torch.save(_use_new_zipfile_serialization=False) cannot be mapped.
                return torch.load(path, map_location="cpu", **options)
        # Each record's CRC-32 is checked as its bytes are read (``Ledger.note_view``).
        expect_mapped(path, obj)
        return obj
    except OSError as exc:
        raise os_error(exc, path) from None
    except Exception as exc:
        failure = judge_failed_load(exc, path, trust_pickle)
    if failure.kind == "refused":
        raise UnsafePickleError(
            f"refused to unpickle ({failure.reason})",
            path=path,
            hint=pointer_hint(path) or TRUST_HINT,
        )
    if failure.kind == "damaged":
        raise _damaged(path, failure.reason)
    if failure.kind == "missing":
        raise BadInputError(
            f"unpickling it imports the Python module '{failure.reason}', which is not installed",
            path=path,
            hint=pointer_hint(path)
            or f"install '{failure.reason.split('.')[0]}' where shardckpt runs to load it "
            "with --trust-pickle",
        )
    raise BadInputError(
        f"not a readable torch.save file ({failure.reason})",
        path=path,
        hint=f"the file is truncated or in another format; name its format with {SRC_FORMAT}",
    )


def checked_file(path: Path) -> None:
    """Raise one line unless ``path`` is a file whose pickles pass ``check_torch_file``: what every read of it checks first."""
    if stat.S_ISDIR(source_stat(path).st_mode):
        raise BadInputError(
            "is a directory, not a torch.save file",
            path=path,
            hint=f"pass the file itself, or {SRC_FORMAT} dcp for a DCP directory",
        )
    source_file(path)
    try:
        check_torch_file(path, path)
    except DamagedPickle as exc:
        raise _damaged(path, str(exc)) from None
    except OSError as exc:
        raise os_error(exc, path) from None


class _Unmapped(io.BufferedReader):
    """A stand-in's stream as torch must read it: through its reads, never its descriptor.

    torch reads a legacy file's storages from ``fileno()`` when there is one: a stand-in's
    descriptor has no bytes.
    """

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a URL SRC's stand-in is read through core.files")


def _damaged(path: Path, reason: str) -> BadInputError:
    return BadInputError(
        f"is a damaged torch.save file ({reason})",
        path=path,
        hint="re-copy it from where it was written",
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
    """Reads a whole-tensor ``torch.save`` file through a memory map.

    The stand-in of an object of a URL SRC is not mapped: torch loads it on the meta
    device (``load(lazy=True)``), which says where each storage's record lies, and rows
    are read from there through ``core.files`` (``preadv``: ranged requests), each
    checked against its record's CRC-32. A file whose tensors cannot all be placed so
    (the other byte order, a legacy file) is loaded whole into memory through a stream.
    """

    format = "torch"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        self._tensors: dict[str, torch.Tensor] | None = None
        """By key; None while the file is read without torch (``_read_plain``)."""
        if not loaded() and not trust_pickle and not is_remote_file(self.src):
            if self._read_plain():
                return
        # A legacy (not zip) file has no records, and torch reads its storages whatever the device.
        self._stored = is_remote_file(self.src) and is_torch_zip(self.src)
        """Whether rows are read from the file by record (a URL SRC's), not from the loaded tensors."""
        self._load(lazy=self._stored)
        if self._stored and not all(
            self._key(t) in self._records
            for t in self._tensors.values()
            if t.untyped_storage().nbytes()
        ):
            self._stored = False
            self._load(lazy=False)

    def _read_plain(self) -> bool:
        """Read the file's metadata without torch (``codecs.torch_pickle``); return False where torch must.

        For ``inspect`` and ``verify``, which run without torch: each storage's record
        goes to the active ledger with the tensors viewing it, as ``expect_mapped`` tells
        it of a mapped file's. A file the stand-ins do not read (or whose tree they would
        not describe as torch's loader does) is left to ``_load``, which words any error.
        """
        checked_file(self.src)
        try:
            plain = plain_torch_file(self.src)
        except (NotPlain, OSError):
            return False
        if not isinstance(plain.obj, dict):
            return False
        refuse_placeholders(self.src, plain.obj)
        metas: list[TensorMeta] = []

        plain_tensors: dict[str, PlainTensor] = {}

        def describe(_path, leaf):
            if not isinstance(leaf, PlainTensor):
                return leaf
            metas.append(TensorMeta(str(len(metas)), leaf.shape, dtype_named(leaf.dtype.name)))
            plain_tensors[metas[-1].key] = leaf
            return metas[-1]

        try:
            tree = map_leaves(plain.obj, describe)
            if stand_ins(tree):
                return False  # a tensor in a tuple, a key or a set: torch's loader says what it is
        except RecursionError:
            return False
        names: dict[str, list[str]] = {}
        for path_, leaf in walk(plain.obj):
            if isinstance(leaf, PlainTensor) and leaf.storage_bytes:
                names.setdefault(leaf.storage, []).append(dotted(path_))
        written = {key: record_written(self.src, plain.records[key]) for key in names}
        if (ledger := active()) is not None:
            for key, held in names.items():
                ledger.expect(written[key], held)
        self._tree, self._stored, self._records = tree, False, {}
        self._plain = _PlainRecords(plain_tensors, written, names)
        return True

    def _torch_loaded(self) -> dict[str, torch.Tensor]:
        """Return the tensors by key, loading the file with torch first where it was read without."""
        if self._tensors is None:
            self._load(lazy=False)
        assert self._tensors is not None
        return self._tensors

    def _load(self, *, lazy: bool) -> None:
        obj = load_dict(self.src, self.trust_pickle, lazy=lazy)
        # A ZeRO-3 model-states file read as a torch file would give empty weights.
        refuse_placeholders(self.src, obj)
        self._tensors = {}
        try:
            self._tree = map_leaves(obj, self._describe)
        except RecursionError:
            raise too_deep(self.src) from None
        records: dict[int, MappedRecord]
        if lazy:
            records = stored_records(self.src, obj)
            if (ledger := active()) is not None:  # as expect_mapped tells it of a mapped file's
                for record in records.values():
                    ledger.expect(record.written, record.names)
        elif is_remote_file(self.src):
            records = {}  # in memory: nothing to place
        else:
            records = mapped_records(self.src, obj)
        self._records = records

    def _key(self, t: torch.Tensor) -> int | None:
        """Return the key of ``t``'s storage in ``_records``: where the file holds it, or its mapped address."""
        storage = t.untyped_storage()
        return stored_offset(storage) if self._stored else storage.data_ptr()

    def _describe(self, path, leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if type(leaf) is not torch.Tensor and not isinstance(leaf, torch.nn.Parameter):
            raise BadInputError(
                f"'{'.'.join(map(str, path))}' is a {type(leaf).__name__}, not a whole tensor",
                path=self.src,
                hint=f"pass the directory of per-rank files, with {SRC_FORMAT} fsdp2-ranks if need be",
            )
        key = str(len(self._tensors))
        self._tensors[key] = leaf.detach()
        return TensorMeta(key, tuple(leaf.shape), leaf.dtype)

    def index(self) -> Index:
        return Index(self.format, str(self.src), 1, self._tree)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        if self._stored:
            return [self._read_stored(meta, r) for meta, r in zip(metas, rows)]
        out = []
        for meta, r in zip(metas, rows):
            t = self._torch_loaded()[meta.key]
            out.append(checked(t if r is None else t[r[0] : r[1]]))
        return out

    def _read_stored(self, meta: TensorMeta, r: Rows) -> torch.Tensor:
        """Return rows ``r`` of ``meta`` read from its record in the file, checked against its CRC-32."""
        t = self._torch_loaded()[meta.key]
        first, stop = (0, 0) if r is None or not meta.shape else r
        shape = meta.shape if r is None or not meta.shape else (stop - first, *meta.shape[1:])
        out = torch.empty(shape, dtype=t.dtype)
        if not out.numel():
            return out
        row = out[0].numel() if out.dim() else 0
        runs = self.stored_runs(meta, first * row, first * row + out.numel())
        record = self._records[self._key(t)]  # type: ignore[index]
        if runs is None:  # a view that is not one run: its storage's record read whole
            whole = record_view(self.src, t, record)
            return whole if r is None or not meta.shape else whole[first:stop].clone()
        read_record_into(self.src, raw_bytes(out), runs[0].offset, record)
        return out

    def stored_runs(self, meta: TensorMeta, start: int, stop: int) -> list[StoredRun] | None:
        """Return where elements [start, stop) of ``meta`` lie in the file: one run of its record.

        A whole tensor's elements lie in its storage's zip record, stored uncompressed, in
        order: copied as they lie (``engine.stored_copy``), not through the mapping. None
        for a tensor that is not one run there (a transposed view) or not placed.
        """
        if self._tensors is None:
            return self._plain.runs(self.src, meta, start, stop)
        t = self._torch_loaded()[meta.key]
        record = self._records.get(self._key(t))  # type: ignore[arg-type]
        if (
            record is None
            or not t.is_contiguous()
            or (t.dtype, tuple(t.shape)) != (meta.dtype, meta.shape)
        ):
            return None
        return _one_run(
            self.src,
            record.written,
            record.names,
            t.storage_offset(),
            t.element_size(),
            start,
            stop,
        )


@dataclass(frozen=True)
class _PlainRecords:
    """A file read without torch (``_read_plain``): its tensors by key, and their storages' records."""

    tensors: dict[str, PlainTensor]
    written: dict[str, Written]
    """Each storage's record, by the storage's key."""
    names: dict[str, list[str]]
    """The tensors each storage holds, as errors name them."""

    def runs(self, src: Path, meta: TensorMeta, start: int, stop: int) -> list[StoredRun] | None:
        """``Reader.stored_runs``, as ``stored_runs`` answers with torch: None for a view that is not one run."""
        t = self.tensors[meta.key]
        if not t.storage_bytes or not t.is_contiguous():
            return None
        names = tuple(self.names[t.storage])
        written = self.written[t.storage]
        return _one_run(src, written, names, t.storage_offset, t.dtype.itemsize, start, stop)


def _one_run(
    src: Path, written: Written, names, storage_offset: int, size: int, start: int, stop: int
) -> list[StoredRun]:
    """Return elements [start, stop) of a contiguous view from element ``storage_offset`` of its record."""
    offset = written.start + (storage_offset + start) * size
    return [StoredRun(src, offset, (stop - start) * size, written, names)]


UNBACKED_MOST = 8192
"""The most placeholders made as ``unbacked`` tensors, one shared map each: the kernel
allows a process 65,530 maps (``vm.max_map_count``), so more are fake tensors."""


def placeholders(tree: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Return ``tree`` with each ``TensorMeta`` a placeholder of its shape and dtype, and those by key.

    A placeholder's bytes are never read (``write_skeleton`` is told which storages are
    placeholders: those the fills name). Up to ``UNBACKED_MOST`` they are ``unbacked``
    tensors, which need nothing but a sparse file; beyond, fake tensors, whose mode
    imports torch's compiler stack (1.7 s here).
    """
    fakes: dict[str, torch.Tensor] = {}
    many = sum(1 for _ in tensor_leaves(tree)) > UNBACKED_MOST

    def fake(_path, leaf):
        if not isinstance(leaf, TensorMeta):
            return leaf
        shape = tuple(leaf.shape)
        made = torch.empty(shape, dtype=leaf.dtype) if many else unbacked(shape, leaf.dtype)
        fakes[leaf.key] = made
        return made

    with fake_mode() if many else contextlib.nullcontext():
        return map_leaves(tree, fake), fakes


def skeleton_regions(
    fd: int,
    offset: int,
    obj,
    fills: dict[int, list[tuple[str, int, int, int]]],
    file: str,
    pickle_module=None,
) -> Frame:
    """Write ``obj``'s ``torch.save`` skeleton at ``offset`` of ``fd``; return what fills it.

    ``fills`` maps each fake storage (``storage_key``) to ``(key, start, stop, byte offset)``
    entries: elements [start, stop) of source tensor ``key`` at that byte of the storage.
    """
    placeholders, records, pieces = write_skeleton(
        fd, offset, obj, file, pickle_module=pickle_module, placeholders=set(fills)
    )
    regions = [
        Region(key, start, stop, file, placeholders[cdata].start + at, placeholders[cdata])
        for cdata, entries in fills.items()
        for key, start, stop, at in entries
        # An empty placeholder has no bytes to fill, and may not be saved at all.
        if stop > start
    ]
    return Frame(regions, records, pieces)


def skeleton_file(
    path: Path,
    obj,
    fills: dict[int, list[tuple[str, int, int, int]]],
    file: str,
    pickle_module=None,
) -> Frame:
    """Create ``path`` holding the ``torch.save`` skeleton of ``obj``; return what fills it.

    Creating and writing the skeleton are one ``writing`` guard: a full disk while
    ``torch.save`` writes it is one line naming ``path``, as a failed fill is.
    """
    with writing(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            return skeleton_regions(fd, 0, obj, fills, file, pickle_module)
        finally:
            os.close(fd)


def whole_file(path: Path, tree: dict, name: str) -> Frame:
    """Write ``tree``'s ``torch.save`` skeleton to ``path``; return the regions that fill each tensor whole.

    For a small file beside a sharded output (Lightning's ``meta.pt``, Megatron's
    ``common.pt``) that one process writes and fills; ``name`` is the file relative to DST.
    """
    skeleton, fakes = placeholders(tree)
    fills = {storage_of(fakes[m.key]): [(m.key, 0, m.numel, 0)] for _, m in tensor_leaves(tree)}
    return skeleton_file(path, skeleton, fills, name)


def storage_of(tensor: torch.Tensor) -> int:
    """Return the identity ``torch.save`` gives ``tensor``'s storage."""
    return storage_key(tensor.untyped_storage())


class TorchWriter(Writer):
    """Writes a ``torch.save`` file laid out by ``torch.save`` itself; every rank fills its rows."""

    def frame(self, runtime) -> Frame:
        def create() -> Frame:
            skeleton, fakes = placeholders(self.plan.tree)
            fills = {
                storage_of(fakes[m.key]): [(m.key, 0, m.numel, 0)] for _, m in self.plan.tensors
            }
            # Through a stream, torch names the archive "archive" instead of after the
            # (temporary) file name, so the bytes do not depend on where it is staged.
            return skeleton_file(self.root, skeleton, fills, "")

        frame = runtime.agreed(lambda: create() if runtime.coordinator else None)
        regions = runtime.broadcast(frame.regions if frame is not None else None)
        mine = spread(regions, self.plan.metas, runtime.rank, runtime.world_size)
        if frame is None:
            return Frame(mine)
        return Frame(mine, frame.records, frame.pieces)


def is_torch_file(path: Path) -> bool:
    """Return whether file ``path`` starts as ``torch.save`` writes: a zip, or a legacy pickle."""
    head = read_head(path, 4)
    return head[:4] == ZIP_MAGIC or head[:2] == b"\x80\x02"


ZIP_MAGIC = b"PK\x03\x04"


def is_torch_zip(path: Path) -> bool:
    """Return whether file ``path`` starts as a zip: ``torch.save``'s format since torch 1.6, not the legacy one."""
    return read_head(path, 4) == ZIP_MAGIC
