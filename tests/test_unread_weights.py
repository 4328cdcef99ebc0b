"""skip_unread_weights and the audit: weights skipped only where the caller provably drops them.

Every call shape below runs a slim module built from a random stock module's weights. Shapes the
analysis recognises must return stock's output (to the dtype's tolerance) and ``None`` weights,
with no softmax outside ``scaled_dot_product_attention``; every other shape must return stock's
output *and* stock's weights. The call sites are written out as small functions at module level
because the analysis reads exactly their bytecode.

The whole file runs on every Python version: the tests that need the analysis to skip are marked
``needs_tested_bytecode`` and run on the versions in ``_TESTED_VERSIONS`` (CI runs each of them);
everything else, the warning of an untested version included, runs everywhere.
"""

from __future__ import annotations

import copy
import dis
import functools
import inspect
import io
import pickle
import sys
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn

import slim_mha
from slim_mha import (
    SlimMultiheadAttention,
    convert,
    patch,
    patched,
    unpatch,
    unread_weights_report,
)
from slim_mha import attention as attention_module
from slim_mha import unread_weights as _unread_weights
from slim_mha.bench.models import DetrStyleDecoderLayer

from _reference import STOCK_MHA, assert_close_scaled, randomize_parameters

E, H, L, S, B = 16, 4, 5, 7, 3
# These tests count slim's own weights path: not stock's Python path, which small calls take by default.
pytestmark = pytest.mark.usefixtures("slims_own_paths")

PYTHON = sys.version_info[:2]
needs_tested_bytecode = pytest.mark.skipif(
    PYTHON not in _unread_weights._TESTED_VERSIONS,
    reason=f"skipping is off on Python {PYTHON[0]}.{PYTHON[1]}, whose bytecode was not tested (it warns instead)",
)


# ------------------------------------------------------------------------------------ helpers


def stock_and_slim(dtype: torch.dtype = torch.float64, **kwargs) -> tuple[nn.Module, SlimMultiheadAttention]:
    torch.manual_seed(0)
    stock = randomize_parameters(STOCK_MHA(E, H, dtype=dtype, **kwargs))
    slim = convert(copy.deepcopy(stock), skip_unread_weights=True)
    return stock, slim


