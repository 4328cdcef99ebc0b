"""The options of one migration run, carried whole from the public functions and the CLI to the writer."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MigrationOptions"]


@dataclass(frozen=True)
class MigrationOptions:
    """The options of one run, carried whole from the public functions to the writer (their meaning:
    :func:`slim_mha.migration.strip_checkpoint`)."""

    zero_attn: Iterable[str] = ()  # checked and made a tuple by migrate
    fold_value_bias: bool = False
    verify: bool = False
    dry_run: bool = False
    force: bool = False
    companions: bool = True
    progress: bool | None = None
    follow_outside_links: bool = False
    allow_expand: bool = False
    keep: Iterable[str] = ()  # strip: modules left as they are, by name or glob pattern
    keep_inexact: bool = False  # strip: leave as they are the modules it cannot convert exactly
    to: str | None = None  # "safetensors" or "dcp"; None: DCP for a DCP folder, safetensors otherwise
