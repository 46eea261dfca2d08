"""Every file a source contributes, read or carried into DST, passes one gate (issue 24 items 2, 3, 7, 10).

The gate (``formats/files.py``): a regular file, or for a carried tree a directory, that
lies inside SRC (``--hf-config``: inside that directory) once symlinks are resolved. The
hostile sources here link to a "credentials" file outside SRC, to ``/dev/zero``, back to
SRC itself, or hold a FIFO, a dangling link or a directory where a file belongs. Each is
refused with exit 3 and one line naming the file and what it is, before anything is
written: DST's parent stays empty, and the marker of the outside file appears nowhere
under it.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.cli.app import run

MARKER = b"OUTSIDE-SRC-7f3a9c"
"""Bytes of every file outside SRC: finding them under DST's parent means a leak."""

OUTSIDE_HINT = (
    "shardckpt reads only the files inside it: copy the file in instead of linking to it, "
    "or remove the link"
)
FIFO_HINT = (
    "copy the checkpoint into a regular file first; shardckpt does not read pipes or devices"
)


def _dcp(path: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _model() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"fc.weight": torch.randn(7, 3, generator=gen), "fc.bias": torch.randn(7, generator=gen)}


def error_of(capsys, argv: list) -> tuple[int, str]:
    """Return the exit code of ``shardckpt ARGV`` and its last line on stderr."""
    code = run([str(a) for a in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    return code, lines[-1] if lines else ""


def leaked(directory: Path) -> list[str]:
    """Return the files under ``directory`` (links not followed) that hold the outside marker."""
    found = []
    for here, _dirs, names in os.walk(directory):
        for name in names:
            path = Path(here) / name
            if path.is_file() and not path.is_symlink() and MARKER in path.read_bytes():
                found.append(str(path))
    return found


def assert_nothing_written(out: Path) -> None:
    """DST's parent holds nothing: no DST, no partial output, no byte of an outside file."""
    assert leaked(out) == []
    assert sorted(os.listdir(out)) == []


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """Return a directory outside SRC: a private ``credentials`` file and a ``tree`` of them."""
    root = tmp_path / "elsewhere"
    (root / "tree").mkdir(parents=True)
    (root / "credentials").write_bytes(b"aws_secret=" + MARKER + b"\n")
    (root / "credentials").chmod(0o600)
    (root / "tree" / "id_rsa").write_bytes(MARKER)
    torch.save({"last_epoch": MARKER.decode()}, root / "scheduler.bin")
    _dcp(
        root / "model_dcp",
        {"model": {"leak": torch.frombuffer(bytearray(MARKER), dtype=torch.uint8)}},
    )
    return root


@pytest.fixture
def out(tmp_path) -> Path:
    """Return the (empty) directory DST is written in."""
    (tmp_path / "out").mkdir()
    return tmp_path / "out"


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _link(target: str):
    def make(path: Path) -> None:
        path.symlink_to(target)

    return make


BAD = {
    "fifo": (_fifo, f"is a FIFO (named pipe), not a regular file: {FIFO_HINT}"),
    "dangling-link": (
        _link("gone"),
        "is a symlink to 'gone', which does not exist: put the file it stood for in its "
        "place, or remove the link",
    ),
    "link-to-dev-zero": (
        _link("/dev/zero"),
        "resolves to '/dev/zero', outside '{within}': " + OUTSIDE_HINT,
    ),
    "directory": (
        _directory,
        "is a directory, not a file: a file is expected under this name; re-copy it from "
        "where it was saved",
    ),
}
"""What can stand where a file belongs: how to make it, and the error (``within``: its directory)."""


def make_bad(path: Path, kind: str, within: Path) -> str:
    """Put a ``kind`` of ``BAD`` at ``path``; return the error line that names it."""
    make, what = BAD[kind]
    path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    make(path)
    return f"shardckpt: error: '{path}': {what.format(within=within)}"


# ------------------------------------------------------------ accelerate's carried files


@pytest.fixture
def acc(tmp_path) -> Path:
    """Return a directory laid out as accelerate's ``save_state`` (SHARDED_STATE_DICT) lays it out."""
    root = tmp_path / "checkpoint_0"
    root.mkdir()
    _dcp(root / "pytorch_model_fsdp_0", {"model": _model()})
    torch.save({"last_epoch": 2}, root / "scheduler.bin")
    for rank in (0, 1):
        torch.save({"step": 2, "rank": rank}, root / f"random_states_{rank}.pkl")
    return root


def to_accelerate(src: Path, dst: Path) -> list:
    return ["convert", src, dst, "--to", "sharded", "--format", "accelerate", "--world-size", "1"]


def assert_accelerate_refused(capsys, acc: Path, out: Path, line: str) -> None:
    """``convert`` to an accelerate DST and ``inspect`` both refuse ``acc`` with ``line``; nothing is written."""
    assert error_of(capsys, to_accelerate(acc, out / "dst")) == (3, line)
    assert_nothing_written(out)
    assert error_of(capsys, ["inspect", acc]) == (3, line)


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("random_states_1.pkl", "credentials"),  # replaces a carried file
        ("sampler.bin", "credentials"),  # a carried file of its own
        ("extra", "tree"),  # a carried directory: the whole outside tree
        ("logs/ssh", "tree"),  # deep inside a carried directory
        ("logs/aws", "credentials"),
        ("scheduler.bin", "scheduler.bin"),  # a part that is read, not carried
        ("pytorch_model_fsdp_0", "model_dcp"),  # the model's DCP directory
    ],
)
def test_an_accelerate_entry_linked_outside_src_is_refused_and_nothing_is_copied(
    capsys, acc, elsewhere, out, name, target
):
    link = acc / name
    if link.exists():
        if link.is_dir():
            link.rename(acc.parent / "moved")
        else:
            link.unlink()
    if link.parent != acc:  # inside a carried directory, beside a file of its own
        link.parent.mkdir()
        (link.parent / "events.txt").write_text("step 2\n")
    link.symlink_to(elsewhere / target)
    line = (
        f"shardckpt: error: '{link}': resolves to '{elsewhere / target}', outside '{acc}': "
        f"{OUTSIDE_HINT}"
    )
    assert_accelerate_refused(capsys, acc, out, line)


