"""Permutation checks for any function or model, and the search for the submodule that breaks them.

Three functions, as in e3nn's ``assert_equivariant``: :func:`permutation_equivariance_error`
measures, :func:`assert_permutation_equivariant` / :func:`assert_permutation_invariant` compare
against the dtype tolerance table, and :func:`format_permutation_error` writes the report.

**Locating the break.** When the checked function is an ``nn.Module`` (or ``module=`` names one)
and the check fails, both runs are repeated with hooks on every submodule, and each submodule call's
inputs and outputs are compared between the original and the permuted run, in the order they
happened (:mod:`._locate` has the rules). The report names the first place where moving tokens does
something other than moving (or leaving alone) what comes out: a submodule whose inputs kept the
property and whose output does not, or the code between two calls, when a call's input is already
broken (``h = self.embed(x) + self.pos`` inline in ``forward``), with its function, file and lines.
If nothing breaks before the checked function's own output, the break is in its own code after its
last submodule call (or the expectation is wrong, e.g. attention is equivariant where invariance was
asked: the report says which reading its output does match).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor, nn

from . import _mode
from ._locate import Culprit, SubmoduleCheck, compare_calls, flatten, readings, recording
from ._measure import EquivarianceError, draw_permutation, format_indices, measure_error, permute
from ._report import OutputCheck, PermutationErrors, blamed_module, format_permutation_error, format_shape, subject_of

__all__ = [
    "Culprit",
    "OutputCheck",
    "SubmoduleCheck",
    "PermutationErrors",
    "permutation_equivariance_error",
    "assert_permutation_equivariant",
    "assert_permutation_invariant",
    "format_permutation_error",
]

DimSpec = int | Sequence[int] | None

# Modules whose randomness the check switches off: dropout layers, and attention, whose dropout
# is internal and follows its own ``training`` flag.
_DROPOUT_TYPES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.MultiheadAttention,
)


class _SameAsDim:
    def __repr__(self) -> str:
        return "<same as dim>"


SAME_AS_DIM = _SameAsDim()


# ---------------------------------------------------------------------------------- measuring


def permutation_equivariance_error(
    fn: Callable,
    *inputs,
    dim: int | Sequence[DimSpec] = 1,
    output_dim: int | Sequence[DimSpec] | None = SAME_AS_DIM,
    seed: int = 0,
    permutation: Tensor | None = None,
    kwargs: dict | None = None,
    module: nn.Module | None = None,
    submodules: bool = False,
) -> PermutationErrors:
    """Run ``fn`` on ``inputs`` and on permuted ``inputs``, and measure every output's error.

    Args:
        fn: the function or ``nn.Module`` to check, called as ``fn(*inputs, **kwargs)``.
        inputs: its positional inputs; the tensors among them are permuted as ``dim`` says.
        dim: the token axis of each input. An int applies to every tensor input; a sequence gives
            one entry per input: an int, a tuple of ints (all permuted alike, e.g. ``(0, 1)`` for an
            ``(L, L)`` mask), or ``None`` for an input that is not permuted. Every permuted axis must
            have the same length: one permutation moves one set of tokens.
        output_dim: the axes each output is expected permuted along, same forms as ``dim`` with one
            entry per returned element; ``None`` means "expected unchanged" (invariance). Default:
            ``dim`` when it is an int, else the first permuted input's axes, for every output.
        seed: seeds the private generator the permutation is drawn from (the global RNG is untouched).
        permutation: use this permutation instead of drawing one.
        kwargs: keyword arguments passed unchanged to both calls.
        module: the module whose submodules are searched and whose dropout is switched off;
            default ``fn`` when it is an ``nn.Module`` (or a bound method of one).
        submodules: also compare every submodule call (slower; the assertions do it on failure).

    Both calls run under ``torch.no_grad()`` from the same global RNG state, which is restored after.
    Dropout layers and attention modules are put in eval mode for the calls; every training flag
    and buffer (e.g. batch-norm running statistics) is restored after.

    Returns:
        :class:`PermutationErrors`: numbers only, no verdict (see :func:`assert_permutation_equivariant`).

    Raises:
        ValueError: for axes out of range, permuted axes of different lengths, or an output whose
            expected axis does not have the number of tokens.
    """
    kwargs = dict(kwargs or {})
    input_dims = _input_dims(dim, inputs)
    length = _token_count(inputs, input_dims)
    if permutation is None:
        permutation = draw_permutation(length, seed)
    else:
        permutation, seed = _checked_permutation(permutation, length), None
    module = _module_of(fn) if module is None else module
    permuted = _permute_inputs(inputs, input_dims, permutation)

    with _check_conditions(module, inputs) as rewind, _mode.naming(module):
        with recording(module if submodules else None) as original_calls:
            reference = fn(*inputs, **kwargs)
        rewind()
        with recording(module if submodules else None) as permuted_calls:
            result = fn(*permuted, **kwargs)

    reference_leaves, result_leaves = flatten(reference, "output"), flatten(result, "output")
    if [name for name, _ in reference_leaves] != [name for name, _ in result_leaves]:
        raise ValueError(
            f"fn returned different structures for the original and the permuted inputs "
            f"({[n for n, _ in reference_leaves]} vs {[n for n, _ in result_leaves]}); "
            "the checker compares outputs element by element, so fn must return the same structure"
        )
    expected_dims = _output_dims(output_dim, dim, input_dims, reference_leaves, length)
    outputs = tuple(
        _check_output(name, actual, expected, dims, length, permutation)
        for (name, expected), (_, actual), dims in zip(reference_leaves, result_leaves, expected_dims)
        if isinstance(expected, Tensor) and isinstance(actual, Tensor)
    )
    submodule_checks, note = (None, "")
    if submodules and module is not None:
        submodule_checks, note = compare_calls(original_calls, permuted_calls, length, permutation)
    return PermutationErrors(
        subject=subject_of(fn),
        outputs=outputs,
        permutation=permutation,
        seed=seed,
        input_dims=input_dims,
        submodules=submodule_checks,
        submodule_note=note,
    )


def _check_output(
    name: str, actual: Tensor, expected: Tensor, dims: tuple[int, ...], length: int, permutation: Tensor
) -> OutputCheck:
    error = measure_error(name, actual, permute(expected, dims, permutation), dims)
    alternatives = tuple(
        measure_error(name, actual, permute(expected, reading, permutation), reading)
        for reading in readings(expected, length)
        if reading != dims
    )
    return OutputCheck(name, error, alternatives)


# ---------------------------------------------------------------------------------- asserting


def assert_permutation_equivariant(
    fn: Callable,
    *inputs,
    dim: int | Sequence[DimSpec] = 1,
    output_dim: int | Sequence[DimSpec] | None = SAME_AS_DIM,
    tolerance: float | None = None,
    seed: int = 0,
    permutation: Tensor | None = None,
    kwargs: dict | None = None,
    module: nn.Module | None = None,
) -> PermutationErrors:
    """Assert ``fn(P inputs) == P fn(inputs)`` within tolerance: permuting tokens permutes the outputs.

    Arguments as :func:`permutation_equivariance_error`; ``tolerance`` is relative to each output's
    largest magnitude (default: the dtype table, :data:`slim_mha.equivariance.TOLERANCE`).

    Example::

        attention = nn.MultiheadAttention(16, 4, batch_first=True)
        x = torch.randn(2, 7, 16)
        slim_mha.assert_permutation_equivariant(lambda x: attention(x, x, x)[0], x, dim=1, module=attention)

    Returns:
        the measured :class:`PermutationErrors`, when it passes.

    Raises:
        EquivarianceError: naming each broken output with its largest error, the permutation and
            seed, and for a module the first submodule whose output stops being equivariant.
    """
    __tracebackhide__ = True
    _check_tolerance(tolerance)
    options = dict(dim=dim, output_dim=output_dim, kwargs=kwargs, module=module)
    result = permutation_equivariance_error(fn, *inputs, seed=seed, permutation=permutation, **options)
    _raise_if_broken(fn, inputs, result, tolerance, options)
    return result


def assert_permutation_invariant(
    fn: Callable,
    *inputs,
    dim: int | Sequence[DimSpec] = 1,
    tolerance: float | None = None,
    seed: int = 0,
    permutation: Tensor | None = None,
    kwargs: dict | None = None,
    module: nn.Module | None = None,
) -> PermutationErrors:
    """Assert ``fn(P inputs) == fn(inputs)`` within tolerance: permuting tokens changes no output.

    :func:`assert_permutation_equivariant` with ``output_dim=None``; same arguments otherwise.
    Pooling over a set and attention *from* fixed queries *over* the permuted tokens are invariant;
    self-attention is not (it is equivariant), and the error says so.
    """
    __tracebackhide__ = True
    _check_tolerance(tolerance)
    options = dict(dim=dim, output_dim=None, kwargs=kwargs, module=module)
    result = permutation_equivariance_error(fn, *inputs, seed=seed, permutation=permutation, **options)
    _raise_if_broken(fn, inputs, result, tolerance, options)
    return result


def _check_tolerance(tolerance: float | None) -> None:
    if tolerance is not None and not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise ValueError(
            f"tolerance must be a number >= 0, relative to each output's largest magnitude "
            f"(or None for the dtype table), got {tolerance!r}"
        )


def _raise_if_broken(fn: Callable, inputs: tuple, result: PermutationErrors, tolerance: float | None, options: dict):
    __tracebackhide__ = True
    if result.passed(tolerance):
        return
    module = _module_of(fn) if options["module"] is None else options["module"]
    if module is not None:  # Run again with the hooks, on the same permutation, to find the culprit.
        located = permutation_equivariance_error(
            fn, *inputs, permutation=result.permutation, submodules=True, **options
        )
        result = replace(located, seed=result.seed)
    broken = tuple(output.error for output in result.outputs if not output.error.passed(tolerance))
    raise EquivarianceError(
        format_permutation_error(result, tolerance),
        errors=broken,
        module_name=blamed_module(result, tolerance),
        seed=result.seed,
        permutations={"inputs": result.permutation},
        result=result,
    )


# ------------------------------------------------------------------------------ the arguments


def _input_dims(dim, inputs: tuple) -> tuple[tuple[int, ...], ...]:
    if not inputs:
        raise ValueError("no inputs given: pass the tensors to permute after fn, e.g. (fn, x, dim=1)")
    if dim is None:
        raise ValueError("dim=None permutes nothing: pass the token axis, as an int or one entry per input")
    if isinstance(dim, int):
        entries = [dim if isinstance(x, Tensor) else None for x in inputs]
    elif isinstance(dim, Sequence) and not isinstance(dim, str):
        if len(dim) != len(inputs):
            raise ValueError(
                f"dim has {len(dim)} entries but {len(inputs)} inputs were given: pass one entry per "
                "input (None for an input that is not permuted), or a single int for all of them"
            )
        entries = list(dim)
    else:
        raise ValueError(f"dim must be an int or a sequence with one entry per input, got {dim!r}")
    result = []
    for index, (x, entry) in enumerate(zip(inputs, entries)):
        where = f"dim[{index}]" if not isinstance(dim, int) else "dim"
        if entry is not None and not isinstance(x, Tensor):
            raise ValueError(
                f"{where}={entry!r} but input {index} is a {type(x).__name__}, not a tensor: pass None for it"
            )
        if entry is None:
            result.append(())
        else:
            result.append(_axes_of(entry, x.dim(), f"{where} for input {index} {format_shape(tuple(x.shape))}"))
    return tuple(result)


def _axes_of(entry, ndim: int | None, where: str) -> tuple[int, ...]:
    if entry is None:
        return ()
    axes = (entry,) if isinstance(entry, int) else tuple(entry)
    normalized = []
    for axis in axes:
        if not isinstance(axis, int) or not -ndim <= axis < ndim:
            raise ValueError(f"{where}: axis {axis!r} is out of range for a tensor with {ndim} dimensions")
        if axis % ndim not in normalized:
            normalized.append(axis % ndim)
    return tuple(normalized)


def _token_count(inputs: tuple, input_dims: tuple[tuple[int, ...], ...]) -> int:
    lengths = [
        (index, axis, inputs[index].shape[axis]) for index, dims in enumerate(input_dims) for axis in dims
    ]
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
        raise ValueError(f"the permuted axes have {first[2]} token(s): a permutation needs at least 2 to move anything")
    return first[2]


def _checked_permutation(permutation, length: int) -> Tensor:
    permutation = torch.as_tensor(permutation).to("cpu", torch.int64)
    if permutation.shape != (length,) or not torch.equal(permutation.sort().values, torch.arange(length)):
        raise ValueError(
            f"permutation must contain each of 0..{length - 1} exactly once (the inputs have {length} tokens), "
            f"got {format_indices(permutation.reshape(-1))}"
        )
    return permutation


def _output_dims(output_dim, dim, input_dims, leaves: list, length: int) -> list[tuple[int, ...]]:
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
    result = []
    for (name, leaf), entry in zip(leaves, entries):
        if not isinstance(leaf, Tensor):
            result.append(())
            continue
        axes = _axes_of(entry, leaf.dim(), f"output_dim for {name} {format_shape(tuple(leaf.shape))}")
        for axis in axes:
            if leaf.shape[axis] != length:
                raise ValueError(
                    f"{name} has shape {format_shape(tuple(leaf.shape))}: dim {axis} has {leaf.shape[axis]} entries but "
                    f"the inputs have {length} tokens; pass output_dim with the axes that carry the tokens, "
                    "or None for an output that should not change"
                )
        result.append(axes)
    return result


def _permute_inputs(inputs: tuple, input_dims, permutation: Tensor) -> tuple:
    # Permute a tensor passed twice once, so `query is key` holds in the permuted call as well.
    done: dict[tuple[int, tuple[int, ...]], Tensor] = {}
    permuted = []
    for x, dims in zip(inputs, input_dims):
        if not dims:
            permuted.append(x)
            continue
        cache_key = (id(x), dims)
        if cache_key not in done:
            done[cache_key] = permute(x.detach(), dims, permutation)
        permuted.append(done[cache_key])
    return tuple(permuted)


def _module_of(fn: Callable) -> nn.Module | None:
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


# ------------------------------------------------------------------------------ run conditions


@contextmanager
def _check_conditions(module: nn.Module | None, inputs: tuple) -> Iterator[Callable[[], None]]:
    """No grad, dropout off, the same RNG state for both runs; flags, buffers and RNG restored after."""
    devices = sorted({x.device.index or 0 for x in inputs if isinstance(x, Tensor) and x.device.type == "cuda"})
    cpu_state = torch.get_rng_state()
    cuda_states = [torch.cuda.get_rng_state(device) for device in devices]

    def rewind() -> None:
        torch.set_rng_state(cpu_state)
        for device, state in zip(devices, cuda_states):
            torch.cuda.set_rng_state(state, device)

    switched, saved = [], []
    if module is not None:
        for submodule in module.modules():
            if submodule.training and isinstance(submodule, _DROPOUT_TYPES):
                submodule.training = False  # this module only: its children keep their flags
                switched.append(submodule)
        saved = [
            (owner, name, buffer, buffer.detach().clone())
            for owner in module.modules()
            for name, buffer in owner._buffers.items()
            if buffer is not None
        ]
    try:
        with torch.no_grad():
            yield rewind
    finally:
        for submodule in switched:
            submodule.training = True
        with torch.no_grad():
            for owner, name, buffer, copy in saved:
                owner._buffers[name] = buffer
                buffer.copy_(copy)
        rewind()
