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

from . import unread_weights
from ._swap import build_stock, load_shared, meta_options, refuse_folded_value_bias
from ._torch_compat import STOCK_MHA
from .attention import SlimMultiheadAttention
from .bias import BIAS_NAMES, fold_value_bias_into_output
from .patching import PatchedMultiheadAttention

__all__ = ["convert", "to_stock", "fold_value_bias"]

_SLIM_TYPES = (SlimMultiheadAttention, PatchedMultiheadAttention)


def convert(module: nn.Module, *, skip_unread_weights: bool = False) -> nn.Module:
    """Replace every stock ``nn.MultiheadAttention`` in ``module``'s tree by a slim one, in place.

    The function computed is unchanged (the key bias is folded as in ``load_state_dict``).
    ``skip_unread_weights`` is given to the slim modules built (modules already slim keep theirs).

    Returns:
        ``module``, or the new slim module when ``module`` itself is a stock attention module.
    """
    skip = unread_weights.resolve_option(skip_unread_weights)
    _refuse_parametrized(module, STOCK_MHA, "nn.MultiheadAttention", "convert")
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
    for name, child in module.named_modules():  # all checked before anything is swapped
        if _is_slim(child):
            refuse_folded_value_bias(child, _describe(name), "to_stock")
    return _swap_modules(module, _is_slim, build_stock)


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
    return type(module) is STOCK_MHA


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
        **meta_options(stock, bias=stock.in_proj_bias is not None), skip_unread_weights=skip_unread_weights
    )
    flags = {name: parameter.requires_grad for name, parameter in stock.named_parameters()}
    packed_flag = flags.get("in_proj_bias", True)  # the split biases inherit the packed one's flag
    load_shared(slim, stock, lambda name: packed_flag if name in BIAS_NAMES else flags[name])
    return slim


def _fold_one(attention: SlimMultiheadAttention) -> None:
    out_proj = attention.out_proj
    with torch.no_grad():
        out_bias, bias_v = fold_value_bias_into_output(
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
