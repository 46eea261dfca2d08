"""torch's private names: found on the torch under test, and each one's fallback when it is gone.

``shardckpt.core.torch_internals`` looks every private torch name up when it is first used.
Each test here takes one away as a torch release might (``monkeypatch``) and checks that
the conversion gives the same bytes by another path, or stops with one line that names
the torch release (exit 2).
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import filesystem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, placement_types

from shardckpt.cli.app import run
from shardckpt.core import torch_internals
from shardckpt.core.errors import UnsupportedTorchError
from shardckpt.core.torch_internals import (
    TESTED_TORCH,
    local_chunk,
    mesh_without_group,
    missing_safe_globals,
    strided_shard,
)
from shardckpt.formats.dcp import plain_metadata
from shardckpt.formats.dcp import reader as dcp_format
from shardckpt.formats.dcp.reader import DcpReader, read_metadata
from shardckpt.formats.dcp.rows import StoredRows
from shardckpt.formats.fsdp1.sharded_tensor_record import ShardedTensorRecord
from shardckpt.formats.fsdp2.reader import describe_placements
from shardckpt.formats.ranks.sharded_tensor_load import load_rank_file
from shardckpt.formats.torch_save.file import load

HINT = f"install a torch release shardckpt is tested with ({TESTED_TORCH})"


def unsupported_line(what: str, need: str) -> str:
    return f"shardckpt: error: torch {torch.__version__} has no {what}, which {need}: {HINT}"


def cli(*argv) -> int:
    return run([str(a) for a in argv])


def error_of(capsys, argv) -> tuple[int, str]:
    code = cli(*argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(7, 3, generator=g), "b": torch.randn(97, 4, generator=g)}


@pytest.fixture
def src(tmp_path):
    """A DCP checkpoint at world size 3 of two tensors with uneven rows (parameters, split)."""
    torch.save({"model": _state()}, tmp_path / "full.pt")
    argv = ["convert", tmp_path / "full.pt", tmp_path / "dcp3", "--to", "sharded"]
    assert cli(*argv, "--world-size", "3") == 0
    return tmp_path / "dcp3"


class _Unrecorded:
    """An attribute torch's loader may set but that reads as absent: a torch that does not record it."""

    def __get__(self, obj, owner=None):
        raise AttributeError("_checkpoint_offset")

    def __set__(self, obj, value):
        pass


# --- every name is there on the torch under test -----------------------------------------


def test_every_private_name_is_found_on_the_torch_under_test():
    assert strided_shard() is placement_types._StridedShard
    assert torch_internals.dcp_metadata_globals() == {
        (module, name): getattr(importlib.import_module(module), name)
        for module, name in torch_internals._DCP_METADATA
    }
    assert torch_internals.dcp_storage_info() is filesystem._StorageInfo
    assert torch_internals.sharded_tensor().ShardedTensor.__name__ == "ShardedTensor"
    assert torch_internals.fake_process_group(1, 4).size() == 4
    assert torch_internals.dcp_v2_3_paths({"a": {"b": torch.ones(1)}}) == [("a", "b")]
    mesh = mesh_without_group(4, 2)
    assert list(mesh.get_coordinate()) == [2]
    assert torch_internals.mesh_world_size(mesh) == 4 and torch_internals.mesh_rank(mesh) == 2


@pytest.mark.parametrize("world_size, rank", [(1, 0), (5, 0), (5, 3), (7, 6)])
def test_a_target_ranks_mesh_is_field_for_field_the_one_devicemesh_builds(world_size, rank):
    built = DeviceMesh("cpu", list(range(world_size)), _init_backend=False, _rank=rank)
    mesh = mesh_without_group(world_size, rank)
    # In the same order: a pickled mesh (in every DTensor of a rank file) keeps it.
    assert list(vars(mesh)) == list(vars(built))
    for name, value in vars(built).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(mesh, name), value), name
        else:
            assert getattr(mesh, name) == value, name
    assert (list(mesh.get_coordinate()), mesh) == ([rank], built)


