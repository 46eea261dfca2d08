"""Every bad input gets one line naming the file and the fix, and its exit code (SPEC)."""

from __future__ import annotations

import fractions
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.cli.app import run


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.fixture
def small(tmp_path):
    sd = {"model": {"w": torch.arange(21.0).reshape(7, 3)}, "epoch": 1}
    torch.save(sd, tmp_path / "small.pt")
    dcp.save(sd, checkpoint_id=tmp_path / "small-dcp", no_dist=True)
    return tmp_path


def error_of(capsys, argv):
    code = run([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_missing_source(capsys, tmp_path):
    assert error_of(capsys, ["inspect", tmp_path / "nope"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'nope'}': no such file or directory: check the path of the checkpoint",
    )


def test_directory_without_metadata(capsys, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "__0_0.distcp").write_bytes(b"x")
    assert error_of(capsys, ["inspect", tmp_path / "d"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'd'}': has *.distcp files but no '.metadata': "
        "the DCP save did not finish; use a checkpoint whose save completed",
    )


def test_empty_directory(capsys, tmp_path):
    assert error_of(capsys, ["convert", tmp_path, tmp_path.parent / "o.pt", "--to", "full"])[0] == 3


def test_truncated_torch_file_is_damaged_not_unsafe(capsys, small):
    data = (small / "small.pt").read_bytes()
    (small / "cut.pt").write_bytes(data[: len(data) // 2])
    assert error_of(capsys, ["inspect", small / "cut.pt"]) == (
        3,
        f"shardckpt: error: '{small / 'cut.pt'}': is a damaged torch.save file "
        "(zip: File is not a zip file): re-copy it from where it was written",
    )


def test_a_file_in_another_format_is_not_called_damaged(capsys, small):
    (small / "plain.pt").write_bytes(pickle.dumps({"a": 1}, protocol=2))
    assert error_of(capsys, ["inspect", small / "plain.pt", "--from", "torch"]) == (
        3,
        f"shardckpt: error: '{small / 'plain.pt'}': not a readable torch.save file "
        "(RuntimeError: Invalid magic number; corrupt file?): the file is truncated or in another "
        "format; name its format with --from",
    )


def test_truncated_safetensors_file(capsys, small):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(100)}, small / "t.safetensors")
    data = (small / "t.safetensors").read_bytes()
    (small / "t.safetensors").write_bytes(data[:-50])
    code, line = error_of(capsys, ["inspect", small / "t.safetensors"])
    assert code == 3 and "not a readable safetensors file" in line and line.count("\n") == 0


def test_unknown_file(capsys, small):
    (small / "notes.txt").write_text("hello")
    assert error_of(capsys, ["inspect", small / "notes.txt"]) == (
        3,
        f"shardckpt: error: '{small / 'notes.txt'}': is a text file, not a checkpoint: pass a "
        "checkpoint file (.pt, .bin, .safetensors) or directory (DCP, per-rank files, a "
        "trainer's), or --from FORMAT for one whose format is not detected",
    )


def test_empty_file(capsys, small):
    (small / "empty.pt").write_bytes(b"")
    assert error_of(capsys, ["inspect", small / "empty.pt"]) == (
        3,
        f"shardckpt: error: '{small / 'empty.pt'}': is empty: the file was not written completely; re-create it",
    )


def test_missing_data_file(capsys, small):
    os.remove(small / "small-dcp" / "__0_0.distcp")
    assert error_of(capsys, ["inspect", small / "small-dcp"]) == (
        3,
        f"shardckpt: error: '{small / 'small-dcp'}': missing data file '__0_0.distcp' named by .metadata: "
        "copy every *.distcp file of the checkpoint",
    )


def test_corrupt_data_file_leaves_no_destination(capsys, small):
    path = small / "small-dcp" / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:10])
    code, line = error_of(
        capsys, ["convert", small / "small-dcp", small / "out.pt", "--to", "full"]
    )
    assert code == 3 and f"'{path}': truncated: 'epoch' is stored at bytes 0..1261" in line
    assert not (small / "out.pt").exists() and not (small / ".out.pt.shardckpt-partial").exists()


def test_existing_destination_needs_overwrite(capsys, small):
    # An earlier output: --overwrite replaces only what reads as a checkpoint (test_overwrite.py).
    torch.save({"w": torch.zeros(2)}, small / "out.pt")
    kept = (small / "out.pt").read_bytes()
    assert error_of(capsys, ["convert", small / "small.pt", small / "out.pt", "--to", "full"]) == (
        5,
        f"shardckpt: error: '{small / 'out.pt'}': already exists: pass --overwrite to replace it",
    )
    assert (small / "out.pt").read_bytes() == kept
    assert (
        run(
            [
                "convert",
                str(small / "small.pt"),
                str(small / "out.pt"),
                "--to",
                "full",
                "--overwrite",
            ]
        )
        == 0
    )
    assert torch.equal(torch.load(small / "out.pt")["model"]["w"], torch.arange(21.0).reshape(7, 3))


