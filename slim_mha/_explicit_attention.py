"""Attention that returns its weights: the explicit softmax(q kᵀ / sqrt(D) + mask) v path.

SDPA does not return probabilities, so whenever weights are requested this path runs instead, in
stock's order of operations, unless the call is one that stock's own kernel takes (unmasked
self-attention without a graph: the "stock kernel" path of :func:`slim_mha.paths.choose_path`) or a
small unmasked one that runs stock's ops (its "stock ops" path).

Without a graph (inference) the scores of every head are one ``(B, H, L, S)`` tensor, masked,
softmaxed (in place where they are large: :func:`_softmax_last`) and averaged by one batched
product: what stock's native kernel holds, and no more. Only where that one pass would not fit in the memory this process can get does the memory
guard (``_memory_guard.rows_per_block``) cut the averaged weights into blocks of query rows.

Every step is one batched call over all heads, so the number of ops per call does not grow with the
number of heads or the length. That matters beyond CUDA launches: on a CPU shared with other
processes each multi-threaded op ends at a barrier where it waits for its slowest thread, and that
thread waits for a core, so the time of a call beside a busy process grows with the number of such
ops far more than with their size (benchmarks/RESULTS.md, in its git history). The blocks pay it once per block.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._memory_guard import check_weights_fit, rows_per_block
from ._torch_compat import records_graph

__all__ = [
    "WeightsPlan",
    "attention_with_weights",
    "blocks_forced",
    "mean_over_heads",
    "plan_weights_path",
    "query_scale",
]

# Set (by tests and the benchmark) to compute averaged weights without a graph in blocks holding at
# most this many bytes of scores even where one pass fits; None: the memory guard decides.
_BLOCK_SCORES_BYTES: int | None = None


def blocks_forced() -> bool:
    """Whether averaged weights are forced into blocks (tests, ``bench weights --blocks``)."""
    return _BLOCK_SCORES_BYTES is not None


class WeightsPlan(NamedTuple):
    """Which weights path a call takes, decided once: run here, and counted by the memory guard."""

    functional: bool  # autograd, dropout, transforms, traces: no out=, in place only where safe
    average: bool  # weights averaged over heads
    rows: int  # query rows per block of scores; all of them for one pass


def plan_weights_path(
    q: Tensor, src_len: int, *, dropout_p: float, average: bool, records_graph: bool, symbolic: bool
) -> WeightsPlan:
    """The path for ``q`` ``(B, H, L, D)`` and ``src_len`` keys (appended tokens included);
    ``symbolic``: :func:`~slim_mha._torch_compat.is_symbolic_call` for the call."""
    # Symbolic calls (fake tensors, dispatch modes) too: the one-pass path keeps a cached constant.
    functional = records_graph or dropout_p > 0.0 or symbolic
    rows = q.shape[2]
    if average and not functional:
        rows = (
            rows_per_block(q, src_len) if _BLOCK_SCORES_BYTES is None else _forced_rows(q, src_len, _BLOCK_SCORES_BYTES)
        )
    return WeightsPlan(functional, average, rows)


def attention_with_weights(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    dropout_p: float,
    average: bool,
    *,
    q_scaled: bool = False,
    symbolic: bool,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ / sqrt(D) + mask) v and the weights, in stock's order of operations.

    ``q`` is ``(B, H, L, D)``, ``k`` and ``v`` ``(B, H, S, D)``, ``mask`` additive and broadcastable
    to ``(B, H, L, S)``. Returns the output ``(B, H, L, D)`` and the weights, ``(B, L, S)`` averaged
    over heads or ``(B, H, L, S)``. ``q_scaled``: ``q`` is already ``q / sqrt(D)``, a contiguous
    tensor of the caller's that this path may write into (only ever without a graph). ``symbolic``:
    :func:`~slim_mha._torch_compat.is_symbolic_call` for the call, asked once by the caller.
    """
    plan = plan_weights_path(
        q,
        k.shape[2],
        dropout_p=dropout_p,
        average=average,
        records_graph=records_graph(q, k, v, mask),
        symbolic=symbolic,
    )
    check_weights_fit(q, k.shape[2], plan, symbolic=symbolic)  # before any (B, H, L, S)
    if plan.functional:  # scaled queries reach it when only the mask or appended tokens need grad
        return _attention_functional(q, k, v, mask, dropout_p, average, q_scaled)
    if plan.rows < q.shape[2]:
        return _attention_averaged_in_blocks(q, k, v, mask, plan.rows, q_scaled=q_scaled)
    return _attention_in_one_pass(q, k, v, mask, average, q_scaled)


