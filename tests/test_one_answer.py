"""One model, one answer, whatever its length: stock's documented function, what stock computes with its
fast path off, on every path slim takes.

Stock's fused encoder kernel departs from that function in a few places (it reads a float mask as a
bool one, turns a row masked from every key to NaN, ignores appended tokens, an attention ``forward``
of its own, live dropout, overridden blocks and a tanh GELU). Slim gives the function there at every
length, across both of its thresholds (``FUSED_LAYER_MAX_LENGTH``: 96 with a mask, 384 without). A
row masked from every key gets SDPA's answer on every path: a zero row, zero weights, finite gradients.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import slim_mha
from slim_mha import encoder_layer
from slim_mha._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA, sdpa_zeroes_rows_masked_from_every_key

from _reference import randomize_parameters

E, H, FF, B = 32, 4, 64, 2
LENGTHS = [16, 96, 97, 383, 384, 385, 600]  # both sides of each of slim's thresholds


def reference(module: nn.Module, *args, **kwargs):
    """Stock's documented function: ``module`` called with the fast path off."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        return module(*args, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


class ScaledAttention(STOCK_MHA):
    """A user's attention with a forward of its own, which stock's fused kernel never calls."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return 0.9 * out, weights


class SlimScaledAttention(slim_mha.SlimMultiheadAttention):
    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return 0.9 * out, weights


class DoubledFeedForward(STOCK_ENCODER_LAYER):
    """A user's layer with a feed-forward block of its own, which stock's fused kernel never calls."""

    def _ff_block(self, x: Tensor) -> Tensor:
        return 2.0 * super()._ff_block(x)


class SlimDoubledFeedForward(encoder_layer.SlimTransformerEncoderLayer):
    def _ff_block(self, x: Tensor) -> Tensor:
        return 2.0 * super()._ff_block(x)


def layers(case: str) -> tuple[nn.Module, nn.Module]:
    """Stock's layer and slim's, same weights (every bias non-zero), in eval: one ``case`` of the sweep."""
    torch.manual_seed(0)
    kwargs: dict = dict(dim_feedforward=FF, dropout=0.0, batch_first=True)
    if case == "tanh gelu":
        kwargs["activation"] = nn.GELU(approximate="tanh")
    if case in ("mc dropout", "dropout module"):
        kwargs["dropout"] = 0.3
    stock = (DoubledFeedForward if case == "own feed-forward" else STOCK_ENCODER_LAYER)(E, H, **kwargs)
    if case in ("bias_kv", "zero_attn"):
        stock.self_attn = STOCK_MHA(
            E, H, batch_first=True, add_bias_kv=case == "bias_kv", add_zero_attn=case == "zero_attn"
        )
    randomize_parameters(stock, scale=0.3)
    slim = slim_mha.convert(copy.deepcopy(stock))
    if case == "own feed-forward":  # a user's subclass of slim's layer (convert leaves stock's subclasses)
        slim = SlimDoubledFeedForward(E, H, **kwargs)
        slim.load_state_dict(stock.state_dict())
    if case == "own attention forward":
        stock.self_attn = ScaledAttention(E, H, batch_first=True)
        slim.self_attn = SlimScaledAttention(E, H, batch_first=True)
        randomize_parameters(stock.self_attn, seed=1, scale=0.3)
        slim.self_attn.load_state_dict(stock.self_attn.state_dict())
    stock.eval(), slim.eval()
    if case == "mc dropout":
        stock.self_attn.train(), slim.self_attn.train()
    if case == "dropout module":
        stock.dropout1.train(), slim.dropout1.train()
    return stock, slim


def masks(case: str, length: int) -> dict:
    i = torch.arange(length, dtype=torch.float32)
    padding = torch.zeros(B, length, dtype=torch.bool)
    padding[1, length // 2 :] = True
    if case == "alibi mask":
        return {"src_mask": -0.1 * (i[:, None] - i[None]).abs()}
    if case == "float 0/1 padding":
        return {"src_key_padding_mask": padding.float()}
    if case == "soft padding bias":
        return {"src_key_padding_mask": -0.5 * padding.float()}
    if case == "empty padding row":
        full = padding.clone()
        full[1] = True
        return {"src_key_padding_mask": full}
    if case == "empty attention row":
        rows = torch.zeros(length, length, dtype=torch.bool)
        rows[3] = True
        return {"src_mask": rows, "src_key_padding_mask": padding}
    return {"src_key_padding_mask": padding}


DEPARTURES = [
    "alibi mask",
    "float 0/1 padding",
    "soft padding bias",
    "empty padding row",
    "empty attention row",
    "bias_kv",
    "zero_attn",
    "own attention forward",
    "own feed-forward",
    "mc dropout",
    "dropout module",
    "tanh gelu",
]


def empty_rows(given: dict, length: int) -> Tensor:
    """``(B, L)``: True where a query is masked from every key."""
    rows = torch.zeros(B, length, dtype=torch.bool)
    padding = given.get("src_key_padding_mask")
    if padding is not None and padding.dtype == torch.bool:
        rows |= padding.all(-1, keepdim=True)
    attn = given.get("src_mask")
    if attn is not None and attn.dtype == torch.bool:
        rows |= (attn[None] | (padding[:, None, :] if padding is not None else False)).all(-1)
    return rows


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("case", DEPARTURES)
def test_where_the_fused_kernel_departs_slims_layer_gives_stocks_function_at_every_length(case, length):
    stock, slim = layers(case)
    x = torch.randn(B, length, E, generator=torch.Generator().manual_seed(length))
    given = masks(case, length)
    with torch.no_grad():
        torch.manual_seed(3)
        expected = reference(stock, x, **given)
        torch.manual_seed(3)
        actual = slim(x, **given)
        assert encoder_layer.why_the_fused_kernel_departs(
            slim, x, given.get("src_mask"), given.get("src_key_padding_mask")
        )
    assert torch.isfinite(actual).all()
    # Stock's own function gives a row masked from every key zeros only where its SDPA does (torch
    # 2.13 does, 2.4 gives NaN): the rows are compared where stock's are finite, and all of them there.
    keep = ~empty_rows(given, length) if not sdpa_zeroes_rows_masked_from_every_key() else slice(None)
    torch.testing.assert_close(actual[keep], expected[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", LENGTHS)
def test_a_float_mask_of_another_dtype_gets_the_kernels_reading_at_every_length(length):
    """Stock's unfused forward refuses a float64 mask beside float32 inputs; its kernel reads it as a
    bool mask (non-zero: masked) and returns. Slim returns that at every length."""
    stock, slim = layers("plain")
    x = torch.randn(B, length, E, generator=torch.Generator().manual_seed(length))
    causal = torch.from_numpy(np.triu(np.full((length, length), -np.inf), 1))
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            reference(stock, x, src_mask=causal)
        expected = stock(x, src_mask=causal)  # stock fuses at every length: the kernel's answer
        torch.testing.assert_close(slim(x, src_mask=causal), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(expected, stock(x, src_mask=causal != 0), rtol=0, atol=0)


@pytest.mark.parametrize("length", [16, 97, 385])
def test_plain_calls_still_take_the_kernel_or_slims_layer(length):
    """The rule costs the calls it does not concern nothing but the masks' read: a bool padding mask
    with no empty row still takes stock's kernel or slim's layer, as before."""
    _, slim = layers("plain")
    x = torch.randn(B, length, E)
    given = masks("plain", length)
    with torch.no_grad():
        path, why = encoder_layer.layer_path(slim, x, None, given["src_key_padding_mask"])
        assert encoder_layer.why_the_fused_kernel_departs(slim, x, None, given["src_key_padding_mask"]) == ""
    assert path == ("stock fused layer" if length <= 96 else "slim layer"), why


def test_each_departure_is_named_in_explain():
    stock, slim = layers("empty padding row")
    x = torch.randn(B, 16, E)
    with torch.no_grad():
        report = slim_mha.explain(slim, x, **masks("empty padding row", 16))
    rows = [row for row in report if row.kind == "encoder layer"]
    assert [row.path for row in rows] == ["unfused layer"] and "masked from every key" in rows[0].why


# ------------------------------------------------------------------ a row masked from every key


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("mode", ["eval", "train", "eval with grad"])
@pytest.mark.parametrize("mask", ["padding", "attention"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_a_row_masked_from_every_key_is_zero_on_every_attention_path(need_weights, average, mode, mask, batch_first):
    """Zero output before the output projection (so ``out_proj.bias`` after it), zero weights and
    finite gradients; the other rows are stock's."""
    torch.manual_seed(0)
    stock = randomize_parameters(STOCK_MHA(E, H, batch_first=batch_first), scale=0.3)
    slim = slim_mha.convert(copy.deepcopy(stock))
    stock.train(mode == "train"), slim.train(mode == "train")
    L = 12
    x = torch.randn(B, L, E) if batch_first else torch.randn(L, B, E)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[0, 5:] = True
    attn = None
    if mask == "padding":
        padding[1] = True  # every query of sample 1 sees no key
        empty = torch.tensor([[False] * L, [True] * L])
    else:
        attn = torch.zeros(L, L, dtype=torch.bool)
        attn[4] = True  # query 4 sees no key
        empty = torch.zeros(B, L, dtype=torch.bool)
        empty[:, 4] = True
    leaf = x.clone().requires_grad_(mode != "eval")
    with torch.set_grad_enabled(mode != "eval"):
        out, weights = slim(
            leaf,
            leaf,
            leaf,
            key_padding_mask=padding,
            attn_mask=attn,
            need_weights=need_weights,
            average_attn_weights=average,
        )
        expected = reference(
            stock,
            x,
            x,
            x,
            key_padding_mask=padding,
            attn_mask=attn,
            need_weights=need_weights,
            average_attn_weights=average,
        )
    batch_major = out if batch_first else out.transpose(0, 1)  # (B, L, E)
    assert torch.equal(batch_major[empty], stock.out_proj.bias.detach().expand(int(empty.sum()), E))
    if need_weights:
        rows = weights if average else weights.transpose(1, 2)  # (B, L, S) or (B, L, H, S)
        assert torch.equal(rows[empty], torch.zeros_like(rows[empty]))
    expected_major = expected[0] if batch_first else expected[0].transpose(0, 1)
    torch.testing.assert_close(batch_major[~empty], expected_major[~empty], rtol=1e-5, atol=1e-5)
    if mode != "eval":
        out.sum().backward()
        assert torch.isfinite(leaf.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in slim.parameters() if p.grad is not None)


