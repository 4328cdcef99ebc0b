"""Writing one safetensors file by streaming: unchanged tensors are copied byte for byte from the source.

The format is an 8-byte little-endian header length, a JSON header mapping each name to its dtype,
shape and ``data_offsets`` (padded with trailing spaces, which the format allows, to a multiple of 8),
then the data. Tensors are laid out by element size, largest first, then by name, as safetensors
itself lays them out, so each starts aligned to its own element size.

Only the few rewritten biases are ever held in memory, so memory stays flat whatever the shard size.
Unchanged tensors that sit back to back in the source are copied as one run, in the kernel
(``copy_file_range``) when source and destination offsets agree within a page, otherwise through a
1 MiB buffer; the header padding is chosen so that most copied bytes agree, where that padding is at
most a thousandth of them (a small file is not grown by up to a page for it).

Sources are read through the descriptors the run opened (see ``._inputs``), never by path again.

Every shard is fsynced before it is closed: the rename that publishes it must never overtake its data.
Companion files (``config.json``, tokenizer files...) are copied byte for byte, and made durable
together by the staging folder's one sync (a model folder may hold thousands of them, and one fsync
each costs a journal commit each). Every file is created readable by its owner only and gets its
final permission bits before it is synced.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from ._inputs import OpenedFile, opened_for_library
from ._records import ITEM_SIZES, TensorRecord
from .report import shown

_CHUNK = 64 * 1024 * 1024  # bytes per kernel copy call: small enough for a smooth bar and a prompt Ctrl-C
_BUFFER = 1024 * 1024  # bytes per user-space copy: fits the CPU caches, measured fastest (benchmarks/)
_PAGE = 4096
_COPY_FALLBACK_ERRORS = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of an output file: copied from ``record``, or written from ``tensor``."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    record: TensorRecord | None = None
    tensor: Tensor | None = None

    @property
    def source(self) -> TensorRecord:
        """The source tensor this output copies: every output tensor not computed here has one."""
        if self.record is None:
            raise RuntimeError(f"'{self.key}' is neither computed nor copied from a source")
        return self.record


def planned_size(tensors: list[OutputTensor], metadata: dict[str, str]) -> int:
    """The size on disk of the file :func:`write_safetensors` writes for these tensors and metadata."""
    blob, ordered, offsets = _layout(tensors, metadata)
    return len(blob) + 8 + offsets[-1]


def write_safetensors(
    path: Path,
    tensors: list[OutputTensor],
    metadata: dict[str, str],
    advance: Callable[[int], object],
    *,
    shown_as: Path | None = None,
    mode: int = 0o644,
) -> int:
    """Write ``tensors`` to the file at ``path`` with permission bits ``mode`` and fsync it; returns its
    size. ``advance(n)`` is called as bytes are written. Messages name the file as ``shown_as`` (where
    it will end up), not as the staging ``path``."""
    blob, ordered, offsets = _layout(tensors, metadata)
    data_start = 8 + len(blob)
    buffer = bytearray(_BUFFER)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_at(target, len(blob).to_bytes(8, "little") + blob, 0)
        for run in _runs(ordered, offsets):
            destination = data_start + run.offset
            if run.data is not None:
                write_at(target, run.data, destination)
                advance(run.length)
                continue
            if run.source is None:  # _runs gives every run its bytes or its source
                raise RuntimeError(f"{shown_as or path}: a tensor's bytes have no source")
            copy_range(
                run.source.descriptor,
                run.source_offset,
                target,
                destination,
                run.length,
                buffer,
                advance,
                source_path=run.source.path,
            )
        os.fchmod(target, mode)
        os.fsync(target)
    finally:
        os.close(target)
    _check_written(path, ordered, shown_as or path)
    return data_start + offsets[-1]


def _layout(tensors: list[OutputTensor], metadata: dict[str, str]) -> tuple[bytes, list[OutputTensor], list[int]]:
    """The padded header, the tensors in file order, and their data offsets (one more: the data's end)."""
    ordered = sorted(tensors, key=lambda tensor: (-ITEM_SIZES.get(tensor.dtype, 1), tensor.key))
    offsets = [0]
    for tensor in ordered:
        offsets.append(offsets[-1] + tensor.nbytes)
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    for tensor, begin, end in zip(ordered, offsets, offsets[1:]):
        header[tensor.key] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [begin, end]}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    data_start = _data_start(8 + len(blob), ordered, offsets)
    return blob + b" " * (data_start - 8 - len(blob)), ordered, offsets  # the format allows trailing spaces


def copy_file(source: OpenedFile, target: Path, advance: Callable[[int], object], *, mode: int = 0o644) -> str:
    """Copy the opened ``source`` (a companion file) to a new file ``target``, byte for byte, with
    permission bits ``mode``; returns the SHA-256 of the bytes copied. Not synced: the caller syncs the
    folder's files at once. The source is checked unchanged once copied (its last read)."""
    output = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        digest = _copy_hashing(source.descriptor, output, source.size, advance, source_path=source.path)
        os.fchmod(output, mode)
    finally:
        os.close(output)
    source.check_unchanged()
    return digest


