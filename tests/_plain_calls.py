"""Shared by the tests of slim's short paths for plain self-attention (no masks, no graph): stock's
kernel with weights (``test_stock_kernel.py``) and the short call without (``test_plain_without_weights.py``).

Each test there counts its path's calls (:func:`recorded_calls`), so that a call that silently changes
path fails, and compares with stock ``nn.MultiheadAttention`` built from the same weights.
"""

from __future__ import annotations

import contextlib

import torch

from slim_mha import SlimMultiheadAttention

from _reference import STOCK_MHA, assert_module_matches_stock, randomize_parameters

BATCH, LENGTH, EMBED, HEADS = 3, 6, 16, 4


def recorded_calls(monkeypatch, owner: object, name: str) -> list:
    """Every call of ``owner.name`` from now on, recorded (its arguments), the call itself unchanged."""
    calls = []
    real = getattr(owner, name)

    def recorded(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(owner, name, recorded)
    return calls


def modules(embed: int = EMBED, heads: int = HEADS, dtype: torch.dtype = torch.float32, **options) -> tuple:
    """Stock with every parameter random (the key slot included) and slim loaded from it, both in eval."""
    options = {"batch_first": True, **options}
    stock = randomize_parameters(STOCK_MHA(embed, heads, dtype=dtype, **options))
    slim = SlimMultiheadAttention(embed, heads, dtype=dtype, **options)
    slim.load_state_dict(stock.state_dict())
    return stock.eval(), slim.eval()


def tokens(dtype: torch.dtype = torch.float32, *shape: int, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*(shape or (BATCH, LENGTH, EMBED)), generator=generator, dtype=torch.float64).to(dtype)


def assert_like_stock(stock, slim, *args, **kwargs) -> None:
    assert_module_matches_stock(stock, slim, *args, **kwargs)


def check_any_key_slot_gives_stocks_output(poison: float, **kwargs) -> None:
    """Whatever the key slot holds (NaN, inf, 1e6), slim's output is stock's with no key bias."""
    stock, slim = modules()
    with torch.no_grad():
        stock.in_proj_bias[EMBED : 2 * EMBED] = 0.0  # stock's function is the same for every key bias
        slim.in_proj_bias[EMBED : 2 * EMBED] = poison
        x = tokens()
        assert_like_stock(stock, slim, x, x, x, **kwargs)


def check_parameter_writes_are_seen(**kwargs) -> None:
    """Nothing derived from the parameters is kept: EMA's ``p.data`` writes, a dtype change after a call."""
    stock, slim = modules()
    x = tokens()
    with torch.no_grad():
        slim(x, x, x, **kwargs)
        for module in (stock, slim):
            for parameter in module.parameters():
                parameter.data.mul_(0.5).add_(0.25)  # an EMA step, through .data (no version bump)
        assert_like_stock(stock, slim, x, x, x, **kwargs)
        stock, slim, x = stock.double(), slim.double(), x.double()
        assert_like_stock(stock, slim, x, x, x, **kwargs)


class Halved(torch.nn.Module):
    """A parametrization: what ``parametrize.register_parametrization`` puts in place of a parameter."""

    def forward(self, bias: torch.Tensor) -> torch.Tensor:
        return bias * 0.5


class Tagged(torch.Tensor):
    """A subclass with its own ``__torch_function__``, as tensor-wrapping libraries define."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


# Calls that neither short path takes, made by refused_call; each test file adds its own.
REFUSED = (
    "key padding mask",
    "bool attn_mask",
    "float attn_mask",
    "causal mask",
    "cross attention",
    "shared key and value",
    "graph recorded",
    "add_bias_kv",
    "add_zero_attn",
    "kdim and vdim",
    "no biases",
    "unbatched",
)
# The module options those calls need.
REFUSED_OPTIONS = {
    "add_bias_kv": {"add_bias_kv": True},
    "add_zero_attn": {"add_zero_attn": True},
    "kdim and vdim": {"kdim": 10, "vdim": 6},
    "no biases": {"bias": False},
}


def refused_call(case: str, x: torch.Tensor) -> tuple[tuple, dict, object]:
    """``(query, key, value)``, keyword arguments and the context of the call ``case`` names, on ``x``;
    for a case not in :data:`REFUSED`, self-attention on ``x`` under ``no_grad``."""
    query = key = value = x
    kwargs, context = {}, torch.no_grad()
    padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    padding[0, -2:] = True
    causal = torch.triu(torch.ones(LENGTH, LENGTH, dtype=torch.bool), diagonal=1)
    if case == "key padding mask":
        kwargs["key_padding_mask"] = padding
    elif case == "bool attn_mask":
        kwargs["attn_mask"] = causal
    elif case == "float attn_mask":
        kwargs["attn_mask"] = torch.zeros(LENGTH, LENGTH).masked_fill(causal, float("-inf"))
    elif case == "causal mask":
        kwargs.update(attn_mask=causal, is_causal=True)
    elif case == "cross attention":
        key = value = tokens(torch.float32, BATCH, LENGTH + 2, EMBED)
    elif case == "shared key and value":
        key = value = x.clone()
    elif case == "graph recorded":
        context = contextlib.nullcontext()
    elif case == "kdim and vdim":
        key, value = torch.randn(BATCH, LENGTH, 10), torch.randn(BATCH, LENGTH, 6)
    elif case == "unbatched":
        query = key = value = x[0]
    return (query, key, value), kwargs, context
