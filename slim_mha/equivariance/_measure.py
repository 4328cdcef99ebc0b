"""The numbers behind every check: the tolerance table, one tensor's error, the permutations, the error type.

An error is always measured against what the output *should* be (the reference output permuted,
or left alone) and reported relative to the reference's largest finite magnitude, so that one
relative tolerance per dtype serves outputs of any scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SENTINEL",
    "TOLERANCE",
    "EquivarianceError",
    "magnitudes",
    "TensorError",
    "tolerance_for",
    "tolerance_dtype",
    "measure_error",
    "draw_permutation",
    "permute",
    "format_indices",
]

# Largest error allowed, relative to max |expected output|. Permuting tokens reorders the sums over
# keys and moves rows across kernel tiles, so a correct call differs from the permuted reference by
# a few rounding errors, amplified by large attention logits. Measured on correct slim attention
# calls (random shapes, masks, appended tokens, logits up to ~1e3): at most 5e-14 (float64),
# 8e-6 (float32), 1.1e-2 (bfloat16), 1.3e-3 (float16). Each entry keeps about 8x headroom or more
# over that, and stays far below what a real break produces (errors of order 1).
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 8e-2,
    torch.float16: 1e-2,
}


# Values at or below this are an additive mask's fill (``finfo.min``, -1e9 and -1e4 are the fills in
# use; softmax sends them to zero): they never set the scale a tolerance is relative to, in the
# inputs or in an output (``scores.masked_fill(pad, -1e9)``), or they would hide any real break.
# Large positive values, and negative ones above it, still do: a point cloud far from the origin.
SENTINEL = -1e4


def tolerance_for(dtype: torch.dtype) -> float:
    """The relative tolerance for ``dtype``: the table's entry, exact for integers and booleans."""
    if dtype in TOLERANCE:
        return TOLERANCE[dtype]
    if dtype.is_complex:
        return tolerance_for(torch.empty((), dtype=dtype).real.dtype)
    if not dtype.is_floating_point:
        return 0.0
    # Narrower floats (float8) than the table covers: scale bfloat16's entry by the precision lost.
    return TOLERANCE[torch.bfloat16] * max(1.0, torch.finfo(dtype).eps / torch.finfo(torch.bfloat16).eps)


def tolerance_dtype(output: Tensor) -> torch.dtype:
    """The output's dtype, or the autocast dtype when autocast computed it in lower precision."""
    device_type = output.device.type
    try:
        autocast = torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # device types autocast does not know
        autocast = False
    if autocast and output.is_floating_point():
        lowered = torch.get_autocast_dtype(device_type)
        if torch.finfo(lowered).eps > torch.finfo(output.dtype).eps:
            return lowered
    return output.dtype


def less_precise(first: torch.dtype, second: torch.dtype) -> torch.dtype:
    if not (first.is_floating_point and second.is_floating_point):
        return first
    return first if torch.finfo(first).eps >= torch.finfo(second).eps else second