def test_destination_inside_source_is_refused(capsys, small):
    assert error_of(
        capsys,
        [
            "convert",
            small / "small-dcp",
            small / "small-dcp" / "x",
            "--to",
            "sharded",
            "--world-size",
            "1",
        ],
    ) == (
        2,
        f"shardckpt: error: '{small / 'small-dcp' / 'x'}': DST is SRC or inside it: "
        "write the conversion somewhere else; SRC is never modified",
    )


def test_format_and_layout_must_agree(capsys, small):
    assert error_of(
        capsys, ["convert", small / "small.pt", small / "o", "--to", "sharded", "--format", "torch"]
    ) == (
        2,
        "shardckpt: error: --format torch is a full layout, not sharded: pass --to full, or a sharded format",
    )


def test_unknown_option_is_a_usage_error(capsys, small):
    assert run(["inspect", str(small / "small.pt"), "--bogus"]) == 2


@pytest.mark.parametrize("world_size", ["0", "-2"])
def test_world_size_below_one_is_a_usage_error(capsys, small, world_size):
    assert error_of(
        capsys,
        ["convert", small / "small.pt", small / "o", "--to", "sharded", "--world-size", world_size],
    ) == (
        2,
        f"shardckpt: error: --world-size must be at least 1, not {world_size}: "
        "pass the number of ranks that will load the output",
    )
    assert not (small / "o").exists()


def test_pickle_that_runs_code_is_refused_in_a_torch_file(capsys, small):
    torch.save({"w": torch.ones(1), "evil": Evil()}, small / "evil.pt")
    code, line = error_of(capsys, ["inspect", small / "evil.pt"])
    assert code == 3
    assert line == (
        f"shardckpt: error: '{small / 'evil.pt'}': refused to unpickle (names posix.system, "
        "not on the weights-only allow-list): pass --trust-pickle only if you trust this file"
    )


def test_pickle_that_runs_code_is_refused_in_dcp_metadata(capsys, small):
    md = small / "small-dcp" / ".metadata"
    md.write_bytes(pickle.dumps(Evil()))
    assert error_of(capsys, ["inspect", small / "small-dcp"]) == (
        3,
        f"shardckpt: error: '{md}': metadata references posix.system, which DCP metadata never holds: "
        "pass --trust-pickle only if you trust this file",
    )


def test_pickle_that_runs_code_is_refused_in_a_dcp_value(capsys, small):
    dcp.save({"w": torch.ones(2), "evil": Evil()}, checkpoint_id=small / "evil-dcp", no_dist=True)
    assert error_of(capsys, ["inspect", small / "evil-dcp"]) == (
        3,
        f"shardckpt: error: '{small / 'evil-dcp' / '__0_0.distcp'}': refused to unpickle value "
        "'evil' (names posix.system, not on the weights-only allow-list): "
        "pass --trust-pickle only if you trust this file",
    )


def test_trust_pickle_opts_out(capsys, small):
    torch.save({"w": torch.ones(1), "ratio": fractions.Fraction(1, 3)}, small / "frac.pt")
    assert run(["inspect", str(small / "frac.pt")]) == 3
    assert run(["inspect", str(small / "frac.pt"), "--trust-pickle"]) == 0


def test_dry_run_writes_nothing(capsys, small):
    assert (
        run(["convert", str(small / "small.pt"), str(small / "o.pt"), "--to", "full", "--dry-run"])
        == 0
    )
    assert "would write" in capsys.readouterr().out and not (small / "o.pt").exists()


def test_bad_size_is_a_usage_error(capsys, small):
    assert error_of(
        capsys,
        ["convert", small / "small.pt", small / "o.pt", "--to", "full", "--buffer-size", "lots"],
    ) == (
        2,
        "shardckpt: error: --buffer-size 'lots' is not a size: write it like 512MB, 2GiB or 1000000",
    )


def test_a_file_whose_top_level_is_not_a_dict(capsys, tmp_path):
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    assert error_of(capsys, ["inspect", tmp_path / "list.pt"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'list.pt'}': holds a list, not a state dict: "
        "shardckpt reads files whose top level is a dict",
    )


@pytest.mark.parametrize("fmt", ["fsdp2-ranks", "fsdp1-sharded"])
def test_a_rank_file_whose_top_level_is_not_a_dict(capsys, tmp_path, fmt):
    (tmp_path / "ranks").mkdir()
    torch.save([torch.ones(2)], tmp_path / "ranks" / "rank_0.pt")
    assert error_of(capsys, ["inspect", tmp_path / "ranks", "--from", fmt]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'ranks' / 'rank_0.pt'}': holds a list, not a state dict: "
        "shardckpt reads files whose top level is a dict",
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{fifo}"],
        ["inspect", "{fifo}", "--from", "torch"],
        ["inspect", "{fifo}", "--from", "safetensors"],
        ["convert", "{fifo}", "{out}", "--to", "full"],
        ["convert", "{fifo}", "{out}", "--to", "full", "--from", "torch"],
        ["diff", "{fifo}", "{fifo}"],
    ],
)
def test_a_fifo_as_src_is_refused_instead_of_blocking_on_open(capsys, tmp_path, argv):
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    argv = [a.format(fifo=fifo, out=tmp_path / "out.pt") for a in argv]
    assert error_of(capsys, argv) == (
        3,
        f"shardckpt: error: '{fifo}': is a FIFO (named pipe), not a regular file: copy the "
        "checkpoint into a regular file first; shardckpt does not read pipes or devices",
    )
    assert not (tmp_path / "out.pt").exists()


