"""``torch.jit.script`` of models that hold slim modules: stock's classes are compiled, the user's
methods are kept, and the eager model is never changed.

TorchScript cannot compile slim's Python ``forward``, so a slim module's ``__prepare_scriptable__``
hands torch a module of stock's class holding the same parameters, submodules and hooks
(:func:`prepare_scriptable`). A user's subclass of a slim class (a class defined while patched
derives from slim) becomes the same subclass with stock's class in slim's place, so its own methods
are the ones compiled.

torch puts whatever ``__prepare_scriptable__`` returns into the parent's ``_modules`` in place, which
would leave the user's eager model holding stock modules after scripting. So scripting a tree that
holds slim modules prepares a shadow of it instead (:func:`shadow_tree`): new module objects with
their own ``_modules`` dictionaries, sharing every parameter, buffer and hook, as stock's scripted
module shares them with the eager one.
"""

from __future__ import annotations

import functools
import types

from torch import nn

from ._swap import rebuild_as, refuse_folded_value_bias
from ._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA, wrap_jit_prepare

__all__ = ["prepare_scriptable", "shadow_tree", "stock_counterpart"]


# What a class body holds that its metaclass makes anew for every class.
_MADE_PER_CLASS = ("__dict__", "__weakref__", "_abc_impl")
# Each slim class sets ``_scripted_as``, the stock class TorchScript compiles in its place.


@functools.cache
def stock_counterpart(cls: type) -> type:
    """``cls`` with stock's class wherever slim's stands among its bases, and ``cls``'s own methods.

    Slim's classes name their stock class in their own ``_scripted_as``; a user's subclass maps to a
    class of the same name, module and body whose bases are mapped the same way, so TorchScript
    compiles the user's methods on stock's.
    """
    if "_scripted_as" in cls.__dict__:
        return cls.__dict__["_scripted_as"]
    if not any(hasattr(base, "_scripted_as") for base in cls.__bases__):
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
    return rebuild_as(module, stock_counterpart(type(module)))


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
    state["_modules"] = {name: child if child is None else shadow_tree(child, memo) for name, child in module._modules.items()}
    for name, value in module.__dict__.items():
        if name != "_modules" and isinstance(value, nn.Module):
            state[name] = shadow_tree(value, memo)
    shadow.__dict__.update(state)
    return shadow


def _holds_slim(module: object) -> bool:
    return isinstance(module, nn.Module) and any(hasattr(type(child), "_scripted_as") for child in module.modules())


def _prepare_on_a_shadow(prepare):
    @functools.wraps(prepare)
    def prepare_leaving_the_eager_model(obj):
        return prepare(shadow_tree(obj) if _holds_slim(obj) else obj)

    return prepare_leaving_the_eager_model


wrap_jit_prepare(_prepare_on_a_shadow)
