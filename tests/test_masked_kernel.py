"""Small masked self-attention in inference takes stock's own kernel, as stock's fast path does.

Where stock's fast path would run ``torch._native_multi_head_attention`` with the call's bool masks,
slim runs the same kernel given ``[b_q; 0; b_v]`` and the mask stock's own ``merge_masks`` makes, up
to ``STOCK_KERNEL_MASKED_MAX_SCORE_BYTES``: exact by construction, compared here with stock and with
a float64 run. A query masked from every key never takes it (the kernel gives NaN there; slim's
answer is zeros), and neither does any call stock's fast path refuses.
"""

from __future__ import annotations

import copy

import pytest
import torch

import slim_mha
from slim_mha import paths
from slim_mha._stock_checks import AttentionCall
from slim_mha._torch_compat import stock_kernel
from slim_mha.bias import key_slot_zeroer

from _reference import STOCK_MHA, assert_matches_stock, randomize_parameters

E, H = 64, 4


def pair(dtype: torch.dtype = torch.float32, **options) -> tuple[STOCK_MHA, slim_mha.SlimMultiheadAttention]:
    torch.manual_seed(0)
    stock = randomize_parameters(STOCK_MHA(E, H, batch_first=True, **options), scale=0.3).to(dtype).eval()
    return stock, slim_mha.convert(copy.deepcopy(stock))


def masks(kind: str, batch: int, length: int) -> dict:
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[0, -length // 4 :] = True
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    return {
        "padding": {"key_padding_mask": padding},
        "causal": {"attn_mask": causal},
        "both": {"key_padding_mask": padding, "attn_mask": causal},
        "per head": {"attn_mask": causal.expand(batch * H, length, length).clone()},
    }[kind]


def path_of(module, x, given: dict, need_weights: bool) -> str:
    call = AttentionCall(x, x, x, given.get("key_padding_mask"), need_weights, given.get("attn_mask"), True, False)
    return paths.choose_path(module, call)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("kind", ["padding", "causal", "both", "per head"])
@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_small_masked_inference_runs_stocks_kernel_and_gives_stocks_answer(kind, need_weights, dtype, context):
    """Where the table has an entry (bf16 without weights has none: slim's own path is the faster)."""
    stock, slim = pair(dtype)
    x = torch.randn(2, 8, E, dtype=dtype)
    given = masks(kind, 2, 8)
    measured = ("cpu", dtype, need_weights) in paths.STOCK_KERNEL_MASKED_MAX_SCORE_BYTES
    manager = torch.no_grad() if context == "no_grad" else torch.inference_mode()
    with manager:
        assert path_of(slim, x, given, need_weights) == ("stock kernel" if measured else "general")
        expected = stock(x, x, x, need_weights=need_weights, **given)
        actual = slim(x, x, x, need_weights=need_weights, **given)
        reference = stock.double()(x.double(), x.double(), x.double(), need_weights=need_weights, **given)
    assert_matches_stock(actual[0], expected[0], reference[0])
    assert actual[0].stride() == expected[0].stride()
    if need_weights:
        assert_matches_stock(actual[1], expected[1], reference[1])


def test_a_query_masked_from_every_key_never_takes_stocks_kernel():
    stock, slim = pair()
    x = torch.randn(2, 16, E)
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1] = True
    with torch.no_grad():
        assert path_of(slim, x, {"key_padding_mask": padding}, True) == "general"
        out, weights = slim(x, x, x, key_padding_mask=padding)
        assert torch.isnan(stock(x, x, x, key_padding_mask=padding)[0]).any()  # stock's kernel: NaN
    assert torch.isfinite(out).all() and torch.equal(weights[1], torch.zeros_like(weights[1]))


@pytest.mark.parametrize(
    "why", ["training", "a graph", "float mask", "odd heads", "sequence first", "appended tokens", "fast path off"]
)
def test_calls_stocks_fast_path_refuses_keep_slims_path(why):
    options = {"odd heads": {}, "appended tokens": {"add_bias_kv": True}}.get(why, {})
    if why == "odd heads":
        stock = STOCK_MHA(63, 3, batch_first=True).eval()
        slim = slim_mha.convert(copy.deepcopy(stock))
        x = torch.randn(2, 16, 63)
    elif why == "sequence first":
        stock = STOCK_MHA(E, H).eval()
        slim = slim_mha.convert(copy.deepcopy(stock))
        x = torch.randn(16, 2, E)
    else:
        stock, slim = pair(**options)
        x = torch.randn(2, 16, E)
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[0, -3:] = True
    given = {"key_padding_mask": padding.float() if why == "float mask" else padding}
    slim.train(why == "training")
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(why != "fast path off")
    try:
        with torch.set_grad_enabled(why == "a graph"):
            if why == "a graph":
                x.requires_grad_()
            assert path_of(slim, x, given, True) != "stock kernel"  # slim's own path, or stock's ops
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("length", [8, 16, 32, 64, 128])
def test_one_answer_across_the_masked_kernels_threshold(length, need_weights):
    """Below the threshold stock's kernel runs, above it slim's own path: both give stock's function."""
    stock, slim = pair()
    x = torch.randn(2, length, E)
    given = masks("both", 2, length)
    with torch.no_grad():
        expected = stock(x, x, x, need_weights=need_weights, **given)
        actual = slim(x, x, x, need_weights=need_weights, **given)
        reference = copy.deepcopy(stock).double()(
            x.double(), x.double(), x.double(), need_weights=need_weights, **given
        )
    assert_matches_stock(actual[0], expected[0], reference[0])
    if need_weights:
        assert_matches_stock(actual[1], expected[1], reference[1])
    limit = paths.STOCK_KERNEL_MASKED_MAX_SCORE_BYTES[("cpu", torch.float32, need_weights)]
    expected_path = "stock kernel" if 2 * H * length * length * 4 <= limit else "general"
    with torch.no_grad():
        assert path_of(slim, x, given, need_weights) == expected_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_a_bool_padding_mask_goes_in_as_it_is_with_the_additive_masks_bits(dtype, need_weights, average):
    """The CPU kernel reads its mask as a bool one, so the padding mask reaches it without stock's
    additive form: slim's answer is the kernel's on the additive mask stock would pass, bit for bit,
    over a sweep of sizes (and stock's own, within its rounding, as the tests above hold)."""
    _, slim = pair(dtype)
    bias = slim.in_proj_bias
    packed = key_slot_zeroer(bias.shape[0], bias.dtype, bias.device)(bias)
    generator = torch.Generator().manual_seed(7)
    for batch, length in [(1, 5), (2, 8), (3, 11), (2, 16), (4, 6)]:
        x = torch.randn(batch, length, E, generator=generator).to(dtype)
        padding = torch.rand(batch, length, generator=generator) < 0.4
        padding[:, 0] = False  # every query sees a key: the kernel's path
        additive = torch.zeros(batch, length, dtype=dtype).masked_fill(padding, float("-inf"))
        with torch.inference_mode():
            if path_of(slim, x, {"key_padding_mask": padding}, need_weights) != "stock kernel":
                continue
            actual = slim(x, x, x, key_padding_mask=padding, need_weights=need_weights, average_attn_weights=average)
            expected = stock_kernel(
                x, x, x, E, H, slim.in_proj_weight, packed, slim.out_proj.weight, slim.out_proj.bias,
                additive, need_weights, average, 1,
            )  # fmt: skip
        assert torch.equal(actual[0], expected[0]), (batch, length)
        assert (actual[1] is None) == (expected[1] is None)
        if need_weights:
            assert torch.equal(actual[1], expected[1]), (batch, length)
