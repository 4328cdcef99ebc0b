"""migration's Python API: each mode, each layout, sharding, torch pickles, dtypes, metadata, --verify."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from slim_mha import SlimMultiheadAttention
from slim_mha.bias import BIAS_NAMES, SlimBiases, unfold_key_bias, zero_key_bias
from slim_mha.migration import (
    FORMAT_VERSION,
    fold_checkpoint,
    format_report,
    inspect_checkpoint,
    strip_checkpoint,
    to_stock_checkpoint,
)

from _migration_checkpoints import (
    STOCK_MHA,
    attention_inputs,
    key_bias_free,
    load_sharded,
    module_state,
    prefixed,
    save_sharded,
    stock_attention,
    tree_digest,
)
from _migration_helpers import private_ledger, reads_pickles  # noqa: F401 (private_ledger: autouse)
from _reference import assert_close_scaled

# Every configuration stock accepts; ids name them.
CONFIGS = {
    "plain": {},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "bias_kv+zero_attn": {"add_bias_kv": True, "add_zero_attn": True},
    "kdim_vdim": {"kdim": 5, "vdim": 6},
    "kdim_vdim+bias_kv": {"kdim": 5, "vdim": 6, "add_bias_kv": True},
    "kdim_vdim+zero_attn": {"kdim": 5, "vdim": 6, "add_zero_attn": True},
}
BIASLESS = {"no_bias": {"bias": False}, "no_bias+bias_kv": {"bias": False, "add_bias_kv": True}}


def slim_from(state: dict, embed_dim: int = 8, num_heads: int = 2, **config) -> SlimMultiheadAttention:
    """Built by the constructor and loaded through load_state_dict, as a user would."""
    module = SlimMultiheadAttention(embed_dim, num_heads, **config)
    module.load_state_dict(state, strict=True)
    return module.eval()


def stock_from(state: dict, embed_dim: int = 8, num_heads: int = 2, **config):
    """Stock, strict; a key-bias-free state is first put in stock's layout (absent slots are zero)."""
    state = dict(state)
    if "q_proj_bias" in state:
        biases = SlimBiases(*(state.pop(name, None) for name in BIAS_NAMES), bias_k=None)
        state["in_proj_bias"], _ = unfold_key_bias(biases, embed_dim=embed_dim)
    module = STOCK_MHA(embed_dim, num_heads, **config)
    module.load_state_dict(state, strict=True)
    return module.eval()


def outputs(module, config) -> torch.Tensor:
    inputs = attention_inputs(module.embed_dim, config.get("kdim"), config.get("vdim"))
    with torch.no_grad():
        return module(*inputs, need_weights=False)[0]


def zero_attn_marks(config) -> list[str]:
    return ["attn"] if config.get("add_zero_attn") else []


# -------------------------------------------------------------------------------- fold / to-stock


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fold_loads_into_stock_and_slim_with_the_original_outputs(tmp_path, config):
    stock = stock_attention(**config)
    # A plain module beside it: a lone add_zero_attn module has nothing to fold, and the run says so.
    save_file(
        {**prefixed(stock, "attn."), **prefixed(stock_attention(seed=5), "plain.")}, tmp_path / "stock.safetensors"
    )

    fold_checkpoint(
        tmp_path / "stock.safetensors", tmp_path / "folded.safetensors", zero_attn=zero_attn_marks(config), verify=True
    )
    folded = module_state(load_file(tmp_path / "folded.safetensors"), "attn.")
    assert folded.keys() == stock.state_dict().keys()  # stock's layout, names and shapes
    key_slot = folded["in_proj_bias"][8:16]
    if config.get("add_zero_attn"):  # nothing can be folded: the module is left as stock has it
        assert torch.equal(key_slot, stock.in_proj_bias[8:16])
    else:
        assert torch.count_nonzero(key_slot) == 0
    expected = outputs(stock, config)
    assert_close_scaled(outputs(stock_from(folded, **config), config), expected, "stock loading fold's output")
    assert_close_scaled(outputs(slim_from(folded, **config), config), expected, "slim loading fold's output")


