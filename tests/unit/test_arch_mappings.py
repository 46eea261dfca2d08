"""``--map``: torchtitan checkpoints to Hugging Face models and back, against torchtitan's own adapters.

The reference is what torchtitan 0.3's ``StateDictAdapter.to_hf`` / ``from_hf`` give for
the same state dict (bit for bit), and what transformers' ``from_pretrained`` loads;
the hostile cases are a layer, an expert or a tensor the mapping does not cover.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from shardckpt.cli.app import run
from shardckpt.plan.mapping import layout, rules
from shardckpt.state.tree import TensorMeta

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.trainers

import titan_models  # noqa: E402


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()[-1] if err.strip() else ""


def _hf_weights(root) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(root)):
        if name.endswith(".safetensors"):
            out.update(load_file(root / name))
    return out


def _bits_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name].contiguous(), b[name].contiguous()
        assert (x.shape, x.dtype) == (y.shape, y.dtype), name
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), name


def _nothing_left(parent, *keep) -> None:
    assert sorted(os.listdir(parent)) == sorted(keep)


def _saved(tmp_path_factory, build):
    """Return a torchtitan model ``build`` makes, its saved step and its config directory."""
    titan = build()
    step, config = titan_models.save(titan, tmp_path_factory.mktemp(build.__name__))
    return titan, step, config


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _saved(tmp_path_factory, titan_models.llama3)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _saved(tmp_path_factory, titan_models.qwen3)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return _saved(tmp_path_factory, titan_models.deepseek_v3)


def _to_hf(capsys, step, config, dst, *more):
    code, out, err = _cli(
        capsys, "convert", step, dst, "--to", "full", "--format", "hf", "--hf-config", config,
        "--json", *more,
    )  # fmt: skip
    assert code == 0, err
    return json.loads(out)


def _loads_as_to_hf_gives(titan, hf) -> None:
    """Check that ``hf`` is torchtitan's ``to_hf`` bit for bit and loads with no missing or unexpected key."""
    _bits_equal(_hf_weights(hf), titan.adapter.to_hf(dict(titan.state)))
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()


def _back_is_from_hf(capsys, titan, hf, name: str, *more) -> dict:
    """Map ``hf`` back to torchtitan at 2 ranks with ``--map name``; check it is ``from_hf``'s; return it."""
    dst = hf.parent / "step-1"
    code, out, err = _cli(
        capsys, "convert", hf, dst, "--to", "sharded", "--format", "torchtitan",
        "--world-size", "2", "--map", name, *more,
    )  # fmt: skip
    assert code == 0, err
    expected = titan.adapter.from_hf(_hf_weights(hf))
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=dst, no_dist=True)
    _bits_equal(loaded, expected)
    return loaded


def test_llama3_to_hf_is_torchtitans_to_hf_bit_for_bit_and_from_pretrained_loads_it(
    capsys, llama, tmp_path
):
    titan, step, config = llama
    doc = _to_hf(capsys, step, config, tmp_path / "hf")
    reference = titan.adapter.to_hf(dict(titan.state))
    size = sum(t.nbytes for t in titan.state.values())
    assert doc["mapping"] == {
        "name": "llama3",
        "file": str(rules.shipped()["llama3"]),
        "direction": "to hf",
        "in": {"tensors": len(titan.state), "bytes": size},
        "out": {"tensors": len(reference), "bytes": size},
        "dropped": {"tensors": 0, "bytes": 0, "names": []},
    }
    _loads_as_to_hf_gives(titan, tmp_path / "hf")


def test_a_mapped_export_streams_in_small_batches_casts_and_verifies(capsys, llama, tmp_path):
    """A 4 KiB buffer cuts q/k's permuted rows and every tensor across batches."""
    titan, step, config = llama
    doc = _to_hf(
        capsys, step, config, tmp_path / "hf", "--buffer-size", "4KiB", "--dtype", "bf16",
        "--verify",
    )  # fmt: skip
    assert doc["verified"] is True
    reference = titan.adapter.to_hf(dict(titan.state))
    _bits_equal(
        _hf_weights(tmp_path / "hf"), {k: v.to(torch.bfloat16) for k, v in reference.items()}
    )


