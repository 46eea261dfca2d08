"""``--overwrite`` replaces only what reads as a checkpoint and holds nothing else (issue 24, item 1).

Each hostile DST is a directory (or file) a user could point shardckpt at by mistake:
checkpoint-looking names beside a project's files, a real checkpoint with a file of
the user's in it, a notes file. Each is refused with one line naming what is not a
checkpoint, and is left exactly as it was; every output shardckpt writes is still
replaced by a second run.
"""

from __future__ import annotations

import argparse
import os
import pickle

import pytest
import torch
from optim_models import trained

from shardckpt.cli.app import run

KEEP = (
    "so --overwrite will not replace it: remove it yourself if you mean it, or choose another DST"
)


def lines_of(capsys, argv) -> tuple[int, list[str]]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def snapshot(root) -> dict[str, object]:
    """Return every entry under ``root`` (links not followed): a file's bytes, a link's target."""
    if not root.is_dir() or root.is_symlink():
        return {".": os.readlink(root) if root.is_symlink() else root.read_bytes()}
    out: dict[str, object] = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(here, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                out[rel] = open(path, "rb").read()
    return out


@pytest.fixture
def ck(tmp_path):
    """A small full checkpoint (model and optimizer), SRC of every conversion here."""
    model, opt = trained("adamw")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    return tmp_path / "ck.pt"


def to_sharded(src, dst, *more) -> list:
    return ["convert", src, dst, "--to", "sharded", "--world-size", "1", "--overwrite", *more]


def assert_refused(capsys, argv, dst, line: str) -> None:
    """Run ``argv``: exit 2, ``line`` alone on stderr, DST as it was, nothing staged beside it."""
    before = snapshot(dst)
    code, err = lines_of(capsys, argv)
    assert (code, err) == (2, [f"shardckpt: error: '{dst}': {line}, {KEEP}"])
    assert snapshot(dst) == before
    assert sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(".")) == []


# ---------------------------------------------------------------- names alone are not a checkpoint


def _pickled(value) -> bytes:
    return pickle.dumps(value, protocol=2)


def _torch_saved(value) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


DECOYS = {
    # The issue's example: a junk metadata.pkl beside a project's src/.
    "metadata.pkl": (
        _pickled({"step": 1}),
        "('metadata.pkl': is not torch_checkpointing metadata "
        "shardckpt can use: version None, not '2.0')",
    ),
    ".metadata": (_pickled({"a": 1}), "('.metadata': not DCP metadata)"),
    "random_states_0.pkl": (
        b"junk\n",
        "(holds no model (pytorch_model_fsdp_0/, pytorch_model_fsdp.bin or model.safetensors))",
    ),
    "model.safetensors.index.json": (
        b"junk\n",
        "('model.safetensors.index.json': not an index of safetensors shards (no 'weight_map' of "
        "names to files))",
    ),
    "rank_0.pt": (
        _torch_saved({"step": 1}),
        "('rank_0.pt': holds no DTensor, so it is not an FSDP2 per-rank file)",
    ),
}


@pytest.mark.parametrize("name", list(DECOYS))
def test_a_checkpoint_name_beside_a_project_does_not_make_it_replaceable(capsys, ck, name):
    data, why = DECOYS[name]
    dst = ck.parent / "project"
    (dst / "src").mkdir(parents=True)
    (dst / "src" / "train.py").write_text("code")
    (dst / name).write_bytes(data)
    line = f"does not read as the checkpoint it looks like {why}"
    assert_refused(capsys, to_sharded(ck, dst), dst, line)


def test_the_issues_junk_metadata_pkl_is_refused_naming_it(capsys, ck):
    dst = ck.parent / "p"
    (dst / "src").mkdir(parents=True)
    (dst / "src" / "train.py").write_text("code")
    (dst / "metadata.pkl").write_text("junk\n")
    before = snapshot(dst)
    code, err = lines_of(capsys, to_sharded(ck, dst))
    assert code == 2 and len(err) == 1
    # Why the pickle does not decode is the unpickler's to word; the line names the file.
    assert err[0].startswith(
        f"shardckpt: error: '{dst}': does not read as the checkpoint it looks like "
        "('metadata.pkl': "
    )
    assert err[0].endswith(f"), {KEEP}")
    assert snapshot(dst) == before


# ---------------------------------------------------------------- a real checkpoint with more in it


def _write(src, dst, *args) -> None:
    assert run([str(a) for a in ["convert", src, dst, *args, "-q"]]) == 0


def _stranger(named: str, title: str) -> str:
    return f"holds '{named}', which is no part of the {title} checkpoint in it"


