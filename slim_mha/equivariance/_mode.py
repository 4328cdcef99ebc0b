"""The assertion mode: slim attention calls check their own permutation equivariance as they run.

With ``dim``, :func:`checking_equivariance` also checks the model's own calls (:mod:`._model_mode`);
this file owns the scopes and the per-call check of slim attention.

Switched on per module (``check_equivariance=True``, or the attribute of that name), for every slim
module called inside ``with checking_equivariance():``, or for the whole process with the
environment variable ``SLIM_MHA_CHECK_EQUIVARIANCE``. ``check_equivariance=False`` opts a module out
of the last two (for an attention that adds positions of its own, say). A value of the variable that
is not understood does not fail the import: the first call that would follow it raises one
ValueError naming the variable and the values it accepts.

A checked call, after computing its result, draws a query permutation ``P`` and a key/value
permutation ``Q`` and recomputes attention once on ``P query``, ``Q key``, ``Q value`` with
``key_padding_mask`` permuted by ``Q`` and ``attn_mask`` by ``P`` on its rows and ``Q`` on its columns.
Attention must return ``P output`` and weights ``P W Qᵀ`` (appended ``add_bias_kv``/``add_zero_attn``
columns stay last). One recomputation tests both properties: equivariance in the queries and
invariance in the keys and values; only when it fails are they run apart, to say which broke.
Both permutations come from :func:`draw_permutation`: from 4 tokens on, one cycle through all of
them that commutes with no cyclic shift of the positions (nor their reversal), so that neither a
leak at some positions nor one that is itself a shift (weight columns rolled by one) can pass.

A causal call is checked through its mask. With an explicit ``attn_mask``, ``is_causal=True`` is only
a hint that the mask is the causal one (``nn.TransformerDecoder`` sets it when it detects that mask),
and the property is equivariance with the mask following the tokens, ``f(P x, P M Pᵀ) = P f(x, M)``:
the recomputation passes the permuted mask, which is no longer causal, without the hint. Only a call
with ``is_causal=True`` and no mask has nothing to permute, and raises.

No side effects: the check follows whatever path the call took and recomputes after it with slim's
own path alone, under ``no_grad`` on detached inputs, with ``dropout_p=0`` (no module flag is
switched; a dropout-free reference is recomputed when the call used dropout; the returned tensors
are never touched), on copies of the module's buffers (a parametrized projection's spectral norm is
not advanced), and the permutations come from private generators, so the global RNG is neither read
nor advanced. While ``torch.compile``/``torch.export`` or ``torch.jit.trace`` trace the module, and
under ``torch.func`` transforms (``vmap``, ``grad``), the check is skipped, so graphs stay free
of it and transforms see the plain call.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import cast
from weakref import WeakKeyDictionary, WeakSet

import torch
from torch import Tensor, nn

from .._features import CHECKS, ENVIRONMENT_VARIABLE, check_every, resolve_options
from .._stock_checks import AttentionCall
from .._torch_compat import is_capturing_or_transforming
from . import _rerun
from ._checker import buffer_copies
from ._context import is_rerunning, naming, qualified_name, type_name
from ._inputs import SAME_AS_DIM
from ._measure import (
    EquivarianceError,
    TensorError,
    draw_permutation,
    format_indices,
    low_precision,
    measure_error,
    permute,
    rounding_of,
    tolerance_dtype,
)
from ._model_mode import CALLS as MODEL_CALLS
from ._model_mode import ModelCheck, check_dim, check_model_options

__all__ = ["ENVIRONMENT_VARIABLE", "SWITCH", "checking_equivariance", "check_call", "reset", "resolve_options"]


@dataclass(frozen=True)
class _Scope:
    every: int


SWITCH = CHECKS  # what every slim forward reads (slim_mha._features)
_LOCK = threading.Lock()
_open_scopes = 0  # in all threads; guarded by _LOCK
_SCOPE: ContextVar[_Scope | None] = ContextVar("slim_mha_equivariance_scope", default=None)
_CALLS: WeakKeyDictionary[nn.Module, int] = WeakKeyDictionary()  # calls seen while on, per module
_WARNED: WeakSet[nn.Module] = WeakSet()  # models already warned about having nothing to check
_SEEDS = torch.Generator().manual_seed(0x5EED)  # private: seeds of the checks' permutations


def _read_environment(value: str | None) -> _Scope | None:
    """``1``/``true``/``yes``/``on``: every call; ``N``: every N-th call of each module; unset/``0``/``false``: off."""
    text = (value or "").strip().lower()
    if text in ("", "false", "no", "off") or (text.isdigit() and int(text) == 0):
        return None
    if text in ("true", "yes", "on"):
        return _Scope(every=1)
    if text.isdigit():
        return _Scope(every=int(text))
    raise ValueError(
        f"{ENVIRONMENT_VARIABLE}={value!r} is not understood: use 1 (or true, yes, on) to check every slim "
        f"attention call, N > 1 to check every N-th call of each module, or 0 (or false, no, off, or unset) "
        f"to turn checking off"
    )


def _configure_environment(value: str | None) -> None:
    """Apply an environment value (done once at import; tests call it to simulate the variable).

    A value that is not understood is not raised here: this runs when slim_mha is imported, and every
    program importing it (the migration CLI included) would die with a traceback. It is kept, and
    raised as one ValueError by the first call that follows the variable (:func:`_sampling_period`).
    """
    global _environment_scope, _environment_error
    try:
        _environment_scope, _environment_error = _read_environment(value), None
    except ValueError as error:
        _environment_scope, _environment_error = None, str(error)
    with _LOCK:
        SWITCH.active = _open_scopes > 0 or _environment_scope is not None or _environment_error is not None


_environment_scope: _Scope | None = None
_environment_error: str | None = None  # the message for a value that is not understood
_configure_environment(os.environ.get(ENVIRONMENT_VARIABLE))


@contextmanager
def checking_equivariance(
    model: nn.Module | None = None,
    *,
    every: int = 1,
    strict: bool = False,
    dim: int | Sequence | Mapping | None = None,
    invariant: bool = False,
    output_dim=SAME_AS_DIM,
    tolerance: float | None = None,
    permutation: Callable | None = None,
) -> Iterator[None]:
    """Check permutation equivariance while the block runs (in this thread or async task).

    Without ``dim``, slim attention checks each of its own calls: given the query, key and value it
    receives, is the call equivariant? That catches a faulty attention, not a model that feeds it
    positions (a position table, a projection along the sequence): each call is still equivariant
    given its inputs. With ``dim``, the model's own calls are checked as well, as a whole.

    Args:
        model: the model. Without ``dim``, errors name the failing attention module by its
            qualified name in ``model``, and a model with no slim attention module to check (stock
            modules only: built before ``patch()``, not converted) warns once, since the block
            would check nothing.
        every: check the first call (of the model, and of each attention module), then every
            ``every``-th one.
        strict: raise a ValueError instead of warning when ``model`` has nothing to check.
        dim: the model's set axis: check the model's calls. An int moves every tensor input along
            that axis (an integer tensor without that many tokens along it, like ``edge_index``,
            holds token indices and is relabelled); a sequence gives one entry per positional
            input, a dict one per forward parameter name: an axis, a tuple of axes, ``"indices"``,
            or ``None`` (unchanged). The model's outputs must follow: permuted along the same axis.
        invariant: with ``dim``, the model's outputs must instead stay unchanged (pooling over the
            set, attention from learned queries over it).
        output_dim: with ``dim``, the axes each output is expected permuted along, as
            :func:`assert_permutation_equivariant` takes it (an int, ``None``, or one entry per
            returned tensor): for attention weights ``(B, L, L)``, ``(1, 2)``; for a batch-first
            model with sequence-first outputs, ``0``. Default: the inputs' axis.
        tolerance: with ``dim``, the relative tolerance for the model's outputs (default: the dtype
            table, relative to the larger of the output's and the permuted inputs' magnitudes).
        permutation: with ``dim``, a function of the call's inputs (called as the model was) that
            returns the permutation to apply, for inputs that hold several sets: a PyG batch of
            graphs is permuted within each graph, which keeps its ``batch`` vector sorted.

    A checked model call is run again twice under ``no_grad`` without dropout, on its inputs and on
    them permuted, and the outputs compared within the dtype tolerance table; a break raises
    :class:`EquivarianceError` naming the first submodule or the lines of code where it breaks, the
    seed and the permutation. The call's output, gradients, the global RNG, buffers and training
    flags are left as the call made them.

    Modules built with ``check_equivariance=False`` are left out of the per-call checks; modules
    with ``True`` keep their own ``check_equivariance_every``. Scopes nest (the innermost ``every``
    applies, and the innermost ``dim`` of a model) and are local to the thread or async task that
    opened them: threads started inside do not inherit them.

    Example::

        with slim_mha.checking_equivariance(model, every=10, dim=1):
            loss = model(batch).loss
    """
    every = _check_scope_options(model, every, strict, dim, invariant, output_dim, tolerance, permutation)
    if dim is None and model is not None:
        _report_nothing_to_check(model, strict)
    model_check = (
        nullcontext()
        if dim is None or model is None  # checked above: a dim comes with a model
        else ModelCheck(
            model,
            dim,
            invariant,
            every,
            lambda: _next_seed(),
            output_dim=output_dim,
            tolerance=tolerance,
            permutation=permutation,
        ).active()
    )
    global _open_scopes
    scope_token = _SCOPE.set(_Scope(every=every))
    with _LOCK:
        _open_scopes += 1
        SWITCH.active = True
    try:
        with naming(model), model_check:
            yield
    finally:
        with _LOCK:
            _open_scopes -= 1
            SWITCH.active = _open_scopes > 0 or _environment_scope is not None or _environment_error is not None
        _SCOPE.reset(scope_token)


def _check_scope_options(model, every, strict, dim, invariant, output_dim, tolerance, permutation) -> int:
    """:func:`checking_equivariance`'s arguments, checked together (each error names the fix); ``every``."""
    every = check_every(every, "every")
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module (used to name failing modules), got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True or False, got {strict!r}")
    if not isinstance(invariant, bool):
        raise ValueError(f"invariant must be True or False, got {invariant!r}")
    if dim is not None and model is None:
        raise ValueError(
            "dim is the model's set axis, and no model was given: pass checking_equivariance(model, dim=...)"
        )
    if invariant and dim is None:
        raise ValueError("invariant=True says how the model's outputs follow its set axis: give that axis as dim too")
    if dim is not None:
        check_dim(dim)
        check_model_options(output_dim, tolerance, permutation, invariant)
    elif output_dim is not SAME_AS_DIM or tolerance is not None or permutation is not None:
        raise ValueError(
            "output_dim, tolerance and permutation are for the model's own calls: give its set axis as dim too"
        )
    return every


