"""Build a module of the other bias layout that shares ``old``'s weights: the core of ``convert``,
``to_stock`` and ``torch.jit.script``'s ``__prepare_scriptable__``.

The new module is built on the meta device (no allocation, no random draws) and then holds the old
module's weight ``Parameter`` objects and its ``out_proj`` submodule, so nothing is copied and device
and dtype cannot change. Bias parameters are rebuilt in the new layout. ``requires_grad`` of every
parameter, the ``training`` flag and every hook registered on the module move over.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ._torch_compat import MODULE_HOOK_ATTRIBUTES, STOCK_MHA
from .bias import BIAS_NAMES, STOCK_BIAS_NAME

__all__ = ["build_stock", "has_folded_value_bias", "load_shared", "meta_options", "refuse_folded_value_bias"]


def has_folded_value_bias(module: nn.Module) -> bool:
    """Whether ``fold_value_bias`` moved this slim module's value bias into ``out_proj.bias``."""
    return module.q_proj_bias is not None and module.v_proj_bias is None


def refuse_folded_value_bias(module: nn.Module, where: str, caller: str) -> None:
    """Stock cannot represent a folded value bias exactly: refuse, naming the module and the fix."""
    if has_folded_value_bias(module):
        raise ValueError(
            f"{caller}: module {where} had its value bias folded into out_proj.bias (fold_value_bias), which "
            "stock cannot represent exactly: on a query row masked from every key stock outputs out_proj.bias, "
            "the fold adds W_o·b_v. Convert the model before folding it"
        )


def meta_options(module: nn.Module, *, bias: bool) -> dict:
    """Constructor arguments for a module of ``module``'s shape in either layout, on the meta device
    (no allocation or random draws: every tensor is assigned afterwards)."""
    return dict(
        embed_dim=module.embed_dim,
        num_heads=module.num_heads,
        dropout=module.dropout,
        bias=bias,
        add_bias_kv=module.bias_k is not None,
        add_zero_attn=module.add_zero_attn,
        kdim=module.kdim,
        vdim=module.vdim,
        batch_first=module.batch_first,
        device="meta",
    )


def build_stock(slim: nn.Module) -> nn.MultiheadAttention:
    """The stock module computing what ``slim`` computes: ``in_proj_bias`` as slim's view (its key
    slot included) and ``bias_k`` as slim holds it. Always torch's own class, patched or not."""
    stock = STOCK_MHA(**meta_options(slim, bias=slim.q_proj_bias is not None))
    state = slim.state_dict(keep_vars=True)
    for name in BIAS_NAMES:
        state.pop(name, None)
    # (state_dict folds a written key slot into bias_k; here the slot stays, so bias_k is taken raw.)
    packed = slim.in_proj_bias
    if packed is not None:
        state[STOCK_BIAS_NAME] = packed.detach().clone()
    if slim.bias_k is not None:
        state["bias_k"] = slim.bias_k
    flags = {name: parameter.requires_grad for name, parameter in slim.named_parameters()}
    # One packed parameter from up to three: trainable if any part was (a folded v bias has no flag).
    packed_flag = any(flags[name] for name in BIAS_NAMES if name in flags)
    load_shared(stock, slim, lambda name: packed_flag if name == STOCK_BIAS_NAME else flags[name], state)
    return stock


def load_shared(
    new: nn.Module,
    old: nn.Module,
    requires_grad_of: Callable[[str], bool],
    state: dict | None = None,
) -> None:
    """Give the meta-built ``new`` the tensors, flags, submodule and hooks of ``old``.

    ``load_state_dict(assign=True)`` keeps each target parameter's ``requires_grad`` and sets it on
    the assigned tensor, so the flags are put on the meta parameters first.
    """
    new.out_proj = old.out_proj
    for name, parameter in new.named_parameters():
        if parameter.is_meta:
            parameter.requires_grad_(requires_grad_of(name))
    if state is None:
        state = old.state_dict(keep_vars=True)
    new.load_state_dict(state, strict=True, assign=True)
    new.training = old.training
    for attribute in MODULE_HOOK_ATTRIBUTES:
        hooks = old.__dict__.get(attribute)
        if hooks is None:
            continue
        hooks.update(new.__dict__.get(attribute, {}))  # none today; kept if the class ever adds one
        new.__dict__[attribute] = hooks
    new.__dict__["_is_full_backward_hook"] = old.__dict__.get("_is_full_backward_hook")
