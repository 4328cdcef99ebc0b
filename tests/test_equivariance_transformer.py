"""A whole nn.Transformer with a causal tgt_mask: trained under the assertion mode, and checked whole.

``nn.TransformerDecoder`` detects that ``generate_square_subsequent_mask`` is causal and passes
``is_causal=True`` down with the mask. The mode then checks the property with the mask following
the tokens, ``f(P x, P M Pᵀ) = P f(x, M)``; attention that adds positions of its own must still be
caught, and the model checker must pass the model when the mask is permuted with the tokens and
fail it when the mask stays put.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha import (
    EquivarianceError,
    SlimMultiheadAttention,
    assert_permutation_equivariant,
    checking_equivariance,
)
from slim_mha.equivariance import _mode

D_MODEL, HEADS, FEEDFORWARD = 16, 4, 32
SOURCE, TARGET, BATCH = 7, 6, 2


pytestmark = pytest.mark.usefixtures("fresh_equivariance_mode")  # tests/conftest.py


@pytest.fixture
def checked(record_checks) -> list:
    """(module, is_causal hint) of each call the mode checked."""
    return record_checks(lambda check: (check.module, check.is_causal_hint))


def build_transformer(how: str) -> nn.Transformer:
    torch.manual_seed(0)
    options = dict(
        num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=FEEDFORWARD, dropout=0.1, batch_first=True
    )
    if how == "patched":
        with slim_mha.patched():
            return nn.Transformer(D_MODEL, HEADS, **options)
    return slim_mha.convert(nn.Transformer(D_MODEL, HEADS, **options))


def sequences(target: int = TARGET) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    source = torch.randn(BATCH, SOURCE, D_MODEL, generator=generator)
    tokens = torch.randn(BATCH, target, D_MODEL, generator=generator)
    return source, tokens, nn.Transformer.generate_square_subsequent_mask(target)


def train_step(model: nn.Transformer) -> list[torch.Tensor]:
    """One SGD step in train mode (dropout on); returns the loss, the gradients and the updated weights."""
    source, tokens, mask = sequences()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)  # the dropout masks
    loss = model(source, tokens, tgt_mask=mask).square().mean()
    loss.backward()
    gradients = [parameter.grad.clone() for parameter in model.parameters()]
    optimizer.step()
    return [loss.detach()] + gradients + [parameter.detach().clone() for parameter in model.parameters()]


@pytest.mark.parametrize("how", ["patched", "converted"])
@pytest.mark.parametrize("switch", ["scope", "environment"])
def test_a_transformer_with_a_causal_mask_trains_under_the_mode_unchanged(how, switch, checked):
    model = build_transformer(how)
    assert isinstance(model.decoder.layers[0].self_attn, SlimMultiheadAttention)
    reference = train_step(copy.deepcopy(model))
    assert checked == []
    if switch == "environment":  # what SLIM_MHA_CHECK_EQUIVARIANCE=1 does at import
        _mode._configure_environment("1")
        result = train_step(model)
    else:
        with checking_equivariance(model, strict=True):
            result = train_step(model)
    # Every attention call was checked: 2 encoder self-attentions, 2 decoder self- and 2 cross-attentions;
    # the decoder's self-attentions came with the is_causal hint that torch derived from the mask.
    decoder_self = {id(layer.self_attn) for layer in model.decoder.layers}
    assert len(checked) == 6
    assert sorted(hint for _, hint in checked) == [False] * 4 + [True] * 2
    assert {id(module) for module, hint in checked if hint} == decoder_self
    for expected, actual in zip(reference, result, strict=True):  # no side effect on outputs, gradients, RNG
        assert torch.equal(expected, actual)


class PositionalBias(SlimMultiheadAttention):
    """Adds a fixed distance bias (ALiBi-like) to the mask it is given: a mask that does not follow the tokens."""

    def _slim_general(self, call, dropout_p=None, plan=None):
        query, key, attn_mask = call.query, call.key, call.attn_mask
        rows = torch.arange(query.shape[1], dtype=query.dtype).view(-1, 1)
        columns = torch.arange(key.shape[1], dtype=query.dtype).view(1, -1)
        bias = -(rows - columns).abs()  # (L, S), by position
        attn_mask = bias if attn_mask is None else attn_mask + bias
        return super()._slim_general(call._replace(attn_mask=attn_mask, is_causal=False), dropout_p)


def with_positional_bias(model: nn.Transformer) -> nn.Transformer:
    layer = model.decoder.layers[0]
    original = layer.self_attn
    broken = PositionalBias(D_MODEL, HEADS, dropout=original.dropout, batch_first=True)
    broken.load_state_dict(original.state_dict())
    layer.self_attn = broken
    return model


@pytest.mark.parametrize("switch", ["scope", "environment"])
def test_attention_whose_mask_does_not_follow_the_tokens_is_caught_in_the_transformer(switch):
    model = with_positional_bias(build_transformer("patched"))
    source, tokens, mask = sequences()
    if switch == "environment":
        _mode._configure_environment("1")
        with pytest.raises(EquivarianceError, match=r"^PositionalBias\(.*\) \(pass the model to"):
            model(source, tokens, tgt_mask=mask)
        return
    with checking_equivariance(model), pytest.raises(EquivarianceError) as caught:
        model(source, tokens, tgt_mask=mask)
    assert caught.value.module_name == "decoder.layers.0.self_attn"
    message = str(caught.value)
    assert message.startswith("PositionalBias 'decoder.layers.0.self_attn' is not permutation-equivariant on this call")
    assert "attn_mask (6, 6) float32" in message and "is_causal=True (a hint" in message


def whole_model(model: nn.Transformer):
    return lambda source, tokens, mask: model(source, tokens, tgt_mask=mask)


def test_the_checker_passes_the_transformer_when_the_mask_follows_the_tokens():
    model = build_transformer("patched").train()
    source, tokens, mask = sequences(target=SOURCE)  # one set of tokens: source and target alike
    result = assert_permutation_equivariant(whole_model(model), source, tokens, mask, dim=(1, 1, (0, 1)), module=model)
    assert result.input_dims == ((1,), (1,), (0, 1))


def test_the_checker_catches_a_mask_that_stays_put_and_names_the_attention_that_sees_it():
    model = build_transformer("patched")
    source, tokens, mask = sequences(target=SOURCE)
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(whole_model(model), source, tokens, mask, dim=(1, 1, None), module=model)
    culprit = caught.value.result.culprit()
    assert (culprit.kind, caught.value.module_name) == ("submodule", "decoder.layers.0.self_attn")
    calls = caught.value.result.submodules
    encoder = [call for call in calls if call.name.startswith("encoder")]
    assert encoder and all(call.passed() for call in encoder)  # the encoder sees no mask: it kept it
    assert culprit.kept == len(encoder)  # every call that finished before the decoder's first attention
    assert "'decoder.layers.0.self_attn' (MultiheadAttention, call 1)" in str(caught.value)
