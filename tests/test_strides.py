"""Stock's output strides, and so stock's dropout draws, in whole models.

Stock's Python path computes batch-first calls in ``(L, B, E)`` and returns a transposed view; its
native kernel returns ``(B, L, E)``. A dropout after the attention draws its mask in memory order,
so a model that returned another layout would draw other masks under the same seed. Slim returns
stock's strides in every path, and whole models train as stock's do, step for step.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha import SlimMultiheadAttention

from _reference import STOCK_MHA, randomize_parameters

MODES = ("train", "train_no_grad", "eval", "no_grad", "inference_mode")
CALLS = list(
    itertools.product((True, False), MODES, (False, True), ("self", "cross"), (4, 3), ("none", "padding", "float"))
)


def _context(mode: str):
    return {"no_grad": torch.no_grad, "train_no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        mode, torch.enable_grad
    )()


@pytest.mark.parametrize("batch_first,mode,need_weights,kind,heads,mask", CALLS)
def test_outputs_and_weights_have_stocks_strides(batch_first, mode, need_weights, kind, heads, mask):
    stock = randomize_parameters(STOCK_MHA(12, heads, batch_first=batch_first))
    slim = SlimMultiheadAttention(12, heads, batch_first=batch_first)
    slim.load_state_dict(stock.state_dict())
    for module in (stock, slim):
        module.train(mode.startswith("train"))
    shape = (2, 5, 12) if batch_first else (5, 2, 12)
    query = torch.randn(shape)
    key = query if kind == "self" else torch.randn(shape)
    masks = {}
    if mask == "padding":
        masks["key_padding_mask"] = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    elif mask == "float":
        masks["attn_mask"] = torch.randn(5, 5)
    with _context(mode):
        expected = stock(query, key, key, need_weights=need_weights, **masks)
        actual = slim(query, key, key, need_weights=need_weights, **masks)
    assert actual[0].stride() == expected[0].stride()
    if need_weights:
        assert actual[1].stride() == expected[1].stride()
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-4, atol=1e-5)


def _losses(model: nn.Module, batches: list[tuple], steps: int = 5) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    torch.manual_seed(1234)
    for inputs in batches[:steps]:
        optimizer.zero_grad()
        out = model(*inputs)
        loss = out.square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _models(kind: str, batch_first: bool):
    torch.manual_seed(0)
    if kind == "encoder":
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=batch_first)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    if kind == "decoder":
        layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.1, batch_first=batch_first)
        return nn.TransformerDecoder(layer, 2)
    return nn.Transformer(32, 4, 2, 2, 64, dropout=0.1, batch_first=batch_first)


@pytest.mark.parametrize("kind", ["encoder", "decoder", "transformer"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("how", ["patched", "converted"])
def test_whole_models_train_as_stock_under_one_seed(kind, batch_first, how):
    """Five AdamW steps with dropout: the same losses (a different dropout mask moves them by ~1e-3)."""
    stock = _models(kind, batch_first)
    if how == "patched":
        with slim_mha.patched():
            slim = _models(kind, batch_first)
        slim.load_state_dict(stock.state_dict())
    else:
        slim = slim_mha.convert(copy.deepcopy(stock))
    assert any(isinstance(m, SlimMultiheadAttention) for m in slim.modules())
    generator = torch.Generator().manual_seed(7)

    def tokens(length):
        return torch.randn((3, length, 32) if batch_first else (length, 3, 32), generator=generator)

    batches = [(tokens(7),) if kind == "encoder" else (tokens(7), tokens(6)) for _ in range(5)]
    expected, actual = _losses(stock, batches), _losses(slim, batches)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
