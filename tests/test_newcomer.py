"""What a newcomer meets first: silent no-ops said out loud, one-line refusals, and explain's words."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import slim_mha


class Attention(nn.Module):
    """Another library's attention class (timm's ViT has one of this name)."""

    def forward(self, x):
        return x


class OwnAttentionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Attention(), Attention()])


class MyAttention(nn.MultiheadAttention):
    """A user's subclass of torch's class, which may override what slim replaces."""


def caught(action) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        action()
    return [str(warning.message) for warning in seen]


def test_convert_says_when_a_model_holds_no_multihead_attention_and_names_what_it_holds():
    (message,) = caught(lambda: slim_mha.convert(OwnAttentionModel()))
    assert "OwnAttentionModel holds no nn.MultiheadAttention (its attention classes: Attention)" in message
    assert message.endswith("so nothing was converted")
    with pytest.raises(ValueError, match=r"holds no nn.MultiheadAttention \(its attention classes: Attention\)"):
        with slim_mha.recording_attention(OwnAttentionModel()):
            pass


def test_a_model_with_attention_converts_without_a_word():
    assert caught(lambda: slim_mha.convert(nn.TransformerEncoderLayer(8, 2, 16))) == []


def test_user_subclasses_left_stock_are_named_by_convert_and_by_the_patch():
    model = nn.Sequential(MyAttention(8, 2), nn.MultiheadAttention(8, 2))
    (message,) = caught(lambda: slim_mha.convert(model))
    assert "'0' (MyAttention)" in message and "SlimMultiheadAttention" in message
    assert type(model[0]) is MyAttention and isinstance(model[1], slim_mha.SlimMultiheadAttention)

    def build_twice():
        with slim_mha.patched():
            MyAttention(8, 2)
            MyAttention(8, 2)

    messages = caught(build_twice)
    assert len(messages) <= 1  # once per class (none when an earlier test already built it while patched)
    assert all("MyAttention subclasses torch's MultiheadAttention" in message for message in messages)


@pytest.mark.parametrize("function", ["convert", "to_stock", "fold_value_bias"])
def test_a_state_dict_is_refused_in_one_line_with_the_fix(function):
    with pytest.raises(TypeError) as refused:
        getattr(slim_mha, function)(nn.MultiheadAttention(8, 2).state_dict())
    message = str(refused.value)
    assert "\n" not in message and "state dict" in message
    assert "load_state_dict" in message and "slim-mha-migrate" in message


def test_explain_gives_every_path_a_reason_and_says_which_grad_mode_it_ran_in():
    with slim_mha.patched():
        model = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1, enable_nested_tensor=False
        ).eval()
    x = torch.randn(2, 5, 8)
    with_grad = slim_mha.explain(model, x)
    with torch.no_grad():
        without = slim_mha.explain(model, x)
        attention = slim_mha.explain(model.layers[0].self_attn, x, x, x)
    assert "ran with grad enabled" in str(with_grad) and "torch.no_grad()" in str(with_grad)
    assert "ran without grad" in str(without)
    for report in (with_grad, without, attention):
        assert all(row.why for row in report)
    (row,) = attention
    assert row.path == "stock kernel" and "stock's own kernel" in row.why
