"""The checked call's inputs: which axes of which inputs hold the tokens, and moving them.

``dim`` names, per input, the axes the permutation moves (or ``"indices"`` for an input of token
indices, which it relabels); the outputs' axes follow ``output_dim`` or, by default, the inputs'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._measure import batch_axis, format_indices, permute
from ._report import format_shape

__all__ = [
    "ENTRY_FORMS",
    "INDICES",
    "entry_form",
    "SAME_AS_DIM",
    "InputPlan",
    "checked_permutation",
    "input_plan",
    "moved_indices",
    "output_dims",
    "per_sample",
    "permute_inputs",
]


class _SameAsDim:
    def __repr__(self) -> str:
        return "<same as dim>"


# output_dim's default: the outputs' token axes follow the inputs'.
SAME_AS_DIM = _SameAsDim()


INDICES = "indices"  # a dim entry: the input holds token indices, relabelled by the permutation

ENTRY_FORMS = (
    "an axis, a tuple of axes (moved alike), 'indices' (an integer tensor of token indices, relabelled), "
    "('indices', axis) (token indices along the token axis, such as kNN (B, L, k): moved and relabelled) "
    "or None (left unchanged)"
)


def entry_form(entry) -> tuple[tuple[int, ...] | None, bool] | None:
    """A ``dim`` entry read as (the axes it moves or ``None``, whether it relabels); ``None`` when the
    entry is not one of :data:`ENTRY_FORMS`. The one reader of the forms, for the checkers and the
    model-level mode."""
    if entry is None:
        return None, False
    if isinstance(entry, str):
        return (None, True) if entry == INDICES else None
    relabel = isinstance(entry, tuple) and bool(entry) and entry[0] == INDICES
    axes = entry[1:] if relabel else entry if isinstance(entry, tuple) else (entry,)
    if not all(isinstance(axis, int) and not isinstance(axis, bool) for axis in axes) or not (axes or relabel):
        return None
    return (tuple(axes) or None), relabel


@dataclass(frozen=True)
class InputPlan:
    """What a permutation does to each input.

    dims: the axes each input is moved along (``()``: not moved). relabelled: the inputs that hold
    token indices (``edge_index``): each value ``i`` becomes the new position of token ``i``.
    length: the number of tokens. samples: the batch size where each sample gets a permutation of
    its own (:func:`per_sample`), else 0.
    """

    dims: tuple[tuple[int, ...], ...]
    relabelled: tuple[int, ...]
    length: int
    samples: int = 0


class TooFewTokens(ValueError):
    """The set has 0 or 1 tokens: nothing to permute. The checkers raise it; the modes skip the call."""


def input_plan(dim, inputs: tuple) -> InputPlan:
    """The input rules.

    An int ``dim`` moves every floating-point, complex or boolean tensor input along that axis. An
    integer tensor input is moved too when that axis has the number of tokens (token ids, a node's
    graph in a batch), and otherwise holds token indices (``edge_index``, a gather index) and is
    relabelled. A sequence gives each input its entry: an axis, a tuple of axes, ``"indices"`` to
    relabel, or ``None`` to pass it unchanged.
    """
    if not inputs:
        raise ValueError("no inputs given: pass the tensors to permute after fn, e.g. (fn, x, dim=1)")
    if dim is None:
        raise ValueError("dim=None permutes nothing: pass the token axis, as an int or one entry per input")
    if isinstance(dim, int) and not isinstance(dim, bool):
        return _plan_for_one_axis(dim, inputs)
    if not (isinstance(dim, Sequence) and not isinstance(dim, str)):
        raise ValueError(f"dim must be an int or a sequence with one entry per input, got {dim!r}")
    if len(dim) != len(inputs):
        raise ValueError(
            f"dim has {len(dim)} entries but {len(inputs)} inputs were given: pass one entry per "
            "input (None for an input that is not permuted), or a single int for all of them"
        )
    dims: list[tuple[int, ...]] = []
    relabelled: list[int] = []
    for index, (x, entry) in enumerate(zip(inputs, dim)):
        where = f"dim[{index}]"
        if entry is not None and not isinstance(x, Tensor):
            raise ValueError(
                f"{where}={entry!r} but input {index} is a {type(x).__name__}, not a tensor: pass None for it"
            )
        form = entry_form(entry)
        if form is None:
            raise ValueError(f"{where}={entry!r} is not understood: use {ENTRY_FORMS}")
        axes, relabel = form
        if relabel:
            if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
                raise ValueError(
                    f"{where}={entry!r} but input {index} is {x.dtype}: only integer tensors hold token indices"
                )
            relabelled.append(index)
        ndim = None if x is None else getattr(x, "ndim", None)
        dims.append(_axes_of(axes, ndim, f"{where} for input {index} {_shape_of(x)}"))
    return _planned(inputs, tuple(dims), tuple(relabelled))


def _plan_for_one_axis(dim: int, inputs: tuple) -> InputPlan:
    def integer(x) -> bool:
        return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)

    tensors = [(index, x) for index, x in enumerate(inputs) if isinstance(x, Tensor)]
    if not tensors:
        raise ValueError("no input is a tensor: dim=int permutes the tensor inputs, and there is none")
    # The number of tokens: from the first non-integer input, else from the first integer one.
    first_index, first = next(((index, x) for index, x in tensors if not integer(x)), tensors[0])
    first_axes = _axes_of(dim, first.ndim, f"dim for input {first_index} {_shape_of(first)}")
    length = first.shape[first_axes[0]]
    # A negative axis counts from the end of that input: the same axis of every other input, so that
    # dim=-2 on (B, L, E) tokens moves a (B, L) mask's tokens, not its batch.
    axis = first_axes[0]
    dims: list[tuple[int, ...]] = [() for _ in inputs]
    relabelled: list[int] = []
    for index, x in tensors:
        if integer(x) and axis >= x.ndim:
            continue  # no token axis at all (a class label per sample): not token indices, left as it is
        if integer(x) and (x.shape[axis] != length or _edge_index_of_two_nodes(x, axis, x is first)):
            relabelled.append(index)
        elif integer(x) and _holds_positions(x, axis):
            continue  # position ids belong to the slots, not the tokens: left as they are
        else:
            dims[index] = _axes_of(axis, x.ndim, f"dim for input {index} {_shape_of(x)}")
    return _planned(inputs, tuple(dims), tuple(relabelled))


def _planned(inputs: tuple, dims: tuple[tuple[int, ...], ...], relabelled: tuple[int, ...]) -> InputPlan:
    plan = InputPlan(dims, relabelled, _token_count(inputs, dims), per_sample(inputs, dims, relabelled))
    _check_indices(inputs, plan)
    return plan


def per_sample(inputs: tuple, dims: tuple[tuple[int, ...], ...], relabelled: tuple[int, ...]) -> int:
    """The batch size, where each sample of the batch can get a permutation of its own; else 0.

    The batch axis is read from the first floating-point input that moves (else the first input that
    moves): axis 0 when its tokens are elsewhere (``(B, L, E)``, ``(B, C, L)``), axis 1 when they are on
    axis 0 of a tensor of 3 or more axes (sequence-first ``(L, B, E)``); a ``(N, C)`` set has none. Every
    other input that moves needs an axis of that size besides its tokens (a ``(B, L)`` mask has one, an
    ``(L, L)`` mask shared by the batch has not), and nothing may be relabelled without moving
    (``edge_index`` numbers the nodes of the whole batch; kNN indices ``(B, L, k)`` move with their
    sample); else one permutation moves every sample alike.
    """
    moved = [(x, axes) for x, axes in zip(inputs, dims) if axes]
    if any(not dims[index] for index in relabelled) or not moved:  # edge_index numbers the whole batch
        return 0
    first, axes = next(((x, axes) for x, axes in moved if x.is_floating_point()), moved[0])
    axis = 0 if axes[0] != 0 else (1 if first.ndim >= 3 else None)
    if axis is None or axis in axes or first.shape[axis] < 2:
        return 0
    samples = first.shape[axis]
    if any(batch_axis(tuple(x.shape), axes, samples) is None for x, axes in moved):
        return 0
    return samples


def _edge_index_of_two_nodes(x: Tensor, axis: int, sets_length: bool) -> bool:
    """A ``(2, E)`` integer input of 0s and 1s beside the features of a graph of 2 nodes (``dim=0``):
    PyG's ``edge_index``, whose 2 rows are source and target, not the 2 nodes, so it is relabelled.
    (Two tokens' ids, sequence-first, hold other values and still move.)"""
    if axis != 0 or x.ndim != 2 or x.shape[0] != 2 or sets_length:
        return False
    return x.numel() == 0 or bool(((x == 0) | (x == 1)).all())


def moved_indices(inputs: tuple, plan: InputPlan) -> tuple[int, ...]:
    """Integer inputs moved but not relabelled whose values all lie in ``0..length-1``: token
    indices (kNN) that were meant to be relabelled too, if the check fails (token ids may look so)."""
    found = []
    for index, (x, dims) in enumerate(zip(inputs, plan.dims)):
        if not dims or index in plan.relabelled or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            continue
        if x.numel() and x.ndim > len(dims):
            low, high = _value_range(x)
            if 0 <= low and high < plan.length:
                found.append(index)
    return tuple(found)


def _holds_positions(x: Tensor, axis: int) -> bool:
    """Whether integer ``x`` counts ``0..L-1`` along ``axis`` (Hugging Face's ``position_ids``): the
    positions of the slots, which stay where they are when the tokens move, so that a model reading
    them shows its dependence on order."""
    length = x.shape[axis]
    if length < 2 or x.numel() == 0:
        return False
    shape = [1] * x.ndim
    shape[axis] = length
    return bool((x == torch.arange(length, device=x.device).view(shape)).all())


def _check_indices(inputs: tuple, plan: InputPlan) -> None:
    """Relabelled inputs must hold token indices: every value in ``0..length-1``."""
    for index in plan.relabelled:
        x = inputs[index]
        if x.numel() == 0:
            continue
        low, high = _value_range(x)
        if low < 0 or high >= plan.length:
            raise ValueError(
                f"input {index} {_shape_of(x)} {str(x.dtype).removeprefix('torch.')} is read as token indices "
                f"(an integer tensor without {plan.length} tokens along the permuted axis), so a permutation "
                f"relabels its values, but they run from {low} to {high}, outside 0..{plan.length - 1}: pass dim "
                "with one entry per input, None for an input to leave unchanged"
            )


def _value_range(x: Tensor) -> tuple[int, int]:
    """The least and the largest value of a non-empty integer tensor, in one host read."""
    low, high = torch.stack([x.min(), x.max()]).tolist()
    return int(low), int(high)


def _shape_of(x) -> str:
    return format_shape(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__


def _axes_of(entry, ndim: int | None, where: str) -> tuple[int, ...]:
    if entry is None:
        return ()
    axes = (entry,) if isinstance(entry, int) else tuple(entry)
    if ndim is None:
        raise ValueError(f"{where}: the input has no dimensions to permute; pass None for it")
    normalized: list[int] = []
    for axis in axes:
        if not isinstance(axis, int) or not -ndim <= axis < ndim:
            raise ValueError(f"{where}: axis {axis!r} is out of range for a tensor with {ndim} dimensions")
        if axis % ndim not in normalized:
            normalized.append(axis % ndim)
    return tuple(normalized)


def _token_count(inputs: tuple, input_dims: tuple[tuple[int, ...], ...]) -> int:
    lengths = [(index, axis, inputs[index].shape[axis]) for index, dims in enumerate(input_dims) for axis in dims]
    if not lengths:
        raise ValueError("no input is permuted: give at least one tensor input a token axis in dim")
    first = lengths[0]
    for other in lengths[1:]:
        if other[2] != first[2]:
            raise ValueError(
                f"permuted axes have different lengths: input {first[0]} dim {first[1]} has {first[2]} tokens, "
                f"input {other[0]} dim {other[1]} has {other[2]}; one permutation moves one set of tokens, so "
                "check sets of different sizes separately (None in dim for the fixed ones)"
            )
    if first[2] < 2:
        raise TooFewTokens(
            f"the permuted axes have {first[2]} token(s): a permutation needs at least 2 to move anything"
        )
    return first[2]


def checked_permutation(permutation, plan: InputPlan) -> Tensor:
    """A given permutation: ``(length,)`` for every sample alike, or ``(samples, length)``, a row per sample."""
    length = plan.length
    permutation = torch.as_tensor(permutation).to("cpu", torch.int64)
    if permutation.ndim == 2 and permutation.shape[0] != plan.samples:
        held = (
            f"{plan.samples} samples each with a permutation of its own" if plan.samples else "no batch axis to follow"
        )
        raise ValueError(
            f"permutation has {permutation.shape[0]} rows, one per sample, but the inputs have {held}: "
            f"pass one permutation of {length} tokens for all"
        )
    rows = permutation.reshape(-1, permutation.shape[-1]) if permutation.ndim else permutation.reshape(1, 1)
    if (
        permutation.ndim not in (1, 2)
        or rows.shape[-1] != length
        or not all(torch.equal(row.sort().values, torch.arange(length)) for row in rows)
    ):
        raise ValueError(
            f"permutation must contain each of 0..{length - 1} exactly once (the inputs have {length} tokens), "
            f"got {format_indices(permutation.reshape(-1))}"
        )
    return permutation


def output_dims(output_dim, dim, input_dims, leaves: list, length: int) -> list[tuple[int, ...]]:
    if output_dim is SAME_AS_DIM:
        output_dim = dim if isinstance(dim, int) else next(dims for dims in input_dims if dims)
        entries = [output_dim] * len(leaves)
    elif output_dim is None or isinstance(output_dim, int):
        entries = [output_dim] * len(leaves)
    elif isinstance(output_dim, Sequence) and len(output_dim) == len(leaves):
        entries = list(output_dim)
    else:
        names = [name for name, _ in leaves]
        raise ValueError(
            f"output_dim={output_dim!r} does not fit the {len(leaves)} returned element(s) {names}: pass an int "
            "or None for all of them, or a sequence with one entry per returned element"
        )
    result: list[tuple[int, ...]] = []
    for (name, leaf), entry in zip(leaves, entries):
        if not isinstance(leaf, Tensor):
            result.append(())
            continue
        axes = _axes_of(entry, leaf.dim(), f"output_dim for {name} {format_shape(tuple(leaf.shape))}")
        for axis in axes:
            if leaf.shape[axis] != length:
                raise ValueError(
                    f"{name} has shape {format_shape(tuple(leaf.shape))}: dim {axis} has {leaf.shape[axis]} entries but "
                    f"the inputs have {length} tokens. An output without a token axis (a classifier's logits, a pooled "
                    "vector) should not change under the permutation: check it with assert_permutation_invariant, or "
                    "checking_equivariance(..., invariant=True); else pass output_dim with the axes that carry the tokens"
                )
        result.append(axes)
    return result


def _relabelled(x: Tensor, dims: tuple[int, ...], permutation: Tensor) -> Tensor:
    """Token indices renamed: each value ``i`` becomes the new position of token ``i`` (each sample's
    own, along ``x``'s batch axis, for a permutation per sample)."""
    new_position = torch.empty_like(permutation)
    new_position.scatter_(-1, permutation, torch.arange(permutation.shape[-1]).expand_as(permutation))
    new_position = new_position.to(x.device, x.dtype)
    if permutation.ndim == 1:
        return new_position[x]
    batch = batch_axis(tuple(x.shape), dims, permutation.shape[0])
    assert batch is not None  # per_sample gave each sample its own permutation only where there is one
    rows = x.movedim(batch, 0)
    return new_position.gather(1, rows.reshape(rows.shape[0], -1)).reshape(rows.shape).movedim(0, batch)


def permute_inputs(inputs: tuple, plan: InputPlan, permutation: Tensor) -> tuple:
    # Permute a tensor passed twice once, so `query is key` holds in the permuted call as well.
    done: dict[tuple[int, tuple[int, ...]], Tensor] = {}
    permuted = []
    for index, (x, dims) in enumerate(zip(inputs, plan.dims)):
        if index in plan.relabelled:
            permuted.append(permute(_relabelled(x, dims, permutation), dims, permutation))
            continue
        if not dims:
            permuted.append(x)
            continue
        cache_key = (id(x), dims)
        if cache_key not in done:
            done[cache_key] = permute(x.detach(), dims, permutation)
        permuted.append(done[cache_key])
    return tuple(permuted)