@pytest.mark.parametrize("config", [{}, {"kdim": 5, "vdim": 6}], ids=["plain", "kdim_vdim"])
def test_strip_then_to_stock_keeps_the_function(tmp_path, config):
    stock = stock_attention(**config)
    save_file(prefixed(stock, "attn."), tmp_path / "stock.safetensors")
    strip_checkpoint(tmp_path / "stock.safetensors", tmp_path / "mid.safetensors", verify=True)
    mid = module_state(load_file(tmp_path / "mid.safetensors"), "attn.")
    assert "in_proj_bias" not in mid and "k_proj_bias" not in mid
    assert_close_scaled(
        outputs(slim_from(mid, **config), config), outputs(stock, config), "slim loading strip's output"
    )

    to_stock_checkpoint(tmp_path / "mid.safetensors", tmp_path / "back.safetensors", verify=True)
    back_state = module_state(load_file(tmp_path / "back.safetensors"), "attn.")
    assert set(back_state) == set(stock.state_dict())
    assert_close_scaled(outputs(stock_from(back_state, **config), config), outputs(stock, config))


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fold_matches_the_bias_arithmetic(tmp_path, config):
    """One implementation: fold's file holds what slim_mha.bias.zero_key_bias makes of the stock state."""
    stock = stock_attention(**config)
    save_file(
        {**prefixed(stock, "attn."), **prefixed(stock_attention(seed=5), "plain.")}, tmp_path / "stock.safetensors"
    )
    fold_checkpoint(tmp_path / "stock.safetensors", tmp_path / "folded.safetensors", zero_attn=zero_attn_marks(config))
    expected = {key: value.detach() for key, value in stock.state_dict().items()}
    expected["in_proj_bias"], bias_k = zero_key_bias(
        expected["in_proj_bias"].double(),
        expected["bias_k"].double() if "bias_k" in expected else None,
        add_zero_attn=bool(config.get("add_zero_attn")),
    )
    if bias_k is not None:
        expected["bias_k"] = bias_k
    migrated = module_state(load_file(tmp_path / "folded.safetensors"), "attn.")
    assert migrated.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(migrated[key], value.float(), rtol=0, atol=1e-7, msg=key)


