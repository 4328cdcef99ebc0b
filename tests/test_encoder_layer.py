"""Patching and conversion reach the attention inside ``nn.TransformerEncoderLayer``'s inference path.

Stock's layer hands inference calls to one fused kernel that never calls the attention module.
Slim's layer (``slim_mha.encoder_layer``) takes the calls where slim wins away from that kernel and
runs stock's blocks with slim's attention. Every combination of nested tensors, ``norm_first``,
masks and layout is compared here with stock's encoder built from the same weights, against a
float64 reference; the path each call takes is checked, and so are the calls that must stay stock's.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha import encoder_layer
from slim_mha._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA
from slim_mha.encoder_layer import SlimTransformerEncoderLayer, layer_path

from _reference import assert_module_matches_stock, randomize_parameters

E, H, FF, B = 16, 4, 32, 3

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # nested tensors' prototype warning, norm_first's


def encoders(*, nested: bool, norm_first: bool, batch_first: bool, patched: bool = True) -> tuple[nn.Module, nn.Module]:
    def build() -> nn.Module:
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.1, batch_first=batch_first, norm_first=norm_first)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested, norm=nn.LayerNorm(E))

    stock = randomize_parameters(build(), scale=0.3).eval()
    if patched:
        with slim_mha.patched():
            slim = build()
    else:
        slim = slim_mha.convert(build())
    slim.load_state_dict(stock.state_dict())
    return stock, slim.eval()


def inputs(mask: str, length: int, batch_first: bool) -> tuple[torch.Tensor, dict]:
    generator = torch.Generator().manual_seed(length)
    x = torch.randn((B, length, E) if batch_first else (length, B, E), generator=generator)
    if mask == "padding":
        padding = torch.zeros(B, length, dtype=torch.bool)
        padding[1, length - 2 :] = True
        padding[2, length // 2 :] = True
        return x, {"src_key_padding_mask": padding}
    if mask == "causal":
        return x, {"mask": nn.Transformer.generate_square_subsequent_mask(length), "is_causal": True}
    return x, {}


@pytest.fixture
def slim_always(monkeypatch):
    """Every eligible call takes slim's attention, whatever its length."""
    monkeypatch.setattr(encoder_layer, "FUSED_LAYER_MAX_LENGTH", {"no mask": 0, "mask": 0, "nested": 0})


@pytest.fixture
def calls(monkeypatch) -> dict[str, int]:
    """Counts of slim's attention calls and of stock's fused layer kernel."""
    counts = {"attention": 0, "fused": 0}
    attend, fused = slim_mha.SlimMultiheadAttention.forward, torch._transformer_encoder_layer_fwd

    def counted_attend(self, *args, **kwargs):
        counts["attention"] += 1
        return attend(self, *args, **kwargs)

    def counted_fused(*args):
        counts["fused"] += 1
        return fused(*args)

    monkeypatch.setattr(slim_mha.SlimMultiheadAttention, "forward", counted_attend)
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counted_fused)
    return counts


MATRIX = list(itertools.product((True, False), (True, False), ("none", "padding", "causal"), (True, False)))


@pytest.mark.parametrize("nested,norm_first,mask,batch_first", MATRIX)
@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad])
def test_the_patched_encoder_is_stock_in_inference(nested, norm_first, mask, batch_first, context, slim_always, calls):
    stock, slim = encoders(nested=nested, norm_first=norm_first, batch_first=batch_first)
    x, masks = inputs(mask, 7, batch_first)
    with context():
        assert_module_matches_stock(stock, slim, x, **masks)
        expected = stock(x, **masks)
        calls.update(attention=0, fused=0)
        actual = slim(x, **masks)
    assert calls == {"attention": 2, "fused": 0}  # every layer reaches slim's attention, none stock's kernel
    if mask == "padding" and nested and not norm_first and batch_first:
        # stock's encoder made a nested batch and padded it back with zeros: slim's output too
        padded_rows = masks["src_key_padding_mask"]
        assert torch.equal(actual[padded_rows], expected[padded_rows])


@pytest.mark.parametrize("mask", ["none", "padding"])
def test_converted_encoders_reach_slim_and_back(mask, slim_always, calls):
    stock, slim = encoders(nested=True, norm_first=False, batch_first=True, patched=False)
    assert type(slim.layers[0]) is SlimTransformerEncoderLayer
    x, masks = inputs(mask, 9, True)
    with torch.inference_mode():
        assert_module_matches_stock(stock, slim, x, **masks)
        calls.update(attention=0, fused=0)
        slim(x, **masks)
    assert calls == {"attention": 2, "fused": 0}
    parameters = list(slim.parameters())
    slim_mha.to_stock(slim)
    assert type(slim.layers[0]) is STOCK_ENCODER_LAYER and type(slim.layers[0].self_attn) is STOCK_MHA
    assert all(a is b for a, b in zip(parameters, slim.parameters()))