def _attention_in_one_pass(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, average: bool, q_scaled: bool
) -> tuple[Tensor, Tensor]:
    """Without a graph: every head's scores at once, softmaxed in place; the output in q's copy.

    Head-major contiguous inputs (as the module's projections give them) are used as they are;
    others are copied, each copy living only as long as its product needs it. The output takes q's
    copy: what the path adds beside the scores never exceeds two ``(B, H, L, D)`` tensors, as in
    stock's kernel.
    """
    B, H, L, D = q.shape
    S = k.shape[2]
    # Explicit sizes in every view, never -1: an empty batch or sequence leaves -1 undetermined.
    scaled = _matrices(q) if q_scaled else _scaled_matrices(q)  # (B·H, L, D), ours to write into
    scores = torch.bmm(scaled, _matrices(k).transpose(1, 2)).view(B, H, L, S)
    if mask is not None:
        scores.add_(mask)
    scores = _softmax_last(scores)
    out = torch.bmm(scores.view(B * H, L, S), _matrices(v), out=scaled)  # q's copy is free once scored
    return out.view(B, H, L, D), mean_over_heads(scores) if average else scores


def _attention_functional(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, average: bool, q_scaled: bool = False
) -> tuple[Tensor, Tensor]:
    """For autograd, dropout, ``torch.func`` transforms and compilers: no ``out=``, in place only where safe."""
    B, H, L, D = q.shape
    S = k.shape[2]
    # bmm on (B·H)-batches, reshaped here once (matmul on 4-D views would fold them with more ops)
    scaled = (q if q_scaled else q * query_scale(D)).reshape(B * H, L, D)
    keys = k.reshape(B * H, S, D).transpose(1, 2)
    if mask is None:
        scores = torch.bmm(scaled, keys).view(B, H, L, S)
    else:
        # The mask added by the product itself, as stock does: an add in place on the product's
        # view would make autograd zero-fill and copy a (B, H, L, S) gradient in the backward.
        scores = torch.baddbmm(_batched_mask(mask, B, H), scaled, keys).view(B, H, L, S)
    weights = scores.softmax(-1)  # the method: torch.softmax's overload parsing costs more than the op at small sizes
    del scores  # autograd keeps softmax's output, not its input: freed here, as stock frees it
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.bmm(weights.reshape(B * H, L, S), v.reshape(B * H, S, D)).view(B, H, L, D)
    return out, weights.mean(dim=1) if average else weights


def _attention_averaged_in_blocks(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, rows: int, q_scaled: bool = False
) -> tuple[Tensor, Tensor]:
    """Averaged weights without a graph, ``rows`` query rows (all batches, all heads) at a time.

    Each block's output and average go to contiguous temporaries first and are then copied into
    their rows: ``bmm`` into a strided ``out=`` falls back to one matrix product per batch.
    """
    B, H, L, D = q.shape
    S = k.shape[2]
    k_matrices, v_matrices = _matrices(k), _matrices(v)  # copied once, not once per block
    out = q.new_empty(B, L, H, D).transpose(1, 2)  # (B, H, L, D) in the layout _merge_heads flattens for free
    weights = q.new_empty(B, L, S)
    for start in range(0, L, rows):
        block = slice(start, min(start + rows, L))
        block_rows = block.stop - block.start
        block_queries = _matrices(q[:, :, block]) if q_scaled else _scaled_matrices(q[:, :, block])
        scores = torch.bmm(block_queries, k_matrices.transpose(1, 2))
        scores = scores.view(B, H, block_rows, S)
        if mask is not None:
            scores.add_(mask if mask.shape[-2] == 1 else mask[..., block, :])
        scores = _softmax_last(scores)
        out[:, :, block] = torch.bmm(scores.view(B * H, block_rows, S), v_matrices).view(B, H, block_rows, D)
        weights[:, block] = mean_over_heads(scores)
        del scores  # freed before the next block's scores are allocated, which then reuse its memory
    return out, weights