def test_a_link_relative_to_a_moved_checkpoint_is_judged_where_it_lands(capsys, acc, out):
    # A link that stayed inside when the directory was saved leads out once it is copied.
    (acc / "random_states_1.pkl").unlink()
    (acc / "random_states_1.pkl").symlink_to(Path("..") / "random_states_1.pkl")
    (acc.parent / "random_states_1.pkl").write_bytes(MARKER)
    assert error_of(capsys, to_accelerate(acc, out / "dst")) == (
        3,
        f"shardckpt: error: '{acc / 'random_states_1.pkl'}': resolves to "
        f"'{acc.parent / 'random_states_1.pkl'}', outside '{acc}': {OUTSIDE_HINT}",
    )
    assert_nothing_written(out)


def test_a_link_to_a_file_inside_src_is_copied_as_a_regular_file(acc, out):
    (acc / "random_states_1.pkl").unlink()
    (acc / "random_states_1.pkl").symlink_to("random_states_0.pkl")
    (acc / "logs").mkdir()
    (acc / "logs" / "last_scheduler.bin").symlink_to(acc / "scheduler.bin")
    dst = out / "dst"
    assert run([str(a) for a in to_accelerate(acc, dst)]) == 0
    for name, original in (
        ("random_states_1.pkl", "random_states_0.pkl"),
        ("logs/last_scheduler.bin", "scheduler.bin"),
    ):
        assert not (dst / name).is_symlink() and (dst / name).is_file()
        assert (dst / name).read_bytes() == (acc / original).read_bytes()


