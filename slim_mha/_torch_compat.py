"""Every probe into torch's behaviour beyond its documented API, in one file.

When torch changes, this is the file to read. Each probe says what it relies on; all were checked
on torch 2.4.1 and 2.13.0 (the tested range's ends at the time of writing).
"""

from __future__ import annotations

import torch
import torch.nn.modules.activation
from torch import Tensor

__all__ = [
    "MODULE_HOOK_ATTRIBUTES",
    "STOCK_MHA",
    "is_capturing_graph",
    "is_capturing_or_transforming",
    "is_symbolic_call",
]

# torch's own class, captured when slim_mha is first imported, which is before anything can patch
# it: while patched, torch.nn.MultiheadAttention is slim's class.
STOCK_MHA = torch.nn.modules.activation.MultiheadAttention

# nn.Module's private hook dictionaries (torch/nn/modules/module.py), moved as they are when a
# module is swapped for its other layout, so that existing RemovableHandle objects still work.
MODULE_HOOK_ATTRIBUTES = (
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


def is_capturing_graph() -> bool:
    """``torch.compile``/``torch.export`` (Dynamo) or ``torch.jit.trace`` is recording this call.

    Public API both: ``torch.compiler.is_compiling`` (Dynamo folds it to True) and
    ``torch.jit.is_tracing``. Sizes are symbolic or recorded there, and no state may change.
    """
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def is_capturing_or_transforming() -> bool:
    """A graph is being captured or a ``torch.func`` transform (``vmap``, ``grad``...) wraps this
    call's tensors: no state may change, no data pointers are real.

    Private: ``torch._C._are_functorch_transforms_active``, present on every tested version. Dynamo
    on torch 2.4 cannot trace that call ("torch.* op returned non-Tensor bool"), so the graph checks
    come first: Dynamo folds ``is_compiling()`` to True and never reaches it.
    """
    return is_capturing_graph() or torch._C._are_functorch_transforms_active()


def is_symbolic_call(query: object) -> bool:
    """Whether this call's tensors may not be real ones: captured, exported, transformed or faked.

    Beyond :func:`is_capturing_or_transforming`: ``torch.compiler.is_exporting`` (torch >= 2.5; older
    export runs Dynamo, which ``is_compiling`` sees), stand-ins for tensors (FX proxies), and a
    non-empty ``torch_dispatch`` mode stack (``make_fx``, ``FakeTensorMode``, non-strict export;
    private: ``torch._C._len_torch_dispatch_stack``). ``torch.jit.script`` needs no check: scripted
    code never runs Python.
    """
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return (
        torch.compiler.is_compiling()  # first: Dynamo folds it to True and traces nothing below
        or (is_exporting is not None and is_exporting())
        or torch._C._get_tracing_state() is not None  # torch.jit.trace
        or not isinstance(query, Tensor)
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._len_torch_dispatch_stack() > 0
    )
