"""Tensors that stand for the packed bias outside it: what code written for stock is handed.

* :class:`ComputedStockBias`: ``in_proj_bias`` where it cannot be the parameters' memory. Reads are
  exact; writes, ``.grad`` and optimizer steps on it raise instead of reaching nothing.
* :func:`own_storage`: a state-dict entry with a storage of its own, still aliasing the parameter.
* :func:`copy_loaded_flags`: a loader's "loaded" flag carried to the packed or computed view.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ComputedStockBias", "copy_loaded_flags", "own_storage", "unaliased_message"]

# Flags that loaders put on tensors they filled (Hugging Face's init guard skips tensors carrying
# ``_is_hf_initialized``): the packed view carries one when every part of it does, so that an
# ``nn.init.zeros_(m.in_proj_bias)`` after loading is skipped exactly when stock's would be.
_LOADED_FLAGS = ("_is_hf_initialized",)


def own_storage(view: Tensor) -> Tensor:
    """``view``'s memory under a storage object of its own (through DLPack), for state dicts.

    The bias parameters are views of one packed storage. Tools that find shared tensors by their
    storage (safetensors' ``save_model``, accelerate's ``save_model``) would take ``q_proj_bias`` and
    ``v_proj_bias`` in a state dict for one tensor saved twice, and drop or refuse one. Entries with
    storages of their own are the separate tensors they are, and writes to them still reach the
    parameters (EMA code copies into ``state_dict()``'s tensors). The parameters themselves stay
    plain views: ``share_memory()`` and Hogwild move their one storage as a whole.
    """
    # Plain dense tensors on CPU or CUDA only: a wrapper subclass (FSDP's DTensor) has no memory of
    # its own to export, and DLPack of one crashes rather than raising.
    if type(view) is not Tensor or view.layout != torch.strided or view.device.type not in ("cpu", "cuda"):
        return view
    try:
        return torch.from_dlpack(view)
    except (RuntimeError, BufferError, TypeError, ValueError):
        return view


def unaliased_message(what: str) -> str:
    return (
        f"slim_mha: {what} cannot reach q_proj_bias/v_proj_bias: their memory is managed by someone else "
        "(vector_to_parameters, FSDP or another wrapper re-pointed them), so in_proj_bias is a computed "
        "copy here. Use q_proj_bias and v_proj_bias instead, or give them memory of their own again with "
        "module.to(module.q_proj_bias.device)"
    )


class ComputedStockBias(Tensor):
    """``in_proj_bias`` where it cannot be the parameters' memory: reads are exact, writes refuse.

    Stock code writes ``in_proj_bias`` in place (``nn.init.zeros_``, ``.copy_``, ``.data = ...``) or
    hands it to an optimizer. On a computed copy those would change nothing, silently; here they
    raise instead. Reads (and gradients of computations with it) reach the parameters as usual.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _writes(func, kwargs):
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(unaliased_message(f"writing in_proj_bias ({name})"))
        if _is_attribute_access(func, Tensor.grad, "__get__"):
            raise RuntimeError(unaliased_message("reading in_proj_bias.grad (an optimizer or clip_grad_norm_ does)"))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        # Views of it (``.data``, ``.detach()``, slices) refuse writes too; new tensors are plain.
        if isinstance(result, Tensor) and not isinstance(result, cls) and _shares_memory(result, args):
            return result.as_subclass(cls)
        return result


# The in-place operators by name; other dunders that start with "__i" (__int__, __index__, __iter__)
# only read.
_IN_PLACE_DUNDERS = frozenset(
    f"__i{operator}__"
    for operator in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
                     "lshift", "rshift")
) | {"__setitem__"}


_SETTABLE_ATTRIBUTES = (Tensor.data, Tensor.grad, Tensor.requires_grad)


def _writes(func, kwargs: dict) -> bool:
    if any(_is_attribute_access(func, attribute, "__set__") for attribute in _SETTABLE_ATTRIBUTES):
        return True
    name = getattr(func, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__")
    return in_place or name in _IN_PLACE_DUNDERS or kwargs.get("out") is not None


def _is_attribute_access(func, attribute, kind: str) -> bool:
    # Each ``Tensor.grad.__get__`` is a new bound method object: compare what it is bound to.
    return getattr(func, "__name__", "") == kind and getattr(func, "__self__", None) is attribute


def _shares_memory(result: Tensor, args) -> bool:
    try:
        address = result.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    for arg in args:
        if isinstance(arg, ComputedStockBias):
            try:
                if arg.untyped_storage().data_ptr() == address:
                    return True
            except (RuntimeError, NotImplementedError):
                pass
    return False


def copy_loaded_flags(packed: Tensor, parts: tuple) -> None:
    present = [p for p in parts if p is not None]
    for flag in _LOADED_FLAGS:
        if all(getattr(p, flag, False) for p in present):
            setattr(packed, flag, True)
        elif flag in packed.__dict__:
            delattr(packed, flag)
