"""Make ``torch.nn.MultiheadAttention`` build slim modules: ``patch``, ``unpatch``, ``patched``, ``is_patched``.

While patched, the name ``MultiheadAttention`` in ``torch.nn``, ``torch.nn.modules``,
``torch.nn.modules.activation``, ``torch.nn.modules.transformer`` and in every other imported module
that bound the stock class under that name (``from torch.nn import MultiheadAttention``) refers to
:class:`PatchedMultiheadAttention`, a :class:`~slim_mha.SlimMultiheadAttention`. So does every module
``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and ``nn.Transformer`` build.

``TransformerEncoderLayer`` is rebound the same way, to :class:`PatchedTransformerEncoderLayer`: stock's
layer hands its inference calls to a fused kernel that never calls the attention module, and slim's
layer decides per call whether that kernel or slim's attention runs
(:func:`slim_mha.encoder_layer.layer_path`). Everything below holds for both names.

What is and is not replaced:

* Only module-level bindings named ``MultiheadAttention`` that hold the stock class. Aliases
  (``StockMHA = nn.MultiheadAttention``) are left alone, so code can keep a deliberate reference to
  stock; so are slim_mha's own modules, which compare against stock on purpose.
* ``unpatch`` puts the stock class back exactly where ``patch`` put ours, and only where ours is
  still bound: a name someone re-bound in the meantime is theirs.

``isinstance`` keeps working in every direction (tested in ``tests/test_patching.py``):

* Slim modules, patched or not, are instances of stock ``nn.MultiheadAttention`` (a subclass), so
  they pass ``isinstance`` against the stock class before, during and after patching, including
  references to it captured before ``patch()``.
* While patched, ``torch.nn.MultiheadAttention`` names :class:`PatchedMultiheadAttention`, whose
  metaclass also accepts stock instances: ``isinstance(stock_built_before_patch,
  torch.nn.MultiheadAttention)`` stays ``True``, and so does ``issubclass``. Only that one class
  widens its checks; subclasses of it, and :class:`~slim_mha.SlimMultiheadAttention` itself, keep
  the ordinary rules.
* Exact-type checks (``type(m) is nn.MultiheadAttention``, dictionaries keyed by type such as the
  ``torch.ao.quantization`` mappings) do see a different class: run :func:`slim_mha.to_stock` before
  handing a model to such code.
* A class that subclasses ``nn.MultiheadAttention`` while patched derives from slim, for good.

Patching is reference counted and guarded by one lock, so it is thread-safe and composes:
``patch()`` holds the patch until ``unpatch()``, each open ``with patched():`` block holds it until
the block exits, and the stock class comes back when nothing holds it. ``patch()`` and
``unpatch()`` are idempotent.

``skip_unread_weights`` (see :class:`~slim_mha.SlimMultiheadAttention`): ``patch()`` and ``patched()``
take it too, as the default for modules built while patched that do not pass it themselves. The
most recent holder that gave a value decides (a ``with patched(skip_unread_weights=False):`` block
inside ``patch(skip_unread_weights=True)`` builds modules without it); holders that gave none leave
it alone; with no value anywhere it is off. Like the patch itself, it is process-wide.
"""

from __future__ import annotations

import abc
import functools
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA
from .attention import SlimMultiheadAttention
from .encoder_layer import SlimTransformerEncoderLayer

__all__ = ["patch", "unpatch", "patched", "is_patched", "PatchedMultiheadAttention", "PatchedTransformerEncoderLayer"]

_OWN_PACKAGE = __name__.partition(".")[0]


class _AcceptsStockInstances(abc.ABCMeta):
    """Metaclass of :class:`PatchedMultiheadAttention`: stock instances and subclasses pass its checks.

    It derives from ``abc.ABCMeta`` so that a user's class may mix the patched classes with
    ``abc.ABC``, as stock's accept (a metaclass of its own beside ``ABCMeta`` would conflict). It
    keeps ``ABCMeta``'s rules (``register``, abstract methods), which stock's subclasses get from
    ``abc.ABC`` alone.

    While patched, ``torch.nn.MultiheadAttention`` *is* the patched class, so without this a stock
    module built before ``patch()`` would fail ``isinstance(m, torch.nn.MultiheadAttention)``. Only
    the installed class widens its checks (tested through ``cls.__dict__``, which subclasses do
    not share), so a user's subclass of it does not claim stock modules.
    """

    def __instancecheck__(cls, instance) -> bool:
        if super().__instancecheck__(instance):
            return True
        stock = cls.__dict__.get("_accepts_stock")
        return stock is not None and isinstance(instance, stock)

    def __subclasscheck__(cls, subclass) -> bool:
        if super().__subclasscheck__(subclass):
            return True
        stock = cls.__dict__.get("_accepts_stock")
        return stock is not None and issubclass(subclass, stock)


