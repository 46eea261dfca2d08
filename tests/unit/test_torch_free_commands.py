"""``inspect`` and ``verify`` of DCP, safetensors and hf sources import no torch, and print what they did.

Each source is written by the real library (``torch.distributed.checkpoint.save``, in
both its serializations; ``safetensors``' ``save_file``). The commands run in a fresh interpreter, once as a user's
shell starts them (nothing imported) and once with torch imported first, the way every
command ran before; the two must print the same (but for timings) and exit alike, and
the first must end with no ``torch`` in ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from test_hf import write_hf_like_transformers
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat

RUN = textwrap.dedent(
    """
    import contextlib, io, json, sys
    if sys.argv[1] == "torch":
        import torch
    from shardckpt.cli.app import run
    done = []
    for argv in json.loads(sys.argv[2]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run(argv)
        done.append([code, out.getvalue(), err.getvalue(), "torch" in sys.modules])
    print(json.dumps(done))
    """
)

# What differs from one run to the next: how long reading took.
TIMES = re.compile(
    r'("(?:read_)?seconds": )[0-9.]+|read in [0-9.]+ s at [0-9.]+ [KMG]?i?B/s, [0-9.]+ s in all'
)


def run(argv_list: list[list[str]], first: str) -> list[list]:
    """Return [exit code, stdout, stderr, torch imported] of each command, run one after another."""
    done = subprocess.run(
        [sys.executable, "-c", RUN, first, json.dumps(argv_list)],
        capture_output=True,
        text=True,
        check=True,
    )
    return [
        [c, TIMES.sub(r"\1", o), TIMES.sub(r"\1", e), t] for c, o, e, t in json.loads(done.stdout)
    ]


def tree() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(9, 4, generator=g),
            "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
            "ids": torch.arange(5, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
        },
        "optim": {
            "state": {"embed.weight": {"step": 3, "exp_avg": torch.randn(9, 4, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["embed.weight"]}],
        },
        "epoch": 7,
        "name": "run-1",
    }


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sources")
    dcp.save(tree(), checkpoint_id=root / "dcp", no_dist=True)
    # torch's other DCP serialization: the tensors of each file in one safetensors blob.
    safetensors_dcp = FileSystemWriter(
        root / "dcp-safetensors", serialization_format=SerializationFormat.SAFETENSORS
    )
    dcp.save(tree(), storage_writer=safetensors_dcp, no_dist=True)
    model = {k: v.contiguous() for k, v in tree()["model"].items()}
    save_file(model, root / "model.safetensors")
    write_hf_like_transformers(root / "hf", model, per_shard=2)
    names = ("dcp", "dcp-safetensors", "model.safetensors", "hf")
    return {name: str(root / name) for name in names}


COMMANDS = (
    ["inspect"],
    ["inspect", "--json"],
    ["inspect", "--shards"],
    ["inspect", "--verify"],
    ["verify"],
    ["verify", "--json"],
)


@pytest.mark.launches
def test_inspect_and_verify_import_no_torch_and_print_what_they_printed_with_it(sources):
    argv_list = [[cmd[0], src, *cmd[1:]] for src in sources.values() for cmd in COMMANDS]
    alone, after_torch = run(argv_list, "nothing"), run(argv_list, "torch")
    for argv, mine, before in zip(argv_list, alone, after_torch):
        assert mine[0] == 0, (argv, mine)
        assert mine[:3] == before[:3], argv
        assert mine[3] is False, f"{argv} imported torch"
    # The outputs say what the sources hold, not only that both runs agree.
    by_argv = {" ".join(a): m for a, m in zip(argv_list, alone)}
    listing = json.loads(by_argv[f"inspect {sources['dcp']} --json"][1])
    assert "bfloat16" in json.dumps(listing) and "run-1" in json.dumps(listing)
    assert by_argv[f"verify {sources['hf']}"][1].startswith(f"intact: {sources['hf']} (hf, 3 files")


@pytest.mark.launches
def test_a_damaged_dcp_is_refused_alike_without_torch(sources, tmp_path):
    # The same one line and exit code whether torch was imported or not: a byte of a
    # data file changed under its CRC-32 (found without torch), and a .metadata cut
    # short (read again with torch's classes, which word the error as they always did).
    flipped, cut, hostile = tmp_path / "flipped", tmp_path / "cut", tmp_path / "hostile"
    for copy in (flipped, cut, hostile):
        subprocess.run(["cp", "-r", sources["dcp"], copy], check=True)
    (hostile / ".metadata").write_bytes(pickle.dumps(os.system))
    data = flipped / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    at = raw.find(tree()["model"]["embed.weight"].numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    meta = cut / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-40])
    argv_list = [
        ["verify", str(flipped)],
        ["inspect", str(cut)],
        ["verify", str(cut)],
        ["inspect", str(hostile)],
    ]
    alone, after_torch = run(argv_list, "nothing"), run(argv_list, "torch")
    assert [m[:3] for m in alone] == [b[:3] for b in after_torch]
    assert [m[0] for m in alone] == [3, 3, 3, 3]
    assert alone[0][2].startswith(f"shardckpt: error: '{data}': ")
    assert alone[1][2].startswith(f"shardckpt: error: '{meta}': ")
    assert alone[3][2].startswith(
        f"shardckpt: error: '{hostile / '.metadata'}': metadata references posix.system"
    )
    assert alone[0][3] is False


@pytest.mark.launches
def test_a_value_that_is_not_plain_python_is_read_by_torch(tmp_path):
    # A value whose pickle names a global (a torch.Size) is left to DCP's own loader,
    # which imports torch: same listing as with torch imported first.
    dcp.save(
        {"w": torch.ones(2), "shape": torch.Size([2, 3])}, checkpoint_id=tmp_path, no_dist=True
    )
    argv_list = [["inspect", str(tmp_path), "--json"]]
    (alone,), (before,) = run(argv_list, "nothing"), run(argv_list, "torch")
    assert alone[:3] == before[:3] and alone[0] == 0
    assert alone[3] is True


def test_the_dtypes_named_without_torch_are_torch_s():
    from shardckpt.state.dtypes import ALIASES, KNOWN

    for name, dtype in KNOWN.items():
        real = getattr(torch, name)
        assert (str(dtype), dtype.itemsize) == (str(real), real.itemsize)
        assert (dtype.is_floating_point, dtype.is_complex) == (
            real.is_floating_point,
            real.is_complex,
        )
    for alias, name in ALIASES.items():
        assert getattr(torch, alias) is getattr(torch, name)


def test_rows_split_without_torch_as_torch_splits_them():
    from torch.distributed.tensor import Shard

    from shardckpt.state.regions import chunk_rows

    for rows in range(0, 40):
        for world_size in range(1, 12):
            for rank in range(world_size):
                size, offset = Shard.local_shard_size_and_offset(rows, world_size, rank)
                assert chunk_rows(rows, world_size, rank) == (offset, offset + size)


def test_the_legacy_magic_number_is_torch_s():
    from torch.serialization import MAGIC_NUMBER

    from shardckpt.codecs.pickle_scan import MAGIC_NUMBER as ours

    assert ours == MAGIC_NUMBER
