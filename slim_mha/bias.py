"""The bias arithmetic: every conversion between stock and slim biases lives here.

Stock ``nn.MultiheadAttention`` packs ``in_proj_bias = [b_q; b_k; b_v]``. Why ``b_k`` can go:
for a query ``q`` and key ``k_j = W_k x_j + b_k`` the score is ``q·W_k x_j + q·b_k``. The second
term is the same for every key ``j`` of that query, and ``softmax(s + c) = softmax(s)``, so the
attention weights, the output and every gradient other than ``b_k``'s are unchanged without it.

Tokens appended *after* the projection do not carry ``b_k``, so for them the shift is not uniform:

* ``add_bias_kv`` appends the key ``bias_k`` which stock scores as ``q·bias_k``. Subtracting the same
  ``q·b_k`` from every score of the row (exact, by the argument above) gives ``q·(bias_k - b_k)`` for it,
  so slim stores ``bias_k - b_k`` and drops ``b_k``.
* ``add_zero_attn`` appends a key of zeros, whose score stays 0 while real keys score ``+q·b_k``. Any
  exact reparametrisation needs an ``embed_dim`` vector again, so slim keeps ``b_k`` (as
  ``k_proj_bias``) for those modules and computes exactly what stock computes. ``bias_k`` is then
  stored unfolded.

The value bias ``b_v`` reaches the output as ``W_o (Σ_j a_ij b_v) = W_o b_v`` because each attention row
sums to 1, so it can be folded into ``out_proj.bias``. That holds only without dropout on the weights
(dropout rescales rows) and only if every appended value token is shifted by ``-b_v`` too: the zero
token of ``add_zero_attn`` cannot be, so that case is refused.

Functions here take and return plain tensors so that the module's state-dict loading and the
checkpoint migration share one implementation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
from torch import Tensor, nn

__all__ = [
    "append_tokens",
    "BIAS_NAMES",
    "FORMAT_VERSION",
    "STOCK_BIAS_NAME",
    "SlimBiases",
    "fold_key_bias",
    "unfold_key_bias",
    "zero_key_bias",
    "key_bias",
    "without_key_bias",
    "key_slot_zeroer",
    "restore_stock_layout",
    "fold_value_bias_into_output",
    "keeps_key_bias",
]


STOCK_BIAS_NAME = "in_proj_bias"  # stock's packed [b_q; b_k; b_v]
BIAS_NAMES = ("q_proj_bias", "k_proj_bias", "v_proj_bias")  # slim's bias parameters, in packed order
FORMAT_VERSION = 1  # of slim's state-dict layout (the module's _version); stock checkpoints carry none


class SlimBiases(NamedTuple):
    """The bias tensors of one slim attention module (``None`` where absent), in packed order."""

    q_proj_bias: Tensor | None
    k_proj_bias: Tensor | None
    v_proj_bias: Tensor | None
    bias_k: Tensor | None


def keeps_key_bias(*, add_zero_attn: bool) -> bool:
    """Whether a slim module must keep ``b_k``: only when a zero key is appended after projection."""
    return add_zero_attn


def fold_key_bias(
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None = None,
    *,
    add_zero_attn: bool = False,
) -> SlimBiases:
    """Turn stock biases into slim ones with the same function.

    Args:
        in_proj_bias: stock packed bias, shape ``(3E,)``, or ``None`` for ``bias=False``.
        bias_k: stock appended key, shape ``(1, 1, E)``, or ``None`` without ``add_bias_kv``.
        add_zero_attn: whether the module appends a zero key; then ``b_k`` is kept.

    Returns:
        ``SlimBiases``; ``bias_k`` is ``bias_k - b_k`` when ``b_k`` is dropped.
    """
    if in_proj_bias is None:
        return SlimBiases(q_proj_bias=None, k_proj_bias=None, v_proj_bias=None, bias_k=bias_k)
    if in_proj_bias.dim() != 1 or in_proj_bias.shape[0] % 3 != 0:
        raise ValueError(
            f"in_proj_bias must have shape (3*embed_dim,), got {tuple(in_proj_bias.shape)}; "
            "pass the stock packed [b_q; b_k; b_v] vector"
        )
    b_q, b_k, b_v = in_proj_bias.chunk(3)
    if keeps_key_bias(add_zero_attn=add_zero_attn):
        return SlimBiases(q_proj_bias=b_q.clone(), k_proj_bias=b_k.clone(), v_proj_bias=b_v.clone(), bias_k=bias_k)
    if bias_k is not None:
        if bias_k.numel() != b_k.numel():
            raise ValueError(
                f"bias_k has {bias_k.numel()} elements but the key bias has {b_k.numel()}; "
                "bias_k must have shape (1, 1, embed_dim)"
            )
        bias_k = bias_k - b_k.view_as(bias_k)
    return SlimBiases(q_proj_bias=b_q.clone(), k_proj_bias=None, v_proj_bias=b_v.clone(), bias_k=bias_k)


def unfold_key_bias(biases: SlimBiases, *, embed_dim: int) -> tuple[Tensor | None, Tensor | None]:
    """Turn slim biases back into stock ``(in_proj_bias, bias_k)`` with the same function.

    A dropped key bias comes back as zeros, so ``bias_k`` is returned as stored: the stock module
    with ``b_k = 0`` scores the appended key as ``q·bias_k``, as the slim one does.
    """
    q, k, v = biases.q_proj_bias, biases.k_proj_bias, biases.v_proj_bias
    # A plain loop, not next(generator, default): Dynamo on torch 2.4 cannot trace the latter.
    present = None
    for tensor in (q, k, v):
        if tensor is not None:
            present = tensor
            break
    if present is None:
        return None, biases.bias_k
    zeros = present.new_zeros(embed_dim)
    packed = torch.cat([t if t is not None else zeros for t in (q, k, v)])
    return packed, biases.bias_k


def zero_key_bias(
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None = None,
    *,
    add_zero_attn: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Stock biases with the same function and a zero key slot: stock's layout, loadable by stock and slim.

    The key slot of ``in_proj_bias`` is zeroed and, with ``add_bias_kv``, ``bias_k - b_k`` is returned
    as the new ``bias_k`` (the module docstring says why that is exact). With ``add_zero_attn`` the
    key bias cannot be folded, and both tensors are returned as they are.

    Returns:
        ``(in_proj_bias, bias_k)``, new tensors; the inputs are not modified.
    """
    if in_proj_bias is None or keeps_key_bias(add_zero_attn=add_zero_attn):
        return in_proj_bias, bias_k
    folded = fold_key_bias(in_proj_bias, bias_k)
    packed, _ = unfold_key_bias(folded, embed_dim=in_proj_bias.shape[0] // 3)
    return packed, folded.bias_k


def key_bias(in_proj_bias: Tensor | None, embed_dim: int) -> Tensor | None:
    """``b_k``, the middle third of stock's packed bias (a view), or ``None`` without biases."""
    return None if in_proj_bias is None else in_proj_bias[embed_dim : 2 * embed_dim]


def without_key_bias(in_proj_bias: Tensor | None, embed_dim: int) -> Tensor | None:
    """``[b_q; 0; b_v]``: the bias of the fused input projection, whatever the key slot holds.

    Built from slices and a fresh zero block, so the key slot's gradient is exactly zero (not a sum
    that cancels to rounding noise) and neither its value nor a NaN in it can reach the output.
    ``embed_dim`` is passed rather than read off the shape, which ``jit.trace`` would record.
    """
    if in_proj_bias is None:
        return None
    E = embed_dim
    return torch.cat((in_proj_bias[:E], in_proj_bias.new_zeros(E), in_proj_bias[2 * E :]))


@functools.lru_cache(maxsize=64)
def key_slot_zeroer(packed: int, dtype: torch.dtype, device: torch.device) -> Callable[[Tensor], Tensor]:
    """What makes ``[b_q; 0; b_v]`` of a packed ``(3E,)`` bias of this size, dtype and device in one
    op, for eager calls (no trace, transform or fake tensors), with or without autograd:
    ``key_slot_zeroer(bias.shape[0], bias.dtype, bias.device)(bias)``.

    The same layout as :func:`without_key_bias`, selected by ``torch.where`` from a constant mask,
    so a NaN or inf in the key slot cannot reach it either, and under autograd the key slot's
    gradient is exactly zero (``where`` routes none there). Its slices, zeros and ``cat`` are four
    dispatches, and right after the previous call's large ops each costs several times its idle
    price (24 µs against 11 µs, measured at ``E=256``); under autograd they are four more nodes of
    the backward. Traces and transforms use :func:`without_key_bias`, whose graph holds no constant.

    Made once per size, dtype and device (outside autograd and inference mode) as a partial of
    ``torch.where``: the cache and the partial are C calls, so the shortest paths cross no Python
    frame of ours to build their bias.
    """
    E = packed // 3
    with torch.inference_mode(False), torch.no_grad():
        keep = torch.ones(packed, dtype=torch.bool, device=device)
        keep[E : 2 * E] = False
        zero = torch.zeros((), dtype=dtype, device=device)
        return cast(Callable[[Tensor], Tensor], functools.partial(torch.where, keep, other=zero))


def restore_stock_layout(state_dict: dict, prefix: str, *, embed_dim: int, error_msgs: list[str]) -> None:
    """Turn one module's key-bias-free entries (format version 1) into stock's, in ``state_dict``.

    ``q_proj_bias``, ``v_proj_bias`` (absent when the value bias was folded) and, for
    ``add_zero_attn`` modules, ``k_proj_bias`` become ``in_proj_bias``; a dropped key bias comes back
    as a zero slot, so the stored ``bias_k`` (relative to it) stays as it is. Problems are appended
    to ``error_msgs`` in ``load_state_dict``'s wording, naming the key.
    """
    present = {name: state_dict[prefix + name] for name in BIAS_NAMES if prefix + name in state_dict}
    if not present:
        return
    listed = ", ".join(prefix + name for name in present)
    if prefix + STOCK_BIAS_NAME in state_dict:
        error_msgs.append(
            f"{prefix}{STOCK_BIAS_NAME} and {listed} are both present: the state dict mixes stock's layout "
            "with the key-bias-free one; keep one of them"
        )
        return
    if "q_proj_bias" not in present:
        error_msgs.append(f"missing key {prefix}q_proj_bias beside {listed}: the key-bias-free layout needs it")
        return
    mismatched = [
        f"size mismatch for {prefix}{name}: copying a param with shape {tensor.shape} from checkpoint, "
        f"the shape in current model is torch.Size([{embed_dim}])."
        for name, tensor in present.items()
        if tuple(tensor.shape) != (embed_dim,)
    ]
    if mismatched:
        error_msgs.extend(mismatched)
        return
    for name in present:
        del state_dict[prefix + name]
    biases = SlimBiases(**{name: present.get(name) for name in BIAS_NAMES}, bias_k=state_dict.get(prefix + "bias_k"))
    state_dict[prefix + STOCK_BIAS_NAME], _ = unfold_key_bias(biases, embed_dim=embed_dim)


def fold_value_bias_into_output(
    v_proj_bias: Tensor,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    bias_v: Tensor | None = None,
    *,
    add_zero_attn: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Fold ``b_v`` into the output bias; exact in eval only (see the module docstring).

    Returns:
        ``(out_proj_bias + W_o b_v, bias_v - b_v)``; the second is ``None`` without ``add_bias_kv``.
    """
    if add_zero_attn:
        raise ValueError(
            "fold_value_bias: add_zero_attn=True appends a zero value token that cannot absorb -b_v, "
            "so folding the value bias would change the output; keep v_proj_bias for this module"
        )
    # Compute in the higher of fp32 and the stored dtype, then round once: folding must not add
    # more error than one rounding of the result.
    work = torch.promote_types(out_proj_weight.dtype, torch.float32)
    shift = out_proj_weight.to(work) @ v_proj_bias.to(work)
    base = out_proj_bias.to(work) if out_proj_bias is not None else torch.zeros_like(shift)
    new_out_bias = (base + shift).to(out_proj_weight.dtype)
    new_bias_v = None if bias_v is None else bias_v - v_proj_bias.view_as(bias_v)
    return new_out_bias, new_bias_v


def append_tokens(module: nn.MultiheadAttention, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``module``'s ``add_bias_kv`` then ``add_zero_attn`` tokens, after projection, as stock appends them
    to ``k`` and ``v`` ``(B, H, S, D)``.

    Stock's projected keys carry ``b_k`` and its appended keys do not; ours carry none, so each
    appended key is shifted by ``-b_k`` (the same shift of a whole score row, exact).
    """
    if module.bias_k is None and module.bias_v is None and not module.add_zero_attn:
        return k, v
    B, H, _, D = k.shape
    b_k = key_bias(module.in_proj_bias, module.embed_dim)  # (E,) or None
    if module.bias_k is not None and module.bias_v is not None:
        bias_k = module.bias_k if b_k is None else module.bias_k - b_k
        k = torch.cat([k, bias_k.view(1, H, 1, D).expand(B, H, 1, D).to(k.dtype)], dim=2)
        v = torch.cat([v, module.bias_v.view(1, H, 1, D).expand(B, H, 1, D).to(v.dtype)], dim=2)
    elif module.bias_k is not None or module.bias_v is not None:
        raise AssertionError("bias_k and bias_v must be both set or both None")
    if module.add_zero_attn:
        zero_key = k.new_zeros(B, H, 1, D) if b_k is None else (-b_k).view(1, H, 1, D).expand(B, H, 1, D).to(k.dtype)
        k = torch.cat([k, zero_key], dim=2)
        v = torch.cat([v, v.new_zeros(B, H, 1, D)], dim=2)
    return k, v
