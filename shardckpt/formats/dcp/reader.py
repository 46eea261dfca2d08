"""``dcp``: a torch.distributed.checkpoint directory (``.metadata`` + ``*.distcp``).

Tensor rows are read from the bytes of the stored chunks that overlap them
(``shardckpt.formats.dcp.rows``), whichever rank (real or virtual, see
``shardckpt.formats.ranks.target_ranks``) they are read for. Non-tensor values, and a chunk that
cannot be read that way, go through DCP's own loader: a target of some rows is
declared to it as one chunk at its row offset. Writing is ``shardckpt.formats.dcp.writer``. Two safety
changes to torch's defaults: ``.metadata`` is unpickled with an allow-list of DCP's
metadata classes, and non-tensor values are loaded with ``weights_only=True``. Torch
loaded or not, ``.metadata`` is read into plain stand-ins (``plain_metadata``) and plain
values from their zips (``values``): DCP's package (and DTensor with it) is imported only
for what DCP's loader must read (``loader``), and torch only where a command needs it.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath

from shardckpt.codecs.pickle_bounds import check_pickle
from shardckpt.codecs.pickle_scan import TRUST_HINT, first_line
from shardckpt.core.collector import collector_paused, spared_while
from shardckpt.core.errors import (
    SRC_FORMAT,
    BadInputError,
    UnsafePickleError,
    UnsupportedTorchError,
)
from shardckpt.core.files import has_file, os_error
from shardckpt.core.lazy_torch import loaded, torch
from shardckpt.core.sight import Sight
from shardckpt.formats.base import Index, Reader, Rows, StoredItem, StoredRun, rows_shape
from shardckpt.formats.dcp import METADATA_FILE, plain_metadata, read_once
from shardckpt.formats.dcp.check import check_metadata
from shardckpt.formats.dcp.plain_metadata import MetadataIndex, is_a
from shardckpt.formats.dcp.rows import StoredRows
from shardckpt.formats.dcp.values import REFUSED, NotPlain, plain_value, stored_bytes
from shardckpt.formats.ranks.dim0_split import WorldSizes, describe_chunks, infer_world_sizes
from shardckpt.state.dtypes import as_torch, of_process
from shardckpt.state.tree import Chunk, TensorMeta, build

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _metadata_vocabulary() -> dict[tuple[str, str], object]:
    """Return every ``(module, name)`` that DCP's ``.metadata`` pickle names, and what it stands for.

    Only these exact pairs are looked up: no import by name and no dotted attribute path
    (protocol 4 would let ``(allowed module, "os.system")`` walk to anything).
    """
    import torch
    import torch.distributed.checkpoint.metadata as torch_metadata

    from shardckpt.core import torch_internals

    classes = [getattr(torch_metadata, c.__name__) for c in plain_metadata.CLASSES]
    vocabulary: dict[tuple[str, str], object] = {(c.__module__, c.__qualname__): c for c in classes}
    if "strides" not in torch_metadata.TensorProperties.__dataclass_fields__:
        # This torch predates 2.15, which pickles a tensor's strides as a sixth field.
        key = (torch_metadata.__name__, "TensorProperties")
        vocabulary[key] = _properties_of_newer_torch(torch_metadata.TensorProperties)
    vocabulary.update(torch_internals.dcp_metadata_globals())
    vocabulary[("torch", "Size")] = torch.Size
    vocabulary[("collections", "OrderedDict")] = OrderedDict
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            vocabulary[("torch", name)] = value
    # StorageMeta.checkpoint_id may be the path it was saved to. Python 3.13 names
    # pathlib's classes from pathlib._local; a pure path reads on any OS (a WindowsPath
    # cannot be made on Linux) and is all the id needs.
    for module in ("pathlib", "pathlib._local"):
        for name, pure in (("Posix", PurePosixPath), ("Windows", PureWindowsPath)):
            vocabulary[(module, f"{name}Path")] = vocabulary[(module, f"Pure{name}Path")] = pure
    return vocabulary


def _properties_of_newer_torch(properties: type) -> type:
    """Return this torch's ``TensorProperties``, reading the six fields torch 2.15 pickles too.

    The sixth, the saved tensor's strides, is dropped: rows are read from each chunk's own
    record, whose pickle has its strides, and this torch's loader has no use for them.
    """

    class TensorProperties(properties):
        def __setstate__(self, state) -> None:
            super().__setstate__(tuple(state)[:5])
            self.__class__ = properties  # torch's own, as every other reader of it expects

    TensorProperties.__module__ = properties.__module__
    return TensorProperties


def torch_vocabulary() -> Mapping[tuple[str, str], object]:
    """Return what ``.metadata`` names, as torch's classes (made once, imports torch)."""
    found = globals().get("_VOCABULARY")
    return found if found is not None else __getattr__("_VOCABULARY")


