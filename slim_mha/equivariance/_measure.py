"""The numbers behind every check: the tolerances, one tensor's error, the permutations, the error type.

An error is always measured against what the output *should* be (the reference output permuted,
or left alone). In float32 and float64 it is judged relative to the reference's largest finite
magnitude, so that one relative tolerance per dtype serves outputs of any scale. In bfloat16 and
float16 a call's rounding varies too much for one number (a sharp softmax rounds to 4% of the
output, a smooth one to nothing), so where the check could rerun the call in float32 the tolerance
is what that call rounded: see :meth:`TensorError.tolerance`.
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
    "input_share",
    "rounding_of",
    "low_precision",
    "tolerance_dtype",
    "measure_error",
    "draw_permutation",
    "draw_permutations",
    "batch_axis",
    "measure_reading",
    "permute",
    "format_indices",
]

# Largest error allowed, relative to max |expected output|. Permuting tokens reorders the sums over
# keys and moves rows across kernel tiles, so a correct call differs from the permuted reference by
# a few rounding errors, amplified by large attention logits. Measured on correct slim attention
# calls (random shapes, masks, appended tokens, logits up to ~1e3): at most 5e-14 (float64),
# 8e-6 (float32). In bfloat16 and float16 the table is the fallback where no float32 rerun could
# measure the call's rounding: the per-call mode's 400-call sweep reached 7.6e-2 (bfloat16) and
# 8.3e-3 (float16) on correct calls, so no single number there both passes them and catches a 4% leak.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 8e-2,
    torch.float16: 1e-2,
}


# Low precision with a measured rounding (a float32 rerun of the same call): the tolerance is
# ROUNDING_FLOOR_ULPS units in the last place of max|expected| plus ROUNDING_HEADROOM times the
# rounding. Each side of a correct comparison lies about its rounding from the exact value, the
# permuted run on its side and the reference on the other: twice the rounding, and two units for a
# permuted run that rounds a little further than the reference. Over the per-call mode's 400-call
# sweep (sharp softmax, masks, weights) the largest error was 0.50 of this tolerance in bfloat16 and
# 0.55 in float16; a leak of 4% of a LayerNorm-ended bfloat16 encoder's output is caught.
ROUNDING_HEADROOM = 2.0
ROUNDING_FLOOR_ULPS = 2.0

# A tolerance relative to the inputs' scale counts one input magnitude as this many rounding units
# of the dtype: a layer that subtracts large inputs (a point cloud far from the origin) keeps a few
# of their roundings, not a share of them as large as the output's relative tolerance.
INPUT_ROUNDING_ULPS = 32.0


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


def input_share(dtype: torch.dtype) -> float:
    """How much of the inputs' largest magnitude enters the scale a tolerance is relative to: at most
    :data:`INPUT_ROUNDING_ULPS` rounding units of ``dtype`` in all (0.038 in float32: a point cloud
    1e3 from the origin allows 3.8e-3 of error, not 0.1)."""
    if not dtype.is_floating_point:
        return 0.0
    return min(1.0, INPUT_ROUNDING_ULPS * torch.finfo(dtype).eps / tolerance_for(dtype))


def low_precision(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a float less precise than float32 (bfloat16, float16, float8)."""
    return dtype.is_floating_point and torch.finfo(dtype).eps > torch.finfo(torch.float32).eps