def _logits(titan, hf) -> tuple[torch.Tensor, torch.Tensor]:
    """Return torchtitan's logits and ``from_pretrained(hf)``'s for the same 16 tokens (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        masks = titan.model.get_attention_masks(positions)
        theirs = titan.model(tokens, attention_masks=masks)
        ours = model(tokens).logits
    assert theirs.dtype == ours.dtype == torch.float32
    assert theirs.abs().max() > 0.1
    return theirs, ours


@pytest.mark.slow
def test_llama3_exported_logits_match_torchtitans_forward(capsys, llama, tmp_path):
    """fp32 on CPU: torchtitan rotates pairs as complex numbers, transformers by
    ``rotate_half`` with cos/sin tables: the same rotation, rounded apart by about one
    ulp per element, which two layers of attention and MLP grow to ~1e-6 of logits of
    size ~1; 1e-4 leaves room and still fails any wrong row order (differences of ~1)."""
    titan, step, config = llama
    _to_hf(capsys, step, config, tmp_path / "hf")
    theirs, ours = _logits(titan, tmp_path / "hf")
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_qwen3_exported_logits_match_torchtitans_forward(capsys, qwen, tmp_path):
    """fp32 on CPU: both rotate halves with cos/sin tables and normalise q and k per
    head, the same operations in the same order (seen: equal, 0.0 apart, logits of
    size ~2.7); 1e-4 as for Llama 3 leaves room for another torch's kernels to sum in
    another order, and q's and k's norms swapped move them by 0.11."""
    titan, step, config = qwen
    _to_hf(capsys, step, config, tmp_path / "hf")
    theirs, ours = _logits(titan, tmp_path / "hf")
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def _grouped_experts_in_fp32(self, x_RD, num_tokens_per_expert_E):
    """torchtitan 0.3's ``GroupedExperts.forward`` (no expert parallelism) without its casts to bf16."""
    offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

    def mm(a, w):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)

    return mm(torch.nn.functional.silu(mm(x_RD, self.w1_EFD)) * mm(x_RD, self.w3_EFD), self.w2_EDF)


@pytest.mark.slow
def test_deepseek_v3_exported_logits_match_torchtitans_forward(
    capsys, deepseek, tmp_path, monkeypatch
):
    """torchtitan 0.3's grouped experts compute in bf16 whatever the model's dtype
    (``GroupedExperts.forward`` casts the tokens and the three weights with
    ``.bfloat16()``), transformers' in fp32: each expert's output is rounded apart by
    bf16's 2**-9 relative step, which two MoE layers carry to ~1e-2 of logits of size ~2
    (seen 1.3e-2); 5e-2 holds that and still fails a wrong mapping (the expert bias
    left out: 2.4; two experts swapped: 1.2). With torchtitan's experts run in fp32 (the
    same ``_grouped_mm`` calls, no casts) only float rounding is left (seen 3e-5:
    interleaved RoPE and MLA's sums in another order, times the route scale 2.5), so
    1e-4 there proves the bf16 casts are the whole difference. The routing agrees
    because the config.json describes torchtitan's router (see ``titan_models``)."""
    titan, step, config = deepseek
    _to_hf(capsys, step, config, tmp_path / "hf")
    theirs, ours = _logits(titan, tmp_path / "hf")
    torch.testing.assert_close(ours, theirs, atol=5e-2, rtol=0)
    from torchtitan.models.common.moe import GroupedExperts

    monkeypatch.setattr(GroupedExperts, "forward", _grouped_experts_in_fp32)
    theirs, ours = _logits(titan, tmp_path / "hf")
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_hf_back_to_torchtitan_at_2_is_torchtitans_from_hf(capsys, llama, tmp_path):
    titan, step, config = llama
    _to_hf(capsys, step, config, tmp_path / "hf")
    loaded = _back_is_from_hf(capsys, titan, tmp_path / "hf", "llama3")
    _bits_equal(loaded, titan.state)


def test_qwen3_to_hf_is_torchtitans_to_hf_and_loads_and_comes_back_as_from_hf(
    capsys, qwen, tmp_path
):
    titan, step, config = qwen
    assert _to_hf(capsys, step, config, tmp_path / "hf")["mapping"]["name"] == "qwen3"
    _loads_as_to_hf_gives(titan, tmp_path / "hf")
    _back_is_from_hf(capsys, titan, tmp_path / "hf", "qwen3")


def test_deepseek_v3_moe_to_hf_is_torchtitans_to_hf_and_loads_and_comes_back_as_from_hf(
    capsys, deepseek, tmp_path
):
    titan, step, config = deepseek
    assert _to_hf(capsys, step, config, tmp_path / "hf")["mapping"]["name"] == "deepseek_v3"
    _loads_as_to_hf_gives(titan, tmp_path / "hf")
    _back_is_from_hf(capsys, titan, tmp_path / "hf", "deepseek_v3")


