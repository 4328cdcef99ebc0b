"""Attention weights nobody reads: the call-site analysis behind ``skip_unread_weights``, and the audit.

``nn.MultiheadAttention`` computes weights by default (``need_weights=True``), and much code throws
them away at once: ``attn(q, k, v)[0]`` or ``out, _ = attn(q, k, v)``. Computing them forces the
explicit path (softmax probabilities of shape ``(B, H, L, S)`` materialised, and kept for backward
when training). :func:`weights_discarded` proves, from the caller's bytecode, that a call's weights
cannot be read, so that a module built with ``skip_unread_weights=True`` may compute exactly what
``need_weights=False`` computes and return ``None`` as the weights (with attention dropout on CPU,
where that is no cheaper, it computes the weights unaveraged and drops them: :func:`call_without_weights`).

What counts as proof (anything else, and any doubt, means "compute the weights as asked"):

* The module was called the ordinary way, ``module(...)``: the frames above ``forward`` are torch's
  ``Module.__call__`` frames (``_call_impl``, its hook-running ``inner``, ``_wrapped_call_impl``),
  for this module, and the caller's current instruction is a plain ``CALL`` whose argument count
  and keyword names are exactly those ``Module.__call__`` received. That last check rules out a C
  function in between (``list(map(attn, qs, ks, vs))[0]``), which shows the caller's ``CALL`` of
  ``list`` as its current instruction. (3.11 emits ``[KW_NAMES k] PRECALL n; CALL n``, 3.12
  ``[KW_NAMES k] CALL n``, 3.13 ``CALL n`` or, with keywords, ``LOAD_CONST k; CALL_KW n``.)
* Right after that ``CALL``, one of two shapes:

  - ``attn(...)[0]``: ``LOAD_CONST 0`` (an ``int``) and ``BINARY_SUBSCR``; the tuple is consumed there;
  - ``out, _ = attn(...)`` (any second name): ``UNPACK_SEQUENCE 2``, one store instruction for the
    first target, then ``STORE_FAST`` of a plain local that no instruction anywhere in the code
    object loads (loops, earlier lines and ``del`` included), that no closure captures (it would be
    a cell, stored with ``STORE_DEREF``), in a function that names none of ``locals``, ``vars``,
    ``eval``, ``exec``, ``breakpoint``, ``_getframe``, ``currentframe`` or ``f_locals``.
* Nothing else observes the result: no forward or backward hooks on the module, no global ones
  (other than the audit's own).
* Nothing is being traced or transformed: not ``torch.compile``/dynamo, ``torch.export``, jit
  tracing or scripting, a functorch transform (``vmap``, ``grad``, ...), a ``TorchDispatchMode``
  (``make_fx``, fake tensors), or FX proxies. A trace records one graph for every later call,
  whatever its caller does with the weights.
* The Python minor version is one whose bytecode these rules were tested on (``_TESTED_VERSIONS``).
  On any other, the weights are computed as asked, and the first call that would have been
  analysed warns once, naming the version: a silent no-op would look like a working option.

3.13 fuses two local loads or stores into one instruction (``STORE_FAST_STORE_FAST``, ...): the
analysis splits each back into the two plain instructions first, so the rules above read the same
on every version, and a read hidden in the second half of a pair still counts as a read.

A wrong verdict can only ever turn weights into ``None``, never change a number: the output is what
``need_weights=False`` computes, which equals the weighted call's output (the two paths compute the
same function, to rounding; with dropout in training each draws its mask as stock's path of the
same name does). The residual risk is a C-level callable that forwards its exact arguments to
the module and then keeps the result for someone else (``functools.lru_cache`` around a module):
whoever reads those weights later gets ``None`` and fails at once.

Cost: the verdict for a call site is cached per ``(code object, instruction offset)``, so after the
first call it is a few frame reads and one dict look-up.

The audit (:func:`unread_weights_report`) runs the same analysis from a global forward hook on every
attention module, stock or slim, and counts the calls that computed weights their caller discarded.
"""

from __future__ import annotations

import dis
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import TextIO

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