def test_fold_keeps_everything_else_bit_for_bit(tmp_path):
    stock = stock_attention(add_bias_kv=True)
    tensors = {**prefixed(stock, "layer.attn."), "layer.norm.weight": torch.randn(8), "head.weight": torch.randn(3, 8)}
    save_file(tensors, tmp_path / "in.safetensors")
    fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    out = load_file(tmp_path / "out.safetensors")
    changed = {"layer.attn.in_proj_bias", "layer.attn.bias_k"}
    for key, value in tensors.items():
        if key not in changed:
            assert torch.equal(out[key], value), key
    b_q, b_k, b_v = tensors["layer.attn.in_proj_bias"].chunk(3)
    assert torch.equal(out["layer.attn.in_proj_bias"], torch.cat([b_q, torch.zeros(8), b_v]))
    torch.testing.assert_close(out["layer.attn.bias_k"], tensors["layer.attn.bias_k"] - b_k.view(1, 1, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_dtypes_are_kept_exactly(tmp_path, dtype):
    stock = stock_attention(add_bias_kv=True)
    tensors = prefixed(stock, "attn.", dtype)
    tensors["attn.out_proj.bias"] = tensors["attn.out_proj.bias"].float()  # a mixed-dtype module too
    save_file(tensors, tmp_path / "in.safetensors")
    report = fold_checkpoint(
        tmp_path / "in.safetensors", tmp_path / "out.safetensors", fold_value_bias=True, verify=True
    )
    out = load_file(tmp_path / "out.safetensors")
    assert out["attn.in_proj_bias"].dtype == dtype
    assert torch.count_nonzero(out["attn.in_proj_bias"][8:]) == 0  # key and (folded) value slots
    assert out["attn.bias_k"].dtype == dtype
    assert out["attn.bias_v"].dtype == dtype
    assert out["attn.out_proj.bias"].dtype == torch.float32
    assert torch.equal(out["attn.in_proj_weight"], tensors["attn.in_proj_weight"])
    assert report.modules[0].verify_error is not None


def test_strip_and_fold_hold_the_same_biases_where_strip_is_exact(tmp_path):
    """fold keeps stock's layout with a zero key slot; strip drops the slot: the same q and v biases."""
    tensors = {**prefixed(stock_attention(seed=1), "a."), **prefixed(stock_attention(kdim=5, vdim=6, seed=2), "b.")}
    save_file(tensors, tmp_path / "in.safetensors")
    strip_checkpoint(tmp_path / "in.safetensors", tmp_path / "strip.safetensors", verify=True)
    fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "fold.safetensors")
    stripped, folded = load_file(tmp_path / "strip.safetensors"), load_file(tmp_path / "fold.safetensors")
    for prefix in ("a.", "b."):
        b_q, b_k, b_v = folded[prefix + "in_proj_bias"].chunk(3)
        assert torch.equal(stripped[prefix + "q_proj_bias"], b_q) and torch.equal(stripped[prefix + "v_proj_bias"], b_v)
        assert torch.count_nonzero(b_k) == 0
    assert stripped.keys() - folded.keys() == {"a.q_proj_bias", "a.v_proj_bias", "b.q_proj_bias", "b.v_proj_bias"}


def test_strip_refuses_bias_k_and_points_to_fold(tmp_path):
    save_file(prefixed(stock_attention(add_bias_kv=True), "attn."), tmp_path / "in.safetensors")
    with pytest.raises(ValueError) as caught:
        strip_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    source = tmp_path / "in.safetensors"
    assert str(caught.value) == (
        f"{source}: strip cannot convert 'attn' exactly: bias_k is present ('attn.bias_k' in {source}), "
        "so dropping the key bias is not exact; use fold, which folds it into bias_k (or pass keep_inexact=True to "
        "strip the rest and leave such modules as they are); nothing was written"
    )
    assert not (tmp_path / "out.safetensors").exists()


def test_strip_refuses_zero_attn_modules(tmp_path):
    tensors = {**prefixed(stock_attention(add_zero_attn=True), "a."), **prefixed(stock_attention(), "b.")}
    save_file(tensors, tmp_path / "in.safetensors")
    with pytest.raises(ValueError) as caught:
        strip_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors", zero_attn=["a"])
    assert str(caught.value) == (
        f"{tmp_path / 'in.safetensors'}: strip cannot convert 'a' exactly: it is marked add_zero_attn, and the "
        "zero key makes the key bias matter; use fold, which keeps stock's layout for it (or pass keep_inexact=True "
        "to strip the rest and leave such modules as they are); nothing was written"
    )
    assert not (tmp_path / "out.safetensors").exists()


def test_biasless_modules_pass_through_unchanged(tmp_path):
    tensors = {
        **prefixed(stock_attention(bias=False), "a."),
        **prefixed(stock_attention(bias=False, add_bias_kv=True), "b."),
        **prefixed(stock_attention(), "c."),
    }
    save_file(tensors, tmp_path / "in.safetensors")
    report = fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors", verify=True)
    out = load_file(tmp_path / "out.safetensors")
    for key in tensors:
        if key.startswith(("a.", "b.")):
            assert torch.equal(out[key], tensors[key]), key
    assert [(module.name, module.changed, module.action) for module in report.modules] == [
        ("a", False, "nothing to do (no input bias)"),
        ("b", False, "nothing to do (no input bias)"),
        ("c", True, "zero the key slot of in_proj_bias"),
    ]


# ------------------------------------------------------------------------------------ value bias


@pytest.mark.parametrize(
    "config", [{}, {"add_bias_kv": True}, {"kdim": 5, "vdim": 6}], ids=["plain", "bias_kv", "kdim"]
)
def test_fold_value_bias_is_exact_in_eval(tmp_path, config):
    stock = stock_attention(**config)
    save_file(prefixed(stock, "attn."), tmp_path / "in.safetensors")
    report = fold_checkpoint(
        tmp_path / "in.safetensors", tmp_path / "out.safetensors", fold_value_bias=True, verify=True
    )
    assert report.modules[0].action.endswith("fold the value bias into out_proj.bias (exact in eval only)")
    state = module_state(load_file(tmp_path / "out.safetensors"), "attn.")
    assert torch.count_nonzero(state["in_proj_bias"][8:]) == 0  # key and value slots are zero
    assert_close_scaled(outputs(stock_from(state, **config), config), outputs(stock, config))

    strip_checkpoint(
        tmp_path / "in.safetensors", tmp_path / "stripped.safetensors", fold_value_bias=True, verify=True
    ) if not config.get("add_bias_kv") else None
    if not config.get("add_bias_kv"):  # strip's file: no value bias at all
        stripped = module_state(load_file(tmp_path / "stripped.safetensors"), "attn.")
        assert "v_proj_bias" not in stripped and "in_proj_bias" not in stripped
        to_stock_checkpoint(tmp_path / "stripped.safetensors", tmp_path / "back.safetensors", verify=True)
        back = module_state(load_file(tmp_path / "back.safetensors"), "attn.")
        assert torch.count_nonzero(back["in_proj_bias"][8:]) == 0
        assert_close_scaled(outputs(stock_from(back, **config), config), outputs(stock, config))


def test_fold_value_bias_is_not_exact_in_training(tmp_path):
    """Why the help says eval only: attention dropout rescales rows, so b_v no longer sums out."""
    stock = stock_attention()
    save_file(prefixed(stock, "attn."), tmp_path / "in.safetensors")
    fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors", fold_value_bias=True)
    slim = stock_from(module_state(load_file(tmp_path / "out.safetensors"), "attn."))
    stock.dropout = slim.dropout = 0.5
    stock.train(), slim.train()
    torch.manual_seed(0)
    expected = stock(*attention_inputs(8), need_weights=True)[0]
    torch.manual_seed(0)
    actual = slim(*attention_inputs(8), need_weights=True)[0]
    assert not torch.allclose(actual, expected, atol=1e-3)


def test_fold_value_bias_refuses_zero_attn(tmp_path):
    save_file(prefixed(stock_attention(add_zero_attn=True), "attn."), tmp_path / "in.safetensors")
    with pytest.raises(ValueError) as caught:
        fold_checkpoint(
            tmp_path / "in.safetensors", tmp_path / "out.safetensors", zero_attn=["attn"], fold_value_bias=True
        )
    assert str(caught.value) == (
        f"{tmp_path / 'in.safetensors'}: fold cannot convert 'attn' exactly: it is marked add_zero_attn, and the "
        "zero value token cannot absorb -b_v, so --fold-value-bias would change its output; drop "
        "--fold-value-bias; nothing was written"
    )


def test_fold_value_bias_on_an_already_slim_checkpoint(tmp_path):
    stock = stock_attention(add_bias_kv=True)
    save_file(prefixed(stock, "attn."), tmp_path / "in.safetensors")
    fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "slim.safetensors")
    report = fold_checkpoint(
        tmp_path / "slim.safetensors", tmp_path / "eval.safetensors", fold_value_bias=True, verify=True
    )
    assert report.modules[0].action == (
        "zero the key slot of in_proj_bias, fold it into bias_k; fold the value bias into out_proj.bias (exact in eval only)"
    )
    state = module_state(load_file(tmp_path / "eval.safetensors"), "attn.")
    assert_close_scaled(outputs(stock_from(state, add_bias_kv=True), {}), outputs(stock, {}))


