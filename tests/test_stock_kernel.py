"""Stock's kernel for stock's default call: which calls take it, and every one against stock.

Self-attention that returns weights, without masks and without a graph, runs stock's
native kernel (``torch._native_multi_head_attention``) with the bias ``[b_q; 0; b_v]`` and averages
the heads in slim (``choose_path`` names it ``"stock kernel"``). Every other call takes the
general path. Each test here counts the kernel's calls, so a call that silently changes path fails,
and compares the result with stock ``nn.MultiheadAttention`` built from the same weights.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import pytest
import torch
from torch.nn.utils import parametrize

import slim_mha.attention as attention
from slim_mha import SlimMultiheadAttention
from slim_mha import _explicit_attention as guard
from slim_mha import unread_weights as _unread_weights

from _plain_calls import (
    BATCH,
    EMBED,
    HEADS,
    LENGTH,
    REFUSED,
    REFUSED_OPTIONS,
    Halved,
    Tagged,
    assert_like_stock,
    check_any_key_slot_gives_stocks_output,
    check_parameter_writes_are_seen,
    modules,
    recorded_calls,
    refused_call,
    tokens,
)
from _reference import STOCK_MHA, assert_close_scaled, fast_path_enabled, randomize_parameters


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """Every call of stock's kernel from slim, recorded."""
    return recorded_calls(monkeypatch, attention, "stock_kernel")


# ---------------------------------------------------------------------------- calls that take it


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_the_default_call_without_a_graph_takes_stocks_kernel_and_matches_stock(
    dtype, average, context, batch_first, kernel_calls
):
    """Sequence-first too (stock's default layout, which its fast path refuses): the kernel gets the
    query batch-first as a view, and the output comes back in stock's layout, strides included."""
    stock, slim = modules(dtype=dtype, batch_first=batch_first)
    x = tokens(dtype, *((BATCH, LENGTH, EMBED) if batch_first else (LENGTH, BATCH, EMBED)))
    with getattr(torch, context)():
        assert_like_stock(stock, slim, x, x, x, average_attn_weights=average)
        expected, actual = stock(x, x, x, average_attn_weights=average), slim(x, x, x, average_attn_weights=average)
    assert len(kernel_calls) == 2
    for want, got in zip(expected, actual):
        assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype
    bias = kernel_calls[0][6]  # stock's kernel's arguments: the packed bias seventh
    assert torch.equal(bias[EMBED : 2 * EMBED], torch.zeros(EMBED, dtype=dtype))  # the key bias never reaches it
    assert torch.equal(bias[:EMBED], slim.in_proj_bias[:EMBED]) and torch.equal(
        bias[2 * EMBED :], slim.in_proj_bias[2 * EMBED :]
    )


@pytest.mark.parametrize(
    "case",
    [
        "frozen parameters, grad enabled",
        "heads of 2",
        "a non-contiguous query",
        "fp64 sizes",
        "a non-contiguous sequence-first query",
    ],
)
def test_other_calls_stocks_fast_path_would_take_take_it_too(case, kernel_calls):
    stock, slim = modules(heads=2 if case == "heads of 2" else HEADS, batch_first="sequence" not in case)
    x = tokens(torch.float32, LENGTH, BATCH, EMBED) if "sequence" in case else tokens()
    context = torch.no_grad()
    if case == "frozen parameters, grad enabled":
        for module in (stock, slim):
            module.requires_grad_(False)
        context = contextlib.nullcontext()
    elif case == "a non-contiguous query":
        x = tokens(torch.float32, LENGTH, BATCH, EMBED).transpose(0, 1)
    elif case == "a non-contiguous sequence-first query":
        x = tokens().transpose(0, 1)  # (L, B, E) over batch-first storage: the kernel gets it contiguous
    elif case == "fp64 sizes":
        stock, slim = stock.double(), slim.double()
        x = x.double()
    with context:
        assert_like_stock(stock, slim, x, x, x)
    assert len(kernel_calls) == 1


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e6])
def test_whatever_the_key_slot_holds_the_output_is_stocks_without_it(poison, kernel_calls):
    check_any_key_slot_gives_stocks_output(poison)
    assert len(kernel_calls) == 1


def test_writes_to_the_parameters_between_calls_are_seen(kernel_calls):
    check_parameter_writes_are_seen()
    assert len(kernel_calls) == 3