def tokens(dtype: torch.dtype = torch.float64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(L, B, E, generator=generator, dtype=torch.float64).to(dtype)
    memory = torch.randn(S, B, E, generator=generator, dtype=torch.float64).to(dtype)
    return query, memory, memory


class WeightsPathSpy:
    """Counts calls of the explicit with-weights path inside slim's forward."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.averaged: list[bool] = []  # each call's ``average`` argument
        original = attention_module.attention_with_weights

        def counting(q, k, v, mask, dropout_p, average, **kwargs):
            self.calls += 1
            self.averaged.append(average)
            return original(q, k, v, mask, dropout_p, average, **kwargs)

        monkeypatch.setattr(attention_module, "attention_with_weights", counting)


@pytest.fixture
def spy(monkeypatch) -> WeightsPathSpy:
    return WeightsPathSpy(monkeypatch)


# ----------------------------------------------------------- call sites the analysis recognises


def site_subscript_zero(attn, q, k, v):
    return attn(q, k, v)[0]


def site_subscript_zero_keywords(attn, q, k, v):
    return attn(q, k, value=v, key_padding_mask=None, need_weights=True, average_attn_weights=False)[0]


def site_subscript_zero_multiline(attn, q, k, v):
    out = attn(
        q,
        k,
        v,
    )[0]
    return out


def site_unpack_underscore(attn, q, k, v):
    out, _ = attn(q, k, v)
    return out


def site_unpack_unread_name(attn, q, k, v):
    out, _weights = attn(q, k, v)
    return out


def site_unpack_in_a_loop(attn, q, k, v):
    total = 0
    for _ in range(2):
        out, _ = attn(q, k, v)
        total = total + out
    return total / 2


def site_unpack_then_deleted(attn, q, k, v):
    out, unused = attn(q, k, v)
    del unused
    return out


RECOGNISED = [
    site_subscript_zero,
    site_subscript_zero_keywords,
    site_subscript_zero_multiline,
    site_unpack_underscore,
    site_unpack_unread_name,
    site_unpack_in_a_loop,
    site_unpack_then_deleted,
]


# ------------------------------------------------------- call sites that must keep the weights

_KEPT: list = []


def site_stored(attn, q, k, v):
    result = attn(q, k, v)
    return result


def site_returned(attn, q, k, v):
    return attn(q, k, v)


def site_passed_on(attn, q, k, v):
    return tuple(attn(q, k, v))


def site_second_name_read_later(attn, q, k, v):
    out, weights = attn(q, k, v)
    return out, weights


def site_underscore_read_later(attn, q, k, v):
    out, _ = attn(q, k, v)
    return out, _


def site_read_earlier_in_a_loop(attn, q, k, v):
    previous = None
    for _ in range(2):
        if previous is not None:
            _KEPT.append(previous)
        out, previous = attn(q, k, v)
    return out, _KEPT.pop()


def site_captured_by_a_closure(attn, q, k, v):
    out, weights = attn(q, k, v)
    return out, (lambda: weights)()


def site_read_through_locals(attn, q, k, v):
    out, weights = attn(q, k, v)
    return out, locals()["weights"]


def site_read_in_a_comprehension(attn, q, k, v):
    out, weights = attn(q, k, v)
    return out, [weights for _ in range(1)][0]  # 3.12+ inline it; 3.13 fuses the read with a store


def site_nested_unpack(attn, q, k, v):
    (_, *later_queries), weights = attn(q, k, v)  # the first target is itself an unpacking
    return torch.stack(later_queries), weights


def site_subscript_one(attn, q, k, v):
    return attn(q, k, v)[0], attn(q, k, v)[1]


def site_subscript_false(attn, q, k, v):
    return attn(q, k, v)[False], attn(q, k, v)[1]


def site_star_unpack(attn, q, k, v):
    out, *rest = attn(q, k, v)
    return out, rest[0]


def site_star_arguments(attn, q, k, v):
    args = (q, k, v)
    _KEPT.append(attn(*args))
    return attn(*args)[0], _KEPT.pop()[1]


def site_through_map(attn, q, k, v):
    return list(map(attn, [q], [k], [v]))[0]


def site_forward_called_directly(attn, q, k, v):
    return attn.forward(q, k, v)[0], attn.forward(q, k, v)[1]


def site_unpack_into_an_attribute(attn, q, k, v):
    class Holder:
        pass

    holder = Holder()
    holder.out, unused = attn(q, k, v)
    return holder.out, attn(q, k, v)[1]


# Each site, and how many attention calls it makes: every one of them must compute the weights.
# Sites with two calls discard in one call (the point of the test) and read in the other.
NOT_RECOGNISED = {
    site_stored: 1,
    site_returned: 1,
    site_passed_on: 1,
    site_second_name_read_later: 1,
    site_underscore_read_later: 1,
    site_read_earlier_in_a_loop: 2,
    site_captured_by_a_closure: 1,
    site_read_through_locals: 1,
    site_read_in_a_comprehension: 1,
    site_star_unpack: 1,
    site_through_map: 1,
    site_subscript_false: 2,
    site_star_arguments: 2,
    site_forward_called_directly: 2,
    site_unpack_into_an_attribute: 2,
    site_nested_unpack: 1,
}


# --------------------------------------------------------------------------------- recognised


@needs_tested_bytecode
@pytest.mark.parametrize("site", RECOGNISED, ids=lambda site: site.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_recognised_sites_skip_the_weights_and_match_stock(site, dtype, spy):
    stock, slim = stock_and_slim(dtype)
    q, k, v = tokens(dtype)
    expected = site(stock, q, k, v)
    actual = site(slim, q, k, v)
    assert spy.calls == 0, "the explicit weights path ran"
    assert_close_scaled(actual, expected, "output")


@needs_tested_bytecode
def test_recognised_site_returns_none_as_the_weights(monkeypatch):
    """Seen from inside: the tuple the discarding caller received had None as the weights."""
    _, slim = stock_and_slim()
    received = []
    # A wrapper around forward would become the caller, so record below it, from _slim_general.
    original_attend = SlimMultiheadAttention._slim_general

    def attend(self, *args, **kwargs):
        result = original_attend(self, *args, **kwargs)
        received.append(result[1])
        return result

    monkeypatch.setattr(SlimMultiheadAttention, "_slim_general", attend)
    q, k, v = tokens()
    site_subscript_zero(slim, q, k, v)
    site_unpack_underscore(slim, q, k, v)
    assert received == [None, None]


@needs_tested_bytecode
@pytest.mark.parametrize("mode", ["train", "eval", "no_grad", "inference_mode"])
def test_skipped_gradients_match_stock(mode, spy):
    stock, slim = stock_and_slim()
    stock.train(mode == "train")
    slim.train(mode == "train")
    q, k, v = tokens()
    grad_out = torch.randn(L, B, E, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    results = {}
    for name, module in (("stock", stock), ("slim", slim)):
        inputs = [t.clone().requires_grad_(mode in ("train", "eval")) for t in (q, k)]
        context = {"no_grad": torch.no_grad(), "inference_mode": torch.inference_mode()}.get(mode)
        if context is None:
            out = site_subscript_zero(module, inputs[0], inputs[1], inputs[1])
            out.backward(grad_out)
            results[name] = (out, *[t.grad for t in inputs])
        else:
            with context:
                results[name] = (site_subscript_zero(module, inputs[0], inputs[1], inputs[1]).clone(),)
    assert spy.calls == 0
    for actual, expected in zip(results["slim"], results["stock"]):
        assert_close_scaled(actual, expected)
    if mode in ("train", "eval"):
        assert_close_scaled(slim.in_proj_bias.grad, stock.in_proj_bias.grad, "in_proj_bias grad")
        assert_close_scaled(slim.in_proj_weight.grad, stock.in_proj_weight.grad, "in_proj_weight grad")


@needs_tested_bytecode
@pytest.mark.parametrize(
    "options", [{"batch_first": True}, {"add_bias_kv": True}, {"add_zero_attn": True}, {"kdim": 6, "vdim": 9}]
)
def test_skipping_matches_stock_across_structures(options, spy):
    stock, slim = stock_and_slim(**options)
    generator = torch.Generator().manual_seed(5)
    shape = (lambda n, width: (B, n, width)) if options.get("batch_first") else (lambda n, width: (n, B, width))
    q = torch.randn(shape(L, E), generator=generator, dtype=torch.float64)
    k = torch.randn(shape(S, options.get("kdim", E)), generator=generator, dtype=torch.float64)
    v = torch.randn(shape(S, options.get("vdim", E)), generator=generator, dtype=torch.float64)
    assert_close_scaled(site_subscript_zero(slim, q, k, v), site_subscript_zero(stock, q, k, v))
    assert spy.calls == 0


@needs_tested_bytecode
def test_skipping_unbatched_and_causal_matches_stock(spy):
    stock, slim = stock_and_slim()
    q, k, _ = tokens()
    query, memory = q[:, 0], k[:, 0]  # unbatched: (L, E), (S, E)
    expected = site_subscript_zero(stock, query, memory, memory)
    assert_close_scaled(site_subscript_zero(slim, query, memory, memory), expected)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)

    def causal_site(attn):
        return attn(q, q, q, attn_mask=causal, is_causal=True)[0]

    assert_close_scaled(causal_site(slim), causal_site(stock))
    assert spy.calls == 0


@needs_tested_bytecode
def test_dropout_in_training_on_cpu_runs_the_weights_path_unaveraged_and_drops_its_weights(spy):
    """With attention dropout on CPU, SDPA would fall back to the same probabilities, slower: the
    skipped call runs the weights path without the average, returns ``None`` as its weights, and
    draws its dropout mask as stock's default call (and, on CPU, as stock's weightless call) does."""
    stock, slim = stock_and_slim(dropout=0.3)
    q, k, v = tokens()
    torch.manual_seed(11)
    default_call = stock(q, k, v)[0]
    torch.manual_seed(11)
    weightless = stock(q, k, v, need_weights=False)[0]
    torch.manual_seed(11)
    out, weights = slim(q, k, v)  # not a discarding site: computed as asked
    assert weights is not None and spy.averaged == [True]
    torch.manual_seed(11)
    actual = site_subscript_zero(slim, q, k, v)
    assert spy.averaged == [True, False]
    assert_close_scaled(actual, default_call, "dropout output, stock's default call")
    assert_close_scaled(actual, weightless, "dropout output, stock without weights")
    assert_close_scaled(actual, out, "dropout output, slim with weights")

    def weights_of_a_discarding_site(attn):
        result = attn(q, k, v)
        return result[1]

    assert weights_of_a_discarding_site(slim) is not None  # read: computed as asked
    assert slim(q, k, v, need_weights=False)[1] is None and spy.calls == 3  # SDPA, as asked


@needs_tested_bytecode
def test_without_dropout_or_in_eval_the_skipped_call_takes_the_weightless_path(spy):
    """Only attention dropout in training keeps the weights path: without it the skip is SDPA's."""
    for dropout, train in ((0.3, False), (0.0, True)):
        stock, slim = stock_and_slim(dropout=dropout)
        stock.train(train), slim.train(train)
        q, k, v = tokens()
        actual = site_subscript_zero(slim, q, k, v)
        assert spy.calls == 0
        assert_close_scaled(actual, stock(q, k, v, need_weights=False)[0], f"dropout {dropout}, train {train}")


