"""One module in the other class, holding the same parameters: the core of ``convert``, ``to_stock``
and ``torch.jit.script``'s ``__prepare_scriptable__``; and the folded-value-bias mark they check.

Stock and slim modules have the same parameters, in the same order, under the same names: a swap
builds the new object around the old one's parameter objects, ``out_proj`` submodule, flags and hook
dictionaries (so existing ``RemovableHandle`` objects still remove their hooks). Nothing is copied or
re-initialised, device and dtype cannot change, and an optimizer built before keeps training them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = [
    "FOLDED_VALUE_BIAS",
    "SLIM_ATTRIBUTES",
    "has_folded_value_bias",
    "rebuild_as",
    "refuse_folded_value_bias",
    "refuse_rows_masked_from_every_key",
]

# Set by slim_mha.fold_value_bias: the module's value bias was moved into out_proj.bias, which is
# exact except on a query row masked from every key (see conversion.fold_value_bias).
FOLDED_VALUE_BIAS = "_slim_mha_folded_value_bias"
# Instance attributes that only slim modules have: a stock module built from a slim one drops them.
SLIM_ATTRIBUTES = ("check_equivariance", "check_equivariance_every", "skip_unread_weights", FOLDED_VALUE_BIAS)
# nn.Module's containers that belong to one module: the new one gets copies holding the same objects.
_OWN_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def has_folded_value_bias(module: nn.Module) -> bool:
    """Whether ``fold_value_bias`` moved this module's value bias into ``out_proj.bias``."""
    return bool(module.__dict__.get(FOLDED_VALUE_BIAS, False))


def refuse_folded_value_bias(module: nn.Module, where: str, caller: str) -> None:
    """Stock cannot represent a folded value bias exactly: refuse, naming the module and the fix."""
    if has_folded_value_bias(module):
        raise ValueError(
            f"{caller}: module {where} had its value bias folded into out_proj.bias (fold_value_bias), which "
            "stock cannot represent exactly: on a query row masked from every key stock outputs out_proj.bias, "
            "the fold adds W_o·b_v. Convert the model before folding it"
        )


def refuse_rows_masked_from_every_key(mask: Tensor) -> None:
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


def rebuild_as(module: nn.Module, cls: type, **attributes) -> nn.Module:
    """A new ``cls`` module that holds ``module``'s parameters, submodules, buffers, flags and hooks.

    Both classes must be stock ``nn.MultiheadAttention`` or a subclass that adds no state of its own
    beyond ``SLIM_ATTRIBUTES``; those are dropped, then ``attributes`` are set.
    """
    new = cls.__new__(cls)
    state = {name: value for name, value in module.__dict__.items() if name not in SLIM_ATTRIBUTES}
    for name in _OWN_CONTAINERS:
        if name in state:
            state[name] = state[name].copy()
    state.update(attributes)
    new.__dict__.update(state)
    return new