@dataclass(frozen=True)
class TensorError:
    """How far one tensor is from what it should be.

    Attributes:
        name: which tensor (``"output"``, ``"output[1]"``, ``"weights"``).
        shape: its shape.
        dtype: the dtype its tolerance is taken from (the lower precision of the tensor's dtype and
            an active autocast dtype).
        dims: the axes the expected tensor was permuted along; ``()`` means "expected unchanged".
        max_abs: the largest absolute error (``inf`` where NaN/inf patterns or shapes differ).
        scale: the largest finite magnitude of the expected tensor, or of the permuted inputs where
            that is larger (``scale_of`` says which).
        where: the index of the largest error, or ``None`` when there is none to point at.
        note: why the error is infinite, when it is.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dims: tuple[int, ...]
    max_abs: float
    scale: float
    where: tuple[int, ...] | None = None
    note: str = ""
    scale_of: str = "expected"  # what ``scale`` is the largest magnitude of: "expected", or "inputs"

    @property
    def max_rel(self) -> float:
        """``max_abs / scale`` (0 when both are 0)."""
        if self.max_abs == 0.0:
            return 0.0
        return self.max_abs / self.scale if self.scale > 0.0 else float("inf")

    def tolerance(self, relative: float | None = None) -> float:
        """The absolute tolerance: ``relative`` (default: the dtype table's entry) times ``scale``."""
        relative = tolerance_for(self.dtype) if relative is None else relative
        return relative * self.scale

    def passed(self, relative: float | None = None) -> bool:
        return self.max_abs <= self.tolerance(relative)

    def describe(self, relative: float | None = None) -> str:
        """One line: the largest error, where it is, the tolerance and where that comes from.

        ``max abs error 3.1e-01 at [0, 4, 2] > tolerance 4.2e-05 (float32: 1e-04 x max|expected| 0.42),
        max rel error 7.4e-01``
        """
        relative_used = tolerance_for(self.dtype) if relative is None else relative
        source = f"{_dtype_name(self.dtype)}: " if relative is None else ""
        verdict = "<=" if self.passed(relative) else ">"
        where = f" at {format_indices(self.where)}" if self.where is not None and self.max_abs > 0 else ""
        note = f" ({self.note})" if self.note else ""
        return (
            f"max abs error {self.max_abs:.2e}{where}{note} {verdict} tolerance {self.tolerance(relative):.2e} "
            f"({source}{relative_used:.0e} x max|{self.scale_of}| {self.scale:.3g}), max rel error {self.max_rel:.2e}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure_error(
    name: str, actual: Tensor, expected: Tensor, dims: tuple[int, ...], dtype: torch.dtype | None = None
) -> TensorError:
    """Compare ``actual`` with ``expected`` elementwise; NaN matches NaN and inf matches the same inf.

    ``dtype`` overrides the dtype the tolerance is read for (default: the lower precision of the two
    tensors'). Runs without recording a graph, in a handful of kernels and one host sync (two when
    a NaN or inf shows up), since the assertion mode calls it on every checked attention call.
    """
    dtype = dtype or less_precise(actual.dtype, expected.dtype)
    shape = tuple(expected.shape)
    with torch.no_grad():
        if actual.shape != expected.shape:
            note = f"shape {tuple(actual.shape)} instead of {shape}"
            return TensorError(name, shape, dtype, dims, float("inf"), _scale(expected), None, note)
        if expected.numel() == 0:
            return TensorError(name, shape, dtype, dims, 0.0, 0.0)
        compute = torch.promote_types(torch.promote_types(actual.dtype, expected.dtype), torch.float32)
        a, e = actual.to(compute), expected.to(compute)
        difference = (a - e).abs_()
        if compute.is_complex:
            difference = difference.real
        if not bool(torch.isfinite(difference).all()):  # rare: decide NaN/inf entries elementwise
            same = (a == e) | (torch.isnan(a) & torch.isnan(e))
            difference = difference.masked_fill_(same, 0.0).nan_to_num_(nan=float("inf"))
        max_abs, flat_index = difference.reshape(-1).max(dim=0)
        magnitude = magnitudes(e)  # mask fills are compared, but never the scale
        # One host sync for all three numbers (float64 holds any index below 2**53 exactly).
        max_abs, index, scale = torch.stack([max_abs.double(), flat_index.double(), magnitude.max().double()]).tolist()
        note = "NaN or inf on one side only" if max_abs == float("inf") else ""
        return TensorError(name, shape, dtype, dims, max_abs, scale, _unravel(int(index), shape), note)


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat_index, position = divmod(flat_index, size)
        index.append(position)
    return tuple(reversed(index))


def _scale(tensor: Tensor) -> float:
    if tensor.numel() == 0:
        return 0.0
    return float(magnitudes(tensor).max())


def magnitudes(tensor: Tensor) -> Tensor:
    """``|tensor|`` as a tolerance's scale reads it, the one copy of the rule: NaN and ``+inf`` count as 0,
    and so do an additive mask's fills (real values at or below :data:`SENTINEL`)."""
    tensor = tensor.detach()
    magnitude = (tensor if tensor.is_floating_point() or tensor.is_complex() else tensor.double()).abs()  # a new tensor
    if tensor.is_floating_point():
        magnitude.masked_fill_(tensor <= SENTINEL, 0.0)
    return magnitude.nan_to_num_(nan=0.0, posinf=0.0)


def draw_permutation(length: int, seed: int) -> Tensor:
    """A permutation of ``length`` tokens that no position leak can hide from, drawn from ``seed``.

    A check by one permutation ``P`` misses every position-dependent change of the output that
    ``P`` maps onto itself. From 4 tokens on, the permutation is therefore drawn uniformly among
    those that:

    * are one cycle through every position. A change that ``P`` maps onto itself is the same on all
      positions of a cycle of ``P``; with a single cycle, only a change that is the same everywhere
      (no leak) passes, and every token moves (no fixed point hides a change at one position).
    * commute with no cyclic shift of the positions and not with their reversal (none of their
      powers is one of those). A change that is itself a shift (weight columns rolled by one, a
      circular position offset) or a reversal commutes with such a ``P`` and would pass.

    2 and 3 tokens are too few for both (every permutation of 3 positions is a rotation or a
    reflection of them): there any permutation but the identity is drawn uniformly, so that checks
    repeated with other seeds reach every leak. A seed always gives the same permutation.

    A private generator: the global RNG is neither read nor advanced. Returns a CPU int64 tensor,
    read as ``out[i] = tokens[permutation[i]]``.
    """
    generator = torch.Generator().manual_seed(seed)
    if length < 4:
        identity = torch.arange(length)
        while True:
            permutation = torch.randperm(length, generator=generator)
            if length < 2 or not bool((permutation == identity).all()):
                return permutation
    while True:  # rejects 2 draws in 3 at 4 tokens, about 1 in 6 at 6, almost none from 8 on
        order = torch.randperm(length, generator=generator)  # a uniform ordering: a uniform single cycle
        if not _commutes_with_a_shift_or_the_reversal(order):
            return _cycle_power(order, 1)


def _cycle_power(order: Tensor, exponent: int) -> Tensor:
    """The cycle ``order[0] -> order[1] -> ... -> order[-1] -> order[0]`` to the power ``exponent``.

    Position ``order[i]`` takes the token at ``order[i + exponent]``: one scatter, for any exponent.
    """
    power = torch.empty_like(order)
    power[order] = order.roll(-exponent)
    return power


def _commutes_with_a_shift_or_the_reversal(order: Tensor) -> bool:
    """Whether a power of the cycle through ``order`` is a cyclic shift of the positions or their reversal.

    What commutes with a single cycle ``c`` of length n is exactly its powers. Every non-trivial
    subgroup of the cyclic group they form contains one of prime order ``p``, generated by
    ``c^(n/p)``; so a non-trivial power of ``c`` is a shift or the reversal iff one of those is.
    """
    length = order.numel()
    positions = torch.arange(length)
    for prime in _prime_factors(length):
        power = _cycle_power(order, length // prime)
        offsets = (power - positions).remainder_(length)
        if bool((offsets == offsets[0]).all()) or bool((power == positions.flip(0)).all()):
            return True
    return False


def _prime_factors(number: int) -> list[int]:
    factors, candidate = [], 2
    while candidate * candidate <= number:
        if number % candidate == 0:
            factors.append(candidate)
            while number % candidate == 0:
                number //= candidate
        candidate += 1
    return factors + ([number] if number > 1 else [])


def permute(tensor: Tensor, dims: tuple[int, ...], permutation: Tensor) -> Tensor:
    """``tensor`` with ``permutation`` applied along each axis in ``dims``: ``out[i] = tensor[permutation[i]]``."""
    index = permutation.to(tensor.device)
    for dim in dims:
        tensor = tensor.index_select(dim, index)
    return tensor


def format_indices(values, limit: int = 24) -> str:
    """``[3, 0, 2, 1]``, elided in the middle when longer than ``limit``."""
    values = [int(v) for v in (values.tolist() if isinstance(values, Tensor) else values)]
    if len(values) <= limit:
        return "[" + ", ".join(map(str, values)) + "]"
    half = limit // 2
    head, tail = ", ".join(map(str, values[:half])), ", ".join(map(str, values[-half:]))
    return f"[{head}, ... ({len(values) - 2 * half} more) ..., {tail}]"


class EquivarianceError(AssertionError):
    """A permutation check failed: the message names what broke, by how much, and how to reproduce it.

    Attributes:
        errors: the :class:`TensorError` of every tensor that broke.
        module_name: the qualified name of the module that broke, when known.
        seed: the seed the permutation(s) were drawn from, when drawn.
        permutations: the permutations used, by role (``"query"``, ``"key/value"``, ``"inputs"``).
        result: for the function checker, the full :class:`PermutationErrors`.
    """

    def __init__(
        self,
        message: str,
        *,
        errors: tuple[TensorError, ...] = (),
        module_name: str | None = None,
        seed: int | None = None,
        permutations: dict[str, Tensor] | None = None,
        result=None,
    ) -> None:
        super().__init__(message)
        self.errors = tuple(errors)
        self.module_name = module_name
        self.seed = seed
        self.permutations = dict(permutations or {})
        self.result = result

    def __reduce__(self):
        # Keyword-only fields survive pickling (multiprocessing, distributed workers).
        state = dict(
            errors=self.errors,
            module_name=self.module_name,
            seed=self.seed,
            permutations=self.permutations,
            result=self.result,
        )
        return (_rebuild_error, (type(self), self.args[0] if self.args else "", state))


def _rebuild_error(cls, message: str, state: dict) -> EquivarianceError:
    return cls(message, **state)
