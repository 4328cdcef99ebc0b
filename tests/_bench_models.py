"""Small models for ``python -m slim_mha.bench model`` in the tests: built from code, no download."""

from __future__ import annotations

import torch
from torch import nn


def tiny_transformer() -> nn.Module:
    """``nn.Transformer`` (two inputs, sequence-first), small enough for a test."""
    return nn.Transformer(32, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64, dropout=0.1)


class SetPooling(nn.Module):
    """A set model of the tests' own: self-attention, then a learned query pools the set."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.attention = nn.MultiheadAttention(width, 4, dropout=0.1, batch_first=True)
        self.seed = nn.Parameter(torch.randn(1, 1, width))
        self.pool = nn.MultiheadAttention(width, 4, batch_first=True)

    def forward(self, points: torch.Tensor) -> dict:
        h = self.embed(points)
        h = h + self.attention(h, h, h, need_weights=False)[0]
        pooled, weights = self.pool(self.seed.expand(len(points), -1, -1), h, h)
        return {"pooled": pooled.squeeze(1), "weights": weights}


def set_batch() -> tuple:
    return (torch.randn(2, 10, 3),)


NOT_CALLABLE = 3


def no_attention() -> nn.Module:
    """A model without attention: nothing for the model command to measure."""
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU())
