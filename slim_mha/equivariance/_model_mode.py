"""The model-level mode: ``checking_equivariance(model, dim=...)`` checks the model's own calls.

The per-call mode checks each slim attention call given the inputs it receives, so a break outside
attention (a position table added in ``forward``, a projection along the sequence, an attention
subclass that adds positions to q and k before calling its parent) passes it. Given the model's set
axis, this mode checks what the user called: after the first call of the model inside the block,
and every ``every``-th one after it, the model runs again on the call's inputs and on those inputs
permuted along ``dim``, through the same checker as :func:`assert_permutation_equivariant` (its
input rules, its tolerance table, its search for the culprit), and a break raises
:class:`EquivarianceError` from the call.

Nothing the caller holds changes. The call's own output and graph are returned as they are; the
comparison runs both runs under ``no_grad``, without dropout (since a random mask does not follow
the tokens), on copies of the inputs and of the buffers, from the random state and module attributes
the call left, which are put back after (:func:`._checker.isolated_runs`). No module flag is switched.
``every`` counts the model's calls across scopes (:data:`CALLS`); a set of 0 or 1 tokens is skipped.
Both runs are marked as the check's own (:func:`._context.rerunning`): neither mode checks inside
them. A checked call therefore costs two no-grad forwards of the model, plus, when it fails, two
more with hooks to find the culprit.

The check is a forward hook on the model, registered for the block. It acts only in the thread or
async task whose scope registered it, and only for the innermost scope of that model there; it is
skipped while the model is compiled, exported or traced and under ``torch.func`` transforms. Calls
of ``model.forward(...)`` that bypass ``model(...)`` are not seen.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from weakref import WeakKeyDictionary

from torch import Tensor, nn

from .._torch_compat import is_capturing_or_transforming, is_symbolic_call, pytree
from . import _context
from ._checker import CheckedCall, error_for, measure
from ._context import type_name
from ._inputs import ENTRY_FORMS, SAME_AS_DIM, TooFewTokens, entry_form
from ._measure import EquivarianceError

__all__ = ["ModelCheck", "check_dim", "check_model_options"]

_ACTIVE: ContextVar[tuple[ModelCheck, ...]] = ContextVar("slim_mha_equivariance_model_checks", default=())
# The calls of each model seen while a scope checked it, across scopes: ``every`` counts a model's
# steps, so a block that wraps one training step checks every ``every``-th step, not every step.
CALLS: WeakKeyDictionary[nn.Module, int] = WeakKeyDictionary()


def check_dim(dim) -> None:
    """Validate the form of ``dim`` when the scope opens; whether it fits the inputs is told per call."""
    if isinstance(dim, bool) or not isinstance(dim, (int, Sequence, Mapping)) or isinstance(dim, str):
        raise ValueError(
            f"dim must be the model's set axis: an int (every tensor input), a sequence with one entry per "
            f"positional input, or a dict from forward parameter names to entries; got {dim!r}"
        )
    entries = dim.values() if isinstance(dim, Mapping) else dim if isinstance(dim, Sequence) else [dim]
    for entry in entries:
        if entry_form(entry) is None:
            raise ValueError(f"dim entry {entry!r} is not understood: use {ENTRY_FORMS}")
    if isinstance(dim, Mapping):
        for key in dim:
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise ValueError(f"dim's keys must be forward parameter names or positions, got {key!r}")


class ModelCheck:
    """One scope's check of one model: its settings, its count of the model's calls, its hook."""

    def __init__(
        self,
        model: nn.Module,
        dim,
        invariant: bool,
        every: int,
        draw_seed: Callable[[], int],
        *,
        output_dim=SAME_AS_DIM,
        tolerance: float | None = None,
        permutation: Callable | None = None,
    ):
        self.model = model
        self.dim = dim
        self.invariant = invariant
        self.output_dim = None if invariant else output_dim
        self.tolerance = tolerance
        self.permutation = permutation
        self.every = every
        self._draw_seed = draw_seed
        self._warned = False

    @contextmanager
    def active(self) -> Iterator[None]:
        token = _ACTIVE.set(_ACTIVE.get() + (self,))
        handle = self.model.register_forward_hook(self._after_call, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()
            _ACTIVE.reset(token)

    def _after_call(self, model: nn.Module, args: tuple, kwargs: dict, output) -> None:
        __tracebackhide__ = True
        if is_capturing_or_transforming():  # first: Dynamo folds it to True and traces nothing below
            return None
        if _context.is_rerunning() or not self._is_innermost_here():
            return None
        first = next((x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor)), None)
        if first is None:
            self._warn_nothing_found(args, kwargs)
            return None
        if is_symbolic_call(first):
            return None
        count = CALLS.get(self.model, 0)
        CALLS[self.model] = count + 1
        if count % self.every == 0:
            self._check(args, kwargs, count)
        return None  # the call's output, unchanged

    def _is_innermost_here(self) -> bool:
        for check in reversed(_ACTIVE.get()):
            if check.model is self.model:
                return check is self
        return False

    def _warn_nothing_found(self, args: tuple, kwargs: dict) -> None:
        """A call with no tensor anywhere in its inputs cannot be checked: say so, once per scope."""
        if self._warned:
            return
        self._warned = True
        kinds = ", ".join(type(x).__name__ for x in (*args, *kwargs.values())) or "none"
        warnings.warn(
            f"{self._describe()}: call {CALLS.get(self.model, 0) + 1} of {type_name(self.model)} has no tensor input the check "
            f"can find (its inputs: {kinds}), so it is not checked. Tensors are found in tuples, lists, dicts and "
            "types registered with torch.utils._pytree; pass the tensors as arguments, register the type, or check "
            "a function of the tensors with slim_mha.assert_permutation_equivariant",
            stacklevel=3,
        )

    def _check(self, args: tuple, kwargs: dict, count: int) -> None:
        __tracebackhide__ = True
        checked = self._checked_call(args, kwargs, count)
        permutation = None if self.permutation is None else self.permutation(*args, **kwargs)
        try:
            with _context.rerunning():
                result = measure(checked, seed=self._draw_seed(), permutation=permutation, submodules=False)
                error = error_for(checked, result, self.tolerance)
        except TooFewTokens:  # a set of 0 or 1 tokens (the last batch of an epoch, say): nothing to permute
            return
        except ValueError as problem:  # the inputs do not fit dim: say which call and which argument
            raise ValueError(f"{self._describe()}: call {count + 1} of {type_name(self.model)}: {problem}") from None
        except Exception as problem:  # the model refused the permuted inputs: name the check, keep the cause
            hint = (
                ""
                if self.permutation is not None
                else "; if the inputs hold several sets (a batch of graphs), "
                "pass permutation=, a function of the call's inputs that permutes within each set"
            )
            raise RuntimeError(
                f"{self._describe()}: call {count + 1} of {type_name(self.model)} failed when the check ran it "
                f"again on its inputs permuted: {type(problem).__name__}: {problem}{hint}"
            ) from problem
        if error is not None:
            raise EquivarianceError(
                f"{self._describe()}: call {count + 1} of the model, run again on its inputs and on them "
                f"permuted (both runs under no_grad, without dropout):\n{error}",
                errors=error.errors,
                module_name=error.module_name,
                seed=error.seed,
                permutations=error.permutations,
                result=error.result,
            )

    def _checked_call(self, args: tuple, kwargs: dict, count: int) -> CheckedCall:
        """The model's call as the checker takes it: every tensor inside the inputs one input of a
        function that rebuilds them and calls the model, each with its name and its entry of ``dim``."""
        names = _input_names(self.model, args, kwargs)
        # Each input's leaves (tensors inside lists, dicts and registered types), rebuilt for each run.
        flat = [pytree.tree_flatten(x) for x in (*args, *kwargs.values())]
        sizes = [len(leaves) for leaves, _ in flat]
        keywords = list(kwargs)
        positional = len(args)

        def call_model(*values):
            rebuilt, start = [], 0
            for size, (_, spec) in zip(sizes, flat):
                rebuilt.append(pytree.tree_unflatten(list(values[start : start + size]), spec))
                start += size
            return self.model(*rebuilt[:positional], **dict(zip(keywords, rebuilt[positional:])))

        entries = self._entries(names, positional, count)
        inputs = tuple(leaf for leaves, _ in flat for leaf in leaves)
        leaf_names = tuple(
            name if size == 1 and leaves[0] is value else f"{name} leaf {index}"
            for name, value, (leaves, _), size in zip(names, (*args, *kwargs.values()), flat, sizes)
            for index in range(size)
        )
        if not isinstance(entries, int):  # an input's entry moves each tensor inside it
            entries = [
                entry if isinstance(leaf, Tensor) else None
                for entry, (leaves, _) in zip(entries, flat)
                for leaf in leaves
            ]
        return CheckedCall(
            fn=call_model,
            inputs=inputs,
            dim=entries,
            output_dim=self.output_dim,
            kwargs={},
            module=self.model,
            subject=type_name(self.model),
            input_names=leaf_names,
            wraps_module=False,  # call_model does nothing but call the model
        )

    def _entries(self, names: list[str], positional: int, count: int):
        """``dim`` as the checker takes it, over the call's inputs (positional, then keyword)."""
        if isinstance(self.dim, int):
            return self.dim
        if isinstance(self.dim, Sequence):
            if len(self.dim) != positional:
                raise ValueError(
                    f"{self._describe()}: call {count + 1} of {type_name(self.model)} has {positional} positional "
                    f"inputs but dim has {len(self.dim)} entries: give one per positional input, or a dict keyed "
                    "by parameter name to reach keyword inputs"
                )
            return [*self.dim, *([None] * (len(names) - positional))]
        unknown = [key for key in self.dim if not (key in names or (isinstance(key, int) and 0 <= key < positional))]
        if unknown:
            raise ValueError(
                f"{self._describe()}: call {count + 1} of {type_name(self.model)} has no input {unknown[0]!r}; "
                f"its inputs are {names}"
            )
        return [self.dim.get(name, self.dim.get(index)) for index, name in enumerate(names)]

    def _describe(self) -> str:
        invariant = ", invariant=True" if self.invariant else ""
        return f"checking_equivariance({type_name(self.model)}, dim={self.dim!r}{invariant})"


def check_model_options(output_dim, tolerance, permutation, invariant: bool) -> None:
    """The model-level options beside ``dim``, checked when the scope opens."""
    if tolerance is not None and (
        isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0
    ):
        raise ValueError(
            f"tolerance must be a number >= 0 (relative to each output's scale) or None, got {tolerance!r}"
        )
    if permutation is not None and not callable(permutation):
        raise ValueError(
            f"permutation must be a function of the call's inputs returning a permutation, got {permutation!r}"
        )
    if invariant and output_dim is not SAME_AS_DIM:
        raise ValueError(
            "invariant=True already says the outputs stay unchanged: pass output_dim or invariant, not both"
        )


def _input_names(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """The forward parameter names of the positional inputs (``input 0``... when unknown), then the keywords."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [positional[i] if i < len(positional) else f"input {i}" for i in range(len(args))]
    return names + list(kwargs)
