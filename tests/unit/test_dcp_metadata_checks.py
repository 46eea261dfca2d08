"""A DCP ``.metadata`` that does not describe its data files is refused before any data moves.

Each case starts from what ``dcp.save`` itself wrote, edits the ``Metadata`` object the
way a damaged or hostile file could, and expects one line that names the file and the
key, exit 3 (SPEC "Safe by default"), and no DST.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from shardckpt import api
from shardckpt.cli.app import run

DAMAGED = (
    "the .metadata is damaged or was not written by torch.distributed.checkpoint; "
    "re-copy the checkpoint from where it was written"
)
DATA = "__0_0.distcp"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """Return a DCP directory written by ``dcp.save``: a 7x3 weight, two 4-vectors, a value."""
    state = {
        "model": {"w": torch.arange(21.0).reshape(7, 3), "a": torch.ones(4), "b": torch.zeros(4)},
        "epoch": 1,
    }
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    return tmp_path / "ckpt"


def edit(ckpt: Path, change) -> None:
    """Apply ``change`` to the ``Metadata`` object in ``ckpt/.metadata`` and write it back."""
    path = ckpt / ".metadata"
    md = pickle.loads(path.read_bytes())
    change(md)
    path.write_bytes(pickle.dumps(md))


def index_of(md, key: str) -> MetadataIndex:
    """Return the ``storage_data`` key of ``key``'s first chunk (or of the value ``key``)."""
    return next(i for i in md.storage_data if i.fqn == key)


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def convert_error(capsys, ckpt: Path) -> tuple[int, str]:
    """Convert ``ckpt`` to a torch file; return (exit code, error line) once no DST is left."""
    dst = ckpt.parent / "out.pt"
    code, line = error_of(capsys, ["convert", ckpt, dst, "--to", "full"])
    assert not dst.exists() and not (ckpt.parent / ".out.pt.shardckpt-partial").exists()
    return code, line


def refused(ckpt: Path, message: str) -> tuple[int, str]:
    return 3, f"shardckpt: error: '{ckpt / '.metadata'}': {message}: {DAMAGED}"


# ---------------------------------------------------------------- chunks tile the tensor


def shrink_chunk(md):
    md.state_dict_metadata["model.w"].chunks[0].sizes = torch.Size([4, 3])


def shift_chunk(md):
    md.state_dict_metadata["model.w"].chunks[0].offsets = torch.Size([1, 0])


def overlap_chunks(md):
    chunk = md.state_dict_metadata["model.w"].chunks[0]
    md.state_dict_metadata["model.w"].chunks.append(
        type(chunk)(offsets=torch.Size([3, 0]), sizes=torch.Size([2, 3]))
    )


def claim_huge_shape(md):
    md.state_dict_metadata["model.w"].size = torch.Size([10**12, 3])


def claim_huge_shape_and_chunk(md):
    entry = md.state_dict_metadata["model.w"]
    entry.size = entry.chunks[0].sizes = torch.Size([10**12, 3])


def wrong_rank_chunk(md):
    md.state_dict_metadata["model.w"].chunks[0].offsets = torch.Size([0])


def dtype_not_a_dtype(md):
    md.state_dict_metadata["model.w"].properties.dtype = "float32"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (shrink_chunk, "the chunks of 'model.w' cover 12 of its 21 elements"),
        (
            shift_chunk,
            "the chunk at [1, 0] of 'model.w' (sizes [7, 3]) lies outside its shape [7, 3]",
        ),
        (overlap_chunks, "the chunks at [0, 0] and [3, 0] of 'model.w' overlap"),
        (claim_huge_shape, "the chunks of 'model.w' cover 21 of its 3000000000000 elements"),
        (
            claim_huge_shape_and_chunk,
            "the chunk at [0, 0] of 'model.w' needs 12000000000000 bytes but 1641 are stored for it",
        ),
        (
            wrong_rank_chunk,
            "a chunk of 'model.w' [7, 3] has offsets [0] and sizes [7, 3]",
        ),
        (dtype_not_a_dtype, "'model.w' has dtype 'float32', not a torch dtype"),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_chunks_that_do_not_tile_their_tensor_are_refused_before_any_read(
    capsys, ckpt, change, message
):
    edit(ckpt, change)
    assert convert_error(capsys, ckpt) == refused(ckpt, message)
    assert error_of(capsys, ["inspect", ckpt]) == refused(ckpt, message)


# ---------------------------------------------------------------- storage entries


def share_storage(md):
    md.storage_data[index_of(md, "model.b")] = md.storage_data[index_of(md, "model.a")]


def drop_chunk_storage(md):
    del md.storage_data[index_of(md, "model.w")]


def drop_value_storage(md):
    del md.storage_data[index_of(md, "epoch")]


