"""Which attention modules are ``add_zero_attn``: the user's patterns and the checkpoint's own record.

Only there does the key bias matter in a file: the appended zero key is not shifted by it. A stock
checkpoint cannot say which modules set the flag, so the user marks them; a file slim_mha wrote
records them in its metadata (``slim_mha.zero_attn_modules``), which every later run reads back.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from slim_mha.bias import FORMAT_VERSION

from ._checkpoint import Checkpoint
from ._modules import AttentionGroup
from ._text import option, shown

__all__ = ["check_patterns", "records_zero_attn", "zero_attn_modules"]


def check_patterns(zero_attn: Iterable[str]) -> tuple[str, ...]:
    if isinstance(zero_attn, str):
        raise ValueError(f"zero_attn must be a list of module names or patterns, got the string {zero_attn!r}")
    patterns = tuple(zero_attn)
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern.strip("."):
            raise ValueError(
                f"{option('zero_attn')} {shown(repr(pattern))}: expected a module name such as "
                "'decoder.layers.0.self_attn'"
            )
    return patterns


def zero_attn_modules(patterns: tuple[str, ...], groups: list[AttentionGroup], checkpoint: Checkpoint) -> set[str]:
    """The modules marked add_zero_attn: by the user's patterns, and by the checkpoint's own metadata
    (``slim_mha.zero_attn_modules``, written by an earlier run), which a round trip must not lose."""
    source = checkpoint.source
    names = [group.name for group in groups]
    marked = recorded_zero_attn(checkpoint, set(names))
    for pattern in patterns:
        hits = [name for name in names if fnmatch.fnmatchcase(name, pattern.rstrip("."))]
        if not hits:
            example = f"; modules are named like '{shown(names[0])}' (see inspect)" if names else ""
            raise ValueError(
                f"{shown(source)}: {option('zero_attn')} '{shown(pattern)}' matches no attention module{example}"
            )
        marked.update(hits)
    return marked


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
