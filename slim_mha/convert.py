"""Swap attention modules in live models: ``convert`` (stock to slim), ``to_stock``, ``fold_value_bias``.

All three walk a module tree and change it in place; the bias arithmetic itself lives in
:mod:`slim_mha.bias`.

Swapped modules keep everything that makes them *the same module* to the code around them:

* the weights, by sharing: the new module holds the old module's weight ``Parameter`` objects and
  its ``out_proj`` submodule, so nothing is copied and device and dtype cannot change. Bias
  parameters are rebuilt in the other layout, so build optimizers after converting;
* ``requires_grad`` of every parameter (a packed ``in_proj_bias`` maps to the split biases and
  back), the ``training`` flag, and every hook registered on the module (forward, forward-pre,
  backward, state-dict). The hook dictionaries move over as they are, so existing
  ``RemovableHandle`` objects still remove them;
* a module reached through several parents is swapped once and stays shared.

Only modules whose type is exactly the stock class (for ``convert``) or exactly a slim class (for
``to_stock``) are swapped: a user subclass may override ``forward``, and swapping it would drop that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parameter import Parameter
from torch.nn.utils import parametrize

from . import _unread_weights
from .attention import SlimMultiheadAttention
from .bias import fold_value_bias as _fold_value_bias_tensors
from .patching import PatchedMultiheadAttention

__all__ = ["convert", "to_stock", "fold_value_bias"]

# Looked up through slim's base, not by name: while patched, torch.nn's name points at slim.
_STOCK = SlimMultiheadAttention.__base__
_SLIM_TYPES = (SlimMultiheadAttention, PatchedMultiheadAttention)
_SPLIT_BIASES = ("q_proj_bias", "k_proj_bias", "v_proj_bias")
_HOOK_ATTRIBUTES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def convert(module: nn.Module, *, skip_unread_weights: bool = False) -> nn.Module:
    """Replace every stock ``nn.MultiheadAttention`` in ``module``'s tree by a slim one, in place.

    The function computed is unchanged (the key bias is folded as in ``load_state_dict``).
    ``skip_unread_weights`` is given to the slim modules built (modules already slim keep theirs).

    Returns:
        ``module``, or the new slim module when ``module`` itself is a stock attention module.
    """
    skip = _unread_weights.resolve_option(skip_unread_weights)
    _refuse_parametrized(module, _STOCK, "nn.MultiheadAttention", "convert")
    return _swap_modules(module, _is_stock, functools.partial(_build_slim, skip_unread_weights=skip))


def to_stock(module: nn.Module) -> nn.Module:
    """Replace every slim attention module in ``module``'s tree by a stock ``nn.MultiheadAttention``.

    The result has exactly stock's state-dict keys and computes the same outputs: the stock module
    gets ``in_proj_bias = [b_q; 0; b_v]`` (or the kept ``b_k``) and slim's stored ``bias_k``. Works
    while patched too: the modules built are always torch's stock class.

    Returns:
        ``module``, or the new stock module when ``module`` itself is a slim attention module.
    """
    _refuse_parametrized(module, SlimMultiheadAttention, "slim attention module", "to_stock")
    for name, child in module.named_modules():
        if _is_slim(child) and child.q_proj_bias is not None and child.v_proj_bias is None:
            raise ValueError(
                f"to_stock: module {_describe(name)} had its value bias folded into out_proj.bias "
                "(fold_value_bias), which stock cannot represent exactly: on a query row masked from every "
                "key stock outputs out_proj.bias, the fold adds W_o·b_v. Convert the model before folding it"
            )
    return _swap_modules(module, _is_slim, _build_stock)


def fold_value_bias(module: nn.Module) -> nn.Module:
    r"""Fold each slim module's value bias into ``out_proj.bias``, in place; an inference transform.

    Why it is exact: output ``i`` is ``W_o Σ_j a_ij (W_v x_j + b_v) + b_o`` and each attention row
    sums to one, so ``b_v`` contributes ``W_o b_v`` to every output: ``b_o' = b_o + W_o b_v``. An
    ``add_bias_kv`` value token, which is not projected, becomes ``bias_v - b_v`` to match. This
    fails when dropout rescales attention rows (training with ``dropout > 0``) and with
    ``add_zero_attn``, whose zero value token cannot absorb ``-b_v``: both are refused, before any
    module is changed. It fails too on a query row masked from every key, whose attention row is
    zero (stock outputs ``b_o`` there): a folded module refuses such a call, and :func:`to_stock`
    refuses a folded module. Afterwards ``v_proj_bias`` is ``None``; a state dict saved from the folded
    model loads into a model folded the same way.

    Modules without a value bias (``bias=False``, already folded) are skipped, so folding twice is
    harmless.

    Raises:
        ValueError: if the tree holds a stock ``nn.MultiheadAttention`` (its value bias is packed in
            ``in_proj_bias``: run :func:`convert` first), or a module with ``add_zero_attn=True``.
        RuntimeError: if a module is in training mode with ``dropout > 0``.

    Returns:
        ``module``.
    """
    to_fold = []
    for name, child in module.named_modules():
        if _is_stock(child):
            raise ValueError(
                f"fold_value_bias: module {_describe(name)} is a stock nn.MultiheadAttention, whose value "
                "bias is packed into in_proj_bias; run slim_mha.convert(module) first"
            )
        if not isinstance(child, SlimMultiheadAttention) or child.v_proj_bias is None:
            continue
        if child.add_zero_attn:
            raise ValueError(
                f"fold_value_bias: module {_describe(name)} has add_zero_attn=True; its zero value token "
                "cannot absorb -b_v, so folding would change the output. Fold the other submodules "
                "one by one instead"
            )
        if child.training and child.dropout > 0:
            raise RuntimeError(
                f"fold_value_bias: module {_describe(name)} is in training mode with "
                f"dropout={child.dropout}; dropout rescales attention rows, so folding is exact only in "
                "eval (as torch's fusion: 'Fusion only for eval!'). Call module.eval() first"
            )
        to_fold.append(child)
    for attention in to_fold:
        _fold_one(attention)
    return module


# --------------------------------------------------------------------------------- the swapping


def _is_stock(module: nn.Module) -> bool:
    return type(module) is _STOCK


def _is_slim(module: nn.Module) -> bool:
    return type(module) in _SLIM_TYPES


def _swap_modules(
    root: nn.Module, select: Callable[[nn.Module], bool], rebuild: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    if select(root):
        return rebuild(root)
    # Keyed by id, holding the old module too so that its id cannot be reused while we walk.
    swapped: dict[int, tuple[nn.Module, nn.Module]] = {}
    for parent in list(root.modules()):
        for name, child in list(parent._modules.items()):
            if child is None or not select(child):
                continue
            if id(child) not in swapped:
                swapped[id(child)] = (child, rebuild(child))
            parent._modules[name] = swapped[id(child)][1]
    return root


def _build_slim(stock: nn.MultiheadAttention, *, skip_unread_weights: bool = False) -> SlimMultiheadAttention:
    slim = SlimMultiheadAttention(
        stock.embed_dim,
        stock.num_heads,
        stock.dropout,
        bias=stock.in_proj_bias is not None,
        add_bias_kv=stock.bias_k is not None,
        add_zero_attn=stock.add_zero_attn,
        kdim=stock.kdim,
        vdim=stock.vdim,
        batch_first=stock.batch_first,
        device="meta",  # no allocation or random draws: every tensor is assigned below
        skip_unread_weights=skip_unread_weights,
    )
    flags = {name: parameter.requires_grad for name, parameter in stock.named_parameters()}
    packed_flag = flags.get("in_proj_bias", True)  # the split biases inherit the packed one's flag
    _load_shared(slim, stock, lambda name: packed_flag if name in _SPLIT_BIASES else flags[name])
    return slim


def _build_stock(slim: SlimMultiheadAttention) -> nn.MultiheadAttention:
    stock = _STOCK(
        slim.embed_dim,
        slim.num_heads,
        slim.dropout,
        bias=slim.q_proj_bias is not None,
        add_bias_kv=slim.bias_k is not None,
        add_zero_attn=slim.add_zero_attn,
        kdim=slim.kdim,
        vdim=slim.vdim,
        batch_first=slim.batch_first,
        device="meta",
    )
    state = slim.state_dict(keep_vars=True)
    for name in _SPLIT_BIASES:
        state.pop(name, None)
    # The stock view: in_proj_bias (its key slot included) with bias_k as it is has slim's function.
    # (state_dict folds a written key slot into bias_k; here the slot stays, so bias_k is taken raw.)
    packed = slim.in_proj_bias
    if packed is not None:
        state["in_proj_bias"] = packed.detach().clone()
    if slim.bias_k is not None:
        state["bias_k"] = slim.bias_k
    flags = {name: parameter.requires_grad for name, parameter in slim.named_parameters()}
    # One packed parameter from up to three: trainable if any part was (a folded v bias has no flag).
    packed_flag = any(flags[name] for name in _SPLIT_BIASES if name in flags)
    _load_shared(stock, slim, lambda name: packed_flag if name == "in_proj_bias" else flags[name], state)
    return stock


def _load_shared(
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
    for attribute in _HOOK_ATTRIBUTES:
        hooks = old.__dict__.get(attribute)
        if hooks is None:
            continue
        hooks.update(new.__dict__.get(attribute, {}))  # none today; kept if the class ever adds one
        new.__dict__[attribute] = hooks
    new.__dict__["_is_full_backward_hook"] = old.__dict__.get("_is_full_backward_hook")


def _fold_one(attention: SlimMultiheadAttention) -> None:
    out_proj = attention.out_proj
    with torch.no_grad():
        out_bias, bias_v = _fold_value_bias_tensors(
            attention.v_proj_bias,
            out_proj.weight,
            out_proj.bias,
            attention.bias_v,
            add_zero_attn=attention.add_zero_attn,
        )
        if out_proj.bias is None:
            out_proj.bias = Parameter(out_bias, requires_grad=attention.v_proj_bias.requires_grad)
        else:
            out_proj.bias.copy_(out_bias)
        if bias_v is not None:
            attention.bias_v.copy_(bias_v)
    attention.v_proj_bias = None


def _refuse_parametrized(root: nn.Module, cls: type, what: str, caller: str) -> None:
    """A parametrized module has a generated subclass type: refuse it, rather than skip it silently.

    Its parametrizations act on tensors (``in_proj_bias`` among them) that do not exist in the
    other layout, so they cannot be carried over. Checked before anything is swapped.
    """
    for name, child in root.named_modules():
        if isinstance(child, cls) and parametrize.is_parametrized(child):
            tensors = ", ".join(child.parametrizations.keys())
            raise ValueError(
                f"{caller}: module {_describe(name)} is a parametrized {what} (parametrizations on {tensors}), "
                "which cannot be carried over to the other bias layout; remove them first with "
                "torch.nn.utils.parametrize.remove_parametrizations, or convert before registering them"
            )


def _describe(name: str) -> str:
    return f"'{name}'" if name else "(the root)"