def shrink_length(md):
    md.storage_data[index_of(md, "model.w")].length = 50


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (share_storage, f"'model.a' and 'model.b' are stored in the same bytes of '{DATA}'"),
        (drop_chunk_storage, "no storage entry for the chunk at [0, 0] of 'model.w'"),
        (drop_value_storage, "no storage entry for the value 'epoch'"),
        (shrink_length, "the chunk at [0, 0] of 'model.w' needs 84 bytes but 50 are stored for it"),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_storage_that_is_missing_or_shared_is_refused(capsys, ckpt, change, message):
    edit(ckpt, change)
    assert convert_error(capsys, ckpt) == refused(ckpt, message)


def test_two_keys_mapped_to_one_storage_never_read_one_tensor_as_the_other(capsys, ckpt):
    # Same shape and dtype: DCP would read model.a's ones into model.b without a word.
    edit(ckpt, share_storage)
    code, line = error_of(capsys, ["diff", ckpt, ckpt])
    assert (code, line) == refused(
        ckpt, f"'model.a' and 'model.b' are stored in the same bytes of '{DATA}'"
    )


@pytest.mark.parametrize("where", ["../outside.distcp", "sub/../../outside.distcp", "absolute"])
def test_a_storage_path_that_leaves_src_is_refused(capsys, ckpt, where):
    # A readable copy of the data outside SRC: without the check it would be read.
    outside = ckpt.parent / "outside.distcp"
    shutil.copy(ckpt / DATA, outside)
    name = str(outside) if where == "absolute" else where

    def point_outside(md):
        for info in md.storage_data.values():
            info.relative_path = name

    edit(ckpt, point_outside)
    assert convert_error(capsys, ckpt) == (
        3,
        f"shardckpt: error: '{ckpt / '.metadata'}': 'epoch' is stored at '{name}', outside the "
        "checkpoint directory: refusing to read it; re-copy the checkpoint from where it was written",
    )


def test_a_data_file_that_links_outside_src_is_refused(capsys, ckpt):
    outside = ckpt.parent / "elsewhere.distcp"
    shutil.move(ckpt / DATA, outside)
    (ckpt / DATA).symlink_to(outside)
    assert convert_error(capsys, ckpt) == (
        3,
        f"shardckpt: error: '{ckpt / DATA}': links outside the checkpoint directory (to "
        f"'{outside}'), and .metadata stores 'epoch' in it: copy the data files into the "
        "checkpoint directory instead of linking to them",
    )


def test_a_data_file_that_links_inside_src_is_read(capsys, ckpt):
    shutil.move(ckpt / DATA, ckpt / "real.bin")
    (ckpt / DATA).symlink_to("real.bin")
    assert run(["convert", str(ckpt), str(ckpt.parent / "out.pt"), "--to", "full"]) == 0
    assert torch.equal(
        torch.load(ckpt.parent / "out.pt")["model"]["w"], torch.arange(21.0).reshape(7, 3)
    )


def test_a_data_file_that_is_a_directory_is_refused(capsys, ckpt):
    os.remove(ckpt / DATA)
    (ckpt / DATA).mkdir()
    assert convert_error(capsys, ckpt) == (
        3,
        f"shardckpt: error: '{ckpt / DATA}': is a directory, not a file: a file is expected "
        "under this name; re-copy it from where it was saved",
    )


def test_a_truncated_data_file_is_named_with_the_key_it_cuts(capsys, ckpt):
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    info = md.storage_data[index_of(md, "model.w")]
    data = (ckpt / DATA).read_bytes()
    (ckpt / DATA).write_bytes(data[: info.offset + 10])
    assert convert_error(capsys, ckpt) == (
        3,
        f"shardckpt: error: '{ckpt / DATA}': truncated: 'model.w' is stored at bytes "
        f"{info.offset}..{info.offset + info.length} but the file has {info.offset + 10} bytes: "
        "re-copy it from where the checkpoint was written",
    )


# ---------------------------------------------------------------- paths in the tree


def collide_paths(md):
    md.planner_data["model.b"] = ("model", "a")


def path_through_a_leaf(md):
    md.planner_data["model.b"] = ("model", "a", "x")


def path_above_a_leaf(md):
    md.planner_data["epoch"] = ("model",)


def path_is_a_string(md):
    md.planner_data["epoch"] = "epoch"


def path_mixes_key_types(md):
    md.planner_data["epoch"] = ("model", 0)


def path_with_a_huge_index(md):
    md.planner_data["epoch"] = ("epoch", 10**12)


def path_for_a_key_not_stored(md):
    md.planner_data["ghost"] = ("model", "ghost")