from ._features import UNREAD
from ._stock_checks import AttentionCall
from ._torch_compat import STOCK_MHA, is_symbolic_call

__all__ = ["UnreadWeightsReport", "UnreadWeightsSite", "unread_weights_report", "weights_discarded"]

# Python minor versions whose bytecode the recognised shapes were tested on: those .ci/run runs
# tests/test_unread_weights.py on. CPython changes these opcodes between minor versions (3.12 drops
# PRECALL, 3.13 moves keyword names onto the stack and fuses loads and stores, 3.14 turns
# BINARY_SUBSCR into BINARY_OP and 0 into LOAD_SMALL_INT), so an untested version never skips.
_TESTED_VERSIONS = frozenset({(3, 11), (3, 12), (3, 13)})
# 3.11 calls through ``PRECALL n; CALL n``; later versions through ``CALL n`` alone.
_PRECALL_BEFORE_CALL = "PRECALL" in dis.opmap
# 3.13's superinstructions, each as the two plain instructions it runs (its argval: their two names).
_FUSED = {
    "LOAD_FAST_LOAD_FAST": ("LOAD_FAST", "LOAD_FAST"),
    "STORE_FAST_LOAD_FAST": ("STORE_FAST", "LOAD_FAST"),
    "STORE_FAST_STORE_FAST": ("STORE_FAST", "STORE_FAST"),
}

# Names through which a function can read its own locals without a LOAD_FAST. (A function it calls
# could still walk up to its frame, as a debugger does: that reader would get None, loudly.)
_INTROSPECTION_NAMES = frozenset(
    {"locals", "vars", "eval", "exec", "breakpoint", "_getframe", "currentframe", "f_locals"}
)
# First target of ``out, _ = ...``: one instruction that consumes the first element.
_SINGLE_STORES = frozenset({"STORE_FAST", "STORE_DEREF", "STORE_GLOBAL", "STORE_NAME", "POP_TOP"})
# Instructions that may touch a local of the second target without reading it.
_HARMLESS_LOCAL_USES = frozenset({"STORE_FAST", "DELETE_FAST"})
_PADDING = frozenset({"EXTENDED_ARG", "NOP"})

_CACHE_LIMIT = 4096  # call sites; code objects built at run time (exec) would otherwise pile up


@dataclass(frozen=True)
class _Site:
    """A call site whose weights are discarded, with the arguments its ``CALL`` passes."""

    positional: int
    keywords: tuple[str, ...]


# Module._call_impl -> the codes of the frames between Module.__call__ and forward.
_BETWEEN_CODES: dict[object, frozenset[CodeType]] = {}
# (code object, offset of the CALL) -> _Site, or None when the weights may be read.
_VERDICTS: dict[tuple[CodeType, int], _Site | None] = {}
# The untested Python versions already warned about (one warning per process).
_WARNED_VERSIONS: set[tuple[int, int]] = set()


def call_without_weights(call: AttentionCall, drops_attention: bool) -> tuple[AttentionCall, bool]:
    """What a call whose weights are discarded computes, and whether its weights are then dropped.

    ``need_weights=False``'s computation, except with attention dropout on CPU: SDPA's CPU kernels
    take no dropout, and its math fallback keeps the same ``(B, H, L, S)`` probabilities for backward
    as the weights path and runs slower (DETR's training step: 0.93x stock, at the same peak). There
    the weights path runs, without the average over heads, and its weights are dropped afterwards;
    it draws its dropout mask as stock's default call does.
    """
    if drops_attention and call.query.device.type == "cpu":
        return call._replace(average_attn_weights=False), True
    return call._replace(need_weights=False), False


def weights_discarded(module: nn.Module, query: object) -> bool:
    """Whether the caller of ``module``'s current ``forward`` provably discards the weights.

    Called from :func:`slim_mha.paths.choose_path`, which ``forward`` calls: ``forward``'s frame is
    the second below this function's. Called from anywhere else, no caller is found, and the answer
    is no: the weights are computed.
    """
    if is_symbolic_call(query):
        return False
    return _discarding_caller(sys._getframe(2), module) is not None