# ------------------------------------------------------------------------------ not recognised


def weights_of(result) -> torch.Tensor:
    """The weights a not-recognised site handed back (as a tuple of (output, weights))."""
    return result[1]


@pytest.mark.parametrize("site", NOT_RECOGNISED, ids=lambda site: site.__name__)
def test_not_recognised_sites_return_stock_weights(site, spy):
    stock, slim = stock_and_slim()
    q, k, v = tokens()
    expected = site(stock, q, k, v)
    actual = site(slim, q, k, v)
    assert weights_of(actual) is not None, "weights were skipped at a site that reads them"
    assert_close_scaled(actual[0], expected[0], "output")
    assert_close_scaled(weights_of(actual), weights_of(expected), "weights")
    assert spy.calls == NOT_RECOGNISED[site], "a call at a not-recognised site skipped its weights"


@needs_tested_bytecode
def test_the_same_spy_sees_a_skipped_call_next_to_a_kept_one(spy):
    """The counterpart that proves the tests above can fail: of [0] and [1], only [1] computes."""
    stock, slim = stock_and_slim()
    q, k, v = tokens()
    out, weights = site_subscript_one(slim, q, k, v)
    assert spy.calls == 1
    assert_close_scaled(weights, stock(q, k, v)[1], "weights")


class Wrapper(nn.Module):
    """A parent that returns the attention result unchanged: the caller of the module is this forward."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, q, k, v):
        return self.attention(q, k, v)


def test_a_wrapping_module_keeps_the_weights(spy):
    stock, slim = stock_and_slim()
    q, k, v = tokens()
    out = Wrapper(slim)(q, k, v)
    assert out[1] is not None and spy.calls == 1
    assert_close_scaled(out[1], Wrapper(stock)(q, k, v)[1], "weights")
    assert Wrapper(slim)(q, k, v)[0] is not None and spy.calls == 2  # [0] on the wrapper: still computed


@needs_tested_bytecode
@pytest.mark.parametrize("scope", ["module", "global", "with_kwargs", "backward"])
def test_hooks_that_see_the_output_keep_the_weights(scope, spy):
    stock, slim = stock_and_slim()
    q, k, v = tokens()
    seen = []
    if scope == "module":
        handle = slim.register_forward_hook(lambda module, args, output: seen.append(output[1]))
    elif scope == "with_kwargs":
        handle = slim.register_forward_hook(
            lambda module, args, kwargs, output: seen.append(output[1]), with_kwargs=True
        )
    elif scope == "global":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, output: seen.append(output[1]) if module is slim else None
        )
    else:
        handle = slim.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    try:
        out = site_subscript_zero(slim, q, k, v)
    finally:
        handle.remove()
    assert spy.calls == 1
    assert_close_scaled(out, site_subscript_zero(stock, q, k, v))
    if scope != "backward":
        assert_close_scaled(seen[0], stock(q, k, v)[1], "weights seen by the hook")
    site_subscript_zero(slim, q, k, v)
    assert spy.calls == 1, "hooks removed: the site skips again"


@needs_tested_bytecode
def test_forward_pre_hooks_do_not_stop_skipping(spy):
    _, slim = stock_and_slim()
    q, k, v = tokens()
    handle = slim.register_forward_pre_hook(lambda module, args: None)
    try:
        site_subscript_zero(slim, q, k, v)
    finally:
        handle.remove()
    assert spy.calls == 0


def untested_warning(version: tuple[int, int]) -> str:
    return (
        f"skip_unread_weights has no effect on Python {version[0]}.{version[1]}: slim_mha reads a call site's "
        f"bytecode only on the Python versions it was tested on (2.7), so every call computes its attention "
        f"weights as asked (and unread_weights_report counts none); where the weights are not used, pass "
        f"need_weights=False"
    )


def test_untested_python_versions_keep_the_weights_and_warn_once(monkeypatch, spy):
    stock, slim = stock_and_slim()
    q, k, v = tokens()
    monkeypatch.setattr(_unread_weights, "_TESTED_VERSIONS", frozenset({(2, 7)}))
    monkeypatch.setattr(_unread_weights, "_WARNED_VERSIONS", set())
    with pytest.warns(RuntimeWarning) as caught:
        out = site_subscript_zero(slim, q, k, v)
    assert [str(warning.message) for warning in caught] == [untested_warning(PYTHON)]
    assert spy.calls == 1
    assert_close_scaled(out, site_subscript_zero(stock, q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second module, site or audit stays quiet
        _, other = stock_and_slim()
        site_unpack_underscore(other, q, k, v)
        with unread_weights_report(quiet=True) as report:
            site_subscript_zero(stock, q, k, v)
    assert spy.calls == 2 and report.sites == []


@pytest.mark.skipif(PYTHON in _unread_weights._TESTED_VERSIONS, reason="this Python's bytecode is tested")
def test_this_untested_python_keeps_the_weights_and_says_so(monkeypatch, spy):
    """On a version CI runs but whose bytecode is untested: the real check, not a patched one."""
    stock, slim = stock_and_slim()
    q, k, v = tokens()
    monkeypatch.setattr(_unread_weights, "_WARNED_VERSIONS", set())
    with pytest.warns(
        RuntimeWarning, match=rf"^skip_unread_weights has no effect on Python {PYTHON[0]}\.{PYTHON[1]}: "
    ):
        out = site_subscript_zero(slim, q, k, v)
    assert spy.calls == 1, "the weights were not computed"
    assert_close_scaled(out, site_subscript_zero(stock, q, k, v))


@needs_tested_bytecode
def test_a_tested_python_does_not_warn(spy):
    _, slim = stock_and_slim()
    q, k, v = tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        site_subscript_zero(slim, q, k, v)
    assert spy.calls == 0


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_malformed_call_raises_stocks_error_with_the_option_on(batch_first):
    """The option's questions come before stock's checks: an unbatched query with batched keys still
    meets stock's error, not one of slim's own."""
    stock = STOCK_MHA(8, 2, batch_first=batch_first)
    slim = convert(copy.deepcopy(stock), skip_unread_weights=True)
    query, key = torch.randn(5, 8), torch.randn(5, 3, 8)
    with pytest.raises(AssertionError) as expected:
        stock(query, key, key)
    with pytest.raises(AssertionError) as raised:
        site_subscript_zero(slim, query, key, key)
    assert str(raised.value) == str(expected.value)


def test_the_option_off_keeps_the_weights(spy):
    _, slim = stock_and_slim()
    slim.skip_unread_weights = False
    q, k, v = tokens()
    site_subscript_zero(slim, q, k, v)
    assert spy.calls == 1


def test_need_weights_false_is_untouched(spy):
    stock, slim = stock_and_slim()
    q, k, v = tokens()
    out, weights = slim(q, k, v, need_weights=False)
    assert weights is None and spy.calls == 0
    assert_close_scaled(out, stock(q, k, v, need_weights=False)[0])


# What each tested Python emits for the shapes the analysis reads, from the CALL on.
EMITTED = {
    (3, 11): {
        site_subscript_zero: ["PRECALL", "CALL", "LOAD_CONST", "BINARY_SUBSCR"],
        site_subscript_zero_keywords: ["KW_NAMES", "PRECALL", "CALL", "LOAD_CONST", "BINARY_SUBSCR"],
        site_unpack_underscore: ["PRECALL", "CALL", "UNPACK_SEQUENCE", "STORE_FAST", "STORE_FAST"],
        site_second_name_read_later: ["PRECALL", "CALL", "UNPACK_SEQUENCE", "STORE_FAST", "STORE_FAST"],
    },
    (3, 12): {
        site_subscript_zero: ["LOAD_FAST", "CALL", "LOAD_CONST", "BINARY_SUBSCR"],
        site_subscript_zero_keywords: ["KW_NAMES", "CALL", "LOAD_CONST", "BINARY_SUBSCR"],
        site_unpack_underscore: ["LOAD_FAST", "CALL", "UNPACK_SEQUENCE", "STORE_FAST", "STORE_FAST"],
        site_second_name_read_later: ["LOAD_FAST", "CALL", "UNPACK_SEQUENCE", "STORE_FAST", "STORE_FAST"],
    },
    (3, 13): {
        site_subscript_zero: ["LOAD_FAST", "CALL", "LOAD_CONST", "BINARY_SUBSCR"],
        site_subscript_zero_keywords: ["LOAD_CONST", "CALL_KW", "LOAD_CONST", "BINARY_SUBSCR"],
        site_unpack_underscore: ["LOAD_FAST", "CALL", "UNPACK_SEQUENCE", "STORE_FAST_STORE_FAST"],
        # the later read is the second half of a fused pair: the analysis must split it to see it
        site_second_name_read_later: [
            "LOAD_FAST",
            "CALL",
            "UNPACK_SEQUENCE",
            "STORE_FAST_STORE_FAST",
            "LOAD_FAST_LOAD_FAST",
        ],
    },
}


def test_every_tested_python_has_its_bytecode_pinned():
    assert set(EMITTED) == _unread_weights._TESTED_VERSIONS


@needs_tested_bytecode
@pytest.mark.parametrize("site", list(EMITTED[(3, 11)]), ids=lambda site: site.__name__)
def test_the_bytecode_this_python_emits_is_the_shape_the_analysis_reads(site):
    """The instructions around the attention call, as this version emits them (see EMITTED)."""
    expected = EMITTED[PYTHON][site]
    names = [instruction.opname for instruction in dis.get_instructions(site)]
    call = names.index(expected[1])
    assert names[call - 1 : call - 1 + len(expected)] == expected


@pytest.mark.skipif(PYTHON < (3, 13), reason="3.13 is the first Python with fused loads and stores")
def test_fused_instructions_are_split_into_the_two_they_run():
    plain = [(i.opname, i.argval) for i in _unread_weights._plain_instructions(site_read_in_a_comprehension.__code__)]
    fused = [(i.opname, i.argval) for i in dis.get_instructions(site_read_in_a_comprehension)]
    assert ("STORE_FAST_STORE_FAST", ("out", "weights")) in fused and (
        "STORE_FAST_LOAD_FAST",
        ("_", "weights"),
    ) in fused
    assert plain[plain.index(("STORE_FAST", "out")) + 1] == ("STORE_FAST", "weights")
    assert plain[plain.index(("STORE_FAST", "_")) + 1] == ("LOAD_FAST", "weights")
    assert not any(name in _unread_weights._FUSED for name, _ in plain)


# ------------------------------------------------------------------------------------- traces


class SubscriptSite(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, q, k, v):
        return self.attention(q, k, v)[0]


def graph_has_softmax(graph_module: torch.fx.GraphModule) -> bool:
    return "softmax" in str(graph_module.graph)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_torch_compile_traces_the_weights_path(fresh_dynamo):
    stock, slim = stock_and_slim()
    q, k, v = tokens()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    out = torch.compile(SubscriptSite(slim), backend=backend, fullgraph=True)(q, k, v)
    assert_close_scaled(out, site_subscript_zero(stock, q, k, v))
    assert graphs and graph_has_softmax(graphs[0])


@pytest.mark.parametrize("strict", [True, False])
def test_torch_export_traces_the_weights_path(strict):
    _, slim = stock_and_slim(dtype=torch.float32)
    q, k, v = tokens(torch.float32)
    exported = torch.export.export(SubscriptSite(slim), (q, k, v), strict=strict)
    assert graph_has_softmax(exported.graph_module)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_jit_trace_traces_the_weights_path():
    _, slim = stock_and_slim(dtype=torch.float32)
    q, k, v = tokens(torch.float32)
    traced = torch.jit.trace(SubscriptSite(slim), (q, k, v), check_trace=False)
    assert "softmax" in str(traced.inlined_graph)


def test_make_fx_traces_the_weights_path():
    _, slim = stock_and_slim(dtype=torch.float32)
    q, k, v = tokens(torch.float32)
    site = SubscriptSite(slim)
    from torch.fx.experimental.proxy_tensor import make_fx

    assert graph_has_softmax(make_fx(site)(q, k, v))


def test_dispatch_modes_keep_the_weights():
    """FakeTensorMode, make_fx and non-strict export run Python under a TorchDispatchMode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    _, slim = stock_and_slim()
    q, k, v = tokens()
    with RecordOps() as recorder:
        site_subscript_zero(slim, q, k, v)
    assert any("softmax" in op for op in recorder.ops)
    with RecordOps() as recorder:
        slim(q, k, v, need_weights=False)
    assert not any("softmax" in op for op in recorder.ops)  # the recorder can tell


