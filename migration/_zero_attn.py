"""Which attention modules are ``add_zero_attn``: the user's patterns and the checkpoint's own record.

Only there does the key bias matter in a file: the appended zero key is not shifted by it. A stock
checkpoint cannot say which modules set the flag, so the user marks them; a file slim_mha wrote
records them in its metadata (``slim_mha.zero_attn_modules``), which every later run reads back.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from slim_mha.bias import FORMAT_VERSION

from ._modules import AttentionGroup
from ._records import Checkpoint
from .report import option, shown

__all__ = ["check_patterns", "records_zero_attn", "zero_attn_modules"]


def check_patterns(patterns: Iterable[str], option_name: str = "zero_attn") -> tuple[str, ...]:
    """Module names or glob patterns as given for ``option_name``: a list, each a module name."""
    if isinstance(patterns, str):
        raise ValueError(f"{option_name} must be a list of module names or patterns, got the string {patterns!r}")
    checked = tuple(patterns)
    for pattern in checked:
        if not isinstance(pattern, str) or not pattern.strip("."):
            raise ValueError(
                f"{option(option_name)} {shown(repr(pattern))}: expected a module name such as "
                "'decoder.layers.0.self_attn'"
            )
    return checked


def matching_modules(
    patterns: tuple[str, ...], groups: list[AttentionGroup], checkpoint: Checkpoint, option_name: str
) -> set[str]:
    """The modules the user's patterns name; a pattern that names none is refused, with an example."""
    names = [group.name for group in groups]
    matched: set[str] = set()
    for pattern in patterns:
        hits = [name for name in names if fnmatch.fnmatchcase(name, pattern.rstrip("."))]
        if not hits:
            example = f"; modules are named like '{shown(names[0])}' (see inspect)" if names else ""
            raise ValueError(
                f"{shown(checkpoint.source)}: {option(option_name)} '{shown(pattern)}' matches no attention module{example}"
            )
        matched.update(hits)
    return matched


def zero_attn_modules(patterns: tuple[str, ...], groups: list[AttentionGroup], checkpoint: Checkpoint) -> set[str]:
    """The modules marked add_zero_attn: by the user's patterns, and by the checkpoint's own metadata
    (``slim_mha.zero_attn_modules``, written by an earlier run), which a round trip must not lose."""
    marked = recorded_zero_attn(checkpoint, {group.name for group in groups})
    return marked | matching_modules(patterns, groups, checkpoint, "zero_attn")


def recorded_zero_attn(checkpoint: Checkpoint, names: set[str]) -> set[str]:
    """What earlier runs recorded in the files' metadata; refuses a record that no longer fits the tensors."""
    for where, value in checkpoint.recorded("slim_mha.format_version"):
        if not (isinstance(value, str) and value.isdigit()):
            raise ValueError(
                f"{shown(where)}: metadata slim_mha.format_version is {shown(repr(value))}, not a number; the "
                "metadata was edited: convert the original checkpoint instead"
            )
        if int(value) > FORMAT_VERSION:
            raise ValueError(
                f"{shown(where)}: written by a newer slim_mha (format version {value}; this one reads up to "
                f"{FORMAT_VERSION}); upgrade slim_mha to convert it"
            )
    recorded: set[str] = set()
    for where, value in checkpoint.recorded("slim_mha.zero_attn_modules"):
        listed = value.split(",") if isinstance(value, str) else [value]
        for name in listed:
            if name not in names:
                raise ValueError(
                    f"{shown(where)}: its metadata marks {shown(repr(name))} as an add_zero_attn module "
                    "(slim_mha.zero_attn_modules), but no attention module has that name: the tensors were "
                    f"renamed after slim_mha wrote them; convert the original checkpoint, with {option('zero_attn')}"
                )
            recorded.add(name)
    return recorded


def records_zero_attn(checkpoint: Checkpoint) -> bool:
    """Whether the checkpoint says which modules are add_zero_attn: slim_mha wrote it, and records them.
    A stock checkpoint cannot: its modules' flag is unknown unless the user marks them."""
    return bool(checkpoint.recorded("slim_mha.format_version"))
