"""Steps the migration tests share: the CLI run in process, and the message of a refusal."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from slim_mha.migration._staging import _record
from slim_mha.migration._torch_pickles import torch_reads_pickles_safely
from slim_mha.migration.cli import main


@pytest.fixture(autouse=True)
def private_ledger(tmp_path_factory, monkeypatch):
    """Each test gets its own ledger of staging paths (under XDG_STATE_HOME), for the runs it starts in
    process and in subprocesses alike; imported by every migration test module, so autouse there."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


def left_by_a_killed_run(path: Path) -> Path:
    """Record ``path`` in the ledger as a run of this tool does before it can leave the path behind."""
    assert _record(path) is not None
    return path


def default_sigint() -> None:
    """``preexec_fn`` for a CLI process that a test interrupts: Ctrl-C acts as in a terminal.

    A process started from a background job inherits an ignored SIGINT, and Python then installs no
    KeyboardInterrupt handler: the SIGINT a test sends would never land, however the suite was started.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """The CLI through its real entry point: the exit code (0, or what it exited with), stdout and stderr."""
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


# A test that reads a .pt input: before torch 2.10.0 the migration refuses every pickle, by design (a test
# of its own checks that refusal), so such a test has nothing to check there.
reads_pickles = pytest.mark.skipif(
    not torch_reads_pickles_safely(), reason="pickle-based inputs need a torch release >= 2.10.0"
)


# What every output of slim-mha-migrate carries, and what --force looks for before replacing a file.
OURS = {"slim_mha.format_version": "1", "slim_mha.mode": "fold"}


def old_output(path: Path, value: float = 0.0) -> bytes:
    """A small safetensors file at ``path`` carrying this tool's metadata, standing for an earlier output
    that --force may replace; returns its bytes, to prove it unchanged."""
    save_file({"old": torch.full((2,), value)}, path, metadata=OURS)
    return path.read_bytes()


def refusal(error: type[BaseException], function: Callable, *args, **kwargs) -> str:
    """The message of the ``error`` that ``function(*args, **kwargs)`` must raise (the test fails if it does not)."""
    __tracebackhide__ = True
    with pytest.raises(error) as caught:
        function(*args, **kwargs)
    return str(caught.value)
