"""Writing a run's output: the shards, the index and the companion files, into a staging place beside
DST that moves into place in one step (:mod:`._staging`); each file read back where ``verify`` asks.

The sizes the files will have (:func:`planned_sizes`) are computed as :func:`write_output` writes
them, so that the free-space check before any write is exact.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from ._dcp_writer import write_dcp_files
from ._destination import (
    COMPANIONS_KEY,
    Companion,
    companion_record,
    file_digest,
    output_permissions,
    permissions,
)
from ._inputs import open_input
from ._plan import ModulePlan
from ._records import DTYPE_NAMES, Checkpoint
from ._run_options import MigrationOptions
from ._staging import Staging, pause_for_tests, sync_files
from ._verify import check_written_file, check_written_text
from ._writer import OutputTensor, copy_file, planned_size, write_safetensors
from .report import option, shown

__all__ = ["output_files", "planned_sizes", "write_output"]

_PROGRESS_BYTES = 256 * 1024 * 1024  # a single file this large gets a progress bar too


def planned_sizes(
    checkpoint: Checkpoint,
    outputs: list[tuple[str, list[OutputTensor]]],
    provenance: dict[str, str],
    digests: dict[str, str],
) -> dict[str, int]:
    """Each output file's size on disk (shards and index), as :func:`write_output` writes them."""
    shards = {shard.name: shard for shard in checkpoint.shards}
    sizes = {
        name: planned_size(tensors, _file_metadata(checkpoint, shards[name], provenance, digests))
        for name, tensors in outputs
    }
    if checkpoint.kind == "sharded":
        sizes[checkpoint.output_index_name] = len(_index_text(checkpoint, outputs, provenance, digests).encode("utf-8"))
    return sizes


def _file_metadata(checkpoint: Checkpoint, shard, provenance: dict[str, str], digests: dict[str, str]) -> dict:
    """A shard's metadata: the source's, the run's provenance, and, in the one file that stands for the
    output folder (its single model.safetensors; else the index), the record of its companion files."""
    metadata = {**shard.metadata, **provenance}
    metadata.pop(COMPANIONS_KEY, None)
    if digests and checkpoint.kind == "directory":
        metadata[COMPANIONS_KEY] = companion_record(digests)
    return metadata


def output_files(
    checkpoint: Checkpoint, plans: list[ModulePlan], rewritten: dict[str, dict[str, torch.Tensor]]
) -> list[tuple[str, list[OutputTensor]]]:
    """Each output file's name and tensors: the input's shards, minus dropped keys, plus new ones."""
    replaced: set[str] = set()
    added: dict[str, list[OutputTensor]] = {shard.name: [] for shard in checkpoint.shards}
    for plan in plans:
        group, tensors = plan.group, rewritten[plan.group.prefix]
        replaced.update(group.key(local) for local in plan.removed)
        for local, tensor in tensors.items():
            replaced.add(group.key(local))
            home = group.records[plan.placed[local]].shard.name
            nbytes = tensor.numel() * tensor.element_size()
            added[home].append(
                OutputTensor(group.key(local), DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), nbytes, tensor=tensor)
            )
    files = []
    for shard in checkpoint.shards:
        kept = [
            OutputTensor(record.key, record.dtype, record.shape, record.nbytes, record=record)
            for key, record in shard.records.items()
            if key not in replaced
        ]
        if kept or added[shard.name]:
            files.append((shard.name, kept + added[shard.name]))
    return files


def write_output(
    checkpoint: Checkpoint,
    destination: Path,
    files: list[tuple[str, list[OutputTensor]]],
    provenance: dict[str, str],
    companions: list[Companion],
    options: MigrationOptions,
    *,
    check: Callable[[], None],
    placed_at: dict[str, str] | None = None,
) -> tuple[dict[str, int], tuple[str, ...]]:
    """Write the output into a staging path and move it into place; on any failure, including an
    interruption, the staging path is removed and DST is left as it was. Returns each written file's
    size on disk (shards and index, or a DCP folder's files), and notes for the report. ``placed_at``:
    for a DCP folder, the source key each new tensor takes the place of (:mod:`._dcp_writer`)."""
    total = sum(tensor.nbytes for _, tensors in files for tensor in tensors)
    total += sum(companion.size for companion in companions)
    progress = options.progress
    if progress is None:
        progress = sys.stderr.isatty() and (len(files) > 1 or total >= _PROGRESS_BYTES)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=checkpoint.source.name,
        file=sys.stderr,
        disable=not progress,
    )
    # cp -p: each file keeps its source's permission bits, the folder its source folder's (a replaced
    # DST its own, less any the source lacks), whatever the umask.
    folder_source = checkpoint.source if checkpoint.source.is_dir() else checkpoint.source.parent
    if checkpoint.writes_directory:
        mode = output_permissions(permissions(folder_source), destination, force=options.force)
    else:
        mode = output_permissions(checkpoint.shards[0].opened.mode, destination, force=options.force)
    staging = Staging(destination, directory=checkpoint.writes_directory, mode=mode)
    try:
        with staging:
            # Companions first: the record of their digests goes into the files written after them.
            root = Path(os.path.realpath(folder_source))
            digests = _copy_companions(staging.path, destination, companions, root, options, bar)
            if checkpoint.kind == "dcp":
                sizes = write_dcp_files(
                    checkpoint,
                    staging.path,
                    destination,
                    files,
                    placed_at or {},
                    provenance,
                    digests,
                    options,
                    bar.update,
                )
            else:
                sizes = _write_files(
                    checkpoint, staging.path, destination, files, provenance, digests, mode, options, bar
                )
            pause_for_tests("before-commit")
            checkpoint.check_unchanged()  # after the last read of SRC (verify's included): one version of each
            staging.commit(replace=options.force or _is_empty_directory(destination), check=check)
            pause_for_tests("after-commit")
        return sizes, tuple(staging.notes)
    except OSError as exc:
        if isinstance(exc, FileExistsError) or exc.filename is None and exc.errno is None:
            raise  # already names the user's path
        raise _write_error(exc, destination, staging) from None
    finally:
        bar.close()


