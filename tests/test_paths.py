"""``choose_path``, the one owner of the path a call takes, over a table of calls; and parity by
construction: where slim runs stock's own kernel, the profiler sees the same op as for stock."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from slim_mha import SlimMultiheadAttention
from slim_mha._stock_checks import AttentionCall
from slim_mha.paths import choose_path

from _reference import (
    STOCK_MHA,
    assert_matches_stock,
    float64_reference,
    randomize_parameters,
)

E, H = 16, 4


def module(**options) -> SlimMultiheadAttention:
    options = {"batch_first": True, **options}
    heads = options.pop("heads", H)
    return SlimMultiheadAttention(E, heads, **options).eval()


def call(query, key=None, value=None, *, need_weights=True, **masks) -> AttentionCall:
    key = query if key is None else key
    value = key if value is None else value
    return AttentionCall(
        query,
        key,
        value,
        masks.get("key_padding_mask"),
        need_weights,
        masks.get("attn_mask"),
        True,
        masks.get("is_causal", False),
    )


SMALL = torch.randn(2, 6, E)
LARGE = torch.randn(8, 200, E)  # 8·4·200·200 scores: above what stock's Python path is kept for
OTHER = torch.randn(2, 9, E)
PADDING = torch.zeros(2, 6, dtype=torch.bool)

TABLE = [
    # (what, module options, the call, grad, autocast, the path)
    ("stock's default call", {}, call(SMALL), False, False, "stock kernel"),
    (
        "stock's default call, sequence-first",
        {"batch_first": False},
        call(SMALL.transpose(0, 1)),
        False,
        False,
        "stock kernel",
    ),
    ("small, without weights (fp32)", {}, call(SMALL, need_weights=False), False, False, "stock kernel"),
    ("large, without weights", {}, call(LARGE, need_weights=False), False, False, "sdpa"),
    ("small, without weights, odd heads", {"heads": 1}, call(SMALL, need_weights=False), False, False, "sdpa"),
    ("small cross-attention with weights, batch-first, no graph", {}, call(SMALL, OTHER), False, False, "stock ops"),
    (
        "cross-attention with weights, batch-first, no graph, 64 KiB of scores (slim's one pass)",
        {},
        call(torch.randn(4, 32, E), torch.randn(4, 32, E)),
        False,
        False,
        "general",
    ),
    ("the same, 32 KiB", {}, call(torch.randn(2, 32, E), torch.randn(2, 32, E)), False, False, "stock ops"),
    (
        "the same, 64 KiB, training with a graph",
        {},
        call(torch.randn(4, 32, E), torch.randn(4, 32, E)),
        True,
        False,
        "stock ops",
    ),
    (
        "small cross-attention with weights, batch-first, training with a graph",
        {},
        call(SMALL, OTHER),
        True,
        False,
        "stock ops",
    ),
    (
        "small cross-attention with weights, sequence-first",
        {"batch_first": False},
        call(SMALL.transpose(0, 1), OTHER.transpose(0, 1)),
        False,
        False,
        "stock ops",
    ),
    (
        "small, three inputs, with weights, sequence-first",
        {"batch_first": False},
        call(SMALL.transpose(0, 1), OTHER.transpose(0, 1), OTHER.transpose(0, 1).clone()),
        False,
        False,
        "stock ops",
    ),
    ("small, with weights, training with a graph", {}, call(SMALL), True, False, "stock ops"),
    ("small, with weights, attention dropout", {"dropout": 0.5}, call(SMALL), True, False, "stock ops"),
    (
        "small, with weights, odd heads, sequence-first",
        {"heads": 1, "batch_first": False},
        call(SMALL.transpose(0, 1), OTHER.transpose(0, 1)),
        False,
        False,
        "stock ops",
    ),
    ("small, with weights, under autocast on the CPU, training", {}, call(SMALL, OTHER), True, True, "stock ops"),
    (
        "small, with weights, in fp16 (not measured)",
        {"dtype": torch.float16},
        call(SMALL.half(), OTHER.half()),
        False,
        False,
        "general",
    ),
    (
        "small, with weights, a bool padding mask: stock's ops add it as stock does",
        {},
        call(SMALL, OTHER, key_padding_mask=torch.zeros(2, 9, dtype=torch.bool)),
        False,
        False,
        "stock ops",
    ),
    (
        "small, with weights, a float padding mask",
        {},
        call(SMALL, OTHER, key_padding_mask=torch.zeros(2, 9)),
        False,
        False,
        "general",
    ),
    (
        "small, with weights, a causal mask",
        {},
        call(SMALL, attn_mask=torch.ones(6, 6).triu(1).bool(), is_causal=True),
        True,
        False,
        "general",
    ),
    (
        "small, with weights, kdim and vdim",
        {"kdim": 8, "vdim": 8},
        call(SMALL, torch.randn(2, 9, 8)),
        False,
        False,
        "general",
    ),
    (
        "small, with weights, keys of another batch (stock's error)",
        {},
        call(SMALL, torch.randn(3, 9, E)),
        False,
        False,
        "general",
    ),
    (
        "small, with weights, keys and values of other lengths (stock's error)",
        {},
        call(SMALL, OTHER, torch.randn(2, 8, E)),
        False,
        False,
        "general",
    ),
    (
        "cross-attention with weights, 256 KiB of fp32 scores: the largest stock's ops take batch-first",
        {"batch_first": True},
        call(torch.randn(4, 64, E), torch.randn(4, 64, E)),
        True,
        False,
        "stock ops",
    ),
    (
        "batch-first cross-attention with weights, one key more",
        {"batch_first": True},
        call(torch.randn(4, 64, E), torch.randn(4, 65, E)),
        True,
        False,
        "general",
    ),
    (
        "sequence-first cross-attention with weights, one key more: stock's ops past their limit (DETR)",
        {"batch_first": False},
        call(torch.randn(64, 4, E), torch.randn(65, 4, E)),
        False,
        False,
        "stock ops",
    ),
    (
        "medium cross-attention with weights, sequence-first (DETR)",
        {"batch_first": False},
        call(torch.randn(64, 8, E), torch.randn(64, 8, E)),
        False,
        False,
        "stock ops",
    ),
    (
        "medium self-attention with weights, sequence-first, in training",
        {"batch_first": False},
        call(torch.randn(64, 8, E)),
        True,
        False,
        "general",
    ),
    ("under autocast, cross-attention", {}, call(SMALL, OTHER, need_weights=False), False, True, "general"),
    (
        "under autocast on the CPU, stock's default call (stock: its fp32 kernel)",
        {},
        call(LARGE, need_weights=False),
        False,
        True,
        "stock kernel",
    ),
    ("large cross-attention with weights", {}, call(LARGE, torch.randn(8, 200, E)), False, False, "general"),
    (
        "self-attention with a padding mask, eval (stock: its kernel; slim too, given stock's merged mask)",
        {},
        call(SMALL, key_padding_mask=PADDING),
        False,
        False,
        "stock kernel",
    ),
    ("large, without weights, with a graph", {}, call(LARGE, need_weights=False), True, False, "general"),
    ("appended tokens", {"add_bias_kv": True}, call(SMALL), False, False, "general"),
    # The check follows the path the call takes, so that checking changes no output.
    ("the equivariance check", {"check_equivariance": True}, call(SMALL), False, False, "stock kernel"),
    ("an unbatched input", {}, call(SMALL[0]), False, False, "general"),
    (
        "nested tensors",
        {},
        call(torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)])),
        False,
        False,
        "nested",
    ),
]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("what,options,the_call,grad,autocast,path", TABLE, ids=[row[0] for row in TABLE])
def test_the_path_each_call_takes(what, options, the_call, grad, autocast, path):
    attention = module(**options)
    if grad:
        attention.train()
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        chosen, why = choose_path(attention, the_call)[:2]
    assert chosen == path, why
    assert (why == "") == (path != "general"), why  # slim's own path names why no shorter one applies


@pytest.mark.parametrize("case", ["cross", "training", "masked, sequence-first"])
def test_under_autocast_slims_own_path_is_as_exact_as_stock(case, slims_own_paths):
    """Where stock runs its Python path under autocast, slim runs its own: outputs and weights against a
    float64 run (bf16 rounds stock's added q·b_k, so neither is exact), no gradient into the key slot."""
    batch_first = case != "masked, sequence-first"
    stock = randomize_parameters(STOCK_MHA(E, H, batch_first=batch_first))
    slim = SlimMultiheadAttention(E, H, batch_first=batch_first)
    slim.load_state_dict(stock.state_dict())
    train = case == "training"
    stock.train(train), slim.train(train)
    query = SMALL if batch_first else SMALL.transpose(0, 1)
    key = OTHER if batch_first else OTHER.transpose(0, 1)
    masks = {"key_padding_mask": torch.zeros(2, 9, dtype=torch.bool)} if case.startswith("masked") else {}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with autocast, torch.set_grad_enabled(train):
        assert choose_path(slim, call(query, key, **masks))[0] == "general"
        expected, actual = stock(query, key, key, **masks), slim(query, key, key, **masks)
    with torch.no_grad():
        reference = float64_reference(stock, query, key, key, **masks)
    for a, e, r in zip(actual, expected, reference):
        assert_matches_stock(a, e, r)
    if train:
        (actual[0].float().sum() + actual[1].float().sum()).backward()
        assert torch.equal(slim.in_proj_bias.grad[E : 2 * E], torch.zeros(E))


def _aten_ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        fn()
    return {event.name for event in profiler.events()}


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_stocks_default_call_runs_stocks_native_kernel_for_slim_too(need_weights, autocast):
    """Parity by construction: the profiler sees ``aten::_native_multi_head_attention`` in both calls,
    under CPU autocast too (stock's fast-path test reads CUDA's autocast alone)."""
    stock = randomize_parameters(STOCK_MHA(E, H, batch_first=True)).eval()
    slim = SlimMultiheadAttention(E, H, batch_first=True).eval()
    slim.load_state_dict(stock.state_dict())
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for attention in (stock, slim):
            ops = _aten_ops(lambda attention=attention: attention(SMALL, SMALL, SMALL, need_weights=need_weights))
            assert "aten::_native_multi_head_attention" in ops, sorted(ops)
        # and the same outputs: stock's kernel on both sides (autocast rounds stock's added q·b_k, so
        # under it both are measured against a float64 run)
        expected, actual = (
            stock(SMALL, SMALL, SMALL, need_weights=need_weights),
            slim(SMALL, SMALL, SMALL, need_weights=need_weights),
        )
    with torch.no_grad():
        reference = float64_reference(stock, SMALL, SMALL, SMALL, need_weights=need_weights)
    for a, e, r in zip(actual, expected, reference):
        if e is None:
            assert a is None
        else:
            assert a.dtype == e.dtype and a.stride() == e.stride()
            assert_matches_stock(a, e, r)
