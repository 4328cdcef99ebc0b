"""Swap attention modules in live models: ``convert`` (stock to slim), ``to_stock``, ``fold_value_bias``.

All three walk a module tree and change it in place; the bias arithmetic itself lives in
:mod:`slim_mha.bias`.

Stock and slim modules have the same parameters, so a swapped module holds the old module's
parameter objects, its ``out_proj`` submodule, ``requires_grad`` flags, ``training`` flag and every
hook registered on it (the hook dictionaries move over as they are, so existing ``RemovableHandle``
objects still remove them). Nothing is copied: optimizers built before a swap keep training the
same tensors. A module reached through several parents is swapped once and stays shared.

Only modules whose type is exactly the stock class (for ``convert``) or exactly a slim class (for
``to_stock``) are swapped: a user subclass may override ``forward``, and swapping it would drop that.

``nn.TransformerEncoderLayer`` is swapped the same way, for :class:`~slim_mha.encoder_layer.SlimTransformerEncoderLayer`
and back: stock's layer runs a fused kernel in inference that never calls the attention module.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import cast

import torch
from torch import nn
from torch.nn.parameter import Parameter
from torch.nn.utils import parametrize

from ._swap import (
    FOLDED_VALUE_BIAS,
    has_folded_value_bias,
    left_stock,
    rebuild_as,
    refuse_folded_value_bias,
)
from ._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA
from .attention import SlimMultiheadAttention, slim_options
from .bias import fold_value_bias_into_output
from .encoder_layer import SlimTransformerEncoderLayer
from .inspection import no_attention_here
from .patching import PatchedMultiheadAttention, PatchedTransformerEncoderLayer

__all__ = ["convert", "to_stock", "fold_value_bias"]

_SLIM_TYPES = (SlimMultiheadAttention, PatchedMultiheadAttention)
_SLIM_LAYER_TYPES = (SlimTransformerEncoderLayer, PatchedTransformerEncoderLayer)


def convert(module: nn.Module, *, skip_unread_weights: bool = False) -> nn.Module:
    """Replace every stock ``nn.MultiheadAttention`` in ``module``'s tree by a slim one, in place.

    The function computed is unchanged: the slim module holds the same parameters and leaves the key
    bias out of the computation. ``skip_unread_weights`` is given to the slim modules built (modules
    already slim keep theirs).

    Returns:
        ``module``, or the new slim module when ``module`` itself is a stock attention module.
    """
    _refuse_non_module(module, "convert")
    options = slim_options(skip_unread_weights=skip_unread_weights)
    _refuse_parametrized(module, STOCK_MHA, "nn.MultiheadAttention", "convert")
    _warn_what_stays_stock(module)
    module = _swap_modules(module, _is_stock, lambda stock: rebuild_as(stock, SlimMultiheadAttention, **options))
    return _swap_modules(
        module,
        lambda child: type(child) is STOCK_ENCODER_LAYER,
        lambda layer: rebuild_as(layer, SlimTransformerEncoderLayer),
    )


def _refuse_non_module(module: object, caller: str) -> None:
    """A state dict, or anything else that is not a module, refused in one line that names the fix."""
    if isinstance(module, Mapping):
        raise TypeError(
            f"{caller}: got a state dict (a mapping of names to tensors), not a model: build the model, "
            f"load the weights with model.load_state_dict(state_dict), then {caller}(model); to migrate "
            "a checkpoint file itself, use slim-mha-migrate"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller}: expected an nn.Module, got {type(module).__name__}")


def _warn_what_stays_stock(module: nn.Module) -> None:
    """One warning where ``convert`` leaves attention as it is: a model holding no
    ``nn.MultiheadAttention`` (naming the attention classes it does hold), or subclasses of torch's
    classes of the user's own, which may override what slim replaces."""
    subclasses = [
        f"{_describe(name)} ({type(child).__qualname__})"
        for name, child in module.named_modules()
        if left_stock(type(child))
    ]
    if subclasses:
        warnings.warn(
            f"convert: left as they are, subclasses of torch's attention classes of your own, which may "
            f"override what slim replaces: {', '.join(subclasses[:8])}{' ...' if len(subclasses) > 8 else ''}; "
            "to make one slim, derive it from slim_mha.SlimMultiheadAttention (or SlimTransformerEncoderLayer)",
            UserWarning,
            stacklevel=3,
        )
    if not any(isinstance(child, STOCK_MHA) for child in module.modules()):
        warnings.warn(f"convert: {no_attention_here(module)}, so nothing was converted", UserWarning, stacklevel=3)


