"""SRC and DST on object storage (``s3://``), against a real S3 server (moto's, on loopback).

Sources are written by torch's own ``dcp.save`` through its ``FsspecWriter`` straight to
the server; outputs are read back by torch's ``FsspecReader`` (``dcp.load``), torch.load
and safetensors, and compared with what was saved.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import damage
import pytest
import torch
import torch.distributed.checkpoint as dcp
import warm_cli
from object_store import S3, own_tmpdir, s3  # noqa: F401 - the fixtures
from reference import write_hf_like_transformers
from safetensors.torch import load as load_safetensors

from shardckpt.cli.app import run
from shardckpt.core import remote_files

pytestmark = [pytest.mark.launches, pytest.mark.usefixtures("own_tmpdir")]


def cli(capsys, *argv) -> tuple[int, list[str]]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def state() -> dict:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 48), "b": torch.randn(48), "e": torch.randn(7, 5)},
        "optim": {"state": {"w": {"exp_avg": torch.randn(64, 48)}}, "lr": 0.1},
        "step": 100,
    }


def save_dcp(url: str, sd: dict) -> None:
    """Save ``sd`` at ``url`` with DCP's own fsspec writer."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dcp.save(sd, storage_writer=FsspecWriter(url), no_dist=True)


def load_dcp(url: str, like: dict) -> dict:
    """Load a DCP at ``url`` into a state dict shaped like ``like`` with DCP's ``FsspecReader``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    target = _zeros(like)
    dcp.load(target, storage_reader=FsspecReader(url), no_dist=True)
    return target


def _zeros(tree):
    if isinstance(tree, dict):
        return {k: _zeros(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else tree


def assert_equal(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def no_leftovers(s3: S3, bucket: str) -> None:  # noqa: F811
    """Assert nothing of shardckpt's is left in the bucket, nor in this node's staging directory."""
    assert not [k for k in s3.keys(bucket) if "shardckpt-" in k]
    assert s3.open_uploads(bucket) == []
    staging = Path(tempfile.gettempdir()) / "shardckpt-staging"
    assert not staging.exists() or not any(staging.glob("*/*"))
    assert not list(Path(tempfile.gettempdir()).glob("shardckpt-src-*"))  # SRC's copies


@pytest.fixture(scope="module")
def src(s3: S3) -> str:  # noqa: F811
    """A DCP saved by torch on S3."""
    url = f"s3://{s3.bucket()}/run/step-100"
    save_dcp(url, state())
    return url


def test_a_url_keeps_both_slashes_and_inspect_reads_it(s3, src, capsys):  # noqa: F811
    code = run(["inspect", src, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["format"] == "dcp"
    paths = {".".join(e["path"]) for e in doc["entries"]}
    assert paths >= {"model.w", "model.b", "optim.state.w.exp_avg", "step"}
    code = run(["inspect", src])
    assert code == 0
    assert capsys.readouterr().out.startswith(f"{src}: format dcp, world size 1")


def test_verify_of_an_intact_s3_dcp_is_exit_0(s3, src, capsys):  # noqa: F811
    code = run(["verify", src])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith(f"intact: {src} (dcp, 2 files")


def test_a_flipped_byte_in_an_s3_object_is_exit_3_naming_the_object(s3, tmp_path, capsys):  # noqa: F811
    local = tmp_path / "ckpt"
    dcp.save(state(), checkpoint_id=local, no_dist=True)
    flipped = damage.flip_in_dcp(local, "model.w")
    url = f"s3://{s3.bucket()}/damaged"
    s3.put_dir(local, url[len("s3://") :])
    code, err = cli(capsys, "verify", url)
    assert code == 3
    named = f"{url}/{flipped.file.name}"
    assert err == [f"shardckpt: error: '{named}': {flipped.message()}: {damage.RECOPY}"]
    code, err = cli(capsys, "convert", url, tmp_path / "out.pt", "--to", "full")
    assert code == 3
    assert err[0].startswith(f"shardckpt: error: '{named}': {flipped.message()}")
    assert not (tmp_path / "out.pt").exists()


def test_s3_dcp_to_s3_dcp_at_3_loads_with_torchs_fsspec_reader(s3, src, capsys):  # noqa: F811
    bucket = src[len("s3://") :].split("/")[0]
    dst = f"s3://{bucket}/run/step-100-at-3"
    argv = ["convert", src, dst, "--to", "sharded", "--world-size", "3", "-q"]
    code = run([*argv, "--dry-run"])
    assert code == 0
    assert "world size 3" in capsys.readouterr().out
    assert s3.keys(dst[len("s3://") :]) == []
    code, err = cli(capsys, *argv, "--verify")
    assert (code, err) == (0, [])
    names = [k.rsplit("/", 1)[1] for k in s3.keys(dst[len("s3://") :])]
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert_equal(load_dcp(dst, state()), state())
    no_leftovers(s3, bucket)
    # The source's own metadata read by torch, against ours: one tree.
    code = run(["diff", src, dst])
    assert code == 0


def test_s3_dcp_to_a_local_torch_file_is_the_source(s3, src, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "full.pt"
    code, err = cli(capsys, "convert", src, out, "--to", "full", "-q")
    assert (code, err) == (0, [])
    assert_equal(torch.load(out, weights_only=True), state())
    assert [p.name for p in tmp_path.iterdir()] == ["full.pt"]


def test_torch_save_and_safetensors_files_on_s3_are_read_as_sources(s3, tmp_path, capsys):  # noqa: F811
    from safetensors.torch import save_file

    bucket = s3.bucket()
    torch.save(state(), tmp_path / "ckpt.pt")
    save_file(state()["model"], tmp_path / "model.safetensors")
    for name in ("ckpt.pt", "model.safetensors"):
        s3.fs.put_file(str(tmp_path / name), f"{bucket}/in/{name}")
    code, err = cli(capsys, "verify", f"s3://{bucket}/in/ckpt.pt", "-q")
    assert (code, err) == (0, [])
    out = tmp_path / "from-pt"
    argv = ["convert", f"s3://{bucket}/in/ckpt.pt", out, "--to", "sharded", "--world-size", "2"]
    code, err = cli(capsys, *argv, "-q")
    assert (code, err) == (0, [])
    back = _zeros(state())
    dcp.load(back, checkpoint_id=out, no_dist=True)
    assert_equal(back, state())
    out = tmp_path / "from-safetensors.pt"
    code, err = cli(
        capsys, "convert", f"s3://{bucket}/in/model.safetensors", out, "--to", "full", "-q"
    )
    assert (code, err) == (0, [])
    assert_equal(torch.load(out, weights_only=True), state()["model"])
    no_leftovers(s3, bucket)


def test_local_dcp_to_s3_safetensors_and_hf_are_the_source(s3, tmp_path, capsys):  # noqa: F811
    local = tmp_path / "ckpt"
    dcp.save(state(), checkpoint_id=local, no_dist=True)
    bucket = s3.bucket()
    one = f"s3://{bucket}/export/model.safetensors"
    code, err = cli(capsys, "convert", local, one, "--to", "full", "--only", "model", "-q")
    assert code == 0, err
    assert_equal(load_safetensors(s3.fs.cat_file(one[5:])), state()["model"])
    hf = f"s3://{bucket}/export/hf"
    argv = ["convert", local, hf, "--to", "full", "--format", "hf", "--max-shard-size", "8KB"]
    code, err = cli(capsys, *argv, "-q")
    assert code == 0, err
    keys = s3.keys(hf[5:])
    index = json.loads(s3.fs.cat_file(f"{hf[5:]}/model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert {k.rsplit("/", 1)[1] for k in keys} >= {"model.safetensors.index.json", *shards}
    got = {}
    for shard in shards:
        got |= load_safetensors(s3.fs.cat_file(f"{hf[5:]}/{shard}"))
    assert_equal(got, state()["model"])
    code, err = cli(capsys, "diff", hf, one, "--only", "model", "-q")  # both read from S3
    assert (code, err) == (0, [])
    no_leftovers(s3, bucket)


def test_an_existing_s3_dst_is_exit_5_and_overwrite_replaces_it(s3, src, tmp_path, capsys):  # noqa: F811
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    s3.fs.pipe_file(f"{bucket}/out/notes.txt", b"mine")
    argv = ["convert", src, dst, "--to", "sharded", "--world-size", "1", "-q"]
    code, err = cli(capsys, *argv)
    assert code == 5
    assert err == [
        f"shardckpt: error: '{dst}': already exists: "
        "pass --overwrite to replace it (every object under it), or name another DST"
    ]
    assert s3.keys(f"{bucket}/out") == [f"{bucket}/out/notes.txt"]
    code, err = cli(capsys, *argv, "--overwrite")
    assert (code, err) == (0, [])
    assert [k.rsplit("/", 1)[1] for k in s3.keys(f"{bucket}/out")] == [".metadata", "__0_0.distcp"]
    assert_equal(load_dcp(dst, state()), state())
    no_leftovers(s3, bucket)


def test_a_missing_bucket_or_object_is_one_line(s3, src, tmp_path, capsys):  # noqa: F811
    code, err = cli(capsys, "inspect", "s3://no-such-bucket-here/x")
    assert code == 3
    assert err == [
        "shardckpt: error: 's3://no-such-bucket-here/x': no such object or prefix "
        "(404 NoSuchBucket): check the URL of the checkpoint (and the bucket's name)"
    ]
    bucket = src[5:].split("/")[0]
    code, err = cli(capsys, "verify", f"s3://{bucket}/run/nothing")
    assert code == 3
    assert err[0].startswith(f"shardckpt: error: 's3://{bucket}/run/nothing': no such object")
    argv = ["convert", src, "s3://no-such-bucket-here/out", "--to", "sharded", "--world-size", "1"]
    code, err = cli(capsys, *argv)
    assert code == 4
    assert err == [
        "shardckpt: error: 's3://no-such-bucket-here/out': no such bucket: create the bucket "
        "first, or check the URL and AWS_ENDPOINT_URL"
    ]


@pytest.mark.slow
def test_a_second_run_on_the_same_url_is_refused_and_leaves_the_first_alone(s3, big, capsys):  # noqa: F811
    local, sd = big
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    argv = ["convert", local, dst, "--to", "sharded", "--world-size", "1", "-q"]
    first = warm_cli.start(argv, setup=(_slow_fill, 0.3))
    marker = f"{bucket}/.out.shardckpt-partial"
    uploading(first, lambda: s3.fs.invalidate_cache() or s3.fs.exists(marker))
    code, err = cli(capsys, *argv)
    assert code == 4
    assert len(err) == 1
    assert err[0].startswith(f"shardckpt: error: '{dst}': is being written by another shardckpt")
    assert err[0].endswith(": wait for that run to finish, or write to another DST")
    assert first.wait(120) == 0
    assert_equal(load_dcp(dst, sd), sd)
    no_leftovers(s3, bucket)


def _slow_fill_beating(delay: float, every: float) -> None:
    """In the warm child: a slow fill (``_slow_fill``), and the marker's heartbeat put every ``every`` seconds."""
    from shardckpt.core import marker

    _slow_fill(delay)
    marker.HEARTBEAT_S = every


