"""The "stock ops" path: small calls with weights and without masks run stock's Python path op for
op, given ``[b_q; 0; b_v]`` (``choose_path`` names it, ``_slim_stock_ops`` runs it).

Its claim is equality, not closeness: with the same bias, its outputs, weights, strides, random
draws and gradients are those of ``F.multi_head_attention_forward``, bit for bit, over a seeded sweep
of shapes, layouts, input identities, modes and dtypes. Against stock itself (which adds ``q·b_k``)
it is as exact as stock, measured against a float64 run, and draws stock's dropout mask.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from slim_mha import SlimMultiheadAttention
from slim_mha._stock_checks import AttentionCall
from slim_mha.paths import choose_path

from _reference import (
    STOCK_MHA,
    assert_matches_stock,
    fast_path_enabled,
    float64_reference,
    randomize_parameters,
)


def _cases(count: int = 48) -> list[dict]:
    rng = random.Random(20261205)
    cases = []
    for index in range(count):
        heads, head_dim = rng.choice((1, 2, 4)), rng.choice((2, 4, 8))
        cases.append(
            {
                "id": index,
                "batch": rng.randint(1, 4),
                "length": rng.randint(1, 12),
                "source": rng.randint(1, 12),
                "heads": heads,
                "width": heads * head_dim,
                "batch_first": rng.random() < 0.5,
                "inputs": rng.choice(("self", "encoder-decoder", "three", "query is key")),
                "mode": rng.choice(("inference", "training", "training with dropout")),
                "average": rng.random() < 0.7,
                "dtype": rng.choice(("float32", "float32", "bfloat16", "autocast")),
            }
        )
    return cases


CASES = _cases()


def _tokens(case: dict, generator: torch.Generator, dtype: torch.dtype):
    batch, width = case["batch"], case["width"]

    def draw(length: int) -> torch.Tensor:
        shape = (batch, length, width) if case["batch_first"] else (length, batch, width)
        return torch.randn(shape, generator=generator).to(dtype)

    query = draw(case["length"])
    key = draw(case["source"])
    return {
        "self": (query, query, query),
        "encoder-decoder": (query, key, key),
        "three": (query, key, draw(case["source"])),
        "query is key": (query, query, draw(case["length"])),
    }[case["inputs"]]


def _modules(case: dict, dtype: torch.dtype):
    dropout = 0.3 if case["mode"] == "training with dropout" else 0.0
    stock = randomize_parameters(
        STOCK_MHA(case["width"], case["heads"], dropout=dropout, batch_first=case["batch_first"]), seed=case["id"]
    ).to(dtype)
    slim = SlimMultiheadAttention(case["width"], case["heads"], dropout=dropout, batch_first=case["batch_first"]).to(
        dtype
    )
    slim.load_state_dict(stock.state_dict())
    training = case["mode"] != "inference"
    return stock.train(training), slim.train(training)


def _stocks_function(slim: SlimMultiheadAttention, query, key, value, average: bool, key_padding_mask=None):
    """Stock's function itself, given the packed bias with its key slot zeroed (built here by ``cat``,
    not by slim's code), in stock's layout: its own transposes, keeping the inputs' identities."""
    width = slim.embed_dim
    bias = slim.in_proj_bias
    packed = torch.cat([bias[:width], torch.zeros_like(bias[width : 2 * width]), bias[2 * width :]])
    if slim.batch_first:
        transposed = {id(x): x.transpose(0, 1) for x in (query, key, value)}
        query, key, value = (transposed[id(x)] for x in (query, key, value))
    out, weights = F.multi_head_attention_forward(
        query,
        key,
        value,
        width,
        slim.num_heads,
        slim.in_proj_weight,
        packed,
        None,
        None,
        False,
        slim.dropout,
        slim.out_proj.weight,
        slim.out_proj.bias,
        training=slim.training,
        key_padding_mask=key_padding_mask,
        need_weights=True,
        average_attn_weights=average,
    )
    return (out.transpose(0, 1) if slim.batch_first else out), weights


def _same_gradients(slim: SlimMultiheadAttention, query, actual: tuple, expected: tuple) -> tuple:
    """The gradients of the query and every parameter, from both results' outputs and weights, equal
    bit for bit; returns slim's."""
    inputs = (query, *slim.parameters())
    gradients = torch.autograd.grad(actual[0].float().sum() + actual[1].float().sum(), inputs)
    expected_gradients = torch.autograd.grad(expected[0].float().sum() + expected[1].float().sum(), inputs)
    for mine, theirs in zip(gradients, expected_gradients):
        assert torch.equal(mine, theirs)
    return gradients


