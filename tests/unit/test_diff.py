"""`diff` compares structure as well as leaves: an empty dict, a list against a dict."""

from __future__ import annotations

import json

import pytest
import torch

from shardckpt.cli.app import run


def diff_json(capsys, a, b):
    code = run(["diff", str(a), str(b), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "tree_a, tree_b, difference",
    [
        (
            {"w": torch.ones(2), "a": {}},
            {"w": torch.ones(2)},
            {"path": ["a"], "reason": "only in A"},
        ),
        (
            {"w": torch.ones(2), "o": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}},
            {"w": torch.ones(2), "o": {"param_groups": [{"lr": 0.1, "params": []}]}},
            {"path": ["o", "state"], "reason": "only in A"},
        ),
        (
            {"x": [torch.ones(2), torch.zeros(2)]},
            {"x": {0: torch.ones(2), 1: torch.zeros(2)}},
            {"path": ["x"], "reason": "a list in A, a dict in B"},
        ),
        ({"a": {}}, {"a": []}, {"path": ["a"], "reason": "value {} vs []"}),
    ],
)
def test_diff_reports_structure_that_differs(capsys, tmp_path, tree_a, tree_b, difference):
    torch.save(tree_a, tmp_path / "a.pt")
    torch.save(tree_b, tmp_path / "b.pt")
    code, doc = diff_json(capsys, tmp_path / "a.pt", tmp_path / "b.pt")
    assert code == 1
    assert [{k: d[k] for k in ("path", "reason")} for d in doc["differences"]] == [difference]


def test_diff_of_equal_trees_with_empty_containers_is_equal(capsys, tmp_path):
    tree = {"w": torch.ones(2), "a": {}, "b": [], "o": {"state": {}, "param_groups": []}}
    torch.save(tree, tmp_path / "a.pt")
    torch.save(tree, tmp_path / "b.pt")
    assert diff_json(capsys, tmp_path / "a.pt", tmp_path / "b.pt")[0] == 0