def marker_of(s3: S3, bucket: str, name: str = "out") -> dict:  # noqa: F811
    """Return the body of the marker beside ``bucket/name``: the run that writes it."""
    return json.loads(s3.fs.cat_file(f"{bucket}/.{name}.shardckpt-partial"))


def forge_marker(s3: S3, bucket: str, **owner) -> None:  # noqa: F811
    """Put the marker of a run that writes ``bucket/out`` (another machine's, or a dead one's)."""
    body = {"host": "node-7", "pid": 4242, "started": time.time() - 60, "heartbeat": time.time()}
    s3.fs.pipe_file(f"{bucket}/.out.shardckpt-partial", json.dumps(body | owner).encode())
    s3.fs.invalidate_cache()


def since(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))


@pytest.mark.slow
def test_a_run_whose_local_lock_does_not_see_the_first_is_refused_by_its_marker(
    s3,  # noqa: F811
    big,
    capsys,
    tmp_path,
    monkeypatch,
):
    """Two processes at once on one URL, staged apart (as two machines are): the marker keeps them apart."""
    local, sd = big
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    argv = ["convert", local, dst, "--to", "sharded", "--world-size", "1", "-q"]
    first = warm_cli.start(argv, setup=(_slow_fill_beating, 0.3, 0.2))
    uploading(first, lambda: s3.fs.invalidate_cache() or s3.open_uploads(bucket))
    owner = marker_of(s3, bucket)
    assert (owner["host"], owner["pid"]) == (socket.gethostname(), first.pid)
    uploading(first, lambda: marker_of(s3, bucket)["heartbeat"] > owner["heartbeat"])  # kept fresh
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # another staging directory
    code, err = cli(capsys, *argv)
    assert code == 4
    assert len(err) == 1
    assert err[0].startswith(
        f"shardckpt: error: '{dst}': is being written by another shardckpt run "
        f"(pid {first.pid} on {socket.gethostname()}, since {since(owner['started'])}, heartbeat "
    )
    assert err[0].endswith(" s ago): wait for that run to finish, or write to another DST")
    assert first.wait(120) == 0
    assert_equal(load_dcp(dst, sd), sd)
    no_leftovers(s3, bucket)


@pytest.mark.slow
def test_two_runs_started_at_once_from_two_staging_directories_one_writes_dst(
    s3,  # noqa: F811
    many,
    tmp_path,
):
    """As two machines would: neither local lock sees the other run; one takes the marker."""
    local, sd = many
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    argv = ["convert", local, dst, "--to", "sharded", "--world-size", "1", "-q"]
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        env = dict(os.environ, TMPDIR=str(tmp_path / name))
        runs.append(warm_cli.start(argv, env=env, setup=(_slow_fill, 0.1)))
    codes = [run.wait(120) for run in runs]
    assert sorted(codes) == [0, 4], [run.communicate() for run in runs]
    won, lost = runs if codes[0] == 0 else runs[::-1]
    assert re.fullmatch(
        rf"shardckpt: error: '{dst}': is being written by another shardckpt run \(pid {won.pid} "
        rf"on {re.escape(socket.gethostname())}, since [-0-9: ]+ UTC, heartbeat \d+ s ago\): "
        r"wait for that run to finish, or write to another DST\n",
        lost.communicate()[1],
    )
    assert_equal(load_dcp(dst, sd), sd)
    no_leftovers(s3, bucket)
    assert not list(tmp_path.glob("*/shardckpt-staging/*/*"))


@pytest.mark.parametrize("raced", [False, True], ids=["found", "created after it was read"])
def test_a_fresh_marker_of_a_run_on_another_host_refuses_the_run(
    s3,  # noqa: F811
    src,
    capsys,
    monkeypatch,
    raced,
):
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    started = time.time() - 60
    if raced:  # the other run creates its marker between this run's read and its put
        from shardckpt.core import marker

        read = marker._read
        reads = []

        def late(store):
            reads.append(store)
            if len(reads) == 1:
                forge_marker(s3, bucket, started=started)
                return None
            return read(store)

        monkeypatch.setattr(marker, "_read", late)
    else:
        forge_marker(s3, bucket, started=started)
    code, err = cli(capsys, "convert", src, dst, "--to", "sharded", "--world-size", "1")
    assert code == 4
    assert len(err) == 1, err
    assert err[0].startswith(
        f"shardckpt: error: '{dst}': is being written by another shardckpt run "
        f"(pid 4242 on node-7, since {since(started)}, heartbeat "
    )
    assert err[0].endswith(" s ago): wait for that run to finish, or write to another DST")
    assert marker_of(s3, bucket)["started"] == started  # the other run's, untouched
    assert s3.keys(f"{bucket}/out") == []
    assert not list(Path(tempfile.gettempdir()).glob("shardckpt-*/*/*"))


def _dead_pid() -> int:
    """Return the pid of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("dead", ["pid gone on this host", "heartbeat old on another host"])
def test_the_marker_of_a_dead_run_is_taken_over_and_its_leftovers_removed(
    s3,  # noqa: F811
    src,
    capsys,
    dead,
):
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    started = time.time() - 3600
    if dead == "pid gone on this host":
        owner = {"host": socket.gethostname(), "pid": _dead_pid()}
    else:
        owner = {"heartbeat": time.time() - 400}  # a marker is stale after 300 s
    forge_marker(s3, bucket, started=started, **owner)
    # What it left: an object not committed, and a multipart upload open.
    s3.fs.pipe_file(f"{bucket}/out/__0_0.distcp", b"x" * 100)
    s3.fs.call_s3("create_multipart_upload", Bucket=bucket, Key="out/__1_0.distcp")
    code, err = cli(capsys, "convert", src, dst, "--to", "sharded", "--world-size", "1", "-q")
    assert code == 0, err
    host, pid = owner.get("host", "node-7"), owner.get("pid", 4242)
    assert len(err) == 1, err
    assert err[0].startswith(
        "shardckpt: note: removed what a run that did not finish "
        f"(pid {pid} on {host}, since {since(started)}, heartbeat "
    )
    assert err[0].endswith(f" s ago) left at '{dst}' (uncommitted objects and 1 open uploads)")
    assert_equal(load_dcp(dst, state()), state())
    no_leftovers(s3, bucket)


@pytest.mark.slow
def test_a_run_whose_marker_another_run_took_over_does_not_commit(s3, many):  # noqa: F811
    local, _ = many
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    argv = ["convert", local, dst, "--to", "sharded", "--world-size", "1", "-q"]
    argv += ["--buffer-size", "8MiB"]
    proc = warm_cli.start(argv, setup=(_slow_fill_beating, 0.3, 0.2))
    uploading(proc, lambda: s3.open_uploads(bucket))
    # Another machine judged it dead and took its marker over (put over its ETag).
    forge_marker(s3, bucket)
    _, err = proc.communicate(120)
    assert proc.returncode == 4, err
    assert err.splitlines() == [
        f"shardckpt: error: '{dst}': another shardckpt run took its marker over (a run not "
        "heard from for 300 s is taken for dead), so this run did not commit: check what that "
        "run writes there; run again once it is done, or write to another DST"
    ]
    assert ".metadata" not in [k.rsplit("/", 1)[1] for k in s3.keys(f"{bucket}/out")]
    assert marker_of(s3, bucket)["host"] == "node-7"  # the other run's marker, left to it
    assert s3.open_uploads(bucket) == []  # its own uploads aborted


def test_a_whole_bucket_as_dst_is_refused(s3, src, capsys):  # noqa: F811
    bucket = s3.bucket()
    argv = ["convert", src, f"s3://{bucket}", "--to", "sharded", "--world-size", "1"]
    code, err = cli(capsys, *argv)
    assert code == 2
    assert err == [
        f"shardckpt: error: 's3://{bucket}': names a whole bucket: name a prefix inside it for DST"
    ]
    assert s3.keys(bucket) == []


def test_an_object_whose_key_leaves_src_is_refused_and_nothing_is_written_outside(
    s3,  # noqa: F811
    tmp_path,
    capsys,
):
    bucket = s3.bucket()
    local = tmp_path / "ckpt"
    dcp.save(state(), checkpoint_id=local, no_dist=True)
    s3.put_dir(local, f"{bucket}/run/step-100")
    name = f"escaped-{bucket}"
    s3.fs.pipe_file(f"{bucket}/run/step-100/../../../{name}", b"planted")
    code, err = cli(capsys, "verify", f"s3://{bucket}/run/step-100")
    assert code == 3
    assert err == [
        f"shardckpt: error: 's3://{bucket}/run/step-100': holds an object named "
        f"'../../../{name}', which names no file inside the checkpoint: remove or rename "
        "that object; shardckpt reads only the objects under SRC"
    ]
    tmp = Path(tempfile.gettempdir())  # where the key's '..'s lead from SRC's copy in it
    assert not any((where / name).exists() for where in (tmp, tmp.parent, tmp / "shardckpt-src"))
    assert not list(Path(tempfile.gettempdir()).glob("shardckpt-src-*"))
    for url in (f"s3://{bucket}/run/..", f"s3://{bucket}/run/./x"):
        code, err = cli(capsys, "convert", local, url, "--to", "sharded", "--world-size", "1")
        assert code == 2
        assert err == [
            f"shardckpt: error: '{url}': has '.' or '..' in its path, which object stores "
            "take as part of a name: write the prefix itself"
        ]


def test_dst_inside_src_on_s3_is_refused(s3, src, capsys):  # noqa: F811
    code, err = cli(capsys, "convert", src, f"{src}/inner", "--to", "sharded", "--world-size", "1")
    assert code == 2
    assert err == [
        f"shardckpt: error: '{src}/inner': DST is SRC, inside it or around it: "
        "name a prefix beside the checkpoint for the output"
    ]


def test_storage_options_reach_the_filesystem(s3, src, capsys, monkeypatch):  # noqa: F811
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    code = run(["inspect", src, "--storage-option", f"endpoint_url={s3.endpoint}"])
    assert code == 0
    assert capsys.readouterr().out.startswith(f"{src}: format dcp")
    code, err = cli(capsys, "inspect", src, "--storage-option", "endpoint_url")
    assert code == 2
    assert err == [
        "shardckpt: error: --storage-option 'endpoint_url' is not KEY=VALUE: "
        "write it like --storage-option anon=true"
    ]


def test_a_protocol_whose_library_is_missing_names_the_extra():
    urls = ["s3://bucket/ckpt", "gs://bucket/ckpt", "nosuch://bucket/ckpt"]
    script = (
        "import sys; sys.modules['s3fs'] = None; sys.modules['gcsfs'] = None\n"
        "from shardckpt.cli.app import run\n"
        "print([run(['inspect', url]) for url in sys.argv[1:]])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *urls], capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip() == "[2, 2, 2]", proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "shardckpt: error: 's3://bucket/ckpt': reading and writing s3:// needs s3fs, which is "
        "not installed: install it (pip install 'shardckpt[s3]')",
        "shardckpt: error: 'gs://bucket/ckpt': reading and writing gs:// needs gcsfs, which is "
        "not installed: install it (pip install gcsfs)",
        "shardckpt: error: 'nosuch://bucket/ckpt': nosuch:// is not a protocol fsspec knows: "
        "write a local path, or a URL such as s3://bucket/prefix",
    ]


def uploading(proc: warm_cli.WarmProcess, seen) -> None:
    """Return once ``seen()`` is true while ``proc`` runs (it uploads); fail if it ends first."""
    deadline = time.monotonic() + 120
    while not seen():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[Path, dict]:
    """A 112 MiB DCP on the local disk: more than s3fs puts in one request (2 x 50 MiB)."""
    sd = {"model": {"w": torch.arange(28 * 2**20, dtype=torch.float32)}}
    local = tmp_path_factory.mktemp("big") / "ckpt"
    dcp.save(sd, checkpoint_id=local, no_dist=True)
    return local, sd


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> tuple[Path, dict]:
    """A 112 MiB DCP of 14 tensors of 8 MiB on the local disk: its data file is written a tensor a step."""
    sd = {"model": {f"w{i}": torch.arange(2 * 2**20, dtype=torch.float32) + i for i in range(14)}}
    local = tmp_path_factory.mktemp("many") / "ckpt"
    dcp.save(sd, checkpoint_id=local, no_dist=True)
    return local, sd


def _this_tmpdir() -> None:
    """In the warm child: stage in this test's TMPDIR (the fork server's is another test's)."""
    tempfile.tempdir = None