@pytest.mark.parametrize("case", CASES, ids=[f"{c['id']}-{c['inputs']}-{c['mode']}-{c['dtype']}" for c in CASES])
def test_equals_stocks_function_given_the_same_bias(case):
    dtype = torch.bfloat16 if case["dtype"] == "bfloat16" else torch.float32
    _, slim = _modules(case, dtype)
    query, key, value = _tokens(case, torch.Generator().manual_seed(case["id"]), dtype)
    before = [x.clone() for x in (query, key, value)]
    training = slim.training
    if training:
        query.requires_grad_(True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case["dtype"] == "autocast")
    with autocast:
        path, why = choose_path(slim, AttentionCall(query, key, value, None, True, None, case["average"], False))[:2]
        assert path == "stock ops", why
        torch.manual_seed(case["id"])
        out, weights = slim(query, key, value, average_attn_weights=case["average"])
        torch.manual_seed(case["id"])
        expected_out, expected_weights = _stocks_function(slim, query, key, value, case["average"])
    for actual, expected, what in ((out, expected_out, "output"), (weights, expected_weights, "weights")):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
        assert actual.stride() == expected.stride(), what
        assert torch.equal(actual, expected), what
    for x, original in zip((query, key, value), before):
        assert torch.equal(x.detach(), original)  # the inputs are never modified
    if not training:
        return
    gradients = _same_gradients(slim, query, (out, weights), (expected_out, expected_weights))
    width = slim.embed_dim
    assert not gradients[1 + [name for name, _ in slim.named_parameters()].index("in_proj_bias")][
        width : 2 * width
    ].any()


@pytest.mark.parametrize("case", CASES[:16], ids=[f"{c['id']}-{c['inputs']}-{c['mode']}" for c in CASES[:16]])
def test_as_exact_as_stock_against_a_float64_run(case):
    """Against stock module, whose added ``q·b_k`` rounds: outputs and weights within stock's own error."""
    stock, slim = _modules({**case, "mode": "inference"}, torch.float32)
    query, key, value = _tokens(case, torch.Generator().manual_seed(case["id"]), torch.float32)
    # Grad enabled, as in training: without a graph stock's kernel takes eval self-attention.
    assert (
        choose_path(slim, AttentionCall(query, key, value, None, True, None, case["average"], False))[0] == "stock ops"
    )
    actual = slim(query, key, value, average_attn_weights=case["average"])
    expected = stock(query, key, value, average_attn_weights=case["average"])
    reference = float64_reference(stock, query, key, value, average_attn_weights=case["average"])
    for a, e, r, what in zip(actual, expected, reference, ("output", "weights")):
        assert a.stride() == e.stride(), what
        assert_matches_stock(a, e, r, what)


@pytest.mark.parametrize("batch_first", [True, False])
def test_draws_stocks_dropout_mask(batch_first):
    """Training with attention dropout under one seed: the weights that dropout zeroed are stock's."""
    case = {"id": 7, "width": 16, "heads": 4, "batch_first": batch_first, "mode": "training with dropout"}
    stock, slim = _modules(case, torch.float32)
    x = torch.randn(3, 10, 16) if batch_first else torch.randn(10, 3, 16)
    torch.manual_seed(3)
    _, expected = stock(x, x, x, average_attn_weights=False)
    torch.manual_seed(3)
    _, actual = slim(x, x, x, average_attn_weights=False)
    assert (expected == 0).any() and torch.equal(actual == 0, expected == 0)


def _padding(case: dict, generator: torch.Generator) -> torch.Tensor:
    """A bool padding mask ``(B, S)`` under which every query sees a key (key 0 stays open)."""
    padding = (
        torch.rand(
            case["batch"],
            case["source"] if case["inputs"] in ("encoder-decoder", "three") else case["length"],
            generator=generator,
        )
        < 0.4
    )
    padding[:, 0] = False
    return padding


