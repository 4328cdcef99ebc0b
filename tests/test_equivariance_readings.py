"""How the checks read a model's inputs and outputs: what moves with the tokens, and in which dtype
an output is judged. Each false alarm here has a twin that must still raise, and each silent pass a
twin that must still pass.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import slim_mha
from slim_mha.equivariance import EquivarianceError, assert_permutation_equivariant, checking_equivariance

B, N, D, H = 2, 6, 16, 4


class Classifier(nn.Module):
    """An encoder stack and a token head run under autocast, the logits handed back in float32
    (``logits.float()``); ``positions`` plants a break."""

    def __init__(self, positions: bool) -> None:
        super().__init__()
        with slim_mha.patched():
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)
        self.positions = nn.Parameter(4 * torch.randn(40, 64)) if positions else None

    def forward(self, x: Tensor) -> Tensor:
        h = x if self.positions is None else x + self.positions
        return self.head(self.encoder(h)).float()


@pytest.mark.parametrize("seed", range(3))
def test_an_output_upcast_under_autocast_is_judged_in_the_dtype_autocast_computed(seed):
    """Judged at float32's tolerance, bf16 rounding (8e-3 here) raised against 2e-3."""
    torch.manual_seed(seed)
    model = Classifier(positions=False).eval()
    x = torch.randn(4, 40, 64) * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = assert_permutation_equivariant(model, x, dim=1, seed=seed)
        with checking_equivariance(model, dim=1):
            model(x)
    assert result.outputs[0].error.dtype == torch.bfloat16  # at float32's, 12 of 20 seeds raised
    broken = Classifier(positions=True).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(EquivarianceError):
        assert_permutation_equivariant(broken, x, dim=1, seed=seed)


class Embedded(nn.Module):
    """Token ids and Hugging Face style ``position_ids``; ``learned`` reads the positions."""

    def __init__(self, learned: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(50, D)
        self.positions = nn.Embedding(N, D) if learned else None
        self.attention = slim_mha.SlimMultiheadAttention(D, H, batch_first=True)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        h = self.tokens(input_ids)
        if self.positions is not None:
            h = h + self.positions(position_ids)
        return self.attention(h, h, h, need_weights=False)[0]


@pytest.mark.parametrize("learned", [True, False])
def test_position_ids_stay_with_their_slots(learned):
    """Moved with the tokens, ``position_ids`` made a model with position embeddings look like a set
    model. They count 0..L-1 along the axis, so they are left where they are."""
    torch.manual_seed(0)
    model = Embedded(learned).eval()
    input_ids = torch.randint(0, 50, (B, N))
    position_ids = torch.arange(N).expand(B, N)
    if learned:
        with pytest.raises(EquivarianceError):
            assert_permutation_equivariant(model, input_ids, position_ids, dim=1)
        with pytest.raises(EquivarianceError), checking_equivariance(model, dim=1):
            model(input_ids, position_ids)
    else:
        assert_permutation_equivariant(model, input_ids, position_ids, dim=1)


@pytest.mark.parametrize("masked", [True, False])
def test_a_negative_dim_moves_a_lower_rank_masks_tokens_not_its_batch(masked):
    """dim=-2 names the tokens of ``(B, L, E)``; a ``(B, L)`` mask has them on its last axis. With
    B == L the mask's batch used to move instead, and a correct model raised."""
    torch.manual_seed(0)
    attention = slim_mha.SlimMultiheadAttention(D, H, batch_first=True).eval()
    x = torch.randn(N, N, D)  # B == L
    padding = torch.zeros(N, N, dtype=torch.bool)
    if masked:
        padding[0, -2:] = True
        padding[3, :3] = True

    def attend(x, padding):
        return attention(x, x, x, key_padding_mask=padding, need_weights=False)[0]

    assert_permutation_equivariant(attend, x, padding, dim=-2, module=attention)


@pytest.mark.parametrize("hint", [True, False])
def test_a_causal_decoder_is_checked_through_its_permuted_mask(hint):
    """``tgt_is_causal=True`` tells attention the mask is the causal one; the check permutes the mask
    with the tokens, so in its runs the hint gives way to the mask. Without that, a correct
    ``nn.Transformer`` failed and slim's own code was blamed."""
    torch.manual_seed(0)
    with slim_mha.patched():
        model = nn.Transformer(D, H, 1, 1, 32, dropout=0.0, batch_first=True).eval()
    src, tgt = torch.randn(B, 7, D), torch.randn(B, N, D)
    mask = nn.Transformer.generate_square_subsequent_mask(N)
    with checking_equivariance(model, dim={"tgt": 1, "tgt_mask": (0, 1)}):
        out = model(src, tgt, tgt_mask=mask, tgt_is_causal=hint)
    torch.testing.assert_close(out, model(src, tgt, tgt_mask=mask, tgt_is_causal=hint))
    # Without the mask moving, the same call is not equivariant: the check still says so.
    with pytest.raises(EquivarianceError), checking_equivariance(model, dim={"tgt": 1}):
        model(src, tgt, tgt_mask=mask, tgt_is_causal=hint)


class MaskedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = slim_mha.SlimMultiheadAttention(D, H, batch_first=True)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.attention(x, x, x, attn_mask=mask, need_weights=False)[0]


def test_a_break_inside_slims_attention_is_blamed_on_its_inputs_never_on_slims_code():
    """An ``(L, L)`` mask under an int ``dim`` moves on one axis only: the report says to check
    ``dim`` for the masks, where it used to name lines of slim's ``attention.py``."""
    torch.manual_seed(0)
    model = MaskedModel().eval()
    x = torch.randn(B, N, D)
    mask = torch.zeros(N, N, dtype=torch.bool)
    mask[0, 1:] = True  # query 0 sees itself alone: not symmetric under a one-axis move
    with pytest.raises(EquivarianceError) as caught, checking_equivariance(model, dim=1):
        model(x, mask)
    message = str(caught.value)
    assert "attention.py" not in message and "slim_mha" not in message
    assert "check dim for the model's mask inputs" in message
    with checking_equivariance(model, dim={"x": 1, "mask": (0, 1)}):  # the mask moved on both axes
        model(x, mask)
