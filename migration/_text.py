"""Showing names that come from files: control and escape characters are printed escaped.

Tensor names and paths are the checkpoint's, not ours, so a name holding ``\x1b[2K`` or ``\r`` could
erase or overwrite a line on the user's terminal and make an error look like success.
"""

from __future__ import annotations

import os

__all__ = ["shown"]


def shown(name: str | os.PathLike) -> str:
    """``name`` as text safe for a terminal: printable characters as they are, the rest escaped."""
    text = os.fspath(name)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