@pytest.mark.parametrize("case", CASES, ids=[f"{c['id']}-{c['inputs']}-{c['mode']}-{c['dtype']}" for c in CASES])
def test_with_a_padding_mask_equals_stocks_function_given_the_same_bias(case):
    """A bool padding mask goes into the product as stock adds it: outputs, weights, strides, random
    draws and gradients are ``F.multi_head_attention_forward``'s with the same mask, bit for bit."""
    dtype = torch.bfloat16 if case["dtype"] == "bfloat16" else torch.float32
    _, slim = _modules(case, dtype)
    generator = torch.Generator().manual_seed(case["id"])
    query, key, value = _tokens(case, generator, dtype)
    padding = _padding(case, generator)
    if case["mode"] != "inference":
        query.requires_grad_(True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case["dtype"] == "autocast")
    with autocast:
        call = AttentionCall(query, key, value, padding, True, None, case["average"], False)
        path, why = choose_path(slim, call)[:2]
        assert path == "stock ops", why
        torch.manual_seed(case["id"])
        out, weights = slim(query, key, value, key_padding_mask=padding, average_attn_weights=case["average"])
        torch.manual_seed(case["id"])
        expected_out, expected_weights = _stocks_function(slim, query, key, value, case["average"], padding)
    for actual, expected, what in ((out, expected_out, "output"), (weights, expected_weights, "weights")):
        assert actual.stride() == expected.stride(), what
        assert torch.equal(actual, expected), what
    if case["mode"] != "inference":
        _same_gradients(slim, query, (out, weights), (expected_out, expected_weights))


@pytest.mark.parametrize("case", CASES[:16], ids=[f"{c['id']}-{c['inputs']}-{c['mode']}" for c in CASES[:16]])
def test_with_a_padding_mask_as_exact_as_stock_against_a_float64_run(case):
    """Against stock's module itself (which adds ``q·b_k``), with the same bool padding mask: within
    stock's own error against a float64 run."""
    stock, slim = _modules({**case, "mode": "inference"}, torch.float32)
    generator = torch.Generator().manual_seed(case["id"])
    query, key, value = _tokens(case, generator, torch.float32)
    padding = _padding(case, generator)
    call = AttentionCall(query, key, value, padding, True, None, case["average"], False)
    assert choose_path(slim, call).path == "stock ops"  # grad enabled, as in training
    options = dict(key_padding_mask=padding, average_attn_weights=case["average"])
    actual = slim(query, key, value, **options)
    expected = stock(query, key, value, **options)
    reference = float64_reference(stock, query, key, value, **options)
    for a, e, r, what in zip(actual, expected, reference, ("output", "weights")):
        assert a.stride() == e.stride(), what
        assert_matches_stock(a, e, r, what)


def test_a_query_that_sees_no_key_or_another_mask_leaves_stocks_ops():
    """Stock's ops turn a row masked from every key to NaN: such calls take slim's own path (zeros),
    and so do float padding masks, attention masks and masks of another shape."""
    case = {"id": 3, "width": 16, "heads": 4, "batch_first": True, "mode": "training"}
    _, slim = _modules(case, torch.float32)
    x = torch.randn(2, 6, 16, requires_grad=True)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1] = True  # the second sequence sees no key
    assert choose_path(slim, AttentionCall(x, x, x, padding, True, None, True, False)).path == "general"
    out, weights = slim(x, x, x, key_padding_mask=padding)
    assert torch.isfinite(out).all() and not weights[1].any()
    open_padding = torch.zeros(2, 6, dtype=torch.bool)
    for mask, attn_mask in (
        (open_padding.float(), None),
        (None, torch.zeros(6, 6, dtype=torch.bool)),
        (torch.zeros(2, 5, dtype=torch.bool), None),
    ):
        assert choose_path(slim, AttentionCall(x, x, x, mask, True, attn_mask, True, False)).path == "general"
    assert choose_path(slim, AttentionCall(x, x, x, open_padding, True, None, True, False)).path == "stock ops"