def test_functorch_transforms_keep_the_weights(spy):
    stock, slim = stock_and_slim()
    q, k, v = tokens()
    expected = torch.func.grad(lambda query: site_subscript_zero(stock, query, k, v).sum())(q)
    actual = torch.func.grad(lambda query: site_subscript_zero(slim, query, k, v).sum())(q)
    assert spy.calls == 1
    assert_close_scaled(actual, expected, "grad through torch.func.grad")
    # vmap: slim's weights path itself does not run under vmap yet (softmax with out=), so the
    # decision is checked on its own: inside the transform, nothing is skipped.
    seen = []
    torch.func.vmap(lambda query: seen.append(_unread_weights.is_symbolic_call(query)) or query)(q)
    assert seen == [True] and _unread_weights.is_symbolic_call(q) is False


# --------------------------------------------------------------------------------- the cache


@needs_tested_bytecode
def test_each_call_site_is_analysed_once(monkeypatch):
    _, slim = stock_and_slim()
    q, k, v = tokens()
    _unread_weights._VERDICTS.clear()
    analysed = []
    original = _unread_weights._analyse_call_site

    def counting(code, lasti):
        analysed.append((code.co_name, lasti))
        return original(code, lasti)

    monkeypatch.setattr(_unread_weights, "_analyse_call_site", counting)
    for _ in range(5):
        site_subscript_zero(slim, q, k, v)
        site_unpack_underscore(slim, q, k, v)
        site_stored(slim, q, k, v)
    assert sorted(name for name, _ in analysed) == ["site_stored", "site_subscript_zero", "site_unpack_underscore"]
    verdicts = {code.co_name: verdict for (code, _), verdict in _unread_weights._VERDICTS.items()}
    assert verdicts["site_subscript_zero"] is not None and verdicts["site_stored"] is None