def test_a_layer_more_than_the_config_is_exit_3_naming_it(capsys, llama, tmp_path):
    titan, step, _ = llama
    config = tmp_path / "one-layer"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({**titan.hf_config, "num_hidden_layers": 1}))
    code, _, line = _cli(
        capsys, "convert", step, tmp_path / "hf", "--to", "full", "--format", "hf",
        "--hf-config", config,
    )  # fmt: skip
    layer_1 = [k for k in titan.state if k.startswith("layers.1.")]
    size = sum(titan.state[k].nbytes for k in layer_1)
    assert (code, line) == (
        3,
        f"shardckpt: error: '{step}': 9 tensors ({size} bytes) the mapping does not cover, e.g. "
        "'layers.1.attention.qkv_linear.wq.weight' (its layer 1 is outside the mapping's 0..0): "
        f"{', '.join(layer_1[:8])} ...: pass the config of this model (--hf-config), --drop "
        "what is not to be exported, or --map a mapping that covers it",
    )
    _nothing_left(tmp_path, "one-layer")


def test_an_expert_more_than_the_config_is_exit_3_naming_it(capsys, deepseek, tmp_path):
    titan, step, _ = deepseek
    config = tmp_path / "three-experts"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({**titan.hf_config, "n_routed_experts": 3}))
    code, _, line = _cli(
        capsys, "convert", step, tmp_path / "hf", "--to", "full", "--format", "hf",
        "--hf-config", config, "--map", "deepseek_v3",
    )  # fmt: skip
    assert (code, line) == (
        3,
        f"shardckpt: error: '{step}': 'layers.1.moe.routed_experts.inner_experts.w1_EFD' holds "
        "4 experts on dim 0, and the config says 3: pass the config of this model (--hf-config)",
    )
    _nothing_left(tmp_path, "three-experts")


def test_a_tensor_no_rule_covers_is_exit_3_unless_dropped(capsys, llama, tmp_path):
    titan, _, config = llama
    state = {**titan.state, "layers.0.attention.extra.weight": torch.ones(5, 3)}
    dcp.save(state, checkpoint_id=tmp_path / "step-0", no_dist=True)
    argv = ["convert", tmp_path / "step-0", tmp_path / "hf", "--to", "full", "--format", "hf",
            "--hf-config", config]  # fmt: skip
    code, _, line = _cli(capsys, *argv)
    assert (code, line) == (
        3,
        f"shardckpt: error: '{tmp_path / 'step-0'}': 1 tensor (60 bytes) the mapping does not "
        "cover, e.g. 'layers.0.attention.extra.weight' (no rule of the mapping names it): "
        "layers.0.attention.extra.weight: pass the config of this model (--hf-config), --drop "
        "what is not to be exported, or --map a mapping that covers it",
    )
    _nothing_left(tmp_path, "step-0")
    code, out, err = _cli(capsys, *argv, "--drop", r"\.extra\.", "--json")
    assert code == 0, err
    assert json.loads(out)["mapping"]["dropped"] == {
        "tensors": 1,
        "bytes": 60,
        "names": ["layers.0.attention.extra.weight"],
    }
    _bits_equal(_hf_weights(tmp_path / "hf"), titan.adapter.to_hf(dict(titan.state)))


def test_a_tensor_the_mapping_expects_and_the_source_lacks_is_exit_3(capsys, llama, tmp_path):
    titan, _, config = llama
    state = {k: v for k, v in titan.state.items() if k != "layers.1.ffn_norm.weight"}
    dcp.save(state, checkpoint_id=tmp_path / "step-0", no_dist=True)
    code, _, line = _cli(
        capsys, "convert", tmp_path / "step-0", tmp_path / "hf", "--to", "full",
        "--format", "hf", "--hf-config", config, "--map", "llama3",
    )  # fmt: skip
    assert (code, line) == (
        3,
        f"shardckpt: error: '{tmp_path / 'step-0'}': lacks 1 tensor the mapping 'llama3' expects "
        "at its config's sizes, e.g. 'layers.1.ffn_norm.weight': pass the config of this model "
        "(--hf-config), or --map the mapping of its architecture",
    )
    _nothing_left(tmp_path, "step-0")


def test_a_mapping_without_sizes_and_a_bad_mapping_file_are_refused(capsys, llama, tmp_path):
    _, step, _ = llama
    argv = ["convert", step, tmp_path / "hf", "--to", "full", "--format", "hf"]
    assert _cli(capsys, *argv, "--map", "llama3")[::2] == (
        2,
        f"shardckpt: error: '{step}': --map llama3 needs the model's sizes (layers, heads, "
        "kv_heads), and SRC does not store them: pass --hf-config DIR, the directory of the "
        "model's config.json",
    )
    assert _cli(capsys, *argv, "--map", "llama9")[::2] == (
        2,
        "shardckpt: error: --map 'llama9': no such mapping: name one of deepseek_v3, llama3, "
        "megatron_gpt, megatron_moe, megatron_qwen2, qwen3, or a mapping file ending in .toml",
    )
    bad = tmp_path / "mine.toml"
    bad.write_text('name = "mine"\n[[tensors]]\nfrom = "a.{layer}"\nto = "b"\n')
    assert _cli(capsys, *argv, "--map", bad)[::2] == (
        3,
        f"shardckpt: error: '{bad}': is not a mapping (ValueError: tensors[0] names range "
        "'layer', which ranges lacks): write it as docs/trainers/mappings.md describes, or name a "
        "shipped mapping",
    )
    _nothing_left(tmp_path, "mine.toml")