@pytest.mark.parametrize("batch", [3, 4, 5])  # scores of 192, 256 and 320 KiB: the limit is 256 KiB (fp32)
@pytest.mark.parametrize("mask", ["bool", "float", "bool with a row that sees no key"])
def test_one_answer_on_both_sides_of_stock_ops_limit_with_a_padding_mask(batch, mask):
    """Below the limit stock's ops run (bool masks under which every query sees a key), above it
    slim's own path: both give stock's function with its fast path off, within stock's rounding, and
    a query masked from every key gets zero weights and no value (stock gives NaN there) on either side."""
    case = {"id": 11, "width": 16, "heads": 4, "batch_first": True, "mode": "training"}
    stock, slim = _modules(case, torch.float32)
    x = torch.randn(batch, 64, 16, generator=torch.Generator().manual_seed(batch), requires_grad=True)
    padding = torch.zeros(batch, 64, dtype=torch.bool)
    padding[::2, 48:] = True
    if mask == "bool with a row that sees no key":
        padding[1] = True
    given = padding if mask != "float" else torch.zeros(batch, 64).masked_fill(padding, float("-inf"))
    path = choose_path(slim, AttentionCall(x, x, x, given, True, None, True, False)).path
    assert path == ("stock ops" if batch <= 4 and mask == "bool" else "general")
    out, weights = slim(x, x, x, key_padding_mask=given)
    with fast_path_enabled(False):
        expected = stock(x, x, x, key_padding_mask=given)
        reference = float64_reference(stock, x, x, x, key_padding_mask=given)
    seen = ~padding.all(dim=-1)  # the sequences whose queries see some key
    for a, e, r, what in zip((out, weights), expected, reference, ("output", "weights")):
        assert_matches_stock(a[seen], e[seen], r[seen], what)
    # Where stock gives NaN: no key's value reaches the row, so it holds out_proj's bias, and zero weights.
    assert torch.equal(out[~seen], slim.out_proj.bias.detach().expand_as(out[~seen])) and not weights[~seen].any()


@pytest.mark.parametrize("source", [96, 160, 640])  # cross: scores of 192 KiB, 320 KiB, 1.25 MiB; the limit: 256 KiB
@pytest.mark.parametrize("inputs", ["three", "encoder-decoder", "query is key"])
@pytest.mark.parametrize("mode", ["inference", "training with dropout"])
def test_sequence_first_cross_attention_keeps_stocks_ops_past_the_limit(source, inputs, mode):
    """DETR's decoder: sequence-first cross-attention with weights and a padding mask (and any call
    whose query, key and value are not one tensor) takes stock's ops past their limit for other calls
    (up to 4 MiB of fp32 scores), and equals stock's function given the same bias,
    bit for bit (outputs, weights, strides, dropout draws, gradients). Batch-first cross-attention and
    sequence-first self-attention keep the limit: past it they take slim's own path."""
    if inputs == "query is key":  # as many queries as keys, 3.1 MiB of scores at most (the limit: 4 MiB)
        source = min(source, 320)
    length = source if inputs == "query is key" else 64
    case = {"id": source, "batch": 2, "length": length, "source": source, "heads": 4, "width": 16}
    case.update(batch_first=False, inputs=inputs, mode=mode)
    _, slim = _modules(case, torch.float32)
    generator = torch.Generator().manual_seed(source)
    query, key, value = _tokens(case, generator, torch.float32)
    padding = _padding(case, generator)
    query.requires_grad_(mode != "inference")
    call = AttentionCall(query, key, value, padding, True, None, True, False)
    with torch.no_grad() if mode == "inference" else torch.enable_grad():
        assert choose_path(slim, call).path == "stock ops"
        torch.manual_seed(source)
        out, weights = slim(query, key, value, key_padding_mask=padding)
        torch.manual_seed(source)
        expected = _stocks_function(slim, query, key, value, True, padding)
    for actual, wanted, what in ((out, expected[0], "output"), (weights, expected[1], "weights")):
        assert actual.stride() == wanted.stride(), what
        assert torch.equal(actual, wanted), what
    if mode != "inference":
        _same_gradients(slim, query, (out, weights), expected)
    past = 2 * 4 * length * source * 4 > 256 << 10  # B·H·L·S fp32 scores above stock's ops' limit
    batch_first = SlimMultiheadAttention(16, 4, batch_first=True).train(slim.training)
    transposed = {id(x): x.transpose(0, 1) for x in (query, key, value)}  # the call's identities kept
    swapped = AttentionCall(*(transposed[id(x)] for x in (query, key, value)), padding, True, None, True, False)
    assert choose_path(batch_first, swapped).path == ("general" if past else "stock ops")
    itself = torch.randn(96, 2, 16, requires_grad=True)  # self-attention: scores of 288 KiB, past the limit
    own = AttentionCall(itself, itself, itself, torch.zeros(2, 96, dtype=torch.bool), True, None, True, False)
    assert choose_path(slim, own).path == "general"


