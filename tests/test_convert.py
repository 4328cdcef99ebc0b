"""convert / to_stock / fold_value_bias on live modules and module trees."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from slim_mha import SlimMultiheadAttention, convert, fold_value_bias, patched, to_stock
from slim_mha._swap import FOLDED_VALUE_BIAS, SLIM_ATTRIBUTES, has_folded_value_bias
from slim_mha.attention import slim_options
from slim_mha.patching import PatchedMultiheadAttention

from _reference import STOCK_MHA, assert_close_scaled, randomize_parameters

E, H = 8, 2
CONFIGS = [
    dict(bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, batch_first=batch_first, **dims)
    for bias, bias_kv, zero_attn, batch_first, dims in itertools.product(
        (True, False), (True, False), (True, False), (True, False), ({}, {"kdim": 6, "vdim": 5})
    )
]


def config_id(config: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in config.items())


def stock_attention(config: dict, dtype=torch.float64, seed: int = 0) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    return randomize_parameters(STOCK_MHA(E, H, **config, dtype=dtype), seed=seed)


def attention_inputs(module: nn.MultiheadAttention, dtype=torch.float64, seed: int = 1) -> tuple:
    """(query, key, value) in the module's layout; self-attention when the dims allow it."""
    generator = torch.Generator().manual_seed(seed)
    shape = (3, 5) if module.batch_first else (5, 3)
    query = torch.randn(*shape, E, generator=generator, dtype=dtype)
    if module._qkv_same_embed_dim:
        return query, query, query
    key = torch.randn(*shape, module.kdim, generator=generator, dtype=dtype)
    value = torch.randn(*shape, module.vdim, generator=generator, dtype=dtype)
    return query, key, value


def outputs(module: nn.Module, inputs: tuple) -> tuple:
    with torch.no_grad():
        return module(*inputs)


def assert_same_function(actual: nn.MultiheadAttention, expected: nn.MultiheadAttention, inputs: tuple) -> None:
    __tracebackhide__ = True
    (out, weights), (ref_out, ref_weights) = outputs(actual, inputs), outputs(expected, inputs)
    assert_close_scaled(out, ref_out, "output")
    assert_close_scaled(weights, ref_weights, "attention weights")


def encoder(seed: int = 0) -> nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return randomize_parameters(model.double(), seed=seed)


# ------------------------------------------------------------------------------ the comparison


def test_comparison_detects_a_wrong_function():
    """The checks below can fail: dropping the value bias (instead of folding it) is caught."""
    stock = stock_attention(dict(bias=True))
    broken = convert(copy.deepcopy(stock))
    with torch.no_grad():
        broken.in_proj_bias[2 * E :].zero_()
    with pytest.raises(AssertionError, match="output: max error"):
        assert_same_function(broken, stock, attention_inputs(stock))


# ------------------------------------------------------------------------------ convert


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_convert_and_back_keep_the_function(config):
    stock = stock_attention(config)
    inputs = attention_inputs(stock)
    reference = copy.deepcopy(stock)
    slim = convert(stock)
    assert type(slim) is SlimMultiheadAttention
    assert_same_function(slim, reference, inputs)

    back = to_stock(slim)
    assert type(back) is STOCK_MHA
    assert_same_function(back, reference, inputs)
    fresh = STOCK_MHA(E, H, **config, dtype=torch.float64)
    assert list(back.state_dict()) == list(fresh.state_dict())
    fresh.load_state_dict(back.state_dict(), strict=True)
    assert_same_function(fresh, reference, inputs)


def test_convert_swaps_every_attention_module_in_a_tree_and_keeps_sharing():
    model = encoder()
    shared = randomize_parameters(STOCK_MHA(E, H, batch_first=True, dtype=torch.float64), seed=3)
    model.extra = nn.ModuleList([shared, nn.Sequential(shared)])
    reference = copy.deepcopy(model)
    x = torch.randn(3, 5, E, dtype=torch.float64)

    assert convert(model) is model
    attention = [m for m in model.modules() if isinstance(m, STOCK_MHA)]
    assert len(attention) == 3 and all(type(m) is SlimMultiheadAttention for m in attention)
    assert model.extra[0] is model.extra[1][0], "a shared module must stay shared"
    with torch.no_grad():
        assert_close_scaled(model(x), reference(x), "encoder output")
        assert_close_scaled(model.extra[0](x, x, x)[0], reference.extra[0](x, x, x)[0], "shared output")

    assert to_stock(model) is model
    assert all(type(m) is STOCK_MHA for m in model.modules() if isinstance(m, STOCK_MHA))
    assert list(model.state_dict()) == list(reference.state_dict())
    with torch.no_grad():
        assert_close_scaled(model(x), reference(x), "encoder output after to_stock")


