"""Where a failing permutation check first breaks: in a submodule, or in the code between two of them.

Both runs of a failing check are repeated with hooks on every submodule, and each submodule call is
recorded twice: when it starts (its tensor inputs, and the function and line that called it) and
when it finishes (its tensor outputs). The check cannot know which axis of an intermediate tensor
carries the tokens, so a tensor is accepted if, within tolerance, it is unchanged (it does not see
the tokens) or permuted along one axis whose length is the number of tokens, or along all such axes
at once. Walking the events in the order they happened, the first tensor that matches none of these
is where the property broke:

* a call whose inputs were fine but whose output is not: the submodule broke it (when it has
  submodules of its own and they all kept it, the break is in its own code after them);
* a call whose input is already broken although every event before it was fine: the code that ran
  between the previous event and this call broke it, e.g. ``h = self.embed(x) + self.pos`` written
  inline in ``forward``. The report names that code by its function, the two calls around it and
  the lines, read from the calling frames.

Integer tensors among the inputs are not judged: they are usually indices (``edge_index``, token
ids) that a permutation relabels rather than moves. Hooks see modules called as ``module(...)``,
not ``module.forward(...)``.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn

from ._context import type_name
from ._measure import TensorError, less_precise, measure_reading, rounding_of

__all__ = ["CallSite", "SubmoduleCheck", "Culprit", "recording", "compare_calls", "find_culprit", "flatten", "readings"]

_CALL_MACHINERY = {os.path.normcase(os.path.abspath(torch.nn.modules.module.__file__))}
_TORCH_DIRECTORY = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


# ------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class CallSite:
    """Where a submodule was called from.

    Attributes:
        filename: the calling function's file.
        line: the line of the call.
        function: the calling function's qualified name (``"Model.forward"``).
        first_line, last_line: the calling function's first and last lines.
    """

    filename: str
    line: int
    function: str
    first_line: int
    last_line: int

    @property
    def path(self) -> str:
        """The file, relative to the working directory when it lies under it."""
        relative = os.path.relpath(self.filename) if os.path.isabs(self.filename) else self.filename
        return self.filename if relative.startswith("..") else relative


@dataclass(frozen=True)
class SubmoduleCheck:
    """One submodule call, compared between the original and the permuted run.

    Attributes:
        name: the submodule's qualified name in the checked module.
        type_name: its class name.
        call: which call of that submodule it was (0 for the first).
        outputs: for each of its tensor outputs, the errors under every reading.
        note: set when the runs disagree structurally (missing output, shape change).
        inputs: for each of its floating-point and boolean tensor inputs, the errors under every reading.
        parent: the qualified name of the submodule whose call was running when it was called
            (``None``: called from the checked function's own code).
        site: where it was called from, when the frames told.
        started, finished: the positions of its start and its end among all recorded events.
        forward: where its class's ``forward`` is defined, when that is outside torch.
    """

    name: str
    type_name: str
    call: int
    outputs: tuple[tuple[TensorError, ...], ...]
    note: str = ""
    inputs: tuple[tuple[TensorError, ...], ...] = ()
    parent: str | None = None
    site: CallSite | None = None
    started: int = -1
    finished: int = -1
    forward: CallSite | None = None

    def passed(self, tolerance: float | None = None) -> bool:
        """Whether every output matches a reading (the inputs are judged by :meth:`inputs_passed`)."""
        if self.note:
            return False
        return all(_matches(readings, tolerance) for readings in self.outputs)

    def inputs_passed(self, tolerance: float | None = None) -> bool:
        return all(_matches(readings, tolerance) for readings in self.inputs)

    def unmoved_inputs(self, tolerance: float | None = None) -> list[TensorError]:
        """Inputs with token-length axes that stayed put while another input moved with the tokens:
        a mask or position input held fixed is the likeliest reason such a call breaks."""
        moved = any(not readings[0].passed(tolerance) and _matches(readings, tolerance) for readings in self.inputs)
        if not moved:
            return []
        return [
            readings[0]
            for readings in self.inputs
            if len(readings) > 1 and readings[0].passed(tolerance) and readings[0].max_abs == 0.0
        ]

    def broken_output(self, tolerance: float | None = None) -> TensorError | None:
        """The closest reading of the first output that matches none."""
        return _closest_broken(self.outputs, tolerance)

    def broken_input(self, tolerance: float | None = None) -> TensorError | None:
        """The closest reading of the first input that matches none."""
        return _closest_broken(self.inputs, tolerance)

    @property
    def display_name(self) -> str:
        """The qualified name; the class name for the checked module itself (whose name is ``""``)."""
        return self.name or self.type_name

    def label(self) -> str:
        """```name` (call 2)``: how reports refer to this call."""
        return f"`{self.display_name}` (call {self.call + 1})"


def _matches(readings: tuple[TensorError, ...], tolerance: float | None) -> bool:
    return any(error.passed(tolerance) for error in readings)


def _closest_broken(tensors, tolerance: float | None) -> TensorError | None:
    for readings in tensors:
        if not _matches(readings, tolerance):
            return min(readings, key=lambda error: error.max_rel)
    return None


@dataclass(frozen=True)
class Culprit:
    """Where a failing check first saw the property break.

    Attributes:
        kind: ``"submodule"`` (a call's output broke while its inputs were fine) or ``"code"`` (a
            call's input was already broken while everything before it was fine).
        module_name: the submodule that broke it; for ``"code"``, the submodule whose call was
            running (``""``: the checked module's own code).
        submodule: the call whose output broke, or the first one that received a broken input.
        code: the code at fault, ``"the code in `Model.forward` between `embed` (call 1) and
            `attn` (call 1)"``; for a submodule with submodules of its own that kept it, its code
            after them (``after_submodules``); for one that called no submodule, its ``forward``
            when that is defined outside torch (``"`PositionalAttention.forward`"``), else empty.
        location: ``"model.py, lines 10-11"``, when the frames told.
        kept: how many submodule calls finished before the break, all of them keeping the property.
    """

    kind: str
    module_name: str
    submodule: SubmoduleCheck
    code: str = ""
    location: str = ""
    kept: int = 0
    after_submodules: bool = False


# ---------------------------------------------------------------------------------- recording


@dataclass
class _Call:
    name: str
    type_name: str
    call: int
    parent: str | None
    site: CallSite | None
    inputs: list[tuple[str, Tensor]]
    started: int
    outputs: list[tuple[str, Tensor]] = field(default_factory=list)
    finished: int = -1
    forward: CallSite | None = None


@contextmanager
def recording(module: nn.Module | None, include_root: bool = False) -> Iterator[list[_Call]]:
    """Record every submodule call (copies of its tensor inputs and outputs), in the order calls start.
    ``include_root``: ``module``'s own calls too (named ``""``), for a checked function that wraps the
    module: a break in the module's code is then told apart from one in the function's."""
    calls: list[_Call] = []
    if module is None:
        yield calls
        return
    counts: dict[str, int] = {}
    running: list[_Call] = []
    events = itertools.count()

    def before_for(name: str):
        def before(submodule: nn.Module, args: tuple, kwargs: dict) -> None:
            call = counts.get(name, 0)
            counts[name] = call + 1
            parent = running[-1].name if running else None
            record = _Call(
                name,
                type_name(submodule),
                call,
                parent,
                _call_site(submodule),
                _tensor_inputs(submodule, args, kwargs),
                next(events),
                forward=_forward_site(type(submodule)),
            )
            calls.append(record)
            running.append(record)

        return before

    def after_for(name: str):
        def after(submodule: nn.Module, args: tuple, output) -> None:
            # The innermost running call of this name is the one finishing (a call that raised
            # never gets here, and then the whole check raises anyway).
            index = next((i for i in range(len(running) - 1, -1, -1) if running[i].name == name), None)
            if index is None:
                return
            record = running.pop(index)
            record.outputs = [
                (leaf_name, leaf.detach().clone())
                for leaf_name, leaf in flatten(output, "output")
                if isinstance(leaf, Tensor)
            ]
            record.finished = next(events)

        return after

    handles = []
    for name, submodule in module.named_modules():
        if submodule is not module or include_root:
            handles.append(submodule.register_forward_pre_hook(before_for(name), with_kwargs=True))
            handles.append(submodule.register_forward_hook(after_for(name)))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _call_site(submodule: nn.Module) -> CallSite | None:
    """The frame that called the submodule: the first one above the hook that is not part of the call.

    Part of the call: torch's call machinery, and any frame whose first argument is the submodule
    itself (a ``__call__`` its class overrides, and the decorators around one, as torch_geometric's
    aggregations have).
    """
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and (
        os.path.normcase(os.path.abspath(frame.f_code.co_filename)) in _CALL_MACHINERY
        or _first_argument(frame) is submodule
    ):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return CallSite(
        filename=code.co_filename,
        line=frame.f_lineno,
        function=getattr(code, "co_qualname", code.co_name),  # co_qualname: Python 3.11+
        first_line=code.co_firstlineno,
        last_line=max(lines, default=code.co_firstlineno),
    )


def _forward_site(cls: type) -> CallSite | None:
    """Where ``cls.forward`` is defined, when outside torch (torch's own layers are named by class)."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    if code is None or os.path.abspath(code.co_filename).startswith(_TORCH_DIRECTORY):
        return None
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return CallSite(
        filename=code.co_filename,
        line=code.co_firstlineno,
        function=getattr(code, "co_qualname", code.co_name),
        first_line=code.co_firstlineno,
        last_line=max(lines, default=code.co_firstlineno),
    )


def _first_argument(frame):
    code = frame.f_code
    if code.co_argcount:
        return frame.f_locals.get(code.co_varnames[0])
    if code.co_flags & inspect.CO_VARARGS:  # def wrapper(*args, **kwargs)
        packed = frame.f_locals.get(code.co_varnames[code.co_kwonlyargcount])
        return packed[0] if isinstance(packed, tuple) and packed else None
    return None


def _tensor_inputs(submodule: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, Tensor]]:
    """Copies of the floating-point, complex and boolean tensors among the inputs, named by parameter."""
    names = _positional_names(submodule)
    leaves = []
    for index, value in enumerate(args):
        leaves += flatten(value, names[index] if index < len(names) else f"args[{index}]")
    for key, value in kwargs.items():
        leaves += flatten(value, key)
    return [(name, leaf.detach().clone()) for name, leaf in leaves if isinstance(leaf, Tensor) and _judged(leaf)]


def _judged(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool


def _positional_names(submodule: nn.Module) -> list[str]:
    try:
        parameters = inspect.signature(submodule.forward).parameters.values()
    except (TypeError, ValueError):  # builtins, C extensions
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = []
    for parameter in parameters:  # the leading positional ones
        if parameter.kind not in positional:
            break
        names.append(parameter.name)
    return names


def flatten(value, name: str, _seen: frozenset = frozenset()) -> list[tuple[str, object]]:
    """The leaves of an output, named like ``output[1]``, ``output['logits']`` or ``output.t``.

    Tensors are found wherever the ecosystem puts them: tuples, lists and mappings (Hugging Face's
    ``ModelOutput`` too), dataclasses, and plain objects through their attributes (a PyG ``Data``
    through its store). Anything else (a string, ``None``, a number) is a leaf of its own, compared
    by equality.
    """
    if isinstance(value, Tensor):
        return [(name, value)]
    if id(value) in _seen or len(_seen) > 8 or isinstance(value, (str, bytes, int, float, complex, bool, type(None))):
        return [(name, value)]
    seen = _seen | {id(value)}
    if isinstance(value, (tuple, list)):
        return [leaf for index, item in enumerate(value) for leaf in flatten(item, f"{name}[{index}]", seen)]
    if isinstance(value, Mapping):
        return [leaf for key, item in value.items() for leaf in flatten(item, f"{name}[{key!r}]", seen)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [
            leaf
            for member in dataclasses.fields(value)
            for leaf in flatten(getattr(value, member.name), f"{name}.{member.name}", seen)
        ]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and not isinstance(value, (nn.Module, type)) and not callable(value):
        return [leaf for key, item in attributes.items() for leaf in flatten(item, f"{name}.{key}", seen)]
    return [(name, value)]


# ---------------------------------------------------------------------------------- comparing


def readings(tensor: Tensor, length: int) -> list[tuple[int, ...]]:
    """Unchanged, each axis of the token count alone, then all of them together."""
    token_axes = tuple(axis for axis, size in enumerate(tensor.shape) if size == length)
    result: list[tuple[int, ...]] = [(), *((axis,) for axis in token_axes)]
    if len(token_axes) > 1:
        result.append(token_axes)
    return result


def _measure_readings(before: list, after: list, length: int, permutation: Tensor, rerun: list | None) -> tuple:
    """Each tensor against each reading; in low precision, with its rounding against the float32
    rerun's same tensor where the rerun made the same call with the same tensors."""
    if rerun is None or [name for name, _ in rerun] != [name for name, _ in before]:
        rerun = [(name, None) for name, _ in before]

    def error(name: str, actual: Tensor, expected: Tensor, again: Tensor | None, reading: tuple[int, ...]):
        dtype = less_precise(actual.dtype, expected.dtype)
        measured = measure_reading(name, actual, expected, reading, permutation, dtype)
        return replace(measured, rounding=None if again is None else rounding_of(dtype, expected, again))

    return tuple(
        tuple(error(name, actual, expected, again, reading) for reading in readings(expected, length))
        for (name, expected), (_, actual), (_, again) in zip(before, after, rerun)
    )


def compare_calls(
    original: list[_Call],
    permuted: list[_Call],
    length: int,
    permutation: Tensor,
    rerun: list[_Call] | None = None,
) -> tuple[tuple[SubmoduleCheck, ...], str]:
    """Each call of the original run against the same call of the permuted run, in finishing order;
    ``rerun``: the float32 rerun's calls, whose outputs give each tensor's rounding in low precision."""
    checks = []
    note = ""
    same_calls = rerun is not None and [(c.name, c.call) for c in rerun] == [(c.name, c.call) for c in original]
    for index, (before, after) in enumerate(zip(original, permuted)):
        again = rerun[index] if rerun is not None and same_calls else None
        if (before.name, before.call) != (after.name, after.call):
            note = (
                f"submodule calls diverge at call {index}: '{before.name}' ran on the original inputs but "
                f"'{after.name}' on the permuted ones (data-dependent control flow); comparison stopped there"
            )
            break
        fields: dict[str, Any] = dict(  # what the two SubmoduleCheck calls below share
            parent=before.parent,
            site=before.site,
            started=before.started,
            finished=before.finished,
            forward=before.forward,
        )
        inputs_match = [name for name, _ in before.inputs] == [name for name, _ in after.inputs]
        inputs = (
            _measure_readings(before.inputs, after.inputs, length, permutation, again.inputs if again else None)
            if inputs_match
            else ()
        )
        if [name for name, _ in before.outputs] != [name for name, _ in after.outputs]:
            checks.append(
                SubmoduleCheck(before.name, before.type_name, before.call, (), "different outputs", inputs, **fields)
            )
            continue
        outputs = _measure_readings(
            before.outputs, after.outputs, length, permutation, again.outputs if again else None
        )
        checks.append(SubmoduleCheck(before.name, before.type_name, before.call, outputs, "", inputs, **fields))
    if not note and len(original) != len(permuted):
        note = f"{len(original)} submodule calls on the original inputs but {len(permuted)} on the permuted ones"
    checks.sort(key=lambda check: check.finished if check.finished >= 0 else float("inf"))
    return tuple(checks), note


# ------------------------------------------------------------------------------------ blaming


def find_culprit(checks: tuple[SubmoduleCheck, ...], tolerance: float | None = None) -> Culprit | None:
    """The first event, in the order they happened, whose tensors match no reading; ``None`` if none."""
    events = sorted(
        [(check.started, "start", check) for check in checks]
        + [(check.finished, "end", check) for check in checks if check.finished >= 0],
        key=lambda event: event[0],
    )
    previous: tuple[str, SubmoduleCheck] | None = None
    kept = 0
    passing = [check for check in checks if check.passed(tolerance)]
    for _, kind, check in events:
        culprit = None if _repaired(check, passing) else _culprit_at(kind, check, previous, checks, kept, tolerance)
        if culprit is not None:
            return culprit
        kept += kind == "end"
        previous = (kind, check)
    return None


def _culprit_at(
    kind: str,
    check: SubmoduleCheck,
    previous: tuple[str, SubmoduleCheck] | None,
    checks: tuple[SubmoduleCheck, ...],
    kept: int,
    tolerance: float | None,
) -> Culprit | None:
    """The culprit an event shows: a call whose inputs come in broken (the code before it), or one
    whose output breaks while its inputs were fine."""
    if kind == "start" and not check.inputs_passed(tolerance):
        code, location = _code_before(check, previous)
        return Culprit("code", check.parent or "", check, code, location, kept)
    if kind == "end" and not check.passed(tolerance):
        if previous is not None and previous[0] == "end" and previous[1].parent == check.name:
            code, location = _code_after(previous[1])  # its own submodules kept it: its code did not
            return Culprit("submodule", check.name, check, code, location, kept, after_submodules=True)
        code, location = "", ""
        if check.forward is not None and _called_nothing(check, checks):
            code = f"`{check.forward.function}`"
            location = _lines(check.forward, check.forward.first_line, check.forward.last_line)
        return Culprit("submodule", check.name, check, code, location, kept)
    return None


def _repaired(check: SubmoduleCheck, passing: list[SubmoduleCheck]) -> bool:
    """Whether a call runs inside another whose outputs keep the property: what breaks in between is
    that call's own bookkeeping (PyG's ``GCNConv`` appends self-loops after the edges, so its
    per-edge messages are neither unchanged nor permuted, while its output per node is)."""
    return any(other.started < check.started and 0 <= check.finished < other.finished for other in passing)


def _called_nothing(check: SubmoduleCheck, checks: tuple[SubmoduleCheck, ...]) -> bool:
    return not any(other.parent == check.name and check.started < other.started < check.finished for other in checks)


def describe_trailing_code(checks: tuple[SubmoduleCheck, ...]) -> tuple[str, str]:
    """The checked function's code after its last submodule call: ``(code, location)``."""
    top_level = [check for check in checks if check.parent is None and check.finished >= 0]
    if not top_level:
        return "", ""
    return _code_after(max(top_level, key=lambda check: check.finished))


def _code_before(check: SubmoduleCheck, previous: tuple[str, SubmoduleCheck] | None) -> tuple[str, str]:
    site = check.site
    earlier = previous[1] if previous is not None and previous[0] == "end" else None
    if site is None:
        where = f"`{check.parent}`'s forward" if check.parent else "the checked function"
        return (
            f"the code in {where} between {earlier.label()} and {check.label()}"
            if earlier
            else f"the code in {where} before {check.label()}"
        ), ""
    if earlier is None:
        return f"the code in `{site.function}` before {check.label()}", _lines(site, site.first_line, site.line)
    if earlier.site is not None and (earlier.site.filename, earlier.site.function) != (site.filename, site.function):
        return (
            f"the code between {earlier.label()}, called in `{earlier.site.function}` "
            f"({earlier.site.path}, line {earlier.site.line}), and {check.label()}, called in `{site.function}`",
            _lines(site, site.line, site.line),
        )
    start = earlier.site.line if earlier.site is not None else site.first_line
    return f"the code in `{site.function}` between {earlier.label()} and {check.label()}", _lines(
        site, start, site.line
    )


def _code_after(last: SubmoduleCheck) -> tuple[str, str]:
    site = last.site
    if site is None:
        return f"the code after {last.label()}", ""
    return f"the code in `{site.function}` after {last.label()}", _lines(site, site.line, site.last_line)


def _lines(site: CallSite, first: int, last: int) -> str:
    first, last = min(first, last), max(first, last)
    return f"{site.path}, line {first}" if first == last else f"{site.path}, lines {first}-{last}"
