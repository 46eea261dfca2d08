"""Which files the DeepSpeed and Megatron readers open: only SRC's own, each once (issue 30 items 3, 7, 8-11).

Every file they open passes the source gate (``core/files.py``): a regular file inside SRC
once symlinks are resolved (a tag directory and a universal ``zero/<param>`` directory
too), one file per rank, no two names for one file. A parameter name used as a path is
one path component; ``partition_count`` is checked against the files before anything is
built for it; ``latest`` is read up to 1 KiB and never shown beyond a short tag. The
hostile sources are copies of the DeepSpeed goldens (and the Megatron golden) with one
file linked, added or changed; files planted outside SRC hold tensors of ``MARK``, which
must never reach DST. Each is refused with exit 3 and one line naming the file, through
convert, verify and inspect --verify, and nothing is written: DST's parent stays empty.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from deepspeed_files import copy_run, edit_file
from deepspeed_goldens import run_dir, universal_dir

from shardckpt.cli.app import run

MARK = 1234.5678
"""The value of every tensor planted outside SRC: its bytes under DST's parent mean a leak."""
_MARK_BYTES = struct.pack("<f", MARK) * 2
MEGATRON = Path(__file__).resolve().parents[1] / "goldens" / "megatron" / "gpt-tp2"
TAG = "global_step3"
SEPARATE = (
    "copy each file itself into the checkpoint directory, from where the checkpoint was saved"
)
OUTSIDE = (
    "shardckpt reads only the files inside it: copy the file in instead of linking to it, "
    "or remove the link"
)
NOT_DEEPSPEEDS = "the file is not one DeepSpeed wrote, or was changed after; re-copy the checkpoint"
UNIVERSAL_AGAIN = "the universal checkpoint is incomplete; run ds_to_universal again"
TAG_ITSELF = "pass the tag directory (global_stepN) itself"


def optim(rank: int, digits: str | None = None) -> str:
    """Return the name of rank ``rank``'s optimizer file of the fp32 goldens (``digits``: the rank as spelled)."""
    return f"zero_pp_rank_{digits or rank}_mp_rank_00_optim_states.pt"


def model3(rank: int, digits: str | None = None) -> str:
    """Return the name of rank ``rank``'s ZeRO-3 model-states file."""
    return f"zero_pp_rank_{digits or rank}_mp_rank_00_model_states.pt"


MODEL12 = "mp_rank_00_model_states.pt"


@pytest.fixture
def out(tmp_path) -> Path:
    """Return the (empty) directory DST is written in."""
    (tmp_path / "out").mkdir()
    return tmp_path / "out"


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """Return a directory outside every SRC of a test."""
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "elsewhere"


def _mark(obj: object) -> object:
    """Return ``obj`` with every floating tensor in it (dicts, lists) filled with ``MARK``."""
    if isinstance(obj, torch.Tensor):
        return torch.full_like(obj, MARK) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _mark(v)
    elif isinstance(obj, list):
        obj[:] = [_mark(v) for v in obj]
    return obj


def marked_copy(path: Path, to: Path) -> Path:
    """Return a copy of the DeepSpeed file ``path`` at ``to``, every floating tensor ``MARK``."""
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, to)
    edit_file(to, _mark)
    return to


def link_out(path: Path, elsewhere: Path) -> Path:
    """Replace ``path`` (a file or directory of SRC) by a symlink to a marked copy outside SRC; return the copy."""
    target = elsewhere / path.name
    if path.is_dir():
        shutil.copytree(path, target)
        for file in sorted(target.rglob("*.pt")):
            edit_file(file, _mark)
        shutil.rmtree(path)
    else:
        marked_copy(path, target)
        path.unlink()
    path.symlink_to(target)
    return target


def leaked(directory: Path) -> list[str]:
    """Return the files under ``directory`` (links not followed) that hold ``MARK``'s bytes."""
    found = []
    for here, _dirs, names in os.walk(directory):
        for name in names:
            path = Path(here) / name
            if not path.is_symlink() and _MARK_BYTES in path.read_bytes():
                found.append(str(path))
    return found


