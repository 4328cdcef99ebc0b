"""Stock ``nn.MultiheadAttention``'s call (:class:`AttentionCall`, its arguments recorded once and passed
whole), its input checks and mask rules, as plain Python, and the call as they leave it for slim's
own path (:class:`PreparedCall`); whether autograd records a call; and stock's fast-path rules.

Stock calls the private ``torch.nn.functional._mha_shape_check``, ``_canonical_mask`` and
``_none_or_dtype``. Calling them from here would tie us to torch's private API, and on older
torch (2.4 to about 2.5) Dynamo lists them as "in-graph" torch functions instead of inlining them:
``_mha_shape_check`` then fails ``torch.compile(fullgraph=True)`` and strict ``torch.export`` with
"torch.* op returned non-Tensor bool". These copies are ordinary functions that Dynamo inlines on
every torch version, and they raise stock's exceptions with stock's wording (identical from torch
2.4 to 2.13; tests/test_stock_checks.py compares them with the installed torch's).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._torch_compat import (
    ACCELERATOR_DEVICES,
    sdpa_zeroes_rows_masked_from_every_key,
    stock_layer_unfuses_for_hooks,
)

# Observed once, at import: read inside compiled code, where a first call would be traced.
_HOOKS_UNFUSE = stock_layer_unfuses_for_hooks()
_SDPA_ZEROES_EMPTY_ROWS = sdpa_zeroes_rows_masked_from_every_key()


class AttentionCall(NamedTuple):
    """``forward``'s arguments in stock's order, so ``super().forward(*call)`` is stock's call.

    A NamedTuple: immutable (a recomputation makes a new one with ``_replace``), and traced by
    Dynamo on every supported torch.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    key_padding_mask: Tensor | None
    need_weights: bool
    attn_mask: Tensor | None
    average_attn_weights: bool
    is_causal: bool


class PreparedCall(NamedTuple):
    """A call as stock's checks before its projections leave it, and what slim's own path reads of
    it (:func:`prepare_call`; the checks after the projections are :func:`attention_mask`'s)."""

    query: Tensor  # batched: an unbatched call is a batch of one, batch-first
    key: Tensor
    value: Tensor
    batch_first: bool  # the layout of the three above
    fused: str  # stock's fused input projection: "qkv" (one matmul), "kv" (keys and values), "" (none)
    weights_graph: bool  # a call with weights that autograd records (asked of those alone: none else reads it)
    batch_major: bool  # stock returns (B, L, E) memory: its native fast path, or an unbatched call
    sizes: tuple[int, int, int]  # (B, L, S): the batch, the queries, the keys before appended tokens
    attn_mask: Tensor | None  # canonical (a bool mask made additive), its shape checked by attention_mask
    key_padding_mask: Tensor | None  # likewise
    is_causal: bool  # SDPA may take the is_causal hint instead of a mask (both masks are then None)


def prepare_call(module, call: AttentionCall, *, batch_major: bool) -> PreparedCall:
    """Stock's checks of ``call`` to ``module`` that come before its projections, in stock's order,
    with its exceptions (the masks' shapes come after: :func:`attention_mask`); and the facts slim's
    own path reads: the layout, the fusing, whether stock would return batch-major memory, and
    whether autograd records a call with weights. ``batch_major``: whether stock returns the batched
    call's output as ``(B, L, E)`` memory, as the call's plan found it."""
    query, key, value, key_padding_mask, need_weights, attn_mask, _, is_causal = call
    state = module.__dict__  # read from the dictionary: a call of the smallest sizes is a few dozen microseconds
    batched = is_batched_mha_input(query, key, value, key_padding_mask, attn_mask, state["num_heads"])
    if not batched:  # a batch of one, batch-first: new tensors, so stock projects them apart too
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    fast_path = batched and batch_major
    batch_first = state["batch_first"] or not batched
    if batch_first:
        sizes = (query.shape[0], query.shape[1], key.shape[1])
    else:
        sizes = (query.shape[1], query.shape[0], key.shape[0])
    attn_mask, key_padding_mask, is_causal = canonical_masks(
        attn_mask, key_padding_mask, is_causal, need_weights, query.dtype, kernel_sizes=sizes if fast_path else None
    )
    same_width = state["_qkv_same_embed_dim"]
    check_embed_dims(query, key, value, state["embed_dim"], same_width)
    fused = "qkv" if same_width and query is key and key is value else "kv" if same_width and key is value else ""
    weights_graph = need_weights and module_records_graph(module, query, key, value, attn_mask, key_padding_mask)
    batch_major = fast_path or not batched
    return PreparedCall(
        query, key, value, batch_first, fused, weights_graph, batch_major, sizes, attn_mask, key_padding_mask, is_causal
    )


