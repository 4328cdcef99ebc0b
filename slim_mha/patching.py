"""Make torch's ``nn.MultiheadAttention`` build slim modules: ``patch``, ``unpatch``, ``patched``, ``is_patched``.

**By construction, not by names.** While patched, constructing torch's own class with arguments
returns a :class:`PatchedMultiheadAttention`, a :class:`~slim_mha.SlimMultiheadAttention`: through
``torch.nn.MultiheadAttention``, an alias bound before ``patch()``, a name imported inside a
``patched()`` block, and every module ``nn.TransformerDecoderLayer`` and ``nn.Transformer`` build.
``nn.TransformerEncoderLayer`` builds :class:`PatchedTransformerEncoderLayer` the same way: stock's
layer hands its inference calls to a fused kernel that never calls the attention module, and slim's
layer decides per call whether that kernel or slim's attention runs
(:func:`slim_mha.encoder_layer.layer_path`).

Every name stays bound to torch's class, so nothing else notices the patch:

* ``isinstance`` holds both ways with no metaclass: the patched classes subclass stock's, and
  ``torch.nn.MultiheadAttention`` is stock's class before, during and after patching.
* Base-class calls by name (``nn.MultiheadAttention.forward(self, ...)``) reach stock's methods.
* A class that subclasses ``nn.MultiheadAttention`` is the user's, with stock's base, whenever it is
  defined: it builds what it builds unpatched (a metaclass of its own combines as with stock's).
* Stock modules pickle as they do unpatched. A patched module pickles under stock's name, with
  stock's state (slim's options left out): the file loads as stock's class where slim_mha is absent
  or not patched (``torch.load(weights_only=True)`` with stock's classes allow-listed too), and as
  the patched class in a patched process. ``copy`` and ``deepcopy`` keep the patched class
  (``nn.TransformerEncoder`` clones its layer so). A folded value bias, which stock cannot
  represent, refuses to pickle. :class:`~slim_mha.SlimMultiheadAttention` imported directly
  pickles under its own name.
* Exact-type checks (``type(m) is nn.MultiheadAttention``) do see another class: run
  :func:`slim_mha.to_stock` before handing a model to such code.

How: the first patch gives each stock class a ``__new__`` that returns the patched class's instance
when that exact class is constructed with arguments while the patch is held, and ``object``'s
otherwise; Python then runs the patched class's ``__init__``. Copy, deepcopy and unpickling call
``__new__`` without arguments, so they keep their class. The ``__new__`` stays installed after
``unpatch()``, gated on the patch (on CPython 3.11, deleting it left a slot that passed the
constructor's arguments on to ``object.__new__``). Another library's ``__new__`` on a stock class, or
another class bound to torch's names, refuses the patch.

Patching is reference counted and guarded by one lock, so it is thread-safe and composes:
``patch()`` holds the patch until ``unpatch()``, each open ``with patched():`` block holds it until
the block exits, and stock's classes build stock modules again when nothing holds it. ``patch()``
and ``unpatch()`` are idempotent.

``skip_unread_weights`` (see :class:`~slim_mha.SlimMultiheadAttention`): ``patch()`` and ``patched()``
take it too, as the default for modules built while patched that do not pass it themselves. The
most recent holder that gave a value decides (a ``with patched(skip_unread_weights=False):`` block
inside ``patch(skip_unread_weights=True)`` builds modules without it); holders that gave none leave
it alone; with no value anywhere it is off. Like the patch itself, it is process-wide.
"""

from __future__ import annotations

import copy
import functools
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

from torch import nn

from ._swap import SLIM_ATTRIBUTES, left_stock, refuse_folded_value_bias, script_on_shadows
from ._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA
from .attention import SlimMultiheadAttention
from .encoder_layer import SlimTransformerEncoderLayer

__all__ = ["patch", "unpatch", "patched", "is_patched", "PatchedMultiheadAttention", "PatchedTransformerEncoderLayer"]


class _StockNamed:
    """The one owner of a patched class's copy and pickle hooks:

    ====================  ==========================  ==================================================
    hook                  called by                   does
    ====================  ==========================  ==================================================
    ``__reduce_ex__``     pickle, ``torch.save``      stock's class called by name on the meta device
                                                      (no memory, no random draw), then stock's state
                                                      (slim's options left out; a folded value bias
                                                      refused)
    ``__copy__``          ``copy.copy``               the same class, the state shared
    ``__deepcopy__``      ``copy.deepcopy``           the same class, the state deep-copied
                          (``nn.TransformerEncoder``
                          clones so)
    ====================  ==========================  ==================================================

    Why a call and not ``NEWOBJ``: pickle writes ``NEWOBJ`` only for an object's own class. A call
    of stock's class with arguments loads as stock where slim_mha is absent or not patched (also
    under ``torch.load(weights_only=True)`` with stock's classes allow-listed), and goes through the
    redirect in a patched process, which builds slim. Only the patched classes themselves reduce
    under stock's name; a subclass of them pickles as its own class. The state is
    ``__getstate__``'s, so a module that refuses to pickle (a parametrized one) still refuses.
    """

    _scripted_as: type

    def __reduce_ex__(self, protocol):
        if type(self) not in _PATCHED_CLASSES:
            return super().__reduce_ex__(protocol)
        module = cast(nn.Module, self)
        refuse_folded_value_bias(module, "(this module)", "pickle")
        state = {name: value for name, value in module.__getstate__().items() if name not in SLIM_ATTRIBUTES}
        return self._scripted_as, self._stock_arguments(), state

    def _stock_arguments(self) -> tuple:
        """Stock's constructor's positional arguments, enough to build a stand-in on the meta device
        that the pickled state then replaces whole (``device`` is the tenth in both classes)."""
        raise NotImplementedError

    def __copy__(self):
        copied = cast(nn.Module, object.__new__(type(self)))
        copied.__setstate__(dict(self.__dict__))
        return copied

    def __deepcopy__(self, memo):
        copied = cast(nn.Module, object.__new__(type(self)))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied


