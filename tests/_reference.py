"""Shared by the conversion, patching, transformer-stack, compile and distributed tests.

Stock modules are built with every parameter random: the default initialisation zeroes the input
biases, and a zero key bias would let a wrong fold pass unnoticed.
"""

from __future__ import annotations

import torch
from torch import nn

from slim_mha._matrix import TOLERANCE


# Captured at import, before any test patches torch.nn: always torch's own class.
STOCK_MHA = nn.MultiheadAttention


def randomize_parameters(module: nn.Module, seed: int = 0, scale: float = 0.5) -> nn.Module:
    """Overwrite every parameter with seeded normal noise (so every bias is non-zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * scale
            parameter.copy_(noise.to(parameter.dtype))
    return module


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, what: str = "output") -> None:
    """max|actual - expected| <= tol[dtype] * max(1, max|expected|); same dtype and shape required."""
    __tracebackhide__ = True
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tolerance = TOLERANCE[expected.dtype]
    actual, expected = actual.detach().double(), expected.detach().double()
    if expected.numel() == 0:
        return
    scale = max(1.0, expected.abs().max().item())
    error = (actual - expected).abs().max().item()
    assert error <= tolerance * scale, f"{what}: max error {error:.3e} > {tolerance:.0e} * {scale:.3g}"


def attention_tokens(
    kind: str,
    *,
    batched: bool,
    batch_first: bool,
    dtype: torch.dtype,
    generator: torch.Generator,
    batch: int,
    tgt_len: int,
    src_len: int,
    embed_dim: int,
    kdim: int,
    vdim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value in an attention module's layout, drawn from ``generator`` in a fixed order.

    ``kind``: ``self`` passes one tensor three times (stock's fused path tests identity),
    ``cross_shared_kv`` one tensor as key and value, ``cross`` two, and ``kdim_vdim`` key and value
    of widths ``kdim`` and ``vdim``. Unbatched tokens are ``(length, width)``.
    """

    def tokens(length: int, width: int) -> torch.Tensor:
        shape = (length, width)
        if batched:
            shape = (batch, length, width) if batch_first else (length, batch, width)
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)

    query = tokens(tgt_len, embed_dim)
    if kind == "self":
        return query, query, query
    if kind == "cross_shared_kv":
        shared = tokens(src_len, embed_dim)
        return query, shared, shared
    if kind == "cross":
        return query, tokens(src_len, embed_dim), tokens(src_len, embed_dim)
    return query, tokens(src_len, kdim), tokens(src_len, vdim)