def _checks_its_calls(module: nn.Module) -> bool:
    # Slim attention is the attention class that declares the option (read off the class, so this
    # module needs no import of the attention module, which imports it).
    return isinstance(module, nn.MultiheadAttention) and hasattr(type(module), "check_equivariance")


def _report_nothing_to_check(model: nn.Module, strict: bool) -> None:
    """Warn once per model (raise when strict) if no module in it would be checked: a silent no-op."""
    slim = [module for module in model.modules() if _checks_its_calls(module)]
    if any(getattr(module, "check_equivariance", None) is not False for module in slim):
        return
    if slim:
        reason = (
            f"all its {len(slim)} slim attention modules opted out with check_equivariance=False; "
            "set the attribute to None (follow the scope) or True on the ones to check"
        )
    else:
        stock = sum(isinstance(module, nn.MultiheadAttention) for module in model.modules())
        found = f"its {stock} nn.MultiheadAttention modules are stock" if stock else "it has no attention module"
        reason = (
            f"{found} and only slim attention checks its calls; build the model inside "
            "`with slim_mha.patched():` (or after slim_mha.patch()), or convert it with slim_mha.convert(model)"
        )
    message = f"checking_equivariance(model): {type(model).__name__} has nothing to check: {reason}"
    if strict:
        raise ValueError(message)
    if model not in _WARNED:
        _WARNED.add(model)
        # stacklevel: this function, the generator, contextlib's __enter__, then the `with` line.
        warnings.warn(message, UserWarning, stacklevel=4)