# ------------------------------------------------------------------------------------ zero-attn


def test_zero_attn_globs_mark_every_matching_module(tmp_path):
    tensors = {}
    for layer in range(3):
        tensors.update(prefixed(stock_attention(add_zero_attn=True, seed=layer), f"decoder.layers.{layer}.self_attn."))
    tensors.update(prefixed(stock_attention(seed=9), "encoder.layers.0.self_attn."))
    save_file(tensors, tmp_path / "in.safetensors")
    report = fold_checkpoint(
        tmp_path / "in.safetensors", tmp_path / "out.safetensors", zero_attn=["decoder.layers.*.self_attn"], verify=True
    )
    out = load_file(tmp_path / "out.safetensors")
    for layer in range(3):  # left as stock has them: their key bias matters
        key = f"decoder.layers.{layer}.self_attn.in_proj_bias"
        assert torch.equal(out[key], tensors[key])
    assert torch.count_nonzero(out["encoder.layers.0.self_attn.in_proj_bias"][8:16]) == 0
    assert [module.zero_attn for module in report.modules] == [True, True, True, None]  # a stock module cannot say
    with safe_open(tmp_path / "out.safetensors", "pt") as handle:
        assert handle.metadata()["slim_mha.zero_attn_modules"] == ",".join(
            f"decoder.layers.{layer}.self_attn" for layer in range(3)
        )


