"""What the checks share while they run, per thread and per async task: the models that name
modules in errors, and whether a check is re-running a model right now.

The checker (:mod:`._checker`) and both assertion modes (:mod:`._mode`, :mod:`._model_mode`) read
and set this state; it lives here so that the modes can call the checker without the checker
importing the modes back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from torch import nn

__all__ = ["naming", "qualified_name", "rerunning", "is_rerunning", "type_name"]

_MODELS: ContextVar[tuple[nn.Module, ...]] = ContextVar("slim_mha_equivariance_models", default=())
_RERUNNING: ContextVar[bool] = ContextVar("slim_mha_equivariance_rerunning", default=False)


@contextmanager
def naming(model: nn.Module | None) -> Iterator[None]:
    """Name modules of ``model`` in errors raised inside the block, without switching checks on."""
    if model is None:
        yield
        return
    token = _MODELS.set(_MODELS.get() + (model,))
    try:
        yield
    finally:
        _MODELS.reset(token)


def qualified_name(module: nn.Module) -> str | None:
    """The module's name in a model being named (walked now, on failure only)."""
    for model in reversed(_MODELS.get()):
        for name, candidate in model.named_modules():
            if candidate is module:
                return name or type(model).__name__
    return None


@contextmanager
def rerunning() -> Iterator[None]:
    """Mark the block as a check's own runs of a model (reference and permuted).

    Inside it neither mode checks anything: those runs are the check, and checking them again
    would advance the modes' call counts and seeds, so that which later calls get checked would
    depend on the checks themselves.
    """
    token = _RERUNNING.set(True)
    try:
        yield
    finally:
        _RERUNNING.reset(token)


def is_rerunning() -> bool:
    return _RERUNNING.get()


def type_name(module: object) -> str:
    """A module's class as its user knows it: while patched, ``nn.MultiheadAttention`` builds
    ``PatchedMultiheadAttention``, which users wrote as ``MultiheadAttention``."""
    name = type(module).__name__
    return "MultiheadAttention" if name == "PatchedMultiheadAttention" else name