def test_short_sequences_without_a_mask_keep_stocks_fused_layer(calls):
    stock, slim = encoders(nested=True, norm_first=False, batch_first=True)
    x, _ = inputs("none", encoder_layer.FUSED_LAYER_MAX_LENGTH["no mask"], True)
    with torch.inference_mode():
        expected = stock(x)
        calls.update(attention=0, fused=0)
        torch.testing.assert_close(slim(x), expected, rtol=0, atol=0)  # the same kernel: bit for bit
    assert calls == {"attention": 0, "fused": 2}


def test_long_and_masked_calls_take_slims_attention(calls):
    stock, slim = encoders(nested=True, norm_first=False, batch_first=True)
    longest = encoder_layer.FUSED_LAYER_MAX_LENGTH["no mask"] + 1
    with torch.inference_mode():
        # stock's encoder hands its layers a nested batch when padded: the "nested" length decides
        for mask, length in (("none", longest), ("padding", encoder_layer.FUSED_LAYER_MAX_LENGTH["nested"] + 1)):
            x, masks = inputs(mask, length, True)
            assert_module_matches_stock(stock, slim, x, **masks)
            calls.update(attention=0, fused=0)
            slim(x, **masks)
            assert calls == {"attention": 2, "fused": 0}, mask


def test_a_padded_batch_that_is_not_nested_takes_slims_attention_sooner(calls):
    stock, slim = encoders(nested=False, norm_first=False, batch_first=True)
    x, masks = inputs("padding", encoder_layer.FUSED_LAYER_MAX_LENGTH["mask"] + 1, True)
    with torch.inference_mode():
        assert_module_matches_stock(stock, slim, x, **masks)
        calls.update(attention=0, fused=0)
        slim(x, **masks)
    assert calls == {"attention": 2, "fused": 0}


@pytest.mark.parametrize("case", ["train", "grad_enabled_eval", "fastpath_disabled"])
def test_calls_stock_runs_unfused_stay_stocks_own(case, slim_always, calls):
    """Where stock's layer takes no fused path, slim's layer runs stock's forward itself."""
    stock, slim = encoders(nested=False, norm_first=False, batch_first=True)
    x, masks = inputs("padding", 6, True)
    layer = slim.layers[0]
    if case == "train":
        for module in (stock, slim):
            module.train()
            for child in module.modules():
                if isinstance(child, nn.Dropout):
                    child.p = 0.0
                elif isinstance(child, nn.MultiheadAttention):
                    child.dropout = 0.0  # attention dropout, drawn inside the attention
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(case != "fastpath_disabled")
    try:
        assert layer_path(layer, x, None, masks["src_key_padding_mask"])[0] == "stock layer"
        context = torch.enable_grad() if case != "fastpath_disabled" else torch.inference_mode()
        with context:
            assert_module_matches_stock(stock, slim, x, **masks)
            calls.update(attention=0, fused=0)
            slim(x, **masks)
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)
    assert calls == {"attention": 2, "fused": 0}  # stock's general path, through slim's attention


def test_the_patch_renames_nothing_and_unpatch_builds_stock_again():
    names = ("torch.nn", "torch.nn.modules", "torch.nn.modules.transformer")
    import sys

    with slim_mha.patched():
        for name in names:
            assert sys.modules[name].TransformerEncoderLayer is STOCK_ENCODER_LAYER
        built = nn.TransformerEncoderLayer(E, H, FF, batch_first=True)
    assert type(built) is slim_mha.patching.PatchedTransformerEncoderLayer
    assert isinstance(built, STOCK_ENCODER_LAYER)
    assert type(nn.TransformerEncoderLayer(E, H, FF, batch_first=True)) is STOCK_ENCODER_LAYER


def test_a_stock_layer_given_to_a_patched_encoder_keeps_nested_tensors():
    stock_layer = nn.TransformerEncoderLayer(E, H, FF, batch_first=True)
    with slim_mha.patched(), warnings.catch_warnings():
        warnings.simplefilter("error")  # stock warns when it turns nested tensors off
        assert isinstance(stock_layer, nn.TransformerEncoderLayer)
        encoder = nn.TransformerEncoder(stock_layer, 2)
    assert encoder.use_nested_tensor


def test_jit_script_compiles_stocks_layer_with_the_same_parameters():
    stock, slim = encoders(nested=False, norm_first=False, batch_first=True)
    scripted = torch.jit.script(copy.deepcopy(slim))
    x, masks = inputs("padding", 5, True)
    with torch.inference_mode():
        torch.testing.assert_close(scripted(x, **masks), stock(x, **masks))


@pytest.mark.parametrize("mask", ["none", "padding"])
def test_compile_and_export_match_stock(mask, slim_always):
    stock, slim = encoders(nested=False, norm_first=False, batch_first=True)
    x, masks = inputs(mask, 6, True)
    with torch.inference_mode():
        expected = stock(x, **masks)
    compiled = torch.compile(slim, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, **masks), expected)
        exported = torch.export.export(slim, (x,), kwargs=masks)
        torch.testing.assert_close(exported.module()(x, **masks), expected)
