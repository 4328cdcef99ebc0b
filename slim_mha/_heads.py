"""Heads as views: a projection split into per-head ``(B, H, L, D)`` tensors and merged back.

Shared by slim's own path and its short path without weights; the layouts follow the caller's
(batch-first or sequence-first), so no transpose of the inputs is ever made.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge_heads", "split_heads"]


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