def test_zero_attn_pattern_matching_nothing_is_an_error(tmp_path):
    save_file(prefixed(stock_attention(), "encoder.attn."), tmp_path / "in.safetensors")
    with pytest.raises(ValueError) as caught:
        fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors", zero_attn=["decoder.*"])
    assert str(caught.value) == (
        f"{tmp_path / 'in.safetensors'}: zero_attn 'decoder.*' matches no attention module; modules are "
        "named like 'encoder.attn' (see inspect)"
    )


def test_zero_attn_mark_contradicting_a_slim_checkpoint_is_an_error(tmp_path):
    save_file(prefixed(stock_attention(), "attn."), tmp_path / "in.safetensors")
    strip_checkpoint(tmp_path / "in.safetensors", tmp_path / "slim.safetensors")
    with pytest.raises(ValueError) as caught:
        to_stock_checkpoint(tmp_path / "slim.safetensors", tmp_path / "out.safetensors", zero_attn=["attn"])
    assert str(caught.value) == (
        f"'attn.q_proj_bias' in {tmp_path / 'slim.safetensors'}: 'attn' is marked add_zero_attn but has no "
        "k_proj_bias; a slim add_zero_attn module keeps its key bias, so this checkpoint lost it when it was "
        "converted without the mark: convert the original stock checkpoint again with zero_attn"
    )


def test_zero_attn_string_instead_of_list_is_refused(tmp_path):
    save_file(prefixed(stock_attention(), "attn."), tmp_path / "in.safetensors")
    with pytest.raises(ValueError, match="zero_attn must be a list of module names or patterns"):
        fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors", zero_attn="attn")


# ------------------------------------------------------------------------------------ sharded


def _sharded_stock(tmp_path):
    """Two modules whose tensors straddle shards, plus other weights; returns (tensors, directory)."""
    tensors = {
        **prefixed(stock_attention(add_bias_kv=True, seed=1), "enc.attn."),
        **prefixed(stock_attention(seed=2), "dec.attn."),
        "embed.weight": torch.randn(10, 8),
        "head.weight": torch.randn(10, 8).to(torch.bfloat16),
    }
    shards = [
        ["embed.weight", "enc.attn.in_proj_weight", "enc.attn.bias_k", "enc.attn.bias_v"],
        ["enc.attn.in_proj_bias", "enc.attn.out_proj.weight", "enc.attn.out_proj.bias", "dec.attn.in_proj_weight"],
        ["dec.attn.in_proj_bias", "dec.attn.out_proj.weight", "dec.attn.out_proj.bias", "head.weight"],
    ]
    return tensors, save_sharded(tensors, tmp_path / "stock", shards, metadata={"format": "pt"})