# ------------------------------------------------------------------------------------- recording


@pytest.mark.parametrize("length", [16, 200])
@pytest.mark.parametrize("padded", [False, True])
def test_recording_changes_no_output_of_an_encoder_layer(length, padded):
    """Bit for bit: the maps are computed beside the call, which runs the path it runs unrecorded."""
    _, slim = layers("plain")
    x = torch.randn(B, length, E)
    given = masks("plain", length) if padded else {}
    with torch.no_grad():
        unrecorded = slim(x, **given)
        with slim_mha.recording_attention(slim) as maps:
            recorded = slim(x, **given)
        stock_weights = reference(slim.self_attn, x, x, x, key_padding_mask=given.get("src_key_padding_mask"))[1]
    assert torch.equal(recorded, unrecorded)
    (the_map,) = maps["self_attn"]
    torch.testing.assert_close(the_map, stock_weights, rtol=1e-5, atol=1e-6)


def test_a_block_records_the_calls_of_its_own_thread_alone():
    _, slim = layers("plain")
    x = torch.randn(B, 16, E)
    started, release = threading.Event(), threading.Event()

    def other_thread():
        started.set()
        release.wait(5)
        with torch.no_grad():
            for _ in range(5):
                slim(x)

    worker = threading.Thread(target=other_thread)
    worker.start()
    started.wait(5)
    with torch.no_grad(), slim_mha.recording_attention(slim) as maps:
        release.set()
        worker.join(10)
        slim(x)
    assert len(maps["self_attn"]) == 1