def records_graph(*tensors: Tensor | None) -> bool:
    """Whether autograd records an op on these tensors: grad mode is on and one of them requires grad
    (``None`` entries skipped). The one copy of the rule: path choice, stock's fast-path tests and
    slim's own path read it."""
    if not torch.is_grad_enabled():
        return False
    for tensor in tensors:  # a loop, not any(...): a generator is a frame of its own on every call
        if tensor is not None and tensor.requires_grad:
            return True
    return False


def module_records_graph(module, *inputs: Tensor | None) -> bool:
    """:func:`records_graph` of a call of an attention ``module`` on ``inputs`` (its tensors and masks)
    and of every parameter the call reads: the module's, its output projection's, and the originals
    behind parametrized ones (``torch.nn.utils.parametrize``). Read from the dictionaries, the
    inputs first: right after a call's large ops each look-up costs several times its idle price."""
    if not torch.is_grad_enabled():
        return False
    if records_graph(*inputs):
        return True
    for owner in (module, module._modules["out_proj"]):  # stock's __init__ registers out_proj, always
        for parameter in owner._parameters.values():  # loops, not any(...): no generator frames per call
            if parameter is not None and parameter.requires_grad:
                return True
        if "parametrizations" in owner._modules:
            for parameter in owner._modules["parametrizations"].parameters():
                if parameter.requires_grad:
                    return True
    return False


