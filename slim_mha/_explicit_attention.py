"""Attention that returns its weights: the explicit softmax(q kᵀ / sqrt(D) + mask) v path.

SDPA does not return probabilities, so whenever weights are requested this path runs instead, in
stock's order of operations, unless the call is one that stock's own kernel takes (unmasked
self-attention without a graph: the "stock kernel" path of :func:`slim_mha.paths.choose_path`) or a
small unmasked one that runs stock's ops (its "stock ops" path).

Without a graph (inference) the scores of every head are one ``(B, H, L, S)`` tensor, masked,
softmaxed (in place where they are large: :func:`_softmax_last`) and averaged by one batched
product: what stock's native kernel holds, and no more. Only where that one pass would not fit in
the memory this process can get does the memory guard (:func:`rows_per_block`, below) cut the
averaged weights into blocks of query rows.

Every step is one batched call over all heads, so the number of ops per call does not grow with the
number of heads or the length. That matters beyond CUDA launches: on a CPU shared with other
processes each multi-threaded op ends at a barrier where it waits for its slowest thread, and that
thread waits for a core, so the time of a call beside a busy process grows with the number of such
ops far more than with their size (benchmarks/RESULTS.md, in its git history). The blocks pay it once per block.

**The memory guard** refuses an attention-weights request that cannot fit, before anything is
allocated for it.

Attention weights are quadratic in the number of tokens: at B=1 and 100,000 tokens the averaged
``(B, L, S)`` float32 weights alone are 37 GiB, and the per-head scores behind them H times that.
Left to the allocator, such a call either fails with ``can't allocate memory: you tried to allocate
...`` (above the kernel's overcommit limit) or, below it, succeeds on paper and lets the kernel's
out-of-memory killer end this process or a neighbour while the pages are written. Either way the
user learns nothing about the fix, which is ``need_weights=False``: scaled_dot_product_attention
never materialises the weights and its memory grows linearly with the number of tokens.

**When to refuse.** :func:`check_weights_fit` compares what this weights path will hold at once
with the memory this process can get. Only
its tensors that grow with ``L x S`` are counted; the linear ones (projections, output) are left out,
so the estimate stays a lower bound of the call's need. Each of these paths holds no more than stock
``nn.MultiheadAttention`` does for the same call, so a call is refused only when stock would fail
too; stock still tries, and fails in the allocator or, under overcommit, in the OOM killer:

===========================================  ====================================  =====================
call                                         slim's path holds at once             stock holds at least
===========================================  ====================================  =====================
a graph is recorded (training), or a         scores and probabilities,             the same
``torch.func`` transform                     2 x (B, H, L, S); the average,
                                             (B, L, S), comes once the scores
                                             are freed
no graph, per-head weights                   the weights, (B, H, L, S)             the same
no graph, averaged, where one pass fits      the scores of every head, softmaxed   (B, H, L, S) scores
(:func:`rows_per_block` returns L)           in place, (B, H, L, S), and their     and their average,
                                             average, (B, L, S)                    (B, L, S)
no graph, averaged, where it does not        the averaged weights, (B, L, S), one  the same as above
                                             block of query rows' scores,
                                             (B, H, rows, S), and its average,
                                             (B, rows, S); rows from
                                             :func:`rows_per_block`
===========================================  ====================================  =====================

**Stock's kernel.** Below the checked size, calls that stock's fast path would take (unmasked
batch-first self-attention without a graph), and their sequence-first twins, run stock's native
kernel itself, which holds what it holds for stock, plus the ``3E``-element bias ``[b_q; 0; b_v]``
that slim gives it; above, they take the paths in the table.

**One pass or blocks.** Without a graph, averaged weights take one pass, which holds what stock's
native kernel holds, wherever it fits in the memory this process can get; only where it does not
are they computed a block of query rows at a time (:func:`rows_per_block`), with blocks as large as
half of that memory allows: the other half is left for what the estimate does not count. Where
stock's pass would not fit, the blocks are what lets the call run at all.

Attention dropout without a graph (a module in training mode under ``torch.no_grad``) also runs
the path of the first row, but the guard is not told the dropout probability, so it counts such a
call as the no-graph path: an underestimate, which can let a call through, never refuse one.

**What the process can get**: :func:`slim_mha._memory.available_bytes`.

**Cost.** Below :data:`_CHECK_ABOVE_BYTES` the check is one flag read and a few integer
multiplications; the limits are read only for requests large enough that computing them takes
tens of milliseconds or more. Under ``torch.compile``/``torch.export``/``torch.jit.trace`` tracing
(sizes may be symbolic or recorded) and for meta tensors and tensor subclasses it does nothing.

**The error** is ``torch.OutOfMemoryError``, a ``RuntimeError``: stock's failure here is the
allocator's ``RuntimeError`` on CPU and ``torch.OutOfMemoryError`` on CUDA, so handlers written for
stock (``except RuntimeError``, batch-size finders that catch out-of-memory errors) catch ours too,
which a ``MemoryError`` would slip past.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._memory import available_bytes
from ._stock_checks import open_empty_rows, query_scale
from ._torch_compat import is_capturing_graph

__all__ = [
    "WeightsPlan",
    "attention_with_weights",
    "below_checked_size",
    "check_weights_fit",
    "forced_rows",
    "mean_over_heads",
    "plan_weights_path",
    "refuse_mask_of_another_dtype",
    "rows_per_block",
    "weights_path_bytes",
]


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
        rows = rows_per_block(q, src_len)
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
    graph: bool,
    given_masks: tuple[Tensor | None, Tensor | None] = (None, None),
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ / sqrt(D) + mask) v and the weights, in stock's order of operations.

    ``q`` is ``(B, H, L, D)``, ``k`` and ``v`` ``(B, H, S, D)``, ``mask`` additive and broadcastable
    to ``(B, H, L, S)``. Returns the output ``(B, H, L, D)`` and the weights, ``(B, L, S)`` averaged
    over heads or ``(B, H, L, S)``. ``q_scaled``: ``q`` is already ``q / sqrt(D)``, a contiguous
    tensor of the caller's that this path may write into (only ever without a graph). ``symbolic``
    and ``graph``: :func:`~slim_mha._torch_compat.is_symbolic_call` and
    :func:`~slim_mha._stock_checks.module_records_graph` for the call, asked once by the caller.
    ``given_masks``: the call's ``attn_mask`` and ``key_padding_mask``, named in a refusal.
    """
    refuse_mask_of_another_dtype(mask, q.dtype, *given_masks)
    plan = plan_weights_path(
        q, k.shape[2], dropout_p=dropout_p, average=average, records_graph=graph, symbolic=symbolic
    )
    check_weights_fit(q, k.shape[2], plan, symbolic=symbolic)  # before any (B, H, L, S)
    empty = None  # rows masked from every key: zero weights and output, as SDPA gives them
    if mask is not None:
        mask, empty = open_empty_rows(mask, may_sync=mask.is_cpu and not symbolic)
    if plan.functional:  # scaled queries reach it when only the mask or appended tokens need grad
        return _attention_functional(q, k, v, mask, dropout_p, average, q_scaled, empty)
    if plan.rows < q.shape[2]:
        return _attention_averaged_in_blocks(q, k, v, mask, plan.rows, q_scaled=q_scaled, empty=empty)
    return _attention_in_one_pass(q, k, v, mask, average, q_scaled, empty)