STRANGERS = {
    # the output written first, what is added to it, what the line says of it
    "dcp": (["--to", "sharded", "--world-size", "2"], "train.py", _stranger("train.py", "DCP")),
    "accelerate": (
        ["--to", "sharded", "--format", "accelerate", "--world-size", "2"],
        "pytorch_model_fsdp_0/notes/todo.txt",
        _stranger("pytorch_model_fsdp_0/notes/", "accelerate"),
    ),
    "hf": (["--to", "full", "--format", "hf"], "logs/", _stranger("logs/", "Hugging Face")),
    "fsdp2-ranks": (
        ["--to", "local", "--world-size", "2", "--model", "optim_models:tiny"],
        "home -> /",
        _stranger("home", "FSDP2 per-rank"),
    ),
    # Its reader names every stray file itself.
    "torch-checkpointing": (
        ["--to", "sharded", "--format", "torch-checkpointing", "--world-size", "2"],
        ".env",
        "does not read as the checkpoint it looks like (holds '.env', which is no part of "
        "this torch_checkpointing checkpoint that shardckpt can read (not listed in "
        "metadata.pkl, not <item>_<rank>.pt of a rank below 2))",
    ),
}


@pytest.mark.parametrize("fmt", list(STRANGERS))
def test_a_real_checkpoint_with_a_file_of_yours_in_it_is_not_replaced(capsys, ck, fmt):
    args, added, line = STRANGERS[fmt]
    dst = ck.parent / "out"
    _write(ck, dst, *args)
    if " -> " in added:
        link, target = added.split(" -> ")
        (dst / link).symlink_to(target)  # an entry of its own: never followed
    elif added.endswith("/"):
        (dst / added).mkdir()
    else:
        (dst / added).parent.mkdir(parents=True, exist_ok=True)
        (dst / added).write_text("mine")
    assert_refused(capsys, to_sharded(ck, dst), dst, line)


# ---------------------------------------------------------------- files


def test_a_file_that_is_no_checkpoint_is_not_replaced(capsys, ck):
    notes = ck.parent / "notes.md"
    notes.write_text("# my notes\n")
    argv = ["convert", ck, notes, "--to", "full", "--format", "torch", "--overwrite"]
    assert_refused(capsys, argv, notes, "is a file that holds no checkpoint")


def test_a_file_that_looks_like_a_torch_file_but_does_not_read_is_not_replaced(capsys, ck):
    fake = ck.parent / "model.pt"
    fake.write_bytes(b"PK\x03\x04 my zip of photos")
    argv = ["convert", ck, fake, "--to", "full", "--overwrite"]
    before = fake.read_bytes()
    code, err = lines_of(capsys, argv)
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        f"shardckpt: error: '{fake}': does not read as the checkpoint it looks like ("
    )
    assert err[0].endswith(f"), {KEEP}")
    assert fake.read_bytes() == before


def test_a_fifo_dst_is_not_replaced(capsys, ck):
    fifo = ck.parent / "pipe.pt"
    os.mkfifo(fifo)
    argv = ["convert", ck, fifo, "--to", "full", "--overwrite"]
    code, err = lines_of(capsys, argv)
    assert (code, err) == (
        2,
        [f"shardckpt: error: '{fifo}': is a file that holds no checkpoint, {KEEP}"],
    )
    assert fifo.is_fifo()


@pytest.mark.parametrize("old", ["empty", "safetensors", "pickled objects"])
def test_an_empty_file_or_one_that_reads_as_a_checkpoint_is_replaced(capsys, ck, old):
    dst = ck.parent / "out.pt"
    if old == "empty":
        dst.write_bytes(b"")
    elif old == "safetensors":
        _write(ck, ck.parent / "o.safetensors", "--to", "full")
        os.replace(ck.parent / "o.safetensors", dst)
    else:
        # Only --trust-pickle would load it; it is still a checkpoint, made of itself.
        torch.save({"args": argparse.Namespace(lr=0.1), "w": torch.ones(2)}, dst)
    code, err = lines_of(capsys, ["convert", ck, dst, "--to", "full", "--overwrite", "-q"])
    assert (code, err) == (0, [])
    assert torch.equal(torch.load(dst)["model"]["fc.weight"], torch.load(ck)["model"]["fc.weight"])


def test_a_symlink_dst_is_replaced_and_what_it_points_at_kept(capsys, ck):
    (ck.parent / "project").mkdir()
    (ck.parent / "project" / "train.py").write_text("code")
    dst = ck.parent / "out"
    dst.symlink_to(ck.parent / "project")
    assert run([str(a) for a in to_sharded(ck, dst, "-q")]) == 0
    assert not dst.is_symlink() and (dst / ".metadata").is_file()
    assert (ck.parent / "project" / "train.py").read_text() == "code"


# ---------------------------------------------------------------- what shardckpt writes stays replaceable


