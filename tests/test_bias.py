"""slim_mha.bias on its own: the key and value folds against stock's function, and their refusals."""

from __future__ import annotations

import pytest
import torch

from slim_mha.bias import (
    SlimBiases,
    fold_key_bias,
    fold_value_bias_into_output,
    keeps_key_bias,
    key_slot_zeroer,
    unfold_key_bias,
    without_key_bias,
)

from _reference import STOCK_MHA, assert_close_scaled, randomize_parameters

E, H = 8, 2


def _one_op(bias):
    """``[b_q; 0; b_v]`` as slim's eager paths build it."""
    return key_slot_zeroer(bias.shape[0], bias.dtype, bias.device)(bias)


def stock_module(**options) -> torch.nn.MultiheadAttention:
    return randomize_parameters(STOCK_MHA(E, H, dtype=torch.float64, **options), seed=3).eval()


def with_biases(stock: torch.nn.MultiheadAttention, in_proj_bias, bias_k) -> torch.nn.MultiheadAttention:
    """A stock module with stock's weights and the given stock-layout biases."""
    other = STOCK_MHA(
        E, H, dtype=torch.float64, add_bias_kv=stock.bias_k is not None, add_zero_attn=stock.add_zero_attn
    ).eval()
    state = stock.state_dict()
    state["in_proj_bias"] = in_proj_bias
    if bias_k is not None:
        state["bias_k"] = bias_k
    other.load_state_dict(state)
    return other


def run(module, x):
    with torch.no_grad():
        return module(x, x, x)


@pytest.mark.parametrize(
    "options",
    [{}, {"add_bias_kv": True}, {"add_zero_attn": True}, {"add_bias_kv": True, "add_zero_attn": True}],
    ids=str,
)
def test_fold_then_unfold_is_stock_s_function(options):
    stock = stock_module(**options)
    folded = fold_key_bias(
        stock.in_proj_bias.detach(),
        None if stock.bias_k is None else stock.bias_k.detach(),
        add_zero_attn=stock.add_zero_attn,
    )
    assert (folded.k_proj_bias is not None) == keeps_key_bias(add_zero_attn=stock.add_zero_attn)
    packed, bias_k = unfold_key_bias(folded, embed_dim=E)
    x = torch.randn(5, 3, E, dtype=torch.float64)
    expected, actual = run(stock, x), run(with_biases(stock, packed, bias_k), x)
    assert_close_scaled(actual[0], expected[0], "output")
    assert_close_scaled(actual[1], expected[1], "weights")
    if not stock.add_zero_attn:  # dropped: the stock view's key slot is zero
        assert torch.equal(packed[E : 2 * E], torch.zeros(E, dtype=torch.float64))


def test_slim_biases_are_in_packed_order():
    assert SlimBiases._fields == ("q_proj_bias", "k_proj_bias", "v_proj_bias", "bias_k")


def test_fold_key_bias_refuses_bad_shapes_by_name():
    with pytest.raises(ValueError, match=r"in_proj_bias must have shape \(3\*embed_dim,\), got \(7,\)"):
        fold_key_bias(torch.zeros(7))
    with pytest.raises(ValueError, match="bias_k has 4 elements but the key bias has 8"):
        fold_key_bias(torch.zeros(3 * E), torch.zeros(1, 1, 4))


def test_fold_value_bias_into_output_is_exact_where_rows_sum_to_one():
    stock = stock_module(add_bias_kv=True)
    b_v = stock.in_proj_bias.detach()[2 * E :]
    out_bias, bias_v = fold_value_bias_into_output(
        b_v, stock.out_proj.weight.detach(), stock.out_proj.bias.detach(), stock.bias_v.detach()
    )
    folded = with_biases(
        stock, torch.cat([stock.in_proj_bias.detach()[: 2 * E], torch.zeros(E, dtype=b_v.dtype)]), stock.bias_k.detach()
    )
    with torch.no_grad():
        folded.out_proj.bias.copy_(out_bias)
        folded.bias_v.copy_(bias_v)
    x = torch.randn(5, 3, E, dtype=torch.float64)
    assert_close_scaled(run(folded, x)[0], run(stock, x)[0], "folded output")


def test_fold_value_bias_into_output_refuses_a_zero_value_token():
    with pytest.raises(ValueError, match="add_zero_attn=True appends a zero value token that cannot absorb -b_v"):
        fold_value_bias_into_output(torch.zeros(E), torch.zeros(E, E), None, add_zero_attn=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("embed_dim", [1, 8, 96])
def test_the_one_op_layout_is_the_graph_layout_bit_for_bit(dtype, embed_dim):
    """Both builders of ``[b_q; 0; b_v]`` agree bit for bit, whatever the key slot holds, and leave
    the parameter as it was. The key slot's values include NaN, infinities and -0.0."""
    bias = torch.randn(3 * embed_dim, generator=torch.Generator().manual_seed(embed_dim)).to(dtype)
    key_slot = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e4])
    bias[embed_dim : 2 * embed_dim] = key_slot.repeat(embed_dim)[:embed_dim].to(dtype)
    before = bias.clone()
    one_op, graph = _one_op(bias), without_key_bias(bias, embed_dim)
    assert one_op.dtype == dtype and one_op.shape == (3 * embed_dim,)
    assert torch.equal(one_op.view(torch.int8), graph.view(torch.int8))  # bits: +0.0 in the slot, not -0.0
    assert torch.equal(one_op[:embed_dim], bias[:embed_dim]) and torch.equal(
        one_op[2 * embed_dim :], bias[2 * embed_dim :]
    )
    assert torch.equal(bias.view(torch.int8), before.view(torch.int8))
    assert one_op.data_ptr() != bias.data_ptr()


def test_the_one_op_layout_records_no_graph_and_outlives_inference_mode():
    """Built from a trainable parameter without autograd (stock's kernel path), it records nothing;
    its cached mask, made outside inference mode, serves calls inside and outside it."""
    bias = torch.nn.Parameter(torch.randn(3 * E))
    with torch.inference_mode():
        inside = _one_op(bias)
    with torch.no_grad():
        outside = _one_op(bias)
    assert inside.grad_fn is None and outside.grad_fn is None and not outside.requires_grad
    assert torch.equal(inside, outside) and torch.equal(outside, without_key_bias(bias, E).detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_one_op_layout_under_autograd_gives_the_graph_layouts_gradient_bit_for_bit(dtype):
    """Eager training calls build ``[b_q; 0; b_v]`` in one op too: the key slot's gradient is exactly
    zero (not noise that cancels), whatever the key slot and the incoming gradient hold."""
    bias = torch.randn(3 * E, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias[E : 2 * E] = float("nan")
    incoming = torch.randn(3 * E, generator=torch.Generator().manual_seed(4)).to(dtype)
    incoming[E] = float("inf")  # what reaches the key slot must not leak into the gradient
    gradients = []
    for build in (_one_op, lambda b: without_key_bias(b, E)):
        leaf = bias.clone().requires_grad_()
        packed = build(leaf)
        assert packed.grad_fn is not None
        packed.backward(incoming)
        gradients.append(leaf.grad)
    one_op, graph = gradients
    assert torch.equal(one_op[E : 2 * E], torch.zeros(E, dtype=dtype))
    assert torch.equal(one_op, graph)
