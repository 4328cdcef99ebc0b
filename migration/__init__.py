"""Checkpoint migration between the stock ``nn.MultiheadAttention`` layout and slim_mha's.

The four operations mirror the CLI (``slim-mha-migrate`` / ``python -m slim_mha.migration``)::

    from slim_mha.migration import fold_checkpoint, inspect_checkpoint, format_report

    print(format_report(inspect_checkpoint("model.safetensors")))
    report = fold_checkpoint("model.safetensors", "model.slim.safetensors", verify=True)

What is read (SRC, never modified):

- a ``.safetensors`` file;
- a ``.pt``, ``.pth``, ``.bin`` or ``.ckpt`` file written by ``torch.save``: a state dict, or a
  checkpoint holding one under ``"state_dict"`` (PyTorch Lightning) or ``"model"``, read with
  ``torch.load(weights_only=True)``, so a pickle that needs anything but tensors is refused unread;
- a sharded checkpoint's index, ``model.safetensors.index.json``, ``pytorch_model.bin.index.json`` or
  any other ``*.index.json``, with its shards (``.safetensors`` or torch files, as above) beside it;
- a folder holding one of those two indexes, or exactly one weight file (``model.safetensors``,
  ``pytorch_model.bin``, or another name);
- a ``torch.distributed.checkpoint`` (DCP) folder, ``.metadata`` and ``*.distcp`` files, as ``dcp.save``
  writes it under FSDP2 or in one process: read in one process, without a process group (see
  :mod:`._dcp`); its chunks are torch pickles, read as the files above are.

What is written (DST) for a DCP folder is a DCP folder (``to="safetensors"``: safetensors shards and an
index), its unchanged entries copied byte for byte (see :mod:`._dcp_writer`). For any other SRC it is
safetensors: a ``.safetensors`` file for a file SRC. For an index or a
folder, DST is a folder: each shard is written as ``.safetensors`` under its Hugging Face name
(``pytorch_model.bin`` becomes ``model.safetensors``, ``pytorch_model-00001-of-00002.bin``
``model-00001-of-00002.safetensors``, and ``pytorch_model.bin.index.json``
``model.safetensors.index.json``), and the other files of SRC's folder (``config.json``, tokenizer
files...; not subfolders, not other weight files) are copied unchanged unless ``companions=False``.
Why each conversion is exact is explained once, in :mod:`slim_mha.bias`, whose functions do the
arithmetic.

Every input is opened once, judged by the file that was opened (a regular file, inside SRC) and read
through that descriptor only; a file that changes while the run reads it fails the run, naming it, and
nothing is written. Nothing from outside SRC reaches DST: a companion file (or a shard) whose symbolic
link leaves SRC's folder is left out with a note (a shard refuses the run), except a Hugging Face cache
snapshot's links into its own repository's ``blobs/`` (``models--*/{blobs,snapshots}``). Output files
and folders get their source's permission bits, as ``cp -p`` does, whatever the umask. The output size
is computed before writing and checked against the free space; a torch file that expands far beyond its
stored bytes, or a compressed torch zip, is refused first. Pickle-based inputs need a torch release
>= 2.10.0, whose ``weights_only`` unpickler a crafted file cannot use to run code; older torch refuses
them (safetensors inputs work on any torch).

Errors: ``ValueError`` for a bad input or a conversion that would not be exact, ``FileNotFoundError``
and ``FileExistsError`` for paths, ``OSError`` when DST's file system lacks the space, ``RuntimeError``
when ``verify`` finds a mismatch. Every message names the file and the key. Nothing is ever written to
SRC, no DST is inside SRC or around it, and DST appears complete or not at all:
the output is staged beside DST, fsynced, and moved into place in one step; a KeyboardInterrupt
removes the staging path, and litter from a killed run is removed by the next run, when this tool's
ledger recorded it (see :mod:`._staging`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from .report import MigrationReport, ModuleReport, NothingToDo, format_report

# Nothing here imports torch: the CLI imports this package before it can catch a Ctrl-C, so the heavy
# modules (``._migrate``, and torch with it) are imported on first use, inside the CLI's guard.

__all__ = [
    "FORMAT_VERSION",
    "MigrationReport",
    "ModuleReport",
    "NothingToDo",
    "StrippedLoadPlanner",
    "format_report",
    "fold_checkpoint",
    "fold_state_dict",
    "inspect_checkpoint",
    "strip_checkpoint",
    "strip_state_dict",
    "to_stock_checkpoint",
    "to_stock_state_dict",
]

PathLike = str | os.PathLike


def __getattr__(name: str):
    if name == "FORMAT_VERSION":
        from ._migrate import FORMAT_VERSION

        return FORMAT_VERSION
    if name == "StrippedLoadPlanner":  # torch.distributed.checkpoint, imported where it is used
        from ._dcp_load import StrippedLoadPlanner

        return StrippedLoadPlanner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def strip_checkpoint(
    source: PathLike,
    destination: PathLike,
    *,
    zero_attn: Iterable[str] = (),
    fold_value_bias: bool = False,
    verify: bool = False,
    dry_run: bool = False,
    force: bool = False,
    companions: bool = True,
    progress: bool | None = None,
    follow_outside_links: bool = False,
    allow_expand: bool = False,
    keep: Iterable[str] = (),
    keep_inexact: bool = False,
    to: str | None = None,
) -> MigrationReport:
    """Write the key-bias-free layout (``q_proj_bias``, ``v_proj_bias``): ``E`` fewer values per
    attention module, which only slim_mha loads. Refuses where dropping the key bias is not exact.

    Dropping ``b_k`` is exact unless the module appends tokens after the projection: with ``bias_k``
    (``add_bias_kv``) or a module marked in ``zero_attn`` it refuses, pointing to :func:`fold`.

    Args:
        source: the checkpoint to read (never modified).
        destination: a ``.safetensors`` path, or a directory for a sharded source.
        zero_attn: names or glob patterns (``"decoder.layers.*.self_attn"``) of modules built with
            ``add_zero_attn=True``; a checkpoint cannot record that flag.
        fold_value_bias: also fold ``b_v`` into ``out_proj.bias``: exact for inference (eval) only,
            because dropout on the attention weights breaks the rows summing to one.
        verify: compare every changed module's outputs, rebuilt from the original and the migrated
            tensors, on random inputs; then read every written file back and compare every tensor with
            the source or its conversion, before the output is moved into place. A mismatch raises
            ``RuntimeError`` and nothing is written. Unmarked modules are assumed built without
            ``add_zero_attn`` (a checkpoint cannot record it); the report names them.
        dry_run: do everything but write.
        force: replace an existing destination that holds nothing but this tool's own earlier output
            (files carrying slim_mha metadata, companions it recorded); anything else is named in the
            refusal. Never one that is or holds a file the run reads, nor one inside SRC or around it.
        companions: for a checkpoint folder, copy its other files (``config.json``, tokenizer files,
            README...; not weight files, not subfolders) unchanged into the output folder, and list
            them in the report. ``False`` leaves them out. A file whose symbolic link leads outside
            SRC's folder is left out, with a note (a Hugging Face cache snapshot's links into its own
            ``blobs/`` are inside).
        progress: show a tqdm bar on stderr: ``None`` decides (a TTY and several shards or a large
            file), ``True`` always, ``False`` never.
        follow_outside_links: copy companions, and read shards, that symbolic links take outside SRC.
        allow_expand: write a torch file whose tensors expand far beyond its stored bytes (a view that
            repeats a small tensor, written out in full); refused by default, before anything is written.
        keep: names or glob patterns of modules to leave as they are (strip only); the report names each.
        keep_inexact: leave as they are the modules strip cannot convert exactly (``add_bias_kv``, marked
            ``add_zero_attn``) instead of refusing the file; the report names each, and why (strip only).
        to: the output's format for a DCP folder: ``None`` (a DCP folder, which ``dcp.load`` reads;
            a stripped one with :class:`StrippedLoadPlanner`) or ``"safetensors"`` (a folder of
            safetensors shards, one per data file that holds tensors, with an index; non-tensor
            entries are left out, with a note). Other sources are always written as safetensors.

    Raises:
        NothingToDo: (a ``ValueError``) the checkpoint is already in this layout; nothing was written.

    Output files and folders get their source's permission bits, as ``cp -p`` does, whatever the umask.
    """
    from ._migrate import migrate

    return migrate("strip", source, destination, _options(locals()))


def fold_checkpoint(
    source: PathLike,
    destination: PathLike,
    *,
    zero_attn: Iterable[str] = (),
    fold_value_bias: bool = False,
    verify: bool = False,
    dry_run: bool = False,
    force: bool = False,
    companions: bool = True,
    progress: bool | None = None,
    follow_outside_links: bool = False,
    allow_expand: bool = False,
    to: str | None = None,
) -> MigrationReport:
    """Write stock's layout with the key slot of every ``in_proj_bias`` zeroed: a file that stock
    ``nn.MultiheadAttention`` and slim_mha both load, computing the original outputs exactly.

    With ``add_bias_kv``, ``bias_k`` becomes ``bias_k - b_k``; modules marked in ``zero_attn`` need
    their key bias and are left as stock has them; a key-bias-free input is turned back into stock's
    layout. The arguments are those of :func:`strip_checkpoint`.
    """
    from ._migrate import migrate

    return migrate("fold", source, destination, _options(locals()))


def to_stock_checkpoint(
    source: PathLike,
    destination: PathLike,
    *,
    zero_attn: Iterable[str] = (),
    verify: bool = False,
    dry_run: bool = False,
    force: bool = False,
    companions: bool = True,
    progress: bool | None = None,
    follow_outside_links: bool = False,
    allow_expand: bool = False,
    to: str | None = None,
) -> MigrationReport:
    """Convert slim modules back to the stock layout: stock ``nn.MultiheadAttention`` then loads the
    checkpoint with ``strict=True`` and computes the same outputs.

    The dropped key bias comes back as a zero slice of ``in_proj_bias`` (and a folded value bias as a
    zero value slice). The arguments are those of :func:`strip_checkpoint`.
    """
    from ._migrate import migrate

    return migrate("to-stock", source, destination, _options(locals()))


def _options(arguments: dict):
    """The run's options from a public function's arguments (its ``locals()`` on entry): the keyword
    arguments are named as ``MigrationOptions``'s fields (``tests/test_migration_users.py`` checks)."""
    from ._migrate import MigrationOptions

    names = {field.name for field in dataclasses.fields(MigrationOptions)}
    return MigrationOptions(**{name: value for name, value in arguments.items() if name in names})


