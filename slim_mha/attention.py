"""SlimMultiheadAttention: stock ``nn.MultiheadAttention`` without the key bias, batch-first and lean."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.parameter import Parameter

from . import _packed_tensor as packed_tensor
from . import unread_weights
from ._call import AttentionCall
from ._explicit_attention import attention_with_weights
from ._packed_bias import PackedBiasOwner
from ._stock_checks import attention_mask, is_batched_mha_input
from ._swap import build_stock, has_folded_value_bias, refuse_folded_value_bias
from ._torch_compat import is_capturing_or_transforming
from .bias import FORMAT_VERSION
from .equivariance import _mode as _equivariance

__all__ = ["SlimMultiheadAttention"]


class SlimMultiheadAttention(PackedBiasOwner, nn.MultiheadAttention):
    r"""A drop-in ``nn.MultiheadAttention`` that stores no key bias and computes the same function.

    Same constructor and ``forward`` as stock, same return values, same initialisation (a seeded
    construction draws the same weights). It differs in how it computes, not in what:

    * **No key bias.** ``b_k`` shifts every score of a query by the same ``q·b_k`` and softmax ignores
      such shifts, so it is not stored, added, or trained. With ``add_bias_kv`` the appended key is
      stored as ``bias_k - b_k`` (the same row shift applied to it). With ``add_zero_attn`` and a bias
      the zero key breaks the argument, so ``b_k`` is kept as ``k_proj_bias``. The maths is in
      :mod:`slim_mha.bias`.
    * **Lean path.** One fused input projection; heads are split as views in the caller's layout;
      ``scaled_dot_product_attention`` whenever weights are not requested; no ``batch_first``
      transposes and no packed-projection copies.

    New options are keyword-only: ``check_equivariance`` (``None`` follows ``slim_mha.checking_equivariance()``
    and the ``SLIM_MHA_CHECK_EQUIVARIANCE`` environment variable) and ``check_equivariance_every``
    turn on the per-call permutation-equivariance assertion of :mod:`slim_mha.equivariance`;
    ``skip_unread_weights=True`` skips the weights of calls whose caller provably discards them
    (``attn(q, k, v)[0]``, ``out, _ = attn(q, k, v)``), see :mod:`slim_mha.unread_weights`.

    State-dict layout (a stable format, version 1), per module prefix:

    ============================  =============  ================================================
    key                           shape          present when
    ============================  =============  ================================================
    ``in_proj_weight``            ``(3E, E)``    ``kdim == vdim == E`` (as stock)
    ``q/k/v_proj_weight``         as stock       ``kdim`` or ``vdim`` differ (as stock)
    ``q_proj_bias``               ``(E,)``       ``bias=True``
    ``v_proj_bias``               ``(E,)``       ``bias=True`` and the value bias was not folded
    ``k_proj_bias``               ``(E,)``       ``bias=True`` and ``add_zero_attn=True``
    ``bias_k``                    ``(1, 1, E)``  ``add_bias_kv``; holds ``bias_k - b_k`` unless
                                                 ``k_proj_bias`` is kept
    ``bias_v``                    ``(1, 1, E)``  ``add_bias_kv`` (as stock)
    ``out_proj.weight/.bias``     as stock       as stock
    ============================  =============  ================================================

    ``load_state_dict`` accepts stock state dicts too (``in_proj_bias`` is folded on the way in).

    Code written for stock that reads or writes ``in_proj_bias`` (stock's ``[b_q; b_k; b_v]``, here
    the packed view the bias parameters share memory with) gets stock's numbers or a refusal that
    names the fix: see :mod:`slim_mha._packed_bias` and the README's "Differences from stock".
    """

    _version = FORMAT_VERSION  # of the state-dict layout above; stock checkpoints carry no version of ours
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
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0,"
                f" got embed_dim={embed_dim} and num_heads={num_heads} instead"
            )
        # Stock's __init__ registers a packed in_proj_bias that we replace by a computed view, so it
        # is re-done here, allocating and initialising in stock's order so seeded weights match.
        nn.Module.__init__(self)
        # Permutation-equivariance assertion mode; None follows SLIM_MHA_CHECK_EQUIVARIANCE and
        # slim_mha.checking_equivariance() (see slim_mha.equivariance).
        self.check_equivariance, self.check_equivariance_every = _equivariance.resolve_options(
            check_equivariance, check_equivariance_every
        )
        # Skip weights the caller provably discards (see slim_mha.unread_weights).
        self.skip_unread_weights = unread_weights.resolve_option(skip_unread_weights)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != self.embed_dim:
            raise AssertionError("embed_dim must be divisible by num_heads")

        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)

        self.add_zero_attn = add_zero_attn
        # q/k/v_proj_bias are views of one packed tensor, the in_proj_bias view (see _packed_bias).
        self._create_packed_bias(bias=bias, factory=factory)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)

        if add_bias_kv:
            self.bias_k = Parameter(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v = Parameter(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.bias_k = self.bias_v = None

        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # Same draws, in the same order, as stock: its zero key slice needs no draw either. The
        # nn.init functions are looked up at call time, so that wrappers of them (Hugging Face's
        # init guard skips the tensors it loaded) see these calls as they see stock's.
        _refuse_stock_checkpoint_dropped_by_loader(self)
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        for bias in (self.q_proj_bias, self.k_proj_bias, self.v_proj_bias):
            if bias is not None:
                nn.init.constant_(bias, 0.0)
        if self.q_proj_bias is not None and not getattr(self.q_proj_bias, "_is_hf_initialized", False):
            self._zero_key_slot()  # stock zeroes its b_k with the rest of in_proj_bias
        if self.q_proj_bias is not None and self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_v)

    def __prepare_scriptable__(self) -> nn.MultiheadAttention:
        """``torch.jit.script`` compiles the equivalent stock module (see :func:`slim_mha.to_stock`)."""
        refuse_folded_value_bias(self, "(this module)", "torch.jit.script")
        return build_stock(self)

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
        if need_weights and self.skip_unread_weights and unread_weights.weights_discarded(self, query):
            need_weights = False  # the caller drops them: compute what need_weights=False computes
        call = AttentionCall(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )
        if query.is_nested or key.is_nested or value.is_nested:
            # Only stock's native kernel takes nested tensors; it reads our computed in_proj_bias.
            return super().forward(*call)
        result = self._attend(call)
        if (self.check_equivariance or _equivariance.SWITCH.active) and not is_capturing_or_transforming():
            _equivariance.check_call(self, result, call)
        return result

    def _attend(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal = call
        is_batched = is_batched_mha_input(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        batch_first = self.batch_first or not is_batched
        if not is_batched:  # unbatched (L, E): a batch of one, batch-first
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        self._check_embed_dims(query, key, value)

        q, k, v = self._project(query, key, value, batch_first)  # (B, H, L, D), (B, H, S, D) x2
        (batch, _, tgt_len, _), src_len = q.shape, k.shape[2]
        appended = int(self.bias_k is not None) + int(self.add_zero_attn)
        mask, is_causal = attention_mask(
            attn_mask, key_padding_mask, is_causal, need_weights, query.dtype,
            batch=batch, num_heads=self.num_heads, tgt_len=tgt_len, src_len=src_len, appended=appended,
        )  # additive, broadcastable to (B, H, L, S + appended)
        k, v = self._append_tokens(k, v)  # (B, H, S + appended, D)
        dropout_p = self.dropout if self.training else 0.0

        if need_weights:
            out, weights = attention_with_weights(q, k, v, mask, dropout_p, average)
        else:
            if mask is not None and has_folded_value_bias(self):
                _refuse_rows_masked_from_every_key(mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
            weights = None

        out = _merge_heads(out, batch_first)
        del q, k, v, mask  # free the projections before the output projection allocates: lower peak
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if not is_batched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    # --------------------------------------------------------------------------------- the steps

    def _check_embed_dims(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        # Same exception types and wording as F.multi_head_attention_forward.
        if query.shape[-1] != self.embed_dim:
            raise AssertionError(
                f"was expecting embedding dimension of {self.embed_dim}, but got {query.shape[-1]}"
            )
        if self._qkv_same_embed_dim:
            if key.shape != value.shape:
                raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        elif key.shape[:2] != value.shape[:2]:
            raise AssertionError(
                f"key's sequence and batch dims {key.shape[:2]} do not match value's {value.shape[:2]}"
            )

    def _project(self, query: Tensor, key: Tensor, value: Tensor, batch_first: bool) -> list[Tensor]:
        """Input projections, fused as far as the inputs allow; returns ``(B, H, len, D)`` views."""
        E = self.embed_dim

        def heads(x: Tensor, weight: Tensor, bias: Tensor | None, parts: int = 1) -> list[Tensor]:
            # parts is passed, not read off weight.shape: under jit.trace a size read becomes a graph
            # value, and its conversion back to int lands at different places in the two traces.
            if bias is not None and bias.dtype != x.dtype:  # as stock's Python path: a promoting add
                projected = F.linear(x, weight) + bias
            else:
                projected = F.linear(x, weight, bias)
            return _split_heads(projected, parts, self.num_heads, batch_first)

        bias = packed_tensor.fused_bias(self)
        weight = self.in_proj_weight
        if self._qkv_same_embed_dim and query is key and key is value:  # self-attention: one matmul
            return heads(query, weight, bias, 3)
        # Split only past self-attention: the three slices cost 11 aten ops (launches) it never uses.
        b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
        if not self._qkv_same_embed_dim:
            return heads(query, self.q_proj_weight, b_q) + heads(key, self.k_proj_weight, b_k) + heads(
                value, self.v_proj_weight, b_v
            )
        if key is value:  # encoder-decoder attention: one matmul for keys and values
            return heads(query, weight[:E], b_q) + heads(key, weight[E:], None if bias is None else bias[E:], 2)
        return heads(query, weight[:E], b_q) + heads(key, weight[E : 2 * E], b_k) + heads(value, weight[2 * E :], b_v)

    def _append_tokens(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``add_bias_kv`` then ``add_zero_attn`` tokens, after projection, as stock appends them."""
        B, H, _, D = k.shape
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.view(1, H, 1, D).expand(B, H, 1, D).to(k.dtype)], dim=2)
            v = torch.cat([v, self.bias_v.view(1, H, 1, D).expand(B, H, 1, D).to(v.dtype)], dim=2)
        elif self.bias_k is not None or self.bias_v is not None:
            raise AssertionError("bias_k and bias_v must be both set or both None")
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, H, 1, D)], dim=2)
            v = torch.cat([v, v.new_zeros(B, H, 1, D)], dim=2)
        return k, v

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


