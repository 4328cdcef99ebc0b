"""Heads as views: a projection split into per-head ``(B, H, L, D)`` tensors and merged back.

Shared by slim's own path and its short path without weights; the layouts follow the caller's
(batch-first or sequence-first), so no transpose of the inputs is ever made. The path that runs stock's
ops instead takes stock's layouts: :func:`sequence_first` and :func:`stock_projected_heads`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["merge_heads", "sequence_first", "split_heads", "stock_heads", "stock_projected_heads"]


def split_heads(
    projected: Tensor, parts: int, num_heads: int, batch_first: bool, *, contiguous: bool = False
) -> list[Tensor]:
    """``(B, L, parts*E)`` or ``(L, B, parts*E)`` -> ``parts`` views of shape ``(B, H, L, D)``, no copy.

    ``contiguous`` (only without a graph): views of one head-major copy, ``(parts, B, H, L, D)``,
    made in one op, so that each head's rows are one matrix of a batched product. (Views whose
    ``B`` and ``H`` fold without that copy, as sequence-first ones can, make the products 4-10%
    slower on CPU: their rows are ``B·E`` elements apart.)

    When a graph is recorded the last axis is split first, so that the backward is a single ``cat``
    straight into the projection's layout (unbinding a 5-D view would backprop through a ``stack``
    and a permuting copy). Without a graph, one view, one permute and one unbind are cheaper.
    """
    d0, d1, width = projected.shape
    head_dim = width // (parts * num_heads)
    # A trace takes the graph-recording form always: jit.trace's check re-traces without a graph,
    # and the two traces must agree.
    if not projected.requires_grad and not torch.jit.is_tracing():
        heads = projected.view(d0, d1, parts, num_heads, head_dim)  # (d0, d1, parts, H, D)
        heads = heads.permute((2, 0, 3, 1, 4) if batch_first else (2, 1, 3, 0, 4))  # (parts, B, H, L, D)
        return list((heads.contiguous() if contiguous else heads).unbind(0))
    order = (0, 2, 1, 3) if batch_first else (1, 2, 0, 3)
    # One part is not split: a split into one piece still copies its gradient in the backward.
    pieces = projected.split_with_sizes((num_heads * head_dim,) * parts, dim=-1) if parts > 1 else (projected,)
    return [part.view(d0, d1, num_heads, head_dim).permute(order) for part in pieces]  # (B, H, L, D) each


def merge_heads(out: Tensor, batch_first: bool) -> Tensor:
    """``(B, H, L, D)`` -> ``(B, L, E)`` or ``(L, B, E)``; free when SDPA wrote ``(B, L, H, D)`` memory."""
    B, H, L, D = out.shape
    if batch_first:
        return out.transpose(1, 2).reshape(B, L, H * D)  # (B, L, E)
    return out.permute(2, 0, 1, 3).reshape(L, B, H * D)  # (L, B, E)


def sequence_first(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Batch-first inputs as stock's Python path takes them, ``(len, B, E)`` views, made as stock makes
    them: the call's ``query is key`` and ``key is value`` hold of the views as they held of the inputs."""
    if key is not value:
        return query.transpose(1, 0), key.transpose(1, 0), value.transpose(1, 0)
    transposed = query.transpose(1, 0)
    key = transposed if query is key else key.transpose(1, 0)
    return transposed, key, key


def stock_heads(projected: Tensor, parts: int, num_heads: int) -> tuple[Tensor, ...]:
    """A sequence-first projection ``(len, B, parts*E)`` -> ``parts`` tensors ``(B·H, len, D)``, laid
    out as stock's Python path lays them out, in fewer ops than its chain of views.

    One part is a view of the projection. Several are views of one copy ``(parts, len, B, E)``, the
    copy stock makes: the same values, strides and offsets, so the products that follow round as
    stock's do. Under autograd the parts' backward is one ``stack``, where stock's selects each fill
    a gradient of the whole copy.
    """
    length, batch, width = projected.shape
    head_dim = width // (parts * num_heads)
    if parts == 1:
        return (projected.view(length, batch * num_heads, head_dim).transpose(0, 1),)
    laid_out = projected.view(length, batch, parts, width // parts).permute(2, 0, 1, 3).contiguous()
    return laid_out.view(parts, length, batch * num_heads, head_dim).transpose(1, 2).unbind(0)


def stock_projected_heads(
    query: Tensor, key: Tensor, value: Tensor, weight: Tensor, bias: Tensor, num_heads: int
) -> tuple[Tensor, ...]:
    """Stock's in-projection of sequence-first inputs with the packed ``(3E, E)`` weight, q, k and v
    ``(B·H, len, D)`` in its layout: one matmul for self-attention, one for the queries and one for
    keys and values when ``key is value``, else one each, as stock fuses them."""
    width = query.shape[2]
    if query is key and key is value:
        return stock_heads(F.linear(query, weight, bias), 3, num_heads)
    if key is value:
        (w_q, w_kv), (b_q, b_kv) = weight.split([width, 2 * width]), bias.split([width, 2 * width])
        (q,) = stock_heads(F.linear(query, w_q, b_q), 1, num_heads)
        return (q, *stock_heads(F.linear(key, w_kv, b_kv), 2, num_heads))
    parts = zip((query, key, value), weight.chunk(3), bias.chunk(3))
    return tuple(stock_heads(F.linear(x, w, b), 1, num_heads)[0] for x, w, b in parts)
