"""Showing names that come from files: control and escape characters are printed escaped.

Tensor names and paths are the checkpoint's, not ours, so a name holding ``\x1b[2K`` or ``\r`` could
erase or overwrite a line on the user's terminal and make an error look like success.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["cli_spelling", "option", "plural", "shown", "with_article"]


def shown(name: str | os.PathLike) -> str:
    """``name`` as text safe for a terminal: printable characters as they are, the rest escaped."""
    text = os.fspath(name)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


# How an option is spelled in messages: ``force=True`` for the Python API, ``--force`` in the CLI,
# which sets this for the duration of its run.
_CLI_SPELLING: ContextVar[bool] = ContextVar("slim_mha_migration_cli_spelling", default=False)
_OPTIONS = {
    "force": ("force=True", "--force"),
    "no_companions": ("companions=False", "--no-companions"),
    "zero_attn": ("zero_attn", "--zero-attn"),
    "verify": ("verify=True", "--verify"),
    "follow_outside_links": ("follow_outside_links=True", "--follow-outside-links"),
    "allow_expand": ("allow_expand=True", "--allow-expand"),
    "keep": ("keep", "--keep"),
    "keep_inexact": ("keep_inexact=True", "--keep-inexact"),
}


def option(name: str) -> str:
    """``name`` as the caller knows it: an API keyword, or the CLI flag when the CLI is running."""
    return _OPTIONS[name][_CLI_SPELLING.get()]


@contextlib.contextmanager
def cli_spelling() -> Iterator[None]:
    token = _CLI_SPELLING.set(True)
    try:
        yield
    finally:
        _CLI_SPELLING.reset(token)


def plural(count: int, noun: str) -> str:
    """``1 companion file``, ``2 companion files``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def with_article(noun: str) -> str:
    """``a float``, ``an int``: the indefinite article a word takes by its first letter."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