# --------------------------------------------------------------------------------- the check


def check_call(module: nn.Module, result: tuple[Tensor, Tensor | None], call: AttentionCall) -> None:
    """Called by ``SlimMultiheadAttention.forward`` when checking may be on; checks this call if due.

    Raises:
        EquivarianceError: if the call broke equivariance, or used ``is_causal=True`` without ``attn_mask``.
        ValueError: if the call follows ``SLIM_MHA_CHECK_EQUIVARIANCE`` and its value is not understood.
    """
    __tracebackhide__ = True
    if _transformed() or is_rerunning():  # a model-level check's own runs: not checked again
        return
    every = _sampling_period(module)
    if every is None:
        return
    if call.is_causal and call.attn_mask is None:
        raise EquivarianceError(
            f"{_label(module)} was called with is_causal=True and no attn_mask, which is order-dependent by "
            "construction (query i attends only to keys j <= i) and leaves no mask to permute with the "
            "tokens, so there is nothing to check. Pass the causal mask as attn_mask (the check permutes it "
            "with its tokens: f(P x, P M P^T) = P f(x, M)), or build the module with check_equivariance=False "
            "(or set the attribute) to exempt it.",
            module_name=qualified_name(module),
        )
    count = _CALLS.get(module, 0)
    _CALLS[module] = count + 1
    if count % every or call.query.is_nested or call.key.is_nested or call.value.is_nested:
        return
    _AttentionCheck(module, call).run(result)