def test_sequence_first_cross_attention_leaves_stocks_ops_past_its_own_limit_or_where_a_row_sees_no_key():
    """Past STOCK_OPS_SEQUENCE_FIRST_MAX_SCORE_BYTES (4 MiB of fp32 scores) slim's own path is the
    faster, and a row masked from every key takes it at any size: there it gives stock's answer for
    the other rows and zeros for that one (stock gives NaN)."""
    case = {"id": 5, "batch": 2, "length": 64, "source": 640, "heads": 4, "width": 16}
    case.update(batch_first=False, inputs="three", mode="inference")
    stock, slim = _modules(case, torch.float32)
    generator = torch.Generator().manual_seed(5)
    query, key, value = _tokens(case, generator, torch.float32)
    padding = _padding(case, generator)
    call = AttentionCall(query, key, value, padding, True, None, True, False)
    assert choose_path(slim, call).path == "stock ops"  # 1.25 MiB
    longer = torch.randn(2100, 2, 16, generator=generator)  # 2·4·64·2100·4 bytes: 4.1 MiB
    longer_padding = torch.zeros(2, 2100, dtype=torch.bool)
    assert choose_path(
        slim, AttentionCall(query, longer, longer + 1, longer_padding, True, None, True, False)
    ).path == ("general")
    padding[1] = True  # the second sequence sees no key
    assert choose_path(slim, call._replace(key_padding_mask=padding)).path == "general"
    with torch.no_grad():
        out, weights = slim(query, key, value, key_padding_mask=padding)
        expected = stock(query, key, value, key_padding_mask=padding)
        reference = float64_reference(stock, query, key, value, key_padding_mask=padding)
    assert_matches_stock(out[:, 0], expected[0][:, 0], reference[0][:, 0], "output")
    assert_matches_stock(weights[0], expected[1][0], reference[1][0], "weights")
    assert torch.equal(out[:, 1], slim.out_proj.bias.detach().expand_as(out[:, 1])) and not weights[1].any()


@pytest.mark.parametrize("source", [2000, 2100])  # 3.9 MiB and 4.1 MiB of fp32 scores: the limit is 4 MiB
@pytest.mark.parametrize("mask", ["bool", "float", "bool with a row that sees no key"])
def test_one_answer_on_both_sides_of_the_sequence_first_limit(source, mask):
    """DETR's cross-attention on either side of STOCK_OPS_SEQUENCE_FIRST_MAX_SCORE_BYTES: stock's ops
    below it (bool masks under which every query sees a key), slim's own path above it and for every
    other mask. Both give stock's function with its fast path off, within stock's rounding against a
    float64 run, and a query masked from every key gets zero weights and no value (stock: NaN)."""
    case = {"id": 13, "width": 16, "heads": 4, "batch_first": False, "mode": "training"}
    stock, slim = _modules(case, torch.float32)
    generator = torch.Generator().manual_seed(source)
    query = torch.randn(64, 2, 16, generator=generator, requires_grad=True)
    memory = torch.randn(source, 2, 16, generator=generator)
    key = memory + torch.randn(source, 2, 16, generator=generator)
    padding = torch.zeros(2, source, dtype=torch.bool)
    padding[1, int(source * 0.85) :] = True
    if mask == "bool with a row that sees no key":
        padding[1] = True
    given = padding if mask != "float" else torch.zeros(2, source).masked_fill(padding, float("-inf"))
    path = choose_path(slim, AttentionCall(query, key, memory, given, True, None, True, False)).path
    assert path == ("stock ops" if source == 2000 and mask == "bool" else "general")
    out, weights = slim(query, key, memory, key_padding_mask=given)
    with fast_path_enabled(False):
        expected = stock(query, key, memory, key_padding_mask=given)
        reference = float64_reference(stock, query, key, memory, key_padding_mask=given)
    seen = ~padding.all(dim=-1)  # the batch rows whose queries see some key
    assert_matches_stock(out[:, seen], expected[0][:, seen], reference[0][:, seen], "output")
    assert_matches_stock(weights[seen], expected[1][seen], reference[1][seen], "weights")
    assert torch.equal(out[:, ~seen], slim.out_proj.bias.detach().expand_as(out[:, ~seen])) and not weights[~seen].any()
    (out.sum() + weights.sum()).backward()
    assert torch.isfinite(query.grad).all()
