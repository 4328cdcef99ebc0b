"""Attention that returns its weights: the explicit softmax(q kᵀ / sqrt(D) + mask) v path.

SDPA does not return probabilities, so whenever weights are requested this path runs instead, in
stock's order of operations.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._memory_guard import check_weights_fit

__all__ = ["attention_with_weights"]


# Averaged weights over scores of at least this size are computed one head at a time, into one
# reused (B, L, S) buffer: peak memory stays below stock's, and a fresh large tensor costs more to
# allocate, first-touch and stream through the caches than the loop's extra calls (measured on the
# 2-core dev machine, where glibc maps allocations of 32 MiB and more afresh on every call). Below
# it, the per-head calls' Python overhead would dominate.
_LARGE_SCORES_BYTES = 1 << 20


def attention_with_weights(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, average: bool
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ / sqrt(D) + mask) v and the weights, in stock's order of operations.

    Returns the output ``(B, H, L, D)`` and the weights, ``(B, L, S)`` averaged over heads or
    ``(B, H, L, S)``. The ``(B, H, L, S)`` scores are the one large tensor here and allocating it
    dominates on CPU, so the mask and (with no graph recorded) the softmax work in place, and
    averaged weights without a graph are computed one head at a time into one ``(B, L, S)`` buffer.
    """
    records_graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, mask)
    )
    check_weights_fit(q, k.shape[2], average=average, records_graph=records_graph)  # before any (B, H, L, S)
    B, H, L, _ = q.shape
    large = B * H * L * k.shape[2] * q.element_size() >= _LARGE_SCORES_BYTES
    if average and large and not records_graph and dropout_p == 0.0:
        return _attention_averaged_head_by_head(q, k, v, mask)
    scale = math.sqrt(1.0 / float(q.shape[-1]))
    scores = torch.matmul(q * scale, k.transpose(-2, -1))  # (B, H, L, S)
    if mask is not None:
        scores.add_(mask)  # safe under autograd: matmul's backward does not read its output
    weights = torch.softmax(scores, dim=-1) if records_graph else torch.softmax(scores, dim=-1, out=scores)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.matmul(weights, v)  # (B, H, L, D)
    return out, weights.mean(dim=1) if average else weights


def _attention_averaged_head_by_head(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The no-graph, no-dropout case of :func:`attention_with_weights` with averaged weights."""
    B, H, L, D = q.shape
    scale = math.sqrt(1.0 / float(D))
    out = q.new_empty(B, L, H, D)  # the layout _merge_heads flattens for free
    total = q.new_zeros(B, L, k.shape[2])
    scores = torch.empty_like(total)  # (B, L, S), reused by every head
    for head in range(H):
        torch.matmul(q[:, head] * scale, k[:, head].transpose(-2, -1), out=scores)
        if mask is not None:
            scores.add_(_mask_of_head(mask, head))
        torch.softmax(scores, dim=-1, out=scores)
        out[:, :, head] = torch.matmul(scores, v[:, head])
        total.add_(scores)
    return out.transpose(1, 2), total.div_(H)  # (B, H, L, D), (B, L, S)


def _mask_of_head(mask: Tensor, head: int) -> Tensor:
    """The slice of a mask broadcastable to ``(B, H, L, S)`` that applies to one head."""
    if mask.dim() < 4:
        return mask
    return mask[:, head if mask.shape[1] > 1 else 0]