# ------------------------------------------------------------------ DETR's decoder layer, as DETR calls it


_SOFTMAX_OPS = frozenset({"aten::softmax", "aten::_softmax", "aten::_safe_softmax"})


def explicit_softmax_calls(step) -> int:
    """Softmax calls in one profiled ``step`` outside ``scaled_dot_product_attention``: the weights path
    is the only place a layer calls softmax itself (SDPA's math fallback runs one inside the SDPA op)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        step()
    count = 0
    for event in profiler.events():
        if event.name not in _SOFTMAX_OPS or (event.cpu_parent is not None and event.cpu_parent.name in _SOFTMAX_OPS):
            continue  # count each softmax call once, not its nested aten::_softmax too
        parent = event.cpu_parent
        while parent is not None and parent.name != "aten::scaled_dot_product_attention":
            parent = parent.cpu_parent
        count += parent is None
    return count


def detr_pair(dropout: float = 0.0):
    """The layer in float64, attention weights random, and DETR's inputs: 6 queries over 11 image tokens,
    the second image padded on its last 15%."""
    torch.manual_seed(0)
    stock = DetrStyleDecoderLayer(E, H, 32, dropout).double()
    randomize_parameters(stock.self_attn, seed=1)
    randomize_parameters(stock.multihead_attn, seed=2)
    generator = torch.Generator().manual_seed(3)
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[-1, 9:] = True
    shapes = {"tgt": (6, 2, E), "memory": (11, 2, E), "query_pos": (6, 2, E), "pos": (11, 2, E)}
    inputs = {name: torch.randn(shape, generator=generator, dtype=torch.float64) for name, shape in shapes.items()}
    return stock, {**inputs, "memory_key_padding_mask": padding}


@needs_tested_bytecode
@pytest.mark.parametrize("build", ["convert", "patched"])
@pytest.mark.parametrize("mode", ["train", "eval", "inference_mode"])
def test_detr_decoder_layer_computes_no_weights_and_matches_stock(build, mode):
    stock, inputs = detr_pair()
    if build == "convert":
        slim = convert(copy.deepcopy(stock), skip_unread_weights=True)
    else:
        with patched(skip_unread_weights=True):
            slim = DetrStyleDecoderLayer(E, H, 32, 0.0).double()
        slim.load_state_dict(stock.state_dict())
    assert isinstance(slim.self_attn, SlimMultiheadAttention) and slim.self_attn.skip_unread_weights
    for layer in (stock, slim):
        layer.train(mode == "train")
    grad_out = torch.randn_like(inputs["tgt"])

    def step(layer):
        if mode == "inference_mode":
            with torch.inference_mode():
                return (layer(**inputs).clone(),)
        tgt = inputs["tgt"].clone().requires_grad_()
        memory = inputs["memory"].clone().requires_grad_()
        out = layer(**{**inputs, "tgt": tgt, "memory": memory})
        out.backward(grad_out)
        return out, tgt.grad, memory.grad

    expected = step(stock)
    actual = step(slim)
    for what, a, b in zip(("output", "tgt grad", "memory grad"), actual, expected):
        assert_close_scaled(a, b, what)
    if mode != "inference_mode":
        for name, parameter in slim.named_parameters():
            if name.startswith(("linear", "norm")):
                assert_close_scaled(parameter.grad, dict(stock.named_parameters())[name].grad, name)
    assert explicit_softmax_calls(lambda: step(stock)) == 2  # the check sees both weights paths
    assert explicit_softmax_calls(lambda: step(slim)) == 0


@needs_tested_bytecode
def test_detr_decoder_layer_with_dropout_draws_as_stock_without_weights():
    """DETR trains with attention dropout 0.1: the skipped layer draws as need_weights=False would."""
    stock, inputs = detr_pair(dropout=0.1)
    slim = convert(copy.deepcopy(stock), skip_unread_weights=True).train()
    reference = copy.deepcopy(stock).train()
    for attention in (reference.self_attn, reference.multihead_attn):  # stock, with need_weights=False
        attention.forward = functools.partial(type(attention).forward, attention, need_weights=False)
    torch.manual_seed(5)
    expected = reference(**inputs)
    torch.manual_seed(5)
    actual = slim(**inputs)
    assert_close_scaled(actual, expected, "output with dropout")


# ---------------------------------------------------------------------------------- the audit


def line_of(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(index for index, line in enumerate(lines) if text in line)


@needs_tested_bytecode
def test_the_audit_names_the_detr_call_sites_with_counts(capsys):
    stock, inputs = detr_pair()
    stock.eval()
    with unread_weights_report(quiet=False) as report:
        for _ in range(3):
            stock(**inputs)
        site_stored(stock.self_attn, inputs["tgt"], inputs["tgt"], inputs["tgt"])  # weights kept: not listed
    forward = DetrStyleDecoderLayer.forward
    expected_lines = {line_of(forward, "self.self_attn("), line_of(forward, "attended = self.multihead_attn(")}
    assert {site.lineno for site in report.sites} == expected_lines
    assert all(site.calls == 3 for site in report.sites)
    assert all(site.filename == forward.__code__.co_filename for site in report.sites)
    assert all(site.function == "DetrStyleDecoderLayer.forward" for site in report.sites)
    printed = capsys.readouterr().err
    for site in report.sites:
        assert f"{site.filename}:{site.lineno} in DetrStyleDecoderLayer.forward: 3 calls" in printed
    assert "fix: pass need_weights=False" in printed


@needs_tested_bytecode
def test_the_audit_counts_slim_modules_that_compute_weights_and_not_those_that_skip():
    stock, inputs = detr_pair()
    computing = convert(copy.deepcopy(stock)).eval()
    skipping = convert(copy.deepcopy(stock), skip_unread_weights=True).eval()
    with unread_weights_report(quiet=True) as report:
        computing(**inputs)
    assert len(report.sites) == 2
    with unread_weights_report(quiet=True) as report:
        out = skipping(**inputs)
    assert report.sites == []
    assert_close_scaled(out, stock.eval()(**inputs))


@needs_tested_bytecode
def test_the_audit_nests_and_removes_its_hook():
    stock, _ = stock_and_slim()
    q, k, v = tokens()
    hooks_before = dict(torch.nn.modules.module._global_forward_hooks)
    stream = io.StringIO()
    with unread_weights_report(quiet=False, file=stream) as outer:
        site_subscript_zero(stock, q, k, v)
        with unread_weights_report(quiet=True) as inner:
            site_unpack_underscore(stock, q, k, v)
        site_subscript_zero(stock, q, k, v)
    assert [(s.function, s.calls) for s in outer.sites] == [("site_subscript_zero", 2), ("site_unpack_underscore", 1)]
    assert [(s.function, s.calls) for s in inner.sites] == [("site_unpack_underscore", 1)]
    assert dict(torch.nn.modules.module._global_forward_hooks) == hooks_before
    assert stream.getvalue().startswith("slim_mha: 2 call site(s) computed attention weights")


@needs_tested_bytecode
def test_an_empty_audit_says_so(capsys):
    _, slim = stock_and_slim()
    q, k, v = tokens()
    with unread_weights_report(quiet=False) as report:
        site_subscript_zero(slim, q, k, v)  # skipped: nothing computed, nothing to report
    assert report.sites == []
    assert "no attention call computed weights that its caller discarded" in capsys.readouterr().err


@needs_tested_bytecode
def test_the_report_is_printed_once_when_the_caller_prints_it(capsys):
    stock, _ = stock_and_slim()
    q, k, v = tokens()
    with unread_weights_report() as report:
        site_subscript_zero(stock, q, k, v)
    assert capsys.readouterr() == ("", "")  # the default prints nothing on exit
    print(report)
    printed = capsys.readouterr().out
    assert printed.count("site_subscript_zero") == 1 and "fix: pass need_weights=False" in printed


# ------------------------------------------------------------------------ the option's plumbing


def test_the_option_is_keyword_only_and_checked():
    parameter = inspect.signature(SlimMultiheadAttention.__init__).parameters["skip_unread_weights"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is False
    with pytest.raises(ValueError, match=r"^skip_unread_weights must be True or False, got 'yes'; pass a bool$"):
        SlimMultiheadAttention(E, H, skip_unread_weights="yes")
    with pytest.raises(ValueError, match=r"^skip_unread_weights must be True or False, got 1; pass a bool$"):
        convert(nn.Linear(2, 2), skip_unread_weights=1)
    message = r"^skip_unread_weights must be True, False or None \(no preference\), got 'on'$"
    with pytest.raises(ValueError, match=message):
        patch(skip_unread_weights="on")
    assert not slim_mha.is_patched()


def test_old_pickles_and_round_trips():
    _, slim = stock_and_slim()
    restored = pickle.loads(pickle.dumps(slim))
    assert restored.skip_unread_weights is True
    del slim.__dict__["skip_unread_weights"]  # as a module pickled before the option existed
    assert pickle.loads(pickle.dumps(slim)).skip_unread_weights is False


def test_patch_and_patched_set_the_default_for_modules_built():
    try:
        with patched(skip_unread_weights=True):
            assert nn.MultiheadAttention(E, H).skip_unread_weights is True
            assert nn.MultiheadAttention(E, H, skip_unread_weights=False).skip_unread_weights is False
            with patched():  # no preference: the outer one stands
                assert nn.MultiheadAttention(E, H).skip_unread_weights is True
                with patched(skip_unread_weights=False):
                    assert nn.MultiheadAttention(E, H).skip_unread_weights is False
            layer = nn.TransformerDecoderLayer(E, H, 32)
            assert layer.self_attn.skip_unread_weights and layer.multihead_attn.skip_unread_weights
        with patched():
            assert nn.MultiheadAttention(E, H).skip_unread_weights is False
        patch(skip_unread_weights=True)
        patch()  # idempotent: keeps its preference
        assert nn.MultiheadAttention(E, H).skip_unread_weights is True
    finally:
        unpatch()
    patch()
    try:
        assert nn.MultiheadAttention(E, H).skip_unread_weights is False
    finally:
        unpatch()
    assert not slim_mha.is_patched()
    assert inspect.signature(slim_mha.patching.PatchedMultiheadAttention).parameters.keys() == (
        inspect.signature(SlimMultiheadAttention).parameters.keys()
    )


def test_convert_sets_the_option_on_the_modules_it_builds():
    model = nn.Sequential(STOCK_MHA(E, H), STOCK_MHA(E, H))
    converted = convert(model, skip_unread_weights=True)
    assert all(m.skip_unread_weights for m in converted if isinstance(m, SlimMultiheadAttention))
    assert convert(STOCK_MHA(E, H)).skip_unread_weights is False


@needs_tested_bytecode
def test_a_wrong_skip_is_loud_not_a_wrong_number():
    """The documented residual: a C callable that caches the result hands a later reader None."""
    _, slim = stock_and_slim()
    q, k, v = tokens()
    cached = functools.lru_cache(maxsize=None)(slim)
    cached(q, k, v)[0]
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'sum'"):
        cached(q, k, v)[1].sum()
