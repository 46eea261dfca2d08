"""Planning is pure and uses torch's own dim-0 split."""

from __future__ import annotations

import pytest
import torch

from shardckpt.core.errors import BadInputError, UsageError
from shardckpt.core.placement import Placement, shared
from shardckpt.formats.base import Index
from shardckpt.plan.plan import SKIP, batches, dim0_rows, make_plan, rows_to_read, stays_whole
from shardckpt.plan.selection import Selection, select
from shardckpt.state.optim import ModelParams
from shardckpt.state.tree import Chunk, TensorMeta


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 97])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_dim0_rows_tile_the_tensor_as_torch_chunk_does(rows, world_size):
    # torch.chunk is what fully_shard documents for dim-0 sharding; ranks past the
    # last chunk hold nothing.
    chunks = torch.arange(rows).chunk(world_size) if rows else ()
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
    got = [dim0_rows((rows, 5), world_size, r) for r in range(world_size)]
    assert [g for g in got if g[1] > g[0]] == expected
    assert all(g[0] <= g[1] <= rows for g in got)


def test_zero_dim_tensors_are_read_whole_by_rank_zero_only_for_a_full_dst():
    step = TensorMeta("s", (), torch.float32)
    assert rows_to_read(step, 2, 0, whole_on_coordinator=True) is None
    assert rows_to_read(step, 2, 1, whole_on_coordinator=True) == SKIP
    assert rows_to_read(step, 2, 1, whole_on_coordinator=False) is None


def test_batches_are_bounded_and_keep_order():
    metas = [TensorMeta(str(i), (n,), torch.uint8) for i, n in enumerate([40, 40, 30, 200, 10])]
    groups = batches(metas, limit=100)
    assert [[m.key for m in g] for g in groups] == [["0", "1"], ["2"], ["3"], ["4"]]


def _index() -> Index:
    tree = {
        "model": {"module.w": TensorMeta("a", (3,), torch.float32)},
        "optim": {
            "state": {"module.w": {"step": TensorMeta("b", (), torch.float32)}},
            "param_groups": [{"lr": 0.1, "params": ["module.w"]}],
        },
    }
    return Index("dcp", "ckpt", 2, tree)


def test_select_cleans_fqns_then_filters():
    tree = select(_index(), Selection(filters=("model.*",)))
    assert tree == {"model": {"w": TensorMeta("a", (3,), torch.float32)}}
    assert "module.w" in select(_index(), Selection(clean_fqns=False))["model"]


def test_only_optim_keeps_the_optimizer():
    plan = make_plan(_index(), Selection(only="optim"), "torch", 1)
    assert list(plan.tree) == ["optim"] and len(plan.tensors) == 1 and plan.num_values == 2


def test_selecting_nothing_is_a_usage_error():
    with pytest.raises(UsageError, match="nothing is selected"):
        make_plan(_index(), Selection(filters=("nope*",)), "torch", 1)


def test_cleaning_collision_names_both_keys():
    index = _index()
    index.tree["model"]["w"] = TensorMeta("c", (3,), torch.float32)
    with pytest.raises(BadInputError) as info:
        select(index, Selection())
    assert info.value.line() == (
        "'ckpt': 'model.module.w' and 'model.w' both become 'w' after FQN cleaning: "
        "pass --no-clean-fqns to keep the keys as they are"
    )