def _copy_companions(
    staging: Path, destination: Path, companions: list[Companion], root: Path, options: MigrationOptions, bar
) -> dict[str, str]:
    """Copy each companion file into the staging folder; returns their digests."""
    digests = {}
    for companion in companions:
        bar.set_postfix_str(companion.name, refresh=False)
        target = staging / companion.name
        # Opened and judged again: the listing is only where to look; the opened file is what is copied.
        opened = open_input(companion.path, root, follow_outside_links=options.follow_outside_links)
        try:
            digests[companion.name] = copy_file(opened, target, bar.update, mode=opened.mode)
        finally:
            opened.close()
        if options.verify and file_digest(target) != digests[companion.name]:
            raise RuntimeError(
                f"{shown(destination / companion.name)}: {option('verify')} read the copied file back and it "
                f"differs from {shown(companion.path)}; nothing was written"
            )
    sync_files(staging, [companion.name for companion in companions])
    return digests


def _write_files(
    checkpoint: Checkpoint,
    staging: Path,
    destination: Path,
    files: list[tuple[str, list[OutputTensor]]],
    provenance: dict[str, str],
    digests: dict[str, str],
    mode: int,
    options: MigrationOptions,
    bar,
) -> dict[str, int]:
    """Write every shard (and a sharded checkpoint's index) into the staging path; their sizes."""
    shards = {shard.name: shard for shard in checkpoint.shards}
    sizes: dict[str, int] = {}
    for number, (name, tensors) in enumerate(files):
        path, final = (staging / name, destination / name) if checkpoint.writes_directory else (staging, destination)
        file_mode = mode if not checkpoint.writes_directory else shards[name].opened.mode
        bar.set_postfix_str(name, refresh=False)
        metadata = _file_metadata(checkpoint, shards[name], provenance, digests)
        tensors = [_with_data(tensor) for tensor in tensors]  # a DCP shard's tensors, read now: one shard at a time
        sizes[name] = write_safetensors(path, tensors, metadata, bar.update, shown_as=final, mode=file_mode)
        if number == 0:
            pause_for_tests("after-first-shard")
        if options.verify:
            check_written_file(path, tensors, shown_as=final)
    if checkpoint.kind == "sharded":
        text = _index_text(checkpoint, files, provenance, digests)
        index = staging / checkpoint.output_index_name
        _write_index(index, text, checkpoint.opened_index.mode)
        sizes[checkpoint.output_index_name] = len(text.encode("utf-8"))
        if options.verify:
            check_written_text(index, text, shown_as=destination / checkpoint.output_index_name)
    return sizes


def _with_data(tensor: OutputTensor) -> OutputTensor:
    """``tensor``, read into memory where its source has no byte range to copy (a DCP tensor's chunks)."""
    record = tensor.record
    if record is None or record.offset is not None or record.tensor is not None:
        return tensor
    return OutputTensor(tensor.key, tensor.dtype, tensor.shape, tensor.nbytes, tensor=record.read())


def _write_error(exc: OSError, destination: Path, staging: Staging) -> OSError:
    """A failed write, said in one line that names DST and what state it is in."""
    if staging.committed:
        state = f"{shown(destination)} was written completely, but syncing its folder failed"
    elif os.path.lexists(destination):
        state = f"{shown(destination)} was left as it was"
    else:
        state = "nothing was written"
    reason = exc.strerror or str(exc)
    culprit = os.fspath(exc.filename) if exc.filename is not None else None
    if culprit and not culprit.startswith(os.fspath(staging.path)):  # an input, named as the user named it
        reason = f"{shown(culprit)}: {reason}"
    error = OSError(f"{shown(destination)}: cannot write the output ({reason}); {state}")
    error.errno = exc.errno
    return error


def _is_empty_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not os.listdir(path)


def _index_text(
    checkpoint: Checkpoint,
    files: list[tuple[str, list[OutputTensor]]],
    provenance: dict[str, str],
    digests: dict[str, str],
) -> str:
    weight_map = {tensor.key: name for name, tensors in files for tensor in tensors}
    total_size = sum(tensor.nbytes for _, tensors in files for tensor in tensors)
    metadata = {**checkpoint.index_metadata, **provenance, "total_size": total_size}
    metadata.pop(COMPANIONS_KEY, None)
    if digests:
        metadata[COMPANIONS_KEY] = companion_record(digests)
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"


def _write_index(path: Path, text: str, mode: int) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(descriptor, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fchmod(file.fileno(), mode)
        os.fsync(file.fileno())