def test_a_copy_and_a_state_dict_round_trip_take_it_and_agree(kernel_calls):
    stock, slim = modules()
    twin = SlimMultiheadAttention(EMBED, HEADS, batch_first=True).eval()
    twin.load_state_dict(slim.state_dict())
    x = tokens()
    with torch.inference_mode():
        results = [module(x, x, x) for module in (slim, copy.deepcopy(slim), twin)]
    for result in results[1:]:
        assert torch.equal(result[0], results[0][0]) and torch.equal(result[1], results[0][1])
    assert len(kernel_calls) == 3


# ---------------------------------------------------------------------- calls that must not take it


# Small masked self-attention in inference takes stock's kernel too, with stock's merged mask
# (tests/test_masked_kernel.py); the other refused calls do not.
GENERAL_PATH = [
    *(case for case in REFUSED if case not in ("key padding mask", "bool attn_mask")),
    "odd heads",
    "sequence first, odd heads",
    "fast path disabled",
    "need_weights=False, large",
    "training without dropout",  # stock's Python path: its (L, B, E) layout, which the kernel does not return
]


@pytest.mark.parametrize("case", GENERAL_PATH)
def test_calls_stocks_fast_path_refuses_take_the_general_path_and_match_stock(case, kernel_calls):
    if "odd heads" in case:
        stock, slim = _odd_head_modules(batch_first=case == "odd heads")
        x = tokens(torch.float32, BATCH, LENGTH, 15)
    else:
        stock, slim = modules(**REFUSED_OPTIONS.get(case, {}))
        x = tokens()
    (query, key, value), kwargs, context = refused_call(case, x)
    if case == "sequence first, odd heads":
        query = key = value = x.transpose(0, 1).contiguous()
    elif case == "need_weights=False, large":  # scores above what the kernel takes without weights
        kwargs["need_weights"] = False
        stock, slim = modules(embed=64)
        query = key = value = tokens(torch.float32, 8, 200, 64)
    elif case == "training without dropout":
        stock.train(), slim.train()
        context = torch.no_grad()
    with context, fast_path_enabled(case != "fast path disabled"):
        assert_like_stock(stock, slim, query, key, value, **kwargs)
    assert kernel_calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_calls_without_weights_take_stocks_kernel_where_it_is_faster(dtype, kernel_calls):
    """Without weights, the kernel runs where its scores are small (fp32) or in bf16, where it beats
    SDPA on the CPU; it is given [b_q; 0; b_v] and returns no weights."""
    stock, slim = modules(dtype=dtype)
    x = tokens(dtype)
    with torch.inference_mode():
        assert_like_stock(stock, slim, x, x, x, need_weights=False)
        assert slim(x, x, x, need_weights=False)[1] is None
    assert len(kernel_calls) == 2 and kernel_calls[0][10] is False  # need_weights=False
    assert torch.equal(kernel_calls[0][6][EMBED : 2 * EMBED], torch.zeros(EMBED, dtype=dtype))


def _odd_head_modules(batch_first: bool = True):
    stock = randomize_parameters(STOCK_MHA(15, 5, batch_first=batch_first))
    slim = SlimMultiheadAttention(15, 5, batch_first=batch_first)
    slim.load_state_dict(stock.state_dict())
    return stock.eval(), slim.eval()


SLIM_OWN = [
    "dropout in training",
    "memory guard sizes",
    "forced blocks",
    "parametrized bias",
    "vmap",
    "jit.trace",
    "tensor subclass",
    "empty batch",
    "nested",
]