COMMANDS = {
    "convert": lambda src, out: ["convert", src, out / "dst.pt", "--to", "full"],
    "verify": lambda src, out: ["verify", src],
    "inspect --verify": lambda src, out: ["inspect", src, "--verify"],
}


def refused(capsys, src: Path, out: Path, command: str) -> tuple[int, str]:
    """Return the exit code and last error line of ``command`` on ``src``; nothing may be written."""
    code = run([str(a) for a in COMMANDS[command](src, out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert os.listdir(out) == []  # no DST, no .dst.pt.shardckpt-partial, no lock
    assert leaked(out) == []
    return code, lines[-1] if lines else ""


def _link(kind: str, path: Path, target: Path) -> None:
    path.unlink()
    if kind == "symlink":
        path.symlink_to(target.name)
    else:
        os.link(target, path)


# ------------------------------------------------------------ item 3: one rank's file as another's


LINKED = {
    "zero3 model-states": ("z3-fp32", model3(1), model3(0), "model-states"),
    "zero3 optimizer": ("z3-fp32", optim(1), optim(0), "optimizer"),
    "zero2 optimizer": ("z2-fp32", optim(1), optim(0), "optimizer"),
    "zero1 optimizer": ("z1-fp32", optim(1), optim(0), "optimizer"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["symlink", "hard link"])
@pytest.mark.parametrize("case", LINKED)
def test_a_ranks_file_linked_to_another_ranks_is_refused(
    capsys, tmp_path, out, case, kind, command
):
    # Before, ZeRO-3 rank 1's files linked to rank 0's converted with exit 0 and 24 of
    # the 33 tensors wrong (rank 0's partitions read as rank 1's).
    name, linked, target, what = LINKED[case]
    src = copy_run(run_dir(name), tmp_path)
    _link(kind, src / TAG / linked, src / TAG / target)
    assert refused(capsys, src, out, command) == (
        3,
        f"shardckpt: error: '{src / TAG / linked}': is the same file as '{target}' (a symlink "
        f"or hard link), but rank 1's {what} file and rank 0's {what} file must be two files: "
        f"{SEPARATE}",
    )


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_a_universal_ranks_model_states_linked_to_another_ranks_is_refused(
    capsys, tmp_path, out, kind, command
):
    src = copy_run(universal_dir("z3-fp32"), tmp_path)
    _link(kind, src / TAG / model3(1), src / TAG / model3(0))
    assert refused(capsys, src, out, command) == (
        3,
        f"shardckpt: error: '{src / TAG / model3(1)}': is the same file as '{model3(0)}' (a "
        "symlink or hard link), but rank 1's model-states file and rank 0's model-states file "
        f"must be two files: {SEPARATE}",
    )


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_a_universal_parameter_file_linked_to_another_parameters_is_refused(
    capsys, tmp_path, out, kind, command
):
    # fc1.bias and norm.weight are both 7 elements: a link read one as the other.
    src = copy_run(universal_dir("z2-bf16"), tmp_path)
    zero = src / TAG / "zero"
    (zero / "norm.weight" / "fp32.pt").unlink()
    if kind == "symlink":
        (zero / "norm.weight" / "fp32.pt").symlink_to("../fc1.bias/fp32.pt")
    else:
        os.link(zero / "fc1.bias" / "fp32.pt", zero / "norm.weight" / "fp32.pt")
    assert refused(capsys, src, out, command) == (
        3,
        f"shardckpt: error: '{zero / 'norm.weight' / 'fp32.pt'}': is the same file as "
        "'fp32.pt' (a symlink or hard link), but 'zero/norm.weight/fp32.pt' and "
        f"'zero/fc1.bias/fp32.pt' must be two files: {SEPARATE}",
    )


# ------------------------------------------------------------ item 7: a second file for one rank


SECOND = {
    # case: (golden, file copied, its copy's name, the rank both names say, the other name)
    "zero2 optimizer": ("z2-fp32", optim(1), optim(1, "01"), 1, optim(1)),
    "zero3 optimizer": ("z3-fp32", optim(1), optim(0, "00"), 0, optim(0)),
    "zero3 model-states": ("z3-fp32", model3(0), model3(1, "01"), 1, model3(1)),
    "zero2 model-states": ("z2-fp32", MODEL12, "mp_rank_000_model_states.pt", 0, MODEL12),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", SECOND)
def test_a_second_file_for_one_rank_is_refused_not_ignored(capsys, tmp_path, out, case, command):
    # Before, one of the two names was silently ignored.
    name, copied, second, rank, other = SECOND[case]
    src = copy_run(run_dir(name), tmp_path)
    shutil.copy(src / TAG / copied, src / TAG / second)
    first, last = sorted((second, other))
    assert refused(capsys, src, out, command) == (
        3,
        f"shardckpt: error: '{src / TAG}': holds two files of rank {rank}: '{first}' and "
        f"'{last}': the directory mixes two saves or copies of one file; keep only the files "
        "DeepSpeed wrote",
    )


# ------------------------------------------------------------ item 8: files outside SRC


def _outside(what: Path, elsewhere: Path, within: Path) -> str:
    """Link ``what`` to a marked copy outside SRC; return the error line naming it."""
    target = link_out(what, elsewhere)
    return f"shardckpt: error: '{what}': resolves to '{target}', outside '{within}': {OUTSIDE}"


LINKED_OUT = {
    # case: (golden, path under SRC linked out)
    "tag directory": (run_dir, "z2-fp32", TAG),
    "zero2 optimizer file": (run_dir, "z2-fp32", f"{TAG}/{optim(1)}"),
    "zero2 model-states file": (run_dir, "z2-fp32", f"{TAG}/{MODEL12}"),
    "zero3 optimizer file": (run_dir, "z3-fp32", f"{TAG}/{optim(0)}"),
    "zero3 model-states file": (run_dir, "z3-fp32", f"{TAG}/{model3(1)}"),
    "universal tag directory": (universal_dir, "z2-bf16", TAG),
    "universal optimizer_state.pt": (universal_dir, "z3-fp32", f"{TAG}/zero/optimizer_state.pt"),
    "universal zero3 model-states file": (universal_dir, "z3-fp32", f"{TAG}/{model3(1)}"),
    "universal zero2 model-states file": (universal_dir, "z2-bf16", f"{TAG}/{MODEL12}"),
    "universal parameter directory": (universal_dir, "z2-bf16", f"{TAG}/zero/fc1.weight"),
    "universal parameter file": (universal_dir, "z3-fp32", f"{TAG}/zero/fc2.weight/fp32.pt"),
    "universal moment file": (universal_dir, "z2-bf16", f"{TAG}/zero/fc1.bias/exp_avg.pt"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", LINKED_OUT)
def test_a_file_or_directory_linked_outside_src_is_refused(
    capsys, tmp_path, out, elsewhere, case, command
):
    # Before, each was read from where the link led: its planted tensors reached DST.
    where, name, inner = LINKED_OUT[case]
    src = copy_run(where(name), tmp_path)
    line = _outside(src / inner, elsewhere, src)
    assert refused(capsys, src, out, command) == (3, line)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_tag_directory_passed_as_src_reads_no_file_outside_it(
    capsys, tmp_path, out, elsewhere, command
):
    tag = copy_run(run_dir("z3-fp32"), tmp_path) / TAG
    line = _outside(tag / optim(1), elsewhere, tag)
    assert refused(capsys, tag, out, command) == (3, line)


def _rename_param(path: Path, old: str, new: str) -> None:
    def edit(sd: dict) -> None:
        for g, group in enumerate(sd["param_shapes"]):
            sd["param_shapes"][g] = type(group)(
                (new if k == old else k, v) for k, v in group.items()
            )
        sd["module"] = {new if k == old else k: v for k, v in sd["module"].items()}

    edit_file(path, edit)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "name, evil",
    [
        ("z2-bf16", "../../../x/leak"),
        ("z3-fp32", "../../../x/leak"),
        ("z2-bf16", ".."),
        ("z2-bf16", "a/b"),
    ],
)
def test_a_parameter_name_that_is_a_path_is_refused(capsys, tmp_path, out, name, evil, command):
    # Before, zero/../../../x/leak/*.pt, outside SRC, were read as the parameter's.
    src = copy_run(universal_dir(name), tmp_path)
    models = sorted((src / TAG).glob("*model_states.pt"))
    for path in models:
        _rename_param(path, "fc1.weight", evil)
    for file in sorted((src / TAG / "zero" / "fc1.weight").iterdir()):
        marked_copy(file, tmp_path / "x" / "leak" / file.name)
    assert refused(capsys, src, out, command) == (
        3,
        f"shardckpt: error: '{models[0]}': 'param_shapes' names {evil!r}, which is not a "
        "parameter name (ds_to_universal keeps each in a directory 'zero/<name>'): "
        f"{NOT_DEEPSPEEDS}",
    )


# ------------------------------------------------------------ items 9 and 11: 'latest'


def _latest_outside(src: Path, elsewhere: Path, pointer: str) -> str:
    # A file outside that names the tag, as /etc/passwd would name something: never read.
    secret = elsewhere / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n" * 40)
    (src / pointer).unlink()
    (src / pointer).symlink_to(secret)
    return (
        f"shardckpt: error: '{src / pointer}': resolves to '{secret}', outside '{src}': {OUTSIDE}"
    )


def _latest_naming_tag_outside(src: Path, elsewhere: Path, pointer: str) -> str:
    secret = elsewhere / "latest"
    secret.write_text(TAG)
    (src / pointer).unlink()
    (src / pointer).symlink_to(secret)
    return (
        f"shardckpt: error: '{src / pointer}': resolves to '{secret}', outside '{src}': {OUTSIDE}"
    )


def _content(data: bytes, what: str) -> Callable[[Path, Path, str], str]:
    def make(src: Path, _elsewhere: Path, pointer: str) -> str:
        (src / pointer).unlink()
        (src / pointer).write_bytes(data)
        return f"shardckpt: error: '{src / pointer}': {what}: {TAG_ITSELF}"

    return make


def _huge(size: int) -> Callable[[Path, Path, str], str]:
    def make(src: Path, _elsewhere: Path, pointer: str) -> str:
        (src / pointer).unlink()
        with open(src / pointer, "wb") as f:
            f.truncate(size)  # sparse: no disk, but 'size' bytes to a reader
        return (
            f"shardckpt: error: '{src / pointer}': is over 1024 bytes, where DeepSpeed writes "
            f"the name of a tag directory: {TAG_ITSELF}"
        )

    return make


def _fifo(src: Path, _elsewhere: Path, pointer: str) -> str:
    (src / pointer).unlink()
    os.mkfifo(src / pointer)
    return (
        f"shardckpt: error: '{src / pointer}': is a FIFO (named pipe), not a regular file: copy "
        "the checkpoint into a regular file first; shardckpt does not read pipes or devices"
    )


LATEST = {
    "symlinked outside": _latest_outside,
    "naming the tag from outside": _latest_naming_tag_outside,
    "3 GiB": _huge(3 << 30),
    "1 MiB of a name": _content(
        b"g" * (1 << 20),
        "is over 1024 bytes, where DeepSpeed writes the name of a tag directory",
    ),
    "binary garbage": _content(
        bytes(range(128, 256)) * 2, "does not hold a tag name (its bytes are not text)"
    ),
    "a long name": _content(
        b"x" * 300,
        f"names {'x' * 48!r}… (300 characters), which is not a directory name",
    ),
    "control characters": _content(
        b"global_step3\x1b[2J", "names 'global_step3\\x1b[2J', which is not a directory name"
    ),
    "fifo": _fifo,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("pointer", ["latest", "latest_universal"])
@pytest.mark.parametrize("case", LATEST)
def test_a_latest_file_that_is_not_a_short_tag_in_src_is_refused_and_never_shown(
    capsys, tmp_path, out, elsewhere, case, pointer, command
):
    where = run_dir("z2-fp32") if pointer == "latest" else universal_dir("z2-bf16")
    src = copy_run(where, tmp_path)
    line = LATEST[case](src, elsewhere, pointer)
    code, got = refused(capsys, src, out, command)
    assert (code, got) == (3, line)
    assert "root:x" not in got


def test_a_file_passed_alone_beside_a_huge_latest_names_its_tag_directory(capsys, tmp_path, out):
    # The hint reads the run's 'latest' to name the directory to pass: at most 1 KiB of it.
    src = copy_run(run_dir("z2-fp32"), tmp_path)
    _huge(3 << 30)(src, tmp_path, "latest")
    lone = src / TAG / optim(1)
    code = run(["convert", str(lone), str(out / "dst.pt"), "--to", "full"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert (code, line) == (
        3,
        f"shardckpt: error: '{lone}': is one file of a DeepSpeed ZeRO checkpoint (rank 1's "
        f"slice of the fp32 weights and optimizer state): pass the directory '{src / TAG}', "
        "which shardckpt reads as one DeepSpeed checkpoint (every rank's files, no pickle run)",
    )
    assert os.listdir(out) == []


# ------------------------------------------------------------ item 10: partition_count


HUGE = 10**12


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", ["z1-fp32", "z2-fp32", "z3-fp32"])
def test_a_huge_partition_count_is_refused_before_anything_is_built_for_it(
    capsys, tmp_path, out, name, command
):
    # Before, ZeRO-1/2's [10**12, 10**12] built set(range(10**12)): an internal error
    # at a 6 GB memory cap.
    src = copy_run(run_dir(name), tmp_path)
    value = HUGE if name == "z3-fp32" else [HUGE, HUGE]
    for rank in (0, 1):
        edit_file(
            src / TAG / optim(rank),
            lambda sd: sd["optimizer_state_dict"].__setitem__("partition_count", value),
        )
    assert refused(capsys, src, out, command) == (
        3,
        f"shardckpt: error: '{src / TAG}': has no optimizer file of data-parallel rank 2 (found "
        "ranks 0, 1): copy every rank's files of the save",
    )


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", ["z2-bf16", "z3-fp32"])
@pytest.mark.parametrize("count", [HUGE, 3])
def test_a_universal_partition_count_is_checked_against_the_save(
    capsys, tmp_path, out, name, count, command
):
    # Before, any count was taken for the world size (inspect said 'world size 10**12').
    src = copy_run(universal_dir(name), tmp_path)
    common = src / TAG / "zero" / "optimizer_state.pt"
    zero3 = name == "z3-fp32"
    edit_file(common, lambda sd: sd.__setitem__("partition_count", count if zero3 else [count] * 2))
    expected = (
        f"'{src / TAG}': has no model-states file of data-parallel rank 2 (found ranks 0, 1): "
        "copy every rank's files of the save"
        if zero3
        else f"'{common}': partitions over {count} ranks, but '{MODEL12}' was saved by 2 "
        f"(dp_world_size): {UNIVERSAL_AGAIN}"
    )
    assert refused(capsys, src, out, command) == (3, "shardckpt: error: " + expected)


# ------------------------------------------------------------ Megatron's common.pt and metadata.json


def _marked_common(path: Path, to: Path) -> None:
    obj = torch.load(path, weights_only=False)  # the golden's own file: argparse.Namespace
    obj["leak"] = torch.full((4,), MARK)
    torch.save(obj, to)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("file", ["common.pt", "metadata.json"])
def test_a_megatron_file_linked_outside_src_is_refused(
    capsys, tmp_path, out, elsewhere, file, command
):
    # Before, both were read from where the link led (common.pt's planted tensor in DST).
    src = tmp_path / "ckpt"
    shutil.copytree(MEGATRON, src)
    target = elsewhere / file
    if file == "common.pt":
        _marked_common(src / file, target)
    else:
        shutil.copy(src / file, target)
    (src / file).unlink()
    (src / file).symlink_to(target)
    assert refused(capsys, src, out, command) == (
        3,
        f"shardckpt: error: '{src / file}': resolves to '{target}', outside '{src}': {OUTSIDE}",
    )