def test_a_symlink_loop_as_src_is_named_as_one(capsys, tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert error_of(capsys, ["convert", tmp_path / "a", tmp_path / "o.pt", "--to", "full"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'a'}': is a symlink loop: point the symlink at the "
        "checkpoint itself",
    )


# ---------------------------------------------------------------- real adverse conditions


def _hf_dir(path):
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"w": torch.ones(4)}, path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "model-00001-of-00001.safetensors"}}'
    )
    return path / "model-00001-of-00001.safetensors"


@pytest.mark.launches
@pytest.mark.parametrize("fmt", ["torch", "safetensors", "hf"])
def test_an_unreadable_source_says_permission_denied(fmt):
    from conditions import public_dir, run_unprivileged
    from safetensors.torch import save_file

    with public_dir() as where:
        if fmt == "torch":
            src = unreadable = where / "x.pt"
            torch.save({"w": torch.ones(2)}, src)
        elif fmt == "safetensors":
            src = unreadable = where / "x.safetensors"
            save_file({"w": torch.ones(2)}, src)
        else:
            src, unreadable = where / "hf", _hf_dir(where / "hf")
            src.chmod(0o755)
        unreadable.chmod(0o600)
        proc = run_unprivileged(["convert", src, where / "o.pt", "--to", "full"], cwd=where)
        assert (proc.returncode, proc.stderr.splitlines()) == (
            4,
            [
                f"shardckpt: error: '{unreadable}': permission denied: check the file's "
                "permissions; shardckpt needs to read it"
            ],
        )


@pytest.mark.launches
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["torch", "safetensors", "hf"])
def test_a_full_disk_while_writing_a_full_output_is_one_line_and_leaves_nothing(
    capsys, tmp_path, fmt
):
    from conditions import tiny_disk

    torch.save({"model": {f"w{i}": torch.randn(128, 128) for i in range(8)}}, tmp_path / "s.pt")
    with tiny_disk("256k") as disk:
        dst = disk / ("out" if fmt == "hf" else f"out.{'pt' if fmt == 'torch' else fmt}")
        code, line = error_of(
            capsys, ["convert", tmp_path / "s.pt", dst, "--to", "full", "--format", fmt]
        )
        assert code == 4, line
        partial = disk / f".{dst.name}.shardckpt-partial"
        written = partial / "model-00001-of-00001.safetensors" if fmt == "hf" else partial
        assert line == (
            f"shardckpt: error: '{written}': No space left on device while writing: free some "
            "space, or write DST on another filesystem"
        )
        assert list(disk.iterdir()) == []


def test_a_tuple_holding_tensors_is_refused_before_anything_is_written(capsys, tmp_path):
    torch.save({"w": torch.ones(2), "pair": (torch.ones(1), torch.zeros(1))}, tmp_path / "t.pt")
    assert error_of(capsys, ["convert", tmp_path / "t.pt", tmp_path / "o.pt", "--to", "full"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 't.pt'}': 'pair' is a tuple holding tensors, which "
        "shardckpt cannot carry: keep tensors in dicts and lists, or leave this out with "
        "--filter/--only",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.pt"]


def test_a_safetensors_tree_nested_thousands_deep_is_one_line(capsys, tmp_path):
    from safetensors.torch import save_file

    deep = '{"dict": [["a", ' * 5000 + '{"value": 1}' + "]]}" * 5000
    save_file({"w": torch.ones(1)}, tmp_path / "d.safetensors", {"shardckpt": deep})
    assert error_of(capsys, ["inspect", tmp_path / "d.safetensors"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'd.safetensors'}': its tree of dicts and lists is nested "
        "too deeply to walk: shardckpt reads trees a few hundred levels deep; this one was not "
        "written by a training job",
    )


class _PythonPickle:
    """``pickle`` with its pure-Python pickler, for ``torch.save(pickle_module=)``."""

    Pickler = pickle._Pickler


def test_a_torch_tree_nested_thousands_deep_is_one_line(capsys, tmp_path):
    import sys

    tree: dict = {"w": torch.ones(1)}
    for _ in range(5000):
        tree = {"a": tree}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)  # only pickling it needs the room; reading must not
    try:
        # Pickled in Python: from 3.12 the C pickler stops at its own depth, whatever the limit.
        torch.save(tree, tmp_path / "d.pt", pickle_module=_PythonPickle)
    finally:
        sys.setrecursionlimit(limit)
    assert error_of(capsys, ["inspect", tmp_path / "d.pt"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'd.pt'}': its tree of dicts and lists is nested "
        "too deeply to walk: shardckpt reads trees a few hundred levels deep; this one was not "
        "written by a training job",
    )
