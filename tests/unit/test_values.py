"""Typed JSON keeps Python value types through formats that hold no pickles."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardckpt.codecs.json_values import (
    UnencodableValue,
    decode_tree,
    decode_value,
    encode_tree,
    encode_value,
)
from shardckpt.state.tree import TensorMeta
from shardckpt.state.values import tensors_differ


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        1,
        -7,
        1.0,
        0.001,
        "x",
        [1, 2.0, "a"],
        (0.9, 0.999),
        {"a": (1, 2)},
        {0: "id", "k": None},
        [(1, [2, (3,)])],
        (),
        b"\x00pickled\xff",
        {"dataloader": {"rank_0": b"\x80\x04"}},
    ],
)
def test_values_round_trip_with_their_types(value):
    back = decode_value(json.loads(json.dumps(encode_value(value))))
    assert back == value and repr(back) == repr(value)


def test_non_finite_floats_stay_floats():
    back = decode_value(json.loads(json.dumps(encode_value([math.inf, -math.inf, math.nan]))))
    assert back[0] == math.inf and back[1] == -math.inf and math.isnan(back[2])


def test_unsupported_value_names_its_path():
    with pytest.raises(UnencodableValue, match="value at 'optim.x' is a object"):
        encode_value(object(), ("optim", "x"))


def test_tree_round_trip_keeps_int_keys_and_holes():
    meta = TensorMeta("k0", (2,), torch.float32)
    tree = {
        "optim": {
            "state": {0: {"step": meta}},
            "param_groups": [{"params": [0], "betas": (0.9, 0.99)}],
        }
    }
    encoded = json.loads(json.dumps(encode_tree(tree, lambda p, m: "name")))
    back = decode_tree(encoded, lambda name: meta)
    assert back == tree
    assert isinstance(back["optim"]["param_groups"][0]["betas"], tuple)


def test_tensors_with_the_same_bytes_are_equal_at_any_tolerance_with_no_difference():
    x = torch.tensor([1.0, float("inf"), float("nan"), -0.0])
    for atol, rtol in [(0.0, 0.0), (1e-3, 0.0), (0.0, 1e-3)]:
        assert tensors_differ(x, x.clone(), atol, rtol) == (False, 0.0)


def test_bytes_that_differ_are_still_judged_as_values():
    zero, minus_zero = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert tensors_differ(zero, minus_zero, 0.0, 0.0) == (True, 0.0)
    assert tensors_differ(zero, minus_zero, 1e-6, 0.0) == (False, 0.0)
