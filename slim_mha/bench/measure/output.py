"""Writing results: JSON files that are whole or absent, tables, and numbers as a reader weighs them."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["excess_text", "mib_text", "table", "write_json"]

_MIB = 1024 * 1024


def mib_text(value: int | None) -> str:
    """Bytes as MiB in a table's column of seven characters; a dash for none."""
    return "      -" if value is None else f"{value / _MIB:7.1f}"


def excess_text(excess: int) -> str:
    """How far the largest slim peak is above stock's, in bytes a reader can weigh; empty if none is."""
    return f", slim at most {excess / 1024:.1f} KiB above stock" if excess > 0 else ""


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    temporary.replace(path)  # a run cut short never leaves half a file behind


def table(header: list[str], rows: list[list[str]], align: str = "", *, markdown: bool = False) -> list[str]:
    """A table's lines: markdown's pipes, or columns padded to their widest cell under a rule of dashes.
    ``align`` holds an ``l`` or an ``r`` per column (default: the first left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    if markdown:
        rule = "|" + "|".join("---" if side == "l" else "--:" for side in align) + "|"
        return [f"| {' | '.join(header)} |", rule, *(f"| {' | '.join(row)} |" for row in rows)]
    widths = [max(map(len, column)) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        padded = (cell.ljust(w) if side == "l" else cell.rjust(w) for cell, w, side in zip(cells, widths, align))
        return " ".join(padded).rstrip()

    return [line(header), "-" * len(line(header)), *map(line, rows)]