@pytest.mark.parametrize("case", SLIM_OWN)
def test_calls_slim_handles_itself_take_the_general_path(case, kernel_calls, monkeypatch, forced_blocks):
    stock, slim = modules()
    x = tokens()
    with torch.no_grad():
        if case == "dropout in training":
            slim.dropout = 0.5
            slim.train()
            out, weights = slim(x, x, x)
            assert out.shape == (BATCH, LENGTH, EMBED) and weights.shape == (BATCH, LENGTH, LENGTH)
        elif case == "memory guard sizes":
            monkeypatch.setattr(guard, "_CHECK_ABOVE_BYTES", 0)  # every request is checked: the guard's path
            assert_like_stock(stock, slim, x, x, x)
        elif case == "forced blocks":
            forced_blocks(1)
            assert_like_stock(stock, slim, x, x, x)
        elif case == "parametrized bias":
            for module in (stock, slim):
                parametrize.register_parametrization(module, "in_proj_bias", Halved())
            assert_like_stock(stock, slim, x, x, x)
        elif case == "vmap":
            batched = torch.func.vmap(lambda t: slim(t, t, t))(x.unsqueeze(1))
            expected = stock(x, x, x)
            assert_close_scaled(batched[0].squeeze(1), expected[0])
            assert_close_scaled(batched[1].squeeze(1), expected[1], "weights")
        elif case == "jit.trace":
            traced = torch.jit.trace(slim, (x, x, x), check_trace=False)
            assert_close_scaled(traced(x, x, x)[0], stock(x, x, x)[0])
        elif case == "tensor subclass":
            assert_like_stock(stock, slim, *(x.as_subclass(Tagged),) * 3)
        elif case == "empty batch":
            empty = torch.randn(0, LENGTH, EMBED)
            out, weights = slim(empty, empty, empty)  # stock's own head split would crash on it
            assert out.shape == (0, LENGTH, EMBED) and weights.shape == (0, LENGTH, LENGTH)
        elif case == "nested":
            nested = torch.nested.nested_tensor([torch.randn(4, EMBED), torch.randn(6, EMBED)])
            out, _ = slim(nested, nested, nested, need_weights=False)
            assert out.is_nested
    assert kernel_calls == []


def _discarding_call(attention_module, x, padding):
    """A call site whose weights are provably discarded: where the module skips unread weights, it may."""
    if padding is None:
        return attention_module(x, x, x)[0]
    return attention_module(x, x, x, key_padding_mask=padding)[0]


@pytest.mark.skipif(
    sys.version_info[:2] not in _unread_weights._TESTED_VERSIONS, reason="skipping is off on untested bytecode"
)
@pytest.mark.parametrize("case", ["batch-first", "sequence-first", "padding mask"])
def test_with_skip_unread_weights_small_calls_keep_the_kernel_and_larger_ones_skip(case, kernel_calls, monkeypatch):
    """Where stock's kernel, weights and all, is faster than skipping them (small fp32 scores on the
    CPU), a module built to skip unread weights keeps the kernel; above that size a caller that
    discards the weights gets none computed, on slim's own path, and one that reads them gets the
    kernel. Every call gives stock's output."""
    from slim_mha import paths

    batch_first, masked = case != "sequence-first", case == "padding mask"
    stock, slim = modules(batch_first=batch_first)
    slim.skip_unread_weights = True
    skips = recorded_calls(monkeypatch, _unread_weights, "call_without_weights")
    monkeypatch.setattr(attention.UNREAD, "call_without_weights", _unread_weights.call_without_weights)
    x = tokens() if batch_first else tokens().transpose(0, 1).contiguous()
    padding = None
    if masked:  # the last two keys of the first sequence are padding
        padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
        padding[0, -2:] = True
    key = ("cpu", torch.float32, masked)
    small = BATCH * HEADS * LENGTH * LENGTH * 4
    with torch.no_grad():
        expected_out, expected_weights = stock(x, x, x, key_padding_mask=padding)
        assert small <= paths.SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES[key]
        assert_close_scaled(_discarding_call(slim, x, padding), expected_out)
        assert (len(kernel_calls), len(skips)) == (1, 0)  # small: the kernel, weights and all
        monkeypatch.setattr(paths, "SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES", {key: small - 1})
        assert_close_scaled(_discarding_call(slim, x, padding), expected_out)
        assert (len(kernel_calls), len(skips)) == (1, 1)  # larger: skipped, on slim's own path
        out, weights = slim(x, x, x, key_padding_mask=padding)  # read: the path without the option
        assert (len(kernel_calls), len(skips)) == (2, 1)
    assert_close_scaled(out, expected_out)
    assert_close_scaled(weights, expected_weights, "weights")


def _discarding_masked_call(attention_module, x, padding):
    return attention_module(x, x, x, key_padding_mask=padding)[0]


