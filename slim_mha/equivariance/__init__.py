r"""Permutation equivariance: an assertion mode for attention calls, and checkers for any model.

Attention without positional information treats its tokens as a set. For queries ``X``, keys and
values ``Y`` and permutation matrices ``P``, ``Q``:

* ``attention(P X, Y) = P attention(X, Y)``: permuting the queries permutes the output
  (equivariance), because each output row depends on its own query only;
* ``attention(X, Q Y) = attention(X, Y)``: permuting keys and values together changes nothing
  (invariance), because ``softmax(q Kᵀ) V`` sums over the keys, and a sum ignores order. The
  attention weights are permuted along their columns, ``W Qᵀ``.

Self-attention (``X = Y``) is therefore equivariant, not invariant. Both hold in exact arithmetic
only: in floating point the reordered sums differ in the last bits, so ``torch.equal`` is the wrong
test and every check here compares within a tolerance from :data:`TOLERANCE`, relative to the
output's largest magnitude.

* :func:`checking_equivariance`, ``SlimMultiheadAttention(check_equivariance=True)`` and the
  environment variable ``SLIM_MHA_CHECK_EQUIVARIANCE`` make slim attention check its own calls;
  ``checking_equivariance(model, dim=...)`` checks the model's own calls as well, as a whole.
* :func:`assert_permutation_equivariant`, :func:`assert_permutation_invariant` and
  :func:`permutation_equivariance_error` check any function or model, and name where the property
  first breaks: a submodule, or the code between two submodule calls (:class:`Culprit`).
* :func:`draw_permutation` draws the permutation a check with a given seed applies, and
  :func:`draw_permutations` the one per sample that the checkers and the model-level mode apply to a
  batch, so that a failure's seed reproduces it.
"""

from ._checker import (
    assert_permutation_equivariant,
    assert_permutation_invariant,
    permutation_equivariance_error,
)
from ._locate import Culprit
from ._measure import TOLERANCE, EquivarianceError, draw_permutation, draw_permutations
from ._mode import ENVIRONMENT_VARIABLE, checking_equivariance
from ._report import PermutationErrors, format_permutation_error

# The public surface. The records inside a result (OutputCheck, SubmoduleCheck, CallSite, TensorError)
# are reached through PermutationErrors' attributes and documented there.
__all__ = [
    "EquivarianceError",
    "checking_equivariance",
    "assert_permutation_equivariant",
    "assert_permutation_invariant",
    "permutation_equivariance_error",
    "format_permutation_error",
    "PermutationErrors",
    "Culprit",
    "draw_permutation",
    "draw_permutations",
    "TOLERANCE",
    "ENVIRONMENT_VARIABLE",
]