def _meta(
    shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> TensorMeta:
    layout = "full" if len(chunks) == 1 and chunks[0][1] == shape else f"{len(chunks)} chunks"
    return TensorMeta("k", shape, torch.float32, layout, tuple(Chunk(0, o, s) for o, s in chunks))


def _tree(buffer: TensorMeta, param: TensorMeta) -> dict:
    step = TensorMeta("step", (), torch.float32)
    exp_avg = TensorMeta("exp_avg", (3, 7), torch.float32, param.layout, param.chunks)
    return {
        "model": {"w": param, "pos_scale": buffer},
        "optim": {
            "state": {"w": {"step": step, "exp_avg": exp_avg}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
        },
        "rng": TensorMeta("rng", (16,), torch.uint8),
    }


def _whole(index: Index, layout: str = "local", model: ModelParams | None = None) -> set[str]:
    fmt = {"sharded": "dcp", "local": "fsdp2-ranks"}[layout]
    plan = make_plan(index, Selection(model=model), fmt, 2)
    return set(plan.whole)


# FSDP2's 3-row weight at 4 ranks: rank 3's empty shard is a chunk of its own.
PARAM = _meta((3, 7), [((0, 0), (1, 7)), ((1, 0), (1, 7)), ((2, 0), (1, 7)), ((3, 0), (0, 7))])
WHOLE_PARAM = TensorMeta("w", (3, 7), torch.float32, "full", (Chunk(0, (0, 0), (3, 7)),))
BUFFER = TensorMeta("buf", (5, 48), torch.float32, "full", (Chunk(0, (0, 0), (5, 48)),))
MODEL = ModelParams(("w",), ((3, 7),), buffers=("pos_scale",))


def test_a_multi_rank_dcp_keeps_whole_what_it_stored_as_one_whole_chunk():
    index = Index("dcp", "ckpt", 4, _tree(BUFFER, PARAM))
    assert _whole(index) == {"buf", "step", "rng"}
    assert _whole(index, "sharded") == {"buf", "step", "rng"}


@pytest.mark.parametrize(
    "fmt, world_size, why",
    [
        ("torch", 1, "a torch checkpoint stores every tensor whole"),
        ("dcp", 1, "a DCP checkpoint of one rank stores every tensor whole"),
        ("dcp", 2, "this DCP checkpoint stores every tensor as one whole chunk"),
    ],
)
def test_a_local_output_of_a_source_that_stores_everything_whole_needs_the_model(
    fmt, world_size, why
):
    index = Index(fmt, "ckpt", world_size, _tree(BUFFER, WHOLE_PARAM))
    with pytest.raises(UsageError) as err:
        _whole(index)
    assert err.value.line() == (
        "'ckpt': cannot tell parameters (split across ranks) from buffers (whole on every "
        f"rank): {why} (3 such tensors, e.g. 'model.w'): pass --model pkg.module:factory "
        "building the trained model"
    )
    # A DCP output may split a buffer: DCP reshards it on load.
    assert _whole(index, "sharded") == {"step"}
    # The model tells: its buffers and what lies beside the model state stay whole.
    assert _whole(index, model=MODEL) == _whole(index, "sharded", MODEL) == {"buf", "step", "rng"}


def test_optimizer_state_alone_is_split_without_the_model():
    index = Index("torch", "ckpt", 1, _tree(BUFFER, WHOLE_PARAM))
    plan = make_plan(index, Selection(only="optim"), "fsdp2-ranks", 2)
    assert set(plan.whole) == {"step"}


def test_a_model_state_tensor_the_model_does_not_have_is_a_usage_error():
    index = Index("torch", "ckpt", 1, _tree(BUFFER, WHOLE_PARAM))
    with pytest.raises(UsageError) as err:
        _whole(index, model=ModelParams(("w",), ((3, 7),)))
    assert err.value.line() == (
        "'ckpt': 'model.pos_scale' is neither a parameter nor a buffer of the --model model: "
        "check that --model builds the trained model, or --rename/--drop the checkpoint's "
        "keys to match it"
    )


def test_a_tied_parameters_other_name_is_split():
    tree = {"embed.weight": WHOLE_PARAM, "head.weight": TensorMeta("h", (3, 7), torch.float32)}
    model = ModelParams(("embed.weight",), ((3, 7),), aliases=("head.weight",))
    assert _whole(Index("torch", "ckpt", 1, tree), model=model) == set()


def test_stays_whole_is_what_per_rank_files_held_as_plain_tensors():
    assert stays_whole(BUFFER) and stays_whole(TensorMeta("s", (), torch.float32))
    assert not stays_whole(PARAM)


@pytest.mark.parametrize(("world_size", "launch_size"), [(1, 2), (3, 2), (8, 2), (4, 4), (5, 1)])
def test_every_target_rank_has_exactly_one_real_rank(world_size, launch_size):
    owned = [r for k in range(launch_size) for r in shared(k, launch_size).targets(world_size)]
    assert sorted(owned) == list(range(world_size))
    assert 0 in shared(0, launch_size).targets(world_size)  # the coordinator plans globally
    assert shared(1 % launch_size, launch_size).targets(world_size) == list(
        range(1 % launch_size, world_size, launch_size)
    )


@pytest.mark.parametrize(
    ("groups", "world_size", "expected"),
    [
        # Two nodes of two ranks, M = 8: node 0 writes 0-3, node 1 writes 4-7, round-robin.
        (((0, 1), (2, 3)), 8, {0: [0, 2], 1: [1, 3], 2: [4, 6], 3: [5, 7]}),
        # Uneven nodes, M = 5: blocks of 3 and 2 ranks.
        (((0,), (1, 2)), 5, {0: [0, 1, 2], 1: [3], 2: [4]}),
        # More nodes than target ranks: a node may write nothing, never the coordinator's.
        (((0,), (1,), (2,)), 2, {0: [0], 1: [1], 2: []}),
        # Ranks of one node need not be contiguous.
        (((0, 2), (1, 3)), 4, {0: [0], 2: [1], 1: [2], 3: [3]}),
    ],
)
def test_dst_on_several_disks_gives_each_disk_a_block_of_target_ranks(groups, world_size, expected):
    got = {r: Placement(groups, r).targets(world_size) for g in groups for r in g}
    assert sorted(t for ts in got.values() for t in ts) == list(range(world_size))
    assert got == expected


def test_the_note_on_several_disks_names_each_disks_ranks_and_block():
    placement = Placement(((0, 1, 2, 3), (4, 6), (5,)), 0)
    assert placement.describe(8) == (
        "DST is on 3 disks the ranks do not share, so each holds a block of target ranks: "
        "ranks 0-3's disk 0-2, ranks 4,6's disk 3-5, rank 5's disk 6-7 (where a job at 8 on "
        "as many nodes runs them)"
    )
    assert "rank 2's disk none" in Placement(((0,), (1,), (2,)), 0).describe(2)