def test_convert_skips_subclasses_and_slim_modules():
    class Custom(STOCK_MHA):
        pass

    custom, slim = Custom(E, H), SlimMultiheadAttention(E, H)
    model = nn.Sequential(custom, slim)
    convert(model)
    assert model[0] is custom and model[1] is slim
    assert convert(slim) is slim and to_stock(custom) is custom


def test_convert_shares_weights_and_keeps_device_dtype_flags_and_mode():
    stock = stock_attention(dict(bias=True, add_bias_kv=True), dtype=torch.bfloat16).eval()
    stock.in_proj_weight.requires_grad_(False)
    stock.in_proj_bias.requires_grad_(False)
    stock.bias_v.requires_grad_(False)
    slim = convert(stock)
    assert slim.out_proj is stock.out_proj
    assert all(new is old for new, old in zip(slim.parameters(), stock.parameters(), strict=True))
    assert {p.dtype for p in slim.parameters()} == {torch.bfloat16}
    assert {p.device for p in slim.parameters()} == {torch.device("cpu")}
    assert not slim.training and not slim.out_proj.training
    flags = {name: p.requires_grad for name, p in slim.named_parameters()}
    assert flags == {
        "in_proj_weight": False,
        "in_proj_bias": False,
        "bias_k": True,
        "bias_v": False,
        "out_proj.weight": True,
        "out_proj.bias": True,
    }
    back = to_stock(slim.train())
    assert back.training
    assert {name: p.requires_grad for name, p in back.named_parameters()} == {
        "in_proj_weight": False,
        "in_proj_bias": False,
        "bias_k": True,
        "bias_v": False,
        "out_proj.weight": True,
        "out_proj.bias": True,
    }


def test_convert_keeps_the_device_of_meta_modules():
    """Nothing is allocated or moved: a meta module converts to a meta module (and back)."""
    stock = STOCK_MHA(E, H, add_bias_kv=True, device="meta")
    slim = convert(stock)
    assert {p.device.type for p in slim.parameters()} == {"meta"}
    assert {p.device.type for p in to_stock(slim).parameters()} == {"meta"}


def test_convert_keeps_hooks_and_their_handles():
    stock = stock_attention(dict(bias=True))
    calls = []
    handles = [
        stock.register_forward_pre_hook(lambda m, args: calls.append(("pre", type(m)))),
        stock.register_forward_hook(lambda m, args, kwargs, out: calls.append(("kwargs", type(m))), with_kwargs=True),
        stock.register_forward_hook(lambda m, args, out: calls.append(("post", type(m))), always_call=True),
        stock.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append(("backward", type(m)))),
    ]
    x = torch.randn(5, 3, E, dtype=torch.float64, requires_grad=True)
    slim = convert(stock)
    slim(x, x, x)[0].sum().backward()
    kind = SlimMultiheadAttention
    assert calls == [("pre", kind), ("kwargs", kind), ("post", kind), ("backward", kind)]

    stock_again = to_stock(slim)
    calls.clear()
    stock_again(x, x, x)
    assert [name for name, _ in calls] == ["pre", "kwargs", "post"]
    for handle in handles:  # handles taken on the original module still remove the hooks
        handle.remove()
    calls.clear()
    stock_again(x, x, x)[0].sum().backward()
    assert calls == []


def test_to_stock_builds_stock_while_patched():
    with patched():
        model = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, batch_first=True)
        assert type(model.self_attn) is PatchedMultiheadAttention
        to_stock(model)
        assert type(model.self_attn) is STOCK_MHA
        assert "self_attn.in_proj_bias" in model.state_dict()


# ------------------------------------------------------------------------------ fold_value_bias


@pytest.mark.parametrize("config", [c for c in CONFIGS if c["bias"] and not c["add_zero_attn"]], ids=config_id)
def test_fold_value_bias_keeps_the_eval_function(config):
    stock = stock_attention(config).eval()
    inputs = attention_inputs(stock)
    slim = convert(copy.deepcopy(stock))
    assert fold_value_bias(slim) is slim
    assert has_folded_value_bias(slim) and torch.equal(
        slim.in_proj_bias[2 * E :], torch.zeros_like(slim.in_proj_bias[:E])
    )
    assert list(slim.state_dict()) == list(stock.state_dict())
    assert_same_function(slim, stock, inputs)
    with pytest.raises(ValueError) as refused:
        to_stock(slim)
    assert str(refused.value) == (
        "to_stock: module (the root) had its value bias folded into out_proj.bias (fold_value_bias), which stock "
        "cannot represent exactly: on a query row masked from every key stock outputs out_proj.bias, the fold "
        "adds W_o·b_v. Load the unfolded weights again first (load_state_dict clears the fold), or keep an unfolded "
        "copy for this and fold only the model you run (fold_value_bias(copy.deepcopy(model).eval()))"
    )
    # What the message says works: the unfolded weights, loaded again, convert back to stock.
    slim.load_state_dict(convert(copy.deepcopy(stock)).state_dict())
    torch.testing.assert_close(to_stock(slim)(*inputs)[0], stock(*inputs)[0])


