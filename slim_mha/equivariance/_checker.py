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

import itertools
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from . import _context, _rerun
from ._inputs import (
    SAME_AS_DIM,
    InputPlan,
    _SameAsDim,
    checked_permutation,
    input_plan,
    moved_indices,
    output_dims,
    permute_inputs,
)
from ._locate import (
    Culprit,
    SubmoduleCheck,
    compare_calls,
    flatten,
    readings,
    recording,
)
from ._measure import (
    EquivarianceError,
    TensorError,
    draw_permutations,
    input_share,
    less_precise,
    magnitudes,
    measure_reading,
    rounding_of,
    tolerance_dtype,
)
from ._report import (
    OutputCheck,
    PermutationErrors,
    blamed_module,
    format_permutation_error,
    subject_of,
)

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

# ---------------------------------------------------------------------------------- measuring


def permutation_equivariance_error(
    fn: Callable,
    *inputs,
    dim: int | Sequence[DimSpec] = 1,
    output_dim: int | Sequence[DimSpec] | None | _SameAsDim = SAME_AS_DIM,
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

    Both calls run under ``torch.no_grad()``, without dropout, on copies of the inputs, from the
    state the inputs and the module are in (the global RNGs, module attributes, buffers), which both
    leave as they found it (:func:`isolated_runs`).

    Returns:
        :class:`PermutationErrors`: numbers only, no verdict (see :func:`assert_permutation_equivariant`).

    Raises:
        ValueError: for axes out of range, permuted axes of different lengths, or an output whose
            expected axis does not have the number of tokens.
    """
    call = CheckedCall(fn, inputs, dim, output_dim, dict(kwargs or {}), _module_of(fn) if module is None else module)
    return measure(call, seed=seed, permutation=permutation, submodules=submodules)


@dataclass(frozen=True)
class CheckedCall:
    """One call to check, as the public checkers and the model-level mode describe it.

    Attributes:
        fn: called as ``fn(*inputs, **kwargs)``.
        inputs: the inputs that ``dim`` describes.
        dim, output_dim: as :func:`permutation_equivariance_error` takes them.
        kwargs: passed unchanged to both calls.
        module: whose submodules are searched and whose dropout is switched off.
        subject: how reports name what was checked (default: ``fn``'s class or qualified name).
        input_names: how reports name the inputs (default: ``input 0``, ``input 1``...).
        wraps_module: whether ``fn`` may do work of its own around ``module`` (a lambda, a
            function): then ``module``'s own call is located like its submodules', so a break in
            its code is told apart from one in ``fn``'s.
    """

    fn: Callable
    inputs: tuple
    dim: object
    output_dim: object
    kwargs: dict
    module: nn.Module | None
    subject: str = ""
    input_names: tuple[str, ...] = ()
    wraps_module: bool | None = None


def measure(call: CheckedCall, *, seed: int | None, permutation: Tensor | None, submodules: bool) -> PermutationErrors:
    """Run ``call`` on its inputs and on permuted inputs, and measure every output's error."""
    plan = input_plan(call.dim, call.inputs)
    if permutation is None:
        if seed is None:  # the callers give one or the other
            raise ValueError("measure needs a seed to draw a permutation from, or the permutation")
        permutation = draw_permutations(plan.length, seed, plan.samples)
    else:
        permutation, seed = checked_permutation(permutation, plan), None
    module, fn, kwargs = call.module, call.fn, call.kwargs
    # Each run gets copies: a model that edits its input in place (x.masked_fill_) edits neither the
    # caller's tensors (whose graph would then fail backward) nor the other run's.
    permuted = permute_inputs(_copies(call.inputs), plan, permutation)
    inputs = _copies(call.inputs)
    wraps_module = (fn is not module) if call.wraps_module is None else call.wraps_module
    record = module if submodules else None

    with isolated_runs(module, call.inputs) as rewind, _context.naming(module):
        with recording(record, include_root=wraps_module) as original_calls:
            reference = fn(*inputs, **kwargs)
        rewind()
        with recording(record, include_root=wraps_module) as permuted_calls:
            result = fn(*permuted, **kwargs)
        reference_leaves, result_leaves = flatten(reference, "output"), flatten(result, "output")
        rerun, rerun_calls = None, None
        if _rerun.wanted(reference_leaves):  # low precision: measure what this call rounds
            rewind()
            with recording(record, include_root=wraps_module) as rerun_calls:
                rerun = _rerun.float32_rerun(fn, _copies(call.inputs), kwargs, module)

    if [name for name, _ in reference_leaves] != [name for name, _ in result_leaves]:
        raise ValueError(
            f"fn returned different structures for the original and the permuted inputs "
            f"({[n for n, _ in reference_leaves]} vs {[n for n, _ in result_leaves]}); "
            "the checker compares outputs element by element, so fn must return the same structure"
        )
    if not any(isinstance(leaf, Tensor) for _, leaf in reference_leaves):
        found = ", ".join(f"{name}: {type(leaf).__name__}" for name, leaf in reference_leaves[:4]) or "nothing"
        raise ValueError(
            f"fn's output holds no tensor to compare ({found}); return the tensors that should follow the "
            "permutation, in tuples, lists, dicts, dataclasses or plain objects"
        )
    expected_dims = output_dims(call.output_dim, call.dim, plan.dims, reference_leaves, plan.length)
    scale = _input_scale(call.inputs, plan)
    reruns = _matching(reference_leaves, None if rerun is None else flatten(rerun, "output"))
    outputs = tuple(
        _check_output(name, actual, expected, dims, plan.length, permutation, scale, again)
        if isinstance(expected, Tensor) and isinstance(actual, Tensor)
        else _check_other_output(name, actual, expected)
        for (name, expected), (_, actual), dims, again in zip(reference_leaves, result_leaves, expected_dims, reruns)
    )
    submodule_checks, note = (None, "")
    if submodules and module is not None:
        submodule_checks, note = compare_calls(original_calls, permuted_calls, plan.length, permutation, rerun_calls)
    return PermutationErrors(
        subject=call.subject or subject_of(fn),
        outputs=outputs,
        permutation=permutation,
        seed=seed,
        input_dims=plan.dims,
        submodules=submodule_checks,
        submodule_note=note,
        relabelled=plan.relabelled,
        moved_indices=moved_indices(call.inputs, plan),
        input_names=call.input_names,
    )


def _copies(inputs: tuple) -> tuple:
    """Detached copies of the tensors among ``inputs``, one per distinct tensor (``query is key`` holds
    of the copies as of the inputs: it selects attention's fused projection)."""
    copies: dict[int, Tensor] = {}
    with torch.no_grad():
        for x in inputs:
            if isinstance(x, Tensor) and id(x) not in copies:
                copies[id(x)] = x.detach().clone()
    return tuple(copies[id(x)] if isinstance(x, Tensor) else x for x in inputs)


def _matching(leaves: list, rerun_leaves: list | None) -> list:
    """Each leaf's float32 rerun, or ``None`` (no rerun, or one of another structure)."""
    if rerun_leaves is None or [name for name, _ in rerun_leaves] != [name for name, _ in leaves]:
        return [None] * len(leaves)
    return [leaf for _, leaf in rerun_leaves]


def _check_output(
    name: str,
    actual: Tensor,
    expected: Tensor,
    dims: tuple[int, ...],
    length: int,
    permutation: Tensor,
    input_scale: float = 0.0,
    rerun: Tensor | None = None,
) -> OutputCheck:
    """One tensor output against each reading. The tolerance is relative to the larger of the output's
    magnitude and a share of the permuted inputs' (:func:`input_share`): a layer that subtracts large
    inputs (a point cloud far from the origin) keeps a few of their roundings. In low precision with
    a float32 ``rerun``, it is what the call rounded (:meth:`TensorError.tolerance`)."""

    dtype = less_precise(actual.dtype, tolerance_dtype(expected))  # under autocast: the dtype it computed in
    inputs = input_scale * input_share(dtype)
    rounding = None if rerun is None else rounding_of(dtype, expected, rerun)

    def error_for(reading: tuple[int, ...]):
        error = measure_reading(name, actual, expected, reading, permutation, dtype)
        if rounding is not None:  # the rerun measured the rounding the inputs' scale stands in for
            return replace(error, rounding=rounding)
        return replace(error, scale=inputs, scale_of="inputs") if error.scale < inputs else error

    alternatives = tuple(error_for(reading) for reading in readings(expected, length) if reading != dims)
    return OutputCheck(name, error_for(dims), alternatives)


def _check_other_output(name: str, actual, expected) -> OutputCheck:
    """A leaf that is not a tensor (a string, ``None``, a number, a tensor on one side only): the
    same in both runs, or broken."""
    try:
        same = type(actual) is type(expected) and bool(actual == expected)
    except Exception:  # a comparison that is not a yes or no: compare what can be printed
        same = repr(actual) == repr(expected)
    note = "" if same else f"{expected!r:.60} in the original run, {actual!r:.60} in the permuted one"
    error = TensorError(name, (), torch.float64, (), 0.0 if same else float("inf"), 0.0, None, note)
    return OutputCheck(name, error, ())


def _input_scale(inputs: tuple, plan: InputPlan) -> float:
    """The largest finite magnitude among the floating-point inputs that the permutation moves."""
    scale = 0.0
    for x, dims in zip(inputs, plan.dims):
        if dims and isinstance(x, Tensor) and x.is_floating_point() and x.numel():
            scale = max(scale, float(magnitudes(x).max()))  # an additive mask's fills never widen it
    return scale


# ---------------------------------------------------------------------------------- asserting


def assert_permutation_equivariant(
    fn: Callable,
    *inputs,
    dim: int | Sequence[DimSpec] = 1,
    output_dim: int | Sequence[DimSpec] | None | _SameAsDim = SAME_AS_DIM,
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
    call = CheckedCall(fn, inputs, dim, output_dim, dict(kwargs or {}), _module_of(fn) if module is None else module)
    result = measure(call, seed=seed, permutation=permutation, submodules=False)
    error = error_for(call, result, tolerance)
    if error is not None:
        raise error
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
    call = CheckedCall(fn, inputs, dim, None, dict(kwargs or {}), _module_of(fn) if module is None else module)
    result = measure(call, seed=seed, permutation=permutation, submodules=False)
    error = error_for(call, result, tolerance)
    if error is not None:
        raise error
    return result


def _check_tolerance(tolerance: float | None) -> None:
    if tolerance is not None and not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise ValueError(
            f"tolerance must be a number >= 0, relative to each output's largest magnitude "
            f"(or None for the dtype table), got {tolerance!r}"
        )


def error_for(call: CheckedCall, result: PermutationErrors, tolerance: float | None) -> EquivarianceError | None:
    """``None`` when ``result`` passed; else the error, located (both runs repeated with hooks,
    on the same permutation) when there is a module to search."""
    if result.passed(tolerance):
        return None
    if call.module is not None:
        located = measure(call, seed=None, permutation=result.permutation, submodules=True)
        result = replace(located, seed=result.seed)
    broken = tuple(output.error for output in result.outputs if not output.error.passed(tolerance))
    return EquivarianceError(
        format_permutation_error(result, tolerance),
        errors=broken,
        module_name=blamed_module(result, tolerance),
        seed=result.seed,
        permutations={"inputs": result.permutation},
        result=result,
    )


# ------------------------------------------------------------------------------ the arguments


def _module_of(fn: Callable) -> nn.Module | None:
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


# ------------------------------------------------------------------------------ run conditions


@contextmanager
def isolated_runs(module: nn.Module | None, inputs: tuple) -> Iterator[Callable[[], None]]:
    """No grad, no dropout, and each run from the state the call left; that state untouched after.

    ``rewind()`` (before each run, and on the way out) puts back the global RNGs (torch's, Python's
    ``random``, NumPy's) and every module attribute a run set (an MoE's ``aux_loss``, a step counter),
    and gives the runs fresh copies of the buffers: they update the copies (batch-norm statistics, an
    EMA, spectral norm's ``_u``), never the buffers themselves, whose values and version counters a
    graph the caller recorded may need for backward. Nothing process-wide is switched: dropout is
    turned off by a function mode of this thread alone (:class:`_CheckRuns`), so another thread
    sharing the model keeps its dropout.
    """
    tensors = [x for x in inputs if isinstance(x, Tensor)]
    modules = list(module.modules()) if module is not None else []
    if module is not None:
        tensors += list(itertools.chain(module.parameters(), module.buffers()))
    devices = sorted({x.device.index or 0 for x in tensors if x.device.type == "cuda"})
    random_states = _RandomStates(devices)
    attributes = [(owner, dict(owner.__dict__)) for owner in modules]
    attention = [m for m in modules if isinstance(m, nn.MultiheadAttention)]
    hints = [m.register_forward_pre_hook(_mask_over_causal_hint, with_kwargs=True) for m in attention]
    token = _IN_RUNS.set(True)
    try:
        with buffer_copies(module) as fresh_buffers:

            def rewind() -> None:
                random_states.restore()
                for owner, saved in attributes:
                    _restore_attributes(owner, saved)
                fresh_buffers()

            try:
                with torch.no_grad(), _CheckRuns():
                    yield rewind
            finally:
                rewind()
    finally:
        _IN_RUNS.reset(token)
        for handle in hints:
            handle.remove()


@contextmanager
def buffer_copies(module: nn.Module | None) -> Iterator[Callable[[], None]]:
    """Fresh copies of ``module``'s buffers in their places while the block runs (``fresh()`` makes
    new ones), the buffers themselves back after: runs that update a buffer (batch-norm statistics,
    an EMA, spectral norm's ``_u``) leave the real one, its values and its version counter, alone."""
    modules = list(module.modules()) if module is not None else []
    buffers = [
        (owner, name, buffer) for owner in modules for name, buffer in owner._buffers.items() if buffer is not None
    ]

    def fresh() -> None:
        with torch.no_grad():
            for owner, name, buffer in buffers:
                owner._buffers[name] = buffer.detach().clone()

    try:
        fresh()
        yield fresh
    finally:
        for owner, name, buffer in buffers:
            owner._buffers[name] = buffer


_IN_RUNS: ContextVar[bool] = ContextVar("slim_mha_equivariance_in_runs", default=False)
_ATTN_MASK, _IS_CAUSAL = 5, 7  # positions in MultiheadAttention.forward's signature


def _mask_over_causal_hint(module: nn.Module, args: tuple, kwargs: dict):
    """In the check's runs, an attention call's ``is_causal`` hint beside an explicit ``attn_mask`` is
    dropped: the hint says the mask is the causal one, which the mask permuted with the tokens no
    longer is, and attention would then ignore the mask. The mask is the truth: ``f(P x, P M Pᵀ) =
    P f(x, M)`` (``nn.Transformer(..., tgt_is_causal=True)`` is checked so). Other threads' calls,
    and calls outside the runs, pass as they are."""
    if not _IN_RUNS.get():
        return None
    mask = kwargs.get("attn_mask", args[_ATTN_MASK] if len(args) > _ATTN_MASK else None)
    if mask is None:
        return None
    if kwargs.get("is_causal"):
        return args, {**kwargs, "is_causal": False}
    if len(args) > _IS_CAUSAL and args[_IS_CAUSAL]:
        return (*args[:_IS_CAUSAL], False, *args[_IS_CAUSAL + 1 :]), kwargs
    return None


class _RandomStates:
    """The global random generators a model's ``forward`` may draw from, as they are now."""

    def __init__(self, cuda_devices: list[int]) -> None:
        self.cuda_devices = cuda_devices
        self.torch = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(device) for device in cuda_devices]
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")  # only where the program uses it: never imported here
        self.numpy = (numpy, numpy.random.get_state()) if numpy is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        for device, state in zip(self.cuda_devices, self.cuda):
            torch.cuda.set_rng_state(state, device)
        random.setstate(self.python)
        if self.numpy is not None:
            numpy, state = self.numpy
            numpy.random.set_state(state)


_MISSING = object()


def _restore_attributes(owner: nn.Module, saved: dict) -> None:
    """Put ``owner``'s instance attributes back as ``saved`` holds them: added ones go, rebound ones return."""
    current = owner.__dict__
    for name in [name for name in current if name not in saved]:
        del current[name]
    for name, value in saved.items():
        if current.get(name, _MISSING) is not value:
            current[name] = value


class _CheckRuns(TorchFunctionMode):
    """Dropout called as a function (``F.dropout``, a dropout module's forward, the ``dropout_p`` of
    ``F.scaled_dot_product_attention``) keeps nothing random in the check's own runs: a random mask
    does not follow the tokens, and would fail the check on a model that has no fault. A function
    mode holds for the thread that entered it alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUT_FUNCTIONS:
            return args[0] if args else kwargs["input"]
        if func in _DROPOUT_PROBABILITY:
            position = _DROPOUT_PROBABILITY[func]
            if len(args) > position:
                args = args[:position] + (0.0,) + args[position + 1 :]
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


_DROPOUT_FUNCTIONS = frozenset(
    {
        F.dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.alpha_dropout,
        F.feature_alpha_dropout,
        torch.dropout,
        torch.alpha_dropout,
        torch.feature_dropout,
        torch.feature_alpha_dropout,
    }
)
# Functions that take a dropout probability, and its position among their arguments.
_DROPOUT_PROBABILITY = {F.scaled_dot_product_attention: 4, F.multi_head_attention_forward: 10}
