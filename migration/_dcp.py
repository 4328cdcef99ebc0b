"""Reading a ``torch.distributed.checkpoint`` (DCP) folder as tensor records, in one process.

A DCP folder holds a ``.metadata`` file and ``*.distcp`` data files. The metadata (a pickle) lists
every entry of the saved state dict: a tensor's dtype, global shape and chunks (the pieces the ranks
saved, each a ``torch.save`` blob at a byte range of a data file), or a non-tensor's byte range.

The metadata is unpickled by an unpickler that builds DCP's own record classes, torch's sizes, dtypes
and layouts, and paths, and refuses anything else, so a crafted file cannot run code; each chunk is
read with ``torch.load(weights_only=True)``, from its byte range of the opened data file only, and so
needs the torch release other pickles do (:data:`._torch_pickles.SAFE_PICKLE_TORCH`). A tensor's data
is read only when asked for (:meth:`DcpRecord.read`): a migration materialises the attention biases
it rewrites and copies every other entry byte for byte (:mod:`._dcp_writer`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ._inputs import OpenedFile
from ._records import DTYPE_NAMES, STORED_DTYPES, Checkpoint, Shard, TensorRecord, one_line
from ._torch_pickles import SAFE_PICKLE_TORCH, torch_reads_pickles_safely
from .report import shown

__all__ = [
    "METADATA_NAME",
    "PROVENANCE_NAME",
    "DcpEntries",
    "DcpRecord",
    "as_safetensors_shards",
    "is_dcp_folder",
    "open_dcp",
    "read_metadata",
]

METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
# What this tool adds to a DCP folder it writes: the run's provenance (DCP's metadata has no free-form
# field), read back by the next run as a safetensors file's metadata is.
PROVENANCE_NAME = "slim_mha.json"
_MAX_METADATA_BYTES = 1 << 30
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATH_CLASSES = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}


def is_dcp_folder(source: Path) -> bool:
    """A folder with DCP's ``.metadata`` file (by the path alone: judged again when opened)."""
    return source.is_dir() and os.path.lexists(source / METADATA_NAME)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and the torch and path values they hold; refuses any other class."""

    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)
        if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:  # the latter: Python 3.13
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it needs {module}.{name}, which DCP's metadata never holds")


def read_metadata(opened: OpenedFile):
    """DCP's ``Metadata`` from the opened ``.metadata`` file, or a one-line ``ValueError`` naming it."""
    from torch.distributed.checkpoint.metadata import Metadata

    if opened.size > _MAX_METADATA_BYTES:
        raise ValueError(f"{shown(opened.path)}: {opened.size} bytes is far more than DCP metadata takes")
    try:
        data = opened.read_all(opened.size)
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{shown(opened.path)}: does not read as torch.distributed.checkpoint metadata ({shown(one_line(exc))}); "
            "pass a folder that dcp.save wrote"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"{shown(opened.path)}: holds {type(metadata).__name__}, not DCP metadata")
    return metadata


@dataclass(eq=False)
class DcpRecord(TensorRecord):
    """A DCP tensor: its chunks, each ``(offsets, sizes, storage)`` with ``storage`` DCP's byte range
    (relative_path, offset, length) in the folder's data files."""

    chunks: list = field(default_factory=list)
    data_files: dict[str, OpenedFile] = field(default_factory=dict)

    def read(self) -> Tensor:
        """The whole tensor, assembled from its chunks (each ``torch.load``-ed from its byte range); a
        tensor saved whole is its one chunk, not a copy of it."""
        dtype = STORED_DTYPES[self.dtype]
        tensor = None if len(self.chunks) == 1 else torch.empty(self.shape, dtype=dtype)
        for offsets, sizes, storage in self.chunks:
            chunk = self.read_chunk(storage)
            if tuple(chunk.shape) != tuple(sizes) or chunk.dtype != dtype:
                raise ValueError(
                    f"{shown(self.shard.path)}: '{shown(self.key)}' has a chunk of {tuple(chunk.shape)} {chunk.dtype} "
                    f"where the metadata says {tuple(sizes)} {dtype}; the folder is inconsistent"
                )
            if tensor is None:
                return chunk.contiguous()
            tensor[tuple(slice(start, start + size) for start, size in zip(offsets, sizes))] = chunk
        return tensor if tensor is not None else torch.empty(self.shape, dtype=dtype)

    def read_chunk(self, storage) -> Tensor:
        reader = io.BufferedReader(_Range(self.data_files[storage.relative_path], storage.offset, storage.length))
        try:
            chunk = torch.load(reader, map_location="cpu", weights_only=True)
        except Exception as exc:  # the weights-only unpickler's refusals and a corrupt zip alike
            raise ValueError(
                f"{shown(self.shard.path)}: cannot read a chunk of '{shown(self.key)}' ({shown(one_line(exc))})"
            ) from None
        if not isinstance(chunk, Tensor):
            raise ValueError(f"{shown(self.shard.path)}: a chunk of '{shown(self.key)}' is not a tensor")
        return chunk