def _slow_fill(delay: float) -> None:
    """In the warm child: each write of a file job (a step of a DCP data file) takes ``delay`` seconds more."""
    from shardckpt.engine import jobs

    _this_tmpdir()
    original = jobs.JobWriter.write

    def slow(self, *args, **kwargs):
        time.sleep(delay)
        return original(self, *args, **kwargs)

    jobs.JobWriter.write = slow


def _slow_parts(delay: float) -> None:
    """In the warm child: each part sent to DST takes ``delay`` seconds more."""
    from shardckpt.core import uploads

    original = uploads.Uploads._send_part

    def slow(self, *args):
        time.sleep(delay)
        return original(self, *args)

    uploads.Uploads._send_part = slow


def _allocated(path: Path) -> int:
    """Return the bytes of the local disk ``path`` takes."""
    return path.stat().st_blocks * 512


def _staged(name: str) -> Path:
    """Return DST file ``name`` where the fill writes it, in this test's staging directory."""
    found = list(
        Path(tempfile.gettempdir()).glob(f"shardckpt-staging/*/.out.shardckpt-partial/{name}")
    )
    assert len(found) == 1, list(Path(tempfile.gettempdir()).rglob("*"))
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["during the fill", "after the fill"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_run_stopped_mid_upload_commits_nothing_and_the_rerun_succeeds(s3, big, many, sig, phase):  # noqa: F811
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    if phase == "during the fill":  # a DCP's data file: its parts stream as it is written
        (local, sd), setup, out = many, (_slow_fill, 0.3), "__0_0.distcp"
        argv = ["convert", local, dst, "--to", "sharded", "--world-size", "1"]
        argv += ["--buffer-size", "8MiB"]
        said = f"shardckpt: interrupted by SIGTERM: '{dst}' was not written"
    else:  # hf shards are filled by every rank and patched once filled: uploaded after
        (local, sd), setup, out = big, (_slow_parts, 0.5), "model-00001-of-00001.safetensors"
        argv = ["convert", local, dst, "--to", "full", "--format", "hf"]
        said = "shardckpt: interrupted by SIGTERM"
    proc = warm_cli.start([*argv, "-q"], setup=setup)
    uploading(proc, lambda: s3.open_uploads(bucket))  # its first part is on its way
    if phase == "during the fill":  # while the fill still writes the file (8 MiB a step)
        # ... the local disk is given back as each part is sent: a hole of 16 MiB at least.
        uploading(
            proc, lambda: _allocated(_staged(out)) <= _staged(out).stat().st_size - (16 << 20)
        )
        assert _staged(out).stat().st_size < 112 << 20
    proc.send_signal(sig)
    _, err = proc.communicate(60)
    assert proc.returncode == (128 + sig if sig == signal.SIGTERM else -sig), err
    assert s3.keys(f"{bucket}/out") == []  # no commit object, and no data object completed
    if sig == signal.SIGTERM:
        assert err.splitlines()[-1] == said
        no_leftovers(s3, bucket)  # its uploads aborted, its marker removed
    rerun = warm_cli.run([*argv, "-q"], setup=(_this_tmpdir,))
    assert rerun.returncode == 0, rerun.stderr
    if sig == signal.SIGKILL:  # its marker names it: this host, a pid that is gone
        assert re.fullmatch(
            rf"shardckpt: note: removed what a run that did not finish \(pid {proc.pid} on "
            rf"{re.escape(socket.gethostname())}, since [-0-9: ]+ UTC, heartbeat \d+ s ago\) "
            rf"left at '{dst}' \(uncommitted objects and 1 open uploads\)\n",
            rerun.stderr,
        )
    if phase == "during the fill":
        assert_equal(load_dcp(dst, sd), sd)
    else:
        assert_equal(load_safetensors(s3.fs.cat_file(f"{bucket}/out/{out}")), sd["model"])
    no_leftovers(s3, bucket)


def composite_crc32(data: bytes, part: int) -> str:
    """Return S3's checksum of an object uploaded in parts of ``part`` bytes, each with its CRC-32."""
    import base64
    import zlib

    parts = [data[i : i + part] for i in range(0, len(data), part)]
    crcs = b"".join(zlib.crc32(p).to_bytes(4, "big") for p in parts)
    return f"{base64.b64encode(zlib.crc32(crcs).to_bytes(4, 'big')).decode()}-{len(parts)}"


def test_every_part_and_put_carries_its_crc32_which_the_store_keeps(s3, big, capsys):  # noqa: F811
    import base64
    import zlib

    local, sd = big
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    code, err = cli(capsys, "convert", local, dst, "--to", "sharded", "--world-size", "1", "-q")
    assert code == 0, err
    for name in (".metadata", "__0_0.distcp"):
        key = f"{bucket}/out/{name}"
        head = s3.fs.call_s3(
            "head_object", Bucket=bucket, Key=f"out/{name}", ChecksumMode="ENABLED"
        )
        data = s3.fs.cat_file(key)
        if len(data) > 16 << 20:  # a multipart upload of 16 MiB parts, each one's CRC-32 sent
            # S3 says "CRC-N"; moto leaves out the "-N"
            value, count = composite_crc32(data, 16 << 20).split("-")
            assert head["ChecksumCRC32"] in (value, f"{value}-{count}")
        else:  # one PUT
            assert (
                head["ChecksumCRC32"]
                == base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
            )
    assert_equal(load_dcp(dst, sd), sd)
    no_leftovers(s3, bucket)


@pytest.mark.parametrize("to", ["sharded", "hf"])
def test_bytes_changed_after_their_crc32_are_refused_by_the_store(s3, big, capsys, monkeypatch, to):  # noqa: F811
    from shardckpt.core import storage, uploads

    read_part = uploads._read_part

    def changed(fd, offset, length):
        data, crc = read_part(fd, offset, length)
        if offset == 0:  # a part whose bytes change on the way, after their CRC-32 was taken
            return bytes([data[0] ^ 1]) + data[1:], crc
        return data, crc

    monkeypatch.setattr(uploads, "_read_part", changed)
    monkeypatch.setattr(storage, "RETRIES", 1)
    local, _ = big
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    argv = ["convert", local, dst, "--to", "sharded", "--world-size", "1", "-q"]
    name = "__0_0.distcp"
    if to == "hf":  # uploaded after the fill, not streamed
        argv = ["convert", local, dst, "--to", "full", "--format", "hf", "-q"]
        name = "model-00001-of-00001.safetensors"
    # botocore sends a refused part again 4 times itself (legacy retries): not here.
    code, err = cli(capsys, *argv, "--storage-option", "config_kwargs.retries.max_attempts=1")
    assert code == 4
    assert err == [
        f"shardckpt: error: '{dst}/{name}': writing failed after 2 tries (400 BadDigest): "
        "check the endpoint (AWS_ENDPOINT_URL) and the network, and run again"
    ]
    assert s3.keys(f"{bucket}/out") == []  # nothing committed, nothing completed
    no_leftovers(s3, bucket)  # no open upload, no marker


@pytest.mark.slow
def test_torchrun_two_ranks_s3_to_s3_loads_equal(s3, src):  # noqa: F811
    bucket = src[5:].split("/")[0]
    dst = f"s3://{bucket}/run/at-2-torchrun"
    cmd = ["--standalone", "--nproc-per-node=2", "-m", "shardckpt", "convert", src, dst]
    cmd += ["--to", "sharded", "-q"]
    proc = warm_cli.run_torchrun(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=150)
    assert proc.returncode == 0, proc.stderr
    names = [k.rsplit("/", 1)[1] for k in s3.keys(dst[5:])]
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert_equal(load_dcp(dst, state()), state())
    no_leftovers(s3, bucket)
    cmd = ["--standalone", "--nproc-per-node=2", "-m", "shardckpt", "verify", dst]
    proc = warm_cli.run_torchrun(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"intact: {dst} (dcp, 3 files")
    no_leftovers(s3, bucket)


def test_file_urls_are_local_paths(tmp_path, capsys):
    local = tmp_path / "ckpt"
    dcp.save(state(), checkpoint_id=local, no_dist=True)
    out = tmp_path / "full.pt"
    code, err = cli(capsys, "convert", f"file://{local}", f"file://{out}", "--to", "full", "-q")
    assert (code, err) == (0, [])
    assert_equal(torch.load(out, weights_only=True), state())


# ------------------------------------------------ data objects read where they lie


def big_state() -> dict:
    """A source whose tensors span several ranged requests (``remote_files.PART``) and chunks."""
    torch.manual_seed(1)
    return {
        "model": {"w": torch.randn(3000, 1024), "b": torch.randn(1024), "u": torch.randn(700, 300)},
        "step": 7,
    }


class Reads:
    """What a run fetched of SRC: objects whole, bytes by ranged request, and the disk its stand-ins took."""

    def __init__(self, monkeypatch, data: tuple[str, ...] = (".distcp",)):
        import s3fs

        from shardckpt.core import remote_files

        self.whole: list[str] = []
        self.stand_ins: dict[str, int] = {}  # a data object's stand-in: the bytes it took on disk
        self.by_object: dict[str, int] = {}  # bytes of ranged GETs, by the object's name
        self.requests = remote_files.requests
        self.requests.count = self.requests.bytes = 0
        get_file, forget = s3fs.S3FileSystem._get_file, remote_files.forget
        fetch, lock = remote_files._fetch, threading.Lock()

        def tallied(obj, start, end):  # called by several fetching threads
            data = fetch(obj, start, end)
            name = obj.url.rsplit("/", 1)[1]
            with lock:
                self.by_object[name] = self.by_object.get(name, 0) + len(data)
            return data

        async def counted(fs, rpath, lpath, **kwargs):
            self.whole.append(rpath)
            return await get_file(fs, rpath, lpath, **kwargs)

        def measured(keys):
            for path in Path(tempfile.gettempdir()).glob("shardckpt-src-*/**/*"):
                if path.name.endswith(data) and path.is_file():
                    self.stand_ins[path.name] = path.stat().st_blocks * 512
            forget(keys)

        monkeypatch.setattr(s3fs.S3FileSystem, "_get_file", counted)
        monkeypatch.setattr(remote_files, "forget", measured)
        monkeypatch.setattr(remote_files, "_fetch", tallied)


def data_sizes(s3: S3, url: str) -> dict[str, int]:  # noqa: F811
    s3.fs.invalidate_cache()
    found = s3.fs.find(url[len("s3://") :], detail=True)
    return {k.rsplit("/", 1)[1]: v["size"] for k, v in found.items() if k.endswith(".distcp")}


def test_s3_to_s3_reads_each_data_object_by_ranged_requests_with_no_local_copy(
    s3,  # noqa: F811
    capsys,
    monkeypatch,
):
    bucket = s3.bucket()
    src, dst = f"s3://{bucket}/run/step-7", f"s3://{bucket}/run/step-7-at-3"
    save_dcp(src, big_state())
    sizes = data_sizes(s3, src)
    reads = Reads(monkeypatch)
    code, err = cli(capsys, "convert", src, dst, "--to", "sharded", "--world-size", "3", "-q")
    assert (code, err) == (0, [])
    assert_equal(load_dcp(dst, big_state()), big_state())
    no_leftovers(s3, bucket)
    # .metadata fetched whole; the data object only by ranges, each byte about once (a
    # chunk's zip headers are read before its rows), and no byte of it on the local disk.
    assert [k.rsplit("/", 1)[1] for k in reads.whole] == [".metadata"]
    assert reads.stand_ins == dict.fromkeys(sizes, 0)
    total = sum(sizes.values())
    assert total <= reads.requests.bytes <= total + 8 * 64 << 10
    assert reads.requests.count >= 2 * total // (8 << 20)
    # The threads that fetched are gone: the process may end at once (cli.app._leave).
    import threading

    assert not [t.name for t in threading.enumerate() if t.name.startswith("shardckpt-get")]


def test_s3_dcp_to_a_local_safetensors_file_and_verify_read_in_place(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    bucket = s3.bucket()
    src = f"s3://{bucket}/run/step-7"
    save_dcp(src, big_state())
    reads = Reads(monkeypatch)
    out = tmp_path / "model.safetensors"
    code, _ = cli(capsys, "convert", src, out, "--to", "full", "--only", "model", "-q")
    assert code == 0
    assert_equal(load_safetensors(out.read_bytes()), big_state()["model"])
    code = run(["verify", src])
    assert code == 0
    assert capsys.readouterr().out.startswith(f"intact: {src} (dcp, 2 files")
    assert not [k for k in reads.whole if k.endswith(".distcp")]
    assert set(reads.stand_ins.values()) == {0}
    no_leftovers(s3, bucket)


def test_a_data_object_removed_during_the_run_is_one_line_naming_it(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    from shardckpt.core import storage

    bucket = s3.bucket()
    src = f"s3://{bucket}/run/step-7"
    save_dcp(src, big_state())
    lay_out = storage.lay_out

    def then_removed(store, into, objects):
        local = lay_out(store, into, objects)
        s3.fs.rm(store.child("__0_0.distcp"))  # once listed and laid out, before any read
        return local

    monkeypatch.setattr(storage, "lay_out", then_removed)
    out = tmp_path / "out"
    code, err = cli(capsys, "convert", src, out, "--to", "sharded", "--world-size", "2")
    assert code == 3
    assert err == [
        f"shardckpt: error: '{src}/__0_0.distcp': was removed while it was read (404 NoSuchKey): "
        "SRC changed during the run; convert a checkpoint that no process is writing or removing"
    ]
    assert list(tmp_path.iterdir()) == []
    no_leftovers(s3, bucket)


def convert_on_two_ranks(src: str, dst: str, world_size: int) -> list[dict]:
    """Convert ``src`` to a DCP at ``world_size`` at ``dst`` on two gloo ranks; return what each read and uploaded."""
    import ranks
    from harness import run_ranks

    env = {
        k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    }
    env["TMPDIR"] = tempfile.gettempdir()
    kwargs = {"world_size": world_size}
    return run_ranks(ranks.convert_on_storage, 2, src, dst, "sharded", kwargs, env)


@pytest.mark.slow
def test_each_rank_reads_by_ranges_and_uploads_the_files_it_wrote_then_rank_0_commits(s3, src):  # noqa: F811
    bucket = src[5:].split("/")[0]
    dst = f"s3://{bucket}/run/at-4-by-2"
    got = convert_on_two_ranks(src, dst, world_size=4)
    # Target rank r's file is written by process r mod 2, which uploads it; rank 0 alone
    # puts .metadata, after both ranks' uploads.
    assert [g["data"] for g in got] == [
        ["__0_0.distcp", "__2_0.distcp"],
        ["__1_0.distcp", "__3_0.distcp"],
    ]
    assert [g["commit"] for g in got] == [[".metadata"], []]
    assert all(g["ranged_bytes"] > 0 for g in got)  # each rank read SRC's data itself
    assert_equal(load_dcp(dst, state()), state())
    no_leftovers(s3, bucket)


# ------------------------------- safetensors, hf and torch.save objects read where they lie

SAFETENSORS_OR_TORCH = (".safetensors", ".pt")


def hf_on_s3(s3: S3, tmp_path: Path) -> tuple[Path, str, dict[str, int]]:  # noqa: F811
    """Return a Hugging Face directory (``hf_state`` in three shards and a config), its URL, and its shards' sizes."""
    local = tmp_path / "hf"
    write_hf_like_transformers(local, hf_state(), per_shard=2)
    (local / "config.json").write_text("{}")
    url = f"s3://{s3.bucket()}/models/hf"
    s3.put_dir(local, url[5:])
    return local, url, sizes_of(s3, url[5:], (".safetensors",))


def read_shards(local: Path) -> dict:
    """Return the tensors of a Hugging Face directory's shards as the safetensors library reads them: the source."""
    from safetensors.torch import load_file

    source = {}
    for shard in sorted(local.glob("*.safetensors")):
        source.update(load_file(shard))
    return source


def sizes_of(s3: S3, prefix: str, data: tuple[str, ...]) -> dict[str, int]:  # noqa: F811
    """Return the data objects under ``prefix`` (``bucket/...``, an object or a prefix) by name, with their sizes."""
    s3.fs.invalidate_cache()
    found = s3.fs.find(prefix, detail=True)
    return {k.rsplit("/", 1)[1]: v["size"] for k, v in found.items() if k.endswith(data)}


def read_in_place(reads: Reads, sizes: dict[str, int]) -> None:
    """Assert the run fetched no data object whole, kept none on the disk, and asked for each byte about once.

    Beyond the data itself: a few 256 KiB blocks per object (its header, or its zip's
    directory, pickle and byteorder record, read before its tensors).
    """
    assert not [k for k in reads.whole if k.endswith(SAFETENSORS_OR_TORCH)]
    assert reads.stand_ins == dict.fromkeys(sizes, 0)
    total = sum(sizes.values())
    assert total <= reads.requests.bytes <= total + len(sizes) * 4 * (256 << 10)


def hf_state() -> dict:
    """Weights that span several ranged requests (``remote_files.PART``), in three shards."""
    torch.manual_seed(2)
    return {
        "embed.weight": torch.randn(1500, 1024),
        "layers.0.w": torch.randn(1024, 600).to(torch.bfloat16),
        "layers.0.b": torch.randn(600),
        "layers.1.w": torch.randn(600, 700),
        "norm.weight": torch.randn(700).half(),
        "step": torch.tensor(3),
    }


def test_s3_hf_directory_to_local_dcp_and_safetensors_reads_its_shards_in_place(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    local, url, sizes = hf_on_s3(s3, tmp_path)
    bucket = url[5:].split("/")[0]
    assert len(sizes) == 3
    source = read_shards(local)

    reads = Reads(monkeypatch, SAFETENSORS_OR_TORCH)
    out = tmp_path / "dcp"
    code, err = cli(capsys, "convert", url, out, "--to", "sharded", "--world-size", "2", "-q")
    assert (code, err) == (0, [])
    back = {"model": {k: torch.zeros_like(v) for k, v in source.items()}}
    dcp.load(back, checkpoint_id=out, no_dist=True)
    assert_equal(back["model"], source)
    read_in_place(reads, sizes)
    assert sorted(k.rsplit("/", 1)[1] for k in reads.whole) == [
        "config.json",
        "model.safetensors.index.json",
    ]

    reads = Reads(monkeypatch, SAFETENSORS_OR_TORCH)
    out = tmp_path / "full.safetensors"
    code, err = cli(capsys, "convert", url, out, "--to", "full", "--only", "model", "-q")
    assert code == 0 and all(line.startswith("shardckpt: note:") for line in err)
    assert_equal(load_safetensors(out.read_bytes()), source)
    read_in_place(reads, sizes)
    no_leftovers(s3, bucket)


def test_s3_torch_save_file_to_local_safetensors_reads_it_in_place(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    local = tmp_path / "model.pt"
    torch.save(big_state()["model"], local)
    source = torch.load(local, weights_only=True)  # what torch reads from the local original
    bucket = s3.bucket()
    url = f"s3://{bucket}/in/model.pt"
    s3.fs.put_file(str(local), url[5:])
    reads = Reads(monkeypatch, SAFETENSORS_OR_TORCH)
    out = tmp_path / "model.safetensors"
    code, err = cli(capsys, "convert", url, out, "--to", "full", "-q")
    assert (code, err) == (0, [])
    assert_equal(load_safetensors(out.read_bytes()), source)
    read_in_place(reads, {"model.pt": local.stat().st_size})
    assert reads.whole == []

    # inspect: its zip's directory, pickle and records' headers, no tensor's bytes.
    reads = Reads(monkeypatch, SAFETENSORS_OR_TORCH)
    code = run(["inspect", url, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert (code, doc["format"]) == (0, "torch")
    assert {".".join(e["path"]) for e in doc["entries"]} == set(source)
    assert reads.whole == []
    assert reads.requests.bytes <= 4 * (256 << 10) < local.stat().st_size // 10
    no_leftovers(s3, bucket)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_s3_torch_save_file_with_views_to_local_dcp_is_the_source(s3, tmp_path, capsys, legacy):  # noqa: F811
    # A transposed view and two tensors sharing one storage: rows not one run of the file.
    # A legacy file (torch < 1.6's format, no zip records) is read whole, through a stream.
    torch.manual_seed(3)
    base = torch.randn(300, 200)
    tree = {"t": base.t(), "head": base[:10], "tail": base[290:], "n": torch.arange(5), "k": 4}
    local = tmp_path / "views.pt"
    torch.save(tree, local, _use_new_zipfile_serialization=not legacy)
    source = torch.load(local, weights_only=True)
    bucket = s3.bucket()
    url = f"s3://{bucket}/in/views.pt"
    s3.fs.put_file(str(local), url[5:])
    out = tmp_path / "dcp"
    code, err = cli(capsys, "convert", url, out, "--to", "sharded", "--world-size", "2", "-q")
    assert (code, err) == (0, [])
    back = _zeros(source)
    dcp.load(back, checkpoint_id=out, no_dist=True)
    assert_equal(back, source)


def test_s3_safetensors_file_to_local_dcp_and_verify_and_inspect_read_it_in_place(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    from safetensors.torch import load_file, save_file

    local = tmp_path / "model.safetensors"
    save_file(hf_state(), local)
    source = load_file(local)
    bucket = s3.bucket()
    url = f"s3://{bucket}/in/model.safetensors"
    s3.fs.put_file(str(local), url[5:])
    sizes = {"model.safetensors": local.stat().st_size}

    reads = Reads(monkeypatch, SAFETENSORS_OR_TORCH)
    out = tmp_path / "dcp"
    argv = ["convert", url, out, "--to", "sharded", "--world-size", "2", "-q"]
    code, err = cli(capsys, *argv)
    assert code == 0 and all(line.startswith("shardckpt: note:") for line in err)
    back = {k: torch.zeros_like(v) for k, v in source.items()}
    dcp.load(back, checkpoint_id=out, no_dist=True)
    assert_equal(back, source)
    read_in_place(reads, sizes)

    reads = Reads(monkeypatch, SAFETENSORS_OR_TORCH)
    code = run(["verify", url])
    assert code == 0
    assert capsys.readouterr().out.startswith(f"intact: {url} (safetensors")
    read_in_place(reads, sizes)

    reads = Reads(monkeypatch, SAFETENSORS_OR_TORCH)
    code = run(["inspect", url, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["format"] == "safetensors"
    assert {".".join(e["path"]) for e in doc["entries"]} == set(source)
    assert reads.whole == []
    assert reads.requests.bytes <= 256 << 10  # its header's block, no tensor
    no_leftovers(s3, bucket)


def test_verify_and_inspect_of_an_s3_hf_directory_fetch_no_shard_whole(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    _, url, sizes = hf_on_s3(s3, tmp_path)
    bucket = url[5:].split("/")[0]
    reads = Reads(monkeypatch, SAFETENSORS_OR_TORCH)
    code = run(["verify", url])
    assert code == 0
    assert capsys.readouterr().out.startswith(f"intact: {url} (hf")
    read_in_place(reads, sizes)
    reads = Reads(monkeypatch, SAFETENSORS_OR_TORCH)
    code = run(["inspect", url])
    assert code == 0
    assert capsys.readouterr().out.startswith(f"{url}: format hf")
    assert not [k for k in reads.whole if k.endswith(".safetensors")]
    assert reads.requests.bytes <= 3 * (256 << 10)  # each shard's header block
    no_leftovers(s3, bucket)


def test_a_flipped_byte_in_a_torch_save_object_on_s3_is_exit_3_naming_it(s3, tmp_path, capsys):  # noqa: F811
    local = tmp_path / "model.pt"
    torch.save(big_state()["model"], local)
    flipped = damage.flip_in_torch_file(local, "u")
    bucket = s3.bucket()
    url = f"s3://{bucket}/in/model.pt"
    s3.fs.put_file(str(local), url[5:])
    for argv in (["verify", url], ["convert", url, tmp_path / "out.safetensors", "--to", "full"]):
        code, err = cli(capsys, *argv)
        assert code == 3
        assert err == [f"shardckpt: error: '{url}': {flipped.message()}: {damage.RECOPY}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    no_leftovers(s3, bucket)


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt", "hf"])
def test_an_object_removed_during_the_run_is_one_line_naming_it(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
    name,
):
    from safetensors.torch import save_file

    from shardckpt.core import storage

    bucket = s3.bucket()
    if name == "hf":
        _, url, _ = hf_on_s3(s3, tmp_path)
        bucket = url[5:].split("/")[0]
        removed = "models/hf/model-00002-of-00003.safetensors"
    else:
        local = tmp_path / name
        (save_file if name.endswith(".safetensors") else torch.save)(hf_state(), local)
        s3.fs.put_file(str(local), f"{bucket}/in/{name}")
        removed, url = f"in/{name}", f"s3://{bucket}/in/{name}"
    lay_out = storage.lay_out

    def then_removed(store, into, objects):
        laid = lay_out(store, into, objects)
        s3.fs.rm(f"{bucket}/{removed}")  # once listed and laid out, before any read
        return laid

    monkeypatch.setattr(storage, "lay_out", then_removed)
    out = tmp_path / "out"
    argv = ["convert", url, out, "--to", "sharded", "--world-size", "2"]
    code, err = cli(capsys, *argv)
    assert code == 3
    assert err == [
        f"shardckpt: error: 's3://{bucket}/{removed}': was removed while it was read "
        "(404 NoSuchKey): SRC changed during the run; convert a checkpoint that no process "
        "is writing or removing"
    ]
    assert not out.exists()
    assert not list(tmp_path.glob(".out*"))
    no_leftovers(s3, bucket)


def _cut(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]


def _huge_header(raw: bytes) -> bytes:
    return (1 << 40).to_bytes(8, "little") + raw[8:]


def _garbled_pickle(raw: bytes) -> bytes:
    at = raw.index(b"data.pkl") + 64  # inside the pickle's record
    return raw[:at] + bytes(64) + raw[at + 64 :]


@pytest.mark.parametrize(
    ("name", "damage_it"),
    [
        ("model.safetensors", _cut),
        ("model.safetensors", _huge_header),
        ("model.pt", _cut),
        ("model.pt", _garbled_pickle),
        ("model.bin", lambda raw: b"not a checkpoint at all" * 10),
    ],
)
def test_a_damaged_object_read_in_place_is_the_line_its_local_copy_gives(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    name,
    damage_it,
):
    from safetensors.torch import save_file

    original = tmp_path / f"original-{name}"
    (save_file if name.endswith(".safetensors") else torch.save)(hf_state(), original)
    (tmp_path / "in").mkdir()
    local = tmp_path / "in" / name
    local.write_bytes(damage_it(original.read_bytes()))
    bucket = s3.bucket()
    url = f"s3://{bucket}/in/{name}"
    s3.fs.put_file(str(local), url[5:])
    argv = ["--to", "sharded", "--world-size", "2"]
    code, err = cli(capsys, "convert", local, tmp_path / "out-local", *argv)
    assert code == 3 and len(err) == 1
    # Read in place, the same line as for the file on a disk, naming the object.
    assert cli(capsys, "convert", url, tmp_path / "out", *argv) == (
        3,
        [err[0].replace(str(local), url)],
    )
    assert not (tmp_path / "out").exists()
    no_leftovers(s3, bucket)


@pytest.mark.slow
def test_two_ranks_read_an_s3_hf_directory_in_place_each_its_part(s3, tmp_path):  # noqa: F811
    local, src, sizes = hf_on_s3(s3, tmp_path)
    source = read_shards(local)
    bucket = src[5:].split("/")[0]
    dst = f"s3://{bucket}/run/from-hf-at-2"
    got = convert_on_two_ranks(src, dst, world_size=2)
    assert_equal(load_dcp(dst, {"model": source})["model"], source)
    # Each rank read the rows of its own target rank from the shards, by ranges: together
    # about the shards' size once (their headers' blocks read by both).
    ranged = [g["ranged_bytes"] for g in got]
    total = sum(sizes.values())
    assert all(n > 0 for n in ranged)
    assert total <= sum(ranged) <= total + 2 * len(sizes) * 4 * (256 << 10)
    no_leftovers(s3, bucket)


@pytest.mark.slow
def test_verify_reads_the_staged_dst_whose_parts_were_already_sent(s3, many):  # noqa: F811
    # A part's local bytes are dropped once sent, but not for --verify, which reads them
    # after the fill (a slow one: its first parts are long sent by then).
    local, sd = many
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    argv = ["convert", local, dst, "--to", "sharded", "--world-size", "1", "--verify", "-q"]
    done = warm_cli.run([*argv, "--buffer-size", "8MiB"], setup=(_slow_fill, 0.2))
    assert (done.returncode, done.stderr) == (0, "")
    assert_equal(load_dcp(dst, sd), sd)
    no_leftovers(s3, bucket)


@pytest.mark.parametrize(
    ("buffer", "rows"), [("64MiB", 48 << 20), ("256MiB", 192 << 20), ("1GiB", 896 << 20)]
)
def test_the_parts_in_flight_come_out_of_the_buffer(s3, big, capsys, monkeypatch, buffer, rows):  # noqa: F811
    from shardckpt.engine import fill

    seen: list[int] = []
    real = fill.rows_budget
    monkeypatch.setattr(fill, "rows_budget", lambda b, t: seen.append(b) or real(b, t))
    local, sd = big
    bucket = s3.bucket()
    dst = f"s3://{bucket}/out"
    argv = ["convert", local, dst, "--to", "sharded", "--world-size", "1", "-q"]
    code, err = cli(capsys, *argv, "--buffer-size", buffer)
    assert (code, err) == (0, [])
    # The parts in flight, 16 MiB each and as much again in the S3 client, from the buffer:
    # a quarter of it at most (1 part, 2, or 4 at most).
    assert seen == [rows]
    assert_equal(load_dcp(dst, sd), sd)
    no_leftovers(s3, bucket)


# ------------------------------------------------ per-rank torch.save files read where they lie


@pytest.fixture(scope="module")
def fsdp2_ranks(tmp_path_factory) -> tuple[Path, dict]:
    """``rank{r}.pt`` of a real FSDP2 job at 2 (shards of several ranged requests), and the job's full state."""
    import fsdp2_ranks_jobs as jobs
    from harness import run_ranks

    root = tmp_path_factory.mktemp("fsdp2") / "ranks"
    root.mkdir()
    full = run_ranks(jobs.save_wide_rank_files, 2, str(root))[0]
    return root, full


def read_rows_in_place(reads: Reads, local: Path, data: int) -> None:
    """Assert a run asked for ``data`` bytes of the rank files ``local`` holds (on S3), about once, no more.

    Beyond the rows: a 256 KiB block per zip record of each file (its local header, read
    before its data), and a few for its directory and pickle.
    """
    records = sum(len({at for at, _ in damage.storages(p).values()}) for p in local.iterdir())
    assert data <= reads.requests.bytes <= data + (records + 8) * (256 << 10)


def model_as_local_converts(capsys, url: str, local: Path, tmp_path: Path, *argv) -> dict:
    """Return the model ``convert URL --to full --only model`` exports, asserting it is the local original's export byte for byte."""
    out, mine = tmp_path / "model.safetensors", tmp_path / "local.safetensors"
    code, err = cli(capsys, "convert", url, out, "--to", "full", "--only", "model", "-q", *argv)
    assert code == 0 and all(line.startswith("shardckpt: note:") for line in err)
    code, _ = cli(capsys, "convert", local, mine, "--to", "full", "--only", "model", "-q", *argv)
    assert code == 0 and out.read_bytes() == mine.read_bytes()
    return load_safetensors(out.read_bytes())


def all_as_local_converts(capsys, url: str, local: Path, tmp_path: Path, *argv) -> Path:
    """Return the file ``convert URL --to full`` writes, asserting it is the local original's byte for byte."""
    out, mine = tmp_path / "all.pt", tmp_path / "all-local.pt"
    code, err = cli(capsys, "convert", url, out, "--to", "full", "-q", *argv)
    assert code == 0 and all(line.startswith("shardckpt: note:") for line in err)
    assert cli(capsys, "convert", local, mine, "--to", "full", "-q", *argv)[0] == 0
    assert out.read_bytes() == mine.read_bytes()
    return out


def test_s3_fsdp2_rank_files_to_local_full_and_dcp_read_their_rows_in_place(
    s3,  # noqa: F811
    fsdp2_ranks,
    tmp_path,
    capsys,
    monkeypatch,
):
    local, full = fsdp2_ranks
    bucket = s3.bucket()
    url = f"s3://{bucket}/run/ranks"
    s3.put_dir(local, url[5:])
    sizes = sizes_of(s3, url[5:], (".pt",))
    assert sorted(sizes) == ["rank0.pt", "rank1.pt"]

    # --only model: each file's pickle and its model shards' rows, not its optimizer state.
    reads = Reads(monkeypatch, (".pt",))
    assert_equal(model_as_local_converts(capsys, url, local, tmp_path), full["model"])
    assert reads.whole == []
    assert reads.stand_ins == dict.fromkeys(sizes, 0)
    read_rows_in_place(
        reads, local, sum(t.numel() * t.element_size() for t in full["model"].values())
    )

    # All of it, resharded to a DCP at 3: every byte read about once.
    reads = Reads(monkeypatch, (".pt",))
    out = tmp_path / "dcp"
    code, err = cli(capsys, "convert", url, out, "--to", "sharded", "--world-size", "3", "-q")
    assert (code, err) == (0, [])
    back = {"model": _zeros(full["model"]), "optim": {"state": _zeros(full["optim"]["state"])}}
    dcp.load(back, checkpoint_id=out, no_dist=True)
    assert_equal(back, {"model": full["model"], "optim": {"state": full["optim"]["state"]}})
    read_rows_in_place(reads, local, sum(sizes.values()))
    no_leftovers(s3, bucket)


def test_a_flipped_byte_in_an_fsdp2_rank_file_on_s3_is_exit_3_naming_it(
    s3,  # noqa: F811
    fsdp2_ranks,
    tmp_path,
    capsys,
    monkeypatch,
):
    local = damage.copy(fsdp2_ranks[0], tmp_path / "ranks")
    flipped = damage.flip_in_torch_file(local / "rank1.pt", "model.0.weight")
    # Nothing fetched: the record's CRC-32 checked as its rows were read by range.
    flip_is_exit_3(s3, capsys, monkeypatch, tmp_path, local, "rank1.pt", flipped, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ranks"]


@pytest.mark.parametrize("name", ["rank_{}.bin", "__{}_0.pt"])
def test_s3_rank_files_by_their_other_names_are_read_in_place_and_checked(
    s3,  # noqa: F811
    fsdp2_ranks,
    tmp_path,
    capsys,
    monkeypatch,
    name,
):
    # The same FSDP2 job's files, named as the per-rank readers also read them
    # (formats/ranks/rank_names.py): read by ranges, as the local files convert.
    local = tmp_path / "ranks"
    local.mkdir()
    for rank in (0, 1):
        damage.copy(fsdp2_ranks[0] / f"rank{rank}.pt", local / name.format(rank))
    url = uploaded(s3, local)
    names = (name.format(0), name.format(1))
    reads = Reads(monkeypatch, names)
    out = torch.load(all_as_local_converts(capsys, url, local, tmp_path), weights_only=True)
    assert_equal(out["model"], fsdp2_ranks[1]["model"])
    assert reads.whole == []
    assert reads.stand_ins == dict.fromkeys(names, 0)
    read_rows_in_place(reads, local, sum(sizes_of(s3, url[5:], names).values()))

    flipped = damage.flip_in_torch_file(local / names[1], "model.0.weight")
    flip_is_exit_3(s3, capsys, monkeypatch, tmp_path, local, names[1], flipped, [])


@pytest.mark.parametrize("kind", ["sharded", "local"])
def test_s3_fsdp1_rank_files_to_local_full_are_fsdp1s_own_full_state_read_in_place(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
    kind,
):
    import fsdp1_jobs
    from harness import run_ranks

    # SHARDED_STATE_DICT (ShardedTensors) and LOCAL_STATE_DICT (flat shards) of a real FSDP1 job at 2.
    full = run_ranks(fsdp1_jobs.save, 2, str(tmp_path), False)[0]
    local = tmp_path / kind
    bucket = s3.bucket()
    url = f"s3://{bucket}/run/{kind}"
    s3.put_dir(local, url[5:])
    reads = Reads(monkeypatch, (".pt",))
    flat = (
        ["--model", "fsdp1_jobs:build_model", "--wrap", "fsdp1_jobs:Block"]
        if kind == "local"
        else []
    )
    assert_equal(model_as_local_converts(capsys, url, local, tmp_path, *flat), full["model"])
    assert reads.whole == []
    assert reads.stand_ins == dict.fromkeys(["rank_0.pt", "rank_1.pt"], 0)
    no_leftovers(s3, bucket)


@pytest.mark.parametrize("case", ["z2-bf16", "z3-fp32"])
def test_s3_deepspeed_run_to_local_full_is_zero_to_fp32s_output_read_in_place(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
    case,
):
    from deepspeed_goldens import run_dir, zero_to_fp32

    local = run_dir(case)  # DeepSpeed's own save (tests/goldens/deepspeed/make.py)
    bucket = s3.bucket()
    url = f"s3://{bucket}/runs/{case}"
    s3.put_dir(local, url[5:])
    sizes = sizes_of(s3, url[5:], ("_states.pt",))
    reads = Reads(monkeypatch, ("_states.pt",))
    out = all_as_local_converts(capsys, url, local, tmp_path)  # as the local original converts
    model = torch.load(out, weights_only=True)["model"]
    assert_equal(model, {k: v for k, v in zero_to_fp32(case).items() if k in model})
    # Only `latest` fetched whole; every states file by ranges, none on the disk.
    assert [k.rsplit("/", 1)[1] for k in reads.whole] == ["latest"]
    assert reads.stand_ins == dict.fromkeys(sizes, 0)
    no_leftovers(s3, bucket)


def flip_is_exit_3(s3, capsys, monkeypatch, tmp_path, src: Path, name: str, flipped, fetched):  # noqa: F811
    """Upload ``src`` (``name`` in it with a byte ``flipped``): verify and convert are exit 3 naming it, fetching only ``fetched`` whole."""
    bucket = s3.bucket()
    url = f"s3://{bucket}/runs/{src.name}"
    s3.put_dir(src, url[5:])
    for argv in (["verify", url], ["convert", url, tmp_path / "out.pt", "--to", "full"]):
        reads = Reads(monkeypatch, (".pt",))
        code, err = cli(capsys, *argv)
        assert code == 3
        assert err == [f"shardckpt: error: '{url}/{name}': {flipped.message()}: {damage.RECOPY}"]
        assert [k.rsplit("/", 1)[1] for k in reads.whole] == fetched
    assert not (tmp_path / "out.pt").exists()
    no_leftovers(s3, bucket)


def test_a_flipped_byte_in_a_deepspeed_partition_on_s3_is_exit_3_naming_it(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    from deepspeed_files import copy_run, deepspeed_classes
    from deepspeed_goldens import run_dir

    src = copy_run(run_dir("z2-bf16"), tmp_path)
    name = "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with deepspeed_classes():
        flipped = damage.flip_in_torch_file(
            src / name,
            "optimizer_state_dict.single_partition_of_fp32_groups.0",
            weights_only=False,
        )
    flip_is_exit_3(s3, capsys, monkeypatch, tmp_path, src, name, flipped, ["latest"])


@pytest.mark.parametrize("case", ["z2-bf16", "z3-fp32"])
def test_s3_deepspeed_universal_checkpoint_to_local_full_reads_its_files_in_place(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
    case,
):
    from deepspeed_goldens import universal_dir

    local = universal_dir(case)  # ds_to_universal's own output (tests/goldens/deepspeed/make.py)
    bucket = s3.bucket()
    url = f"s3://{bucket}/runs/{case}-universal"
    s3.put_dir(local, url[5:])
    s3.fs.invalidate_cache()
    sizes = {k: v["size"] for k, v in s3.fs.find(url[5:], detail=True).items() if k.endswith(".pt")}
    assert len(sizes) > 20  # fp32.pt, exp_avg.pt, ... of every parameter, and the states files
    reads = Reads(monkeypatch, (".pt",))
    all_as_local_converts(capsys, url, local, tmp_path)
    # Only latest_universal fetched whole; every .pt by ranges, none on the disk.
    assert [k.rsplit("/", 1)[1] for k in reads.whole] == ["latest_universal"]
    assert set(reads.stand_ins.values()) == {0}
    assert sum(reads.by_object.values()) == reads.requests.bytes <= sum(sizes.values())
    no_leftovers(s3, bucket)


def test_a_flipped_byte_in_a_universal_parameter_file_on_s3_is_exit_3_naming_it(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    from deepspeed_goldens import universal_dir

    src = damage.copy(universal_dir("z2-bf16"), tmp_path / "universal")
    name = "global_step3/zero/fc1.weight/exp_avg.pt"
    flipped = damage.flip_in_torch_file(src / name, "param")
    flip_is_exit_3(s3, capsys, monkeypatch, tmp_path, src, name, flipped, ["latest_universal"])


@pytest.mark.trainers
@pytest.mark.parametrize("safetensors_model", [True, False])
def test_s3_torch_checkpointing_items_are_read_in_place(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
    safetensors_model,
):
    pytest.importorskip("torch_checkpointing")
    import torch_checkpointing_jobs
    from harness import run_ranks

    # The library's own save at 2: the model as model_{rank}.safetensors (or .pt), the optimizer and step as .pt.
    local = tmp_path / "step-2"
    state, _ = run_ranks(torch_checkpointing_jobs.save, 2, str(local), safetensors_model)
    bucket = s3.bucket()
    url = f"s3://{bucket}/tcp/step-2"
    s3.put_dir(local, url[5:])
    sizes = sizes_of(s3, url[5:], (".safetensors", ".pt"))
    model = "model_{}.safetensors" if safetensors_model else "model_{}.pt"
    items = [model.format(r) for r in (0, 1)] + ["optim_0.pt", "optim_1.pt"]
    assert set(items) <= set(sizes)
    reads = Reads(monkeypatch, (".safetensors", ".pt"))
    assert_equal(model_as_local_converts(capsys, url, local, tmp_path), state["model"])
    # Every item by ranges, none on the disk; metadata.pkl alone fetched whole.
    assert [k.rsplit("/", 1)[1] for k in reads.whole] == ["metadata.pkl"]
    assert reads.stand_ins == dict.fromkeys(sizes, 0)

    # All of it (the optimizer's moments too), as the local original converts, byte for byte.
    reads = Reads(monkeypatch, (".safetensors", ".pt"))
    all_as_local_converts(capsys, url, local, tmp_path)
    assert [k.rsplit("/", 1)[1] for k in reads.whole] == ["metadata.pkl"]
    assert reads.requests.bytes <= sum(sizes.values())
    no_leftovers(s3, bucket)


@pytest.mark.trainers
def test_a_flipped_byte_in_a_torch_checkpointing_item_on_s3_is_exit_3_naming_it(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    pytest.importorskip("torch_checkpointing")
    import torch_checkpointing_jobs
    from harness import run_ranks

    local = tmp_path / "step-2"
    run_ranks(torch_checkpointing_jobs.save, 2, str(local), False)
    flipped = damage.flip_in_torch_file(local / "optim_1.pt", "state.fc.weight.exp_avg")
    flip_is_exit_3(
        s3, capsys, monkeypatch, tmp_path, local, "optim_1.pt", flipped, ["metadata.pkl"]
    )


# ------------------------------------- a file every rank filled: one upload, parts from every rank

PART = 16 << 20  # uploads.PART_BYTES: the parts a file larger than it is uploaded in


@pytest.fixture(scope="module")
def two_tensors(tmp_path_factory) -> tuple[Path, dict]:
    """A 40 MiB DCP on the local disk, two tensors of 20 MiB: any full output of it is three parts or more."""
    sd = {
        "model": {
            "a": torch.arange(5 * 2**20, dtype=torch.float32),
            "b": -torch.arange(5 * 2**20, dtype=torch.float32),
        }
    }
    local = tmp_path_factory.mktemp("two") / "ckpt"
    dcp.save(sd, checkpoint_id=local, no_dist=True)
    return local, sd


def convert_sending_parts(src: Path, dst: str, to: dict, damaged: int | None = None) -> list[dict]:
    """Convert ``src`` to ``dst`` on two gloo ranks; return the parts each sent and the uploads each completed."""
    import ranks
    from harness import run_ranks

    env = {
        k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    }
    env["TMPDIR"] = tempfile.gettempdir()
    fn = ranks.convert_sending_parts
    return run_ranks(fn, 2, str(src), dst, "full", to, env, damaged)


def parts_of(size: int) -> int:
    """Return how many parts of 16 MiB a file of ``size`` bytes is uploaded in (fewer than 1,000)."""
    return -(-size // PART)


@pytest.mark.slow
@pytest.mark.parametrize("out", ["model.safetensors", "model.pt", "hf"])
def test_a_file_every_rank_filled_is_one_upload_of_both_ranks_parts_completed_once(
    s3,  # noqa: F811
    two_tensors,
    out,
):
    local, sd = two_tensors
    bucket = s3.bucket()
    dst = f"s3://{bucket}/export/{out}"
    to = {"only": "model"}
    if out == "hf":  # two shards of 20 MiB: data objects, each completed by the rank that opened it
        to |= {"format": "hf", "max_shard_size": 24 << 20}
    got = convert_sending_parts(local, dst, to)
    assert [g["error"] for g in got] == [None, None]
    large = {name: size for name, size in sizes_of(s3, dst[5:], ("",)).items() if size > PART}
    assert len(large) == (2 if out == "hf" else 1)
    # Every part of every large file went once, from one rank or the other, both ranks
    # sent parts of each file, and about as many bytes (within one part).
    every = [(name, n) for name in sorted(large) for n in range(1, parts_of(large[name]) + 1)]
    sent = [[(name or out, n) for name, n in g["sent"]] for g in got]  # "": DST itself
    assert sorted(sent[0] + sent[1]) == every
    for name in large:
        assert {r for r in (0, 1) for sent_name, _ in sent[r] if sent_name == name} == {0, 1}
    nbytes = [sum(min(PART, large[name] - (n - 1) * PART) for name, n in mine) for mine in sent]
    assert abs(nbytes[0] - nbytes[1]) <= PART
    # Each upload completed once, with every part: the single file by rank 0 (its commit),
    # hf's shards each by the rank that opened it.
    done = [(r, name or out, n) for r in (0, 1) for name, n in got[r]["completed"]]
    if out == "hf":
        shards = sorted(large)
        assert sorted(done) == [(0, shards[0], 2), (1, shards[1], 2)]
    else:
        assert done == [(0, out, parts_of(large[out]))]
    if out == "model.safetensors":
        assert_equal(load_safetensors(s3.fs.cat_file(dst[5:])), sd["model"])
    elif out == "model.pt":
        with s3.fs.open(dst[5:]) as f:
            assert_equal(torch.load(f, weights_only=True), sd["model"])
    else:
        index = json.loads(s3.fs.cat_file(f"{dst[5:]}/model.safetensors.index.json"))
        assert sorted(set(index["weight_map"].values())) == sorted(large)
        read = {}
        for shard in large:
            read |= load_safetensors(s3.fs.cat_file(f"{dst[5:]}/{shard}"))
        assert_equal(read, sd["model"])
    no_leftovers(s3, bucket)


@pytest.mark.slow
def test_a_part_one_rank_fails_aborts_the_upload_and_the_rerun_succeeds(s3, two_tensors, capsys):  # noqa: F811
    local, sd = two_tensors
    bucket = s3.bucket()
    dst = f"s3://{bucket}/export/model.safetensors"
    # Rank 1 sends part 2 (from 16 MiB): its bytes change after their CRC-32 was taken, so
    # the store refuses it, and botocore does not send it again itself.
    to = {"only": "model", "storage_options": ("config_kwargs.retries.max_attempts=1",)}
    got = convert_sending_parts(local, dst, to, damaged=PART)
    line = (
        f"'{dst}': writing failed after 2 tries (400 BadDigest): check the endpoint "
        "(AWS_ENDPOINT_URL) and the network, and run again"
    )
    assert got[1]["error"] == ("IOFailure", 4, line)
    assert got[0]["error"] == ("RemoteRankError", 4, f"rank 1 failed: {line}")
    assert [g["completed"] for g in got] == [[], []]
    assert s3.keys(f"{bucket}/export") == [f"{bucket}/export/.model.safetensors.shardckpt-partial"]
    assert s3.open_uploads(bucket) == []  # aborted by the failed run itself
    code, err = cli(capsys, "convert", local, dst, "--to", "full", "--only", "model", "-q")
    assert code == 0, err
    # The failed run marked its marker ended: taken over at once, from any host.
    assert [
        line
        for line in err
        if re.fullmatch(
            r"shardckpt: note: removed what a run that did not finish \(pid \d+ on "
            rf"{re.escape(socket.gethostname())}, since [-0-9: ]+ UTC, ended\) left at "
            rf"'{dst}' \(uncommitted objects and 0 open uploads\)",
            line,
        )
    ]
    s3.fs.invalidate_cache()
    assert_equal(load_safetensors(s3.fs.cat_file(dst[5:])), sd["model"])
    no_leftovers(s3, bucket)


@pytest.mark.slow
def test_a_rank_killed_mid_upload_leaves_no_object_and_the_rerun_succeeds(
    s3,  # noqa: F811
    two_tensors,
    tmp_path,
    capsys,
):
    local, sd = two_tensors
    bucket = s3.bucket()
    dst = f"s3://{bucket}/export/model.pt"
    # Each rank's parts wait 3 s before they go: rank 1 is killed while it holds part 2.
    program = Path(__file__).parents[1] / "slow_parts_cli.py"
    cmd = ["--standalone", "--nproc-per-node=2", str(program), "convert", local, dst]
    cmd += ["--to", "full", "--only", "model", "-q"]
    env = dict(os.environ, OMP_NUM_THREADS="1", SLOW_PARTS_DIR=str(tmp_path))
    proc = warm_cli.start_torchrun(cmd, env=dict(env, SLOW_PARTS_DELAY="3"))
    uploading(proc, lambda: (tmp_path / "parts-1").exists() and (tmp_path / "parts-0").exists())
    assert (tmp_path / "parts-1").read_text() == " 2\n"  # "": DST itself, part 2 of 3
    assert s3.open_uploads(bucket) == ["export/model.pt"]  # one upload, both ranks' parts
    os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGKILL)
    _, err = proc.communicate(120)
    assert proc.returncode != 0, err
    s3.fs.invalidate_cache()
    assert not s3.fs.exists(dst[5:])  # never completed
    code, err = cli(capsys, "convert", local, dst, "--to", "full", "--only", "model", "-q")
    assert code == 0, err
    s3.fs.invalidate_cache()
    with s3.fs.open(dst[5:]) as f:
        assert_equal(torch.load(f, weights_only=True), sd["model"])


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_s3_verl_model_files_are_read_in_place_and_its_other_files_fetched(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
    kind,
):
    from verl_models import GOLDENS, WRAP

    local = GOLDENS / kind / "global_step_2"  # veRL's own save at 2 (tests/goldens/verl/make.py)
    full = torch.load(GOLDENS / kind / "reference.pt", weights_only=True)
    bucket = s3.bucket()
    url = f"s3://{bucket}/verl/{kind}/global_step_2"
    s3.put_dir(local, url[5:])
    models = sizes_of(s3, url[5:], (".pt",))
    models = {k: v for k, v in models.items() if k.startswith("model_")}
    assert sorted(models) == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    optims = [f"optim_world_size_2_rank_{r}.pt" for r in (0, 1)]
    reads = Reads(monkeypatch, (*models, *optims))
    model = model_as_local_converts(capsys, url, local, tmp_path)
    assert_equal(model, {k: v for k, v in full["model"].items() if k in model})
    assert sorted(model) == sorted(full["model"])
    # The model and optimizer files by ranges, none on the disk; the extra_state files fetched.
    assert sorted(k.rsplit("/", 1)[1] for k in reads.whole if k.endswith(".pt")) == [
        f"extra_state_world_size_2_rank_{r}.pt" for r in (0, 1)
    ]
    assert reads.stand_ins == dict.fromkeys([*models, *optims], 0)
    # All of it, the optimizer's state too, as the local original converts, byte for byte.
    flat = ["--model", "verl_models:qwen2", "--wrap", WRAP] if kind == "fsdp1" else []
    reads = Reads(monkeypatch, (*models, *optims))
    all_as_local_converts(capsys, url, local, tmp_path, *flat)
    assert not [k for k in reads.whole if k.endswith(tuple(optims))]
    assert reads.stand_ins == dict.fromkeys([*models, *optims], 0)
    no_leftovers(s3, bucket)


@pytest.mark.parametrize(
    ("kind", "name", "tensor"),
    [
        ("fsdp2", "model_world_size_2_rank_1.pt", "mlp.up_proj.weight"),
        ("fsdp2", "optim_world_size_2_rank_1.pt", "exp_avg"),
        ("fsdp1", "optim_world_size_2_rank_1.pt", "exp_avg_sq"),
    ],
)
def test_a_flipped_byte_in_a_verl_model_or_optimizer_file_on_s3_is_exit_3_naming_it(
    s3,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
    kind,
    name,
    tensor,
):
    from verl_models import GOLDENS, WRAP

    local = damage.copy(GOLDENS / kind / "global_step_2", tmp_path / "global_step_2")
    key = next(k for k in damage.storages(local / name) if k.endswith(tensor))
    flipped = damage.flip_in_torch_file(local / name, key)
    bucket = s3.bucket()
    url = f"s3://{bucket}/verl/global_step_2"
    s3.put_dir(local, url[5:])
    flat = ["--model", "verl_models:qwen2", "--wrap", WRAP] if kind == "fsdp1" else []
    argvs = (["verify", url], ["convert", url, tmp_path / "out.safetensors", "--to", "full", *flat])
    for argv in argvs:
        reads = Reads(monkeypatch, (name,))
        code, err = cli(capsys, *argv)
        assert code == 3  # after convert's note on the files a veRL DST carries
        assert err[-1] == f"shardckpt: error: '{url}/{name}': {flipped.message()}: {damage.RECOPY}"
        assert all(line.startswith("shardckpt: note:") for line in err[:-1])
        assert not [k for k in reads.whole if k.endswith(name)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2"]
    no_leftovers(s3, bucket)


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory) -> Path:
    """A transformers Trainer's own ``checkpoint-2/`` (``tests/trainer_saves.py``)."""
    import trainer_saves

    return trainer_saves.save("trainer", tmp_path_factory.mktemp("trainer") / "checkpoint-2")


@pytest.fixture(scope="module")
def accelerate_state(tmp_path_factory) -> Path:
    """A directory ``Accelerator.save_state`` wrote (``tests/trainer_saves.py``)."""
    import trainer_saves

    return trainer_saves.save("accelerate", tmp_path_factory.mktemp("accelerate") / "state")


def uploaded(s3: S3, local: Path) -> str:  # noqa: F811
    """Return the URL of the directory ``local`` uploaded to a new bucket (``run/<its name>``)."""
    url = f"s3://{s3.bucket()}/run/{local.name}"
    s3.put_dir(local, url[5:])
    return url


def flipped_on_s3(s3: S3, src: Path, tmp_path: Path, file: str, tensor: str):  # noqa: F811
    """Return the URL of a copy of directory ``src`` uploaded with a byte flipped in ``tensor`` of ``file``, and the flip."""
    local = damage.copy(src, tmp_path / src.name)
    flipped = damage.flip_in_torch_file(local / file, tensor)
    return uploaded(s3, local), flipped


@pytest.fixture(scope="module")
def fsdp_trainer_checkpoint(tmp_path_factory) -> Path:
    """A transformers Trainer's own ``checkpoint-2/`` under FSDP2 with full state dicts (``tests/trainer_saves.py``)."""
    import trainer_saves

    dst = tmp_path_factory.mktemp("trainer-fsdp") / "checkpoint-2"
    return trainer_saves.save("trainer-fsdp", dst)


TRAINER_DATA = {
    "trainer_checkpoint": ("model.safetensors", "optimizer.pt"),
    # Under FSDP with full state dicts: optimizer.bin and FSDP's copy of the model, and no
    # random_states_R.pkl (it is no save_state's).
    "fsdp_trainer_checkpoint": ("model.safetensors", "optimizer.bin", "pytorch_model_fsdp.bin"),
}


@pytest.mark.parametrize("saved", TRAINER_DATA)
def test_s3_trainer_checkpoint_reads_its_weights_in_place_and_never_its_optimizer(
    s3,  # noqa: F811
    saved,
    request,
    tmp_path,
    capsys,
    monkeypatch,
):
    from safetensors.torch import load_file

    local, data = request.getfixturevalue(saved), TRAINER_DATA[saved]
    url = uploaded(s3, local)
    bucket = url[5:].split("/")[0]
    sizes = sizes_of(s3, url[5:], data)
    # Adam's state is twice the model; each spans several ranged GETs.
    assert sizes[data[1]] > 2 * sizes["model.safetensors"] > 4 * remote_files.PART
    assert min(sizes.values()) > 2 * remote_files.PART

    reads = Reads(monkeypatch, data)
    model = model_as_local_converts(capsys, url, local, tmp_path)
    assert_equal(model, load_file(local / "model.safetensors"))
    # The weights by ranges (each byte about once), the optimizer state and FSDP's copy of
    # the model (the hf reader carries them unread) not at all, nothing on the disk; the
    # Trainer's small files fetched.
    assert sorted(k.rsplit("/", 1)[1] for k in reads.whole) == [
        "config.json",
        "generation_config.json",
        "rng_state.pth",
        "scheduler.pt",
        "trainer_state.json",
        "training_args.bin",
    ]
    assert reads.stand_ins == dict.fromkeys(data, 0)
    assert list(reads.by_object) == ["model.safetensors"]
    # Beyond the weights: the header's block, and one 256 KiB block for each small tensor
    # read on its own (the 5 norms).
    model_size = sizes["model.safetensors"]
    assert model_size <= reads.by_object["model.safetensors"] <= model_size + 8 * (256 << 10)

    # inspect: the header's block of the weights, nothing of the optimizer.
    reads = Reads(monkeypatch, data)
    code = run(["inspect", url])
    out = capsys.readouterr().out
    assert code == 0
    assert f"  {data[1]}: carried unread, a transformers Trainer's state, not model weights" in out
    assert reads.by_object == {"model.safetensors": 256 << 10}

    # verify reads every byte, the optimizer's too (its records' CRC-32s), by ranges,
    # about once: a zip's local headers are asked for together, each its few bytes (not a
    # 256 KiB block around each: optimizer.pt's 63 records cost 7.6 MB beyond its 17.9 MB).
    reads = Reads(monkeypatch, data)
    assert cli(capsys, "verify", url) == (0, [])
    assert not [k for k in reads.whole if k.endswith(data)]
    # Beyond the bytes: a few 256 KiB blocks (a safetensors header; a zip's directory and pickle).
    for name, size in sizes.items():
        assert size <= reads.by_object[name] <= size + 3 * (256 << 10)
    no_leftovers(s3, bucket)


@pytest.mark.parametrize(
    ("saved", "tensor"),
    [
        ("trainer_checkpoint", "state.1.exp_avg"),
        ("fsdp_trainer_checkpoint", "state.model.layers.0.self_attn.q_proj.weight.exp_avg"),
    ],
)
def test_a_flipped_byte_in_a_trainers_optimizer_on_s3_is_exit_3_for_verify_naming_it(
    s3,  # noqa: F811
    saved,
    tensor,
    request,
    tmp_path,
    capsys,
    monkeypatch,
):
    data = TRAINER_DATA[saved]
    url, flipped = flipped_on_s3(s3, request.getfixturevalue(saved), tmp_path, data[1], tensor)
    reads = Reads(monkeypatch, data)
    code, err = cli(capsys, "verify", url)
    # The hf reader carries it unread: its records are checked, no tensor named.
    said = f"the bytes do not match the checksum written with them ({flipped.where})"
    assert (code, err) == (3, [f"shardckpt: error: '{url}/{data[1]}': {said}: {damage.RECOPY}"])
    assert not [k for k in reads.whole if k.endswith(data)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    no_leftovers(s3, url[5:].split("/")[0])


def test_s3_trainer_checkpoint_read_as_accelerate_copies_its_optimizer_from_the_store(
    s3,  # noqa: F811
    trainer_checkpoint,
    tmp_path,
    capsys,
):
    # --from accelerate carries optimizer.pt and copies it into DST: from the store,
    # through its stand-in, byte for byte.
    local = trainer_checkpoint
    url = uploaded(s3, local)
    bucket = url[5:].split("/")[0]
    out = tmp_path / "out"
    argv = ["convert", url, out, "--from", "accelerate", "--to", "sharded", "--world-size", 2]
    code, err = cli(capsys, *argv, "--format", "accelerate", "-q")
    assert code == 0, err
    for name in ("optimizer.pt", "rng_state.pth", "trainer_state.json"):
        assert (out / name).read_bytes() == (local / name).read_bytes()
    no_leftovers(s3, bucket)


ACCELERATE_DATA = ("model.safetensors", "optimizer.bin")


def test_s3_accelerate_state_reads_its_model_and_optimizer_in_place(
    s3,  # noqa: F811
    accelerate_state,
    tmp_path,
    capsys,
    monkeypatch,
):
    from safetensors.torch import load_file

    local = accelerate_state
    url = uploaded(s3, local)
    bucket = url[5:].split("/")[0]
    sizes = sizes_of(s3, url[5:], ACCELERATE_DATA)
    assert sizes["optimizer.bin"] > 2 * sizes["model.safetensors"] > 2 * remote_files.PART

    reads = Reads(monkeypatch, ACCELERATE_DATA)
    out = all_as_local_converts(capsys, url, local, tmp_path)
    got = torch.load(out, weights_only=True)
    assert_equal(got["model"], load_file(local / "model.safetensors"))
    assert_equal(got["optimizer"], torch.load(local / "optimizer.bin", weights_only=True))
    assert_equal(got["scheduler"], torch.load(local / "scheduler.bin", weights_only=True))
    assert sorted(k.rsplit("/", 1)[1] for k in reads.whole) == [
        "random_states_0.pkl",
        "scheduler.bin",
    ]
    assert reads.stand_ins == dict.fromkeys(ACCELERATE_DATA, 0)
    # Each byte about once, beyond it the header's blocks and one 256 KiB block for each
    # small tensor read on its own (steps, biases).
    for name, size in sizes.items():
        assert size <= reads.by_object[name] <= size + 8 * (256 << 10)
    no_leftovers(s3, bucket)


def test_a_flipped_byte_in_an_accelerate_optimizer_on_s3_is_exit_3_naming_it(
    s3,  # noqa: F811
    accelerate_state,
    tmp_path,
    capsys,
    monkeypatch,
):
    url, flipped = flipped_on_s3(s3, accelerate_state, tmp_path, "optimizer.bin", "state.2.exp_avg")
    argvs = (["verify", url], ["convert", url, tmp_path / "out.pt", "--to", "full"])
    for argv in argvs:
        reads = Reads(monkeypatch, ACCELERATE_DATA)
        code, err = cli(capsys, *argv)
        assert code == 3
        line = f"shardckpt: error: '{url}/optimizer.bin': {flipped.message()}: {damage.RECOPY}"
        assert err[-1] == line
        assert all(e.startswith("shardckpt: note:") for e in err[:-1])
        assert not [k for k in reads.whole if k.endswith(ACCELERATE_DATA)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
    no_leftovers(s3, url[5:].split("/")[0])
