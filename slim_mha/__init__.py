"""slim_mha: a faster nn.MultiheadAttention without the key bias, exact to stock."""

from .attention import SlimMultiheadAttention
from .convert import convert, fold_value_bias, to_stock
from .patching import is_patched, patch, patched, unpatch
from ._unread_weights import UnreadWeightsReport, UnreadWeightsSite, unread_weights_report
from .equivariance import (
    EquivarianceError,
    assert_permutation_equivariant,
    assert_permutation_invariant,
    checking_equivariance,
    format_permutation_error,
    permutation_equivariance_error,
)

__all__ = [
    "SlimMultiheadAttention",
    "patch",
    "unpatch",
    "patched",
    "is_patched",
    "convert",
    "to_stock",
    "fold_value_bias",
    "unread_weights_report",
    "UnreadWeightsReport",
    "UnreadWeightsSite",
    "EquivarianceError",
    "checking_equivariance",
    "assert_permutation_equivariant",
    "assert_permutation_invariant",
    "permutation_equivariance_error",
    "format_permutation_error",
]
__version__ = "0.1.0"
