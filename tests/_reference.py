"""Shared by the conversion, patching, transformer-stack, compile and distributed tests.

Stock modules are built with every parameter random: the default initialisation zeroes the input
biases, and a zero key bias would let a wrong fold pass unnoticed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from copy import deepcopy

import torch
from torch import nn

from slim_mha._matrix import TOLERANCE

# Captured at import, before any test patches torch.nn: always torch's own class.
STOCK_MHA = nn.MultiheadAttention


@contextlib.contextmanager
def fast_path_enabled(enabled: bool) -> Iterator[None]:
    """Stock's ``torch.backends.mha`` fast path set to ``enabled`` inside, restored after."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def randomize_parameters(module: nn.Module, seed: int = 0, scale: float = 0.5) -> nn.Module:
    """Overwrite every parameter with seeded normal noise (so every bias is non-zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * scale
            parameter.copy_(noise.to(parameter.dtype))
    return module


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, what: str = "output") -> None:
    """max|actual - expected| <= tol[dtype] * max(1, max|expected|); same dtype and shape required.

    A fixed bound: right for float64, whose rounding is six orders of magnitude below it, and for
    small fp32 cases. Where slim is compared with stock in a lower precision at sizes where torch's
    own rounding can cross a fixed bound, use :func:`assert_matches_stock` with a float64 reference.
    """
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


# Slim may be this many times as far from the higher-precision reference as stock is, plus FLOOR.
STOCK_ERROR_FACTOR = 2.0
# A few units of each dtype's rounding, relative to max(1, max|reference|): what two correct
# implementations may differ by where stock itself happens to round an output exactly.
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def assert_matches_stock(
    actual: torch.Tensor, expected: torch.Tensor, reference: torch.Tensor, what: str = "output"
) -> None:
    """Slim is as exact as stock: ``max|actual - reference| <= 2 max|expected - reference| + floor``.

    ``expected`` is stock's output and ``reference`` stock's function computed in a higher precision
    (float64; see :func:`float64_reference`) from the same weights and inputs, so the bound is stock's
    own rounding error in this torch release, not a constant a release can cross. A wrong result (a
    dropped bias, a permuted head) is off by the size of the output and fails by orders of magnitude.
    """
    __tracebackhide__ = True
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape == reference.shape, (
        f"{what}: shapes {tuple(actual.shape)}, {tuple(expected.shape)}, reference {tuple(reference.shape)}"
    )
    if expected.numel() == 0:
        return
    floor = FLOOR[actual.dtype]  # the compared dtype's, read before the float64 copies below
    actual, expected, reference = (t.detach().double() for t in (actual, expected, reference))
    finite = torch.isfinite(reference)
    assert torch.equal(finite, torch.isfinite(actual)), f"{what}: non-finite entries differ from the reference"
    if not finite.any():
        return
    scale = max(1.0, reference[finite].abs().max().item())
    stock_error = (expected[finite] - reference[finite]).abs().max().item()
    error = (actual[finite] - reference[finite]).abs().max().item()
    bound = STOCK_ERROR_FACTOR * stock_error + floor * scale
    assert error <= bound, (
        f"{what}: max error {error:.3e} against float64 > {STOCK_ERROR_FACTOR:g} x stock's {stock_error:.3e} "
        f"+ {floor:.0e} * {scale:.3g}"
    )


def float64_reference(module: nn.Module, *args, **kwargs):
    """``module``'s outputs computed in float64 on a copy: its float tensors and inputs upcast.

    Inputs passed as the same object stay one object (stock's self-attention path tests identity).
    """
    with torch.inference_mode(False), torch.no_grad():  # a copy of ordinary tensors, in any caller's mode
        copy = deepcopy(module).double()
    upcast: dict[int, torch.Tensor] = {}

    def cast(value):
        if torch.is_tensor(value) and value.is_floating_point():
            return upcast.setdefault(id(value), value.detach().double())
        return value

    return copy(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})


def assert_module_matches_stock(stock: nn.Module, slim: nn.Module, *args, **kwargs) -> None:
    """Call both modules (in the caller's grad mode) and compare every tensor output with
    :func:`assert_matches_stock`, against stock run in float64 on the same weights and inputs."""
    __tracebackhide__ = True
    expected, actual = stock(*args, **kwargs), slim(*args, **kwargs)
    reference = float64_reference(stock, *args, **kwargs)
    if torch.is_tensor(expected):
        expected, actual, reference = (expected,), (actual,), (reference,)
    for index, (a, e, r) in enumerate(zip(actual, expected, reference, strict=True)):
        what = "output" if index == 0 else "weights" if index == 1 else f"output {index}"
        if e is None:
            assert a is None, f"{what}: stock returned None, slim {type(a).__name__}"
        else:
            assert_matches_stock(a, e, r, what)


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
