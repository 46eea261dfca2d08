"""``inspect`` and ``verify`` of DCP, torch.save, safetensors and hf sources import no torch, and print what they did.

Each source is written by the real library (``torch.distributed.checkpoint.save``, in
both its serializations; ``torch.save``; ``safetensors``' ``save_file``). The commands run in a fresh interpreter, once as a user's
shell starts them (nothing imported) and once with torch imported first, the way every
command ran before; the two must print the same (but for timings) and exit alike, and
the first must end with no ``torch`` in ``sys.modules``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from damage import flip_in_torch_file
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


def torch_save_tree() -> dict:
    """``tree()`` as a training script saves it, with what torch.save pickles otherwise.

    A module's ``state_dict()`` (an OrderedDict with ``_metadata``), a parameter, a
    transposed view and a slice of one storage, a float8 tensor (an ``UntypedStorage``
    with its dtype) and a list of tensors.
    """
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 4, generator=g)
    out = tree()
    out["model"].update({"base.T": base.t(), "base.rows": base[2:4]})
    out["linear"] = torch.nn.Linear(3, 2).state_dict()
    out["scale"] = torch.nn.Parameter(torch.ones(2))
    out["fp8"] = torch.zeros(3, dtype=torch.float8_e4m3fn)
    out["buffers"] = [torch.ones(2, dtype=torch.float16), torch.zeros(1, dtype=torch.uint16)]
    return out


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
    torch.save(torch_save_tree(), root / "model.pt")
    names = ("dcp", "dcp-safetensors", "model.safetensors", "hf", "model.pt")
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
    listing = by_argv[f"inspect {sources['model.pt']}"][1]
    for line in ("model.base.T     4x6", "model.norm.weight  4", "fp8  ", "linear.bias", "run-1"):
        assert line.split()[0] in listing, line
    assert "bfloat16" in listing and "float8_e4m3fn" in listing
    # Every record checked against its CRC-32 (base.T and base.rows share one), data.pkl too.
    records = len(zipfile.ZipFile(sources["model.pt"]).namelist())
    checked = by_argv[f"verify {sources['model.pt']} --json"][1]
    assert '"intact": true, "files": 1, ' in checked and f'"checked": {records}, ' in checked


def flip_embed(dcp_dir: Path) -> Path:
    """Flip a byte of ``embed.weight``'s data in the DCP save of ``tree()`` at ``dcp_dir``; return its file."""
    data = dcp_dir / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    at = raw.find(tree()["model"]["embed.weight"].numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    return data


@pytest.mark.launches
def test_a_damaged_dcp_is_refused_alike_without_torch(sources, tmp_path):
    # The same one line and exit code whether torch was imported or not: a byte of a
    # data file changed under its CRC-32 (found without torch), and a .metadata cut
    # short (read again with torch's classes, which word the error as they always did).
    flipped, cut, hostile = tmp_path / "flipped", tmp_path / "cut", tmp_path / "hostile"
    for copy in (flipped, cut, hostile):
        subprocess.run(["cp", "-r", sources["dcp"], copy], check=True)
    (hostile / ".metadata").write_bytes(pickle.dumps(os.system))
    data = flip_embed(flipped)
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


def torch_file_variants(src: str, root) -> dict[str, str]:
    """Return copies of the torch.save file ``src``, each damaged or hostile in its own way."""
    out = {}
    flipped = root / "flipped.pt"
    flipped.write_bytes(open(src, "rb").read())
    flip_in_torch_file(flipped, "model.embed.weight")
    out["flipped"] = flipped
    torch.save({"w": torch.ones(2), "run": os.system}, root / "hostile.pt")
    out["hostile"] = root / "hostile.pt"
    cut = root / "cut.pt"
    raw = open(src, "rb").read()
    cut.write_bytes(raw[: len(raw) // 2])
    out["cut"] = cut
    # What the stand-ins leave to torch: a tensor inside a tuple, a torch.Size, a legacy
    # (not zip) file; each read as before, by torch.
    torch.save({"pair": (torch.ones(1), 2)}, root / "tuple.pt")
    out["tuple"] = root / "tuple.pt"
    torch.save({"w": torch.ones(2), "shape": torch.Size([2])}, root / "size.pt")
    out["size"] = root / "size.pt"
    torch.save({"w": torch.ones(2)}, root / "legacy.pt", _use_new_zipfile_serialization=False)
    out["legacy"] = root / "legacy.pt"
    return {k: str(v) for k, v in out.items()}


@pytest.mark.launches
def test_a_damaged_or_hostile_torch_file_is_told_alike_without_torch(sources, tmp_path):
    files = torch_file_variants(sources["model.pt"], tmp_path)
    # Each in an interpreter of its own: one that imports torch would hide the next one's import.
    argv_list = [
        ["verify", files["flipped"]],
        ["inspect", files["flipped"], "--verify"],
        ["inspect", files["cut"]],
        ["inspect", files["hostile"]],
        ["verify", files["hostile"]],
        ["inspect", files["tuple"], "--json"],
        ["verify", files["size"]],
        ["inspect", files["legacy"]],
        ["inspect", sources["model.pt"], "--trust-pickle"],
    ]
    alone = [run([argv], "nothing")[0] for argv in argv_list]
    after_torch = run(argv_list, "torch")
    assert [m[:3] for m in alone] == [b[:3] for b in after_torch]
    assert [m[0] for m in alone] == [3, 3, 3, 3, 3, 0, 0, 0, 0]
    # A flipped byte is found by its record's CRC-32, without torch.
    assert "damaged: " in alone[0][1] and "'model.embed.weight'" in alone[0][1]
    assert alone[2][2].startswith(f"shardckpt: error: '{files['cut']}': is a damaged torch.save")
    # Read without torch; each of the others is left to torch's loader, which imports it.
    assert [m[3] for m in alone] == [False] * 3 + [True] * 6
    # A global off the allow-list: torch's loader refuses it, in the line it always gave.
    assert alone[3][2] == (
        f"shardckpt: error: '{files['hostile']}': refused to unpickle (names posix.system, "
        "not on the weights-only allow-list): pass --trust-pickle only if you trust this file\n"
    )


def test_the_globals_read_without_torch_are_on_torch_s_allow_list():
    from torch._weights_only_unpickler import _get_allowed_globals

    from shardckpt.codecs.torch_pickle import _GLOBALS, _STORAGES

    allowed = _get_allowed_globals()
    for module, name in _GLOBALS:
        assert f"{module}.{name}" in allowed, (module, name)
    for cls, dtype in _STORAGES.items():
        assert getattr(torch, cls).dtype is getattr(torch, dtype)


def _tensor(size: int = 2, numel: int = 2, key: str = "0", storage=("torch", "FloatStorage")):
    """The opcodes of a tensor as torch.save pickles one, over storage ``key`` of ``numel`` floats."""
    from pickle_payloads import _call, _global, _str, _tuple

    persid = (
        _tuple(
            _str("storage"),
            _global(*storage),
            _str(key),
            _str("cpu"),
            pickle.BININT1 + bytes([numel]),
        )
        + pickle.BINPERSID
    )
    hooks = _call(_global("collections", "OrderedDict"))
    sizes = _tuple(pickle.BININT1 + bytes([size]))
    return _call(
        _global("torch._utils", "_rebuild_tensor_v2"),
        persid,
        pickle.BININT1 + b"\0",
        sizes,
        _tuple(pickle.BININT1 + b"\1"),
        pickle.NEWFALSE,
        hooks,
    )


def _dict(*items: bytes) -> bytes:
    return (
        pickle.PROTO
        + b"\2"
        + pickle.EMPTY_DICT
        + pickle.MARK
        + b"".join(items)
        + pickle.SETITEMS
        + pickle.STOP
    )


def crafted(marker) -> dict[str, bytes]:
    """Pickles of a torch.save file (its one storage: 2 floats), each but two unlike any torch.save writes.

    torch's loader refuses some and reads others (a storage larger than its record, whose
    bytes run on into the next one's); the stand-ins read only the two torch.save writes.
    """
    from pickle_payloads import _call, _global, _str, _tuple, reduce_os_system

    one = pickle.BININT1 + b"\1"
    return {
        "plain": _dict(_str("w"), _tensor(), _str("step"), one),
        "past its storage": _dict(_str("w"), _tensor(size=3)),
        "storage larger than its record": _dict(_str("w"), _tensor(size=2, numel=4)),
        "no record": _dict(_str("w"), _tensor(key="7")),
        "untyped by the wrong name": _dict(_str("w"), _tensor(storage=("torch", "UntypedStorage"))),
        "item set in a list": _dict(_str("l"), pickle.EMPTY_LIST + one + one + pickle.SETITEM),
        "append to a dict": _dict(_str("d"), pickle.EMPTY_DICT + one + pickle.APPEND),
        "state set on a tensor": _dict(_str("w"), _tensor() + pickle.EMPTY_DICT + pickle.BUILD),
        "OrderedDict called with items": _dict(
            _str("o"), _call(_global("collections", "OrderedDict"), pickle.EMPTY_LIST)
        ),
        "OrderedDict made by NEWOBJ": _dict(
            _str("o"), _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.NEWOBJ
        ),
        "short binstring": _dict(_str("s"), pickle.SHORT_BINSTRING + b"\3abc"),
        "stack global": _dict(
            _str("o"),
            _str("collections")
            + _str("OrderedDict")
            + pickle.STACK_GLOBAL
            + pickle.EMPTY_TUPLE
            + pickle.REDUCE,
        ),
        "a tuple in a tuple": _dict(_str("t"), _tuple(_tuple(one))),
        "os.system": reduce_os_system(marker),
    }


def test_what_is_read_without_torch_torch_s_loader_reads_alike(tmp_path):
    # Each crafted pickle is read by the stand-ins only where torch's weights_only loader
    # reads it too, and then into the same tree: dtypes, shapes, views and plain values.
    from pickle_payloads import torch_file

    from shardckpt.codecs.torch_pickle import NotPlain, plain_torch_file
    from shardckpt.state.plain_tensor import PlainTensor
    from shardckpt.state.tree import walk

    read = []
    for name, pickled in crafted(tmp_path / "marker").items():
        path = torch_file(tmp_path / f"{len(read)}.pt", pickled)
        try:
            plain = plain_torch_file(path).obj
        except NotPlain:
            continue
        read.append(name)
        loaded = torch.load(path, weights_only=True, mmap=True)
        mine = [(p, v) for p, v in walk(plain)]
        theirs = [(p, v) for p, v in walk(loaded)]
        assert [p for p, _ in mine] == [p for p, _ in theirs], name
        for (_, a), (_, b) in zip(mine, theirs):
            if isinstance(a, PlainTensor):
                assert (str(a.dtype), a.shape, a.stride, a.storage_offset) == (
                    str(b.dtype),
                    tuple(b.shape),
                    b.stride(),
                    b.storage_offset(),
                ), name
            else:
                assert a == b and type(a) is type(b), name
    assert read == ["plain", "a tuple in a tuple"]
    assert not (tmp_path / "marker").exists()


def test_a_torch_file_read_without_torch_lists_checks_and_reads_as_with_it(
    sources, tmp_path, monkeypatch
):
    # In this process torch is loaded; the reader is told it is not, so it reads the
    # stand-ins. Its index, verify's findings (the tensors named in a damaged record)
    # and the tensors it reads (torch loaded then) are those of torch's own loader.
    from damage import copy

    from shardckpt.api.integrity import verify
    from shardckpt.api.requests import VerifyRequest
    from shardckpt.formats.torch_save import file

    src = copy(Path(sources["model.pt"]), tmp_path / "model.pt")
    flip_in_torch_file(src, "model.base.T")
    torch_reader = file.TorchReader(src)
    by_torch = verify(VerifyRequest(src=src))
    monkeypatch.setattr(file, "loaded", lambda: False)
    plain_reader = file.TorchReader(src)
    assert plain_reader._tensors is None
    assert plain_reader.index() == torch_reader.index()
    plain = verify(VerifyRequest(src=src))
    assert plain.damaged == by_torch.damaged and len(plain.damaged) == 1
    assert plain.damaged[0].tensors == ("model.base.T", "model.base.rows")
    metas = [m for _, m in plain_reader.index().tensors()]
    for a, b in zip(
        plain_reader.read(metas, [None] * len(metas), None),
        torch_reader.read(metas, [None] * len(metas), None),
    ):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


GOLDENS = Path(__file__).resolve().parents[1] / "goldens" / "dcp"


@pytest.mark.launches
def test_a_dcp_of_torch_2_15_is_read_without_torch_as_with_it():
    # torch 2.15 pickles each tensor's TensorProperties with its strides (six fields, not
    # five); read without torch it lists and checks what torch's own classes read (an
    # older torch's classes read the five they know).
    src = str(GOLDENS / "torch-2.15.0")
    argv_list = [["inspect", src], ["inspect", src, "--json"], ["verify", src]]
    alone, after_torch = run(argv_list, "nothing"), run(argv_list, "torch")
    assert [m[:3] for m in alone] == [b[:3] for b in after_torch]
    assert [m[0] for m in alone] == [0, 0, 0]
    assert [m[3] for m in alone] == [False, False, False]
    listed = json.loads(alone[1][1])["entries"]
    assert [(e["path"], e.get("shape")) for e in listed] == [
        (["model", "w"], [4, 3]),
        (["model", "norm"], [3]),
        (["step"], None),
    ]


def test_a_dcp_of_torch_2_15_converts_under_this_torch_to_what_it_saved(tmp_path, capsys):
    from shardckpt.cli.app import run as cli

    spec = importlib.util.spec_from_file_location("dcp_goldens_make", GOLDENS / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    dst = tmp_path / "full.pt"
    assert cli(["convert", str(GOLDENS / "torch-2.15.0"), str(dst), "--to", "full", "-q"]) == 0
    assert capsys.readouterr().err == ""
    got, want = torch.load(dst, weights_only=True), make.state()
    assert got["step"] == want["step"]
    for name, value in want["model"].items():
        assert torch.equal(got["model"][name], value), name


def changed_dcp(root, change) -> str:
    """Return a DCP save of ``tree()`` with ``change`` applied to its model state first."""
    state = tree()
    change(state["model"])
    dcp.save(state, checkpoint_id=root, no_dist=True)
    return str(root)


@pytest.mark.launches
def test_diff_of_equal_sources_imports_no_torch_and_prints_what_it_printed_with_it(sources):
    # Equal tensors are compared by the bytes they are stored as; the sides are written by
    # different libraries (DCP in both serializations, safetensors, a transformers-like hf
    # directory), so the bytes compared lie in different places of different files.
    s = sources
    argv_list = [
        ["diff", s["dcp"], s["dcp-safetensors"]],
        ["diff", s["dcp"], s["dcp-safetensors"], "--json"],
        ["diff", s["dcp"], s["hf"], "--only", "model"],
        ["diff", s["model.safetensors"], s["hf"], "--nest-a", "model"],
        ["diff", s["dcp"], s["model.safetensors"], "--only", "model", "--atol", "0.1"],
    ]
    alone, after_torch = run(argv_list, "nothing"), run(argv_list, "torch")
    for argv, mine, before in zip(argv_list, alone, after_torch):
        assert mine[:3] == before[:3], argv
        assert mine[3] is False, f"{argv} imported torch"
    # --only model keeps the DCP's plain values at its root, which hf lacks.
    assert [m[0] for m in alone] == [0, 0, 1, 0, 0]
    assert alone[0][1] == "equal: 11 leaves compared\n"
    assert json.loads(alone[1][1])["equal"] is True
    assert alone[2][1] == "2 of 6 leaves differ:\n  epoch: only in A\n  name: only in A\n"
    assert alone[3][1] == alone[4][1] == "equal: 4 leaves compared\n"


@pytest.mark.launches
def test_diff_of_tensors_whose_bytes_differ_compares_them_with_torch_as_before(sources, tmp_path):
    # Bytes that differ are told apart by value, through torch: -0.0 against 0.0, a value
    # within --atol, a changed one; a transposed view (not one run in its record) too.
    def negative_zero(model):
        model["ids"] = model["ids"] * 0
        model["embed.weight"][0, 0] = -0.0

    def nudged(model):
        model["embed.weight"][2, 1] += 1e-3

    zeros = changed_dcp(tmp_path / "zeros", lambda m: m["embed.weight"].__setitem__((0, 0), 0.0))
    negative = changed_dcp(tmp_path / "negative", negative_zero)
    near = changed_dcp(tmp_path / "near", nudged)
    torch_copy = tmp_path / "copy.pt"
    torch_copy.write_bytes(open(sources["model.pt"], "rb").read())
    argv_list = [
        ["diff", zeros, negative],
        ["diff", sources["dcp"], near],
        ["diff", sources["dcp"], near, "--atol", "0.01", "--json"],
        ["diff", sources["dcp"], near, "--quiet"],
        ["diff", sources["model.pt"], str(torch_copy)],
    ]
    alone = [run([argv], "nothing")[0] for argv in argv_list]
    after_torch = run(argv_list, "torch")
    assert [m[:3] for m in alone] == [b[:3] for b in after_torch]
    assert [m[0] for m in alone] == [1, 1, 0, 1, 0]
    assert alone[0][1] == (
        "2 of 11 leaves differ:\n"
        "  model.embed.weight: values differ, max abs diff 0\n"
        "  model.ids: values differ, max abs diff 4\n"
    )
    assert alone[1][1] == (
        "1 of 11 leaves differs:\n  model.embed.weight: values differ, max abs diff 0.00100005\n"
    )
    assert [m[3] for m in alone] == [True] * 5


@pytest.mark.launches
def test_diff_checks_the_bytes_it_compares_without_torch(sources, tmp_path):
    # A byte flipped alike on both sides compares equal as bytes: its record's CRC-32
    # finds it (exit 3, the file named), as verify would, and torch is never needed.
    # Flipped on one side only, the bytes differ and torch compares them; exit 3 still.
    sides = [tmp_path / "a", tmp_path / "b"]
    for side in sides:
        subprocess.run(["cp", "-r", sources["dcp"], side], check=True)
        data = side / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        at = raw.find(tree()["model"]["embed.weight"].numpy().tobytes())
        raw[at + 5] ^= 0xFF
        data.write_bytes(bytes(raw))
    argv_list = [
        ["diff", str(sides[0]), str(sides[1])],
        ["diff", sources["dcp"], str(sides[1])],
    ]
    alone = [run([argv], "nothing")[0] for argv in argv_list]
    after_torch = run(argv_list, "torch")
    assert [m[:3] for m in alone] == [b[:3] for b in after_torch]
    assert [m[0] for m in alone] == [3, 3]
    assert alone[0][2].startswith(f"shardckpt: error: '{sides[0] / '__0_0.distcp'}': ")
    assert alone[1][2].startswith(f"shardckpt: error: '{sides[1] / '__0_0.distcp'}': ")
    assert "do not match the checksum" in alone[0][2]
    assert [m[3] for m in alone] == [False, True]


@pytest.mark.launches
def test_diff_of_a_side_only_torch_reads_against_one_read_without_it(sources, tmp_path):
    # A legacy (not zip) torch file is read by torch's loader, which imports torch after
    # the other side named its dtypes by stand-ins: both sides are read again with torch,
    # and equal tensors stay equal (not "dtype float32 vs float32").
    model = {k: v.contiguous() for k, v in tree()["model"].items()}
    legacy = tmp_path / "legacy.pt"
    torch.save({"model": model}, legacy, _use_new_zipfile_serialization=False)
    plain = tmp_path / "plain.pt"
    torch.save({"model": model}, plain)
    argv_list = [
        ["diff", str(plain), str(legacy)],
        ["diff", str(legacy), str(plain)],
        ["diff", sources["hf"], str(legacy)],
        ["diff", sources["dcp"], str(legacy), "--only", "model"],
    ]
    alone = [run([argv], "nothing")[0] for argv in argv_list]
    after_torch = run(argv_list, "torch")
    assert [m[:3] for m in alone] == [b[:3] for b in after_torch]
    assert [m[0] for m in alone] == [0, 0, 0, 1]
    assert alone[0][1] == alone[1][1] == alone[2][1] == "equal: 4 leaves compared\n"
    # The DCP's plain values are at its root, which the file lacks; its tensors are equal.
    assert alone[3][1] == "2 of 6 leaves differ:\n  epoch: only in A\n  name: only in A\n"
    assert [m[3] for m in alone] == [True] * 4


# Exports whose every region is copied as it lies in SRC, and the ones torch is needed for.
EXPORTS = {
    "dcp.safetensors": ("dcp", ["--to", "full"], False),
    "dcp-st.safetensors": ("dcp-safetensors", ["--to", "full"], False),
    "dcp-model.safetensors": ("dcp", ["--to", "full", "--only", "model", "--verify"], False),
    "dcp-hf": ("dcp", ["--to", "full", "--format", "hf", "--max-shard-size", "100B"], False),
    "dcp-optim.safetensors": (
        "dcp",
        ["--to", "full", "--only", "optim", "--optim-keys", "id"],
        False,
    ),
    "dcp-edits.safetensors": (
        "dcp",
        ["--to", "full", "--rename", "embed=emb", "--drop", "ids$", "--filter", "model.*"],
        False,
    ),
    "st-nest.safetensors": ("model.safetensors", ["--to", "full", "--nest", "model"], False),
    "st-hf": ("model.safetensors", ["--to", "full", "--format", "hf"], False),
    "hf.safetensors": ("hf", ["--to", "full"], False),
    # A transposed view is not one run of its storage; a cast and a torch.save DST make tensors.
    "pt.safetensors": ("model.pt", ["--to", "full"], True),
    "dcp-bf16.safetensors": ("dcp", ["--to", "full", "--dtype", "bfloat16"], True),
    "dcp.pt": ("dcp", ["--to", "full"], True),
    "sized.safetensors": ("sized", ["--to", "full"], True),
}


@pytest.mark.launches
def test_an_export_copied_as_it_lies_imports_no_torch_and_writes_what_it_wrote_with_it(
    sources, tmp_path
):
    def argv_list(mode: str) -> list[list[str]]:
        return [
            ["convert", sources[src], str(tmp_path / mode / name), *options, "-q"]
            for name, (src, options, _) in EXPORTS.items()
        ]

    for mode in ("nothing", "torch"):
        (tmp_path / mode).mkdir()
    # A value DCP's own loader reads (it names a global): torch is imported as SRC is read.
    state = {"model": tree()["model"], "shape": torch.Size([2, 3])}
    dcp.save(state, checkpoint_id=tmp_path / "sized", no_dist=True)
    sources = {**sources, "sized": str(tmp_path / "sized")}
    alone, after_torch = run(argv_list("nothing"), "nothing"), run(argv_list("torch"), "torch")
    for name, mine, before in zip(EXPORTS, alone, after_torch):
        assert mine[:3] == before[:3] and mine[:2] == [0, ""], (name, mine, before)
        assert mine[3] is EXPORTS[name][2], f"{name}: torch imported: {mine[3]}"
        written = sorted(
            p.relative_to(tmp_path / "nothing") for p in (tmp_path / "nothing").glob(f"{name}/**/*")
        )
        for one, other in (
            (tmp_path / "nothing" / name, tmp_path / "torch" / name),
            *[(tmp_path / "nothing" / w, tmp_path / "torch" / w) for w in written],
        ):
            if one.is_file():
                assert one.read_bytes() == other.read_bytes(), one
    # What was written is what the sources hold, as the libraries read them back.
    from safetensors.torch import load_file

    model = tree()["model"]
    out = load_file(tmp_path / "nothing" / "dcp.safetensors")
    assert set(out) >= {f"model.{k}" for k in model} | {"optim.state.embed.weight.exp_avg"}
    for key, value in model.items():
        assert torch.equal(out[f"model.{key}"], value), key
    assert load_file(tmp_path / "nothing" / "dcp-st.safetensors").keys() == out.keys()
    shards = sorted((tmp_path / "nothing" / "dcp-hf").glob("*.safetensors"))
    assert len(shards) > 1
    merged = {k: v for shard in shards for k, v in load_file(shard).items()}
    assert set(merged) == set(model) and all(torch.equal(merged[k], model[k]) for k in model)
    hf = load_file(tmp_path / "nothing" / "hf.safetensors")
    # An hf directory is read as the model it holds.
    assert set(hf) == {f"model.{k}" for k in model}
    assert all(torch.equal(hf[f"model.{k}"], model[k]) for k in model)


@pytest.mark.launches
def test_an_export_without_torch_checks_the_bytes_it_copies(sources, tmp_path):
    # A byte changed under its record's CRC-32 is found as the region is copied: the same
    # one line and exit code as with torch, and no DST.
    flipped = tmp_path / "flipped"
    subprocess.run(["cp", "-r", sources["dcp"], flipped], check=True)
    data = flip_embed(flipped)
    argv = ["convert", str(flipped), str(tmp_path / "out.safetensors"), "--to", "full", "-q"]
    (alone,), (before,) = run([argv], "nothing"), run([argv], "torch")
    assert alone[:3] == before[:3], (alone, before)
    assert alone[0] == 3 and alone[2].startswith(f"shardckpt: error: '{data}': "), alone
    assert alone[3] is False
    assert not (tmp_path / "out.safetensors").exists()