def test_meshes_of_many_target_ranks_share_what_does_not_depend_on_the_rank():
    # Each of M meshes holding all M ranks made a writer at M = 100,000 run out of memory.
    first, other = mesh_without_group(100_000, 1), mesh_without_group(100_000, 99_999)
    assert first._flatten_rank_map is other._flatten_rank_map
    assert first._rank_map is other._rank_map
    assert (list(first.get_coordinate()), list(other.get_coordinate())) == ([1], [99_999])
    assert first._flatten_mapping is not other._flatten_mapping


# --- DTensor placements ---------------------------------------------------------------------


def test_a_strided_shard_unpickles_weights_only_on_every_tested_torch(tmp_path):
    # torch 2.11 leaves _StridedShard (FSDP+TP's placement) off its allow-list.
    placement = placement_types._StridedShard(0, split_factor=2)
    torch.save({"p": placement, "w": torch.ones(2)}, tmp_path / "rank0.pt")
    assert load(tmp_path / "rank0.pt", trust_pickle=False)["p"] == placement


def test_the_allow_list_adds_only_torchs_own_classes_and_only_what_torch_lacks(monkeypatch):
    assert all(c.__module__.startswith("torch.distributed.tensor") for c in missing_safe_globals())
    assert not set(missing_safe_globals()) & set(torch.serialization.get_safe_globals())
    monkeypatch.delattr(placement_types, "_StridedShard")
    assert strided_shard() is None and missing_safe_globals() == []
    assert describe_placements([Replicate(), Shard(0)], (2, 2)) == "Replicate×Shard(0) over 2×2"


