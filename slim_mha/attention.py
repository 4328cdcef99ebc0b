"""SlimMultiheadAttention: stock ``nn.MultiheadAttention`` without the key bias, batch-first and lean."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.parameter import Parameter

from . import _packed_bias
from ._explicit_attention import attention_with_weights
from ._stock_checks import additive_mask, is_batched_mha_input
from .bias import SlimBiases, fold_key_bias, keeps_key_bias
from .equivariance import _mode as _equivariance
from . import _unread_weights

__all__ = ["SlimMultiheadAttention"]

_STOCK_BIAS = "in_proj_bias"
_SPLIT_BIASES = ("q_proj_bias", "k_proj_bias", "v_proj_bias")


class SlimMultiheadAttention(nn.MultiheadAttention):
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
    (``attn(q, k, v)[0]``, ``out, _ = attn(q, k, v)``), see :mod:`slim_mha._unread_weights`.

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

    Compatibility with code written for stock:

    * ``in_proj_bias`` is stock's ``(3E,)`` ``[b_q; b_k; b_v]``, one object that ``q_proj_bias``,
      ``v_proj_bias`` (and a kept ``k_proj_bias``) are views of, so stock's idioms work on it:
      ``nn.init.zeros_(m.in_proj_bias)``, ``.copy_``, ``.data.copy_``, ``.requires_grad_``, and
      ``t.data = t.data.to(dtype)`` (the parameters follow at the next forward or read). Its key
      slice reads zero unless kept or written; a written key slice is used exactly as stock uses
      its ``b_k`` (``state_dict`` folds it into ``bias_k``). Gradients that code computing with
      ``in_proj_bias`` itself accumulates are routed to the parameters. Together with ``bias_k`` it
      describes a stock module with the same function. See :mod:`slim_mha._packed_bias`.
    * Assigning a ``(3E,)`` ``Parameter`` to ``in_proj_bias`` makes it that view (as stock registers it).
    * The parameter count is ``embed_dim`` lower than stock's with ``bias=True`` (unless
      ``add_zero_attn``); ``bias_k`` reads as the folded value.
    """

    _version = 1  # of the state-dict layout above; stock checkpoints carry no version of ours
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
        # Skip weights the caller provably discards (see slim_mha._unread_weights).
        self.skip_unread_weights = _unread_weights.resolve_option(skip_unread_weights)
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
        keep_key = bias and keeps_key_bias(add_zero_attn=add_zero_attn)
        # q/k/v_proj_bias are views of one packed tensor, the in_proj_bias view (see _packed_bias).
        _packed_bias.create(self, bias=bias, keep_key=keep_key, factory=factory)
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
            _packed_bias.set_middle(self, None)  # stock zeroes its b_k with the rest of in_proj_bias
        if self.q_proj_bias is not None and self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_v)

    # ------------------------------------------------------------------ stock-compatible bias view

    @property
    def in_proj_bias(self) -> Tensor | None:
        """Stock's packed ``[b_q; b_k; b_v]``: the tensor the bias parameters are views of."""
        return _packed_bias.stock_view(self)

    def __setattr__(self, name: str, value) -> None:
        if name == _STOCK_BIAS:
            self._assign_in_proj_bias(value)
            return
        super().__setattr__(name, value)

    def _assign_in_proj_bias(self, value: Tensor | None) -> None:
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(
                f"cannot assign '{torch.typename(value)}' as parameter 'in_proj_bias' "
                "(torch.nn.Parameter or None expected)"
            )
        if value is not None and tuple(value.shape[-1:]) != (3 * self.embed_dim,):
            raise ValueError(
                f"in_proj_bias must have shape ({3 * self.embed_dim},) = 3*embed_dim, "
                f"got {tuple(value.shape)}"
            )
        # A Parameter is registered as stock registers the object (its key slice used exactly as
        # stock uses b_k); a plain tensor stands in for it, as torch.func.functional_call swaps it.
        _packed_bias.assign(self, value, keep_key=keeps_key_bias(add_zero_attn=self.add_zero_attn))

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if name == _STOCK_BIAS:  # as stock: registering it is assigning it
            self._assign_in_proj_bias(param)
            return
        if param is not None and _packed_bias.is_packed(self, param):
            # torch.nn.utils.prune re-registers the tensor it prunes as '<name>_orig' first.
            raise ValueError(
                f"cannot register in_proj_bias as parameter {name!r}: SlimMultiheadAttention's parameters are "
                "q_proj_bias and v_proj_bias (in_proj_bias is their packed view, not a registered parameter). "
                "Prune or re-register q_proj_bias/v_proj_bias instead, or use slim_mha.to_stock(module)"
            )
        super().register_parameter(name, param)

    def _slim_biases(self) -> SlimBiases:
        return SlimBiases(self.q_proj_bias, self.v_proj_bias, self.k_proj_bias, self.bias_k)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # A stock checkpoint carries in_proj_bias; fold it into our layout before the usual loading.
        # Without input biases of our own, leave it for torch to report as unexpected.
        stock_key = prefix + _STOCK_BIAS
        mismatched = False
        zero_middle, own_bias_k = False, None
        if stock_key in state_dict and self.q_proj_bias is not None:
            packed = state_dict.pop(stock_key)
            mismatched = tuple(packed.shape) != (3 * self.embed_dim,)
            if mismatched:
                error_msgs.append(
                    f"size mismatch for {stock_key}: copying a param with shape {packed.shape} from "
                    f"checkpoint, the shape in current model is torch.Size([{3 * self.embed_dim}])."
                )
            else:
                biases, own_bias_k = self._split_stock_bias(packed, state_dict.get(prefix + "bias_k"))
                for name, tensor in biases._asdict().items():
                    if tensor is not None:
                        state_dict[prefix + name] = tensor
                zero_middle = True
        elif prefix + "bias_k" in state_dict and self.bias_k is not None:
            zero_middle = True  # our own layout: the stored bias_k is relative to a zero key slot
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        _packed_bias.sync(self, take_new_parameters=True, owned=True)  # assign=True registers new objects
        if zero_middle:
            _packed_bias.set_middle(self, None)
        if own_bias_k is not None:
            with torch.no_grad():
                self.bias_k.copy_(own_bias_k)
        if mismatched:  # the size mismatch already names the culprit; our split keys are not missing
            split = {prefix + name for name in _SPLIT_BIASES}
            missing_keys[:] = [key for key in missing_keys if key not in split]

    def _split_stock_bias(self, packed: Tensor, bias_k: Tensor | None) -> tuple[SlimBiases, Tensor | None]:
        """Stock ``(in_proj_bias, bias_k)`` to our layout with stock's function: ``b_k`` folded.

        Returns the biases to load and, for a partial load without ``bias_k`` into an
        ``add_bias_kv`` module, the new value of this module's ``bias_k``: stock keeps its own
        ``bias_k`` then, whose stock view here is ``self.bias_k``, so the loaded ``b_k`` is folded
        into that. Everything stays in the parameters (the key slot is zeroed).
        """
        with torch.no_grad():
            if bias_k is None and self.bias_k is not None and not self.add_zero_attn:
                folded = fold_key_bias(packed, self.bias_k.detach())
                return folded._replace(bias_k=None), folded.bias_k
            return fold_key_bias(packed, bias_k, add_zero_attn=self.add_zero_attn), None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        _packed_bias.sync(self)  # take in any in_proj_bias.data = ... first
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:
            for name in _SPLIT_BIASES:
                if prefix + name in destination:
                    destination[prefix + name] = _packed_bias.own_storage(destination[prefix + name])
        middle = _packed_bias.stock_middle(self)
        if self.bias_k is not None and middle is not None and bool(middle.any()):
            # Our layout stores bias_k relative to a zero key slot: fold a written slot into it.
            with torch.no_grad():
                folded = fold_key_bias(self.in_proj_bias.detach(), self.bias_k.detach())
            destination[prefix + "bias_k"] = folded.bias_k

    def _apply(self, fn, recurse=True):
        # Casts and moves give the parameters new memory: take in a pending in_proj_bias.data = ...
        # first, and make them views of one packed tensor again afterwards.
        _packed_bias.sync(self)
        result = super()._apply(fn, recurse)
        _packed_bias.sync(self, take_new_parameters=True, owned=True)
        return result

    def train(self, mode: bool = True):
        # Loaders register new parameter objects with setattr (Hugging Face's from_pretrained, which
        # ends with eval()): make them views of the packed tensor here, where their memory is theirs.
        result = super().train(mode)
        _packed_bias.sync(self, take_new_parameters=True)
        return result

    def __getstate__(self):
        # The packed tensor is rebuilt from the parameters on the way in (pickle, deepcopy).
        state = self.__dict__.copy()
        state.pop(_packed_bias.STATE_KEY, None)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if "_parameters" in self.__dict__:
            _packed_bias.sync(self, take_new_parameters=True, owned=True)

    def __prepare_scriptable__(self) -> nn.MultiheadAttention:
        """``torch.jit.script`` compiles the equivalent stock module (see :func:`slim_mha.to_stock`)."""
        from .convert import to_stock

        return to_stock(self)

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
        if need_weights and self.skip_unread_weights and _unread_weights.weights_discarded(self, query):
            need_weights = False  # the caller drops them: compute what need_weights=False computes
        if query.is_nested or key.is_nested or value.is_nested:
            # Only stock's native kernel takes nested tensors; it reads our computed in_proj_bias.
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        result = self._attend(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )
        if (self.check_equivariance or _equivariance.SWITCH.active) and not _packed_bias.is_transforming():
            _equivariance.check_call(
                self, result, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                is_causal,
            )
        return result

    def _attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        is_batched = is_batched_mha_input(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        batch_first = self.batch_first or not is_batched
        if not is_batched:  # unbatched (L, E): a batch of one, batch-first
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        self._check_embed_dims(query, key, value)

        q, k, v = self._project(query, key, value, batch_first)  # (B, H, L, D), (B, H, S, D) x2
        (batch, _, tgt_len, _), src_len = q.shape, k.shape[2]
        mask, is_causal = self._attention_mask(
            attn_mask, key_padding_mask, is_causal, need_weights, query.dtype, batch, tgt_len, src_len
        )
        k, v = self._append_tokens(k, v)  # (B, H, S + appended, D)
        dropout_p = self.dropout if self.training else 0.0

        if need_weights:
            out, weights = attention_with_weights(q, k, v, mask, dropout_p, average_attn_weights)
        else:
            if mask is not None and self.q_proj_bias is not None and self.v_proj_bias is None:
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

        bias = _packed_bias.fused_bias(self)
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

    def _num_appended(self) -> int:
        return int(self.bias_k is not None) + int(self.add_zero_attn)

    def _attention_mask(
        self,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
        dtype: torch.dtype,
        batch: int,
        tgt_len: int,
        src_len: int,
    ) -> tuple[Tensor | None, bool]:
        """Stock's mask rules, as one additive mask broadcastable to ``(B, H, L, S')``.

        Returns the mask and whether SDPA may use ``is_causal`` instead of it (only when no padding
        mask and no weights are involved, exactly as stock decides).
        """
        key_padding_mask = additive_mask(
            key_padding_mask, "key_padding_mask", dtype, other=attn_mask, other_name="attn_mask"
        )
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                "method `generate_square_subsequent_mask` to create this mask."
            )
        if is_causal and key_padding_mask is None and not need_weights:
            return None, True
        attn_mask = additive_mask(attn_mask, "attn_mask", dtype)
        appended = self._num_appended()
        if attn_mask is not None:
            attn_mask = self._shape_attn_mask(attn_mask, tgt_len, src_len, batch)
            if appended:
                attn_mask = F.pad(attn_mask, (0, appended))
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
        return attn_mask, False

    def _shape_attn_mask(self, attn_mask: Tensor, tgt_len: int, src_len: int, batch: int) -> Tensor:
        """2-D ``(L, S)`` stays; 3-D ``(B*H, L, S)`` becomes ``(B, H, L, S)``; stock's checks and messages."""
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}."
                )
            return attn_mask
        if attn_mask.dim() == 3:
            expected = (batch * self.num_heads, tgt_len, src_len)
            if tuple(attn_mask.shape) != expected:
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {expected}.")
            return attn_mask.view(batch, self.num_heads, tgt_len, src_len)
        raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")

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
