"""slim_mha._stock_checks against the installed torch's private helpers it replaces.

Each case runs our function and torch's on the same inputs and compares what comes back: the
result, or the exception's type and message, and the warnings raised.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

from slim_mha._stock_checks import additive_mask, is_batched_mha_input

H, L, S, E = 2, 3, 5, 4


def outcome(call):
    """What ``call()`` returns (tensors compared by value), or the type and message it raised, and its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = call()
        except Exception as error:
            result = (type(error), str(error))
    if torch.is_tensor(result):
        result = ("tensor", result.dtype, tuple(result.shape), result.tolist())
    return result, [str(w.message) for w in caught]


def tensor_of_dim(dim: int, length: int, width: int | None = None, batch: int = 3) -> torch.Tensor:
    shape = {1: (length,), 2: (length, width), 3: (length, batch, width), 4: (1, length, batch, width)}[dim]
    return torch.zeros(tuple(s for s in shape if s is not None))


def shape_cases():
    """Every dimension 1-4 of query, key and value; masks absent or of dimension 1-4."""
    yield from itertools.product((1, 2, 3, 4), (1, 2, 3, 4), (None, 1, 2, 3), (None, 1, 2, 3, 4))


@pytest.mark.parametrize("q_dim, kv_dim, kpm_dim, mask_dim", list(shape_cases()))
def test_shape_check_matches_stock(q_dim, kv_dim, kpm_dim, mask_dim):
    query, key = tensor_of_dim(q_dim, L, E), tensor_of_dim(kv_dim, S, E)
    padding = None if kpm_dim is None else torch.zeros({1: (S,), 2: (3, S), 3: (3, S, 1)}[kpm_dim], dtype=torch.bool)
    mask = None if mask_dim is None else torch.zeros({1: (S,), 2: (L, S), 3: (H, L, S), 4: (1, H, L, S)}[mask_dim])
    args = (query, key, key, padding, mask, H)
    assert outcome(lambda: is_batched_mha_input(*args)) == outcome(lambda: F._mha_shape_check(*args))


@pytest.mark.parametrize("wrong", [(H + 1, L, S), (H, L + 1, S), (H, L, S + 1)])
def test_shape_check_matches_stock_on_a_wrong_unbatched_3d_mask(wrong):
    query, key, mask = torch.zeros(L, E), torch.zeros(S, E), torch.zeros(wrong)
    expected = outcome(lambda: F._mha_shape_check(query, key, key, None, mask, H))
    assert expected[0][0] is AssertionError  # the case does fail in stock
    assert outcome(lambda: is_batched_mha_input(query, key, key, None, mask, H)) == expected


MASK_DTYPES = (torch.bool, torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8)


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
@pytest.mark.parametrize("other_dtype", (None, torch.bool, torch.float32))
@pytest.mark.parametrize("target", (torch.float32, torch.float64, torch.bfloat16))
def test_additive_mask_matches_stock(mask_dtype, other_dtype, target):
    mask = (torch.arange(L * S).view(L, S) % 3 == 0).to(mask_dtype)
    other = None if other_dtype is None else torch.zeros(L, S, dtype=other_dtype)
    ours = outcome(lambda: additive_mask(mask, "key_padding_mask", target, other=other, other_name="attn_mask"))
    stock = outcome(
        lambda: F._canonical_mask(
            mask=mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(other),
            other_name="attn_mask",
            target_type=target,
        )
    )
    assert ours == stock


def test_additive_mask_of_none_is_none():
    assert additive_mask(None, "attn_mask", torch.float32) is None


def test_additive_mask_returns_a_float_mask_itself_and_leaves_a_bool_mask_alone():
    float_mask = torch.zeros(L, S)
    assert additive_mask(float_mask, "attn_mask", torch.float64) is float_mask
    bool_mask = torch.ones(L, S, dtype=torch.bool)
    additive_mask(bool_mask, "attn_mask", torch.float32)
    assert bool_mask.dtype == torch.bool and bool_mask.all()


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("which", ["attn_mask", "key_padding_mask", "both"])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_mask_of_another_dtype_is_refused_where_stock_refuses_it(dtype, mask_dtype, which, train, need_weights):
    """With weights stock adds the mask by ``baddbmm``, which refuses any dtype but the scores', in
    every mode; slim's passes without a graph add it in place and must refuse it too, not cast it.
    Without weights SDPA decides for both (it takes float32 masks for any query)."""
    from slim_mha import SlimMultiheadAttention

    from _reference import STOCK_MHA

    torch.manual_seed(0)
    stock = STOCK_MHA(E, H, batch_first=True, dtype=dtype).train(train)
    slim = SlimMultiheadAttention(E, H, batch_first=True, dtype=dtype).train(train)
    slim.load_state_dict(stock.state_dict())
    x = torch.randn(2, S, E, dtype=dtype)
    masks = {}
    if which in ("attn_mask", "both"):
        masks["attn_mask"] = torch.zeros(S, S, dtype=mask_dtype)
    if which in ("key_padding_mask", "both"):
        masks["key_padding_mask"] = torch.zeros(2, S, dtype=mask_dtype)

    def call(module):
        return lambda: module(x, x, x, need_weights=need_weights, **masks)[0].detach()

    with torch.set_grad_enabled(train):
        (expected, _), (actual, _) = outcome(call(stock)), outcome(call(slim))
    refused = isinstance(expected, tuple) and expected[0] is RuntimeError
    assert refused == (isinstance(actual, tuple) and actual[0] is RuntimeError), (expected, actual)
    if refused and need_weights:
        named = [name for name in masks if mask_dtype != dtype and mask_dtype != torch.bool]
        assert all(f"{name} ({mask_dtype})" in actual[1] for name in named) and "pass a bool mask" in actual[1]
    elif not refused:
        torch.testing.assert_close(actual[3], expected[3], rtol=0, atol=0.05 if dtype == torch.bfloat16 else 1e-5)