@dataclass
class DcpEntries:
    """The parts of a DCP folder the writer needs beside the records: the metadata as read, the data
    files by their relative path, and each entry's storage items, by fully qualified name."""

    metadata: object
    data_files: dict[str, OpenedFile]
    items: dict[str, list] = field(default_factory=dict)  # fqn -> [(MetadataIndex, storage)], in file order


def open_dcp(source: Path, opened_metadata: OpenedFile, open_data) -> tuple[Checkpoint, DcpEntries]:
    """SRC's records (one shard per data file, each tensor in the file of its first chunk) and entries.

    ``open_data(path, listed)`` opens a data file the metadata names (raising if it is missing or not
    SRC's). Raises ``ValueError`` for metadata that refers to data that is not there, or that is not
    put together as DCP puts it (a record of one class where another belongs).
    """
    try:
        return _open_dcp(source, opened_metadata, open_data)
    except (AttributeError, TypeError) as exc:
        raise ValueError(
            f"{shown(opened_metadata.path)}: is not put together as DCP writes its metadata ({shown(one_line(exc))}); "
            "pass a folder that dcp.save wrote"
        ) from None


def _open_dcp(source: Path, opened_metadata: OpenedFile, open_data) -> tuple[Checkpoint, DcpEntries]:
    metadata_path = opened_metadata.path
    if not torch_reads_pickles_safely():
        raise ValueError(
            f"{shown(source)}: a DCP folder's chunks are torch pickles, and torch {torch.__version__} reads them "
            f"unsafely; install torch >= {'.'.join(map(str, SAFE_PICKLE_TORCH))} to migrate it"
        )
    metadata = read_metadata(opened_metadata)
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise ValueError(f"{shown(metadata_path)}: has no storage records; not a folder FileSystemWriter wrote")
    entries = DcpEntries(metadata, {})
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(index.fqn, str) or not isinstance(info.offset, int) or not isinstance(info.length, int):
            raise TypeError(
                f"an entry's index or byte range is not DCP's: {type(index).__name__}, {type(info).__name__}"
            )
        if not isinstance(relative, str) or Path(relative).name != relative or not relative.endswith(DATA_SUFFIX):
            raise ValueError(
                f"{shown(metadata_path)}: names the data file {shown(repr(relative))}, not one in the folder"
            )
        if getattr(info, "transform_descriptors", None):
            raise ValueError(
                f"{shown(metadata_path)}: '{shown(index.fqn)}' is stored through {info.transform_descriptors} "
                "(a compressing extension), which this tool does not read; save the checkpoint without it"
            )
        if relative not in entries.data_files:
            entries.data_files[relative] = open_data(source / relative, f"{shown(metadata_path)} lists it")
        size = entries.data_files[relative].size
        if not (0 <= info.offset and info.length >= 0 and info.offset + info.length <= size):
            raise ValueError(
                f"{shown(metadata_path)}: '{shown(index.fqn)}' lies at bytes {info.offset}+{info.length} of "
                f"{shown(source / relative)}, which holds {size}; the data file is truncated or another save's"
            )
        entries.items.setdefault(index.fqn, []).append((index, info))
    shards = {name: Shard(name, source / name, {}, file=opened) for name, opened in sorted(entries.data_files.items())}
    for fqn, described in metadata.state_dict_metadata.items():
        if fqn not in entries.items:
            raise ValueError(f"{shown(metadata_path)}: '{shown(fqn)}' has no data in any file of the folder")
        if hasattr(described, "chunks"):
            record = _record(fqn, described, entries, shards, metadata_path)
            record.shard.records[fqn] = record
    checkpoint = Checkpoint(source, "dcp", list(shards.values()), index_name=METADATA_NAME, index_path=metadata_path)
    checkpoint.index_file = opened_metadata
    return checkpoint, entries


