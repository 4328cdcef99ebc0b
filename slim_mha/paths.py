"""The one owner of the path an attention call takes: :func:`choose_path`.

Stock's ``forward`` owns its choice in ``why_not_fast_path``; slim's owns its here, and
``SlimMultiheadAttention.forward`` reads: choose, run. The paths:

* ``"traced"``: ``torch.fx`` symbolic tracing records the call, as it records stock's;
* ``"nested"``: nested tensors, which only stock's native kernel takes;
* ``"recorded"``: a :func:`slim_mha.recording_attention` block watches the module: the call
  computes stock's weights on the path :func:`choose_path` picks for it with ``recording=False``,
  hands them to the block, and returns what the caller asked for;
* ``"stock kernel"``: stock's native kernel given ``[b_q; 0; b_v]``, for self-attention without a
  graph where stock's fast path would run it. Without masks: with weights always (it is the floor;
  with ``skip_unread_weights`` up to :data:`SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES`),
  without weights where its scores are small (:data:`STOCK_KERNEL_MAX_SCORE_BYTES`) and under the
  CPU's autocast (where stock runs its kernel too). With bool masks, given stock's merged mask, up
  to :data:`STOCK_KERNEL_MASKED_MAX_SCORE_BYTES`, and never where a query sees no key;
* ``"stock ops"``: stock's Python path op for op given ``[b_q; 0; b_v]``, for other calls with
  weights, without masks or with a bool padding mask under which every query sees a key, whose
  scores are small (:data:`STOCK_OPS_MAX_SCORE_BYTES`; for
  batch-first calls without a graph, under :data:`ONE_PASS_FROM_SCORE_BYTES`; for sequence-first
  calls other than self-attention, :data:`STOCK_OPS_SEQUENCE_FIRST_MAX_SCORE_BYTES`);
* ``"sdpa"``: the same self-attention without weights, in slim's fewest ops: one projection,
  ``scaled_dot_product_attention``, the output projection;
* ``"general"``: slim's general path, every feature (masks, weights, appended tokens, other
  layouts), and slim's options around it (the equivariance check, skipped weights).

The rules and the measurements behind them are in ``benchmarks/RESULTS.md``, "Paths".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, cast

import torch
from torch import Tensor, nn

from . import _explicit_attention
from ._explicit_attention import below_checked_size, forced_rows
from ._features import INSPECTION, UNREAD, load_feature
from ._stock_checks import (
    AttentionCall,
    a_row_sees_no_key,
    module_records_graph,
    stock_returns_batch_major,
)
from ._swap import FOLDED_VALUE_BIAS
from ._torch_compat import is_symbolic_call

__all__ = [
    "ONE_PASS_FROM_SCORE_BYTES",
    "PATHS_TAKEN",
    "STOCK_KERNEL_MASKED_MAX_SCORE_BYTES",
    "STOCK_KERNEL_MAX_SCORE_BYTES",
    "SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES",
    "STOCK_OPS_MAX_SCORE_BYTES",
    "STOCK_OPS_SEQUENCE_FIRST_MAX_SCORE_BYTES",
    "CallPlan",
    "choose_path",
    "forcing_blocks",
    "stock_layout",
]


class CallPlan(NamedTuple):
    """What :func:`choose_path` decided for one call, decided once and read by the path that runs it.

    path: one of those this module's docstring names. why: why the call could not take a shorter
    path (``""`` where it takes one). symbolic: the call's tensors may not be real ones
    (:func:`~slim_mha._torch_compat.is_symbolic_call`), ``None`` where the choice never asked.
    batch_major: stock returns this call's output as ``(B, L, E)`` memory (its fast path), ``None``
    where the choice never asked. drops_weights: the module skips unread weights and the call's
    caller provably discards them (:mod:`slim_mha.unread_weights`): slim's own path computes none.
    """

    path: str
    why: str = ""
    symbolic: bool | None = None
    batch_major: bool | None = None
    drops_weights: bool = False


# What each path is, in the words explain prints where choose_path gives no reason (it names why a
# call could not take a shorter path, and a path it takes without one needs none).
PATHS_TAKEN = {
    "traced": "torch.fx records the call, as it records stock's",
    "nested": "nested tensors: stock's native kernel, the only one that takes them",
    "recorded": "attention maps are being recorded (slim_mha.recording_attention)",
    "stock kernel": "self-attention where stock's fast path runs its kernel: stock's own kernel given [b_q; 0; b_v]",
    "stock ops": "a call with weights where stock's ops are the faster: stock's ops without the key bias, the floor",
    "sdpa": "self-attention without weights: one projection, scaled_dot_product_attention, the output projection",
    "general": "slim's own path",
}

# Self-attention without weights takes stock's native kernel where its scores fit in this many
# bytes: there the kernel is faster and the memory slim saves is small. On the CPU in bf16 the
# kernel beats SDPA at every size of the quick matrix (slim's own path read 0.72x-0.82x); in fp32
# only at the smallest (0.90x-0.93x at L=64); in fp16 stock's kernel is slow on the CPU; CUDA has not
# been measured, and keeps slim's path (benchmarks/RESULTS.md, "Paths").
STOCK_KERNEL_MAX_SCORE_BYTES = {
    ("cpu", torch.float32): 2 << 20,
    ("cpu", torch.bfloat16): 32 << 20,
}

# Self-attention with bool masks, in inference, takes stock's native kernel given [b_q; 0; b_v] and
# stock's own merged mask where stock's fast path would, up to scores of this many bytes, keyed by
# (device, dtype, need_weights): there the kernel beats slim's own path by 3% or more in quiet medians,
# above it slim's own path wins. In bf16 without weights slim's path wins at every size measured, so
# that entry is absent; CUDA has not been measured (benchmarks/one_answer_ab/README.md).
STOCK_KERNEL_MASKED_MAX_SCORE_BYTES = {
    ("cpu", torch.float32, True): 64 << 10,
    ("cpu", torch.float32, False): 8 << 10,
    ("cpu", torch.bfloat16, True): 16 << 10,
}

# Calls with weights, without masks or with a bool padding mask, that stock's kernel does not take run stock's Python path op
# for op, given ``[b_q; 0; b_v]``, where their scores fit in this many bytes: there its few ops take
# less time than slim's own path spends in Python. Above it slim's own path wins. Measured on the CPU
# in fp32 and bf16; CUDA has not been measured and keeps slim's path (benchmarks/RESULTS.md, "Paths").
STOCK_OPS_MAX_SCORE_BYTES = {
    ("cpu", torch.float32): 256 << 10,
    ("cpu", torch.bfloat16): 64 << 10,
}

# With ``skip_unread_weights``, a call whose caller discards the weights takes slim's own path
# without them, except a call stock's kernel runs with weights whose scores fit in this many bytes,
# keyed by (device, dtype, masked): there the kernel, weights and all, is still the faster. On the
# CPU in fp32 it is faster by 4-53% up to 256 KiB and slower by 3-5% at 512 KiB; with a padding mask
# faster by 13-44% up to 32 KiB and slower by 12% at 64 KiB. Beside a busy process the kernel is
# within 2% at 256 KiB, and with a mask 5-7% slower than skipping at 32 KiB, yet still at or above
# stock there, where skipping reads 0.91x of stock quiet. In bf16 the skip is faster by 6-18% from
# 32 KiB (within 2% at 4 KiB), and CUDA has not been measured: there the skip always applies
# (benchmarks/skip_or_kernel.py, benchmarks/smallest_calls/README.md).
SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES = {
    ("cpu", torch.float32, False): 256 << 10,
    ("cpu", torch.float32, True): 32 << 10,
}

# Sequence-first calls with weights other than self-attention (query, key and value not one tensor:
# DETR's decoder makes two, its cross-attention and its self-attention over target plus positions)
# take stock's ops up to this many bytes of scores instead. At B=2 E=256 H=8 with a padding mask, in
# one process, up to 2.4 MiB: slim's own path read 0.78x-0.97x of stock, stock's ops 0.98x-1.03x; with
# the key and value one tensor 0.92x-1.05x and 0.995x-1.02x, the own path ahead only at 2.4 MiB. From
# 5.8 MiB the own path wins in inference (1.01x-1.21x against 0.98x-1.01x) and is within 1% in
# training but once (0.95x against 0.99x at 9.8 MiB, query is key). Batch-first calls read alike on
# both paths, so they keep the limit above; bf16 and CUDA have not been measured
# (benchmarks/small_cross/README.md).
STOCK_OPS_SEQUENCE_FIRST_MAX_SCORE_BYTES = {("cpu", torch.float32): 4 << 20}

# Except for batch-first calls without a graph or dropout from this many bytes of scores on: there
# slim's one pass wins, as it projects the caller's layout where stock's ops first copy every input
# sequence-first (benchmarks/RESULTS.md, "Small shapes with weights").
ONE_PASS_FROM_SCORE_BYTES = 64 << 10


def choose_path(
    module: nn.MultiheadAttention, call: AttentionCall, *, recording: bool = True, as_real: bool = False
) -> CallPlan:
    """The plan ``call`` runs: the path it takes (one of those this module's docstring names), why it
    cannot take a shorter one, and the facts the choice learnt that the path needs again. The one owner
    of the choice, as stock's ``why_not_fast_path`` owns stock's, and like it one chain of questions,
    each asked once: the module's facts, then self-attention's paths, then stock's ops.

    ``as_real``: take fake tensors (``FakeTensorMode``) as the real ones they stand for, to tell which
    path a call would take on a device this machine lacks (``tests/test_fake_cuda.py``); a call on
    fake tensors itself runs slim's own path, which takes them.

    Cheap on purpose: at the sizes of set models a call takes a tenth of a millisecond, and every
    microsecond here is a percent of it. So the module's state is read from its dictionaries, and the
    shortest paths cross no other function of ours but :func:`_module_facts`.
    """
    query, key, value, key_padding_mask, need_weights, attn_mask, _, is_causal = call
    if isinstance(query, torch.fx.Proxy):
        return CallPlan("traced")
    if query.is_nested or key.is_nested or value.is_nested:
        return CallPlan("nested")
    if recording and INSPECTION.recording and cast(Callable, INSPECTION.watched)(module):
        return CallPlan("recorded", "attention maps are being recorded (slim_mha.recording_attention)")
    symbolic = is_symbolic_call(query)
    stand_ins = not as_real and (symbolic or type(query) is not Tensor)
    # Read off the flags, not `query.device`: building a device object costs a percent of a small call.
    device = "cuda" if query.is_cuda else "cpu"  # the two that _module_facts lets through
    why, fast = _module_facts(module, query, stand_ins)
    state = module.__dict__
    # skip_unread_weights: slim's own path without the weights where the caller provably discards
    # them, but for small calls stock's kernel runs (with weights, still the faster). The proof is
    # asked in this frame, which forward calls (it reads forward's caller), before the kernel's
    # questions where the call is too large for the kernel to be kept. Without the proof, the call
    # takes the path it would take without the option, weights and all.
    skipping = need_weights and module.skip_unread_weights
    small = False  # small enough for stock's kernel to be kept, should it run the call
    if skipping:
        if UNREAD.discarded is None:  # skip_unread_weights set by hand, before the feature was loaded
            load_feature("unread weights")
        masked = key_padding_mask is not None or attn_mask is not None
        kernel_up_to = SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES.get((device, query.dtype, masked), -1)
        small = (_packed_score_bytes(module, query, key, value) or kernel_up_to + 1) <= kernel_up_to
        if not small and cast(Callable, UNREAD.discarded)(module, query):
            return _general(module, call, fast, _SKIPPING, symbolic, drops_weights=True)
    plan = None  # slim's own path for a reason found below, else none yet
    if why:
        plan = _general(module, call, fast, why, symbolic)
    elif query is key and key is value and not is_causal and state["_qkv_same_embed_dim"]:
        if key_padding_mask is not None or attn_mask is not None:
            if not fast:  # the module's part of stock's test, which training fails: stock's Python path
                plan = CallPlan("general", _MASKS_OFF_STOCKS_FAST_PATH, symbolic, batch_major=False)
            else:
                plan = _masked_self_attention_path(module, call, device, symbolic)
        # Plain self-attention: stock's kernel or "sdpa" where one runs it, else slim's own path.
        # Stock's fast-path test reads CUDA's autocast alone: under the CPU's it still runs its
        # native kernel, and so does slim. Elsewhere under autocast stock runs its Python path, which
        # slim's own path beats (2.13x in inference, 1.03x-1.05x in training, at B=8 L=128 E=256).
        elif (autocast := torch.is_autocast_enabled(device)) and device == "cuda":
            plan = CallPlan(
                "general", "autocast on CUDA, where stock runs its Python path", symbolic, batch_major=False
            )
        elif torch.is_grad_enabled() and module_records_graph(module, query):
            plan = CallPlan("general", "a graph is recorded", symbolic, batch_major=False)
        elif state["training"] and state["dropout"] > 0.0:
            plan = CallPlan("general", "attention dropout", symbolic, batch_major=False)
        else:
            batch_first, heads, size = state["batch_first"], state["num_heads"], query.element_size()
            batch, length = query.shape[:2] if batch_first else (query.shape[1], query.shape[0])
            if need_weights and fast and below_checked_size(batch, heads, length, length, size):
                plan = CallPlan("stock kernel", "", symbolic)
            elif need_weights:
                too_large = "weights stock's fast path would not compute, or too large to check"
                plan = _general(module, call, fast, too_large, symbolic)
            elif fast and (
                autocast  # under the CPU's autocast always: stock runs its kernel there
                or batch * heads * length * length * size <= STOCK_KERNEL_MAX_SCORE_BYTES.get((device, query.dtype), -1)
            ):
                return CallPlan("stock kernel", "", symbolic)
            else:
                # Stock's layout: its kernel's (B, L, E) where it runs, else its Python path's (L, B, E);
                # the rest of stock's fast-path test is this path's own entry condition.
                return CallPlan("sdpa", "", symbolic, batch_major=batch_first and fast)
    if small and (plan is None or plan.path != "stock kernel") and cast(Callable, UNREAD.discarded)(module, query):
        return _general(module, call, fast, _SKIPPING, symbolic, drops_weights=True)
    if why or (plan is not None and plan.path == "stock kernel"):
        return cast(CallPlan, plan)
    # Calls with weights that no kernel path takes: stock's ops where they are the faster.
    largest = STOCK_OPS_MAX_SCORE_BYTES.get((device, query.dtype))
    if not state["batch_first"] and not (query is key and key is value):  # DETR's calls, say
        largest = STOCK_OPS_SEQUENCE_FIRST_MAX_SCORE_BYTES.get((device, query.dtype), largest)
    if largest is not None and need_weights and attn_mask is None and not is_causal:
        score_bytes = _packed_score_bytes(module, query, key, value)
        if score_bytes is not None and score_bytes <= largest:
            one_pass = (
                state["batch_first"]
                and score_bytes >= ONE_PASS_FROM_SCORE_BYTES
                and not (state["training"] and state["dropout"] > 0.0)
            )
            # The padding mask last: it reads the mask on the host, which a one-pass call need not.
            if (not one_pass or module_records_graph(module, query, key, value)) and _stock_ops_take(
                module, query, key, key_padding_mask
            ):
                return CallPlan("stock ops", "", symbolic)
    return plan or _general(module, call, fast, "masks or cross-attention", symbolic)


def _general(
    module: nn.MultiheadAttention, call: AttentionCall, fast: bool, why: str, symbolic: bool, drops_weights=False
) -> CallPlan:
    """Slim's own path for ``why``, with stock's layout for the call (``fast``: the module's part of
    stock's fast-path test, as :func:`_module_facts` found it)."""
    return CallPlan("general", why, symbolic, stock_layout(module, call, fast), drops_weights)


def stock_layout(module: nn.MultiheadAttention, call: AttentionCall, fast: bool | None = None) -> bool:
    """Whether stock returns ``call``'s output as ``(B, L, E)`` memory (its fast path): the module's part
    of stock's fast-path test (``fast``, where the caller knows it) and the call's part
    (:func:`stock_returns_batch_major`). Without ``fast``, for a call that no plan decided (a
    recomputation of the maps, or of the equivariance check), the module's part is read afresh."""
    query, key, value, key_padding_mask, _, attn_mask, _, _ = call
    if fast is None:
        _, fast = _module_facts(module, query, True)  # the module's part alone: no reason is read here
    return fast and stock_returns_batch_major(module, query, key, value, attn_mask, key_padding_mask)


_MASKS_OFF_STOCKS_FAST_PATH = "masks, on a call stock's fast path would not take"
_SKIPPING = "slim's own option skip_unread_weights"


def _masked_self_attention_path(
    module: nn.MultiheadAttention, call: AttentionCall, device: str, symbolic: bool
) -> CallPlan:
    """For self-attention with masks on a module that passes its part of stock's fast-path test:
    ``"stock kernel"`` where stock's fast path would run its kernel with the masks and it is the
    faster (:data:`STOCK_KERNEL_MASKED_MAX_SCORE_BYTES`), else ``"general"`` and why (``symbolic``
    goes into the plan as it is). Never where a query sees no key: the kernel turns that row to NaN."""
    query, attn_mask, key_padding_mask = call.query, call.attn_mask, call.key_padding_mask
    batch_major = stock_returns_batch_major(module, query, query, query, attn_mask, key_padding_mask)
    largest = STOCK_KERNEL_MASKED_MAX_SCORE_BYTES.get((device, query.dtype, call.need_weights))
    if largest is None:
        why = "masks, where stock's kernel with masks is not the faster (or not measured)"
        return CallPlan("general", why, symbolic, batch_major)
    state = module.__dict__
    if not state["batch_first"]:  # stock's fast path takes batch-first calls alone
        return CallPlan("general", _MASKS_OFF_STOCKS_FAST_PATH, symbolic, False)
    batch, length = query.shape[:2]
    if batch * state["num_heads"] * length * length * query.element_size() > largest:
        why = "masks, on scores larger than stock's kernel is the faster at"
        return CallPlan("general", why, symbolic, batch_major)
    if not batch_major:
        return CallPlan("general", _MASKS_OFF_STOCKS_FAST_PATH, symbolic, False)
    if call.need_weights and not below_checked_size(batch, state["num_heads"], length, length, query.element_size()):
        return CallPlan("general", "weights too large to check", symbolic, True)
    if a_row_sees_no_key(batch, length, attn_mask, key_padding_mask):
        why = "a query masked from every key, which stock's kernel turns to NaN"
        return CallPlan("general", why, symbolic, True)
    return CallPlan("stock kernel", "", symbolic, True)


def _stock_ops_take(module: nn.MultiheadAttention, query: Tensor, key: Tensor, key_padding_mask) -> bool:
    """Whether stock's ops take this call's padding mask as they are written: none, or a bool
    ``(B, S)`` one under which every query sees a key (stock's ops turn a row that sees none to NaN).
    Other masks, and masks of another shape (stock's error), go to slim's own path."""
    if key_padding_mask is None:
        return True
    batch_axis = 0 if module.__dict__["batch_first"] else 1
    batch, source = query.shape[batch_axis], key.shape[1 - batch_axis]
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (batch, source):
        return False
    return not a_row_sees_no_key(batch, source, None, key_padding_mask)


def _packed_score_bytes(module: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor) -> int | None:
    """The bytes of the scores of a batched call that stock's Python path would project with the
    packed weight, every head's: ``B·H·L·S`` elements of the query's dtype. None where it would not, or
    where stock's checks would refuse the query, key or value: slim's own path then raises stock's error."""
    state, shape, key_shape = module.__dict__, query.shape, key.shape
    if not state["_qkv_same_embed_dim"] or len(shape) != 3 or len(key_shape) != 3 or key_shape != value.shape:
        return None
    batch_axis = 0 if state["batch_first"] else 1
    if key_shape[batch_axis] != shape[batch_axis] or key_shape[2] != shape[2]:
        return None
    batch, length, source = shape[batch_axis], shape[1 - batch_axis], key_shape[1 - batch_axis]
    return batch * state["num_heads"] * length * source * query.element_size()


def _module_facts(module: nn.MultiheadAttention, query: Tensor, stand_ins: bool) -> tuple[str, bool]:
    """Two facts, read in one pass over the module's dictionaries: the first reason the call can take
    no path but slim's own (``""`` where none), and whether the module passes its part of stock's
    fast-path test (the switch on, eval, an even number of heads; the call's part is
    :func:`~slim_mha._stock_checks.stock_returns_batch_major`). ``stand_ins``: the call's tensors may
    not be real ones (traced, transformed, faked or a subclass), and are not taken as such."""
    state, parameters = module.__dict__, module._parameters
    fast = torch.backends.mha.get_fastpath_enabled() and not state["training"] and not state["num_heads"] % 2
    if parameters.get("bias_k") is not None or parameters.get("bias_v") is not None or state["add_zero_attn"]:
        return "appended tokens, where the key bias matters", fast
    out_parameters = cast(nn.Module, module._modules["out_proj"])._parameters
    weight, bias = parameters.get("in_proj_weight"), parameters.get("in_proj_bias")
    out_weight, out_bias = out_parameters.get("weight"), out_parameters.get("bias")
    if bias is None or out_weight is None or out_bias is None or (weight is None and state["_qkv_same_embed_dim"]):
        return "no input or output bias, or a parametrized projection", fast
    if state.get(FOLDED_VALUE_BIAS):
        return "a folded value bias, which refuses rows masked from every key", fast
    if stand_ins:
        return "a trace, transform, fake tensor or tensor subclass", fast
    shape = query.shape
    if len(shape) != 3 or shape[2] != state["embed_dim"] or not (shape[0] and shape[1]):
        return "an unbatched or empty input, or one of another width (stock's error)", fast
    if not (query.is_cpu or query.is_cuda):
        return "a device other than cpu and cuda", fast
    dtype = query.dtype
    if (
        bias.dtype != dtype
        or out_weight.dtype != dtype
        or out_bias.dtype != dtype
        or (weight is not None and weight.dtype != dtype)
    ):
        return "parameters of another dtype than the query", fast
    if torch.overrides.has_torch_function((bias, out_weight, out_bias)):
        return "tensor subclasses among the parameters", fast
    return "", fast


@contextmanager
def forcing_blocks(block_bytes: int) -> Iterator[None]:
    """For tests and ``bench run --blocks``: averaged weights without a graph computed in blocks
    of query rows holding at most ``block_bytes`` of scores, even where one pass fits, and every call
    on slim's own path, which alone computes blocks. It swaps this module's facts of the module and
    the memory guard's block rule for the block's duration (one thread): no call reads a switch."""
    facts, rows = _module_facts, _explicit_attention.rows_per_block

    def forced_facts(*args) -> tuple[str, bool]:
        why, fast = facts(*args)
        return why or "weights forced into blocks", fast

    globals()["_module_facts"] = forced_facts
    _explicit_attention.rows_per_block = lambda q, src_len: forced_rows(q, src_len, block_bytes)
    try:
        yield
    finally:
        globals()["_module_facts"] = facts
        _explicit_attention.rows_per_block = rows