def is_batched_mha_input(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    num_heads: int,
) -> bool:
    """Stock's shape check: ``True`` for batched 3-D inputs, ``False`` for unbatched 2-D ones.

    Raises ``AssertionError`` with stock's message on any other combination of dimensions.
    """
    if query.dim() == 3:
        _check_ranks("batched (3-D)", 3, key, value, key_padding_mask, attn_mask)
        return True
    if query.dim() == 2:
        _check_ranks("unbatched (2-D)", 2, key, value, key_padding_mask, attn_mask)
        expected_shape = (num_heads, query.shape[0], key.shape[0])
        if attn_mask is not None and attn_mask.dim() == 3 and attn_mask.shape != expected_shape:
            raise AssertionError(f"Expected `attn_mask` shape to be {expected_shape} but got {attn_mask.shape}")
        return False
    raise AssertionError(f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor")


def check_embed_dims(query: Tensor, key: Tensor, value: Tensor, embed_dim: int, same_embed_dim: bool) -> None:
    """Stock's width checks, with F.multi_head_attention_forward's exception types and wording."""
    if query.shape[-1] != embed_dim:
        raise AssertionError(f"was expecting embedding dimension of {embed_dim}, but got {query.shape[-1]}")
    if same_embed_dim:
        if key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
    elif key.shape[:2] != value.shape[:2]:
        raise AssertionError(f"key's sequence and batch dims {key.shape[:2]} do not match value's {value.shape[:2]}")


def _check_ranks(
    query_kind: str, rank: int, key: Tensor, value: Tensor, key_padding_mask: Tensor | None, attn_mask: Tensor | None
) -> None:
    """The checks stock makes for a ``rank``-D query: key and value of the same rank, a padding mask of
    one less, an attention mask of 2 or 3. ``query_kind`` is stock's wording, e.g. ``batched (3-D)``."""
    if key.dim() != rank or value.dim() != rank:
        raise AssertionError(
            f"For {query_kind} `query`, expected `key` and `value` to be {rank}-D"
            f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
        )
    if key_padding_mask is not None and key_padding_mask.dim() != rank - 1:
        raise AssertionError(
            f"For {query_kind} `query`, expected `key_padding_mask` to be `None` or {rank - 1}-D"
            f" but found {key_padding_mask.dim()}-D tensor instead"
        )
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise AssertionError(
            f"For {query_kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D"
            f" but found {attn_mask.dim()}-D tensor instead"
        )


def additive_mask(
    mask: Tensor | None,
    mask_name: str,
    target_dtype: torch.dtype,
    *,
    other: Tensor | None = None,
    other_name: str = "",
) -> Tensor | None:
    """Stock's mask canonicalisation: a bool mask becomes ``0`` / ``-inf`` in ``target_dtype``.

    A float mask is returned as it is. Other dtypes raise stock's ``AssertionError``; a mask whose
    dtype differs from ``other``'s gets stock's deprecation warning.
    """
    if mask is None:
        return None
    is_float = torch.is_floating_point(mask)
    if mask.dtype != torch.bool and not is_float:
        raise AssertionError(f"only bool and floating types of {mask_name} are supported")
    if other is not None and mask.dtype != other.dtype:
        warnings.warn(
            f"Support for mismatched {mask_name} and {other_name} is deprecated. Use same type for both instead.",
            stacklevel=1,  # stock's: the warning names this line, as stock's names its own
        )
    if is_float:
        return mask
    return torch.zeros_like(mask, dtype=target_dtype).masked_fill_(mask, float("-inf"))


def canonical_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    need_weights: bool,
    dtype: torch.dtype,
    *,
    kernel_sizes: tuple[int, int, int] | None = None,
) -> tuple[Tensor | None, Tensor | None, bool]:
    """Stock's mask rules before its projections: bool masks made additive in ``dtype``, the masks'
    dtypes checked, and whether SDPA may use ``is_causal`` instead of them (only when no padding
    mask and no weights are involved, exactly as stock decides; both masks are then ``None``).

    ``kernel_sizes``: ``(B, L, S)`` where stock would run its native kernel on this call, which
    ignores ``is_causal`` and raises a ``RuntimeError`` for a padding mask of the wrong shape.
    """
    if kernel_sizes is not None:
        batch, _, src_len = kernel_sizes
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, src_len):
            raise RuntimeError("For mask_type == 1 mask shape should be (B, L)")  # the kernel's check
        is_causal = False  # the kernel takes no hint: it ignores it, with a mask or without
    key_padding_mask = additive_mask(
        key_padding_mask, "key_padding_mask", dtype, other=attn_mask, other_name="attn_mask"
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
            "method `generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        return None, None, True
    return additive_mask(attn_mask, "attn_mask", dtype), key_padding_mask, False


def attention_mask(module, prepared: PreparedCall) -> Tensor | None:
    """Stock's checks after its projections: the canonical masks' shapes and the keys' batch, with
    stock's exception types; the masks merged into one additive mask broadcastable to ``(B, H, L, S')``,
    the columns of appended keys (``add_bias_kv``, ``add_zero_attn`` tokens) left open."""
    attn_mask, key_padding_mask = prepared.attn_mask, prepared.key_padding_mask
    batch, tgt_len, src_len = prepared.sizes
    appended = int(module.bias_k is not None) + int(module.add_zero_attn)
    if attn_mask is not None:
        attn_mask = _shape_attn_mask(attn_mask, tgt_len, src_len, batch, module.num_heads)
        if appended:
            attn_mask = F.pad(attn_mask, (0, appended))
    # Stock fails here, reshaping the keys to the queries' batch; SDPA would broadcast a batch of one.
    key_batch = prepared.key.shape[0 if prepared.batch_first else 1]
    if key_batch != batch:
        raise RuntimeError(
            f"key and value have a batch of {key_batch} where query has {batch}: each query sequence attends "
            "to the key sequence of its own batch entry, so the batch sizes must match (stock raises here too)"
        )
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (batch, src_len):
            raise AssertionError(
                f"Expected key_padding_mask of shape {(batch, src_len)} (batch, source length), "
                f"but got {tuple(key_padding_mask.shape)}"
            )
        if appended:
            key_padding_mask = F.pad(key_padding_mask, (0, appended))
        key_padding_mask = key_padding_mask.view(batch, 1, 1, src_len + appended)  # (B, 1, 1, S')
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    return attn_mask


def a_row_sees_no_key(batch: int, length: int, attn_mask: Tensor | None, key_padding_mask: Tensor | None) -> bool:
    """Whether a query of a self-attention call over ``length`` tokens is masked from every key, with the
    masks read as stock's fused kernels read them (bool, or non-zero: masked): those kernels turn such
    a row to NaN. ``attn_mask`` ``(L, L)`` or ``(B·H, L, L)``, ``key_padding_mask`` ``(B, L)``. Reads
    the masks on the host; a mask of the wrong shape is left to the path that raises stock's error."""
    if attn_mask is None and key_padding_mask is None:
        return False
    if (attn_mask is not None and tuple(attn_mask.shape[-2:]) != (length, length)) or (
        key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, length)
    ):
        return False
    if attn_mask is not None and attn_mask.dim() == 3 and attn_mask.shape[0] % batch:
        return False
    if attn_mask is None and key_padding_mask is not None and key_padding_mask.dtype == torch.bool:
        return True in key_padding_mask.all(dim=-1).tolist()  # the common case: one op and a copy to the host
    masked = [m if m.dtype == torch.bool else m != 0 for m in (attn_mask, key_padding_mask) if m is not None]
    if attn_mask is not None and attn_mask.dim() == 3:  # (B·H, L, S) -> (B, H, L, S)
        masked[0] = masked[0].view(batch, -1, *masked[0].shape[-2:])
    if key_padding_mask is not None:  # (B, S) -> (B, 1, 1, S), beside a (L, S) or (B, H, L, S) mask
        masked[-1] = masked[-1].view(batch, 1, 1, length)
    rows = masked[0] if len(masked) == 1 else masked[0] | masked[1]
    return bool(rows.all(dim=-1).any())