def as_safetensors_shards(checkpoint: Checkpoint, index_name: str) -> Checkpoint:
    """The DCP folder as a sharded safetensors checkpoint to write: one shard per data file that holds
    tensors (HF's names, in order) and an index; non-tensor entries cannot go into safetensors and are
    left out, with a note. The writer reads a shard's tensors (:meth:`DcpRecord.read`) as it writes it."""
    holding = [shard for shard in checkpoint.shards if shard.records]
    for number, shard in enumerate(holding, 1):
        shard.name = f"model-{number:05d}-of-{len(holding):05d}.safetensors"
    records = checkpoint.records
    described = getattr(checkpoint.entries, "metadata", None)
    others = sorted(fqn for fqn in getattr(described, "state_dict_metadata", {}) if fqn not in records)
    notes = (f"left out {len(others)} non-tensor entries, which safetensors cannot hold: {', '.join(others[:5])}",)
    view = dataclasses.replace(
        checkpoint,
        kind="sharded",
        shards=holding,
        index_name=index_name,
        notes=checkpoint.notes + (notes if others else ()),
        other_inputs=[*checkpoint.other_inputs, *(shard.path for shard in checkpoint.shards if not shard.records)],
    )
    view.files, view.index_file = checkpoint.files, checkpoint.index_file
    return view


def provenance(opened: OpenedFile | None) -> dict[str, str]:
    """What an earlier run of this tool recorded in the folder (its ``slim_mha.json``); empty if none."""
    if opened is None:
        return {}
    try:
        recorded = json.loads(opened.read_all(min(opened.size, 1 << 20)))
    except (ValueError, RecursionError):
        return {}
    return {str(k): str(v) for k, v in recorded.items()} if isinstance(recorded, dict) else {}


def _record(fqn: str, described, entries: DcpEntries, shards: dict[str, Shard], metadata_path: Path) -> DcpRecord:
    dtype = described.properties.dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{shown(metadata_path)}: '{shown(fqn)}' is {dtype}, which this tool does not convert")
    by_offset = {tuple(index.offset): info for index, info in entries.items[fqn] if index.offset is not None}
    chunks, covered = [], 0
    for chunk in described.chunks:
        info = by_offset.get(tuple(chunk.offsets))
        if info is None:
            raise ValueError(
                f"{shown(metadata_path)}: a chunk of '{shown(fqn)}' at {tuple(chunk.offsets)} has no data in the folder"
            )
        chunks.append((tuple(chunk.offsets), tuple(chunk.sizes), info))
        covered += torch.Size(chunk.sizes).numel()
    shape = tuple(described.size)
    if covered != torch.Size(shape).numel():
        raise ValueError(
            f"{shown(metadata_path)}: the chunks of '{shown(fqn)}' cover {covered} of its {torch.Size(shape).numel()} "
            "elements; the folder is missing part of it"
        )
    home = shards[chunks[0][2].relative_path] if chunks else next(iter(shards.values()))
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return DcpRecord(fqn, DTYPE_NAMES[dtype], shape, nbytes, home, chunks=chunks, data_files=entries.data_files)


class _Range(io.RawIOBase):
    """A byte range of an opened file as a seekable stream, read through its descriptor: ``torch.load``
    reads a chunk's storage straight into the tensor, with no copy of the blob in between."""

    def __init__(self, opened: OpenedFile, offset: int, length: int) -> None:
        super().__init__()
        self._opened, self._start, self._length, self._position = opened, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:
        count = min(len(buffer), max(0, self._length - self._position))
        if not count:
            return 0
        read = os.preadv(self._opened.descriptor, [memoryview(buffer)[:count]], self._start + self._position)
        self._position += read
        return read
