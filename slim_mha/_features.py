"""The seam where slim's optional features plug into attention's calls, so the core imports none of them.

A leaf: it imports nothing of slim_mha when it is imported, and the features import it to register;
:func:`load_feature` imports a feature by name where one is first wanted.

* The equivariance check: ``slim_mha.equivariance`` sets :attr:`Checks.run` on :data:`CHECKS` when it
  is imported, and its scopes and the environment variable switch :attr:`Checks.active`. A slim
  ``forward`` reads one flag per call and calls into the check only where it is on.
* Unread weights: ``slim_mha.unread_weights`` sets its two functions on :data:`UNREAD` when it is
  imported.
* Inspection: :data:`INSPECTION` holds the blocks that ``slim_mha.explain`` and
  ``slim_mha.recording_attention`` open, which every call reads (empty: nothing to note or record),
  and the three functions a call makes where one is open, which ``slim_mha.inspection`` sets when it
  is imported (as it must be, to open one).

``slim_mha.attention`` imports a feature where it is wanted (a module built with
``check_equivariance`` or ``skip_unread_weights``, the environment variable, an option set by hand),
so ``import slim_mha.attention`` alone loads neither.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

__all__ = [
    "CHECKS",
    "ENVIRONMENT_VARIABLE",
    "INSPECTION",
    "Inspection",
    "UNREAD",
    "Checks",
    "UnreadWeights",
    "check_every",
    "checks_wanted_by_environment",
    "load_feature",
    "resolve_options",
    "resolve_skip_option",
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
        self.run: Callable | None = None  # (module, result, call) -> None, set by slim_mha.equivariance


class UnreadWeights:
    """``slim_mha.unread_weights``'s ``weights_discarded`` and ``call_without_weights``, once imported."""

    __slots__ = ("discarded", "call_without_weights")

    def __init__(self) -> None:
        self.discarded: Callable | None = None
        self.call_without_weights: Callable | None = None


class Inspection:
    """``slim_mha.inspection``'s open blocks, innermost last, which every slim call reads, and its
    ``note``, ``watched`` and ``record_call``, set when it is imported. The lists are inspection's own
    registries, changed in place under its lock: a reader needs no lock (a list's truth is one check)."""

    __slots__ = ("explaining", "recording", "note", "watched", "record_call")

    def __init__(self) -> None:
        self.explaining: list = []  # open explain() reports
        self.recording: list = []  # open recording_attention() blocks
        self.note: Callable | None = None
        self.watched: Callable | None = None
        self.record_call: Callable | None = None


CHECKS = Checks()
UNREAD = UnreadWeights()
INSPECTION = Inspection()

# The optional features, each imported where first wanted; each registers here when it is imported.
_FEATURES = {"check": "slim_mha.equivariance._mode", "unread weights": "slim_mha.unread_weights"}


def load_feature(name: str) -> None:
    """Import the feature ``name`` (``"check"`` or ``"unread weights"``), which registers here."""
    importlib.import_module(_FEATURES[name])


def checks_wanted_by_environment() -> bool:
    return bool(os.environ.get(ENVIRONMENT_VARIABLE, "").strip())


def resolve_options(check_equivariance: bool | None, every: int) -> tuple[bool | None, int]:
    """Validate the constructor's options; returns them unchanged."""
    if check_equivariance not in (None, True, False) or not isinstance(check_equivariance, (bool, type(None))):
        raise ValueError(
            f"check_equivariance must be True, False or None (None: follow {ENVIRONMENT_VARIABLE} and "
            f"slim_mha.checking_equivariance()), got {check_equivariance!r}"
        )
    return check_equivariance, check_every(every, "check_equivariance_every")


def check_every(every, name: str) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{name} must be an int >= 1 (1 checks every call, N every N-th call), got {every!r}")
    return every


def resolve_skip_option(skip_unread_weights: object) -> bool:
    """The constructor's ``skip_unread_weights``, checked."""
    if not isinstance(skip_unread_weights, bool):
        raise ValueError(f"skip_unread_weights must be True or False, got {skip_unread_weights!r}; pass a bool")
    return skip_unread_weights