def test_sharded_fold_keeps_shards_index_and_metadata(tmp_path):
    tensors, source = _sharded_stock(tmp_path)
    before = tree_digest(source)
    report = fold_checkpoint(source, tmp_path / "slim", verify=True)
    assert tree_digest(source) == before
    assert report.shards == tuple(f"model-0000{n}-of-00003.safetensors" for n in (1, 2, 3))

    out_dir = tmp_path / "slim"
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert sorted(path.name for path in out_dir.iterdir()) == sorted([*report.shards, "model.safetensors.index.json"])
    stored = {}
    for name in report.shards:
        with safe_open(out_dir / name, "pt") as handle:
            stored.update({key: name for key in handle.keys()})
            assert handle.metadata() == {
                "format": "pt",
                "slim_mha.format_version": str(FORMAT_VERSION),
                "slim_mha.mode": "fold",
            }
    assert index["weight_map"] == stored
    assert stored["enc.attn.in_proj_bias"] == "model-00002-of-00003.safetensors"
    assert stored["enc.attn.bias_k"] == "model-00001-of-00003.safetensors"
    out = load_sharded(out_dir)
    assert index["metadata"] == {
        "origin": "tests",
        "slim_mha.format_version": str(FORMAT_VERSION),
        "slim_mha.mode": "fold",
        "total_size": sum(t.numel() * t.element_size() for t in out.values()),
    }
    assert out["head.weight"].dtype == torch.bfloat16 and torch.equal(out["head.weight"], tensors["head.weight"])


def test_sharded_fold_through_the_index_path_loads_into_stock(tmp_path):
    tensors, source = _sharded_stock(tmp_path)
    fold_checkpoint(source / "model.safetensors.index.json", tmp_path / "folded")
    back = load_sharded(tmp_path / "folded")
    assert back.keys() == tensors.keys()
    for prefix, config in (("enc.attn.", {"add_bias_kv": True}), ("dec.attn.", {})):
        expected = stock_from(module_state(tensors, prefix), **config)
        actual = stock_from(module_state(back, prefix), **config)
        assert_close_scaled(outputs(actual, config), outputs(expected, config))


def test_directory_with_a_single_model_file(tmp_path):
    (tmp_path / "ckpt").mkdir()
    save_file(prefixed(stock_attention(), "attn."), tmp_path / "ckpt" / "model.safetensors")
    fold_checkpoint(tmp_path / "ckpt", tmp_path / "slim")
    assert [path.name for path in (tmp_path / "slim").iterdir()] == ["model.safetensors"]


# ------------------------------------------------------------------------------------ torch pickles


@pytest.mark.parametrize("wrapper", [None, "state_dict", "model"])
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
@reads_pickles
def test_torch_state_dicts_and_their_wrappers(tmp_path, wrapper, suffix):
    stock = stock_attention(add_bias_kv=True)
    state = prefixed(stock, "attn.")
    source = tmp_path / f"ckpt{suffix}"
    torch.save(state if wrapper is None else {wrapper: state, "epoch": 3}, source)
    report = fold_checkpoint(source, tmp_path / "out.safetensors", verify=True)
    assert report.notes == (() if wrapper is None else (f"read the state dict under '{wrapper}'; ignored: epoch",))
    out = load_file(tmp_path / "out.safetensors")
    assert_close_scaled(outputs(stock_from(module_state(out, "attn."), add_bias_kv=True), {}), outputs(stock, {}))
    with safe_open(tmp_path / "out.safetensors", "pt") as handle:
        assert handle.metadata()["format"] == "pt"


@reads_pickles
def test_torch_tensors_sharing_storage_are_written_separately(tmp_path):
    state = prefixed(stock_attention(), "attn.")
    state["tied.weight"] = state["attn.out_proj.weight"]  # tied weights share storage in memory
    torch.save(state, tmp_path / "tied.pt")
    fold_checkpoint(tmp_path / "tied.pt", tmp_path / "out.safetensors")
    out = load_file(tmp_path / "out.safetensors")
    assert torch.equal(out["tied.weight"], out["attn.out_proj.weight"])


# ------------------------------------------------------------------------------------ verify


