"""Benchmark `shardckpt convert s3://... s3://...` against what a user would otherwise run.

    python scripts/bench.py --s3 [--size-gb 1.0] [--world-size 3] [--workdir .bench] [--json]
                                 [--source dcp|hf] [--threads N] [--buffer-size B] [--cases A,B]

Builds (or reuses) bench.py's FSDP2 DCP of about SIZE_GB (model + AdamW) (``--source hf``:
its model as a Hugging Face directory of 256 MB safetensors shards, converted once by
shardckpt and kept beside it; read in place as the DCP is), starts a moto S3
server on loopback (``moto_server``, from ``pip install -e '.[s3,s3-server]'``), puts the
DCP there (ranged GETs served from the range alone, as S3 does: ``bench_moto.py``; moto's
own server, ``--plain-moto``, reads the whole object for each), then runs each case as a process of its own, one after another:

- ``plain copy (client side)``: every object of SRC downloaded with s3fs (``fs.get``) into a
  local directory and uploaded again (``fs.put``) under another prefix: the same bytes
  down and up, no conversion; the floor for anything that reads SRC and writes DST
  through the client.
- ``copy (server side, CopyObject)``: s3fs ``fs.copy`` of the prefix; no byte reaches the
  client (for scale only: no conversion can run there).
- ``download, convert, upload``: s3fs get, ``shardckpt convert`` of the local copy, s3fs
  put of the result: the user's alternative.
- ``shardckpt s3 -> s3``: ``shardckpt convert s3://SRC s3://DST --to sharded
  --world-size M``.

Each case reports wall time, its process's peak RSS (``ru_maxrss``) and the S3 API
requests it made, by operation (counted in the process, on botocore's calls). The
shardckpt output is then compared object by object (MD5) with the download-convert-upload
output: both are shardckpt's writer at M, so they must be the same bytes. One markdown
table on stdout (one JSON document with --json); progress on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
BUCKET = "bench"
ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def log(message: str) -> None:
    print(f"bench_s3: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- one case, in its own process


def count_requests() -> Counter:
    """Count every S3 API call this process makes (aiobotocore, under s3fs), by operation."""
    from aiobotocore.client import AioBaseClient

    counts: Counter = Counter()
    call = AioBaseClient._make_api_call

    async def counted(self, operation_name, api_params):
        counts[operation_name] += 1
        return await call(self, operation_name, api_params)

    AioBaseClient._make_api_call = counted
    return counts


def peak_rss_mib() -> float:
    """Return this process's peak RSS (VmHWM): ``ru_maxrss`` would count the parent's, from before exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def filesystem():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def child(
    case: str, src: str, dst: str, world_size: int, threads: str = "", buffer: str = ""
) -> dict:
    """Run one case here; return its wall time, peak RSS and requests."""
    counts = count_requests()
    from shardckpt.cli.app import run

    argv = ["convert", "--to", "sharded", "--world-size", str(world_size), "-q"]
    argv += ["--threads", threads] if threads else []
    argv += ["--buffer-size", buffer] if buffer else []
    fs = filesystem()
    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    start = time.perf_counter()
    code = 0
    try:
        if case == "plain":
            fs.get(src + "/", str(work / "copy"), recursive=True)
            fs.put(str(work / "copy") + "/", dst, recursive=True)
        elif case == "server":
            fs.copy(src, dst, recursive=True)
        elif case == "dcu":
            fs.get(src + "/", str(work / "src"), recursive=True)
            code = run([*argv[:1], str(work / "src"), str(work / "out"), *argv[1:]])
            fs.put(str(work / "out") + "/", dst, recursive=True)
        elif case == "shardckpt":
            code = run([*argv[:1], f"s3://{src}", f"s3://{dst}", *argv[1:]])
    finally:
        wall = time.perf_counter() - start
        shutil.rmtree(work, ignore_errors=True)
    used = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "code": code,
        "wall_s": wall,
        "cpu_s": used.ru_utime + used.ru_stime,
        "peak_rss_mib": peak_rss_mib(),
        "requests": dict(counts),
    }


# ---------------------------------------------------------------- the driver

CASES = {
    "plain": "plain copy (client side: s3fs get + put)",
    "server": "copy (server side: s3fs copy, CopyObject)",
    "dcu": "download, convert, upload (s3fs get, shardckpt, s3fs put)",
    "shardckpt": "shardckpt convert s3:// s3://",
}


SOURCES = {
    "dcp": "FSDP2 DCP (model + AdamW)",
    "hf": "Hugging Face directory (the DCP's model, 256 MB safetensors shards)",
}


