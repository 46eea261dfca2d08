"""``hf`` (Hugging Face shard directories) and ``--dtype``, checked with the safetensors library."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from reference import assert_trees_equal, write_hf_like_transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.formats import detect
from shardckpt.formats.hf.digests import header, header_crc
from shardckpt.formats.hf.sharded import INDEX_FILE, plan_shards
from shardckpt.state.tree import TensorMeta

LIMIT = 4000  # bytes per shard: small enough that the tree below needs several


def training_tree() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return {
        "model": {
            "embed.weight": torch.randn(97, 48, generator=g),  # 18624 B: a shard of its own
            "blocks.0.fc.weight": torch.randn(7, 3, generator=g),
            "blocks.0.transposed": base.t(),  # non-contiguous in the source
            "blocks.0.bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
            "norm.weight": torch.randn(48, 21, generator=g),  # 4032 B: over the limit, alone
            "empty": torch.zeros(0, 4),
            "ids": torch.arange(5, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        },
        "optim": {
            "state": {
                "embed.weight": {
                    "step": torch.tensor(300.0),
                    "exp_avg": torch.randn(97, 48, generator=g),
                }
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["embed.weight"]}],
        },
        "epoch": 7,
    }


@pytest.fixture
def src(tmp_path):
    torch.save(training_tree(), tmp_path / "src.pt")
    return tmp_path / "src.pt"


def read_hf_with_the_library(path) -> tuple[dict, dict]:
    """Return the index and every tensor of an hf directory, read by safetensors itself."""
    index = json.loads((path / INDEX_FILE).read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        for name, t in load_file(path / file).items():
            assert name not in tensors, f"{name} is in two shards"
            tensors[name] = t
    return index, tensors


def error_of(capsys, argv):
    code = run([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_hf_output_spans_several_shards_and_its_index_covers_every_tensor_once(src, tmp_path):
    dst = tmp_path / "hf"
    argv = ["convert", src, dst, "--to", "full", "--format", "hf", "--max-shard-size", LIMIT]
    assert run([str(a) for a in argv + ["--verify"]]) == 0
    model = training_tree()["model"]
    index, tensors = read_hf_with_the_library(dst)
    files = sorted(p.name for p in dst.iterdir())
    shards = [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert files == [*shards, INDEX_FILE]
    assert sorted(index["weight_map"]) == sorted(model)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in model.values())}
    assert_trees_equal(tensors, model)
    for name, file in index["weight_map"].items():
        with safe_open(dst / file, framework="pt") as f:
            assert name in f.keys()
            metadata = f.metadata()
            assert metadata.pop("shardckpt.header_crc32") == header_crc(header(dst / file)[1])
            assert metadata == {"format": "pt", "shardckpt.crc32": crc32_digits(dst / file)}


def crc32_digits(path) -> str:
    """Return zlib's CRC-32 of each tensor's bytes in a safetensors file, 8 hex digits each, in data order."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    return "".join(f"{zlib.crc32(raw[8 + size + a : 8 + size + b]):08x}" for a, b in spans)


def test_shards_fill_in_tree_order_and_a_big_tensor_goes_alone(src, tmp_path):
    api.convert(
        api.ConvertRequest(
            src=src, dst=tmp_path / "hf", to="full", format="hf", max_shard_size=LIMIT
        )
    )
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    model = training_tree()["model"]
    by_file: dict[str, list[str]] = {}
    for name in model:  # tree order
        by_file.setdefault(index["weight_map"][name], []).append(name)
    groups = [by_file[f] for f in sorted(by_file)]
    assert [n for g in groups for n in g] == list(model)  # shards are consecutive runs
    sizes = [sum(model[n].nbytes for n in g) for g in groups]
    for i, (group, size) in enumerate(zip(groups, sizes)):
        assert size <= LIMIT or len(group) == 1
        if i + 1 < len(groups):  # the next shard's first tensor did not fit in this one
            assert size + model[groups[i + 1][0]].nbytes > LIMIT


