"""Plain self-attention without weights: which calls take the short path, and every one against stock.

Self-attention with ``need_weights=False``, without masks and without a graph, skips the general
path's bookkeeping (``SlimMultiheadAttention._attend_plain`` then ``_attend_without_weights``): one
input projection with ``[b_q; 0; b_v]``, SDPA and the output projection, the general path's own ops.
Each test counts the short path's calls, so a call that silently changes path fails, and compares
the result with stock ``nn.MultiheadAttention`` built from the same weights (and, where the short
path runs, bit for bit with the general path).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _reference import STOCK_MHA, assert_close_scaled, randomize_parameters
from torch.nn.utils import parametrize

import slim_mha.attention as attention
from slim_mha import SlimMultiheadAttention
from slim_mha.bench.contenders import fast_path_enabled
from slim_mha.bench.memory import profile_step

BATCH, LENGTH, EMBED, HEADS = 3, 6, 16, 4


@pytest.fixture
def short_calls(monkeypatch) -> list:
    """Every call of the short path without weights, recorded."""
    calls = []
    real = SlimMultiheadAttention._attend_without_weights

    def counted(self, *args):
        calls.append(args)
        return real(self, *args)

    monkeypatch.setattr(SlimMultiheadAttention, "_attend_without_weights", counted)
    return calls


def modules(embed: int = EMBED, heads: int = HEADS, dtype: torch.dtype = torch.float32, **options) -> tuple:
    options = {"batch_first": True, **options}
    stock = randomize_parameters(STOCK_MHA(embed, heads, dtype=dtype, **options))  # the key slot included
    slim = SlimMultiheadAttention(embed, heads, dtype=dtype, **options)
    slim.load_state_dict(stock.state_dict())
    return stock.eval(), slim.eval()


def tokens(dtype: torch.dtype = torch.float32, *shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    return torch.randn(*(shape or (BATCH, LENGTH, EMBED)), generator=generator, dtype=torch.float64).to(dtype)


def assert_like_stock(stock, slim, *args, **kwargs) -> None:
    expected, actual = stock(*args, need_weights=False, **kwargs), slim(*args, need_weights=False, **kwargs)
    assert actual[1] is None and expected[1] is None
    assert_close_scaled(actual[0], expected[0])
    assert actual[0].shape == expected[0].shape and actual[0].dtype == expected[0].dtype


@contextlib.contextmanager
def general_path_only(monkeypatch):
    """Every call through the general path, as before the short path existed."""
    with monkeypatch.context() as patch:
        patch.setattr(SlimMultiheadAttention, "_attend_plain", lambda self, *args: None)
        yield


# ---------------------------------------------------------------------------- calls that take it


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_plain_calls_take_the_short_path_match_stock_and_the_general_path_bit_for_bit(
    dtype, context, batch_first, short_calls, monkeypatch
):
    stock, slim = modules(dtype=dtype, batch_first=batch_first)
    x = tokens(dtype, *((BATCH, LENGTH, EMBED) if batch_first else (LENGTH, BATCH, EMBED)))
    with getattr(torch, context)():
        assert_like_stock(stock, slim, x, x, x)
        short = slim(x, x, x, need_weights=False)[0]
        with general_path_only(monkeypatch):
            general = slim(x, x, x, need_weights=False)[0]
    assert len(short_calls) == 2
    assert torch.equal(short, general)
    assert short.stride() == general.stride()


@pytest.mark.parametrize(
    "case",
    [
        "frozen parameters, grad enabled", "training without dropout", "odd heads", "fast path disabled",
        "a non-contiguous query", "skip unread weights", "sequence first, odd heads",
    ],
)
def test_other_plain_calls_take_it_too(case, short_calls):
    odd = "odd heads" in case
    stock, slim = modules(embed=15 if odd else EMBED, heads=5 if odd else HEADS, batch_first="sequence" not in case)
    x = tokens(torch.float32, *((BATCH, LENGTH, 15) if odd else (BATCH, LENGTH, EMBED)))
    if "sequence" in case:
        x = x.transpose(0, 1).contiguous()
    context = torch.no_grad()
    if case == "frozen parameters, grad enabled":
        for module in (stock, slim):
            module.requires_grad_(False)
        context = contextlib.nullcontext()
    elif case == "training without dropout":
        slim.train()
    elif case == "a non-contiguous query":
        x = tokens(torch.float32, LENGTH, BATCH, EMBED).transpose(0, 1)
    elif case == "skip unread weights":
        slim.skip_unread_weights = True
    with context, fast_path_enabled(case != "fast path disabled"):
        assert_like_stock(stock, slim, x, x, x)
    assert len(short_calls) == 1


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e6])
def test_whatever_the_key_slot_holds_the_output_is_stocks_without_it(poison, short_calls):
    stock, slim = modules()
    with torch.no_grad():
        stock.in_proj_bias[EMBED : 2 * EMBED] = 0.0  # stock's function is the same for every key bias
        slim.in_proj_bias[EMBED : 2 * EMBED] = poison
        x = tokens()
        assert_like_stock(stock, slim, x, x, x)
    assert len(short_calls) == 1


def test_writes_to_the_parameters_between_calls_are_seen(short_calls):
    """Nothing derived from the parameters is kept: EMA's ``p.data`` writes, a dtype change after a call."""
    stock, slim = modules()
    x = tokens()
    with torch.no_grad():
        slim(x, x, x, need_weights=False)
        for module in (stock, slim):
            for parameter in module.parameters():
                parameter.data.mul_(0.5).add_(0.25)  # an EMA step, through .data (no version bump)
        assert_like_stock(stock, slim, x, x, x)
        stock, slim, x = stock.double(), slim.double(), x.double()
        assert_like_stock(stock, slim, x, x, x)
    assert len(short_calls) == 3


