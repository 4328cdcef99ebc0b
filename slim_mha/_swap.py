"""One module in the other class, holding the same parameters: the core of ``convert``, ``to_stock``
and ``torch.jit.script``'s ``__prepare_scriptable__``; and the folded-value-bias mark they check.

Scripting: ``torch.jit.script`` of a model that holds slim modules compiles stock's classes, keeps the
user's methods, and never changes the eager model.

TorchScript cannot compile slim's Python ``forward``, so a slim module's ``__prepare_scriptable__``
hands torch a module of stock's class holding the same parameters, submodules and hooks
(:func:`prepare_scriptable`). A user's subclass of a slim class becomes the same subclass with
stock's class in slim's place, so its own methods are the ones compiled.

torch puts whatever ``__prepare_scriptable__`` returns into the parent's ``_modules`` in place, which
would leave the user's eager model holding stock modules after scripting. So scripting a tree that
holds slim modules prepares a shadow of it instead (:func:`shadow_tree`): new module objects with
their own ``_modules`` dictionaries, sharing every parameter, buffer and hook, as stock's scripted
module shares them with the eager one.


Stock and slim modules have the same parameters, in the same order, under the same names: a swap
builds the new object around the old one's parameter objects, ``out_proj`` submodule, flags and hook
dictionaries (so existing ``RemovableHandle`` objects still remove their hooks). Nothing is copied or
re-initialised, device and dtype cannot change, and an optimizer built before keeps training them.
"""

from __future__ import annotations

import functools
import types
from typing import TypeVar

from torch import Tensor, nn

from ._stock_checks import rows_masked_from_every_key
from ._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA, wrap_jit_prepare

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "FOLDED_VALUE_BIAS",
    "SLIM_ATTRIBUTES",
    "has_folded_value_bias",
    "left_stock",
    "prepare_scriptable",
    "rebuild_as",
    "refuse_folded_value_bias",
    "refuse_rows_masked_from_every_key",
    "shadow_tree",
    "slim_stands_for",
    "stock_counterpart",
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
            "the fold adds W_o·b_v. Load the unfolded weights again first (load_state_dict clears the fold), or keep "
            "an unfolded copy for this and fold only the model you run (fold_value_bias(copy.deepcopy(model).eval()))"
        )


def refuse_rows_masked_from_every_key(mask: Tensor) -> None:
    """A folded value bias is exact only where attention rows sum to one (see fold_value_bias).

    A query masked from every key has a row of zeros: stock outputs ``out_proj.bias`` there, while
    the folded bias adds ``W_o b_v``. The fold cannot be undone here, so such a call is refused.
    """
    if bool(rows_masked_from_every_key(mask).any()):
        raise RuntimeError(
            "slim_mha: a query row is masked from every key, and this module's value bias was folded into "
            "out_proj.bias (fold_value_bias), which is exact only where each query attends to some key "
            "(stock outputs out_proj.bias on such a row, the fold adds W_o·b_v). Use the unfolded module "
            "for inputs like this, or leave at least one key unmasked per query"
        )


def rebuild_as(module: nn.Module, cls: type[M], **attributes) -> M:
    """A new ``cls`` module that holds ``module``'s parameters, submodules, buffers, flags and hooks.

    Both classes must be stock ``nn.MultiheadAttention`` or a subclass that adds no state of its own
    beyond ``SLIM_ATTRIBUTES``; those are dropped, then ``attributes`` are set.
    """
    if slim_stands_for(cls):
        script_on_shadows()
    new = object.__new__(cls)  # nn.Module defines no __new__: no __init__ runs, the state is copied below
    state = {name: value for name, value in module.__dict__.items() if name not in SLIM_ATTRIBUTES}
    for name in _OWN_CONTAINERS:
        if name in state:
            state[name] = state[name].copy()
    state.update(attributes)
    new.__dict__.update(state)
    return new


def left_stock(cls: type) -> bool:
    """Whether ``cls`` is a subclass of torch's attention or encoder-layer class of the user's own, which
    ``convert`` and the patch leave as it is: it may override what slim replaces. Torch's classes
    themselves and slim's (and subclasses of slim's) are not."""
    return (
        issubclass(cls, (STOCK_MHA, STOCK_ENCODER_LAYER))
        and cls not in (STOCK_MHA, STOCK_ENCODER_LAYER)
        and slim_stands_for(cls) is None
    )