def test_carried_files_keep_their_permission_bits(acc, out):
    (acc / "random_states_0.pkl").chmod(0o600)
    (acc / "random_states_1.pkl").chmod(0o640)
    (acc / "logs").mkdir(mode=0o700)
    (acc / "logs" / "events.txt").write_text("step 2\n")
    (acc / "logs" / "events.txt").chmod(0o600)
    (acc / "logs").chmod(0o700)
    dst = out / "dst"
    assert run([str(a) for a in to_accelerate(acc, dst)]) == 0

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(dst / "random_states_0.pkl") == 0o600
    assert mode(dst / "random_states_1.pkl") == 0o640
    assert mode(dst / "logs") == 0o700
    assert mode(dst / "logs" / "events.txt") == 0o600
    assert (dst / "logs" / "events.txt").read_text() == "step 2\n"


# ------------------------------------------------------------ what would never end (item 7)


def _two_links_to_each_other(acc: Path) -> Path:
    (acc / "a").mkdir()
    (acc / "b").mkdir()
    (acc / "a" / "to_b").symlink_to(Path("..") / "b")
    (acc / "b" / "to_a").symlink_to(Path("..") / "a")
    return acc / "a" / "to_b" / "to_a"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["random_states_1.pkl", "logs/events.txt"])
@pytest.mark.parametrize("kind", ["link-to-dev-zero", "fifo", "dangling-link"])
def test_a_carried_file_that_never_ends_is_refused_before_any_byte_is_copied(
    capsys, acc, out, name, kind
):
    line = make_bad(acc / name, kind, acc)
    assert_accelerate_refused(capsys, acc, out, line)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "target", "back_to"),
    [("extra", ".", ""), ("logs/x/up", "..", "logs"), ("logs/x/top", "../..", "")],
)
def test_a_carried_directory_linked_back_to_one_it_lies_in_is_refused_as_a_loop(
    capsys, acc, out, name, target, back_to
):
    (acc / name).parent.mkdir(parents=True, exist_ok=True)
    (acc / name).symlink_to(target)
    line = (
        f"shardckpt: error: '{acc / name}': is a symlink loop: it leads back to "
        f"'{(acc / back_to).resolve()}', a directory it lies in: remove the link from the checkpoint"
    )
    assert_accelerate_refused(capsys, acc, out, line)


@pytest.mark.timeout(60)
def test_two_directories_linked_to_each_other_are_a_loop(capsys, acc, out):
    where = _two_links_to_each_other(acc)
    assert error_of(capsys, to_accelerate(acc, out / "dst")) == (
        3,
        f"shardckpt: error: '{where}': is a symlink loop: it leads back to "
        f"'{(acc / 'a').resolve()}', a directory it lies in: remove the link from the checkpoint",
    )
    assert_nothing_written(out)


# ------------------------------------------------------------ --hf-config's companions (item 3)

CONFIG = {"model_type": "tiny", "hidden_size": 48}


@pytest.fixture
def weights(tmp_path) -> Path:
    """Return a flat ``torch.save`` of a model's weights, alone in its directory."""
    (tmp_path / "run").mkdir()
    torch.save(_model(), tmp_path / "run" / "model.pt")
    return tmp_path / "run" / "model.pt"


@pytest.fixture
def base(tmp_path) -> Path:
    """Return a model directory: config.json and a tokenizer file."""
    root = tmp_path / "base"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    (root / "tokenizer_config.json").write_text("{}")
    return root


def to_hf(src: Path, dst: Path, *more) -> list:
    return ["convert", src, dst, "--to", "full", "--format", "hf", *more]


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("tokenizer.json", "credentials"),
        ("config.json", "credentials"),
        ("special_tokens_map.json", "tree/id_rsa"),
        ("modeling_tiny.py", "credentials"),  # code auto_map names
    ],
)
def test_a_companion_linked_outside_the_config_directory_is_refused(
    capsys, weights, base, elsewhere, out, name, target
):
    if name.endswith(".py"):
        (base / "config.json").write_text(
            json.dumps({**CONFIG, "auto_map": {"AutoModel": "modeling_tiny.Tiny"}})
        )
    (base / name).unlink(missing_ok=True)
    (base / name).symlink_to(elsewhere / target)
    assert error_of(capsys, to_hf(weights, out / "hf", "--hf-config", base)) == (
        3,
        f"shardckpt: error: '{base / name}': resolves to '{elsewhere / target}', outside "
        f"'{base}': {OUTSIDE_HINT}",
    )
    assert_nothing_written(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["vocab.txt", "tokenizer.model", "config.json"])