def test_its_peak_is_no_higher_than_the_general_paths(short_calls, monkeypatch):
    """The projections are freed before the output projection allocates, as the general path frees them."""
    _, slim = modules(embed=64, heads=4)
    x = torch.randn(4, 96, 64)
    with torch.inference_mode():
        slim(x, x, x, need_weights=False)  # warm
        short = profile_step(lambda: slim(x, x, x, need_weights=False), x.device).peak_bytes
        with general_path_only(monkeypatch):
            general = profile_step(lambda: slim(x, x, x, need_weights=False), x.device).peak_bytes
    assert short_calls and short <= general, (short, general)


# ---------------------------------------------------------------------- calls that must not take it


def _masks():
    padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    padding[0, -2:] = True
    causal = torch.triu(torch.ones(LENGTH, LENGTH, dtype=torch.bool), diagonal=1)
    return padding, causal


GENERAL_PATH = [
    "key padding mask", "bool attn_mask", "causal mask", "cross attention", "shared key and value",
    "graph recorded", "add_bias_kv", "add_zero_attn", "kdim and vdim", "no biases", "autocast", "unbatched",
    "dropout in training", "equivariance check", "parametrized bias", "vmap", "tensor subclass", "empty batch",
    "nested",
]


@pytest.mark.parametrize("case", GENERAL_PATH)
def test_other_calls_take_the_general_path_and_match_stock(case, short_calls):
    options = {
        "add_bias_kv": {"add_bias_kv": True}, "add_zero_attn": {"add_zero_attn": True},
        "kdim and vdim": {"kdim": 10, "vdim": 6}, "no biases": {"bias": False},
    }.get(case, {})
    stock, slim = modules(**options)
    x = tokens()
    query = key = value = x
    kwargs, context = {}, torch.no_grad()
    padding, causal = _masks()
    if case == "key padding mask":
        kwargs["key_padding_mask"] = padding
    elif case == "bool attn_mask":
        kwargs["attn_mask"] = causal
    elif case == "causal mask":
        kwargs.update(attn_mask=causal, is_causal=True)
    elif case == "cross attention":
        key = value = tokens(torch.float32, BATCH, LENGTH + 2, EMBED)
    elif case == "shared key and value":
        key = value = x.clone()
    elif case == "graph recorded":
        context = contextlib.nullcontext()
    elif case == "kdim and vdim":
        key, value = torch.randn(BATCH, LENGTH, 10), torch.randn(BATCH, LENGTH, 6)
    elif case == "unbatched":
        query = key = value = x[0]
    elif case == "parametrized bias":
        for module in (stock, slim):
            parametrize.register_parametrization(module, "in_proj_bias", _Halved())
    elif case == "equivariance check":
        slim.check_equivariance = True
    elif case == "tensor subclass":
        query = key = value = x.as_subclass(_Tagged)
    with context:
        if case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                slim(query, key, value, need_weights=False)  # autocast's rounding: compared in test_compile_export
        elif case == "dropout in training":
            slim.dropout = 0.5
            slim.train()
            assert slim(x, x, x, need_weights=False)[0].shape == (BATCH, LENGTH, EMBED)
        elif case == "vmap":
            batched = torch.func.vmap(lambda t: slim(t, t, t, need_weights=False)[0])(x.unsqueeze(1))
            assert_close_scaled(batched.squeeze(1), stock(x, x, x, need_weights=False)[0])
        elif case == "empty batch":
            empty = torch.randn(0, LENGTH, EMBED)
            assert slim(empty, empty, empty, need_weights=False)[0].shape == (0, LENGTH, EMBED)
        elif case == "nested":
            nested = torch.nested.nested_tensor([torch.randn(4, EMBED), torch.randn(6, EMBED)])
            assert slim(nested, nested, nested, need_weights=False)[0].is_nested
        else:
            assert_like_stock(stock, slim, query, key, value, **kwargs)
    assert short_calls == []


def test_a_query_of_the_wrong_width_gets_stocks_error(short_calls):
    """Stock's Python path's error (its fast path's kernel words it differently)."""
    stock, slim = modules()
    stock.train()
    x = tokens(torch.float32, BATCH, LENGTH, EMBED + 1)
    with torch.no_grad():
        for module in (stock, slim):
            with pytest.raises(AssertionError, match=f"was expecting embedding dimension of {EMBED}"):
                module(x, x, x, need_weights=False)
    assert short_calls == []


class _Halved(torch.nn.Module):
    def forward(self, bias: torch.Tensor) -> torch.Tensor:
        return bias * 0.5


class _Tagged(torch.Tensor):
    """A subclass with its own ``__torch_function__``, as tensor-wrapping libraries define."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


# -------------------------------------------------------------------------------- the check fails


def test_the_comparison_fails_when_the_short_path_gets_the_key_bias(short_calls, monkeypatch):
    """With a key bias of 1e6 in the projection, the scores lose their precision: the check sees it."""
    monkeypatch.setattr(attention, "without_key_bias_eager", lambda bias: bias)
    stock, slim = modules()
    with torch.no_grad():
        stock.in_proj_bias[EMBED : 2 * EMBED] = 0.0
        slim.in_proj_bias[EMBED : 2 * EMBED] = 1e6
        x = tokens()
        with pytest.raises(AssertionError):
            assert_like_stock(stock, slim, x, x, x)
    assert len(short_calls) == 1