def test_a_compiled_model_inside_a_block_raises_one_line_naming_torch_compile():
    pytest.importorskip("torch._dynamo")
    _, slim = layers("plain")
    x = torch.randn(B, 16, E)
    compiled = torch.compile(slim, backend="eager")
    with torch.no_grad():
        compiled(x)  # compiled before the block, as a model in use is
        try:
            with slim_mha.recording_attention(slim) as maps:
                compiled(x)
        except Exception as error:  # Dynamo may wrap it: the words are the contract
            assert "torch.compile" in str(error) and "recording_attention" in str(error)
        else:
            assert len(maps["self_attn"]) == 1  # or it records, never an empty map


# ------------------------------------------------------------------------------------------ seeds

_SEEDED_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn
    import slim_mha  # imported first, as a patched codebase imports it
    torch.manual_seed(0)
    {context}
        attention = nn.MultiheadAttention(8, 2)
        layer = nn.TransformerEncoderLayer(8, 2, 16)
        x = torch.randn(3, 2, 8)
        out = layer(x)
    print(sum(p.sum().item() for p in attention.parameters()), out.sum().item(), torch.rand(1).item())
    """
)


def test_a_seeded_script_gets_stocks_weights_and_draws_on_its_first_build():
    """No import or first use of slim draws from the global RNG."""
    printed = {}
    for name, context in (("stock", "if True:"), ("patched", "with slim_mha.patched():")):
        script = _SEEDED_SCRIPT.format(context=context)
        printed[name] = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
        ).stdout
    assert printed["patched"] == printed["stock"]


def test_the_probes_leave_the_rng_where_they_found_it():
    from slim_mha import _torch_compat

    state = torch.random.get_rng_state()
    _torch_compat.stock_layer_unfuses_for_hooks.__wrapped__()
    _torch_compat.sdpa_zeroes_rows_masked_from_every_key.__wrapped__()
    assert torch.equal(torch.random.get_rng_state(), state)


def test_the_sdpa_probe_answers_as_sdpa_does():
    mask = torch.zeros(B, 1, 1, 4)
    mask[1] = float("-inf")
    q = torch.randn(B, H, 4, 8)
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert sdpa_zeroes_rows_masked_from_every_key() == bool((out[1] == 0).all())