@pytest.mark.parametrize("kind", list(BAD))
def test_a_companion_that_is_not_a_regular_file_is_refused(capsys, weights, base, out, name, kind):
    line = make_bad(base / name, kind, base)
    assert error_of(capsys, to_hf(weights, out / "hf", "--hf-config", base)) == (3, line)
    assert_nothing_written(out)


def test_a_hub_snapshot_whose_files_link_into_its_blobs_is_copied(weights, tmp_path, out):
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for blob, name, text in (
        ("e3b0", "config.json", json.dumps(CONFIG)),
        ("9f86", "vocab.txt", "a\nb\n"),
    ):
        (repo / "blobs" / blob).write_text(text)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    assert run([str(a) for a in to_hf(weights, out / "hf", "--hf-config", snapshot, "-q")]) == 0
    for name in ("config.json", "vocab.txt"):
        assert not (out / "hf" / name).is_symlink()
        assert (out / "hf" / name).read_bytes() == (snapshot / name).read_bytes()


def test_a_hub_snapshot_link_that_leaves_the_repository_is_refused(
    capsys, weights, tmp_path, elsewhere, out
):
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "blobs").mkdir()
    (snapshot / "config.json").write_text(json.dumps(CONFIG))
    (snapshot / "tokenizer.json").symlink_to(elsewhere / "credentials")
    assert error_of(capsys, to_hf(weights, out / "hf", "--hf-config", snapshot)) == (
        3,
        f"shardckpt: error: '{snapshot / 'tokenizer.json'}': resolves to "
        f"'{elsewhere / 'credentials'}', outside '{snapshot}': {OUTSIDE_HINT}",
    )
    assert_nothing_written(out)


def test_a_config_in_src_with_a_companion_linked_outside_is_not_copied_with_a_note(
    capsys, tmp_path, elsewhere, out
):
    # Not named by the user: the weights are still written, and nothing of the config dir.
    ckpt = tmp_path / "checkpoint-7"
    _dcp(ckpt, {"model": _model()})
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    (ckpt / "tokenizer.json").symlink_to(elsewhere / "credentials")
    assert run([str(a) for a in to_hf(ckpt, out / "hf", "-q")]) == 0
    assert capsys.readouterr().err.strip() == (
        f"shardckpt: note: not copying config.json from '{ckpt}': '{ckpt / 'tokenizer.json'}': "
        f"resolves to '{elsewhere / 'credentials'}', outside '{ckpt}': {OUTSIDE_HINT}"
    )
    assert leaked(out) == []
    assert sorted(os.listdir(out / "hf")) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


def test_a_config_beside_a_directory_src_is_not_used_but_named_in_a_note(capsys, tmp_path, out):
    downloads = tmp_path / "downloads"  # a shared folder: its config is another model's
    _dcp(downloads / "ckpt", {"model": _model()})
    (downloads / "config.json").write_text(json.dumps(CONFIG))
    (downloads / "tokenizer.json").write_bytes(MARKER)
    assert run([str(a) for a in to_hf(downloads / "ckpt", out / "hf", "-q")]) == 0
    assert capsys.readouterr().err.strip() == (
        f"shardckpt: note: not copying config.json from '{downloads}', the directory SRC is in: "
        f"pass --hf-config '{downloads}' if it is this model's"
    )
    assert leaked(out) == []
    assert not (out / "hf" / "config.json").exists()


# ------------------------------------------------------------ a file present but not a file (item 10)