def metadata_vocabulary() -> Mapping[tuple[str, str], object]:
    """Return what ``.metadata`` names, as torch's classes where torch is loaded, else as plain stand-ins."""
    return torch_vocabulary() if loaded() else plain_metadata.VOCABULARY


def __getattr__(name: str) -> object:
    # ``_VOCABULARY``, torch's classes by name, is made on first use: it imports torch.
    if name == "_VOCABULARY":
        globals()[name] = _metadata_vocabulary()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside DCP's metadata vocabulary is refused.

    ``extra`` widens the vocabulary for a writer that stores more in ``.metadata``
    (Megatron's save plans), by the same exact ``(module, name)`` pairs.
    """

    def __init__(
        self,
        file,
        extra: Mapping[tuple[str, str], object] | None = None,
        base: Mapping[tuple[str, str], object] | None = None,
    ):
        super().__init__(file)
        base = base if base is not None else metadata_vocabulary()
        self._vocabulary = {**base, **extra} if extra else base

    def find_class(self, module: str, name: str):
        try:
            return self._vocabulary[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"metadata references {module}.{name}, which DCP metadata never holds",
                hint=TRUST_HINT,
            ) from None


def read_metadata(
    path: Path, trust_pickle: bool, extra: Mapping[tuple[str, str], object] | None = None
) -> object:
    """Return the checkpoint's ``Metadata``, refusing unexpected globals unless trusted.

    ``plain_metadata``'s stand-ins, torch loaded or not (no DCP import); torch's classes
    for a pickle they do not read, for ``extra`` and with ``trust_pickle``.
    ``plain_metadata.is_a`` tells either kind.

    ``extra``: ``(module, name)`` pairs admitted beside DCP's own (``_MetadataUnpickler``).
    Inside ``read_once.metadata_read_once``, a file read before (the same inode, size and
    modification time) is not read again.
    """
    memo = read_once.memo()
    if memo is None:
        return _read_metadata(path, trust_pickle, extra)
    try:
        st = os.stat(path / METADATA_FILE)
    except OSError:
        return _read_metadata(path, trust_pickle, extra)  # which says what is wrong
    vocabulary = tuple(sorted((k, id(v)) for k, v in (extra or {}).items()))
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, trust_pickle, vocabulary, loaded())
    if key not in memo:
        memo[key] = _read_metadata(path, trust_pickle, extra)
    return memo[key]


def _read_metadata(
    path: Path, trust_pickle: bool, extra: Mapping[tuple[str, str], object] | None
) -> object:
    """``read_metadata`` itself: read, check and unpickle ``path/.metadata``."""
    file = path / METADATA_FILE
    if not path.exists():
        raise BadInputError(
            "no such file or directory",
            path=path,
            hint="check the path of the DCP checkpoint directory",
        )
    if not has_file(file, path):
        raise BadInputError(
            f"no '{METADATA_FILE}' in this directory",
            path=path,
            hint=f"pass the DCP checkpoint directory itself, or {SRC_FORMAT} for another format",
        )
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise os_error(exc, file) from None
    check_pickle(raw, file, metadata=True)
    try:
        stream = io.BytesIO(raw)
        with collector_paused():
            md = _unpickle(stream, trust_pickle, extra)
            if is_a(md, "Metadata"):
                # Before the collector runs again: its first run would walk them all.
                spared_while(md)
    except (UnsafePickleError, UnsupportedTorchError) as exc:
        raise type(exc)(exc.message, path=file, hint=exc.hint) from None
    except Exception as exc:
        raise BadInputError(
            f"cannot read DCP metadata ({first_line(exc)})",
            path=file,
            hint="the file is damaged or not written by torch.distributed.checkpoint; "
            "re-copy the checkpoint from where it was written",
        ) from None
    if not is_a(md, "Metadata"):
        raise BadInputError(
            "not DCP metadata",
            path=file,
            hint="pass a directory written by torch.distributed.checkpoint.save",
        )
    return md


def _unpickle(stream: io.BytesIO, trust_pickle: bool, extra: Mapping | None) -> object:
    """Return ``.metadata`` unpickled: as plain stand-ins where they name all it holds."""
    if trust_pickle:
        return pickle.load(stream)
    if not extra:
        try:
            return _MetadataUnpickler(stream, base=plain_metadata.VOCABULARY).load()
        except Exception:  # noqa: BLE001 - read again with torch's classes, which words it
            # A name only torch's vocabulary has (a release's private class), or a pickle
            # that does not build: torch's classes read it, or fail as they always did.
            stream.seek(0)
    return _MetadataUnpickler(stream, extra, torch_vocabulary()).load()


class DcpReader(Reader):
    """Reads a DCP directory: metadata from ``.metadata``, rows from the chunks' bytes.

    Rows are read with ``dcp_rows.StoredRows``; a chunk it cannot place goes through
    ``dcp.load``.
    """

    format = "dcp"

    def __init__(self, src, trust_pickle: bool = False, sight: Sight | None = None):
        super().__init__(src, trust_pickle)
        self.sight = sight
        if sight is None:
            self.metadata = self.load_metadata()
        else:
            # Where ranks see different files (node-local disks), the coordinator's node
            # usually holds .metadata: one rank that sees it reads it for all.
            self.metadata = sight.shared([METADATA_FILE], self.load_metadata)
        self._rows = self.rows_class(self.src, self.metadata)
        self._checked = False

    # What places a stored chunk's rows in its file; a variant that stores chunks
    # otherwise (safetensors) brings its own.
    rows_class: type[StoredRows] = StoredRows
    # Whether each stored item is a torch.save zip (FileSystemWriter's); torch's other
    # writers store safetensors files, which ``verify`` checks by their headers instead.
    zip_items = True

    def load_metadata(self) -> object:
        """Return the checkpoint's DCP ``Metadata`` (``.metadata``, read safely); a variant reads its own."""
        return read_metadata(self.src, self.trust_pickle)

    def stored_value(self, key: str, stored: bytes, loaded: object) -> object:
        """Return what the index holds for value ``key``, given its stored pickle and what it loaded to.

        ``loaded`` is ``REFUSED`` where the safe loader refused the pickle: returned
        as it is, the refusal is an error naming the value. A format that may carry a
        value as its stored bytes (Megatron's ShardedObjects) returns something else.
        """
        return loaded

    def _check(self) -> None:
        """Refuse a ``.metadata`` that does not describe SRC's files, before any data moves."""
        if not self._checked:
            check_metadata(self.metadata, self.src, self.sight.sizes if self.sight else {})
            self._checked = True

    def files_for(self, meta: TensorMeta, rows: Rows) -> list[tuple[Rows, frozenset[str]]]:
        """Return ``rows`` cut at the stored chunks' row boundaries, with the files of the chunks each part overlaps."""
        md = self.metadata
        entry = md.state_dict_metadata[meta.key]
        stored = [
            (tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks if 0 not in tuple(c.sizes)
        ]

        def file_of(offsets) -> str:
            return md.storage_data[MetadataIndex(meta.key, offsets)].relative_path

        if not meta.shape:
            return [(rows, frozenset(file_of(o) for o, _ in stored))]
        start, stop = rows if rows is not None else (0, meta.shape[0])
        cuts = {start, stop}
        for offsets, sizes in stored:
            cuts.update(c for c in (offsets[0], offsets[0] + sizes[0]) if start < c < stop)
        edges = sorted(cuts)
        parts: list[tuple[Rows, frozenset[str]]] = []
        for lo, hi in zip(edges, edges[1:]):
            files = frozenset(file_of(o) for o, z in stored if o[0] < hi and lo < o[0] + z[0])
            if parts and parts[-1][1] == files:
                parts[-1] = ((parts[-1][0][0], hi), files)  # type: ignore[index]
            else:
                parts.append(((lo, hi), files))
        return parts or [(rows, frozenset())]

    def stored_runs(self, meta: TensorMeta, start: int, stop: int) -> list[StoredRun] | None:
        """Return where elements [start, stop) of ``meta`` lie in the chunks' files (``StoredRows.runs``)."""
        self._check()
        return self._rows.runs(meta.key, meta.dtype, meta.shape, start, stop)

    def index(self) -> Index:
        self._check()
        md = self.metadata
        files = {info.relative_path for info in (md.storage_data or {}).values()}
        ranks = [r for f in files if (r := self.rank_of_file(f)) is not None]
        named = (max(ranks) + 1) if ranks else (len(files) or None)
        rank_of = {}
        for idx, info in (md.storage_data or {}).items():
            rank_of[(idx.fqn, tuple(idx.offset) if idx.offset is not None else None)] = (
                self.rank_of_file(info.relative_path)
            )
        paths = dict(md.planner_data or {})
        keys = list(paths) + [k for k in md.state_dict_metadata if k not in paths]
        byte_keys = [k for k in keys if is_a(md.state_dict_metadata.get(k), "BytesStorageMetadata")]
        values = self._read_values(byte_keys)
        tensors = {
            key: (
                tuple(entry.size),
                tuple(
                    Chunk(rank_of.get((key, tuple(c.offsets))), tuple(c.offsets), tuple(c.sizes))
                    for c in entry.chunks
                ),
            )
            for key, entry in md.state_dict_metadata.items()
            if is_a(entry, "TensorStorageMetadata")
        }
        # Ranks that held nothing have no data in .metadata, but may have a file of their own.
        world = infer_world_sizes(tensors.values(), named or 1)
        if world is not None and (on_disk := self._files_on_disk()):
            world = (world & WorldSizes(on_disk, None)) or world
        world_size = world.low if world is not None else named
        items = []
        for key in keys:
            entry = md.state_dict_metadata.get(key)
            path = tuple(paths.get(key, (key,)))
            if entry is None:
                # A path alone: an empty mapping dcp_write kept from torch's loader.
                items.append((path, {}))
            elif key in tensors:
                shape, chunks = tensors[key]
                layout = describe_chunks(shape, chunks, world or named)
                items.append(
                    (
                        path,
                        TensorMeta(key, shape, of_process(entry.properties.dtype), layout, chunks),
                    )
                )
            else:
                items.append((path, values[key]))
        return Index(self.format, str(self.src), world_size, build(items))

    def members(self) -> frozenset[str]:
        """Return ``.metadata``, the files it stores data in, and any ``__R_0.distcp`` beside them.

        A target rank that held nothing still gets its (empty) data file from DCP's writer.
        """
        stored = {info.relative_path for info in (self.metadata.storage_data or {}).values()}
        try:
            empty = {p.name for p in self.src.iterdir() if _RANK_FILE.match(p.name)}
        except OSError as exc:
            raise os_error(exc, self.src) from None
        return frozenset({METADATA_FILE} | stored | empty)

    def stored_items(self) -> dict[str, list[StoredItem]]:
        """Return the items ``.metadata`` stores in each data file, each a ``torch.save`` zip.

        Where tensors are stored as a safetensors blob (``zip_items`` False), the values'
        zips come first and the blob fills the rest of the file; a file of the blob alone
        is checked by its header.
        """
        out: dict[str, list[StoredItem]] = {}
        md = self.metadata
        for index, info in (md.storage_data or {}).items():
            value = is_a(md.state_dict_metadata.get(index.fqn), "BytesStorageMetadata")
            if self.zip_items or value:
                zipped = not info.transform_descriptors
                item = StoredItem(info.offset, info.length, index.fqn, zipped)
                out.setdefault(info.relative_path, []).append(item)
        if not self.zip_items:
            for name, items in out.items():
                end = max(i.offset + i.length for i in items)
                size = (self.src / name).stat().st_size
                items.append(StoredItem(end, size - end, "the safetensors data", False))
        return out

    def _files_on_disk(self) -> int | None:
        """Return one more than the highest rank a ``__R_0.distcp`` file here is named for."""
        try:
            ranks = [r for p in self.src.iterdir() if (r := self.rank_of_file(p.name)) is not None]
        except OSError:
            return None
        return max(ranks) + 1 if ranks else None

    def rank_of_file(self, name: str) -> int | None:
        """Return the rank that wrote data file ``name`` (``__R_T.distcp``), None if its name does not say."""
        m = _RANK_FILE.match(name)
        return int(m.group(1)) if m else None

    def _read_values(self, keys: list[str]) -> dict[str, object]:
        if not keys or self.sight is None:
            return self._read_values_here(keys)
        # Each value is read by a rank that sees the file DCP stored it in.
        by_file: dict[str, list[str]] = {}
        for key in keys:
            info = self.metadata.storage_data[MetadataIndex(key)]
            by_file.setdefault(info.relative_path, []).append(key)
        values: dict[str, object] = {}
        for name, here in sorted(by_file.items()):
            values.update(self.sight.shared([name], lambda here=here: self._read_values_here(here)))
        return values

    def _read_values_here(self, keys: list[str]) -> dict[str, object]:
        """Return the values of ``keys``: plain ones read here (``values.py``), the rest by DCP's loader."""
        values: dict[str, object] = {}
        rest = []
        for key in keys:
            info = self.metadata.storage_data[MetadataIndex(key)]
            try:
                stored = stored_bytes(self.src, info)
                values[key] = self.stored_value(
                    key, stored, plain_value(stored, self.src / info.relative_path)
                )
            except NotPlain:
                rest.append(key)
        if rest:
            from shardckpt.formats.dcp.loader import SafeLoadPlanner

            planner = SafeLoadPlanner(self.trust_pickle, self.src, stored_value=self.stored_value)
            self._load(dict.fromkeys(rest), planner)
            values.update(planner.values)
        return {key: values[key] for key in keys if key in values}

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        outs = [torch.empty(rows_shape(m, r), dtype=as_torch(m.dtype)) for m, r in zip(metas, rows)]
        return self.read_into(metas, rows, outs, runtime)

    def read_into(
        self,
        metas: Sequence[TensorMeta],
        rows: Sequence[Rows],
        outs: Sequence[torch.Tensor],
        runtime,
    ) -> list[torch.Tensor]:
        self._check()
        targets: dict[str, torch.Tensor] = {}
        row_starts: dict[str, int] = {}
        for meta, r, out in zip(metas, rows, outs):
            targets[meta.key] = out
            if r is not None and r != (0, meta.shape[0]):
                row_starts[meta.key] = r[0]
        # An empty target has nothing to read (an empty shard, a zero-size tensor); a
        # target with a chunk StoredRows cannot place is read by DCP's loader.
        wanted = {}
        for key, target in targets.items():
            if target.numel() and not self._rows.read_into(key, target, row_starts.get(key, 0)):
                wanted[key] = target
        if wanted:
            from shardckpt.formats.dcp.loader import SafeLoadPlanner

            starts = {k: v for k, v in row_starts.items() if k in wanted}
            self._load(wanted, SafeLoadPlanner(self.trust_pickle, self.src, starts))
        return [targets[m.key] for m in metas]

    def _load(self, state_dict: dict, planner) -> None:
        """Load ``state_dict``'s keys with DCP's own loader (``loader.py``)."""
        from shardckpt.formats.dcp.loader import load

        load(self.src, self.metadata, state_dict, planner)


def as_stored(tree: object) -> object:
    """Return ``tree`` as DCP gives it back: every mapping key a str (ID-keyed state: "0", "1", ...)."""
    if isinstance(tree, Mapping):
        return {str(k): as_stored(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [as_stored(v) for v in tree]
    return tree


__all__ = ["REFUSED", "DcpReader", "read_metadata"]


def is_dcp_dir(path: Path) -> bool:
    """Return whether ``path`` holds DCP's ``.metadata``."""
    return has_file(path / METADATA_FILE, path)


def dcp_tells_whole(index) -> bool:
    """Return whether a DCP checkpoint says which tensors every rank held whole.

    One written by several ranks that stores some tensor in several chunks does: DCP
    stores what every rank held whole (FSDP2's buffers) as one chunk covering the
    tensor, and a sharded parameter as a chunk per rank, empty ones included. A DCP of
    one rank, or one whose every tensor is one whole chunk (DDP; FSDP2 over a mesh whose
    shard dimension has size 1), stores parameters and buffers alike.
    """
    return (index.world_size or 1) > 1 and any(
        m.shape and m.layout != "full" for _, m in index.tensors()
    )
