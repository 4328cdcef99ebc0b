"""Steps the migration tests share: the CLI run in process, and the message of a refusal."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from slim_mha.migration.cli import main


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """The CLI through its real entry point: the exit code (0, or what it exited with), stdout and stderr."""
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


def refusal(error: type[BaseException], function: Callable, *args, **kwargs) -> str:
    """The message of the ``error`` that ``function(*args, **kwargs)`` must raise (the test fails if it does not)."""
    __tracebackhide__ = True
    with pytest.raises(error) as caught:
        function(*args, **kwargs)
    return str(caught.value)