def slim_stands_for(cls: type) -> type | None:
    """The stock class a slim class (or a subclass of one) stands for, from its ``_scripted_as``;
    ``None`` for any other class. The one reading of that mark: scripting and inspection use it."""
    return getattr(cls, "_scripted_as", None)


# What a class body holds that its metaclass makes anew for every class.
_MADE_PER_CLASS = ("__dict__", "__weakref__", "_abc_impl")
# Each slim class sets ``_scripted_as``, the stock class TorchScript compiles in its place.


def stock_counterpart(cls: type) -> type:
    """``cls`` with stock's class wherever slim's stands among its bases, and ``cls``'s own methods.

    Slim's classes name their stock class in their own ``_scripted_as``; a user's subclass maps to a
    class of the same name, module and body whose bases are mapped the same way, so TorchScript
    compiles the user's methods on stock's.
    """
    counterpart = _COUNTERPARTS.get(cls)
    if counterpart is None:
        counterpart = _COUNTERPARTS[cls] = _counterpart_of(cls)
    return counterpart


_COUNTERPARTS: dict[type, type] = {}  # one counterpart class per class, as TorchScript caches types


def _counterpart_of(cls: type) -> type:
    if "_scripted_as" in cls.__dict__:
        return cls.__dict__["_scripted_as"]
    if not any(slim_stands_for(base) for base in cls.__bases__):
        return cls
    bases = tuple(stock_counterpart(base) for base in cls.__bases__)
    body = {name: value for name, value in cls.__dict__.items() if name not in _MADE_PER_CLASS}
    try:
        return types.new_class(cls.__name__, bases, {}, lambda namespace: namespace.update(body))
    except Exception as error:
        raise TypeError(
            f"torch.jit.script: {cls.__module__}.{cls.__qualname__} derives from a slim_mha class and cannot be "
            f"rebuilt on stock's ({error}); script it unpatched (slim_mha.to_stock(model) first)"
        ) from error


def prepare_scriptable(module: nn.Module) -> nn.Module:
    """The module TorchScript compiles for a slim ``module``: its stock counterpart, same state."""
    refuse_folded_value_bias(module, "(this module)", "torch.jit.script")
    counterpart = stock_counterpart(type(module))
    if not issubclass(counterpart, nn.Module):  # a module's class maps to a module's class
        raise TypeError(f"torch.jit.script: {type(module).__qualname__} maps to {counterpart!r}, not a module class")
    return rebuild_as(module, counterpart)


def shadow_tree(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """A copy of ``module``'s tree whose modules are new objects with their own ``_modules``
    dictionaries, sharing everything else (parameters, buffers, hooks, flags). A module reached
    twice is shadowed once; script modules are left as they are."""
    from torch.jit import ScriptModule

    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    if isinstance(module, ScriptModule):
        return module
    shadow = type(module).__new__(type(module))
    memo[id(module)] = shadow
    state = dict(module.__dict__)
    state["_modules"] = {
        name: child if child is None else shadow_tree(child, memo) for name, child in module._modules.items()
    }
    for name, value in module.__dict__.items():
        if name != "_modules" and isinstance(value, nn.Module):
            state[name] = shadow_tree(value, memo)
    shadow.__dict__.update(state)
    return shadow


def _holds_slim(module: object) -> bool:
    return isinstance(module, nn.Module) and any(slim_stands_for(type(child)) for child in module.modules())


def _prepare_on_a_shadow(prepare):
    @functools.wraps(prepare)
    def prepare_leaving_the_eager_model(obj):
        return prepare(shadow_tree(obj) if _holds_slim(obj) else obj)

    return prepare_leaving_the_eager_model


def script_on_shadows() -> None:
    """From now on ``torch.jit.script`` prepares a tree that holds slim modules on a shadow of it,
    so the eager tree keeps its modules (:func:`shadow_tree`). Idempotent. Called where slim modules
    come to be (the patch, their constructors, :func:`rebuild_as`), not on import: importing slim_mha
    leaves torch as it is."""
    wrap_jit_prepare(_prepare_on_a_shadow)
