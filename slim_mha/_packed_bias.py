"""The one owner of the packed bias: every ``nn.Module`` hook that keeps ``in_proj_bias`` and the bias
parameters one state, and the state-dict layout they share.

Slim registers ``q_proj_bias`` and ``v_proj_bias`` (and ``k_proj_bias`` where the key bias is kept);
stock code reads and writes ``in_proj_bias``. Both names are one memory: a packed ``(3E,)`` tensor
that the parameters are views of (:mod:`slim_mha._packed_tensor` holds the tensor machinery). Three
operations keep it so, each named for whose parameter objects it may re-point:

* ``resync``: take in ``in_proj_bias.data = ...``, and re-point only the objects aliased before whose
  memory is their own;
* ``take_new_parameters``: also objects registered since (a loader's ``setattr``), if their memory is
  their own (FSDP's, which it refills, is never taken);
* ``reown``: objects this module itself just registered (``_apply``, loading, unpickling), whatever
  their memory.

=============================  ======================  =============================================
hook                           operation               why
=============================  ======================  =============================================
``in_proj_bias`` (read)        take_new_parameters     stock code holds and writes the object read
``__setattr__``,               assign                  stock registers an assigned ``Parameter``;
``register_parameter``                                 ``functional_call`` swaps a plain tensor in
``_load_from_state_dict``      fold, then reown        stock checkpoints carry ``in_proj_bias``;
                                                       ``assign=True`` registers new objects
``_save_to_state_dict``        resync, then fold       a written key slot is folded into ``bias_k``;
                                                       entries get storages of their own
``_apply``                     resync, then reown      casts and moves give the parameters new memory
``train``                      take_new_parameters     Hugging Face's loader ends with ``eval()``
``__getstate__``,              drop, then reown        pickle and deepcopy rebuild the packed tensor
``__setstate__``                                       from the parameters
=============================  ======================  =============================================
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.parameter import Parameter

from . import _packed_tensor as packed_tensor
from ._bias_views import own_storage
from .bias import BIAS_NAMES, STOCK_BIAS_NAME, SlimBiases, fold_key_bias, keeps_key_bias

__all__ = ["PackedBiasOwner"]


class PackedBiasOwner(nn.Module):
    """Mixin for a slim attention module (before ``nn.MultiheadAttention`` in the bases).

    The module has ``embed_dim``, ``add_zero_attn`` and ``bias_k`` as stock's has, and calls
    :meth:`_create_packed_bias` in its constructor.
    """

    def _create_packed_bias(self, *, bias: bool, factory: dict) -> None:
        keep_key = bias and keeps_key_bias(add_zero_attn=self.add_zero_attn)
        packed_tensor.create(self, bias=bias, keep_key=keep_key, factory=factory)

    @property
    def in_proj_bias(self) -> Tensor | None:
        """Stock's packed ``[b_q; b_k; b_v]``: the tensor the bias parameters are views of."""
        return packed_tensor.stock_view(self)

    def __setattr__(self, name: str, value) -> None:
        if name == STOCK_BIAS_NAME:
            self._assign_in_proj_bias(value)
            return
        super().__setattr__(name, value)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if name == STOCK_BIAS_NAME:  # as stock: registering it is assigning it
            self._assign_in_proj_bias(param)
            return
        if param is not None and packed_tensor.is_packed(self, param):
            # torch.nn.utils.prune re-registers the tensor it prunes as '<name>_orig' first.
            raise ValueError(
                f"cannot register in_proj_bias as parameter {name!r}: SlimMultiheadAttention's parameters are "
                "q_proj_bias and v_proj_bias (in_proj_bias is their packed view, not a registered parameter). "
                "Prune or re-register q_proj_bias/v_proj_bias instead, or use slim_mha.to_stock(module)"
            )
        super().register_parameter(name, param)

    def _assign_in_proj_bias(self, value: Tensor | None) -> None:
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(
                f"cannot assign '{torch.typename(value)}' as parameter 'in_proj_bias' "
                "(torch.nn.Parameter or None expected)"
            )
        if value is not None and tuple(value.shape[-1:]) != (3 * self.embed_dim,):
            raise ValueError(
                f"in_proj_bias must have shape ({3 * self.embed_dim},) = 3*embed_dim, got {tuple(value.shape)}"
            )
        # A Parameter is registered as stock registers the object (its key slice used exactly as
        # stock uses b_k); a plain tensor stands in for it, as torch.func.functional_call swaps it.
        packed_tensor.assign(self, value, keep_key=keeps_key_bias(add_zero_attn=self.add_zero_attn))

    # ------------------------------------------------------------------------------ state dicts

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # A stock checkpoint carries in_proj_bias; fold it into our layout before the usual loading.
        # Without input biases of our own, leave it for torch to report as unexpected.
        stock_key = prefix + STOCK_BIAS_NAME
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
        packed_tensor.reown(self)  # assign=True registers new objects
        if zero_middle:
            self._zero_key_slot()
        if own_bias_k is not None:
            with torch.no_grad():
                self.bias_k.copy_(own_bias_k)
        if mismatched:  # the size mismatch already names the culprit; our split keys are not missing
            split = {prefix + name for name in BIAS_NAMES}
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
        packed_tensor.resync(self)  # take in any in_proj_bias.data = ... first
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:
            for name in BIAS_NAMES:
                if prefix + name in destination:
                    destination[prefix + name] = own_storage(destination[prefix + name])
        middle = self._key_slot()
        if self.bias_k is not None and middle is not None and bool(middle.any()):
            # Our layout stores bias_k relative to a zero key slot: fold a written slot into it.
            with torch.no_grad():
                folded = fold_key_bias(self.in_proj_bias.detach(), self.bias_k.detach())
            destination[prefix + "bias_k"] = folded.bias_k

    def _key_slot(self) -> Tensor | None:
        """The packed key slot as ``in_proj_bias`` reads it, where it is no parameter (a dropped key
        bias: zero unless code wrote stock's ``b_k`` into it), else None."""
        state = self.__dict__.get(packed_tensor.STATE_KEY)
        if state is None or self.k_proj_bias is not None or state.packed.is_meta:
            return None
        return state.packed.detach()[self.embed_dim : 2 * self.embed_dim]

    def _zero_key_slot(self) -> None:
        slot = self._key_slot()
        if slot is not None:
            with torch.no_grad():
                slot.zero_()

    # ---------------------------------------------------------------- casts, modes, pickling

    def _apply(self, fn, recurse=True):
        packed_tensor.resync(self)
        result = super()._apply(fn, recurse)
        packed_tensor.reown(self)
        return result

    def train(self, mode: bool = True):
        result = super().train(mode)
        packed_tensor.take_new_parameters(self)
        return result

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop(packed_tensor.STATE_KEY, None)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if "_parameters" in self.__dict__:
            packed_tensor.reown(self)