def key_not_a_str(md):
    md.state_dict_metadata[5] = BytesStorageMetadata()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            collide_paths,
            "the paths of 'model.a' ('model', 'a') and 'model.b' ('model', 'a') collide",
        ),
        (
            path_through_a_leaf,
            "the paths of 'model.a' ('model', 'a') and 'model.b' ('model', 'a', 'x') collide",
        ),
        (path_above_a_leaf, "the paths of 'model.w' ('model', 'w') and 'epoch' ('model',) collide"),
        (
            path_is_a_string,
            "the path of 'epoch' is 'epoch', not a tuple of str keys and list indices",
        ),
        (
            path_mixes_key_types,
            "the path of 'epoch' ('model', 0) mixes list indices and mapping keys at ('model',)",
        ),
        (
            path_with_a_huge_index,
            "the path of 'epoch' ('epoch', 1000000000000) has list index 1000000000000",
        ),
        (path_for_a_key_not_stored, "planner_data names 'ghost', which .metadata does not store"),
        (key_not_a_str, "key 5 is a int, not a str"),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_paths_that_cannot_build_one_tree_are_refused(capsys, ckpt, change, message):
    edit(ckpt, change)
    assert error_of(capsys, ["inspect", ckpt]) == refused(ckpt, message)


def chunk_without_sizes(md):
    del md.state_dict_metadata["model.w"].chunks[0].sizes


def storage_without_length(md):
    del md.storage_data[index_of(md, "model.w")].length


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (chunk_without_sizes, "a chunk of 'model.w' [7, 3] has offsets [0, 0] and sizes None"),
        (
            storage_without_length,
            # The offset is where this torch's dcp.save put the item (it moves between releases).
            "the storage entry of 'model.w' has relative_path '__0_0.distcp', offset {offset}, "
            "length None",
        ),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_entries_missing_their_fields_are_refused_not_a_traceback(capsys, ckpt, change, message):
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    offset = md.storage_data[index_of(md, "model.w")].offset
    edit(ckpt, change)
    assert error_of(capsys, ["inspect", ckpt]) == refused(ckpt, message.format(offset=offset))


def test_what_dcp_save_writes_passes_every_check(capsys, ckpt):
    assert run(["convert", str(ckpt), str(ckpt.parent / "out.pt"), "--to", "full"]) == 0
    assert api.diff(api.DiffRequest(a=ckpt, b=ckpt.parent / "out.pt")).equal


# ---------------------------------------------------------------- errors while reading data


def test_damaged_bytes_name_the_data_file_and_the_key(capsys, ckpt):
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    info = md.storage_data[index_of(md, "model.w")]
    data = bytearray((ckpt / DATA).read_bytes())
    data[info.offset : info.offset + info.length] = bytes(info.length)
    (ckpt / DATA).write_bytes(bytes(data))
    assert convert_error(capsys, ckpt) == (
        3,
        f"shardckpt: error: '{ckpt / DATA}': cannot read the chunk at [0, 0] of 'model.w' "
        "(BadZipFile: File is not a zip file): the file is damaged or does not match .metadata; "
        "re-copy it from where the checkpoint was written",
    )


def test_a_chunk_larger_than_its_stored_tensor_names_the_data_file_and_the_key(capsys, ckpt):
    # The 4 stored elements of model.a claimed as 5: say where, and what is stored.
    def grow(md):
        entry = md.state_dict_metadata["model.a"]
        entry.size = entry.chunks[0].sizes = torch.Size([5])

    edit(ckpt, grow)
    assert convert_error(capsys, ckpt) == (
        3,
        f"shardckpt: error: '{ckpt / DATA}': the chunk at [0] of 'model.a' is stored as a (4,) "
        "torch.float32 tensor, where .metadata says (5,) torch.float32: the file is damaged or "
        "does not match .metadata; re-copy it from where the checkpoint was written",
    )


@contextlib.contextmanager
def as_unprivileged_user():
    """Run the body as a user that file permissions apply to (root reads any file)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_a_data_file_without_read_permission_says_so_not_truncated(capsys):
    # Under /tmp with 0755 so that the unprivileged user can reach it (pytest's tmp is 0700).
    root = Path(tempfile.mkdtemp(prefix="shardckpt-perm-"))
    try:
        root.chmod(0o755)
        dcp.save({"w": torch.ones(3), "epoch": 1}, checkpoint_id=root / "ckpt", no_dist=True)
        (root / "ckpt").chmod(0o755)
        # Once readable: every module the failing run needs is imported while we are root.
        assert run(["inspect", str(root / "ckpt")]) == 0
        capsys.readouterr()
        (root / "ckpt" / DATA).chmod(0)
        with as_unprivileged_user():
            code, line = error_of(capsys, ["inspect", root / "ckpt"])
        assert (code, line) == (
            4,
            f"shardckpt: error: '{root / 'ckpt' / DATA}': permission denied: "
            "check the file's permissions; shardckpt needs to read it",
        )
    finally:
        shutil.rmtree(root)