# ------------------------------------------------------------------------------- the proof


def _torch_call_frames() -> tuple[CodeType, frozenset[CodeType]]:
    """``Module._wrapped_call_impl``'s code, and the codes that run between it and ``forward``."""
    call_impl = nn.Module._call_impl  # looked up per call: a library may have replaced either
    codes = _BETWEEN_CODES.get(call_impl)
    if codes is None:
        # torch >= 2.5 runs hooks and forward in a nested ``inner``; 2.4 runs them in ``_call_impl``.
        code = call_impl.__code__
        inner = {c for c in code.co_consts if isinstance(c, CodeType) and c.co_name == "inner"}
        codes = _BETWEEN_CODES[call_impl] = frozenset({code, *inner})
    return nn.Module._wrapped_call_impl.__code__, codes


def _discarding_caller(frame: FrameType, module: nn.Module) -> FrameType | None:
    """The caller's frame if it discards the weights ``module`` returns; ``frame`` is forward's or a hook's."""
    if not _bytecode_tested() or _outputs_observed(module):
        return None
    wrapped_code, inner_codes = _torch_call_frames()
    below = frame.f_back  # not torch's frames when forward was called directly, or by a subclass
    while below is not None and below.f_code in inner_codes:
        below = below.f_back
    if below is None or below.f_code is not wrapped_code:
        return None
    caller = below.f_back
    if caller is None:
        return None
    key = (caller.f_code, caller.f_lasti)
    try:
        site = _VERDICTS[key]
    except KeyError:
        site = _analyse_call_site(caller.f_code, caller.f_lasti)
        if len(_VERDICTS) >= _CACHE_LIMIT:
            _VERDICTS.clear()
        _VERDICTS[key] = site
    if site is None:
        return None
    received = below.f_locals  # Module.__call__(self, *args, **kwargs) as the caller invoked it
    args, kwargs = received.get("args"), received.get("kwargs")
    if received.get("self") is not module or not isinstance(args, tuple) or not isinstance(kwargs, dict):
        return None
    if len(args) != site.positional or tuple(kwargs) != site.keywords:  # a C callable in between
        return None
    return caller


def _bytecode_tested() -> bool:
    """Whether this Python's bytecode is one the analysis was tested on; the first time it is not, warns."""
    version = sys.version_info[:2]
    if version in _TESTED_VERSIONS:
        return True
    if version not in _WARNED_VERSIONS:
        _WARNED_VERSIONS.add(version)
        tested = ", ".join(f"{major}.{minor}" for major, minor in sorted(_TESTED_VERSIONS))
        warnings.warn(
            f"skip_unread_weights has no effect on Python {version[0]}.{version[1]}: slim_mha reads a call "
            f"site's bytecode only on the Python versions it was tested on ({tested}), so every call "
            "computes its attention weights as asked (and unread_weights_report counts none); where "
            "the weights are not used, pass need_weights=False",
            RuntimeWarning,
            stacklevel=2,
        )
    return False


def _outputs_observed(module: nn.Module) -> bool:
    """Whether a hook will see the returned tuple (a forward hook reading the weights, for one)."""
    global_forward = _torch_module._global_forward_hooks
    return bool(
        module._forward_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or (global_forward and global_forward.keys() - _AUDIT.hook_ids)
        or _torch_module._global_backward_hooks
        or _torch_module._global_backward_pre_hooks
    )


def _analyse_call_site(code: CodeType, lasti: int) -> _Site | None:
    """Read the caller's bytecode around the instruction at ``lasti`` (the call in progress)."""
    instructions = _plain_instructions(code)
    index = _instruction_at(instructions, lasti)
    if index is None:
        return None
    call = instructions[index]
    keywords = _keyword_names(code, instructions, index)
    if keywords is None:
        return None
    after = _skip_padding(instructions, index + 1)
    if call.arg is None:  # a call instruction always counts its arguments
        return None
    if _subscripts_zero(instructions, after) or _unpacks_into_unread_second(code, instructions, after):
        return _Site(positional=call.arg - len(keywords), keywords=keywords)
    return None


