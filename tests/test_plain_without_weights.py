"""Plain self-attention without weights: which calls take the short path, and every one against stock.

Self-attention with ``need_weights=False``, without masks and without a graph, skips the general
path's bookkeeping (``choose_path`` names it ``"sdpa"``, ``_slim_sdpa`` runs it): one
input projection with ``[b_q; 0; b_v]``, SDPA and the output projection, the general path's own ops.
Each test counts the short path's calls, so a call that silently changes path fails, and compares
the result with stock ``nn.MultiheadAttention`` built from the same weights (and, where the short
path runs, bit for bit with the general path).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.utils import parametrize

import slim_mha.attention as attention
from slim_mha import SlimMultiheadAttention
from slim_mha.bench.measure.memory import profile_step
from slim_mha.paths import CallPlan

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
from _reference import assert_close_scaled, fast_path_enabled

WITHOUT = {"need_weights": False}
# Slim's own short path: not stock's kernel, which takes these small calls by default in fp32 and bf16.
pytestmark = pytest.mark.usefixtures("slims_own_paths")


@pytest.fixture
def short_calls(monkeypatch) -> list:
    """Every call of the short path without weights, recorded."""
    return recorded_calls(monkeypatch, SlimMultiheadAttention, "_slim_sdpa")


@contextlib.contextmanager
def general_path_only(monkeypatch):
    """Every call through the general path, as before the short path existed."""
    with monkeypatch.context() as patch:
        general = CallPlan("general", "the test's")
        patch.setattr(attention, "choose_path", lambda module, call: general)  # forward's binding
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
        assert_like_stock(stock, slim, x, x, x, **WITHOUT)
        short = slim(x, x, x, need_weights=False)[0]
        with general_path_only(monkeypatch):
            general = slim(x, x, x, need_weights=False)[0]
    assert len(short_calls) == 2
    assert torch.equal(short, general)
    assert short.stride() == general.stride()


@pytest.mark.parametrize(
    "case",
    [
        "frozen parameters, grad enabled",
        "training without dropout",
        "odd heads",
        "fast path disabled",
        "a non-contiguous query",
        "skip unread weights",
        "sequence first, odd heads",
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
        assert_like_stock(stock, slim, x, x, x, **WITHOUT)
    assert len(short_calls) == 1


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e6])
def test_whatever_the_key_slot_holds_the_output_is_stocks_without_it(poison, short_calls):
    check_any_key_slot_gives_stocks_output(poison, **WITHOUT)
    assert len(short_calls) == 1


def test_writes_to_the_parameters_between_calls_are_seen(short_calls):
    check_parameter_writes_are_seen(**WITHOUT)
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


GENERAL_PATH = [
    *REFUSED,
    "autocast",
    "dropout in training",
    "parametrized bias",
    "vmap",
    "tensor subclass",
    "empty batch",
    "nested",
]


@pytest.mark.parametrize("case", GENERAL_PATH)
def test_other_calls_take_the_general_path_and_match_stock(case, short_calls):
    stock, slim = modules(**REFUSED_OPTIONS.get(case, {}))
    x = tokens()
    (query, key, value), kwargs, context = refused_call(case, x)
    if case == "parametrized bias":
        for module in (stock, slim):
            parametrize.register_parametrization(module, "in_proj_bias", Halved())
    elif case == "tensor subclass":
        query = key = value = x.as_subclass(Tagged)
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
            assert_like_stock(stock, slim, query, key, value, **kwargs, **WITHOUT)
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


# -------------------------------------------------------------------------------- the check fails


def test_the_comparison_fails_when_the_short_path_gets_the_key_bias(short_calls, monkeypatch):
    """With a key bias of 1e6 in the projection, the scores lose their precision: the check sees it."""
    monkeypatch.setattr(attention, "key_slot_zeroer", lambda *bias_kind: lambda bias: bias)
    stock, slim = modules()
    with torch.no_grad():
        stock.in_proj_bias[EMBED : 2 * EMBED] = 0.0
        slim.in_proj_bias[EMBED : 2 * EMBED] = 1e6
        x = tokens()
        with pytest.raises(AssertionError):
            assert_like_stock(stock, slim, x, x, x, **WITHOUT)
    assert len(short_calls) == 1
