"""Plain values compare safely whatever they hold: numpy arrays (an RNG state) included."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shardckpt.engine.compare import values_equal
from shardckpt.formats.ranks.rank_set import check_one_save


def _rng_state(seed: int) -> dict:
    """Return the RNG state veRL's extra_state holds: numpy's is a tuple with a uint32 array."""
    np.random.seed(seed)
    random.seed(seed)
    return {"numpy": np.random.get_state(), "random": random.getstate()}


def test_an_rng_state_equals_itself_and_not_another_seed():
    assert values_equal(_rng_state(1), _rng_state(1))
    assert not values_equal(_rng_state(1), _rng_state(2))


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (np.arange(3, dtype=np.uint32), np.arange(3, dtype=np.uint32), True),
        (np.arange(3, dtype=np.uint32), np.arange(3, dtype=np.int64), False),
        (np.arange(4).reshape(2, 2), np.arange(4), False),
        (np.array([np.nan]), np.array([np.nan]), True),
        (np.array([0.0]), np.array([-0.0]), False),
        (np.array([1, "a"], dtype=object), np.array([1, "a"], dtype=object), True),
        (np.array([1, "a"], dtype=object), np.array([1, "b"], dtype=object), False),
        (np.float32(1.5), np.float32(1.5), True),
        (np.float32(1.5), np.float32(2.5), False),
        (np.uint32(3), 3, False),
    ],
)
def test_numpy_values_compare_by_dtype_shape_and_bits(a, b, equal):
    assert values_equal(a, b) is equal


def test_tensors_of_other_shapes_differ_instead_of_raising():
    assert not values_equal(torch.zeros(2), torch.zeros(3))
    assert not values_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_rank_files_whose_rng_states_differ_are_told_apart(tmp_path):
    files = [tmp_path / "rank_0.pt", tmp_path / "rank_1.pt"]
    with pytest.raises(Exception, match="'rng.numpy' is"):
        check_one_save(files, [{"rng": _rng_state(1)}, {"rng": _rng_state(2)}])
    check_one_save(files, [{"rng": _rng_state(1)}, {"rng": _rng_state(1)}])