def query_scale(head_dim: int) -> float:
    """``1/sqrt(D)``, computed as stock computes it, so that scaled queries are stock's bit for bit."""
    return math.sqrt(1.0 / float(head_dim))


def sdpa_needs_empty_rows_mended(query: Tensor) -> bool:
    """Whether SDPA on ``query``'s device may not give a row masked from every key its zero output
    and finite gradients by itself (:func:`~slim_mha._torch_compat.sdpa_zeroes_rows_masked_from_every_key`):
    then :func:`open_empty_rows` mends the call."""
    return not (query.is_cpu and _SDPA_ZEROES_EMPTY_ROWS)


def open_empty_rows(mask: Tensor, *, may_sync: bool) -> tuple[Tensor, Tensor | None]:
    """The answer for a query row masked from every key, the same on every path: SDPA's (torch 2.13's
    CPU kernels), a zero output row, zero weights and finite gradients. Stock's native kernel and its
    weights path give NaN there instead (pytorch#41508), as softmax over no key would.

    Returns ``mask`` (additive, broadcastable to ``(B, H, L, S)``) with such rows opened (0 where every
    key was ``-inf``), so the scores stay finite and their gradients too, and the rows ``(..., L or 1, 1)``,
    True where a row was masked from every key, for the caller to zero after the softmax. With
    ``may_sync`` (eager CPU calls, where reading a flag costs nothing) a mask without such rows is
    returned as it is, with ``None``; elsewhere the mend is made without a host sync.
    """
    empty = rows_masked_from_every_key(mask)
    if may_sync and not bool(empty.any()):
        return mask, None
    return mask.masked_fill(empty, 0.0), empty


def rows_masked_from_every_key(mask: Tensor) -> Tensor:
    """``(..., L or 1, 1)``, True where every key of an additive ``mask`` is ``-inf``: a query that sees no key."""
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def _shape_attn_mask(attn_mask: Tensor, tgt_len: int, src_len: int, batch: int, num_heads: int) -> Tensor:
    """2-D ``(L, S)`` stays; 3-D ``(B*H, L, S)`` becomes ``(B, H, L, S)``; stock's checks and messages."""
    if attn_mask.dim() == 2:
        if tuple(attn_mask.shape) != (tgt_len, src_len):
            raise RuntimeError(
                f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}."
            )
        return attn_mask
    if attn_mask.dim() == 3:
        expected = (batch * num_heads, tgt_len, src_len)
        if tuple(attn_mask.shape) != expected:
            raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {expected}.")
        return attn_mask.view(batch, num_heads, tgt_len, src_len)
    raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")