def test_plan_shards_matches_the_greedy_rule():
    metas = [TensorMeta(str(i), (n,), torch.uint8) for i, n in enumerate([3, 3, 5, 1, 9, 2])]
    assert [[m.key for m in s] for s in plan_shards(metas, 6)] == [
        ["0", "1"],
        ["2", "3"],
        ["4"],
        ["5"],
    ]


def test_one_shard_by_default_still_has_an_index(src, tmp_path):
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "hf", to="full", format="hf"))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "model-00001-of-00001.safetensors",
        INDEX_FILE,
    ]
    assert detect(tmp_path / "hf") == "hf"


def test_a_tree_without_a_model_key_writes_everything_but_optimizers(tmp_path):
    tree = training_tree()
    flat = {**tree["model"], "optim": tree["optim"], "epoch": 7}
    torch.save(flat, tmp_path / "flat.pt")
    api.convert(
        api.ConvertRequest(src=tmp_path / "flat.pt", dst=tmp_path / "hf", to="full", format="hf")
    )
    assert_trees_equal(read_hf_with_the_library(tmp_path / "hf")[1], tree["model"])


def test_hf_to_dcp_to_full_round_trips_bit_exactly_under_model(tmp_path):
    model = training_tree()["model"]
    write_hf_like_transformers(tmp_path / "hf", model, per_shard=3)
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "hf", dst=tmp_path / "dcp", to="sharded", world_size=1, verify=True
        )
    )
    api.convert(
        api.ConvertRequest(src=tmp_path / "dcp", dst=tmp_path / "full.pt", to="full", verify=True)
    )
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), {"model": model})
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "dcp", dst=tmp_path / "again", to="full", format="hf", verify=True
        )
    )
    assert_trees_equal(read_hf_with_the_library(tmp_path / "again")[1], model)


def test_missing_shard_file(capsys, tmp_path):
    write_hf_like_transformers(tmp_path / "hf", training_tree()["model"], per_shard=4)
    (tmp_path / "hf" / "model-00002-of-00003.safetensors").unlink()
    assert error_of(capsys, ["inspect", tmp_path / "hf"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'hf'}': missing shard 'model-00002-of-00003.safetensors' "
        f"named by {INDEX_FILE}: copy every *.safetensors shard of the checkpoint",
    )


def test_index_naming_a_tensor_not_in_its_shard(capsys, tmp_path):
    write_hf_like_transformers(tmp_path / "hf", training_tree()["model"], per_shard=4)
    index_path = tmp_path / "hf" / INDEX_FILE
    index = json.loads(index_path.read_text())
    index["weight_map"]["ids"] = "model-00001-of-00003.safetensors"  # really in shard 2
    index_path.write_text(json.dumps(index))
    shard = tmp_path / "hf" / "model-00001-of-00003.safetensors"
    assert error_of(capsys, ["convert", tmp_path / "hf", tmp_path / "o.pt", "--to", "full"]) == (
        3,
        f"shardckpt: error: '{shard}': has no tensor 'ids', which {INDEX_FILE} puts there: "
        "the index and the shards do not match; re-copy the checkpoint",
    )
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("text", ["{not json", '{"weight_map": ["w"]}', '{"metadata": {}}'])
def test_index_that_is_not_an_index_of_shards(capsys, tmp_path, text):
    write_hf_like_transformers(tmp_path / "hf", {"w": torch.ones(2)}, per_shard=1)
    (tmp_path / "hf" / INDEX_FILE).write_text(text)
    assert error_of(capsys, ["inspect", tmp_path / "hf"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'hf' / INDEX_FILE}': not an index of safetensors shards "
        "(no 'weight_map' of names to files): re-save the model with save_pretrained, or re-copy the file",
    )