@pytest.mark.skipif(
    sys.version_info[:2] not in _unread_weights._TESTED_VERSIONS, reason="skipping is off on untested bytecode"
)
@pytest.mark.parametrize("empty_row", [False, True])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("length", [12, 40])  # scores of 4.5 KiB and 50 KiB: both sides of the masked limit
def test_skip_unread_weights_on_both_sides_of_its_kernel_limit_gives_stocks_function(length, mask_dtype, empty_row):
    """Against stock with its fast path off (its documented function): the kernel kept below the
    limit, the skip above it, and the weights computed for a caller that reads them. A row masked
    from every key is zero before the output projection on every path, its weights zero."""
    from slim_mha import paths

    limit = paths.SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES[("cpu", torch.float32, True)]
    assert (2 * 4 * length * length * 4 <= limit) == (length == 12)
    torch.manual_seed(0)
    stock = randomize_parameters(STOCK_MHA(32, 4, batch_first=True), scale=0.3).eval()
    slim = SlimMultiheadAttention(32, 4, batch_first=True, skip_unread_weights=True).eval()
    slim.load_state_dict(stock.state_dict())
    x = torch.randn(2, length, 32)
    padded = torch.zeros(2, length, dtype=torch.bool)
    padded[0, length // 2 :] = True
    if empty_row:
        padded[1] = True  # every query of sample 1 sees no key
    padding = padded if mask_dtype == torch.bool else torch.zeros(2, length).masked_fill(padded, float("-inf"))
    rows = torch.tensor([[False], [empty_row]]).expand(2, length)
    with torch.no_grad(), fast_path_enabled(False):
        expected_out, expected_weights = stock(x, x, x, key_padding_mask=padding)
    with torch.no_grad():
        discarded = _discarding_masked_call(slim, x, padding)
        out, weights = slim(x, x, x, key_padding_mask=padding)  # read: computed
    for actual in (discarded, out):
        torch.testing.assert_close(actual[~rows], expected_out[~rows], rtol=1e-5, atol=1e-5)
        assert torch.equal(actual[rows], stock.out_proj.bias.detach().expand(int(rows.sum()), 32))
    torch.testing.assert_close(weights[~rows], expected_weights[~rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(weights[rows], torch.zeros_like(weights[rows]))


# -------------------------------------------------------------------------------- the check fails


def test_the_comparison_fails_on_a_wrong_average_of_the_kernels_weights(kernel_calls, monkeypatch):
    kernel = attention.stock_kernel

    def summing_kernel(*args):
        out, weights = kernel(*args)
        return out, weights * args[0].new_tensor(4.0)  # H=4: the sum over heads, not their mean

    monkeypatch.setattr(attention, "stock_kernel", summing_kernel)
    stock, slim = modules()
    x = tokens()
    with torch.no_grad(), pytest.raises(AssertionError, match="weights"):
        assert_like_stock(stock, slim, x, x, x)


def test_the_comparison_fails_when_the_kernel_gets_the_key_bias(kernel_calls, monkeypatch):
    """With a key bias of 1e6 in the kernel's bias, the scores lose their precision: the check sees it."""
    monkeypatch.setattr(attention, "key_slot_zeroer", lambda *bias_kind: lambda bias: bias)
    stock, slim = modules()
    with torch.no_grad():
        stock.in_proj_bias[EMBED : 2 * EMBED] = 0.0
        slim.in_proj_bias[EMBED : 2 * EMBED] = 1e6
        x = tokens()
        with pytest.raises(AssertionError):
            assert_like_stock(stock, slim, x, x, x)
    assert len(kernel_calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_the_kernel_call_is_stocks_bit_for_bit(dtype, average, batch_first):
    """Slim calls the kernel as stock's fast path calls it, averaging included: where stock runs the
    same kernel (batch-first) given the same zeroed key slot, output and weights are stock's bit
    for bit, sequence-first included."""
    stock = randomize_parameters(STOCK_MHA(64, 4, batch_first=True, dtype=dtype)).eval()
    slim = SlimMultiheadAttention(64, 4, batch_first=batch_first, dtype=dtype).eval()
    slim.load_state_dict(stock.state_dict())
    with torch.no_grad():
        stock.in_proj_bias[64:128].zero_()  # stock's kernel given the key bias slim leaves out
    x = torch.randn(3, 24, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    with torch.inference_mode():
        expected = stock(x, x, x, average_attn_weights=average)
        query = x if batch_first else x.transpose(0, 1)
        out, weights = slim(query, query, query, average_attn_weights=average)
    torch.testing.assert_close(out if batch_first else out.transpose(0, 1), expected[0], rtol=0, atol=0)
    torch.testing.assert_close(weights, expected[1], rtol=0, atol=0)
