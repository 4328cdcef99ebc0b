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
    """The rule is about fills: a point cloud far from the origin keeps a wider tolerance, of a few
    of its roundings (32 units of float32's last place of 1e4: 3.8e-2), while its centring rounds to 2e-3."""
    points = torch.randn(2, 64, 3) + 1e4
    result = assert_permutation_equivariant(lambda p: p - p.mean(dim=1, keepdim=True), points, dim=1)
    error = result.outputs[0].error
    assert error.scale_of == "inputs" and 0.9 * 32 * 1e4 * 1.19e-7 < error.tolerance() < 32 * 1.1e4 * 1.2e-7
    assert "max|inputs| 1e+04 x 0.038" in error.describe()
    assert SENTINEL == -1e4


class Millimetres(nn.Module):
    """A point-cloud block: points in millimetres, centred, embedded, normalised and attended over;
    ``leak`` plants a position table that moves the output by a few percent."""

    def __init__(self, leak: float) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.norm = nn.LayerNorm(D)
        self.positions = nn.Parameter(leak * torch.randn(N, D))
        self.attention = slim_mha.SlimMultiheadAttention(D, H, batch_first=True)

    def forward(self, points: Tensor) -> Tensor:
        centred = points - points.mean(dim=1, keepdim=True)
        h = self.norm(self.embed(centred / 100.0)) + self.positions
        return self.attention(h, h, h, need_weights=False)[0]


@pytest.mark.parametrize("seed", range(6))
def test_millimetre_inputs_hide_no_leak_of_a_few_percent(seed):
    """Inputs of 1e3 once widened the tolerance to 0.1, more than the leak moves this output."""
    torch.manual_seed(seed)
    points = 1e3 + 300.0 * torch.randn(B, N, 3)
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(Millimetres(leak=0.02).eval(), points, dim=1, seed=seed)
    error = caught.value.errors[0]
    assert error.max_abs < 0.07 * error.scale  # a leak of a few percent of the output
    assert_permutation_equivariant(Millimetres(leak=0.0).eval(), points, dim=1, seed=seed)


class LeakyEncoder(nn.Module):
    """A LayerNorm-ended encoder with a small position table added to its input."""

    def __init__(self, leak: float, tokens: int = 32, width: int = 64) -> None:
        super().__init__()
        with slim_mha.patched():
            layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.positions = nn.Parameter(leak * torch.randn(tokens, width))

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(x + self.positions)


def low_precision(mode: str, model: nn.Module, x: Tensor):
    if mode == "autocast":
        return model, x, torch.autocast("cpu", dtype=torch.bfloat16)
    dtype = getattr(torch, mode)
    return model.to(dtype), x.to(dtype), torch.autocast("cpu", enabled=False)


@pytest.mark.parametrize("mode", ["bfloat16", "float16", "autocast"])
@pytest.mark.parametrize("seed", range(4))
def test_low_precision_catches_a_leak_of_four_percent(mode, seed):
    """The bfloat16 table's 8e-2 let a leak of 4% of the output through: the tolerance is now what
    the call rounded against a float32 rerun, and the same model without the leak still passes."""
    torch.manual_seed(seed)
    model, x, precision = low_precision(mode, LeakyEncoder(leak=0.04).eval(), torch.randn(4, 32, 64))
    with precision, pytest.raises(EquivarianceError, match="against a float32 rerun") as caught:
        assert_permutation_equivariant(model, x, dim=1, seed=seed)
    error = caught.value.errors[0]
    assert error.rounding is not None and 0.03 < error.max_rel < 0.08  # the old table passed it
    with precision, pytest.raises(EquivarianceError), checking_equivariance(model, dim=1):
        model(x)
    torch.manual_seed(seed)
    model, x, precision = low_precision(mode, LeakyEncoder(leak=0.0).eval(), torch.randn(4, 32, 64))
    with precision, checking_equivariance(model, dim=1):
        model(x)
    with precision:
        assert_permutation_equivariant(model, x, dim=1, seed=seed)


def test_low_precision_without_a_rerun_falls_back_to_the_table():
    """A function around a bfloat16 module the check was not told of cannot be rerun in float32 (the
    dtypes clash): the table's tolerance applies, and the report says which."""
    projection = nn.Linear(16, 16).to(torch.bfloat16)
    x = torch.randn(2, 10, 16, dtype=torch.bfloat16)
    error = assert_permutation_equivariant(lambda x: projection(x), x, dim=1).outputs[0].error
    assert error.rounding is None and "(bfloat16: 8e-02 x max|" in error.describe()
    told = assert_permutation_equivariant(lambda x: projection(x), x, dim=1, module=projection).outputs[0].error
    assert told.rounding is not None and "against a float32 rerun" in told.describe()
