"""What each way of reading, CRC'ing and writing a file's bytes a slice at a time costs in CPU.

    python scripts/bench_slices.py SRC_FILE DST_DIR [--rounds 3] [--slice-mib 4] [--shift 64]
                                   [--ways read,kernel,read+kernel,read+pwrite,map+pwrite]

The loop a full export's stored runs go through (``engine/stored_copy``), without the
rest of the export: SRC_FILE (in the page cache: read once first) is written into a new
file in DST_DIR, ``--shift`` bytes further on (a safetensors header moves every tensor's
bytes from where the source holds them), a slice at a time, each way in turn, round after
round; the table gives each way's median CPU seconds (user + system of this process) and
GB/s. The ways:

- ``kernel``: ``copy_file_range`` alone (no check): what ``cp`` pays;
- ``read``: ``pread`` into a buffer placed as the file is (``core.read_buffers``) and its
  CRC-32, nothing written: what the check adds;
- ``read+kernel``: both, the kernel copying each slice after it is read and CRC'd;
- ``read+pwrite``: the slice read and CRC'd, then ``pwrite``n from the buffer;
- ``map+pwrite``: the slice mapped, CRC'd and ``pwrite``n from the mapping (what a source
  cut short turns into SIGBUS: shown for its cost, not used).

DST_DIR decides the filesystem written: ``/dev/shm`` for tmpfs, a directory on disk for
that disk's (its written bytes are dropped after each way, not synced).
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import sys
from pathlib import Path

from isal import isal_zlib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shardckpt.codecs.zip_skeleton import pwrite_all  # noqa: E402
from shardckpt.core.read_buffers import ReadBuffer  # noqa: E402

WAYS = ("kernel", "read", "read+kernel", "read+pwrite", "map+pwrite")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _copy(src: int, dst: int, offset: int, length: int, shift: int) -> None:
    done = 0
    while done < length:
        n = os.copy_file_range(src, dst, length - done, offset + done, offset + done + shift)
        if n == 0:
            raise SystemExit("bench_slices: the source ended early")
        done += n


def one_pass(way: str, src_path: Path, dst_path: Path, slice_bytes: int, shift: int) -> float:
    """Write ``src_path`` into ``dst_path`` one way; return the CPU seconds it took."""
    src = os.open(src_path, os.O_RDONLY)
    dst = os.open(dst_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    size = os.fstat(src).st_size
    buffer = ReadBuffer(slice_bytes)
    crc = 0
    start = _cpu()
    try:
        for at in range(0, size, slice_bytes):
            length = min(slice_bytes, size - at)
            if way == "kernel":
                _copy(src, dst, at, length, shift)
                continue
            if way == "map+pwrite":
                low = at - at % mmap.PAGESIZE
                with mmap.mmap(src, at + length - low, offset=low, prot=mmap.PROT_READ) as mapped:
                    part = memoryview(mapped)[at - low :]
                    crc = isal_zlib.crc32(part, crc)
                    pwrite_all(dst, part, at + shift)
                    part.release()
                continue
            part = buffer.for_read(at, length)
            os.preadv(src, [part], at)
            crc = isal_zlib.crc32(part, crc)
            if way == "read+kernel":
                _copy(src, dst, at, length, shift)
            elif way == "read+pwrite":
                pwrite_all(dst, part, at + shift)
        return _cpu() - start
    finally:
        os.close(src)
        os.close(dst)
        dst_path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst_dir", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slice-mib", type=float, default=4)
    parser.add_argument("--shift", type=int, default=64)
    parser.add_argument("--ways", default=",".join(WAYS))
    args = parser.parse_args()
    ways = args.ways.split(",")
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {sorted(unknown)}; choose from {', '.join(WAYS)}")
    slice_bytes = int(args.slice_mib * (1 << 20))
    with open(args.src, "rb") as warm:
        while warm.read(1 << 24):
            pass
    size = args.src.stat().st_size
    spent: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            dst = args.dst_dir / f"bench_slices.{os.getpid()}.out"
            spent[way].append(one_pass(way, args.src, dst, slice_bytes, args.shift))
    print(
        f"{size / 1e9:.2f} GB, slices of {args.slice_mib:g} MiB, DST {args.dst_dir}, "
        f"{args.rounds} rounds"
    )
    print("| way | CPU s (median) | range | GB per CPU-s |")
    print("|---|---:|---:|---:|")
    for way, seconds in spent.items():
        median = statistics.median(seconds)
        print(
            f"| {way} | {median:.2f} | {min(seconds):.2f}-{max(seconds):.2f} | "
            f"{size / 1e9 / median:.2f} |"
        )


if __name__ == "__main__":
    main()