def _transformed() -> bool:
    """Whether the call is being traced or transformed, where the check must not run.

    ``torch.compile``/``torch.export``/``torch.jit.trace``: graphs stay free of the check.
    ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``...): the recomputation would run on
    wrapped tensors, draw random permutations inside ``vmap`` (an error in its default randomness
    mode) and check one batched call for all the mapped ones.
    """
    return is_capturing_or_transforming()


def _sampling_period(module: nn.Module) -> int | None:
    flag = getattr(module, "check_equivariance", None)
    if flag is False:
        return None
    if flag:
        return check_every(module.check_equivariance_every, "check_equivariance_every")
    scope = _SCOPE.get()
    if scope is None and _environment_error is not None:
        raise ValueError(_environment_error)
    scope = scope or _environment_scope
    return None if scope is None else scope.every


class _AttentionCheck:
    """One checked call: its detached inputs, the permutations, and the recomputations."""

    def __init__(self, module, call: AttentionCall):
        query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal = call
        self.module = module
        # With a mask, is_causal is only a hint that it is the causal one: the recomputations pass the
        # permuted mask instead (no longer causal), and the call's own result is the reference.
        self.is_causal_hint = is_causal
        detached = _detach_alike(query, key, value, key_padding_mask, attn_mask)
        self.query, self.key, self.value = (cast(Tensor, t) for t in detached[:3])  # tensors in, tensors out
        self.key_padding_mask, self.attn_mask = detached[3:]
        self.need_weights = need_weights
        self.average_attn_weights = average_attn_weights
        self.batched = query.dim() == 3
        self.axis = 1 if self.batched and module.batch_first else 0  # token axis of query, key, value, output
        self.used_dropout = module.training and module.dropout > 0.0
        # Stock's causal kernel masks appended key columns (add_bias_kv, add_zero_attn) that the
        # explicit mask, padded, leaves open: there the call's result is not f(x, M), so the
        # reference is recomputed from the mask, as the permuted calls are.
        appended = module.bias_k is not None or module.add_zero_attn
        self.recompute_reference = self.used_dropout or (is_causal and appended)
        self.rounding: tuple[float | None, float | None] = (None, None)  # set by run in low precision
        self.seed = _next_seed()
        self.query_permutation = draw_permutation(query.shape[self.axis], self.seed)
        self.key_permutation = draw_permutation(key.shape[self.axis], self.seed + 1)

    def run(self, result: tuple[Tensor, Tensor | None]) -> None:
        __tracebackhide__ = True
        # Each recomputation runs slim's own path alone (no user code; dropout_p=0, so nothing random is
        # drawn and no module flag is switched), on fresh copies of the module's buffers: a parametrized
        # projection's spectral norm is not advanced.
        with torch.no_grad(), buffer_copies(self.module) as self.rewind:
            if self.recompute_reference:  # dropout noise, or a causal hint read differently: recompute
                reference = self._attend(permute_queries=False, permute_keys=False)
            else:
                output, weights = result
                reference = (output.detach(), None if weights is None else weights.detach())
            self.rounding = self._rounding(reference)
            errors = self._compare(reference, permute_queries=True, permute_keys=True)
            if all(error.passed() for error in errors):
                return
            diagnosis = [
                (role, self._compare(reference, permute_queries=role == "queries", permute_keys=role == "keys"))
                for role in ("queries", "keys")
            ]
        raise self._error(errors, diagnosis)

    def _rounding(self, reference: tuple[Tensor, Tensor | None]) -> tuple[float | None, float | None]:
        """In low precision, what the comparison's two sides round (output, weights), measured against
        a float32 rerun: half the sum of the reference's and slim's own path's distances from it, so
        that the tolerance (floor plus twice this) allows each side its own rounding. The reference may
        come from another path (stock's kernel) that rounds less or more than slim's."""
        dtype = tolerance_dtype(reference[0])
        if not low_precision(dtype):
            return None, None
        own = reference if self.recompute_reference else self._attend(permute_queries=False, permute_keys=False)
        with _rerun.in_float32(self.module):
            exact = self._attend(permute_queries=False, permute_keys=False, upcast=True)
        roundings: list[float | None] = []
        for ours, theirs, high in zip(own, reference, exact):
            first = None if high is None or theirs is None else rounding_of(dtype, theirs, high)
            second = None if high is None or ours is None else rounding_of(dtype, ours, high)
            roundings.append(None if first is None or second is None else (first + second) / 2)
        return roundings[0], roundings[1]

    def _attend(self, permute_queries: bool, permute_keys: bool, upcast: bool = False) -> tuple[Tensor, Tensor | None]:
        query, key, value = self.query, self.key, self.value
        key_padding_mask, attn_mask = self.key_padding_mask, self.attn_mask
        if upcast:
            query, key, value, key_padding_mask, attn_mask = _rerun.upcast(
                (query, key, value, key_padding_mask, attn_mask)
            )
        if permute_queries:
            query = permute(query, (self.axis,), self.query_permutation)
            if attn_mask is not None:
                attn_mask = permute(attn_mask, (-2,), self.query_permutation)  # (L, S) or (B*H, L, S)
        if permute_keys:
            shared_value = value is key
            key = permute(key, (self.axis,), self.key_permutation)
            value = key if shared_value else permute(value, (self.axis,), self.key_permutation)
            if key_padding_mask is not None:
                key_padding_mask = permute(key_padding_mask, (-1,), self.key_permutation)  # (B, S) or (S,)
            if attn_mask is not None:
                attn_mask = permute(attn_mask, (-1,), self.key_permutation)
        self.rewind()
        return self.module._slim_general(
            AttentionCall(
                query, key, value, key_padding_mask, self.need_weights, attn_mask, self.average_attn_weights, False
            ),
            dropout_p=0.0,
        )

    def _compare(self, reference, permute_queries: bool, permute_keys: bool) -> list[TensorError]:
        output, weights = self._attend(permute_queries, permute_keys)
        reference_output, reference_weights = reference
        rows = self.query_permutation if permute_queries else None
        dtype = tolerance_dtype(reference_output)
        expected = reference_output if rows is None else permute(reference_output, (self.axis,), rows)
        output_rounding, weights_rounding = self.rounding
        error = measure_error("output", output, expected, (self.axis,) if rows is not None else (), dtype)
        errors = [replace(error, rounding=output_rounding)]
        if reference_weights is not None and weights is not None:
            expected = reference_weights if rows is None else permute(reference_weights, (-2,), rows)
            if permute_keys:  # appended key columns (add_bias_kv, add_zero_attn) stay where they are
                source = self.key.shape[self.axis]
                appended = torch.arange(source, reference_weights.shape[-1])
                expected = permute(expected, (-1,), torch.cat([self.key_permutation, appended]))
            dims = ((-2,) if rows is not None else ()) + ((-1,) if permute_keys else ())
            errors.append(replace(measure_error("weights", weights, expected, dims, dtype), rounding=weights_rounding))
        return errors

    def _error(self, errors: list[TensorError], diagnosis) -> EquivarianceError:
        lines = [
            f"{_label(self.module)} is not permutation-equivariant on this call "
            f"(recomputed under no_grad{' with dropout off' if self.used_dropout else ''}):"
        ]
        failed: list[TensorError] = []
        sentences = {
            ("queries", "output"): "permuting the queries does not permute the output rows",
            ("queries", "weights"): "permuting the queries does not permute the weight rows",
            ("keys", "output"): "permuting the keys and values together changes the output",
            ("keys", "weights"): "permuting the keys and values together does more than permute the weight columns",
        }
        for role, role_errors in diagnosis:
            for error in role_errors:
                if not error.passed():
                    lines.append(f"  {error.name}: {sentences[role, error.name]}: {error.describe()}")
                    failed.append(error)
        if not failed:  # only the two permutations together break it
            for error in errors:
                if not error.passed():
                    lines.append(f"  {error.name}: permuting queries and keys/values together: {error.describe()}")
                    failed.append(error)
        lines.append("  call: " + self._describe_call())
        lines.append(
            f"  reproduce: seed {self.seed} drew query permutation {format_indices(self.query_permutation)} and "
            f"key/value permutation {format_indices(self.key_permutation)} "
            f"(slim_mha.equivariance.draw_permutation(n, {self.seed}) and (n, {self.seed + 1}))"
        )
        return EquivarianceError(
            "\n".join(lines),
            errors=tuple(failed),
            module_name=qualified_name(self.module),
            seed=self.seed,
            permutations={"query": self.query_permutation, "key/value": self.key_permutation},
        )

    def _describe_call(self) -> str:
        layout = f"batch_first={self.module.batch_first}" if self.batched else "unbatched"
        parts = [
            f"query {_shape(self.query)}, key {_shape(self.key)}, value {_shape(self.value)}, "
            f"tokens on dim {self.axis} ({layout})"
        ]
        if self.key_padding_mask is not None:
            parts.append(f"key_padding_mask {_shape(self.key_padding_mask)} {_dtype(self.key_padding_mask)}")
        if self.attn_mask is not None:
            parts.append(f"attn_mask {_shape(self.attn_mask)} {_dtype(self.attn_mask)}")
        parts.append(f"need_weights={self.need_weights}, average_attn_weights={self.average_attn_weights}")
        if self.is_causal_hint:
            parts.append(
                "is_causal=True (a hint: the check permutes attn_mask, so a mask that is not the causal "
                "one shows up here as a break)"
            )
        parts.append(f"training={self.module.training}")
        return "; ".join(parts)