# Scores under this many bytes are softmaxed into a new tensor, larger ones in place: on the CPU the
# in-place kernel costs a fixed few microseconds more, a tenth of a call at set-model sizes, and is
# faster on large scores, where the memory it saves matters (benchmarks/RESULTS.md, "Paths").
_SOFTMAX_IN_PLACE_FROM_BYTES = 64 << 10


def _softmax_last(scores: Tensor) -> Tensor:
    """softmax over the last axis, in place where the scores are large (without a graph only)."""
    if scores.numel() * scores.element_size() < _SOFTMAX_IN_PLACE_FROM_BYTES:
        return scores.softmax(-1)
    return torch.softmax(scores, dim=-1, out=scores)


def _batched_mask(mask: Tensor, batch: int, heads: int) -> Tensor:
    """An additive mask broadcastable to ``(B, H, L, S)`` as ``baddbmm``'s input over ``B·H``
    matrices: a shared ``(L, S)`` mask stays 2-D, and only masks that vary by batch or head are
    spelled out per ``(b, h)``, over their own rows (one row for a padding mask)."""
    if mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1:
        mask = mask[0, 0]
    if mask.dim() == 2:
        return mask  # (L or 1, S), the same for every batch and head
    rows, src_len = mask.shape[-2:]
    return mask.expand(batch, heads, rows, src_len).reshape(batch * heads, rows, src_len)


def query_scale(head_dim: int) -> float:
    """``1/sqrt(D)``, computed as stock computes it, so that scaled queries are stock's bit for bit."""
    return math.sqrt(1.0 / float(head_dim))


def _scaled_matrices(q: Tensor) -> Tensor:
    """``q / sqrt(D)`` as ``(B·H, L, D)``: scaled first, as stock does, in the copy ``bmm`` needs anyway."""
    B, H, L, D = q.shape
    scaled = q.new_empty(B * H, L, D)
    torch.mul(q, query_scale(D), out=scaled.view(B, H, L, D))
    return scaled


def _matrices(x: Tensor) -> Tensor:
    """``(B, H, N, D)`` -> ``(B·H, N, D)``; copies only if ``B`` and ``H`` do not fold (one dispatch:
    a copy spelled out as allocation, view and ``copy_`` costs three at small shapes)."""
    B, H, N, D = x.shape
    return x.reshape(B * H, N, D)


def mean_over_heads(weights: Tensor) -> Tensor:
    """``(B, H, L, S)`` -> ``(B, L, S)``, as one batched matrix-vector product with ``1/H``.

    ``mean(dim=1)`` makes three passes over the weights (zero the result, sum into it, divide it);
    this makes one. With H a power of two, ``1/H`` and every product by it are exact, so the two
    agree up to the order of summation; otherwise up to one rounding of ``1/H``.
    """
    B, H, L, S = weights.shape
    average = _head_average(H, weights.dtype, weights.device).expand(B, 1, H)
    return torch.bmm(average, weights.reshape(B, H, L * S)).view(B, L, S)


@functools.lru_cache(maxsize=64)
def _head_average(heads: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The constant ``(1, 1, H)`` row of ``1/H``, made once per heads, dtype and device.

    Made during a call it would be the one allocation beside the scores, the output and the
    averaged weights at the call's peak, and lift it a few bytes above stock's. Made without
    autograd or inference mode, so that it serves calls in and out of either.
    """
    with torch.inference_mode(False), torch.no_grad():
        return torch.full((1, 1, heads), 1.0 / heads, dtype=dtype, device=device)


def _forced_rows(q: Tensor, src_len: int, block_bytes: int) -> int:
    """Query rows per block holding at most ``block_bytes`` of scores, as equal as possible."""
    B, H, L, _ = q.shape
    row_bytes = max(B * H * src_len * q.element_size(), 1)
    most = max(1, block_bytes // row_bytes)
    if most >= L:
        return L
    blocks = -(-L // most)
    return -(-L // blocks)
