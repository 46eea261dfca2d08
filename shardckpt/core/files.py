"""Source files: what a reader may open, and what an OS error on a file means to the user.

Every file a source contributes, read or carried unread into DST, passes one gate
(``source_file``, ``source_entry``, ``source_tree``): a regular file (or, for a carried
tree, a directory) that lies inside SRC once symlinks are resolved. So a FIFO, a socket
or a device is refused before ``open`` could block on it, a link to ``/etc/passwd`` or
``~/.ssh`` never brings that file into DST, and a dangling link, a symlink loop or a
denied permission is named as what it is instead of as a missing or truncated file.
Files meant to be different (each rank's) are checked to be so (``check_separate``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import resource
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from shardckpt.core import remote_files
from shardckpt.core.errors import BadInputError, IOFailure, ShardckptError, in_chain


class OutOfDescriptors(IOFailure):
    """The process (EMFILE) or the system (ENFILE) has no file descriptor left (exit 4)."""


def kept_open() -> int:
    """Return how many files a cache of descriptors keeps open: a quarter of the process's limit, at most 4,096.

    A quarter, never more: SRC's data files a reader keeps open and DST's files a writer
    keeps open are two such caches, and the rest is torch's and the files opened per use
    (at ``ulimit -n 64``, 16 each).
    """
    soft = _open_files_limit()
    return 4096 if soft == resource.RLIM_INFINITY else min(4096, soft // 4)


def _open_files_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def os_error(exc: OSError, path: str | os.PathLike, *, writing: bool = False) -> ShardckptError:
    """Return the one-line error for ``exc``, raised while reading (or ``writing``) ``path``."""
    code = exc.errno
    if code == errno.ENOENT and not writing:
        return BadInputError(
            "no such file or directory", path=path, hint="check the path of the checkpoint"
        )
    if code == errno.ELOOP:
        return BadInputError(
            "is a symlink loop", path=path, hint="point the symlink at the checkpoint itself"
        )
    if code in (errno.EACCES, errno.EPERM):
        return IOFailure(
            "permission denied",
            path=path,
            hint="check the permissions of the directory DST goes in"
            if writing
            else "check the file's permissions; shardckpt needs to read it",
        )
    if code in (errno.EMFILE, errno.ENFILE):
        return OutOfDescriptors(
            f"too many open files (the limit is {_open_files_limit()})",
            path=path,
            hint="raise the limit of open files (ulimit -n) and run again",
        )
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return IOFailure(
            f"{exc.strerror or 'no space left'} while writing",
            path=path,
            hint="free some space, or write DST on another filesystem",
        )
    what = "writing" if writing else "reading"
    return IOFailure(
        f"{what} failed ({exc.strerror or type(exc).__name__})",
        path=path,
        hint="check the disk and the filesystem it is on",
    )


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def source_stat(path: str | os.PathLike) -> os.stat_result:
    """Return ``os.stat(path)`` (symlinks followed), or raise the one-line error for why not."""
    try:
        return os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT and os.path.islink(path):
            raise BadInputError(
                f"is a symlink to '{os.readlink(path)}', which does not exist",
                path=path,
                hint="put the file it stood for in its place, or remove the link",
            ) from None
        raise os_error(exc, path) from None


def _bounds(within: str | os.PathLike) -> tuple[str, ...]:
    """Return the resolved directories that the files of directory ``within`` may lie in.

    ``within`` itself; and for a Hugging Face hub snapshot (``models--x/snapshots/REV``),
    whose every file is the hub's link into ``models--x/blobs``, that directory too.
    """
    root = os.path.realpath(within)
    snapshots = os.path.dirname(root)
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    if os.path.basename(snapshots) == "snapshots" and os.path.isdir(blobs):
        return root, os.path.realpath(blobs)
    return (root,)


def outside(path: str | os.PathLike, within: str | os.PathLike) -> str | None:
    """Return where ``path`` lies, symlinks resolved, when that is outside ``within``; else None."""
    real = os.path.realpath(path)
    if any(os.path.commonpath([real, bound]) == bound for bound in _bounds(within)):
        return None
    return real


def _gate(path: str | os.PathLike, within: str | os.PathLike | None) -> os.stat_result:
    """Return the stat of ``path``, a regular file or a directory inside ``within``; else raise."""
    st = source_stat(path)
    if within is not None and (real := outside(path, within)) is not None:
        # A link could bring any file this user can read (~/.ssh, cloud credentials)
        # into an output that is then shared.
        raise BadInputError(
            f"resolves to '{real}', outside '{within}'",
            path=path,
            hint="shardckpt reads only the files inside it: copy the file in instead of "
            "linking to it, or remove the link",
        )
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise BadInputError(
            f"is a {_kind(st.st_mode)}, not a regular file",
            path=path,
            hint="copy the checkpoint into a regular file first; shardckpt does not read pipes or devices",
        )
    return st


def open_source(path: str | os.PathLike) -> int:
    """Return a read-only descriptor of the regular file ``path``; raise one line if it is not one.

    Opened without blocking, so a FIFO put in the file's place since it was checked
    cannot stall the run.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise os_error(exc, path) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BadInputError(
            f"is a {'directory' if stat.S_ISDIR(mode) else _kind(mode)}, not a regular file",
            path=path,
            hint="put the checkpoint's own file in its place",
        )
    return fd


