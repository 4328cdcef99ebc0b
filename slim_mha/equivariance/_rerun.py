"""The float32 rerun that measures what a low-precision call rounds.

A bfloat16 call rounds by anything from nothing to 4% of its output (a sharp softmax rounds its
logits), so no one relative tolerance tells a 4% leak from rounding: the table's 8e-2 let such
leaks through. Rerunning the same call in float32 (its low-precision inputs, parameters and
buffers upcast, autocast off) shows how far the reference lies from the value it rounds; a
correct permuted run lies about as far on the other side (:meth:`TensorError.tolerance`).

The rerun happens inside the check's isolated runs (no grad, no dropout, buffers on copies, the
random state rewound), so it changes the step no more than the two runs of the comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ._measure import low_precision, tolerance_dtype

__all__ = ["low_precision", "wanted", "upcast", "in_float32", "float32_rerun"]


def wanted(outputs: list) -> bool:
    """Whether any tensor output is judged in a low-precision dtype (its own, or autocast's)."""
    return any(
        isinstance(leaf, Tensor) and leaf.is_floating_point() and low_precision(tolerance_dtype(leaf))
        for _, leaf in outputs
    )


def upcast(values: Sequence) -> list:
    """``values`` with each low-precision tensor in float32; a tensor passed twice is upcast once, so
    that ``query is key`` holds in the rerun as in the call (it selects attention's fused projection)."""
    copies: dict[int, Tensor] = {}
    for value in values:
        if isinstance(value, Tensor) and low_precision(value.dtype) and id(value) not in copies:
            copies[id(value)] = value.float()
    return [copies.get(id(value), value) for value in values]


@contextmanager
def in_float32(module: nn.Module | None) -> Iterator[None]:
    """``module``'s low-precision parameters and buffers replaced by float32 copies (tied ones stay
    tied), and autocast off on every device, while the block runs; the originals back after."""
    swapped: list[tuple[dict, str, Tensor]] = []
    copies: dict[int, Any] = {}
    try:
        for owner in module.modules() if module is not None else ():
            for slots in (owner._parameters, owner._buffers):
                for name, tensor in list(slots.items()):
                    if tensor is not None and low_precision(tensor.dtype):
                        if id(tensor) not in copies:  # a parameter stays one: code may ask
                            copy = tensor.detach().float()
                            is_parameter = isinstance(tensor, nn.Parameter)
                            copies[id(tensor)] = nn.Parameter(copy, tensor.requires_grad) if is_parameter else copy
                        swapped.append((slots, name, tensor))
                        slots[name] = copies[id(tensor)]
        with ExitStack() as stack:
            for device_type in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        for slots, name, tensor in reversed(swapped):
            slots[name] = tensor


def float32_rerun(fn: Callable, inputs: tuple, kwargs: dict, module: nn.Module | None):
    """``fn`` run again in float32 on ``inputs``, or ``None`` where it cannot be (a function that
    casts to a low precision of its own, or a module it holds that the check was not told of:
    then the dtypes clash). The caller rewinds the state before and after."""
    try:
        with in_float32(module):
            upcast_values = upcast([*inputs, *kwargs.values()])
            return fn(*upcast_values[: len(inputs)], **dict(zip(kwargs, upcast_values[len(inputs) :])))
    except Exception:  # any failure means "no rerun", and the table's tolerance applies
        return None