def inspect_checkpoint(source: PathLike, *, zero_attn: Iterable[str] = ()) -> MigrationReport:
    """List every attention module with its shapes, its key bias, and what each mode would do to it."""
    from ._migrate import inspect_source

    return inspect_source(source, zero_attn=zero_attn)


def fold_state_dict(state_dict, *, zero_attn: Iterable[str] = (), fold_value_bias: bool = False) -> dict:
    """:func:`fold_checkpoint` on a state dict in memory (``model.state_dict()``): a new dict in
    stock's layout with every key slot zeroed, which stock and slim both load. The input is never
    modified; the tensors this leaves alone are the input's own objects.
    """
    from ._state_dict import migrate_state_dict

    return migrate_state_dict(state_dict, "fold", zero_attn=zero_attn, fold_value_bias=fold_value_bias)


def strip_state_dict(state_dict, *, zero_attn: Iterable[str] = (), fold_value_bias: bool = False) -> dict:
    """:func:`strip_checkpoint` on a state dict in memory: a new dict in the key-bias-free layout,
    which slim's ``load_state_dict`` reads."""
    from ._state_dict import migrate_state_dict

    return migrate_state_dict(state_dict, "strip", zero_attn=zero_attn, fold_value_bias=fold_value_bias)


def to_stock_state_dict(state_dict, *, zero_attn: Iterable[str] = ()) -> dict:
    """:func:`to_stock_checkpoint` on a state dict in memory: a new dict in stock's layout."""
    from ._state_dict import migrate_state_dict

    return migrate_state_dict(state_dict, "to-stock", zero_attn=zero_attn)