SRC_CHANGED = (
    "SRC changed during the run; convert a checkpoint that no process is writing, moving or cutting"
)
"""The hint for a source file that no longer holds what it held when the run checked it."""


def preadv(fd: int, data: memoryview, at: int) -> int:
    """Read into ``data`` from byte ``at`` of the source file open as ``fd``; return how many bytes.

    ``os.preadv`` for a local file; for the stand-in of an object of a URL SRC
    (``remote_files``), ranged requests to the store. Fewer bytes only where the file ends.
    """
    obj = remote_files.of_fd(fd)
    if obj is None:
        return os.preadv(fd, [data], at)
    return remote_files.read_into(obj, data, at)


def pread(fd: int, n: int, at: int) -> bytes:
    """Return ``n`` bytes from byte ``at`` of the source file open as ``fd`` (``preadv``'s bytes)."""
    obj = remote_files.of_fd(fd)
    if obj is None:
        return os.pread(fd, n, at)
    data = bytearray(max(0, n))
    return bytes(data[: remote_files.read_into(obj, memoryview(data), at)])


def pread_each(fd: int, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Return the bytes of each range (start, length) of the source file open as ``fd`` (fewer where it ends).

    For a stand-in, each range is one ranged request of its own size, several in flight
    (``remote_files.read_each``): scattered small reads (a zip's local headers) ask for
    their bytes alone, not a block around each.
    """
    obj = remote_files.of_fd(fd)
    if obj is None:
        return [os.pread(fd, n, at) for at, n in ranges]
    return remote_files.read_each(obj, ranges)


def is_remote(fd: int) -> bool:
    """Return whether ``fd`` stands for an object of a URL SRC: its bytes are not in the file (no kernel copy)."""
    return remote_files.of_fd(fd) is not None


def is_remote_file(path: str | os.PathLike) -> bool:
    """Return whether the file ``path`` stands for an object of a URL SRC: a reader must not map it.

    A mapping of a stand-in (``torch.load(mmap=True)``, ``safe_open``) reads zeros; its
    readers read it through ``preadv``/``pread``/``source_stream`` instead.
    """
    return remote_files.of_path(path) is not None


def will_read(path: str | os.PathLike, ranges: list[tuple[int, int]]) -> None:
    """Say that ranges (start, length) of the source file ``path`` are read next, in this order.

    An object of a URL SRC fetches them ahead, a few requests at once; a local file has
    nothing to do (the kernel reads ahead by itself).
    """
    obj = remote_files.of_path(path)
    if obj is not None and ranges:
        remote_files.will_read(obj, ranges)


class SourceStream(io.RawIOBase):
    """A source file open for reading as a file object, every read through ``preadv``.

    For libraries that read a file object (DCP's own loader): an object of a URL SRC
    reads from the store, as every other read does.
    """

    def __init__(self, path: str | os.PathLike):
        self._fd = open_source(path)
        self._pos = 0

    def fileno(self) -> int:
        return self._fd

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: os.fstat(self._fd).st_size}[whence]
        self._pos = base + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = preadv(self._fd, view, self._pos)
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def source_stream(path: str | os.PathLike) -> io.BufferedReader:
    """Return the source file ``path`` open for reading as a buffered file object (``SourceStream``)."""
    return io.BufferedReader(SourceStream(path), buffer_size=64 << 10)


def read_exactly(fd: int, data: memoryview, at: int, path: str | os.PathLike, what: str) -> None:
    """Fill ``data`` from byte ``at`` of ``fd`` (file ``path``); raise (exit 3) where the file ends first.

    For bytes SRC held when the run checked it: a file that ends early now was cut short
    while it was read. ``what`` names the bytes in the line (``the data of 'w'``).
    """
    done = 0
    while done < len(data):
        try:
            n = preadv(fd, data[done:], at + done)
        except OSError as exc:
            raise os_error(exc, path) from None
        if n == 0:
            raise BadInputError(
                f"truncated while it was read: it now ends at byte {at + done}, inside {what}",
                path=path,
                hint=SRC_CHANGED,
            )
        done += n


def source_file(path: str | os.PathLike, within: str | os.PathLike | None = None) -> Path:
    """Return ``path`` when it is a readable regular file inside ``within``; else raise one line.

    ``within`` is the directory whose file it is (None for a file the user named as
    SRC): the file must lie inside it once symlinks are resolved. The file is opened once
    here: libraries report a denied read their own way (safetensors says the file does
    not exist).
    """
    if stat.S_ISDIR(_gate(path, within).st_mode):
        raise BadInputError(
            "is a directory, not a file",
            path=path,
            hint="pass the checkpoint file itself, or the directory as SRC for a directory format"
            if within is None
            else "a file is expected under this name; re-copy it from where it was saved",
        )
    os.close(open_source(path))
    return Path(path)


def read_head(path: str | os.PathLike, size: int) -> bytes:
    """Return the first ``size`` bytes of the source file ``path`` (fewer when it is shorter).

    Through ``pread``: the stand-in of an object of a URL SRC reads from the store.
    """
    fd = open_source(source_file(path))
    try:
        return pread(fd, min(size, os.fstat(fd).st_size), 0)
    except OSError as exc:
        raise os_error(exc, path) from None
    finally:
        os.close(fd)


def source_entry(path: str | os.PathLike, within: str | os.PathLike) -> bool:
    """Return whether the entry ``path`` of ``within`` is a directory; else it is a readable regular file.

    Anything else (a link out of ``within``, a dangling link, a FIFO, a device) raises.
    """
    if stat.S_ISDIR(_gate(path, within).st_mode):
        return True
    os.close(open_source(path))
    return False


def has_file(path: str | os.PathLike, within: str | os.PathLike) -> bool:
    """Return whether ``within`` holds the file ``path``: False when nothing is there.

    Something there that is not a readable regular file inside ``within`` raises: a
    format that reads the file must not take it for absent and read SRC as another.
    """
    if not os.path.lexists(path):
        return False
    source_file(path, within)
    return True


def source_tree(top: str | os.PathLike, within: str | os.PathLike) -> list[tuple[str, bool]]:
    """Return every entry under the directory ``top`` of ``within``: ``(name, is a directory)``, parents first.

    Names are POSIX paths relative to ``top``; every entry passes the gate
    (``source_entry``), and a directory that leads back to one the walk is in
    (``extra -> .``) is refused as a loop: copying it would never end.
    """
    rel = Path(top).relative_to(within)
    enclosing = frozenset(os.path.realpath(Path(within) / p) for p in rel.parents)
    entries: list[tuple[str, bool]] = []
    walking = [(Path(top), "", enclosing)]
    while walking:
        here, prefix, above = walking.pop()
        real = os.path.realpath(here)
        if real in above:
            raise BadInputError(
                f"is a symlink loop: it leads back to '{real}', a directory it lies in",
                path=here,
                hint="remove the link from the checkpoint",
            )
        try:
            names = sorted(os.listdir(here))
        except OSError as exc:
            raise os_error(exc, here) from None
        for name in names:
            is_dir = source_entry(here / name, within)
            entries.append((prefix + name, is_dir))
            if is_dir:
                walking.append((here / name, f"{prefix}{name}/", above | {real}))
    return entries


K = TypeVar("K")


def check_separate(files: Mapping[K, Path], whose: Callable[[K], str]) -> None:
    """Return once no two of ``files`` are one file on disk; else raise one line naming both.

    A symlink or a hard link from one name to another passes every per-file check, and
    a reader would then take one rank's (or one data file's) bytes for another's: a
    silent wrong result. ``whose`` says what each key's file is meant to be
    (``rank 1's file``), for the message.
    """
    seen: dict[tuple[int, int], K] = {}
    for key, path in files.items():
        st = source_stat(path)
        first = seen.setdefault((st.st_dev, st.st_ino), key)
        if first != key:
            if os.path.islink(files[first]) and not os.path.islink(path):
                first, key, path = key, first, files[first]  # name the link, not its target
            raise BadInputError(
                f"is the same file as '{files[first].name}' (a symlink or hard link), but "
                f"{whose(key)} and {whose(first)} must be two files",
                path=path,
                hint="copy each file itself into the checkpoint directory, "
                "from where the checkpoint was saved",
            )


def os_error_in(exc: BaseException) -> OSError | None:
    """Return the OSError that caused ``exc`` (itself, or one it was raised from or during), if any.

    torch.save reports a failed write as a RuntimeError ("unexpected pos ...") raised
    while handling the OSError (ENOSPC, EIO) the file object raised; that is the cause
    the user can act on.
    """
    return in_chain(exc, OSError)


# How torch's zip writer (caffe2's inline_container.cc) words a write that failed.
_ZIP_WRITER_FAILURES = ("PytorchStreamWriter", "inline_container", "unexpected pos")


@contextlib.contextmanager
def writing(path: str | os.PathLike, shown_as: str | os.PathLike | None = None) -> Iterator[None]:
    """Turn a failed write of ``path`` (disk full, permissions, I/O) into one line naming it.

    The line names ``shown_as`` when given (a temporary name the user never sees).
    ``torch.save`` reports a failed write as a RuntimeError of its zip writer
    ("PytorchStreamWriter failed writing file ...", "unexpected pos ..."), raised while
    handling the OSError behind it when there is one, and without any errno otherwise:
    a full filesystem, by far the usual cause, is then told from the filesystem itself.
    """
    name = shown_as if shown_as is not None else path
    try:
        yield
    except ShardckptError:
        raise
    except (OSError, RuntimeError) as exc:
        cause = os_error_in(exc)
        if cause is not None:
            raise os_error(cause, name, writing=True) from None
        if not any(mark in str(exc) for mark in _ZIP_WRITER_FAILURES):
            raise
        if _is_full(Path(path).parent):
            full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise os_error(full, name, writing=True) from None
        first = str(exc).strip().splitlines()[0]
        raise IOFailure(
            f"writing failed ({first})",
            path=name,
            hint="check the free space and the filesystem DST is on",
        ) from None


def _is_full(directory: Path) -> bool:
    """Return whether the filesystem of ``directory`` has no block left for this process."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail == 0 or st.f_bfree == 0
