"""``--help`` and ``--version`` answer without importing torch (seconds on a small machine).

The CLI imports torch when a command that needs tensors runs, not when the app is built:
option choices come from torch-free modules (``state.choices``, the format registry with
its lazy references), and each command imports the library inside its body. ``inspect``
and ``verify`` of most sources import none (``tests/unit/test_torch_free_commands.py``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ASK = textwrap.dedent(
    """
    import contextlib, io, sys
    from shardckpt.cli.app import run
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        codes = [run(argv) for argv in (["--version"], ["--help"], ["convert", "--help"],
                                        ["inspect", "--help"], ["diff", "--help"])]
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print(codes, loaded, "shardckpt" in out.getvalue())
    """
)


@pytest.mark.launches
def test_help_and_version_import_no_torch():
    done = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[0, 0, 0, 0, 0] [] True"


@pytest.mark.launches
def test_a_command_that_needs_tensors_imports_torch_when_it_runs(tmp_path):
    ask = ASK.replace(
        '["--version"], ', f'["convert", "{tmp_path}", "{tmp_path}.pt", "--to", "full"], '
    )
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True)
    codes, rest = done.stdout.split("]", 1)
    assert codes == "[3, 0, 0, 0, 0" and "'torch'" in rest


def test_every_command_imports_the_library_through_library_load():
    # torch's import must run with signals held (cli/library.load): a Ctrl-C inside it
    # otherwise aborts in a pybind11 callback instead of ending with 130 and one line.
    import ast

    from shardckpt import cli

    unguarded = []
    for path in sorted(Path(cli.__file__).parent.glob("*.py")):
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, ast.FunctionDef):
                continue
            loaded = False
            nodes = [n for n in ast.walk(func) if hasattr(n, "lineno")]
            for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "library.load":
                    loaded = True
                if isinstance(node, ast.ImportFrom) and node.module == "shardckpt" and not loaded:
                    if any(alias.name == "api" for alias in node.names):
                        unguarded.append(f"{path.name}:{func.name}")
    assert unguarded == []


@pytest.mark.launches
def test_a_full_torch_export_loads_no_compiler(tmp_path):
    # Its placeholders are unbacked tensors too (up to UNBACKED_MOST of them), not fakes.
    import torch
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {"w": torch.randn(8, 3), "b": torch.arange(5).to(torch.bfloat16)},
        "e": torch.empty(0, 2),
        "s": torch.tensor(2.5),
        "step": 7,
    }
    dcp.save(state, checkpoint_id=tmp_path / "src", no_dist=True)
    out = tmp_path / "out.pt"
    ask = ASK.replace(
        '["--version"], ', f'["convert", "{tmp_path / "src"}", "{out}", "--to", "full", "-q"], '
    ).replace('m == "torch" or m.startswith("torch.")', 'm.startswith(("torch._dynamo", "triton"))')
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[0, 0, 0, 0, 0] [] True"
    back = torch.load(out, weights_only=True)
    assert back["step"] == 7 and back["e"].shape == (0, 2) and torch.equal(back["s"], state["s"])
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    assert back["model"]["b"].dtype == torch.bfloat16


@pytest.mark.launches
def test_resharding_a_dcp_loads_no_compiler(tmp_path):
    # A DCP item's blob is laid out with an unbacked tensor, not a FakeTensorMode, whose
    # first use imports torch._dynamo and triton (a second or more, 100 MiB of memory).
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(8, 3), "b": torch.arange(5), "e": torch.empty(0, 2)}
    dcp.save(state, checkpoint_id=tmp_path / "src", no_dist=True)
    ask = ASK.replace(
        '["--version"], ',
        f'["convert", "{tmp_path / "src"}", "{tmp_path / "out"}", "--to", "sharded", '
        '"--world-size", "3", "-q"], ',
    ).replace('m == "torch" or m.startswith("torch.")', 'm.startswith(("torch._dynamo", "triton"))')
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[0, 0, 0, 0, 0] [] True"
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, checkpoint_id=tmp_path / "out", no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.launches
def test_a_full_export_of_a_dcp_imports_neither_dcp_nor_dtensor(tmp_path):
    # .metadata read into plain stand-ins, its plain values from their zips and the saved
    # world size by Shard(0)'s rule computed here: DTensor's import alone is 0.9 CPU-s.
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    state = {
        "model": {"w": torch.randn(9, 3), "b": torch.arange(5).to(torch.bfloat16)},
        "step": 7,
        "name": "run-1",
    }
    dcp.save(state, checkpoint_id=tmp_path / "src", no_dist=True)
    out = tmp_path / "out.safetensors"
    ask = ASK.replace(
        '["--version"], ', f'["convert", "{tmp_path / "src"}", "{out}", "--to", "full", "-q"], '
    ).replace(
        'm == "torch" or m.startswith("torch.")',
        'm.startswith(("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy"))',
    )
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[0, 0, 0, 0, 0] [] True"
    written = load_file(out)
    assert torch.equal(written["model.w"], state["model"]["w"])
    assert torch.equal(written["model.b"], state["model"]["b"])


@pytest.mark.launches
def test_the_rows_each_rank_fills_of_a_full_file_import_no_dtensor():
    # Under torchrun torch is loaded, and asking DTensor's Shard(0) rule for the rows each
    # rank fills imported DTensor and sympy: 1.7 s of a 2-rank full export's start.
    ask = """
import sys, torch, torch.distributed
from shardckpt.state.regions import Region, spread
from shardckpt.state.tree import TensorMeta
metas = {"w": TensorMeta("w", (7, 3), torch.float32), "s": TensorMeta("s", (), torch.float32)}
regions = [Region("w", 0, 21, "f", 0), Region("s", 0, 1, "f", 84)]
parts = [[(r.key, r.start, r.stop) for r in spread(regions, metas, q, 3)] for q in range(3)]
print("torch.distributed.tensor" in sys.modules, parts)
"""
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    from torch.distributed.tensor import Shard

    rows = [Shard.local_shard_size_and_offset(7, 3, q) for q in range(3)]
    want = [[("w", off * 3, (off + size) * 3)] for size, off in rows]
    want[1].append(("s", 0, 1))  # the second region's 0-dim tensor: the second rank's
    assert done.stdout.strip() == f"False {want}"