def rounding_of(dtype: torch.dtype, reference: Tensor, rerun: Tensor) -> float | None:
    """The largest difference between a low-precision reference and its float32 rerun, over the
    entries both hold finite values for and neither holds a mask fill (``None`` when the dtype is
    not low precision or the shapes differ)."""
    if not low_precision(dtype) or reference.shape != rerun.shape or not reference.is_floating_point():
        return None
    if reference.numel() == 0:
        return 0.0
    with torch.no_grad():
        a, b = reference.detach().double(), rerun.detach().to(reference.device, torch.float64)
        kept = torch.isfinite(a) & torch.isfinite(b) & (a > SENTINEL) & (b > SENTINEL)
        return float((a - b).abs_().masked_fill_(~kept, 0.0).max())


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
        scale_of: what ``scale`` is: ``"expected"`` (its largest magnitude), or ``"inputs"`` (the
            inputs' largest magnitude times :func:`input_share`).
        rounding: in low precision, the expected tensor's largest difference from a float32 rerun
            of the same call; ``None`` where there was none (then the table's tolerance applies).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dims: tuple[int, ...]
    max_abs: float
    scale: float
    where: tuple[int, ...] | None = None
    note: str = ""
    scale_of: str = "expected"
    rounding: float | None = None

    @property
    def max_rel(self) -> float:
        """``max_abs / scale`` (0 when both are 0)."""
        if self.max_abs == 0.0:
            return 0.0
        return self.max_abs / self.scale if self.scale > 0.0 else float("inf")

    def tolerance(self, relative: float | None = None) -> float:
        """The absolute tolerance: ``relative`` times ``scale``; by default, the call's own rounding
        where it was measured (``ROUNDING_FLOOR_ULPS`` units of ``scale`` plus ``ROUNDING_HEADROOM``
        times ``rounding``), else the dtype table's entry times ``scale``."""
        if relative is None and self.rounding is not None:
            return self._floor() * self.scale + ROUNDING_HEADROOM * self.rounding
        relative = tolerance_for(self.dtype) if relative is None else relative
        return relative * self.scale

    def _floor(self) -> float:
        return ROUNDING_FLOOR_ULPS * torch.finfo(self.dtype).eps

    def passed(self, relative: float | None = None) -> bool:
        return self.max_abs <= self.tolerance(relative)

    def describe(self, relative: float | None = None) -> str:
        """One line: the largest error, where it is, the tolerance and where that comes from.

        ``max abs error 3.1e-01 at [0, 4, 2] > tolerance 4.2e-05 (float32: 1e-04 x max|expected| 0.42),
        max rel error 7.4e-01``
        """
        verdict = "<=" if self.passed(relative) else ">"
        where = f" at {format_indices(self.where)}" if self.where is not None and self.max_abs > 0 else ""
        note = f" ({self.note})" if self.note else ""
        return (
            f"max abs error {self.max_abs:.2e}{where}{note} {verdict} tolerance {self.tolerance(relative):.2e} "
            f"({self._tolerance_source(relative)}), max rel error {self.max_rel:.2e}"
        )

    def _tolerance_source(self, relative: float | None) -> str:
        scale = f"max|{self.scale_of}| {self.scale:.3g}"
        if self.scale_of == "inputs":
            scale = f"max|inputs| {self.scale / input_share(self.dtype):.3g} x {input_share(self.dtype):.2g}"
        if relative is not None:
            return f"{relative:.0e} x {scale}"
        if self.rounding is not None:
            return (
                f"{_dtype_name(self.dtype)}: {self._floor():.0e} x {scale} + {ROUNDING_HEADROOM:g} x its rounding "
                f"{self.rounding:.2e} against a float32 rerun"
            )
        return f"{_dtype_name(self.dtype)}: {tolerance_for(self.dtype):.0e} x {scale}"


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


# Samples beyond this many reuse the draws in turn: a model that mixes samples is caught as soon as
# two of them move differently, and drawing stays cheap for a batch of thousands.
DISTINCT_DRAWS = 8


def draw_permutations(length: int, seed: int, samples: int) -> Tensor:
    """One permutation per sample, ``(samples, length)``; a single one ``(length,)`` when ``samples`` is 0.

    Sample 0 takes ``draw_permutation(length, seed)``, the one a shared check with the same seed
    draws, which no position leak can hide from. The others are uniform draws from a generator
    seeded with ``seed + 1``, there so that each sample moves differently: a model that mixes the
    samples of a batch (attention across the batch axis, ``h - h.mean(0)``) no longer hides behind a
    permutation they all share. Past :data:`DISTINCT_DRAWS` samples the rows repeat in turn.
    """
    first = draw_permutation(length, seed)
    if samples == 0:
        return first
    generator = torch.Generator().manual_seed(seed + 1)
    draws = [first] + [torch.randperm(length, generator=generator) for _ in range(min(samples, DISTINCT_DRAWS) - 1)]
    return torch.stack([draws[b % len(draws)] for b in range(samples)])


def batch_axis(shape: tuple[int, ...], dims: tuple[int, ...], samples: int) -> int | None:
    """The axis that holds the ``samples`` of a batch: the first one besides ``dims`` of that size."""
    return next((axis for axis, size in enumerate(shape) if size == samples and axis not in dims), None)


def can_permute(tensor: Tensor, dims: tuple[int, ...], permutation: Tensor) -> bool:
    """Whether :func:`permute` can move ``tensor``: always for one permutation, and for one per sample
    when the tensor has a batch axis besides ``dims`` (or ``dims`` is empty)."""
    return permutation.ndim == 1 or not dims or batch_axis(tuple(tensor.shape), dims, permutation.shape[0]) is not None


def measure_reading(
    name: str, actual: Tensor, expected: Tensor, reading: tuple[int, ...], permutation: Tensor, dtype: torch.dtype
) -> TensorError:
    """``actual`` against ``expected`` moved by ``permutation`` along ``reading`` (:func:`measure_error`);
    a tensor that a permutation per sample cannot move (no batch axis besides its tokens) never passes."""
    if not can_permute(expected, reading, permutation):
        return _unpermutable(name, actual, reading, permutation, dtype)
    return measure_error(name, actual, permute(expected, reading, permutation), reading, dtype)


def _unpermutable(
    name: str, actual: Tensor, dims: tuple[int, ...], permutation: Tensor, dtype: torch.dtype
) -> TensorError:
    """The error of a tensor that carries tokens but no batch axis, checked with a permutation per
    sample: its tokens cannot follow (the model pooled or mixed the samples), so it never passes."""
    note = (
        f"no axis of the batch's {permutation.shape[0]} samples besides its tokens, so they cannot follow a "
        "permutation per sample: the model mixes the samples of a batch, or pass permutation= with one "
        "permutation of the tokens for all"
    )
    return TensorError(name, tuple(actual.shape), dtype, dims, float("inf"), 0.0, None, note)


def permute(tensor: Tensor, dims: tuple[int, ...], permutation: Tensor) -> Tensor:
    """``tensor`` with ``permutation`` applied along each axis in ``dims``: ``out[i] = tensor[permutation[i]]``.

    A ``(samples, length)`` permutation moves each sample's tokens by its own row, along the
    tensor's batch axis (:func:`batch_axis`); check :func:`can_permute` first.
    """
    index = permutation.to(tensor.device)
    if index.ndim == 1:
        for dim in dims:
            tensor = tensor.index_select(dim, index)
        return tensor
    if not dims:
        return tensor
    batch = batch_axis(tuple(tensor.shape), dims, index.shape[0])
    if batch is None:
        raise ValueError(f"a tensor of shape {tuple(tensor.shape)} has no axis of {index.shape[0]} samples")
    for dim in dims:
        shape = [1] * tensor.ndim
        shape[batch], shape[dim] = index.shape
        rows = index if batch < dim else index.t()  # the view below lays the two axes out in order
        tensor = tensor.gather(dim, rows.reshape(shape).expand(tensor.shape))
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