def test_a_users_own_mapping_file_maps_and_is_named_in_the_summary(capsys, llama, tmp_path):
    titan, step, config = llama
    mine = tmp_path / "mine.toml"
    shutil.copy(rules.shipped()["llama3"], mine)
    doc = _to_hf(capsys, step, config, tmp_path / "hf", "--map", mine)
    assert (doc["mapping"]["name"], doc["mapping"]["file"]) == ("llama3", str(mine))
    _bits_equal(_hf_weights(tmp_path / "hf"), titan.adapter.to_hf(dict(titan.state)))


def test_rope_order_is_torchtitans_permute():
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    rows = torch.arange(48.0).unsqueeze(1)
    permuted = Llama3StateDictAdapter._permute(None, rows, 3)
    assert permuted.squeeze(1).long().tolist() == layout.rope_order(48, 3)


def test_the_proof_finds_an_element_read_twice_or_left_unread():
    meta = TensorMeta("w", (4, 2), torch.float32)
    twice = layout.Mapped(
        {"a": TensorMeta("a", (4, 2), torch.float32)},
        {"a": (layout.Run("w", 0, 4), layout.Run("w", 2, 6))},
    )
    with pytest.raises(Exception, match="elements 2.. of 'w' would be read twice"):
        layout.prove(twice, {"w": meta}, "src")
    short = layout.Mapped(
        {"a": TensorMeta("a", (3, 2), torch.float32)}, {"a": (layout.Run("w", 0, 6),)}
    )
    with pytest.raises(Exception, match="elements 6.. of 'w' would be left unread"):
        layout.prove(short, {"w": meta}, "src")


def test_a_dry_run_says_which_mapping_and_its_ledger_and_writes_nothing(capsys, llama, tmp_path):
    titan, step, config = llama
    code, out, _ = _cli(
        capsys, "convert", step, tmp_path / "hf", "--to", "full", "--format", "hf",
        "--hf-config", config, "--dry-run",
    )  # fmt: skip
    size = sum(t.nbytes for t in titan.state.values())
    assert code == 0
    assert out.splitlines()[-1] == (
        f"mapped with 'llama3' (to hf): every element of 21 tensors ({size / 2**10:.1f} KiB) in "
        f"21 tensors ({size / 2**10:.1f} KiB) of DST"
    )
    _nothing_left(tmp_path)


def test_a_damaged_hf_source_mapped_back_is_exit_3_naming_the_file(capsys, llama, tmp_path):
    """The mapped reader reads through the source's own: its checksums still judge every byte."""
    _, step, config = llama
    _to_hf(capsys, step, config, tmp_path / "hf")
    shard = tmp_path / "hf" / "model-00001-of-00001.safetensors"
    with open(shard, "r+b") as f:
        f.seek(-1000, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1000, os.SEEK_END)
        f.write(bytes([byte ^ 1]))
    code, _, line = _cli(
        capsys, "convert", tmp_path / "hf", tmp_path / "step-1", "--to", "sharded",
        "--format", "torchtitan", "--world-size", "2", "--map", "llama3",
    )  # fmt: skip
    assert code == 3
    assert line.startswith(
        f"shardckpt: error: '{shard}': the bytes of 'lm_head.weight' do not match the checksum "
        "written with them"
    )
    _nothing_left(tmp_path, "hf")


def test_a_rule_left_out_by_a_flag_goes_only_where_the_config_sets_it(tmp_path):
    amap = rules.load("megatron_gpt")
    lm_head = [r for r in amap.rules if r.targets == ("lm_head.weight",)]
    assert [r.unless for r in lm_head] == ["tied"]
    for config, kept in (({}, True), ({"tie_word_embeddings": False}, True),
                         ({"tie_word_embeddings": True}, False)):  # fmt: skip
        assert (lm_head[0] in amap.for_config(config).rules) is kept
    bad = tmp_path / "mine.toml"
    bad.write_text('name = "mine"\n[[tensors]]\nfrom = "a"\nto = "b"\nunless = "tied"\n')
    with pytest.raises(Exception, match="tensors\\[0\\] names flag 'tied', which flags lacks"):
        rules.read(bad)