def to_stock(module: nn.Module) -> nn.Module:
    """Replace every slim attention module in ``module``'s tree by a stock ``nn.MultiheadAttention``.

    The stock module holds the same parameters and computes the same outputs (it adds the key bias,
    which softmax cancels). Works while patched too: the modules built are always torch's stock class.

    Returns:
        ``module``, or the new stock module when ``module`` itself is a slim attention module.
    """
    _refuse_non_module(module, "to_stock")
    _refuse_parametrized(module, SlimMultiheadAttention, "slim attention module", "to_stock")
    for name, child in module.named_modules():  # all checked before anything is swapped
        if _is_slim(child):
            refuse_folded_value_bias(child, _describe(name), "to_stock")
    module = _swap_modules(module, _is_slim, lambda slim: rebuild_as(slim, STOCK_MHA))
    return _swap_modules(
        module, lambda child: type(child) in _SLIM_LAYER_TYPES, lambda layer: rebuild_as(layer, STOCK_ENCODER_LAYER)
    )


def fold_value_bias(module: nn.Module) -> nn.Module:
    r"""Fold each slim module's value bias into ``out_proj.bias``, in place; an inference transform.

    Why it is exact: output ``i`` is ``W_o Σ_j a_ij (W_v x_j + b_v) + b_o`` and each attention row
    sums to one, so ``b_v`` contributes ``W_o b_v`` to every output: ``b_o' = b_o + W_o b_v``, and the
    value slot of ``in_proj_bias`` is zeroed. An ``add_bias_kv`` value token, which is not
    projected, becomes ``bias_v - b_v`` to match. This
    fails when dropout rescales attention rows (training with ``dropout > 0``) and with
    ``add_zero_attn``, whose zero value token cannot absorb ``-b_v``: both are refused, before any
    module is changed. It fails too on a query row masked from every key, whose attention row is
    zero (stock outputs ``b_o`` there): a folded module refuses such a call, and :func:`to_stock`
    refuses a folded module. The mark lives on the module, not in its state dict: the state dict
    saved from a folded model is stock's layout, and a module loading it computes stock's function
    of those weights.

    Modules without a value bias (``bias=False``) or already folded are skipped, so folding twice
    is harmless.

    Raises:
        ValueError: if the tree holds a stock ``nn.MultiheadAttention`` (its forward cannot refuse the
            rows the fold gets wrong: run :func:`convert` first), or a module with ``add_zero_attn=True``.
        RuntimeError: if a module is in training mode with ``dropout > 0``.

    Returns:
        ``module``.
    """
    _refuse_non_module(module, "fold_value_bias")
    _refuse_parametrized(module, SlimMultiheadAttention, "slim attention module", "fold_value_bias")
    to_fold = []
    for name, child in module.named_modules():
        if _is_stock(child):
            raise ValueError(
                f"fold_value_bias: module {_describe(name)} is a stock nn.MultiheadAttention, whose forward "
                "cannot refuse the query rows a folded value bias gets wrong (rows masked from every key); "
                "run slim_mha.convert(module) first"
            )
        if not isinstance(child, SlimMultiheadAttention) or child.in_proj_bias is None or has_folded_value_bias(child):
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


def _fold_one(attention: SlimMultiheadAttention) -> None:
    E, out_proj = attention.embed_dim, attention.out_proj
    value_bias = attention.in_proj_bias[2 * E :]
    with torch.no_grad():
        out_bias, bias_v = fold_value_bias_into_output(
            value_bias, out_proj.weight, out_proj.bias, attention.bias_v, add_zero_attn=attention.add_zero_attn
        )
        if out_proj.bias is None:
            out_proj.bias = Parameter(out_bias, requires_grad=attention.in_proj_bias.requires_grad)
        else:
            out_proj.bias.copy_(out_bias)
        if bias_v is not None and attention.bias_v is not None:
            attention.bias_v.copy_(bias_v)
        value_bias.zero_()
    attention.__dict__[FOLDED_VALUE_BIAS] = True


def _refuse_parametrized(root: nn.Module, cls: type[nn.Module], what: str, caller: str) -> None:
    """A parametrized module has a generated subclass type: refuse it, rather than skip it silently.

    Its class is generated from the class it was built from, so it cannot take the other class
    without dropping its parametrizations. Checked before anything is changed.
    """
    for name, child in root.named_modules():
        if isinstance(child, cls) and parametrize.is_parametrized(child):
            tensors = ", ".join(
                cast(nn.ModuleDict, child.parametrizations).keys()
            )  # what register_parametrization makes
            raise ValueError(
                f"{caller}: module {_describe(name)} is a parametrized {what} (parametrizations on {tensors}), "
                f"which {caller} cannot change without dropping them; remove them first with "
                "torch.nn.utils.parametrize.remove_parametrizations, or call it before registering them"
            )


def _describe(name: str) -> str:
    return f"'{name}'" if name else "(the root)"