class PatchedMultiheadAttention(SlimMultiheadAttention, metaclass=_AcceptsStockInstances):
    """The class ``patch()`` installs as ``torch.nn.MultiheadAttention``: slim, and ``isinstance``-wide.

    Behaves exactly as :class:`~slim_mha.SlimMultiheadAttention` (same constructor, state dict and
    ``forward``); its only difference is that stock ``nn.MultiheadAttention`` instances and
    subclasses pass ``isinstance``/``issubclass`` against it. Instances pickle by reference to this
    class, so loading them needs slim_mha importable, not patched.
    """

    _accepts_stock = STOCK_MHA
    _scripted_as = STOCK_MHA

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("skip_unread_weights", _skip_unread_weights_while_patched())
        super().__init__(*args, **kwargs)


# help() and inspect.signature show slim's constructor, whose arguments this one passes on.
functools.update_wrapper(PatchedMultiheadAttention.__init__, SlimMultiheadAttention.__init__)


class PatchedTransformerEncoderLayer(SlimTransformerEncoderLayer, metaclass=_AcceptsStockInstances):
    """The class ``patch()`` installs as ``torch.nn.TransformerEncoderLayer``: slim's layer, ``isinstance``-wide.

    ``nn.TransformerEncoder`` checks its layer with ``isinstance(layer, torch.nn.TransformerEncoderLayer)``
    before it lets the layers take nested tensors: a stock layer passes it while patched too.
    """

    _accepts_stock = STOCK_ENCODER_LAYER
    _scripted_as = STOCK_ENCODER_LAYER


# Each name patching rebinds: torch's class, ours, and the modules that must hold torch's class for
# the patch to mean anything (the scan of sys.modules finds the rest).
_BINDINGS = {
    "MultiheadAttention": (
        STOCK_MHA,
        PatchedMultiheadAttention,
        ("torch.nn", "torch.nn.modules", "torch.nn.modules.activation", "torch.nn.modules.transformer"),
    ),
    "TransformerEncoderLayer": (
        STOCK_ENCODER_LAYER,
        PatchedTransformerEncoderLayer,
        ("torch.nn", "torch.nn.modules", "torch.nn.modules.transformer"),
    ),
}


class _PatchState:
    """Who holds the patch, and every binding it replaced. Guarded by ``_LOCK``."""

    def __init__(self) -> None:
        self.held_by_patch_call = False
        self.open_blocks = 0
        self.replaced: list[tuple[dict, str]] = []  # (module namespace, name) now bound to ours
        self.skip_requests: list[tuple[object, bool]] = []  # (holder, skip_unread_weights), oldest first

    def request_skip(self, holder: object, skip_unread_weights: bool | None) -> None:
        """Record a holder's ``skip_unread_weights`` as the most recent (``None``: no preference)."""
        if skip_unread_weights is not None:
            self.drop_skip(holder)
            self.skip_requests.append((holder, skip_unread_weights))

    def drop_skip(self, holder: object) -> None:
        self.skip_requests = [request for request in self.skip_requests if request[0] is not holder]

    @property
    def wanted(self) -> bool:
        return self.held_by_patch_call or self.open_blocks > 0

    @property
    def installed(self) -> bool:
        return bool(self.replaced)


_LOCK = threading.RLock()
_STATE = _PatchState()
_PATCH_CALL = object()  # the holder that patch() and unpatch() stand for


def _skip_unread_weights_while_patched() -> bool:
    with _LOCK:
        return _STATE.skip_requests[-1][1] if _STATE.skip_requests else False


def _check_skip_option(skip_unread_weights: object) -> None:
    if skip_unread_weights is not None and not isinstance(skip_unread_weights, bool):
        raise ValueError(
            f"skip_unread_weights must be True, False or None (no preference), got {skip_unread_weights!r}"
        )


