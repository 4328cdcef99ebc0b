"""Factories for ``python -m slim_mha.bench model`` on the client libraries recorded in RESULTS.md.

The command calls a factory with no arguments, so models that take options are built here: open_clip's
ViT-B-32 without pretrained weights (nothing is downloaded), a stacked set transformer, and a batch
of inputs for each. Run from the
repository root with ``PYTHONPATH=benchmarks``; torchvision and open_clip are not dependencies of
slim_mha: install them to run these.
"""

from __future__ import annotations

import torch
from torch import nn


def open_clip_vit_b_32():
    import open_clip

    return open_clip.create_model("ViT-B-32", pretrained=None)


def open_clip_batch() -> tuple:
    """Two images and two token sequences of CLIP's context length (77), made up, seeded."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 224, 224, generator=generator)
    tokens = torch.randint(1, 49407, (2, 77), generator=generator)
    return images, tokens


class SetTransformer(nn.Module):
    """Four set-transformer blocks (attention, residual, LayerNorm, MLP): no positions, batch-first."""

    def __init__(self, width: int = 64, heads: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.attention = nn.ModuleList(nn.MultiheadAttention(width, heads, batch_first=True) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(depth)
        )

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        x = points
        for attention, norm, mlp in zip(self.attention, self.norms, self.mlps):
            x = x + attention(x, x, x, need_weights=False)[0]
            x = x + mlp(norm(x))
        return x


def set_transformer() -> nn.Module:
    return SetTransformer()


def point_set() -> tuple:
    """Four sets of 1024 points, 64 features each, seeded."""
    return (torch.randn(4, 1024, 64, generator=torch.Generator().manual_seed(0)),)


def transformer_encoder() -> nn.Module:
    """A 4-layer batch-first nn.TransformerEncoder, E=256, H=8 (the issue on compiled models' probe)."""
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
