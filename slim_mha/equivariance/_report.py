"""What a permutation check found, and its text: the result records and :func:`format_permutation_error`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from ._context import type_name
from ._locate import Culprit, SubmoduleCheck, describe_trailing_code, find_culprit
from ._measure import TensorError, format_indices

__all__ = [
    "OutputCheck",
    "PermutationErrors",
    "blamed_module",
    "format_permutation_error",
    "format_shape",
    "subject_of",
]


# ------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class OutputCheck:
    """One tensor output of the checked function.

    Attributes:
        name: ``"output"`` for a single tensor, ``"output[1]"``, ``"output['logits']"`` inside containers.
        error: against the requested expectation (permuted along ``error.dims``, or unchanged).
        alternatives: against the other readings (unchanged; permuted along each axis whose length
            is the number of tokens, or all of them), to tell what the output does instead.
    """

    name: str
    error: TensorError
    alternatives: tuple[TensorError, ...]

    def observed(self, tolerance: float | None = None) -> str | None:
        """The first other reading the output matches (``"unchanged"``, ``"permuted along dim 0"``), if any."""
        for alternative in self.alternatives:
            if alternative.passed(tolerance):
                return _describe_dims(alternative.dims)
        return None


@dataclass(frozen=True)
class PermutationErrors:
    """What :func:`permutation_equivariance_error` measured.

    Attributes:
        subject: what was checked (a class name or a function's qualified name).
        outputs: one :class:`OutputCheck` per tensor output, in the order the function returned them.
        permutation: the permutation applied to the inputs (CPU int64): ``x'[i] = x[permutation[i]]``.
        seed: the seed it was drawn from, or ``None`` when it was given.
        input_dims: the permuted axes of each input (``()``: not permuted).
        submodules: every submodule call, in the order the calls finished; ``None`` unless asked for.
        submodule_note: why the submodule comparison stopped early, if it did.
        relabelled: the inputs read as token indices (``edge_index``), whose values the
            permutation relabels: ``i`` became the new position of token ``i``.
        moved_indices: integer inputs moved, not relabelled, whose values all lie in ``0..L-1``:
            kNN indices meant to be relabelled too, when the check fails.
        input_names: how the report names the inputs (default ``input 0``, ``input 1``...).
    """

    subject: str
    outputs: tuple[OutputCheck, ...]
    permutation: Tensor
    seed: int | None
    input_dims: tuple[tuple[int, ...], ...]
    submodules: tuple[SubmoduleCheck, ...] | None = None
    submodule_note: str = ""
    relabelled: tuple[int, ...] = ()
    moved_indices: tuple[int, ...] = ()
    input_names: tuple[str, ...] = ()

    def input_name(self, index: int) -> str:
        return self.input_names[index] if index < len(self.input_names) else f"input {index}"

    @property
    def invariant(self) -> bool:
        """Whether every output was expected unchanged (an invariance check)."""
        return all(not output.error.dims for output in self.outputs)

    @property
    def max_rel(self) -> float:
        """The largest relative error over the outputs."""
        return max((output.error.max_rel for output in self.outputs), default=0.0)

    def passed(self, tolerance: float | None = None) -> bool:
        return all(output.error.passed(tolerance) for output in self.outputs)

    def first_broken_submodule(self, tolerance: float | None = None) -> SubmoduleCheck | None:
        """The first submodule call, in finishing order, whose output matches no reading."""
        for call in self.submodules or ():
            if not call.passed(tolerance):
                return call
        return None

    def culprit(self, tolerance: float | None = None) -> Culprit | None:
        """Where the property first broke: a submodule, or the code between two calls (see :mod:`._locate`)."""
        return find_culprit(self.submodules or (), tolerance)


# --------------------------------------------------------------------------------- formatting


def format_permutation_error(result: PermutationErrors, tolerance: float | None = None) -> str:
    """The report: each output against its tolerance, the first broken submodule, the permutation."""
    kind = "invariant" if result.invariant else "equivariant"
    broken = [output for output in result.outputs if not output.error.passed(tolerance)]
    if broken:
        lines = [f"{result.subject} is not permutation-{kind}: {len(broken)} of {len(result.outputs)} outputs broke"]
    else:
        lines = [f"{result.subject} is permutation-{kind} within tolerance"]
    for output in result.outputs:
        error = output.error
        status = "ok" if error.passed(tolerance) else "BROKEN"
        lines.append(
            f"  {output.name} {format_shape(error.shape)} {str(error.dtype).removeprefix('torch.')}, "
            f"expected {_describe_dims(error.dims)}: {status}, {error.describe(tolerance)}"
        )
        if not error.passed(tolerance):
            observed = output.observed(tolerance)
            lines.append(
                f"    it is {observed} instead"
                if observed
                else f"    it is neither unchanged nor permuted along any axis of length {result.permutation.shape[-1]}"
            )
    if broken:
        lines.extend(_locate_lines(result, tolerance, broken))
        for index in result.moved_indices:
            axes = result.input_dims[index]
            entry = ", ".join(map(str, axes))
            lines.append(
                f"  {result.input_name(index)} moved on dim{'s' if len(axes) > 1 else ''} {_axes(axes)} holds "
                f"integers in 0..{result.permutation.shape[-1] - 1} only: if they are token indices (kNN), give it "
                f"the dim entry ('indices', {entry}) to relabel them as well"
            )
    inputs = ", ".join(
        f"{result.input_name(index)} on dim{'s' if len(dims) > 1 else ''} {_axes(dims)}"
        for index, dims in enumerate(result.input_dims)
        if dims
    )
    relabelled = ", ".join(result.input_name(index) for index in result.relabelled)
    lines.append(
        f"  {format_permutation(result.permutation, result.seed)}; permuted: {inputs}"
        + (f"; relabelled as token indices: {relabelled}" if relabelled else "")
    )
    return "\n".join(lines)


def format_permutation(permutation: Tensor, seed: int | None) -> str:
    """``permutation (seed 7, 10 tokens): [...]``, or, one per sample, the first rows and where they come from."""
    drawn = f"seed {seed}" if seed is not None else "given"
    if permutation.ndim == 1:
        return f"permutation ({drawn}, {len(permutation)} tokens): {format_indices(permutation)}"
    samples, length = permutation.shape
    rows = "; ".join(f"sample {b}: {format_indices(permutation[b], limit=12)}" for b in range(min(samples, 2)))
    source = f", as draw_permutations({length}, {seed}, {samples}) draws them" if seed is not None else ""
    more = f"; ... ({samples - 2} more samples)" if samples > 2 else ""
    return f"permutations, one per sample ({drawn}, {samples} samples of {length} tokens{source}): {rows}{more}"


def blamed_module(result: PermutationErrors, tolerance: float | None) -> str | None:
    """The culprit's module name; ``""`` when the checked module's own code after its submodules broke it."""
    culprit = result.culprit(tolerance)
    if culprit is not None:
        return culprit.module_name
    broken = [output for output in result.outputs if not output.error.passed(tolerance)]
    if result.submodules is None or all(output.observed(tolerance) for output in broken):
        return None
    return ""


def _locate_lines(result: PermutationErrors, tolerance: float | None, broken: list[OutputCheck]) -> list[str]:
    culprit = result.culprit(tolerance)
    lines = []
    if culprit is not None and culprit.kind == "submodule":
        lines += _submodule_culprit_lines(culprit, tolerance)
    elif culprit is not None:
        call = culprit.submodule
        closest = call.broken_input(tolerance)
        lines.append(f"  the break is in {culprit.code}{_at(culprit.location)}")
        if closest is None:  # a culprit is found by its broken input: at another tolerance there may be none
            lines.append(f"    '{call.display_name}' ({call.type_name}, call {call.call + 1}) receives a broken input")
        else:
            lines.append(
                f"    '{call.display_name}' ({call.type_name}, call {call.call + 1}) receives an input that is neither "
                f"unchanged nor permuted along its token axes, after {_calls(culprit.kept)} that kept it: its "
                f"{closest.name} {format_shape(closest.shape)}, closest reading '{_describe_dims(closest.dims)}': "
                f"{closest.describe(tolerance)}"
            )
    elif all(output.observed(tolerance) for output in broken):
        lines.append(
            "  each broken output matches another reading (above): the function is consistent, "
            "just not in the way output_dim asked"
        )
    elif result.submodules is None:
        lines.append("  (fn is not an nn.Module: pass module=... to find the submodule that breaks it)")
    else:
        code, location = describe_trailing_code(result.submodules)
        where = f": {code}{_at(location)}" if code else ""
        lines.append(
            f"  no submodule call breaks it ({len(result.submodules)} compared): the break is in "
            f"{result.subject}'s own forward code, between its submodules or after them{where}"
        )
    if result.submodule_note:
        lines.append(f"  ({result.submodule_note})")
    return lines


def _submodule_culprit_lines(culprit: Culprit, tolerance: float | None) -> list[str]:
    """The submodule whose own output breaks equivariance first, and what its inputs say of where."""
    call = culprit.submodule
    lines = []
    lines.append(
        f"  first submodule, in execution order, whose output is neither unchanged nor permuted along "
        f"its token axes: '{call.display_name}' ({call.type_name}, call {call.call + 1}), "
        f"after {_calls(culprit.kept)} that kept it"
    )
    closest = call.broken_output(tolerance)
    if call.note:
        lines.append(f"    {call.note}")
    elif closest is not None:
        lines.append(
            f"    its {closest.name} {format_shape(closest.shape)}, closest reading "
            f"'{_describe_dims(closest.dims)}': {closest.describe(tolerance)}"
        )
    unmoved = call.unmoved_inputs(tolerance)
    if unmoved:
        names = ", ".join(f"{error.name} {format_shape(error.shape)}" for error in unmoved)
        lines.append(
            f"    the break comes in with its input {names}, which has token axes but did not move with the "
            "tokens while its other inputs did (a causal mask, a padding or position input held fixed): it is "
            "not permutation-equivariant, or it must be permuted with the tokens"
        )
    elif _is_slims_own(call):
        lines.append(
            "    slim's attention is permutation-equivariant in what it is given (the per-call mode checks each "
            "call), so the break comes in with its inputs as the model hands them over: masks must move with "
            "the tokens, an (L, L) attn_mask on both axes (dim (0, 1), or (1, 2) for (B*H, L, L)), a padding "
            "mask along its tokens; check dim for the model's mask inputs"
        )
    elif culprit.after_submodules:
        lines.append(f"    its own submodule calls kept it: the break is in {culprit.code}{_at(culprit.location)}")
    elif culprit.code:
        lines.append(f"    it calls no submodule: the break is in its own code, {culprit.code}{_at(culprit.location)}")
    return lines


# slim_mha's own code: a break located there is what a user's input made of it, never slim's.
_OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_slims_own(call: SubmoduleCheck) -> bool:
    """Whether ``call``'s module runs slim_mha's own ``forward`` (its attention, its encoder layer)."""
    site = call.forward
    return site is not None and os.path.abspath(site.filename).startswith(_OWN_CODE + os.sep)


def _calls(count: int) -> str:
    return f"{count} submodule call{'s' if count != 1 else ''}"


def _at(location: str) -> str:
    return f" ({location})" if location else ""


def _describe_dims(dims: tuple[int, ...]) -> str:
    if not dims:
        return "unchanged"
    return f"permuted along dim{'s' if len(dims) > 1 else ''} {_axes(dims)}"


def _axes(dims: tuple[int, ...]) -> str:
    return str(dims[0]) if len(dims) == 1 else str(tuple(dims))


def format_shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def subject_of(fn: Callable) -> str:
    if isinstance(fn, nn.Module):
        return type_name(fn)
    return getattr(fn, "__qualname__", None) or type(fn).__name__