def hf_source(dcp_dir: Path) -> Path:
    """Return the model of ``dcp_dir`` as a Hugging Face directory beside it, converting it once."""
    out = dcp_dir.with_name(dcp_dir.name + "-hf")
    if (out / "model.safetensors.index.json").is_file():
        log(f"reusing {out}")
        return out
    log(f"converting {dcp_dir} to {out} ...")
    argv = [sys.executable, "-m", "shardckpt", "convert", str(dcp_dir), str(out), "--to", "full"]
    argv += ["--format", "hf", "--max-shard-size", "256MB", "-q"]
    subprocess.run(argv, cwd=ROOT, check=True, stdout=sys.stderr)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(plain: bool) -> tuple[subprocess.Popen, str]:
    """Start moto's S3 server on loopback: serving ranges from the range alone (bench_moto.py) unless ``plain``."""
    server = [sys.executable, str(SCRIPTS / "bench_moto.py")]
    if plain:
        found = Path(sys.executable).with_name("moto_server")
        server = [str(found if found.exists() else shutil.which("moto_server") or "moto_server")]
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*server, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"bench_s3: moto_server did not start on {endpoint}") from None
            time.sleep(0.2)


def md5s(fs, prefix: str) -> dict[str, str]:
    fs.invalidate_cache()
    out = {}
    for key in sorted(fs.find(prefix)):
        digest = hashlib.md5()
        with fs.open(key, "rb", block_size=16 << 20) as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
        out[key[len(prefix) + 1 :]] = digest.hexdigest()
    return out


def run_case(
    case: str, src: str, dst: str, world_size: int, threads: str = "", buffer: str = ""
) -> dict:
    log(f"{CASES[case]} ...")
    argv = [sys.executable, __file__, "--child", case, src, dst, str(world_size), threads, buffer]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"bench_s3: case {case} failed (exit {done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    log(f"  {result['wall_s']:.1f} s, {sum(result['requests'].values())} requests")
    return result


def table(results: dict[str, dict], src_bytes: int, world_size: int) -> str:
    plain = results["plain"]["wall_s"]
    rows = [
        "| case | wall (s) | × plain copy | peak RSS (MiB) | requests | by operation |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for case, r in results.items():
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r["requests"].items()))
        rows.append(
            f"| {CASES[case]} | {r['wall_s']:.1f} | {r['wall_s'] / plain:.2f} | "
            f"{r['peak_rss_mib']:.0f} | {sum(r['requests'].values())} | {ops} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        case, src, dst, world_size, threads, buffer = argv[1:7]
        print(json.dumps(child(case, src, dst, int(world_size), threads, buffer)))
        return 0
    parser = argparse.ArgumentParser(prog="bench.py --s3")
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--source",
        choices=("dcp", "hf"),
        default="dcp",
        help="SRC on S3: the FSDP2 DCP, or its model as a Hugging Face directory",
    )
    parser.add_argument("--threads", default="", help="shardckpt's --threads (default: its own)")
    parser.add_argument(
        "--buffer-size", default="", help="shardckpt's --buffer-size (its default unless given)"
    )
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"the cases to run, comma-separated, of {','.join(CASES)} (plain is always run)",
    )
    parser.add_argument(
        "--plain-moto",
        action="store_true",
        help="moto's own server, which reads a whole object for each ranged GET",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(SCRIPTS))
    import bench

    src_dir = bench.ensure_source(args.workdir.resolve(), args.size_gb)
    if args.source == "hf":
        src_dir = hf_source(src_dir)
    src_bytes = bench.tree_bytes(src_dir)
    proc, endpoint = start_moto(args.plain_moto)
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        fs = filesystem()
        fs.mkdir(BUCKET)
        log(f"putting {src_dir} ({src_bytes / 1e9:.3f} GB) on {endpoint} ...")
        fs.put(str(src_dir) + "/", f"{BUCKET}/src", recursive=True)
        results = {}
        wanted = {"plain", *args.cases.split(",")}
        for case in [c for c in CASES if c in wanted]:
            dst = f"{BUCKET}/{case}"
            results[case] = run_case(
                case, f"{BUCKET}/src", dst, args.world_size, args.threads, args.buffer_size
            )
            if case in ("plain", "server"):
                fs.rm(f"{BUCKET}/{case}", recursive=True)  # moto holds objects in memory
        same = (
            md5s(fs, f"{BUCKET}/dcu") == md5s(fs, f"{BUCKET}/shardckpt")
            if {"dcu", "shardckpt"} <= wanted
            else None
        )
    finally:
        proc.terminate()
        proc.wait(10)
    doc = {
        "source": str(src_dir),
        "source_bytes": src_bytes,
        "source_format": args.source,
        "threads": args.threads or "shardckpt's default",
        "world_size": args.world_size,
        "endpoint": "moto_server on loopback"
        + (" (plain)" if args.plain_moto else " (ranges served as S3 does)"),
        "cpus": os.cpu_count(),
        "results": results,
        "shardckpt_output_same_bytes_as_download_convert_upload": same,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(
            f"SRC: {SOURCES[args.source]}, {src_bytes / 1e9:.3f} GB, on {doc['endpoint']}, "
            f"to DCP at {args.world_size}; {os.cpu_count()} CPUs, --threads {doc['threads']}"
        )
        print()
        print(table(results, src_bytes, args.world_size))
        print()
        print(f"shardckpt's output is the same bytes as download-convert-upload's: {same}")
    return 0 if same is not False and all(r["code"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