def patch(*, skip_unread_weights: bool | None = None) -> None:
    """Make ``torch.nn.MultiheadAttention`` (and every binding of it by that name) build slim modules.

    Idempotent: a second call changes nothing but a ``skip_unread_weights`` it gives. Holds the
    patch until :func:`unpatch`. ``skip_unread_weights`` is the default for modules built while
    patched (``None``: no preference; see the module docstring).

    Raises:
        RuntimeError: if ``torch.nn.MultiheadAttention`` (or one of torch's other required names)
            is neither the stock class nor ours, i.e. another library has patched it.
    """
    _check_skip_option(skip_unread_weights)
    with _LOCK:
        _STATE.held_by_patch_call = True
        try:
            _apply(_STATE)
        except BaseException:
            _STATE.held_by_patch_call = False
            raise
        _STATE.request_skip(_PATCH_CALL, skip_unread_weights)


def unpatch() -> None:
    """Release the hold :func:`patch` took; restore the stock class once no ``patched()`` block is open.

    Idempotent. Restores exactly the bindings that patching replaced and that still hold our class.
    """
    with _LOCK:
        _STATE.held_by_patch_call = False
        _STATE.drop_skip(_PATCH_CALL)
        _apply(_STATE)


@contextmanager
def patched(*, skip_unread_weights: bool | None = None) -> Iterator[None]:
    """Patch for the duration of a ``with`` block (or a decorated function); blocks nest and compose.

    ``skip_unread_weights`` is the default for modules built in the block (``None``: no preference).

    Example::

        with slim_mha.patched():
            model = torch.nn.TransformerEncoder(layer, num_layers=6)  # slim attention inside
        # the stock class is back here, unless patch() or another open block still holds it
    """
    _check_skip_option(skip_unread_weights)
    block = object()
    with _LOCK:
        _STATE.open_blocks += 1
        try:
            _apply(_STATE)
        except BaseException:
            _STATE.open_blocks -= 1
            raise
        _STATE.request_skip(block, skip_unread_weights)
    try:
        yield
    finally:
        with _LOCK:
            _STATE.open_blocks -= 1
            _STATE.drop_skip(block)
            _apply(_STATE)


def is_patched() -> bool:
    """Whether ``torch.nn.MultiheadAttention`` currently builds slim modules because of this package."""
    with _LOCK:
        return _STATE.installed


def _apply(state: _PatchState) -> None:
    """Install or restore so that the bindings match who holds the patch."""
    if state.wanted and not state.installed:
        state.replaced = _install()
    elif not state.wanted and state.installed:
        _restore(state.replaced)
        state.replaced = []


def _install() -> list[tuple[dict, str]]:
    _check_torch_holds_stock()
    replaced = []
    for namespace in _module_namespaces():
        for name, (stock, ours, _) in _BINDINGS.items():
            if namespace.get(name) is stock:
                namespace[name] = ours
                replaced.append((namespace, name))
    return replaced


def _restore(replaced: list[tuple[dict, str]]) -> None:
    for namespace, name in replaced:
        stock, ours, _ = _BINDINGS[name]
        if namespace.get(name) is ours:
            namespace[name] = stock


def _check_torch_holds_stock() -> None:
    # Checked before anything is replaced, so a refusal leaves every binding as it was.
    for name, (stock, _, required) in _BINDINGS.items():
        for module_name in required:
            module = sys.modules.get(module_name)
            bound = getattr(module, name, None) if module is not None else None
            if bound is not stock:
                raise RuntimeError(
                    f"slim_mha.patch(): {module_name}.{name} is {bound!r}, not torch's stock class; another "
                    "library has patched it. Undo that patch first, or use slim_mha.convert(model) instead "
                    "of patching"
                )


def _module_namespaces() -> Iterator[dict]:
    """The ``__dict__`` of every imported module except our own, read defensively.

    ``sys.modules`` is snapshotted first (imports in other threads may grow it) and may hold lazy
    proxies that import, or raise, when their attributes are touched: those are skipped.
    """
    for module_name, module in list(sys.modules.items()):
        if module_name == _OWN_PACKAGE or module_name.startswith(_OWN_PACKAGE + "."):
            continue
        try:
            namespace = object.__getattribute__(module, "__dict__")
        except Exception:  # not a module, or a proxy without a plain namespace
            continue
        if isinstance(namespace, dict):
            yield namespace