def _detach_alike(*tensors: Tensor | None) -> list[Tensor | None]:
    """Detach each tensor once, so `query is key is value` still holds (it selects the fused path)."""
    detached: dict[int, Tensor] = {}
    for tensor in tensors:
        if tensor is not None and id(tensor) not in detached:
            detached[id(tensor)] = tensor.detach()
    return [None if tensor is None else detached[id(tensor)] for tensor in tensors]


def reset(environment: str | None = None) -> None:
    """Back to the state of a fresh process whose environment variable is ``environment``: the checks'
    seed sequence from its start, no call counted, no model warned about. For tests and notebooks."""
    with _LOCK:
        _SEEDS.manual_seed(_SEEDS.initial_seed())
        _CALLS.clear()
        MODEL_CALLS.clear()
        _WARNED.clear()
    _configure_environment(environment)


def _next_seed() -> int:
    with _LOCK:
        return int(torch.randint(0, 2**31 - 2, (1,), generator=_SEEDS))


def _label(module: nn.Module) -> str:
    name = qualified_name(module)
    if name is not None:
        return f"{type_name(module)} '{name}'"
    return (
        f"{type_name(module)}({module.extra_repr()}) (pass the model to slim_mha.checking_equivariance(model) "
        "to get its qualified name)"
    )


def _shape(tensor: Tensor) -> str:
    return "(" + ", ".join(map(str, tensor.shape)) + ")"


def _dtype(tensor: Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


CHECKS.run = check_call  # every slim forward reaches the check through slim_mha._features