def test_under_autocast_a_float32_mask_is_cast_with_the_scores_as_on_stock():
    """Autocast casts ``baddbmm``'s mask with its matrices, so stock takes a float32 mask for bfloat16
    scores there; slim must not refuse what stock takes."""
    from slim_mha import SlimMultiheadAttention

    from _reference import STOCK_MHA

    torch.manual_seed(0)
    stock = STOCK_MHA(E, H, batch_first=True).eval()
    slim = SlimMultiheadAttention(E, H, batch_first=True).eval()
    slim.load_state_dict(stock.state_dict())
    x, mask = torch.randn(2, S, E), torch.randn(S, S)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = stock(x, x, x, attn_mask=mask), slim(x, x, x, attn_mask=mask)
    for want, got in zip(expected, actual):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.05)


DOUBLE_FAULTS = {
    # A call that fails two of stock's checks raises the one stock reaches first.
    "mask of an unsupported dtype, query of another width": (
        {},
        lambda: (torch.randn(2, 5, 6), torch.randn(2, 7, 6)),
        lambda: {"attn_mask": torch.zeros(5, 7, dtype=torch.int64)},
    ),
    "mask of an unsupported dtype, key of another width": (
        {"kdim": 6, "vdim": 6},
        lambda: (torch.randn(2, 5, 8), torch.randn(2, 7, 5)),
        lambda: {"attn_mask": torch.zeros(5, 7, dtype=torch.int64)},
    ),
    "padding mask of the wrong shape, inputs of another dtype": (
        {},
        lambda: (torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 7, 8, dtype=torch.float64)),
        lambda: {"key_padding_mask": torch.zeros(2, 3, dtype=torch.bool)},
    ),
    "attention mask of the wrong shape, inputs of another dtype": (
        {},
        lambda: (torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 7, 8, dtype=torch.float64)),
        lambda: {"attn_mask": torch.zeros(3, 3)},
    ),
}


@pytest.mark.parametrize("fault", DOUBLE_FAULTS)
@pytest.mark.parametrize("need_weights", [True, False])
def test_of_two_faults_the_one_stock_reaches_first_is_raised(fault, need_weights):
    """Stock checks the masks' dtypes before the widths and the projections, and their shapes after
    the projections; slim's own path raises in the same order."""
    from slim_mha import SlimMultiheadAttention

    from _reference import STOCK_MHA

    options, inputs, masks = DOUBLE_FAULTS[fault]
    torch.manual_seed(0)
    stock = STOCK_MHA(8, 2, batch_first=True, **options)
    slim = SlimMultiheadAttention(8, 2, batch_first=True, **options)
    slim.load_state_dict(stock.state_dict())
    query, key = inputs()
    results = [outcome(lambda m=m: m(query, key, key, need_weights=need_weights, **masks())) for m in (stock, slim)]
    assert results[1] == results[0]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("batches", [(2, 1), (1, 2), (2, 3)])
def test_keys_of_another_batch_are_refused_as_stock_refuses_them(batch_first, need_weights, batches):
    """Stock reshapes the keys to the queries' batch and fails; SDPA alone would broadcast a batch of
    one and return an output for a call stock refuses."""
    from slim_mha import SlimMultiheadAttention

    from _reference import STOCK_MHA

    torch.manual_seed(0)
    stock = STOCK_MHA(8, 2, batch_first=batch_first)
    slim = SlimMultiheadAttention(8, 2, batch_first=batch_first)
    slim.load_state_dict(stock.state_dict())
    query_batch, key_batch = batches
    query = torch.randn(*((query_batch, 5, 8) if batch_first else (5, query_batch, 8)))
    key = torch.randn(*((key_batch, 7, 8) if batch_first else (7, key_batch, 8)))
    for module in (stock, slim):
        with pytest.raises(RuntimeError) as raised:
            module(query, key, key, need_weights=need_weights)
    assert "batch" in str(raised.value)
