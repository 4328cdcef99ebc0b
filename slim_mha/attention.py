"""SlimMultiheadAttention: stock ``nn.MultiheadAttention`` without the key bias, batch-first and lean."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._explicit_attention import attention_with_weights
from ._features import (
    CHECKS,
    INSPECTION,
    UNREAD,
    checks_wanted_by_environment,
    load_feature,
    resolve_options,
    resolve_skip_option,
)
from ._stock_checks import (
    AttentionCall,
    PreparedCall,
    additive_mask,
    attention_mask,
    open_empty_rows,
    prepare_call,
    query_scale,
    sdpa_needs_empty_rows_mended,
)
from ._swap import (
    FOLDED_VALUE_BIAS,
    has_folded_value_bias,
    prepare_scriptable,
    refuse_rows_masked_from_every_key,
    script_on_shadows,
)
from ._torch_compat import (
    STOCK_MHA,
    fx_proxy_of,
    is_symbolic_call,
    stock_head_split,
    stock_kernel,
)
from .bias import append_tokens, key_slot_zeroer, restore_stock_layout, without_key_bias
from .paths import PATHS_TAKEN, CallPlan, choose_path, stock_layout

__all__ = ["SlimMultiheadAttention", "slim_options"]


class SlimMultiheadAttention(nn.MultiheadAttention):
    r"""A drop-in ``nn.MultiheadAttention`` that computes stock's function without the key bias.

    Same constructor, parameters and ``forward`` as stock: the parameters are created and initialised
    by stock's own ``__init__``, so ``named_parameters()``, ``state_dict()``, optimizers, hooks,
    FSDP/DDP, ``torch.compile``, fx and parametrizations see exactly what they see on stock, with
    ``in_proj_bias`` a registered leaf ``Parameter`` of shape ``(3E,)``. What differs is the
    computation:

    * **No key bias.** ``b_k = in_proj_bias[E:2E]`` shifts every score of a query by the same
      ``q·b_k`` and softmax ignores such shifts, so the forward never adds it: its gradient is
      exactly zero and whatever value it holds, the output is stock's. Tokens appended after the
      projection are not shifted by stock, so there the maths keeps ``b_k``: with ``add_bias_kv`` the
      appended key is ``bias_k - b_k``, with ``add_zero_attn`` the zero key is ``-b_k`` (see
      :mod:`slim_mha.bias`); ``b_k`` then trains as on stock.
    * **One owner of the path.** :func:`slim_mha.paths.choose_path` picks stock's native kernel
      given ``[b_q; 0; b_v]`` where that is the floor, stock's ops given it for small calls with
      weights, else slim's lean path: one fused projection, heads as views in the caller's layout,
      ``scaled_dot_product_attention`` whenever weights are not requested.

    New options are keyword-only: ``check_equivariance`` (``None`` follows ``slim_mha.checking_equivariance()``
    and the ``SLIM_MHA_CHECK_EQUIVARIANCE`` environment variable) and ``check_equivariance_every``
    turn on the per-call permutation-equivariance assertion of :mod:`slim_mha.equivariance`;
    ``skip_unread_weights=True`` skips the weights of calls whose caller provably discards them
    (``attn(q, k, v)[0]``, ``out, _ = attn(q, k, v)``), see :mod:`slim_mha.unread_weights`.

    ``load_state_dict`` takes stock's layout and the key-bias-free layout that
    ``slim-mha-migrate strip`` writes (``q_proj_bias``/``v_proj_bias``, format version 1).
    """

    _scripted_as = STOCK_MHA  # what torch.jit.script compiles (slim_mha._swap)
    # Class-level defaults so that modules pickled before these options existed still run.
    check_equivariance: bool | None = None
    check_equivariance_every: int = 1
    skip_unread_weights: bool = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        check_equivariance: bool | None = None,
        check_equivariance_every: int = 1,
        skip_unread_weights: bool = False,
    ) -> None:
        options = slim_options(
            check_equivariance=check_equivariance,
            check_equivariance_every=check_equivariance_every,
            skip_unread_weights=skip_unread_weights,
        )
        script_on_shadows()
        # Stock registers and initialises every parameter, in its order and with its random draws.
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self.__dict__.update(options)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # The key-bias-free layout (format version 1) becomes stock's before stock's loading runs.
        # Without biases of our own its keys are left for torch to report as unexpected.
        if self.in_proj_bias is not None:
            restore_stock_layout(state_dict, prefix, embed_dim=self.embed_dim, error_msgs=error_msgs)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # Loaded weights are a model of their own: this module now computes stock's function of them.
        self.__dict__.pop(FOLDED_VALUE_BIAS, None)

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script`` compiles the stock module (or the user's subclass of it) holding these
        same parameters; the eager model is left as it is (:mod:`slim_mha._swap`)."""
        return prepare_scriptable(self)

    # ------------------------------------------------------------------------------------ forward

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Stock's ``forward``: same arguments, shapes, masks semantics and return values."""
        call = AttentionCall(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )
        plan = choose_path(self, call)
        if INSPECTION.explaining:
            cast(Callable, INSPECTION.note)(self, "attention", plan.path, plan.why or PATHS_TAKEN[plan.path])
        result = getattr(self, _RUNS[plan.path])(call, plan)
        # The check follows whatever path ran, so that checking changes no output, not even its last bits;
        # calls whose tensors hold no values (traced, compiled, transformed, faked) are not checked.
        if (self.check_equivariance or CHECKS.active) and not is_symbolic_call(query):
            if CHECKS.run is None:  # check_equivariance set by hand, before the check was loaded
                load_feature("check")
            cast(Callable, CHECKS.run)(self, result, call)
        return result

    def _slim_recorded(self, call: AttentionCall, plan: CallPlan) -> tuple[Tensor, Tensor | None]:
        """The call with every head's weights, on the path it takes with weights, handed to the open
        ``recording_attention`` blocks; returns what the caller asked for."""
        return cast(Callable, INSPECTION.record_call)(self, self._slim_unrecorded, self._slim_maps, call)

    def _slim_unrecorded(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        plan = choose_path(self, call, recording=False)
        if plan.path == "general":  # weights computed for the maps are not skipped
            return self._slim_general(call, plan=plan)
        return getattr(self, _RUNS[plan.path])(call, plan)

    def _slim_maps(self, call: AttentionCall, per_head: bool) -> Tensor:
        """The attention probabilities of ``call``, every head's ``(B, H, L, S)`` or their average
        ``(B, L, S)`` (unbatched: without ``B``), computed beside it: without dropout, a graph or a
        random draw (``recording_attention``). Averaged, the weights path may work in blocks of rows."""
        maps_call = call._replace(need_weights=True, average_attn_weights=not per_head)
        with torch.no_grad():
            return cast(Tensor, self._slim_general(maps_call, dropout_p=0.0)[1])

    def _slim_traced(self, call: AttentionCall, plan: CallPlan):
        # fx records the call as a caller writes it for stock: query, key and value, then the keywords
        # whose values differ from stock's defaults
        keywords = {
            name: value
            for name, value in call._asdict().items()
            if name in _STOCK_DEFAULTS and value is not _STOCK_DEFAULTS[name]
        }
        return fx_proxy_of(self, call.query, tuple(call[:3]), keywords)

    def _slim_stock_forward(self, call: AttentionCall, plan: CallPlan) -> tuple[Tensor, Tensor | None]:
        """Stock's own ``forward``: nested tensors, which only stock's native kernel takes."""
        return super().forward(*call)

    def _slim_stock_kernel(self, call: AttentionCall, plan: CallPlan) -> tuple[Tensor, Tensor | None]:
        """Stock's native kernel, given ``[b_q; 0; b_v]``: batch-first self-attention, called as stock's
        fast path calls it, its masks made canonical and merged by stock's rules and stock's own
        ``merge_masks`` (a sequence-first query, unmasked, goes in as a transposed view, its output
        comes back in stock's layout)."""
        batch_first = self.__dict__["batch_first"]
        query = call.query if batch_first else call.query.transpose(0, 1)  # (B, L, E), as a view
        mask, mask_type = None, None
        padding = call.key_padding_mask
        if call.attn_mask is None and padding is not None and padding.dtype == torch.bool and query.is_cpu:
            # The CPU kernel reads its mask as a bool one (masked where non-zero), so stock's additive
            # form of a bool padding mask reads back as the mask itself: it goes in as it is, without
            # the two ops that make it additive (tests/test_masked_kernel.py holds them bit for bit).
            mask, mask_type = padding, 1
        elif padding is not None or call.attn_mask is not None:
            key_padding_mask = additive_mask(
                call.key_padding_mask, "key_padding_mask", query.dtype, other=call.attn_mask, other_name="attn_mask"
            )
            mask, mask_type = self.merge_masks(
                additive_mask(call.attn_mask, "attn_mask", query.dtype), key_padding_mask, query
            )
        # Read from the dictionaries: each nn.Module attribute look-up costs a percent of a small call.
        p, out_p = self._parameters, cast(nn.Module, self._modules["out_proj"])._parameters
        bias = cast(Tensor, p["in_proj_bias"])
        out, weights = stock_kernel(
            query,
            query,
            query,
            query.shape[2],
            self.__dict__["num_heads"],
            cast(Tensor, p["in_proj_weight"]),
            # [b_q; 0; b_v] as _packed builds it, written out: the shortest path a call takes, no frame more
            key_slot_zeroer(bias.shape[0], bias.dtype, bias.device)(bias),
            cast(Tensor, out_p["weight"]),
            cast(Tensor, out_p["bias"]),
            mask,
            call.need_weights,
            call.average_attn_weights,
            mask_type,
        )  # (B, L, E), and (B, H, L, L), (B, L, L) or None
        if not batch_first:  # stock's (L, B, E), laid out as its Python path lays it out
            out = out.transpose(0, 1).contiguous()
        return out, weights

    def _slim_stock_ops(self, call: AttentionCall, plan: CallPlan) -> tuple[Tensor, Tensor | None]:
        """Stock's Python path with weights, without masks or with a bool padding mask under which every
        query sees a key, without the key bias: its products, softmax, dropout, copies and layouts, so
        its rounding, strides and random draws, in fewer view ops and without its argument checks,
        which are ``choose_path``'s. Parameters are read from their dictionaries: at the sizes this
        path takes, each attribute read is a percent of a call."""
        query, key, value = sequence_first(*call[:3]) if self.batch_first else call[:3]
        (length, batch, width), heads, p = query.shape, self.num_heads, self._parameters
        # choose_path takes this path only with the packed projection and its bias: both are tensors
        weight, bias = cast(Tensor, p["in_proj_weight"]), cast(Tensor, p["in_proj_bias"])
        q, k, v = stock_projected_heads(query, key, value, weight, bias, heads)  # (B·H, len, D)
        if call.key_padding_mask is None:
            weights = torch.bmm(q * query_scale(q.shape[2]), k.transpose(1, 2)).softmax(-1)  # (B·H, L, S)
        else:  # stock's additive form of the bool padding mask, a row per batch and head, added by the product
            source = k.shape[1]
            padding = cast(Tensor, additive_mask(call.key_padding_mask, "key_padding_mask", call.query.dtype))
            padding = padding.view(batch, 1, 1, source).expand(-1, heads, -1, -1).reshape(batch * heads, 1, source)
            weights = torch.baddbmm(padding, q * query_scale(q.shape[2]), k.transpose(1, 2)).softmax(-1)
        if self.training and self.dropout > 0.0:
            weights = F.dropout(weights, p=self.dropout)
        out = torch.bmm(weights, v)
        del q, k, v  # the projections are freed before the output's copy, as stock frees them
        out = out.transpose(0, 1).reshape(length * batch, width)  # stock's copy
        out_p = cast(nn.Module, self._modules["out_proj"])._parameters
        # Rows as one matrix, as stock's: a 3-D input may add the bias after rounding (bf16)
        out = F.linear(out, cast(Tensor, out_p["weight"]), out_p["bias"]).view(length, batch, width)
        weights = weights.view(batch, heads, length, -1)
        if call.average_attn_weights:
            weights = weights.mean(dim=1)
        return (out.transpose(1, 0) if self.batch_first else out), weights

    def _slim_general_with_options(self, call: AttentionCall, plan: CallPlan) -> tuple[Tensor, Tensor | None]:
        """Slim's own path, with weights skipped where ``choose_path`` found that the caller discards them."""
        if not plan.drops_weights:
            return self._slim_general(call, plan=plan)
        call, drop_weights = cast(Callable, UNREAD.call_without_weights)(call, self.training and self.dropout > 0.0)
        result = self._slim_general(call, plan=plan)
        return (result[0], None) if drop_weights else result

    def _slim_sdpa(self, call: AttentionCall, plan: CallPlan) -> tuple[Tensor, None]:
        """The general path's ops for plain self-attention without weights, nothing else."""
        projected = F.linear(call.query, self.in_proj_weight, self._slim_packed_bias(symbolic=False))
        q, k, v = split_heads(projected, 3, self.num_heads, self.batch_first)  # (B, H, L, D) views
        del projected
        batch_major = bool(plan.batch_major)  # stock's layout: its kernel's (B, L, E), else (L, B, E)
        out = merge_heads(F.scaled_dot_product_attention(q, k, v), batch_major)
        del q, k, v  # free the projection before the output projection allocates: lower peak
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        return (out.transpose(0, 1) if self.batch_first and not batch_major else out), None

    def _slim_general(
        self, call: AttentionCall, dropout_p: float | None = None, plan: CallPlan | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Slim's own path, top to bottom: stock's checks before its projections, the projections
        without the key bias, the appended tokens, the masks' shapes, the kernel (SDPA, or the
        explicit one where weights are asked for), the heads merged in stock's layout, the output
        projection. ``dropout_p``: the module's (in training) unless given. ``plan``: what
        ``choose_path`` learnt of the call, not asked again (recomputations come without one)."""
        if dropout_p is None:
            dropout_p = self.dropout if self.training else 0.0
        need_weights, H = call.need_weights, self.num_heads
        # stock's layout: the plan's (choose_path finds it for every call it sends here), else asked afresh
        batch_major = plan.batch_major if plan is not None else None
        batch_major = stock_layout(self, call) if batch_major is None else batch_major
        # batched; stock's checks, its layout and fusing; canonical masks
        prepared = prepare_call(self, call, batch_major=batch_major)
        # asked once: the projections and the weights path need it
        symbolic = is_symbolic_call(call.query) if plan is None or plan.symbolic is None else plan.symbolic

        # Weights in one pass, without a graph: q, k and v head-major, each head's rows one matrix, the
        # queries scaled, so the weights path multiplies them as they are and writes into the queries.
        one_pass = need_weights and dropout_p == 0.0 and not (symbolic or prepared.weights_graph)
        heads = None  # stock's native kernel's own head split, where it applies: one op for all three
        if one_pass and prepared.batch_first and prepared.fused == "qkv":
            heads = stock_head_split(prepared.query, self.in_proj_weight, self._slim_packed_bias(symbolic=False), H)
        q, k, v = heads if heads is not None else self._slim_project(prepared, one_pass, symbolic)  # (B, H, len, D)
        del heads  # q, k and v alone hold the projections: they go before the output projection
        k, v = append_tokens(self, k, v)  # (B, H, S + appended, D)
        mask = attention_mask(self, prepared)  # the masks' shapes, checked after the projections as stock's

        if need_weights:
            out, weights = attention_with_weights(
                q,
                k,
                v,
                mask,
                dropout_p,
                call.average_attn_weights,
                q_scaled=one_pass,
                symbolic=symbolic,
                graph=prepared.weights_graph,
                given_masks=(call.attn_mask, call.key_padding_mask),
            )
        else:
            empty = None  # rows masked from every key: a zero output, where this SDPA gives NaN
            if mask is not None and has_folded_value_bias(self):
                refuse_rows_masked_from_every_key(mask)
            elif mask is not None and sdpa_needs_empty_rows_mended(q):
                mask, empty = open_empty_rows(mask, may_sync=q.is_cpu and not symbolic)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=prepared.is_causal
            )
            if empty is not None:
                out = out.masked_fill(empty, 0.0)
            weights = None

        # Stock's layout, so that a dropout after the attention draws the same mask: (L, B, E) memory
        # behind a batch-first view wherever stock's Python path would run (training, above all).
        batch_first, batch_major = prepared.batch_first, prepared.batch_major
        # Where SDPA wrote (B, L, H, D) memory, the heads merge for free and stock's (L, B, E) memory
        # is laid out after the output projection: the projection then saves SDPA's output itself for
        # backward, which SDPA saves anyway, not a copy beside it (stock's output is its SDPA output).
        late = batch_first and not batch_major and out.transpose(1, 2).is_contiguous()
        out = merge_heads(out, batch_major or late)
        del q, k, v, mask, prepared  # free the projections before the output projection allocates: lower peak
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if late:
            out = out.transpose(0, 1).contiguous().transpose(0, 1)  # (B, L, E) view of (L, B, E) memory
        elif batch_first and not batch_major:
            out = out.transpose(0, 1)  # (B, L, E) view of (L, B, E) memory, as stock returns it
        if call.query.dim() == 2:  # unbatched: the batch of one goes
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    # --------------------------------------------------------------------------------- the steps

    def _slim_packed_bias(self, *, symbolic: bool) -> Tensor | None:
        """``[b_q; 0; b_v]``, the bias of a fused projection: the key's rows never reach a sum. One op
        in eager calls; under traces and transforms from pieces whose graph holds no constant."""
        bias = self.in_proj_bias
        if bias is None or symbolic:
            return without_key_bias(bias, self.embed_dim)
        return _packed(bias)

    def _slim_project(self, prepared: PreparedCall, one_pass: bool, symbolic: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Input projections without the key bias, fused as stock fuses them: q, k and v ``(B, H, len, D)``.

        Views of the projections, except in ``one_pass`` (weights without dropout, a graph or a trace):
        that path multiplies each head's rows as one matrix, so q, k and v come head-major and
        contiguous, the queries scaled, each copied in one op as its projection dies rather than
        later beside it.
        """
        query, key, value, batch_first = prepared.query, prepared.key, prepared.value, prepared.batch_first
        E, H = self.embed_dim, self.num_heads
        bias, weight = self.in_proj_bias, self.in_proj_weight

        def project(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            if bias is not None and bias.dtype != x.dtype:  # as stock's Python path: a promoting add
                return F.linear(x, weight) + bias
            return F.linear(x, weight, bias)

        def queries(projected: Tensor) -> Tensor:
            if one_pass:  # the projection is ours: scaled in place, then copied head-major in one op
                projected.mul_(query_scale(E // H))
            (q,) = split_heads(projected, 1, H, batch_first, contiguous=one_pass)
            return q

        # Parts are passed, not read off weight.shape: under jit.trace a size read becomes a graph
        # value, and its conversion back to int lands at different places in the two traces.
        if prepared.fused == "qkv":  # self-attention: one matmul
            q, k, v = split_heads(
                project(query, weight, self._slim_packed_bias(symbolic=symbolic)),
                3,
                H,
                batch_first,
                contiguous=one_pass,
            )
            if one_pass:  # the copy is ours: the queries scaled in place, as stock's head split scales them
                q.mul_(query_scale(q.shape[-1]))
            return q, k, v
        # Splits, not slices: under autograd a split's backward is one cat into the gradient, where
        # each slice's backward zero-fills a gradient of the whole parameter and adds into it.
        if prepared.fused == "kv":  # encoder-decoder attention: one matmul for keys and values
            w_q, w_kv = weight.split_with_sizes((E, 2 * E))
            packed = self._slim_packed_bias(symbolic=symbolic)
            b_q, kv_bias = packed.split_with_sizes((E, 2 * E)) if packed is not None else (None, None)
            del packed
            q = queries(project(query, w_q, b_q))
            projected = project(key, w_kv, kv_bias)
            del b_q, kv_bias  # the built bias is freed before the copies: it is not kept beside them
            k, v = split_heads(projected, 2, H, batch_first, contiguous=one_pass)
            return q, k, v
        b_q, _, b_v = bias.split_with_sizes((E, E, E)) if bias is not None else (None, None, None)
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = weight.split_with_sizes((E, E, E))
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        q = queries(project(query, w_q, b_q))
        (k,) = split_heads(project(key, w_k, None), 1, H, batch_first, contiguous=one_pass)  # no key bias
        (v,) = split_heads(project(value, w_v, b_v), 1, H, batch_first, contiguous=one_pass)
        return q, k, v

    def extra_repr(self) -> str:
        extras = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}", f"batch_first={self.batch_first}"]
        if self.dropout:
            extras.append(f"dropout={self.dropout}")
        if not self._qkv_same_embed_dim:
            extras.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.bias_k is not None:
            extras.append("add_bias_kv=True")
        if self.add_zero_attn:
            extras.append("add_zero_attn=True")
        return ", ".join(extras)


# The environment turns the per-call check on for the whole process: load it with the class.
if checks_wanted_by_environment():
    load_feature("check")

# Stock's forward's keyword defaults (None, True, False: compared by identity), read off its signature.
_STOCK_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(STOCK_MHA.forward).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}

# The method that runs each path that choose_path names, given the call and its plan.
_RUNS = {
    "traced": "_slim_traced",
    "nested": "_slim_stock_forward",
    "recorded": "_slim_recorded",
    "stock kernel": "_slim_stock_kernel",
    "stock ops": "_slim_stock_ops",
    "sdpa": "_slim_sdpa",
    "general": "_slim_general_with_options",
}


def slim_options(
    *, check_equivariance: bool | None = None, check_equivariance_every: int = 1, skip_unread_weights: bool = False
) -> dict:
    """Slim's own options as the instance attributes that hold them, resolved and checked once."""
    check, every = resolve_options(check_equivariance, check_equivariance_every)
    skip = resolve_skip_option(skip_unread_weights)
    if check:
        load_feature("check")
    if skip:
        load_feature("unread weights")
    return {
        # Permutation-equivariance assertion mode; None follows SLIM_MHA_CHECK_EQUIVARIANCE and
        # slim_mha.checking_equivariance() (see slim_mha.equivariance).
        "check_equivariance": check,
        "check_equivariance_every": every,
        # Skip weights the caller provably discards (see slim_mha.unread_weights).
        "skip_unread_weights": skip,
    }


# ------------------------------------------------------------------------------------------ heads
# Heads as views: a projection split into per-head (B, H, L, D) tensors and merged back, in the
# caller's layout (batch-first or sequence-first), so no transpose of the inputs is ever made. The
# path that runs stock's ops takes stock's layouts instead: sequence_first and stock_projected_heads.


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
    split: list[Tensor] = []  # a loop, not a comprehension: no frame of its own on every call
    for part in pieces:
        split.append(part.view(d0, d1, num_heads, head_dim).permute(order))  # (B, H, L, D)
    return split


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
    """Stock's in-projection of sequence-first inputs with the packed ``(3E, E)`` weight and bias,
    without the key bias, q, k and v ``(B·H, len, D)`` in its layout: one matmul for self-attention,
    one for the queries and one for keys and values when ``key is value``, else one each, as stock
    fuses them. A fused projection takes ``[b_q; 0; b_v]``; the keys' own projection takes no bias,
    so that call (cross-attention, as DETR's decoder makes it) builds none."""
    width = query.shape[2]
    if query is key and key is value:
        return stock_heads(F.linear(query, weight, _packed(bias)), 3, num_heads)
    if key is value:
        (w_q, w_kv), (b_q, b_kv) = weight.split([width, 2 * width]), _packed(bias).split([width, 2 * width])
        (q,) = stock_heads(F.linear(query, w_q, b_q), 1, num_heads)
        return (q, *stock_heads(F.linear(key, w_kv, b_kv), 2, num_heads))
    b_q, _, b_v = bias.chunk(3)
    parts = zip((query, key, value), weight.chunk(3), (b_q, None, b_v))
    return tuple(stock_heads(F.linear(x, w, b), 1, num_heads)[0] for x, w, b in parts)


def _packed(bias: Tensor) -> Tensor:
    """``[b_q; 0; b_v]`` of an eager call's packed bias (:func:`slim_mha.bias.key_slot_zeroer`)."""
    return key_slot_zeroer(bias.shape[0], bias.dtype, bias.device)(bias)
