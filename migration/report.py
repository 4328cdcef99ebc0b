"""What a migration found and did: plain dataclasses, and one function that turns them into text.

The dataclasses hold names as the checkpoint spells them; every message shows them through
:func:`shown`, with control and escape characters escaped: tensor names and paths are the
checkpoint's, not ours, so a name holding ``\x1b[2K`` or ``\r`` could erase or overwrite a line on
the user's terminal and make an error look like success. :func:`option` spells an option as the
caller knows it (an API keyword, or the CLI's flag).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NOTHING_TO_DO_STATUS",
    "MigrationReport",
    "ModuleReport",
    "NothingToDo",
    "cli_spelling",
    "format_report",
    "format_size",
    "option",
    "plural",
    "shown",
    "with_article",
]


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
    "to": ("to", "--to"),
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


class NothingToDo(ValueError):
    """The checkpoint is already in the layout asked for (or holds no attention module): nothing was
    written. The CLI exits with :data:`NOTHING_TO_DO_STATUS` for it, so that a pipeline can tell
    "already done" from a failure."""


NOTHING_TO_DO_STATUS = 3


@dataclass(frozen=True)
class ModuleReport:
    """One attention module, found by its key prefix.

    ``shapes`` lists each tensor of the module (local name, shape). ``key_bias`` is ``"absent"``
    (``bias=False``), ``"dropped"`` (already slim), ``"zero"`` or ``"non-zero"``; ``key_bias_max`` is
    the largest ``|b_k|`` where it is stored. ``zero_attn`` is None where the checkpoint cannot tell
    (stock modules that were not marked). ``strip``, ``fold`` and ``to_stock`` say what each mode
    does to the module; ``action`` is what this run did to it.
    """

    name: str
    layout: str
    embed_dim: int
    kdim: int
    vdim: int
    dtype: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    key_bias: str
    key_bias_max: float | None
    bias_kv: bool
    zero_attn: bool | None  # None: unknown, as in a stock checkpoint that nobody marked
    strip: str
    fold: str
    to_stock: str
    action: str | None = None
    changed: bool = False
    verify_error: float | None = None


@dataclass(frozen=True)
class MigrationReport:
    """A whole run: ``mode`` is ``"inspect"``, ``"strip"``, ``"fold"`` or ``"to-stock"``.

    Sizes are sizes on disk: ``total_bytes`` of SRC's files, ``output_bytes`` of the written shards and
    index (planned exactly, for a dry run). ``files_read_back`` counts the files ``verify`` compared
    tensor by tensor; ``assumed_no_zero_attn`` names the changed modules it took to be built without
    ``add_zero_attn``, which their checkpoint cannot record.
    """

    mode: str
    source: Path
    destination: Path | None
    shards: tuple[str, ...]
    tensors: int
    total_bytes: int
    modules: tuple[ModuleReport, ...]
    metadata: dict[str, str]
    output_tensors: int | None = None
    output_bytes: int | None = None
    dry_run: bool = False
    written: bool = False
    verified: bool = False
    notes: tuple[str, ...] = ()
    companions: tuple[str, ...] = ()  # files copied unchanged beside the shards (config.json...)
    files_read_back: int = 0
    assumed_no_zero_attn: tuple[str, ...] = ()

    @property
    def changed(self) -> tuple[ModuleReport, ...]:
        return tuple(module for module in self.modules if module.changed)


def format_report(report: MigrationReport) -> str:
    """The report as the CLI prints it."""
    if report.mode == "inspect":
        lines = _format_inspect(report)
    else:
        lines = _format_migration(report)
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(shown(line) for line in lines)


def _format_inspect(report: MigrationReport) -> list[str]:
    count = len(report.modules)
    lines = [
        f"{report.source}: {count} attention module{'s' if count != 1 else ''}; "
        f"{plural(len(report.shards), 'shard')}, {plural(report.tensors, 'tensor')}, {format_size(report.total_bytes)}"
    ]
    if report.metadata:
        lines.append("metadata: " + ", ".join(f"{key}={value}" for key, value in sorted(report.metadata.items())))
    for module in report.modules:
        dims = f"embed_dim={module.embed_dim}"
        if (module.kdim, module.vdim) != (module.embed_dim, module.embed_dim):
            dims += f", kdim={module.kdim}, vdim={module.vdim}"
        key_bias = module.key_bias
        if module.key_bias_max is not None and module.key_bias == "non-zero":
            key_bias += f" (max |b_k| {module.key_bias_max:.3g})"
        lines += [
            f"{module.name}: {module.layout}, {dims}, {module.dtype}, key bias {key_bias}, "
            f"bias_k/bias_v {_yes(module.bias_kv)}, {_zero_attn(module.zero_attn)}",
            "  shapes:   " + ", ".join(f"{local} {list(shape)}" for local, shape in module.shapes),
            f"  strip:    {module.strip}",
            f"  fold:     {module.fold}",
            f"  to-stock: {module.to_stock}",
        ]
    return lines


def _format_migration(report: MigrationReport) -> list[str]:
    count = len(report.modules)
    lines = [
        f"{report.mode} {report.source} -> {report.destination}: {len(report.changed)} of "
        f"{plural(count, 'attention module')} changed"
    ]
    for module in report.modules:
        line = f"  {module.name}: {module.action}"
        if module.verify_error is not None:
            line += f" [verified, error {module.verify_error:.2g}]"
        lines.append(line)
    if report.verified:
        worst = max((m.verify_error for m in report.changed if m.verify_error is not None), default=0.0)
        lines.append(f"verified {plural(len(report.changed), 'module')}: largest relative output error {worst:.2g}")
        if report.files_read_back:
            lines.append(
                f"verified {plural(report.files_read_back, 'written file')} by reading "
                f"{'it' if report.files_read_back == 1 else 'them'} back: every tensor matches the source or its "
                "conversion"
            )
        if report.assumed_no_zero_attn:
            count = len(report.assumed_no_zero_attn)
            lines.append(
                f"verify assumed {plural(count, 'module')} built without add_zero_attn, which a stock checkpoint "
                f"cannot record: if {'one was' if count > 1 else 'it was'} built with it, rerun with "
                f"{option('zero_attn')} (see inspect)"
            )
    what = (
        f"{plural(len(report.shards), 'shard')}, {plural(report.output_tensors or 0, 'tensor')}, "
        f"{format_size(report.output_bytes or 0)}"
    )
    if report.companions:
        copied = "would copy" if report.dry_run else "copied"
        lines.append(
            f"{copied} {plural(len(report.companions), 'companion file')} unchanged: {', '.join(report.companions)}"
        )
    if report.dry_run:
        lines.append(f"dry run: would write {report.destination} ({what}); nothing was written")
    elif report.written:
        lines.append(f"wrote {report.destination} ({what})")
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _zero_attn(flag: bool | None) -> str:
    if flag is None:
        return "add_zero_attn: unknown (not recorded in stock checkpoints)"
    return f"add_zero_attn {_yes(flag)}"


def format_size(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
