"""The tolerance is never widened by an additive mask's fill.

Hugging Face style masks fill masked keys with ``finfo.min``, -1e9 or -1e4, and models fill masked
scores with -1e9. A tolerance relative to the largest input or output magnitude then grew with the
fill and let any break through (a std-1 position table passed). Fills (values at or below
``SENTINEL``) are compared like any value but never set the scale. Each case here has its twin: the
same model without the break passes, with the same mask.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import slim_mha
from slim_mha.equivariance import EquivarianceError, assert_permutation_equivariant, checking_equivariance
from slim_mha.equivariance._measure import SENTINEL

B, N, D, H = 2, 10, 16, 4
FILLS = [torch.finfo(torch.float32).min, -1e9, -1e4]


class MaskedSet(nn.Module):
    """Self-attention over a set with an additive float mask; ``positions`` plants a break."""

    def __init__(self, positions: bool) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.randn(N, D)) if positions else None
        self.attention = slim_mha.SlimMultiheadAttention(D, H, batch_first=True)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = x if self.positions is None else x + self.positions
        return self.attention(h, h, h, attn_mask=mask.repeat_interleave(H, 0), need_weights=False)[0]


class FilledScores(nn.Module):
    """Per-token scores with the padded ones filled, as a pooling head computes them."""

    def __init__(self, positions: bool) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.randn(N, 1)) if positions else None

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:
        scores = x.sum(-1, keepdim=True)
        if self.positions is not None:
            scores = scores + self.positions
        return scores.masked_fill(padding[..., None], -1e9)


def inputs(fill: float) -> tuple[Tensor, Tensor, Tensor]:
    torch.manual_seed(0)
    x = torch.randn(B, N, D)
    padding = torch.zeros(B, N, dtype=torch.bool)
    padding[0, -3:] = True
    mask = torch.zeros(B, N, N).masked_fill(padding[:, None, :], fill)
    return x, padding, mask


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("positions", [True, False])
def test_a_mask_fill_never_hides_a_position_table(fill, positions):
    torch.manual_seed(1)
    model = MaskedSet(positions).eval()
    x, _, mask = inputs(fill)
    if positions:
        with pytest.raises(EquivarianceError):
            assert_permutation_equivariant(model, x, mask, dim=[1, (1, 2)])
        with pytest.raises(EquivarianceError), checking_equivariance(model, dim={"x": 1, "mask": (1, 2)}):
            model(x, mask)
    else:
        assert_permutation_equivariant(model, x, mask, dim=[1, (1, 2)])
        with checking_equivariance(model, dim={"x": 1, "mask": (1, 2)}):
            model(x, mask)


@pytest.mark.parametrize("positions", [True, False])
def test_a_filled_output_never_hides_a_break(positions):
    torch.manual_seed(1)
    model = FilledScores(positions)
    x, padding, _ = inputs(-1e9)
    if positions:
        with pytest.raises(EquivarianceError):
            assert_permutation_equivariant(model, x, padding, dim=1)
    else:
        result = assert_permutation_equivariant(model, x, padding, dim=1)
        assert result.outputs[0].error.scale < 1e3  # the fills were compared, not taken as the scale


def test_large_positive_inputs_still_set_the_scale():
    """The rule is about fills: a point cloud far from the origin keeps its wider tolerance."""
    points = torch.randn(2, 64, 3) + 1e4
    result = assert_permutation_equivariant(lambda p: p - p.mean(dim=1, keepdim=True), points, dim=1)
    assert result.outputs[0].error.scale_of == "inputs" and result.outputs[0].error.scale > 9e3
    assert SENTINEL == -1e4