def stock_returns_batch_major(module, query: Tensor, key: Tensor, value: Tensor, attn_mask, key_padding_mask) -> bool:
    """Whether stock returns a batch-first call's output contiguous ``(B, L, E)``, not as a transposed
    view, for a module that passes its own part of stock's fast-path test (the switch on, eval, an even
    number of heads: :func:`slim_mha.paths.choose_path` asks that once per call).

    Stock's native fast path writes ``(B, L, E)``; its Python path computes in ``(L, B, E)`` and
    returns ``.transpose(1, 0)`` of it, strides ``(E, B*E, 1)``. The layout decides which elements a
    following dropout draws for which position (it draws in memory order), so slim returns stock's.
    This is the call's part of stock's fast-path test: stock's conditions, in stock's order. The
    module is read from its dictionaries: a small masked call asks this on every call, and each
    ``nn.Module`` attribute look-up costs a percent of it.
    """
    state, parameters = module.__dict__, module._parameters
    if (
        query.dim() != 3
        or not (query is key and key is value)
        or not state["batch_first"]
        or parameters.get("bias_k") is not None
        or parameters.get("bias_v") is not None
        or state["add_zero_attn"]
        or not state["_qkv_same_embed_dim"]
        or (attn_mask is not None and torch.is_floating_point(attn_mask))
        or (key_padding_mask is not None and torch.is_floating_point(key_padding_mask))
        or torch.is_autocast_enabled()
    ):
        return False
    weight, bias = parameters.get("in_proj_weight"), parameters.get("in_proj_bias")
    if weight is None or bias is None or query.dtype != weight.dtype or query.dtype != bias.dtype:
        return False  # without an input bias stock's kernel is not called: its Python path runs
    out_parameters = module._modules["out_proj"]._parameters
    tensors = [
        t for t in (query, weight, bias, out_parameters.get("weight"), out_parameters.get("bias")) if t is not None
    ]
    return not (
        torch.overrides.has_torch_function(tensors)
        or not all(t.is_cpu or t.is_cuda for t in tensors)
        or module_records_graph(module, query, attn_mask, key_padding_mask)
    )


def why_stock_layer_is_not_fused(
    layer, src: Tensor, src_mask: Tensor | None, src_key_padding_mask: Tensor | None
) -> str:
    """Why stock's ``nn.TransformerEncoderLayer.forward`` would not hand this call to its fused kernel
    (``torch._transformer_encoder_layer_fwd``), in stock's words and order; ``""`` where it would.

    The one copy of stock's rule: :func:`slim_mha.encoder_layer.layer_path` reads it, and
    ``tests/test_encoder_contract.py`` checks it against the calls stock's layer makes, case by case
    (hooks, masks, nesting, autocast, grad, each attribute), on every tested torch.
    """
    attention = layer.self_attn
    if not torch.backends.mha.get_fastpath_enabled():
        return "torch.backends.mha.get_fastpath_enabled() was not True"
    if src.dim() != 3:
        return f"input not batched; expected src.dim() of 3 but got {src.dim()}"
    if layer.training:
        return "training is enabled"
    if not attention.batch_first:
        return "self_attn.batch_first was not True"
    if attention.in_proj_bias is None:
        return "self_attn was passed bias=False"
    if not attention._qkv_same_embed_dim:
        return "self_attn._qkv_same_embed_dim was not True"
    if not layer.activation_relu_or_gelu:
        return "activation_relu_or_gelu was not True"
    if layer.norm1.eps != layer.norm2.eps:
        return "norm1.eps is not equal to norm2.eps"
    if src.is_nested and (src_key_padding_mask is not None or src_mask is not None):
        return "neither src_key_padding_mask nor src_mask are not supported with NestedTensor input"
    if attention.num_heads % 2:
        return "num_head is odd"
    if torch.is_autocast_enabled():  # without a device: CUDA's autocast alone, as stock reads it
        return "autocast is enabled"
    if _HOOKS_UNFUSE and any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules()):
        return "forward pre-/hooks are attached to the module"
    tensors = (
        src,
        attention.in_proj_weight,
        attention.in_proj_bias,
        attention.out_proj.weight,
        attention.out_proj.bias,
        layer.norm1.weight,
        layer.norm1.bias,
        layer.norm2.weight,
        layer.norm2.bias,
        layer.linear1.weight,
        layer.linear1.bias,
        layer.linear2.weight,
        layer.linear2.bias,
    )
    if torch.overrides.has_torch_function(tensors):
        return "some Tensor argument has_torch_function"
    if not all(t.device.type in ACCELERATOR_DEVICES for t in tensors):
        return f"some Tensor argument's device is neither one of {list(ACCELERATOR_DEVICES)}"
    if records_graph(*tensors):
        return (
            "grad is enabled and at least one of query or the input/output projection weights or biases requires_grad"
        )
    return ""