def test_verify_catches_a_wrong_fold_and_writes_nothing(tmp_path, monkeypatch):
    """The checker can fail: a fold that forgets to shift bias_k is caught."""
    import slim_mha.migration._plan as plan

    def forgetful_fold(in_proj_bias, bias_k=None, *, add_zero_attn=False):
        b_q, _, b_v = in_proj_bias.chunk(3)
        return torch.cat([b_q, torch.zeros_like(b_q), b_v]), bias_k

    monkeypatch.setattr(plan, "zero_key_bias", forgetful_fold)
    source = tmp_path / "in.safetensors"
    save_file(prefixed(stock_attention(add_bias_kv=True), "attn."), source)
    with pytest.raises(RuntimeError) as caught:
        fold_checkpoint(source, tmp_path / "out.safetensors", verify=True)
    message = str(caught.value)
    assert message.startswith(f"{source}: verify=True failed for 'attn': the migrated module's output differs ")
    assert message.endswith("more than the 1e-05 allowed for torch.float32; nothing was written")
    assert not (tmp_path / "out.safetensors").exists()
    fold_checkpoint(source, tmp_path / "out.safetensors")  # unverified, the bug would have gone through


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_verify_passes_honest_folds_in_low_precision(tmp_path, dtype):
    tensors = {}
    for seed in range(4):
        tensors.update(prefixed(stock_attention(32, add_bias_kv=True, seed=seed), f"m{seed}.", dtype))
    save_file(tensors, tmp_path / "in.safetensors")
    report = fold_checkpoint(
        tmp_path / "in.safetensors", tmp_path / "out.safetensors", verify=True, fold_value_bias=True
    )
    assert all(module.verify_error is not None for module in report.modules)


# ------------------------------------------------------------------------------------ inspect


def test_inspect_reports_layout_key_bias_and_plans(tmp_path):
    zero_key = stock_attention(seed=3)
    with torch.no_grad():
        zero_key.in_proj_bias[8:16] = 0
    tensors = {
        **prefixed(stock_attention(add_bias_kv=True), "kv."),
        **prefixed(zero_key, "zero_key."),
        **prefixed(stock_attention(add_zero_attn=True), "za."),
        **prefixed(stock_attention(bias=False), "nobias."),
        "other.weight": torch.zeros(2),
    }
    save_file(tensors, tmp_path / "in.safetensors")
    report = inspect_checkpoint(tmp_path / "in.safetensors", zero_attn=["za"])
    summary = [(m.name, m.layout, m.key_bias, m.bias_kv, m.zero_attn, m.strip, m.fold) for m in report.modules]
    assert summary == [
        (
            "kv",
            "stock",
            "non-zero",
            True,
            None,
            "refuses: bias_k is present (use fold)",
            "zero the key slot of in_proj_bias, fold it into bias_k",
        ),
        (
            "nobias",
            "no input bias",
            "absent",
            False,
            None,
            "nothing to do (no input bias)",
            "nothing to do (no input bias)",
        ),
        (
            "za",
            "stock",
            "non-zero",
            False,
            True,
            "refuses: add_zero_attn (use fold)",
            "nothing to fold (add_zero_attn: the zero key makes the key bias matter; stock's layout kept)",
        ),
        (
            "zero_key",
            "stock",
            "zero",
            False,
            None,
            "drop the key slice of in_proj_bias",
            "zero the key slot of in_proj_bias",
        ),
    ]  # None: a stock checkpoint cannot record add_zero_attn, and only "za" was marked
    assert report.modules[0].key_bias_max == pytest.approx(float(tensors["kv.in_proj_bias"][8:16].abs().max()))
    assert report.tensors == len(tensors)
    assert report.destination is None and not report.written


