"""What safe loading still reads, and how narrowly: DCP metadata.

DCP's ``.metadata`` is unpickled with exact ``(module, name)`` pairs.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import PurePosixPath

import pickle_payloads as payloads
import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.cli import run
from shardckpt.formats.dcp import _VOCABULARY, _MetadataUnpickler, read_metadata


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def save_dcp(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def trained_adamw() -> dict:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(4, 3)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def test_metadata_of_real_dcp_saves_reads_without_trust(tmp_path):
    state = {
        **trained_adamw(),
        "bf16": torch.ones(7, 3, dtype=torch.bfloat16),
        "ints": torch.arange(5),
        "mask": torch.tensor([True, False]),
        "channels_last": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "values": {"epoch": 3, "name": "run-1", "betas": (0.9, 0.95), "none": None, "lr": 0.5},
    }
    save_dcp(state, tmp_path / "ckpt")
    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:
        trusted = pickle.load(f)
    safe = read_metadata(tmp_path / "ckpt", trust_pickle=False)
    assert safe.state_dict_metadata == trusted.state_dict_metadata
    assert safe.planner_data == trusted.planner_data
    assert safe.storage_data == trusted.storage_data
    assert str(safe.storage_meta.checkpoint_id) == str(tmp_path / "ckpt")
    assert run(["inspect", str(tmp_path / "ckpt")]) == 0


def test_metadata_names_are_exact_pairs_never_attribute_paths():
    assert all("." not in name for _, name in _VOCABULARY)


def test_a_dotted_name_under_a_metadata_module_is_refused(capsys, tmp_path):
    marker = tmp_path / "PAYLOAD-RAN"
    ckpt = payloads.dcp_with_metadata(tmp_path / "ckpt", payloads.dotted_stack_global(marker))
    assert error_of(capsys, ["inspect", ckpt]) == (
        3,
        f"shardckpt: error: '{ckpt / '.metadata'}': metadata references "
        "torch.distributed.checkpoint.metadata.os.system, which DCP metadata never holds: "
        "pass --trust-pickle only if you trust this file",
    )
    assert not marker.exists()


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_a_saved_path_reads_as_a_pure_path_from_any_python(module):
    # Python 3.13 pickles a PosixPath as pathlib._local.PosixPath (3.12 and 3.14: pathlib).
    pk = f"\x80\x02c{module}\nPosixPath\nX\x04\x00\x00\x00/ckp\x85R.".encode("latin-1")
    path = _MetadataUnpickler(io.BytesIO(pk)).load()
    assert type(path) is PurePosixPath and path == PurePosixPath("/ckp")