def refuse_mask_of_another_dtype(
    mask: Tensor | None, scores_dtype: torch.dtype, attn_mask: Tensor | None, key_padding_mask: Tensor | None
) -> None:
    """Stock's refusal of a float mask whose dtype is not the scores', on a call that returns weights.

    Stock adds the mask to the scores with ``baddbmm``, which raises on any other dtype, in every
    mode. Slim's passes without a graph add it in place, which would cast it silently, so the
    refusal is made here, once, for all of them. Without weights SDPA takes the mask and decides, on
    stock and slim alike (it accepts float32 masks for any query). Under autocast ``baddbmm`` casts
    the mask with the scores, so the ops decide there too.
    """
    if mask is None or mask.dtype == scores_dtype or torch.is_autocast_enabled(mask.device.type):
        return
    named = [
        f"{name} ({given.dtype})"
        for name, given in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask))
        if given is not None and given.is_floating_point() and given.dtype != scores_dtype
    ]
    raise RuntimeError(
        f"{' and '.join(named) or f'the merged mask ({mask.dtype})'} cannot be added to {scores_dtype} "
        f"attention scores when weights are returned: pass a bool mask or a {scores_dtype} one "
        "(stock raises here too)"
    )


def _attention_in_one_pass(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, average: bool, q_scaled: bool, empty: Tensor | None
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
    if empty is not None:
        scores.masked_fill_(empty, 0.0)
    out = torch.bmm(scores.view(B * H, L, S), _matrices(v), out=scaled)  # q's copy is free once scored
    return out.view(B, H, L, D), mean_over_heads(scores) if average else scores


def _attention_functional(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    dropout_p: float,
    average: bool,
    q_scaled: bool = False,
    empty: Tensor | None = None,
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
    if empty is not None:  # out of place: the zeroed rows pass no gradient to the opened scores
        weights = weights.masked_fill(empty, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.bmm(weights.reshape(B * H, L, S), v.reshape(B * H, S, D)).view(B, H, L, D)
    return out, weights.mean(dim=1) if average else weights


def _attention_averaged_in_blocks(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, rows: int, q_scaled: bool = False, empty: Tensor | None = None
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
        if empty is not None:
            scores.masked_fill_(empty if empty.shape[-2] == 1 else empty[..., block, :], 0.0)
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


def forced_rows(q: Tensor, src_len: int, block_bytes: int) -> int:
    """Query rows per block holding at most ``block_bytes`` of scores, as equal as possible."""
    B, H, L, _ = q.shape
    row_bytes = max(B * H * src_len * q.element_size(), 1)
    most = max(1, block_bytes // row_bytes)
    if most >= L:
        return L
    blocks = -(-L // most)
    return -(-L // blocks)


# ------------------------------------------------------------------------------ the memory guard

# Requests below this are not checked: reading the limits costs tens of microseconds, a rounding
# error next to writing 256 MiB of scores, and smaller requests are not where memory runs out.
_CHECK_ABOVE_BYTES = 1 << 28


def check_weights_fit(q: Tensor, src_len: int, plan, *, symbolic: bool = True) -> None:
    """Raise ``torch.OutOfMemoryError`` if the weights path ``plan`` for ``q`` ``(B, H, L, D)`` cannot fit.

    ``src_len`` is the number of keys (appended ``bias_k``/zero-attention tokens included); ``plan``
    is the path the call takes (:func:`plan_weights_path`), so the estimate counts
    what that very path holds. ``symbolic=False`` (``is_symbolic_call`` said so) skips asking
    whether a graph is being captured, which it would have ruled out.
    """
    if symbolic and is_capturing_graph():  # symbolic or recorded sizes: no allocation here
        return
    head_maps = q.numel() // q.size(-1) * src_len * q.element_size()  # bytes of one (B, H, L, S) tensor
    if 2 * head_maps + head_maps // q.size(1) < _CHECK_ABOVE_BYTES:  # the most any path below holds
        return
    needed, what = weights_path_bytes(q, src_len, plan)
    if needed >= _CHECK_ABOVE_BYTES:
        _refuse_if_too_large(q, src_len, needed, what)


def below_checked_size(batch: int, heads: int, tgt_len: int, src_len: int, itemsize: int) -> bool:
    """Whether weights without a graph for these sizes are too small to check: every head's scores
    and their average, held at once, stay below :data:`_CHECK_ABOVE_BYTES`, so one pass always runs."""
    return batch * (heads + 1) * tgt_len * src_len * itemsize < _CHECK_ABOVE_BYTES


def weights_path_bytes(q: Tensor, src_len: int, plan) -> tuple[int, str]:
    """Bytes of the ``L x S``-sized tensors the weights path ``plan`` holds at once for ``q``
    ``(B, H, L, D)`` and ``src_len`` keys, in ``q``'s dtype, and what they are (the table above)."""
    B, H, L, _ = q.shape
    S, itemsize = src_len, q.element_size()
    head_maps, averaged = B * H * L * S * itemsize, B * L * S * itemsize
    average_text = f"and their average, (B, L, S) = {(B, L, S)}"
    if plan.functional:  # the average is taken once the scores are freed: it never adds to the two
        return 2 * head_maps, f"scores and probabilities, each (B, H, L, S) = {(B, H, L, S)}"
    if not plan.average:
        return head_maps, f"the weights, (B, H, L, S) = {(B, H, L, S)}"
    rows = plan.rows
    if rows < L:  # a block's average is written to a temporary, then copied into the weights
        block = f"one block of scores, (B, H, rows, S) = {(B, H, rows, S)}, and its average"
        block_bytes = B * (H + 1) * rows * S * itemsize
        return averaged + block_bytes, f"the averaged weights, (B, L, S) = {(B, L, S)}, {block}"
    return head_maps + averaged, f"the scores of every head, (B, H, L, S) = {(B, H, L, S)}, {average_text}"


def rows_per_block(q: Tensor, src_len: int) -> int:
    """Query rows that averaged weights without a graph compute at once for ``q`` ``(B, H, L, D)``:
    all ``L`` (one pass) wherever that fits in the memory this process can get, else blocks as
    equal as possible whose scores and the averaged weights take at most half of it (at least one
    row: :func:`check_weights_fit` then refuses what even that cannot fit)."""
    B, H, L, _ = q.shape
    if below_checked_size(B, H, L, src_len, q.element_size()) or is_capturing_graph() or not _allocates(q):
        return L
    itemsize = _result_dtype(q).itemsize
    averaged = B * L * src_len * itemsize
    available, _ = available_bytes(q.device)
    if available is None or B * H * L * src_len * itemsize + averaged <= available:
        return L
    row_bytes = B * (H + 1) * src_len * itemsize  # one query row of every head's scores and their average
    most = max(1, (available // 2 - averaged) // max(row_bytes, 1))
    blocks = -(-L // most)  # as few as the budget allows, as equal as possible
    return min(L, -(-L // blocks))


def _allocates(q: Tensor) -> bool:
    """False for fake, meta and subclass tensors, which allocate elsewhere or not at all."""
    return type(q) is Tensor and q.device.type in ("cpu", "cuda")


def _result_dtype(q: Tensor) -> torch.dtype:
    """The dtype of the scores: q's, or autocast's where its matmuls produce a narrower one."""
    if torch.is_autocast_enabled(q.device.type):
        autocast_dtype = torch.get_autocast_dtype(q.device.type)
        if autocast_dtype.itemsize < q.dtype.itemsize:
            return autocast_dtype
    return q.dtype


def _refuse_if_too_large(q: Tensor, src_len: int, needed: int, what: str) -> None:
    if not _allocates(q):
        return
    dtype = _result_dtype(q)
    needed = needed * dtype.itemsize // q.element_size()
    available, source = available_bytes(q.device)
    if available is None or needed <= available:
        return
    raise torch.OutOfMemoryError(
        f"need_weights=True: attention weights over {q.shape[2]:,} queries and {src_len:,} keys need at least "
        f"{_format_bytes(needed)} ({what}, {str(dtype).removeprefix('torch.')}), more than this process "
        f"can get ({_format_bytes(max(available, 0))}, {source}); pass need_weights=False, which never "
        "materialises them and keeps memory linear in the number of tokens, or attend over fewer tokens"
    )


def _format_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"