OUTPUTS = {
    "torch": ["o.pt", "--to", "full"],
    "safetensors": ["o.safetensors", "--to", "full"],
    "hf": ["o", "--to", "full", "--format", "hf"],
    "hf with config": ["o", "--to", "full", "--format", "hf", "--hf-config", "@cfg"],
    "dcp": ["o", "--to", "sharded", "--world-size", "@M"],
    "torch-checkpointing": [
        "o",
        "--to",
        "sharded",
        "--format",
        "torch-checkpointing",
        "--world-size",
        "@M",
    ],
    "lightning": ["o", "--to", "sharded", "--format", "lightning", "--world-size", "@M"],
    "accelerate": ["o", "--to", "sharded", "--format", "accelerate", "--world-size", "@M"],
    "torchtitan": [
        "o",
        "--to",
        "sharded",
        "--format",
        "torchtitan",
        "--world-size",
        "@M",
        "--optim-keys",
        "flat",
    ],
    "fsdp2-ranks": ["o", "--to", "local", "--world-size", "@M", "--model", "optim_models:tiny"],
    "fsdp1-sharded": [
        "o",
        "--to",
        "local",
        "--format",
        "fsdp1-sharded",
        "--world-size",
        "@M",
        "--model",
        "optim_models:tiny",
    ],
    "fsdp1-local": [
        "o",
        "--to",
        "local",
        "--format",
        "fsdp1-local",
        "--world-size",
        "@M",
        "--model",
        "optim_models:tiny",
        "--only",
        "model",
    ],
}


def _src_for(name: str, ck):
    """Return SRC for output ``name``: the small checkpoint, as torchtitan's tree for torchtitan."""
    if name != "torchtitan":
        return ck
    tree = torch.load(ck)
    titan = ck.parent / "titan.pt"
    torch.save({"optimizer": tree["optimizer"], **tree["model"]}, titan)
    return titan


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_every_output_shardckpt_writes_is_replaced_by_a_second_run(capsys, ck, name):
    cfg = ck.parent / "cfg"
    cfg.mkdir()
    (cfg / "config.json").write_text('{"model_type": "tiny"}')
    (cfg / "tokenizer.json").write_text("{}")
    src = _src_for(name, ck)
    dst = ck.parent / OUTPUTS[name][0]
    written = []
    # A model transformers does not know: the weight-name check says it did not run.
    told = [
        f"shardckpt: note: '{cfg / 'config.json'}': not checking DST's weight names against the "
        "model it describes: it names no 'architectures', and transformers knows no model_type "
        "'tiny'"
    ]
    for world_size in ("2", "3"):
        args = [world_size if a == "@M" else cfg if a == "@cfg" else a for a in OUTPUTS[name][1:]]
        code, err = lines_of(capsys, ["convert", src, dst, *args, "--overwrite", "-q"])
        assert (code, err) == (0, told if "@cfg" in OUTPUTS[name] else [])
        written.append(sorted(snapshot(dst)))
    if "--world-size" in OUTPUTS[name]:
        assert written[0] != written[1]  # the second run's files, not the first's
    assert sorted(p.name for p in ck.parent.iterdir()) == sorted(
        {ck.name, src.name, "cfg", dst.name}
    )


NOT_CHECKPOINTS = {
    # The issue's case: `--overwrite` made notes.md a torch zip, exit 0.
    "notes.md": b"# notes\n\nsome of my own words\n",
    "config.json": b'{"hidden_size": 48}',
    "random.bin": bytes(range(256)) * 16,
    "photo.safetensors": b"\xff\xd8\xff\xe0 not a safetensors header",
    "tool": b"\x7fELF\x02\x01\x01" + bytes(200),
}


@pytest.mark.parametrize("name", list(NOT_CHECKPOINTS))
def test_overwrite_refuses_any_file_that_is_no_checkpoint(capsys, ck, name):
    dst = ck.parent / name
    dst.write_bytes(NOT_CHECKPOINTS[name])
    argv = ["convert", ck, dst, "--to", "full", "--overwrite"]
    assert_refused(capsys, argv, dst, "is a file that holds no checkpoint")


def test_overwrite_refuses_a_truncated_torch_file(capsys, ck):
    # A checkpoint cut short is the user's to repair or remove, not ours to replace.
    dst = ck.parent / "cut.pt"
    dst.write_bytes(ck.read_bytes()[:2000])
    before = dst.read_bytes()
    assert lines_of(capsys, ["convert", ck, dst, "--to", "full", "--overwrite"]) == (
        2,
        [
            f"shardckpt: error: '{dst}': does not read as the checkpoint it looks like (is a "
            f"damaged torch.save file (zip: File is not a zip file)), {KEEP}"
        ],
    )
    assert dst.read_bytes() == before