def _dtensor(shape, mesh, placements) -> DTensor:
    """Return the DTensor of ``shape`` whose local shard ``mesh``'s rank holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        torch.zeros(sizes),
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


def _meshes():
    """Yield ``(mesh, placements)`` over 4 ranks: 1-D, and 2-D as HSDP and FSDP+TP save."""
    for rank in range(4):
        one_d = mesh_without_group(4, rank)
        two_d = DeviceMesh("cpu", [[0, 1], [2, 3]], _init_backend=False, _rank=rank)
        yield one_d, [Shard(0)]
        yield one_d, [Shard(1)]
        yield one_d, [Replicate()]
        yield two_d, [Replicate(), Shard(0)]
        yield two_d, [Shard(0), Shard(1)]
        yield two_d, [placement_types._StridedShard(0, split_factor=2), Shard(0)]


@pytest.mark.parametrize("shape", [(7, 3), (3, 5), (97, 48)])
def test_local_chunks_without_torchs_helper_are_the_chunks_torch_gives_dcp(shape, monkeypatch):
    cases = [(mesh, placements) for mesh, placements in _meshes()]
    tensors = [_dtensor(shape, mesh, placements) for mesh, placements in cases]
    with_helper = [local_chunk(t) for t in tensors]
    from torch.distributed.tensor import _utils

    monkeypatch.delattr(_utils, "compute_local_shape_and_global_offset")
    assert [local_chunk(t) for t in tensors] == with_helper
    # A rank whose shard is empty (3 rows over 4 ranks) is among them.
    assert any(0 in sizes for sizes, _ in with_helper) == (min(shape) < 4)


def test_a_partial_dtensors_chunk_without_torchs_helper_is_one_clean_error(monkeypatch):
    from torch.distributed.tensor import _utils

    t = _dtensor((7, 3), mesh_without_group(4, 1), [Partial()])
    assert local_chunk(t) == ((7, 3), (0, 0))
    monkeypatch.delattr(_utils, "compute_local_shape_and_global_offset")
    with pytest.raises(UnsupportedTorchError, match="compute_local_shape_and_global_offset"):
        local_chunk(t)


# --- device meshes -------------------------------------------------------------------------


def _drop_from_pickled_meshes(monkeypatch, name: str) -> None:
    """Make every unpickled DeviceMesh lack ``name``, as one pickled by another torch might."""
    original = DeviceMesh.__setstate__

    def setstate(self, state):
        original(self, {k: v for k, v in state.items() if k != name})

    monkeypatch.setattr(DeviceMesh, "__setstate__", setstate)


def test_rank_files_whose_meshes_do_not_say_the_saving_rank_still_read_bit_exact(
    src, tmp_path, monkeypatch
):
    assert cli("convert", src, tmp_path / "ranks", "--to", "local", "--world-size", "3") == 0
    assert cli("convert", tmp_path / "ranks", tmp_path / "before.pt", "--to", "full") == 0
    _drop_from_pickled_meshes(monkeypatch, "_rank")
    assert cli("convert", tmp_path / "ranks", tmp_path / "after.pt", "--to", "full") == 0
    assert (tmp_path / "after.pt").read_bytes() == (tmp_path / "before.pt").read_bytes()


def test_rank_files_whose_meshes_lack_a_rank_map_stop_in_one_line(
    src, tmp_path, monkeypatch, capsys
):
    assert cli("convert", src, tmp_path / "ranks", "--to", "local", "--world-size", "3") == 0
    _drop_from_pickled_meshes(monkeypatch, "_rank_map")
    assert error_of(capsys, ["inspect", tmp_path / "ranks"]) == (
        2,
        unsupported_line("DeviceMesh._rank_map", "reading fsdp2-ranks files needs"),
    )


def test_writing_dtensors_without_devicemeshs_private_arguments_stops_in_one_line(
    src, tmp_path, monkeypatch, capsys
):
    def init(self, device_type, mesh=None, *, mesh_dim_names=None):
        raise AssertionError("not to be called")

    monkeypatch.setattr(DeviceMesh, "__init__", init)
    # A mesh another test built in this process is kept (one per world size): not here.
    torch_internals._mesh_of.cache_clear()
    dst = tmp_path / "out"
    # DCP's output is planned without DTensors (formats/dcp/save_plan.py); FSDP2's rank
    # files still pickle DTensors on a mesh of each target rank.
    assert error_of(capsys, ["convert", src, dst, "--to", "local", "--world-size", "2"]) == (
        2,
        unsupported_line(
            "DeviceMesh(_init_backend=..., _rank=...)", "writing DTensors for other ranks needs"
        ),
    )
    assert not dst.exists()


def test_rank_files_are_not_written_where_a_mesh_would_lose_its_group_names(
    src, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(lambda group, device_type: None))
    dst = tmp_path / "ranks"
    assert error_of(capsys, ["convert", src, dst, "--to", "local", "--world-size", "2"]) == (
        2,
        unsupported_line("DeviceMesh._dim_group_names", "writing DTensors for other ranks needs"),
    )
    assert not dst.exists()


# --- DCP ------------------------------------------------------------------------------------


def _dcp_source(tmp_path):
    state = {"model": _state(), "t": torch.randn(4, 6).t(), "step": 3}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    return tmp_path / "dcp"


def test_dcp_rows_go_through_dcp_load_bit_exact_when_torch_does_not_say_where_chunks_lie(
    tmp_path, monkeypatch
):
    src = _dcp_source(tmp_path)
    assert cli("convert", src, tmp_path / "before.pt", "--to", "full") == 0
    loaded: list[str] = []
    original = DcpReader._load

    def spy(self, state_dict, planner):
        loaded.extend(state_dict)
        return original(self, state_dict, planner)

    monkeypatch.setattr(DcpReader, "_load", spy)
    monkeypatch.setattr(torch.storage._StorageBase, "_checkpoint_offset", _Unrecorded())
    rows = StoredRows(src, read_metadata(src, trust_pickle=False))
    assert rows.read_into("model.w", torch.empty(7, 3), 0) is False
    assert cli("convert", src, tmp_path / "after.pt", "--to", "full") == 0
    assert (tmp_path / "after.pt").read_bytes() == (tmp_path / "before.pt").read_bytes()
    assert {"model.w", "model.b", "t"} <= set(loaded)


def test_dcp_metadata_naming_a_class_torch_lacks_fails_in_one_line_naming_the_release(
    tmp_path, monkeypatch
):
    src = _dcp_source(tmp_path)
    monkeypatch.delattr(filesystem, "_StorageInfo")
    monkeypatch.setattr(dcp_format, "_VOCABULARY", dcp_format._metadata_vocabulary())
    # Read into plain stand-ins, which need no class of torch's ...
    assert isinstance(read_metadata(src, trust_pickle=False), plain_metadata.Metadata)
    # ... and where torch's classes must read it (a name the stand-ins lack: a release's
    # private class), the line names the release.
    storage_info = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    stand_ins = {k: v for k, v in plain_metadata.VOCABULARY.items() if k != storage_info}
    monkeypatch.setattr(plain_metadata, "VOCABULARY", stand_ins)
    with pytest.raises(UnsupportedTorchError) as raised:
        read_metadata(src, trust_pickle=False)
    assert raised.value.line() == (
        f"'{src / '.metadata'}': torch {torch.__version__} has no "
        f"torch.distributed.checkpoint.filesystem._StorageInfo, which DCP's .metadata needs: "
        f"{HINT}"
    )


def test_dcp_is_not_written_without_the_class_its_metadata_holds(
    src, tmp_path, monkeypatch, capsys
):
    monkeypatch.delattr(filesystem, "_StorageInfo")
    dst = tmp_path / "out"
    assert error_of(capsys, ["convert", src, dst, "--to", "sharded", "--world-size", "2"]) == (
        2,
        unsupported_line(
            "torch.distributed.checkpoint.filesystem._StorageInfo",
            "writing DCP's .metadata needs",
        ),
    )
    assert not dst.exists()


def test_dcp_without_the_pre_2_4_traversal_is_the_same_unless_it_holds_an_empty_mapping(
    tmp_path, monkeypatch, capsys
):
    from torch.distributed.checkpoint import _traverse

    torch.save({"model": _state(), "step": 1}, tmp_path / "plain.pt")
    torch.save({"model": _state(), "optim": {"state": {}}}, tmp_path / "empty.pt")
    at_one = ("--to", "sharded", "--world-size", "1")
    assert cli("convert", tmp_path / "plain.pt", tmp_path / "before", *at_one) == 0
    monkeypatch.delattr(_traverse, "traverse_state_dict_v_2_3")
    assert cli("convert", tmp_path / "plain.pt", tmp_path / "after", *at_one) == 0
    for before in (tmp_path / "before").iterdir():
        assert (tmp_path / "after" / before.name).read_bytes() == before.read_bytes()
    assert error_of(capsys, ["convert", tmp_path / "empty.pt", tmp_path / "e", *at_one]) == (
        2,
        unsupported_line(
            "torch.distributed.checkpoint._traverse.traverse_state_dict_v_2_3",
            "writing an empty mapping to DCP needs",
        ),
    )


# --- torch.save files ------------------------------------------------------------------------


def test_torch_files_are_not_written_without_fake_tensors(src, tmp_path, monkeypatch, capsys):
    from torch._subclasses import fake_tensor

    from shardckpt.formats.torch_save import file as torch_file

    monkeypatch.delattr(fake_tensor, "FakeTensorMode")
    # More than UNBACKED_MOST tensors are laid out with fake ones.
    monkeypatch.setattr(torch_file, "UNBACKED_MOST", 0)
    dst = tmp_path / "out.pt"
    assert error_of(capsys, ["convert", src, dst, "--to", "full"]) == (
        2,
        unsupported_line(
            "torch._subclasses.fake_tensor.FakeTensorMode", "writing torch.save files needs"
        ),
    )
    assert not dst.exists()


def test_torch_files_are_not_written_where_torch_save_no_longer_marks_placeholders(
    src, tmp_path, monkeypatch, capsys
):
    monkeypatch.delattr(torch.storage._StorageBase, "_fake_device")
    # Per-rank files are laid out with fake DTensors, told from real storages by that mark.
    argv = ["convert", src, tmp_path / "ranks", "--to", "local", "--world-size", "2"]
    assert error_of(capsys, argv) == (
        2,
        unsupported_line(
            "torch.storage._StorageBase._fake_device", "writing torch.save files needs"
        ),
    )


# --- FSDP1 -------------------------------------------------------------------------------------


def test_fsdp1_layouts_without_a_fake_process_group_stop_in_one_line(monkeypatch):
    monkeypatch.delattr(torch._C._distributed_c10d, "FakeProcessGroup")
    with pytest.raises(UnsupportedTorchError) as raised:
        torch_internals.fake_process_group(0, 2)
    assert f"shardckpt: error: {raised.value.line()}" == unsupported_line(
        "torch._C._distributed_c10d.FakeProcessGroup._create_internal",
        "FSDP1's flat-parameter layouts (fsdp1-local) need",
    )


def test_a_flat_parameter_without_its_fields_stops_in_one_line():
    with pytest.raises(UnsupportedTorchError) as raised:
        torch_internals.flat_param_info(object())
    assert f"shardckpt: error: {raised.value.line()}" == unsupported_line(
        "FlatParameter._fqns", "FSDP1's flat-parameter layouts (fsdp1-local) need"
    )


def test_sharded_tensor_files_without_torchs_sharded_tensor_stop_in_one_line(tmp_path, monkeypatch):
    record = ShardedTensorRecord(torch.ones(2, 3), (4, 3), torch.float32, [(0, 0, 2)], 0, 2)
    torch.save({"model": {"w": record}}, tmp_path / "rank_0.pt")
    monkeypatch.setitem(sys.modules, "torch.distributed._shard.sharded_tensor", None)
    line = unsupported_line(
        "torch.distributed._shard.sharded_tensor.ShardedTensor",
        "FSDP1's ShardedTensor files (fsdp1-sharded) need",
    )
    for act in (
        lambda: load_rank_file(tmp_path / "rank_0.pt", trust_pickle=False),
        lambda: ShardedTensorRecord(None, (4, 3), torch.float32, [(0, 0, 4)], 1, 2),
    ):
        with pytest.raises(UnsupportedTorchError) as raised:
            act()
        assert f"shardckpt: error: {raised.value.line()}" == line


# --- start-up ----------------------------------------------------------------------------------

# The private modules shardckpt imports from, taken away after torch's own imports of them.
_GONE = [
    "torch.distributed._shard",
    "torch.distributed._shard.metadata",
    "torch.distributed._shard.sharded_tensor",
    "torch.distributed.checkpoint._traverse",
    "torch.distributed.tensor._utils",
    "torch._subclasses.fake_tensor",
]


@pytest.mark.launches
def test_shardckpt_starts_and_converts_safetensors_without_torchs_private_modules(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file(_state(), src)
    script = (
        "import sys, torch, torch.distributed.checkpoint, torch.distributed.tensor\n"
        "import torch.distributed.fsdp\n"
        f"for name in {_GONE!r}:\n"
        "    sys.modules[name] = None\n"
        "from shardckpt.cli.app import run\n"
        "sys.exit(run(sys.argv[1:]))\n"
    )
    out = tmp_path / "out.safetensors"
    argv = [sys.executable, "-c", script, "convert", str(src), str(out), "--to", "full"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    # A torch file's skeleton is laid out with unbacked placeholders: no fake tensors.
    argv[-5:] = ["convert", str(src), str(tmp_path / "out.pt"), "--to", "full"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert back.keys() == _state().keys()
    assert all(torch.equal(back[k], v) for k, v in _state().items())


def test_a_torch_file_past_the_unbacked_limit_is_laid_out_with_fakes_and_loads_alike(
    src, tmp_path, monkeypatch
):
    from shardckpt.formats.torch_save import file as torch_file

    assert run(["convert", str(src), str(tmp_path / "unbacked.pt"), "--to", "full", "-q"]) == 0
    monkeypatch.setattr(torch_file, "UNBACKED_MOST", 0)
    assert run(["convert", str(src), str(tmp_path / "fake.pt"), "--to", "full", "-q"]) == 0
    a = torch.load(tmp_path / "unbacked.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "fake.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() == _state().keys()
    assert all(torch.equal(a[k], v) and torch.equal(b[k], v) for k, v in _state().items())