class PatchedMultiheadAttention(_StockNamed, SlimMultiheadAttention):
    """What torch's ``nn.MultiheadAttention(...)`` builds while patched: slim, pickled under stock's name.

    Behaves exactly as :class:`~slim_mha.SlimMultiheadAttention` (same constructor, state dict and
    ``forward``); it takes the patch's ``skip_unread_weights`` default, and pickles as stock's class.
    """

    _scripted_as = STOCK_MHA

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("skip_unread_weights", _skip_unread_weights_while_patched())
        super().__init__(*args, **kwargs)

    def _stock_arguments(self) -> tuple:
        # embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device
        return self.embed_dim, self.num_heads, 0.0, True, False, False, None, None, False, "meta"


# help() and inspect.signature show slim's constructor, whose arguments this one passes on.
functools.update_wrapper(PatchedMultiheadAttention.__init__, SlimMultiheadAttention.__init__)


class PatchedTransformerEncoderLayer(_StockNamed, SlimTransformerEncoderLayer):
    """What torch's ``nn.TransformerEncoderLayer(...)`` builds while patched: slim's layer, pickled
    under stock's name."""

    _scripted_as = STOCK_ENCODER_LAYER

    def _stock_arguments(self) -> tuple:
        # d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first, bias, device
        return self.self_attn.embed_dim, self.self_attn.num_heads, 2048, 0.1, "relu", 1e-5, False, False, True, "meta"


# Stock's class -> what constructing it builds while patched.
_REDIRECTS = {STOCK_MHA: PatchedMultiheadAttention, STOCK_ENCODER_LAYER: PatchedTransformerEncoderLayer}
_PATCHED_CLASSES = frozenset(_REDIRECTS.values())
# The names that must hold torch's classes for a patch of them to mean anything.
_REQUIRED_NAMES = {
    STOCK_MHA: ("torch.nn", "torch.nn.modules", "torch.nn.modules.activation", "torch.nn.modules.transformer"),
    STOCK_ENCODER_LAYER: ("torch.nn", "torch.nn.modules", "torch.nn.modules.transformer"),
}


class _PatchState:
    """Who holds the patch, and every binding it replaced. Guarded by ``_LOCK``."""

    def __init__(self) -> None:
        self.held_by_patch_call = False
        self.open_blocks = 0
        self.active = False  # read by the redirect without the lock: one attribute read
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
        return self.active


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
    """Switch the redirect on or off so that it matches who holds the patch."""
    if state.wanted and not state.active:
        _check_torch_holds_stock()
        script_on_shadows()
        for stock, ours in _REDIRECTS.items():
            _install_redirect(stock, ours)
        state.active = True
    elif not state.wanted and state.active:
        state.active = False


def _install_redirect(stock: type, ours: type) -> None:
    """Give ``stock`` the ``__new__`` that builds ``ours`` while patched, once; it stays installed."""
    if _redirect_of(stock) is ours:
        return

    def __new__(cls, *args, **kwargs):
        if (args or kwargs) and _STATE.active:
            if cls is stock:
                return object.__new__(ours)
            _warn_once_left_stock(cls, stock)
        return object.__new__(cls)

    __new__._slim_mha_builds = ours  # type: ignore[attr-defined]
    stock.__new__ = staticmethod(__new__)  # type: ignore[method-assign,assignment]


def _redirect_of(stock: type) -> type | None:
    """The patched class ``stock``'s installed ``__new__`` builds, if that ``__new__`` is ours."""
    current = stock.__dict__.get("__new__")
    return getattr(getattr(current, "__func__", None), "_slim_mha_builds", None)


_WARNED_SUBCLASSES: set[type] = set()


def _warn_once_left_stock(cls: type, stock: type) -> None:
    """A subclass of torch's class of the user's own, built while patched, stays what it is: say so
    once per class, since the patch changes nothing for it."""
    if cls in _WARNED_SUBCLASSES or not left_stock(cls):
        return
    _WARNED_SUBCLASSES.add(cls)
    warnings.warn(
        f"slim_mha.patched(): {cls.__qualname__} subclasses torch's {stock.__name__} and is built as it is: the "
        "patch makes torch's own class build slim, not subclasses, which may override what slim replaces; "
        f"derive it from slim_mha.SlimMultiheadAttention (or SlimTransformerEncoderLayer) to make it slim",
        UserWarning,
        stacklevel=3,
    )


def _check_torch_holds_stock() -> None:
    # Checked before anything is installed, so a refusal leaves torch as it was.
    for stock, module_names in _REQUIRED_NAMES.items():
        current = stock.__dict__.get("__new__")
        if current is not None and _redirect_of(stock) is None:
            raise RuntimeError(
                f"slim_mha.patch(): torch's {stock.__name__} has a __new__ of another library's ({current!r}); "
                "undo that patch first, or use slim_mha.convert(model) instead of patching"
            )
        for module_name in module_names:
            module = sys.modules.get(module_name)
            bound = getattr(module, stock.__name__, None) if module is not None else None
            if bound is not stock:
                raise RuntimeError(
                    f"slim_mha.patch(): {module_name}.{stock.__name__} is {bound!r}, not torch's stock class; "
                    "another library has patched it. Undo that patch first, or use slim_mha.convert(model) "
                    "instead of patching"
                )