def _plain_instructions(code: CodeType) -> list[dis.Instruction]:
    """``code``'s instructions, each superinstruction split into the two it fuses (both at its offset)."""
    instructions = []
    for instruction in dis.get_instructions(code):
        halves = _FUSED.get(instruction.opname)
        if halves is None:
            instructions.append(instruction)
            continue
        for opname, name in zip(halves, instruction.argval, strict=True):
            instructions.append(instruction._replace(opname=opname, opcode=dis.opmap[opname], arg=None, argval=name))
    return instructions


def _instruction_at(instructions: list[dis.Instruction], offset: int) -> int | None:
    """Index of the instruction whose bytes (inline caches included) contain ``offset``.

    A call into a Python function reports the offset of the ``CALL``'s last cache entry, a call
    through C (``Module.__call__``) the ``CALL`` itself. (The halves of a split superinstruction
    share an offset; no call is among them.)
    """
    for index, instruction in enumerate(instructions):
        following = instructions[index + 1].offset if index + 1 < len(instructions) else None
        if instruction.offset <= offset and (following is None or offset < following):
            return index
    return None


def _keyword_names(code: CodeType, instructions: list[dis.Instruction], index: int) -> tuple[str, ...] | None:
    """Keyword names of the call at ``index``; None unless it is a plain call with its arguments on the stack.

    3.11: ``[KW_NAMES k] PRECALL n; CALL n``; 3.12: ``[KW_NAMES k] CALL n``; 3.13: ``CALL n``, or
    ``LOAD_CONST k; CALL_KW n``. (``CALL_FUNCTION_EX``, the ``*args``/``**kwargs`` call, is none of them.)
    """
    call = instructions[index]
    before = index - 1
    if call.opname == "CALL_KW":
        if before < 0 or instructions[before].opname != "LOAD_CONST":
            return None
        names = instructions[before].argval
    elif call.opname == "CALL":
        if _PRECALL_BEFORE_CALL:
            if before < 0 or instructions[before].opname != "PRECALL" or instructions[before].arg != call.arg:
                return None
            before -= 1
        argument = instructions[before].arg if before >= 0 else None
        if argument is None or instructions[before].opname != "KW_NAMES":
            return ()
        names = code.co_consts[argument]
    else:
        return None
    if (
        call.arg is None
        or not isinstance(names, tuple)
        or len(names) > call.arg
        or not all(type(name) is str for name in names)
    ):
        return None
    return names


def _skip_padding(instructions: list[dis.Instruction], index: int) -> int:
    while index < len(instructions) and instructions[index].opname in _PADDING:
        index += 1
    return index


def _subscripts_zero(instructions: list[dis.Instruction], index: int) -> bool:
    """``(...)[0]``: the tuple is consumed by the subscript; only the output survives."""
    if index >= len(instructions):
        return False
    load = instructions[index]
    if load.opname != "LOAD_CONST" or type(load.argval) is not int or load.argval != 0:
        return False
    subscript = _skip_padding(instructions, index + 1)
    return subscript < len(instructions) and instructions[subscript].opname == "BINARY_SUBSCR"


def _unpacks_into_unread_second(code: CodeType, instructions: list[dis.Instruction], index: int) -> bool:
    """``out, name = (...)`` where ``name`` is a plain local that nothing ever reads."""
    if index >= len(instructions):
        return False
    unpack = instructions[index]
    if unpack.opname != "UNPACK_SEQUENCE" or unpack.arg != 2:
        return False
    first = _skip_padding(instructions, index + 1)
    if first >= len(instructions) or instructions[first].opname not in _SINGLE_STORES:
        return False
    second = _skip_padding(instructions, first + 1)
    if second >= len(instructions) or instructions[second].opname != "STORE_FAST":
        return False
    return _never_read(code, instructions, instructions[second].argval)


def _never_read(code: CodeType, instructions: list[dis.Instruction], name: str) -> bool:
    if name in code.co_cellvars or name in code.co_freevars:
        return False
    if _INTROSPECTION_NAMES & set(code.co_names):
        return False
    for instruction in instructions:
        touches_local = instruction.opcode in dis.haslocal or instruction.opcode in dis.hasfree
        if touches_local and instruction.argval == name and instruction.opname not in _HARMLESS_LOCAL_USES:
            return False
    return True