@pytest.mark.parametrize("file", ["../model.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_index_naming_a_file_outside_its_directory_says_so(capsys, tmp_path, file):
    write_hf_like_transformers(tmp_path / "hf", {"w": torch.ones(2)}, per_shard=1)
    (tmp_path / "hf" / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": file}}))
    assert error_of(capsys, ["inspect", tmp_path / "hf"]) == (
        3,
        f"shardckpt: error: '{tmp_path / 'hf' / INDEX_FILE}': names '{file}' as the shard of 'w', "
        "which is not a file name in this directory: an index lists the names of the shards "
        "beside it; re-save the model with save_pretrained",
    )


def test_a_tensor_a_shard_holds_but_the_index_omits_is_an_error_not_a_loss(capsys, tmp_path):
    write_hf_like_transformers(tmp_path / "hf", training_tree()["model"], per_shard=4)
    index_path = tmp_path / "hf" / INDEX_FILE
    index = json.loads(index_path.read_text())
    del index["weight_map"]["ids"]  # the tensor stays in its shard
    index_path.write_text(json.dumps(index))
    shard = tmp_path / "hf" / "model-00002-of-00003.safetensors"
    assert error_of(capsys, ["convert", tmp_path / "hf", tmp_path / "o.pt", "--to", "full"]) == (
        3,
        f"shardckpt: error: '{shard}': holds tensor 'ids', which {INDEX_FILE} does not put there: "
        "the index and the shards do not match; re-save the model, or add the tensor to the "
        "index's weight_map",
    )
    assert not (tmp_path / "o.pt").exists()


def test_a_shard_the_index_does_not_list_is_an_error_not_a_loss(capsys, tmp_path):
    write_hf_like_transformers(tmp_path / "hf", training_tree()["model"], per_shard=4)
    index_path = tmp_path / "hf" / INDEX_FILE
    index = json.loads(index_path.read_text())
    index["weight_map"] = {
        k: v for k, v in index["weight_map"].items() if v != "model-00003-of-00003.safetensors"
    }
    index_path.write_text(json.dumps(index))
    assert error_of(capsys, ["inspect", tmp_path / "hf"]) == (
        3,
        f"shardckpt: error: '{index_path}': 'model-00003-of-00003.safetensors' is named like a "
        f"shard but {INDEX_FILE} does not list it: the index and the shards do not match; "
        "re-save the model, or remove the stray shard",
    )


def test_other_safetensors_files_beside_the_shards_are_not_shards(capsys, tmp_path):
    write_hf_like_transformers(tmp_path / "hf", {"w": torch.ones(2)}, per_shard=1)
    save_file({"x": torch.zeros(1)}, tmp_path / "hf" / "consolidated.safetensors")
    assert run(["inspect", str(tmp_path / "hf")]) == 0


@pytest.mark.parametrize(
    "extra, line",
    [
        (
            ["--format", "hf", "--max-shard-size", "lots"],
            "--max-shard-size 'lots' is not a size: write it like 512MB, 2GiB or 1000000",
        ),
        (
            ["--format", "hf", "--max-shard-size", "0"],
            "--max-shard-size must be positive: write it like 5GB or 500MB",
        ),
        (
            ["--max-shard-size", "5GB"],
            "--max-shard-size applies to --format hf only: drop --max-shard-size, or pass --format hf",
        ),
        (
            ["--cast-optim"],
            "--cast-optim needs --dtype: add --dtype bf16, fp16 or fp32, or drop --cast-optim",
        ),
    ],
)
def test_option_errors(capsys, src, tmp_path, extra, line):
    argv = ["convert", src, tmp_path / "out", "--to", "full", *extra]
    assert error_of(capsys, argv) == (2, f"shardckpt: error: {line}")
    assert not (tmp_path / "out").exists()


def test_hf_is_a_full_layout(capsys, src, tmp_path):
    assert error_of(
        capsys, ["convert", src, tmp_path / "o", "--to", "sharded", "--format", "hf"]
    ) == (
        2,
        "shardckpt: error: --format hf is a full layout, not sharded: pass --to full, or a sharded format",
    )


def test_hf_of_optimizer_state_only_is_refused(capsys, src, tmp_path):
    argv = ["convert", src, tmp_path / "o", "--to", "full", "--format", "hf", "--only", "optim"]
    assert error_of(capsys, argv) == (
        2,
        f"shardckpt: error: '{src}': has no model tensors to write as --format hf: "
        "check --only and --filter against `shardckpt inspect`",
    )


# ---------------------------------------------------------------- --dtype


def test_dtype_bf16_casts_model_floats_only(src, tmp_path):
    api.convert(
        api.ConvertRequest(src=src, dst=tmp_path / "bf16.pt", to="full", dtype="bf16", verify=True)
    )
    out = torch.load(tmp_path / "bf16.pt", weights_only=True)
    expected = training_tree()
    expected["model"] = {
        k: t.to(torch.bfloat16) if t.is_floating_point() else t
        for k, t in expected["model"].items()
    }
    assert_trees_equal(out, expected)  # optimizer state and ints/bools untouched


def test_cast_optim_casts_optimizer_state_but_not_step(src, tmp_path):
    argv = ["convert", src, tmp_path / "o.pt", "--to", "full", "--dtype", "fp16", "--cast-optim"]
    assert run([str(a) for a in argv + ["--verify"]]) == 0
    out = torch.load(tmp_path / "o.pt", weights_only=True)
    state = training_tree()["optim"]["state"]["embed.weight"]
    got = out["optim"]["state"]["embed.weight"]
    assert_trees_equal(got, {"step": state["step"], "exp_avg": state["exp_avg"].to(torch.float16)})
    assert out["model"]["ids"].dtype == torch.int64


def test_dtype_applies_to_sharded_and_hf_outputs(src, tmp_path):
    api.convert(
        api.ConvertRequest(
            src=src, dst=tmp_path / "dcp", to="sharded", world_size=1, dtype="bf16", verify=True
        )
    )
    api.convert(api.ConvertRequest(src=tmp_path / "dcp", dst=tmp_path / "back.pt", to="full"))
    bf16 = torch.load(tmp_path / "back.pt", weights_only=True)
    api.convert(
        api.ConvertRequest(
            src=src, dst=tmp_path / "hf", to="full", format="hf", dtype="bf16", max_shard_size=LIMIT
        )
    )
    tensors = read_hf_with_the_library(tmp_path / "hf")[1]
    model = training_tree()["model"]
    expected = {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in model.items()}
    assert_trees_equal(bf16["model"], expected)
    assert_trees_equal(tensors, expected)


def test_dtype_on_an_int_only_checkpoint_changes_nothing(tmp_path):
    torch.save({"ids": torch.arange(7), "mask": torch.ones(3, dtype=torch.bool)}, tmp_path / "i.pt")
    api.convert(api.ConvertRequest(src=tmp_path / "i.pt", dst=tmp_path / "a.pt", to="full"))
    argv = ["convert", tmp_path / "i.pt", tmp_path / "b.pt", "--to", "full", "--dtype", "bf16"]
    assert run([str(a) for a in argv]) == 0
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


# --hf-config (issue 11 item 3): config.json and friends beside the weights. These
# configs name no architecture, so nothing is checked against transformers here
# (tests/dist/test_hf_config.py loads real exports with from_pretrained).
CONFIG = {"model_type": "tiny", "hidden_size": 48}


def model_dir(path, **extra_files):
    """Return ``path`` made into a model directory: config.json plus ``extra_files``."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    for name, text in extra_files.items():
        (path / name).write_text(text)
    return path


def test_hf_config_copies_config_and_tokenizer_files_but_no_weights_or_trainer_state(src, tmp_path):
    files = {
        "generation_config.json": "{}",
        "tokenizer.json": "{}",
        "tokenizer_config.json": "{}",
        "special_tokens_map.json": "{}",
        "merges.txt": "",
        "model.safetensors": "weights",
        "optimizer.pt": "state",
        "trainer_state.json": "{}",
        "train.py": "",
    }
    base = model_dir(tmp_path / "base", **files)
    assert run(["convert", str(src), str(tmp_path / "out"), "--to", "full"]
               + ["--format", "hf", "--hf-config", str(base), "-q"]) == 0  # fmt: skip
    copied = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    expected = ["config.json", "generation_config.json", "merges.txt", "special_tokens_map.json"]
    expected += ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(copied) == sorted([*expected, INDEX_FILE, "model-00001-of-00001.safetensors"])
    assert all(copied[name] == (base / name).read_bytes() for name in expected)


def test_code_that_auto_map_names_is_copied(src, tmp_path):
    base = model_dir(tmp_path / "base", **{"modeling_tiny.py": "X = 1\n", "other.py": ""})
    config = {**CONFIG, "auto_map": {"AutoModel": "modeling_tiny.Tiny"}}
    (base / "config.json").write_text(json.dumps(config))
    api.convert(
        api.ConvertRequest(src=src, dst=tmp_path / "out", to="full", format="hf", hf_config=base)
    )
    assert (tmp_path / "out" / "modeling_tiny.py").read_text() == "X = 1\n"
    assert not (tmp_path / "out" / "other.py").exists()


def test_a_config_in_the_directory_src_sits_in_is_not_used_but_named_in_a_note(capsys, tmp_path):
    # The directory SRC sits in may be a shared download folder holding another model's.
    ckpt = model_dir(tmp_path / "checkpoint-7", **{"tokenizer.json": "{}"})
    torch.save(training_tree(), ckpt / "full.pt")
    assert run(["convert", str(ckpt / "full.pt"), str(tmp_path / "out"), "--to", "full"]
               + ["--format", "hf", "-q"]) == 0  # fmt: skip
    assert capsys.readouterr().err.strip() == (
        f"shardckpt: note: not copying config.json from '{ckpt}', the directory SRC is in: "
        f"pass --hf-config '{ckpt}' if it is this model's"
    )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model-00001-of-00001.safetensors",
        INDEX_FILE,
    ]


def test_a_config_in_a_directory_src_is_used_with_a_note(capsys, tmp_path):
    ckpt = model_dir(tmp_path / "checkpoint-7", **{"optimizer.pt": "state"})
    dcp.save(training_tree(), checkpoint_id=ckpt, no_dist=True)
    assert run(["convert", str(ckpt), str(tmp_path / "out"), "--to", "full"]
               + ["--format", "hf", "-q"]) == 0  # fmt: skip
    assert capsys.readouterr().err.strip().splitlines() == [
        # A model transformers does not know: the weight-name check says it did not run.
        f"shardckpt: note: '{ckpt / 'config.json'}': not checking DST's weight names against "
        "the model it describes: it names no 'architectures', and transformers knows no "
        "model_type 'tiny'",
        f"shardckpt: note: copying config.json from '{ckpt}', where SRC is (pass "
        "--hf-config DIR for another model's)",
    ]
    assert (tmp_path / "out" / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    assert not (tmp_path / "out" / "optimizer.pt").exists()


def test_hf_config_without_config_json_is_refused_before_anything_is_read(capsys, src, tmp_path):
    (tmp_path / "empty").mkdir()
    argv = ["convert", src, tmp_path / "out", "--to", "full", "--format", "hf"]
    assert error_of(capsys, [*argv, "--hf-config", tmp_path / "empty"]) == (
        2,
        f"shardckpt: error: '{tmp_path / 'empty'}': --hf-config: no 'config.json' in this "
        "directory: pass the directory of the model's config.json (its original directory or "
        "a hub snapshot)",
    )
    assert not (tmp_path / "out").exists()


def test_hf_config_naming_the_file_asks_for_its_directory(capsys, src, tmp_path):
    base = model_dir(tmp_path / "base")
    argv = ["convert", src, tmp_path / "out", "--to", "full", "--format", "hf"]
    assert error_of(capsys, [*argv, "--hf-config", base / "config.json"]) == (
        2,
        f"shardckpt: error: '{base / 'config.json'}': --hf-config: is a file; the option takes "
        f"the directory holding config.json: pass --hf-config '{base}'",
    )


def test_a_config_json_that_is_not_json_is_named(capsys, src, tmp_path):
    base = model_dir(tmp_path / "base")
    (base / "config.json").write_text("{not json")
    argv = ["convert", src, tmp_path / "out", "--to", "full", "--format", "hf"]
    assert error_of(capsys, [*argv, "--hf-config", base]) == (
        3,
        f"shardckpt: error: '{base / 'config.json'}': is not a JSON object, so not a "
        "transformers model config: copy config.json again from the model's directory or hub "
        "repository",
    )