def _refuse_stock_checkpoint_dropped_by_loader(module: SlimMultiheadAttention) -> None:
    """Raise instead of initialising biases that a loader dropped: never a silently wrong model.

    Hugging Face's loader flags each tensor it loaded (``_is_hf_initialized``), reports stock's
    ``in_proj_bias`` as an unexpected key and then initialises what is missing. Weights flagged as
    loaded but ``q_proj_bias`` not means a stock checkpoint, whose biases would be lost.
    """
    weight = module.in_proj_weight if module._qkv_same_embed_dim else module.q_proj_weight
    bias = module.q_proj_bias
    if (
        bias is not None
        and getattr(weight, "_is_hf_initialized", False)
        and not getattr(bias, "_is_hf_initialized", False)
    ):
        raise RuntimeError(
            "slim_mha: the loader filled this attention module's projection weight but not q_proj_bias: "
            "the checkpoint is in stock nn.MultiheadAttention's layout (in_proj_bias), which the loader "
            "dropped as an unexpected key. Load it without slim_mha.patch() and run "
            "slim_mha.convert(model), or migrate the checkpoint first with `slim-mha-migrate fold`"
        )


def _refuse_rows_masked_from_every_key(mask: Tensor) -> None:
    """A folded value bias is exact only where attention rows sum to one (see fold_value_bias).

    A query masked from every key has a row of zeros: stock outputs ``out_proj.bias`` there, while
    the folded bias adds ``W_o b_v``. The fold cannot be undone here, so such a call is refused.
    """
    if bool(torch.isneginf(mask).all(dim=-1).any()):
        raise RuntimeError(
            "slim_mha: a query row is masked from every key, and this module's value bias was folded into "
            "out_proj.bias (fold_value_bias), which is exact only where each query attends to some key "
            "(stock outputs out_proj.bias on such a row, the fold adds W_o·b_v). Use the unfolded module "
            "for inputs like this, or leave at least one key unmasked per query"
        )


def _split_heads(projected: Tensor, parts: int, num_heads: int, batch_first: bool) -> list[Tensor]:
    """``(B, L, parts*E)`` or ``(L, B, parts*E)`` -> ``parts`` views of shape ``(B, H, L, D)``, no copy.

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
        return list(heads.permute((2, 0, 3, 1, 4) if batch_first else (2, 1, 3, 0, 4)).unbind(0))
    order = (0, 2, 1, 3) if batch_first else (1, 2, 0, 3)
    return [
        part.view(d0, d1, num_heads, head_dim).permute(order)  # (B, H, L, D)
        for part in projected.split(num_heads * head_dim, dim=-1)
    ]


def _merge_heads(out: Tensor, batch_first: bool) -> Tensor:
    """``(B, H, L, D)`` -> ``(B, L, E)`` or ``(L, B, E)``; free when SDPA wrote ``(B, L, H, D)`` memory."""
    B, H, L, D = out.shape
    if batch_first:
        return out.transpose(1, 2).reshape(B, L, H * D)  # (B, L, E)
    return out.permute(2, 0, 1, 3).reshape(L, B, H * D)  # (L, B, E)