# ---------------------------------------------------------------------------------- the audit


@dataclass(frozen=True)
class UnreadWeightsSite:
    """A call site that computed attention weights its caller discarded."""

    filename: str
    lineno: int
    function: str
    calls: int

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}: {self.calls} call{'s' * (self.calls != 1)}"


class UnreadWeightsReport:
    """Counts, per call site, of attention calls that computed weights the caller discarded."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, int, str]] = Counter()
        self._lock = threading.Lock()

    def _record(self, filename: str, lineno: int, function: str) -> None:
        with self._lock:
            self._counts[(filename, lineno, function)] += 1

    @property
    def sites(self) -> list[UnreadWeightsSite]:
        """The call sites, most calls first."""
        with self._lock:
            counts = list(self._counts.items())
        counts.sort(key=lambda item: (-item[1], item[0]))
        return [UnreadWeightsSite(filename, lineno, function, calls) for (filename, lineno, function), calls in counts]

    def __str__(self) -> str:
        sites = self.sites
        if not sites:
            return "slim_mha: no attention call computed weights that its caller discarded"
        lines = [f"slim_mha: {len(sites)} call site(s) computed attention weights that the caller discarded:"]
        lines += [f"  {site}" for site in sites]
        lines.append("fix: pass need_weights=False at these calls")
        return "\n".join(lines)


class _AuditState:
    """The open reports and the one global forward hook that feeds them. Guarded by ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reports: list[UnreadWeightsReport] = []
        self.handle: RemovableHandle | None = None
        self.hook_ids: frozenset[int] = frozenset()


_AUDIT = _AuditState()


def _audit_hook(module: nn.Module, args: tuple, output: object) -> None:
    # Stock's class is slim's base: stock and slim modules alike (and the patched class).
    if not isinstance(module, STOCK_MHA) or not isinstance(output, tuple) or len(output) != 2 or output[1] is None:
        return
    if is_symbolic_call(output[0]):
        return
    caller = _discarding_caller(sys._getframe(0), module)
    if caller is None:
        return
    site = (caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_qualname)
    for report in list(_AUDIT.reports):
        report._record(*site)


@contextmanager
def unread_weights_report(*, quiet: bool = True, file: TextIO | None = None) -> Iterator[UnreadWeightsReport]:
    """Count the attention calls whose weights were computed and then discarded by their caller.

    Every ``nn.MultiheadAttention`` call in the block (stock, slim or patched) that returned weights
    to a caller that provably throws them away (the same analysis as ``skip_unread_weights``) is
    counted by file, line and function. The report is yours to read or print (``print(report)`` lists
    the sites with the fix: pass ``need_weights=False`` at those calls); with ``quiet=False`` it is
    also printed on exit, to ``file`` (default: ``sys.stderr``). Blocks nest; each counts its own calls.

    Example::

        with slim_mha.unread_weights_report() as report:
            model(images)
        report.sites  # [UnreadWeightsSite(filename='.../detr.py', lineno=271, function=..., calls=6), ...]
    """
    report = UnreadWeightsReport()
    with _AUDIT.lock:
        if _AUDIT.handle is None:
            _AUDIT.handle = torch.nn.modules.module.register_module_forward_hook(_audit_hook)
            _AUDIT.hook_ids = frozenset({_AUDIT.handle.id})
        _AUDIT.reports.append(report)
    try:
        yield report
    finally:
        with _AUDIT.lock:
            _AUDIT.reports.remove(report)
            if not _AUDIT.reports and _AUDIT.handle is not None:
                _AUDIT.handle.remove()
                _AUDIT.handle, _AUDIT.hook_ids = None, frozenset()
        if not quiet:
            print(report, file=file if file is not None else sys.stderr)


# Slim's forward reaches these through slim_mha._features, which imports nothing of this module.
UNREAD.discarded, UNREAD.call_without_weights = weights_discarded, call_without_weights
