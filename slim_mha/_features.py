"""The seam where slim's optional features plug into attention's calls, so the core imports none of them.

* The equivariance check: ``slim_mha.equivariance`` registers its per-call check on :data:`CHECKS`
  when it is imported, and its scopes and the environment variable switch :attr:`Checks.active`. A
  slim ``forward`` reads one flag per call and calls into the check only where it is on.
* Unread weights: ``slim_mha.unread_weights`` registers its functions on :data:`UNREAD` when it is
  imported, which a module built with ``skip_unread_weights=True`` does.

So ``import slim_mha.attention`` loads neither, unless a module is built with ``check_equivariance``
or the process sets ``SLIM_MHA_CHECK_EQUIVARIANCE``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

__all__ = [
    "CHECKS",
    "ENVIRONMENT_VARIABLE",
    "Checks",
    "check_every",
    "load_checks",
    "resolve_options",
    "resolve_skip_option",
    "UNREAD",
]

ENVIRONMENT_VARIABLE = "SLIM_MHA_CHECK_EQUIVARIANCE"


class Checks:
    """Read by every slim ``forward``: is checking on anywhere in the process (a scope or the
    environment variable), and the check to run. ``active`` is a hint only, so that ``forward`` pays
    one attribute read when the mode is off; the check then asks its own context (scopes are per
    thread and per async task)."""

    __slots__ = ("active", "run")

    def __init__(self) -> None:
        self.active = False
        self.run: Callable | None = None  # (module, result, call) -> None, registered by the package

    def check(self, module, result, call) -> None:
        """Check one call: ``module.check_equivariance`` may be set by hand on a module built before
        the package was imported, so the package is loaded here where it was not."""
        if self.run is None:
            load_checks()
        assert self.run is not None  # registered by the import
        self.run(module, result, call)


CHECKS = Checks()


def load_checks() -> None:
    """Import the per-call check, which registers itself on :data:`CHECKS`."""
    importlib.import_module("slim_mha.equivariance._mode")


def wanted_by_environment() -> bool:
    return bool(os.environ.get(ENVIRONMENT_VARIABLE, "").strip())


def resolve_options(check_equivariance: bool | None, every: int) -> tuple[bool | None, int]:
    """Validate the constructor's options; returns them unchanged. A module built to check loads the check."""
    if check_equivariance not in (None, True, False) or not isinstance(check_equivariance, (bool, type(None))):
        raise ValueError(
            f"check_equivariance must be True, False or None (None: follow {ENVIRONMENT_VARIABLE} and "
            f"slim_mha.checking_equivariance()), got {check_equivariance!r}"
        )
    every = check_every(every, "check_equivariance_every")
    if check_equivariance:
        load_checks()
    return check_equivariance, every


def check_every(every, name: str) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{name} must be an int >= 1 (1 checks every call, N every N-th call), got {every!r}")
    return every


def resolve_skip_option(skip_unread_weights: object) -> bool:
    """The constructor's ``skip_unread_weights``, checked; a module built to skip loads the feature."""
    if not isinstance(skip_unread_weights, bool):
        raise ValueError(f"skip_unread_weights must be True or False, got {skip_unread_weights!r}; pass a bool")
    if skip_unread_weights:
        importlib.import_module("slim_mha.unread_weights")
    return skip_unread_weights


class UnreadWeights:
    """Where ``slim_mha.unread_weights`` registers its two functions when it is imported (a module
    built with ``skip_unread_weights=True`` imports it: :func:`resolve_skip_option`). Until then each
    loads it first, for a module whose option was set by hand."""

    __slots__ = ("discarded", "call_without_weights")

    def __init__(self) -> None:
        self.discarded = self._loaded("weights_discarded")
        self.call_without_weights = self._loaded("call_without_weights")

    def _loaded(self, name: str) -> Callable:
        def load_then_call(*args):
            importlib.import_module("slim_mha.unread_weights")
            return getattr(self, name)(*args)

        return load_then_call


UNREAD = UnreadWeights()