def test_a_folded_module_refuses_a_query_row_masked_from_every_key():
    """Stock outputs out_proj.bias on such a row (its attention row is zero); the fold would add W_o b_v."""
    stock = stock_attention(dict(bias=True, batch_first=True)).eval()
    slim = fold_value_bias(convert(copy.deepcopy(stock)).eval())
    x = torch.randn(2, 5, E, dtype=stock.out_proj.weight.dtype)
    open_mask = torch.zeros(5, 5, dtype=torch.bool)
    closed_row = open_mask.clone()
    closed_row[3] = True
    with torch.no_grad():
        for mask in (open_mask, torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)):
            assert_close_scaled(
                slim(x, x, x, attn_mask=mask, need_weights=False)[0],
                stock(x, x, x, attn_mask=mask, need_weights=False)[0],
                "folded, masked",
            )
        with pytest.raises(
            RuntimeError, match="a query row is masked from every key, and this module's value bias was folded"
        ):
            slim(x, x, x, attn_mask=closed_row, need_weights=False)
        padding = torch.zeros(2, 5, dtype=torch.bool)
        padding[1] = True  # an empty set: sample 1 has no valid key at all
        with pytest.raises(RuntimeError, match="masked from every key"):
            slim(x, x, x, key_padding_mask=padding, need_weights=False)


def test_fold_value_bias_over_a_tree_is_idempotent_and_state_dicts_round_trip():
    model = convert(encoder()).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 5, E, dtype=torch.float64)
    fold_value_bias(model)
    fold_value_bias(model)  # already folded: nothing left to do
    with torch.no_grad():
        assert_close_scaled(model(x), reference(x), "folded encoder")
    target = fold_value_bias(convert(encoder(seed=7)).eval())
    target.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        assert_close_scaled(target(x), reference(x), "reloaded folded encoder")


def test_fold_value_bias_is_allowed_in_training_without_dropout():
    slim = convert(stock_attention(dict(bias=True, add_bias_kv=True)))
    reference = copy.deepcopy(slim)
    fold_value_bias(slim.train())
    assert_same_function(slim, reference, attention_inputs(slim))


def test_fold_value_bias_skips_modules_without_value_bias():
    slim = convert(stock_attention(dict(bias=False, add_zero_attn=True)))
    fold_value_bias(slim)  # nothing to fold, so add_zero_attn is no obstacle
    assert not has_folded_value_bias(slim) and slim.in_proj_bias is None


def test_fold_value_bias_refuses_training_with_dropout():
    model = nn.Sequential(SlimMultiheadAttention(E, H, dropout=0.1))
    with pytest.raises(RuntimeError) as error:
        fold_value_bias(model)
    assert str(error.value) == (
        "fold_value_bias: module '0' is in training mode with dropout=0.1; dropout rescales attention rows, "
        "so folding is exact only in eval (as torch's fusion: 'Fusion only for eval!'). Call module.eval() first"
    )
    fold_value_bias(model.eval())
    assert has_folded_value_bias(model[0])


def test_fold_value_bias_refuses_zero_attention_and_stock_modules_before_changing_anything():
    good = convert(stock_attention(dict(bias=True)))
    before = copy.deepcopy(good.state_dict())
    model = nn.ModuleDict({"good": good, "zero": SlimMultiheadAttention(E, H, add_zero_attn=True)})
    with pytest.raises(ValueError) as error:
        fold_value_bias(model)
    assert str(error.value) == (
        "fold_value_bias: module 'zero' has add_zero_attn=True; its zero value token cannot absorb -b_v, "
        "so folding would change the output. Fold the other submodules one by one instead"
    )
    assert not has_folded_value_bias(good), "a refused fold must not change any module"
    for name, tensor in good.state_dict().items():
        assert torch.equal(tensor, before[name]), name

    with pytest.raises(ValueError, match=r"module \(the root\) is a stock nn.MultiheadAttention.*slim_mha.convert"):
        fold_value_bias(STOCK_MHA(E, H))
    fold_value_bias(model["good"])
    assert has_folded_value_bias(good)


def test_the_attributes_a_swap_to_stock_drops_are_slims_options_and_the_fold_mark():
    """``_swap`` cannot import ``slim_options`` (attention imports ``_swap``): this ties the two lists."""
    assert set(SLIM_ATTRIBUTES) == set(slim_options()) | {FOLDED_VALUE_BIAS}
    slim = SlimMultiheadAttention(8, 2)
    assert set(SLIM_ATTRIBUTES) - {FOLDED_VALUE_BIAS} <= set(vars(slim))
    assert not set(SLIM_ATTRIBUTES) & set(vars(to_stock(slim)))