def _copy_hashing(source: int, target: int, length: int, advance: Callable[[int], object], *, source_path: Path) -> str:
    """Copy through user space, hashing on the way: companion files are small, and the digest lets a
    later ``force`` run recognise them as ours."""
    digest = hashlib.sha256()
    offset = 0
    while offset < length:
        block = os.pread(source, min(_BUFFER, length - offset), offset)
        if not block:
            raise ValueError(
                f"{shown(source_path)}: ended {length - offset} bytes early; it changed while being read: "
                "rerun when nothing writes it"
            )
        digest.update(block)
        write_at(target, block, offset)
        offset += len(block)
        advance(len(block))
    return digest.hexdigest()


@dataclass(frozen=True)
class _Run:
    """Bytes to put at ``offset`` (relative to the data start): from memory, or copied from a file."""

    offset: int
    length: int
    data: memoryview | None = None
    source: OpenedFile | None = None
    source_offset: int = 0


def _runs(ordered: list[OutputTensor], offsets: list[int]) -> list[_Run]:
    """Consecutive tensors that sit back to back in one source file are copied as one run."""
    runs: list[_Run] = []
    for tensor, offset in zip(ordered, offsets):
        record = tensor.record
        in_memory = tensor.tensor if tensor.tensor is not None else (record.tensor if record else None)
        if in_memory is not None:
            flat = in_memory.contiguous().reshape(-1)  # an expanded view (stride 0) is written out in full
            runs.append(_Run(offset, tensor.nbytes, data=flat.view(torch.uint8).numpy().data))
            continue
        record, last = tensor.source, runs[-1] if runs else None
        if last and last.source is record.shard.opened and last.source_offset + last.length == record.data_offset:
            runs[-1] = _Run(
                last.offset, last.length + tensor.nbytes, source=last.source, source_offset=last.source_offset
            )
        else:
            runs.append(_Run(offset, tensor.nbytes, source=record.shard.opened, source_offset=record.data_offset))
    return runs


_PADDING_RATIO = 1000


def _data_start(minimum: int, ordered: list[OutputTensor], offsets: list[int]) -> int:
    """Where the data starts: at least ``minimum``, a multiple of 8, and chosen so that as many copied
    bytes as possible keep their offset within a page, which lets the kernel copy them page by page
    (an unaligned in-kernel copy is slower than copying through a buffer)."""
    by_shift: dict[int, int] = {}
    for tensor, offset in zip(ordered, offsets):
        if tensor.tensor is None and tensor.record is not None and tensor.record.offset is not None:
            shift = (tensor.record.offset - offset) % _PAGE
            by_shift[shift] = by_shift.get(shift, 0) + tensor.nbytes
    aligned = minimum + (-minimum % 8)
    candidates = [shift for shift in by_shift if shift % 8 == 0]
    if not candidates:
        return aligned
    best = max(candidates, key=lambda shift: by_shift[shift])
    padding = (best - aligned) % _PAGE
    # Padding only where it pays: at most a thousandth of the bytes it lets the kernel copy. A small
    # file gets the 8-byte alignment the format needs and nothing more (it would grow by up to 4 KiB).
    return aligned + padding if padding * _PADDING_RATIO <= by_shift[best] else aligned


def write_at(descriptor: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(descriptor, view, offset)
        view, offset = view[written:], offset + written


def copy_range(
    source: int,
    source_offset: int,
    target: int,
    target_offset: int,
    length: int,
    buffer: bytearray,
    advance: Callable[[int], object],
    *,
    source_path: Path,
) -> None:
    """Copy ``length`` bytes between files: in the kernel when both offsets agree within a page
    (``copy_file_range``), otherwise through ``buffer``, which is as fast as ``cp`` for that case."""
    kernel = getattr(os, "copy_file_range", None)
    remaining = length
    while remaining:
        step = min(_CHUNK, remaining)
        copied = 0
        if kernel is not None and (source_offset - target_offset) % _PAGE == 0:
            try:
                copied = kernel(source, target, step, offset_src=source_offset, offset_dst=target_offset)
            except OSError as exc:
                if exc.errno not in _COPY_FALLBACK_ERRORS:
                    raise
                kernel = None  # e.g. across file systems on an old kernel: copy through the buffer
        if copied == 0:
            copied = _copy_through(source, source_offset, target, target_offset, min(step, len(buffer)), buffer)
        if copied == 0:
            raise ValueError(
                f"{shown(source_path)}: ended {remaining} bytes early; it changed while being read: "
                "rerun when nothing writes it"
            )
        source_offset, target_offset, remaining = source_offset + copied, target_offset + copied, remaining - copied
        advance(copied)


def _copy_through(source: int, source_offset: int, target: int, target_offset: int, length: int, buffer) -> int:
    view = memoryview(buffer)[:length]
    read = os.preadv(source, [view], source_offset)
    write_at(target, view[:read], target_offset)
    return read  # 0 at an early end of file: the caller names the file


def _check_written(path: Path, ordered: list[OutputTensor], shown_as: Path) -> None:
    """Re-read the header just written; a mismatch is our bug (every key is checked when it is read),
    so it is an internal invariant, and the output is never moved into place."""
    try:
        with opened_for_library(path) as readable, safe_open(readable, framework="pt") as handle:
            keys = set(handle.keys())
    except SafetensorError as exc:  # pragma: no cover - would be a bug in the writer
        raise RuntimeError(
            f"{shown(shown_as)}: internal error: the output for this file did not read back ({exc}); nothing was "
            "written"
        ) from None
    assert keys == {tensor.key for tensor in ordered}, f"{shown(shown_as)}: written keys differ from the plan"


__all__ = ["OutputTensor", "copy_file", "copy_range", "planned_size", "write_at", "write_safetensors"]
