"""Fixtures shared by the tests of the equivariance assertion mode (none of them is autouse).

A test file that exercises the mode starts each test from a known state with
``pytestmark = pytest.mark.usefixtures("fresh_equivariance_mode")``, and records the calls the mode
actually checked with ``record_checks``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import pytest

from slim_mha.equivariance import ENVIRONMENT_VARIABLE, _mode
from slim_mha.paths import forcing_blocks


@pytest.fixture
def fresh_equivariance_mode(monkeypatch):
    """The mode as a fresh process has it, whatever the shell set and whatever ran before.

    The environment variable's mode is off, and the checks draw their permutation seeds from the
    start of the mode's seed sequence, so a test sees the same permutations alone, in any order,
    or after other tests that ran checks.
    """
    _mode.reset(environment=None)
    yield
    _mode.reset(environment=os.environ.get(ENVIRONMENT_VARIABLE))


@pytest.fixture
def record_checks(monkeypatch) -> Callable[[Callable], list]:
    """``record_checks(what)`` returns a list that gets ``what(check)`` for each call the mode actually checks.

    ``check`` is the mode's ``_AttentionCheck`` (``.module``, ``.is_causal_hint``, ``.seed``...), appended
    in call order before it runs.
    """

    def start(what: Callable) -> list:
        seen = []
        run = _mode._AttentionCheck.run

        def recording_run(self, result):
            seen.append(what(self))
            return run(self, result)

        monkeypatch.setattr(_mode._AttentionCheck, "run", recording_run)
        return seen

    return start


@pytest.fixture
def slims_own_paths(monkeypatch):
    """Small calls that slim hands to stock's code by default in fp32 and bf16 take slim's own paths
    instead, for the tests that exercise slim's own code at small sizes: without weights its short
    path rather than stock's kernel, with masks or weights its own path rather than stock's kernel or
    ops, and with ``skip_unread_weights`` the skip rather than stock's kernel."""
    from slim_mha import paths

    monkeypatch.setattr(paths, "STOCK_KERNEL_MAX_SCORE_BYTES", {})
    monkeypatch.setattr(paths, "STOCK_KERNEL_MASKED_MAX_SCORE_BYTES", {})
    monkeypatch.setattr(paths, "STOCK_OPS_MAX_SCORE_BYTES", {})
    monkeypatch.setattr(paths, "STOCK_OPS_SEQUENCE_FIRST_MAX_SCORE_BYTES", {})
    monkeypatch.setattr(paths, "SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES", {})


@pytest.fixture
def forced_blocks():
    """``forced_blocks(n)``: until the test ends, averaged weights without a graph go in blocks of at
    most ``n`` bytes of scores, on slim's own path (:func:`slim_mha.paths.forcing_blocks`)."""
    with contextlib.ExitStack() as stack:
        yield lambda block_bytes: stack.enter_context(forcing_blocks(block_bytes))
