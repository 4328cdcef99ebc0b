"""slim_mha: a faster nn.MultiheadAttention without the key bias, exact to stock."""

import importlib

# Each public name and the submodule that defines it. They are imported on first use (PEP 562), all at
# once, not here: importing torch takes seconds, and the slim-mha-migrate CLI, which lives in this
# package, must be able to catch a Ctrl-C during that import (it imports torch inside its guard).
_EXPORTS = {
    "SlimMultiheadAttention": "attention",
    "patch": "patching",
    "unpatch": "patching",
    "patched": "patching",
    "is_patched": "patching",
    "convert": "conversion",
    "to_stock": "conversion",
    "fold_value_bias": "conversion",
    "unread_weights_report": "unread_weights",
    "UnreadWeightsReport": "unread_weights",
    "UnreadWeightsSite": "unread_weights",
    "EquivarianceError": "equivariance",
    "checking_equivariance": "equivariance",
    "assert_permutation_equivariant": "equivariance",
    "assert_permutation_invariant": "equivariance",
    "permutation_equivariance_error": "equivariance",
    "format_permutation_error": "equivariance",
    "recording_attention": "inspection",
    "explain": "inspection",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def _bind_exports() -> None:
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _bind_exports()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