def test_inspect_of_slim_and_kdim_modules(tmp_path):
    save_file(
        key_bias_free(stock_attention(kdim=5, vdim=6, add_zero_attn=True), "attn.", add_zero_attn=True),
        tmp_path / "slim.safetensors",
        metadata={"slim_mha.format_version": "1"},
    )
    text = format_report(inspect_checkpoint(tmp_path / "slim.safetensors"))
    assert text.splitlines()[2:] == [
        "attn: slim, embed_dim=8, kdim=5, vdim=6, float32, key bias non-zero (max |b_k| "
        f"{inspect_checkpoint(tmp_path / 'slim.safetensors').modules[0].key_bias_max:.3g}), bias_k/bias_v no, "
        "add_zero_attn yes",
        "  shapes:   q_proj_weight [8, 8], k_proj_weight [8, 5], v_proj_weight [8, 6], q_proj_bias [8], "
        "k_proj_bias [8], v_proj_bias [8], out_proj.weight [8, 8], out_proj.bias [8]",
        "  strip:    nothing to do (already slim)",
        "  fold:     pack the input biases into in_proj_bias with the kept k_proj_bias",
        "  to-stock: pack the input biases into in_proj_bias with the kept k_proj_bias",
    ]


def test_a_bare_module_checkpoint_has_the_root_prefix(tmp_path):
    stock = stock_attention(add_bias_kv=True)
    save_file(prefixed(stock, ""), tmp_path / "mha.safetensors")
    report = inspect_checkpoint(tmp_path / "mha.safetensors", zero_attn=["<root>"])
    assert [(module.name, module.zero_attn) for module in report.modules] == [("<root>", True)]
    report = fold_checkpoint(tmp_path / "mha.safetensors", tmp_path / "folded.safetensors", verify=True)
    assert [module.name for module in report.modules] == ["<root>"]
    state = load_file(tmp_path / "folded.safetensors")
    assert state.keys() == stock.state_dict().keys()
    config = {"add_bias_kv": True}
    assert_close_scaled(outputs(stock_from(state, **config), config), outputs(stock, config))


@reads_pickles
def test_legacy_torch_serialization_is_read_too(tmp_path):
    stock = stock_attention()
    torch.save(prefixed(stock, "attn."), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    fold_checkpoint(tmp_path / "legacy.pt", tmp_path / "out.safetensors", verify=True)
    state = module_state(load_file(tmp_path / "out.safetensors"), "attn.")
    assert_close_scaled(outputs(stock_from(state), {}), outputs(stock, {}))


def test_randomized_sweep_of_configurations_and_dtypes(tmp_path):
    """One seeded sweep over the whole matrix: strip where exact (and back), else fold, maybe with the value
    bias, verified; every output loads into stock in the source's dtype."""
    rng = torch.Generator().manual_seed(3)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    folded_value = 0
    for case in range(20):
        embed_dim = pick([4, 6, 8, 12])
        config = {
            "bias": pick([True, True, True, False]),
            "add_bias_kv": pick([True, False]),
            "add_zero_attn": pick([True, False]),
            "kdim": pick([None, 3, 7]),
            "vdim": pick([None, 5]),
        }
        dtype = pick([torch.float32, torch.bfloat16, torch.float16, torch.float64])
        fold_value = config["bias"] and not config["add_zero_attn"] and pick([True, False])
        stock = stock_attention(embed_dim, num_heads=pick([1, 2]), seed=case, **config)
        source = tmp_path / f"case{case}.safetensors"
        save_file(prefixed(stock, "attn.", dtype), source)
        marks = zero_attn_marks(config)
        strips = not (config["add_bias_kv"] or config["add_zero_attn"])
        mode = strip_checkpoint if strips else fold_checkpoint
        if not config["bias"] or (config["add_zero_attn"] and not fold_value):
            with pytest.raises(ValueError, match="nothing to do"):
                mode(source, tmp_path / f"slim{case}.safetensors", zero_attn=marks)
            continue
        mode(source, tmp_path / f"slim{case}.safetensors", zero_attn=marks, fold_value_bias=fold_value, verify=True)
        folded_value += fold_value
        back = tmp_path / f"slim{case}.safetensors"
        if strips:
            to_stock_checkpoint(back, tmp_path / f"back{case}.safetensors", zero_attn=marks, verify=True)
            back = tmp_path / f"back{case}.safetensors"
        back = load_file(back)
        assert {key: value.dtype for key, value in back.items()} == {f"attn.{key}": dtype for key in stock.state_dict()}
    assert folded_value >= 3  # the seed covers the value fold too