@pytest.fixture
def lightning(tmp_path) -> Path:
    """Return a Lightning sharded checkpoint: DCP of the module's state, meta.pt beside it."""
    root = tmp_path / "epoch=1-step=3.ckpt"
    _dcp(root, {"model": _model()})
    torch.save({"step": 3, "epoch": 1, "hyper_parameters": {"lr": 0.1}}, root / "meta.pt")
    return root


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{src}"],
        ["convert", "{src}", "{out}/dst.pt", "--to", "full"],
        [
            "convert",
            "{src}",
            "{out}/dst",
            "--to",
            "sharded",
            "--format",
            "lightning",
            "--world-size",
            "2",
        ],
        [
            "convert",
            "{src}",
            "{out}/dst",
            "--to",
            "sharded",
            "--from",
            "lightning",
            "--world-size",
            "1",
        ],
        ["diff", "{src}", "{src}"],
    ],
)
def test_a_lightning_meta_pt_that_is_not_a_file_is_refused_not_read_as_plain_dcp(
    capsys, lightning, out, kind, argv
):
    line = make_bad(lightning / "meta.pt", kind, lightning)
    argv = [a.format(src=lightning, out=out) for a in argv]
    assert error_of(capsys, argv) == (3, line)
    assert_nothing_written(out)


def test_a_lightning_meta_pt_linked_outside_src_is_refused(capsys, lightning, elsewhere, out):
    (lightning / "meta.pt").unlink()
    torch.save({"step": 3, "token": MARKER.decode()}, elsewhere / "meta.pt")
    (lightning / "meta.pt").symlink_to(elsewhere / "meta.pt")
    assert error_of(capsys, ["convert", lightning, out / "dst.pt", "--to", "full"]) == (
        3,
        f"shardckpt: error: '{lightning / 'meta.pt'}': resolves to '{elsewhere / 'meta.pt'}', "
        f"outside '{lightning}': {OUTSIDE_HINT}",
    )
    assert_nothing_written(out)


def _dcp_metadata(root: Path) -> Path:
    _dcp(root, {"model": _model()})
    os.remove(root / ".metadata")
    return root / ".metadata"


def _torch_checkpointing_metadata(root: Path) -> Path:
    root.mkdir()
    return root / "metadata.pkl"


def _hf_index(root: Path) -> Path:
    from safetensors.torch import save_file

    root.mkdir()
    save_file(_model(), root / "model-00001-of-00001.safetensors")
    return root / "model.safetensors.index.json"


def _second_rank_file(root: Path) -> Path:
    root.mkdir()
    torch.save(_model(), root / "rank_0.pt")
    return root / "rank_1.pt"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "layout", [_dcp_metadata, _torch_checkpointing_metadata, _hf_index, _second_rank_file]
)
@pytest.mark.parametrize("kind", list(BAD))
def test_a_file_detection_looks_for_that_is_not_a_file_is_named_not_taken_for_absent(
    capsys, tmp_path, out, layout, kind
):
    src = tmp_path / "ckpt"
    line = make_bad(layout(src), kind, src)
    assert error_of(capsys, ["inspect", src]) == (3, line)
    assert error_of(capsys, ["convert", src, out / "dst.pt", "--to", "full"]) == (3, line)
    assert_nothing_written(out)


# ------------------------------------------------------------ a DCP save's data files


@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize(
    "command", ["inspect", "convert", "verify", "diff"], ids=lambda c: c.split()[0]
)
def test_a_dcp_data_file_that_is_not_a_regular_file_is_named_not_waited_on(
    capsys, tmp_path, out, kind, command
):
    # Format detection peeks into a data file (safetensors-serialized DCP?): a FIFO
    # there used to block it forever, before the reader's own gate was reached.
    src = tmp_path / "src"
    _dcp(src, {"model": _model()})
    line = make_bad(src / "__0_0.distcp", kind, src)
    argv = {
        "inspect": ["inspect", src],
        "convert": ["convert", src, out / "full.pt", "--to", "full"],
        "verify": ["verify", src],
        "diff": ["diff", src, src],
    }[command]
    assert error_of(capsys, argv) == (3, line)
    assert_nothing_written(out)
