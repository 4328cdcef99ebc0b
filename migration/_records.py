"""What a checkpoint holds, as records: its tensors (where each is and what it is, without its
data), its files, the checkpoint; and the dtypes a safetensors file stores.

The readers of each format (:mod:`._checkpoint`, :mod:`._torch_pickles`) make these; the plan, the
writer and the verification read them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ._inputs import OpenedFile
from .report import shown

__all__ = [
    "DTYPE_NAMES",
    "FLOAT_DTYPES",
    "ITEM_SIZES",
    "STORED_DTYPES",
    "Checkpoint",
    "Shard",
    "TensorRecord",
    "one_line",
]

# safetensors dtype names, and the bytes per element (tensors are laid out largest first so that
# each one starts aligned to its own element size, as safetensors itself writes them).
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
# Stored by safetensors under these names where both libraries know them (older versions lack them):
# a .pt tensor of such a dtype converts exactly as the same tensor in a .safetensors file does.
for _name, _dtype_name in (("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
    if hasattr(torch, _dtype_name):
        DTYPE_NAMES[getattr(torch, _dtype_name)] = _name
STORED_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
ITEM_SIZES = {name: torch.empty((), dtype=dtype).element_size() for dtype, name in DTYPE_NAMES.items()}
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(eq=False)
class TensorRecord:
    """One stored tensor: where it is and what it is, without its data."""

    key: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int
    shard: Shard
    offset: int | None = None  # absolute byte offset of the data in shard.path (safetensors sources)
    tensor: Tensor | None = None  # the tensor itself (torch pickles), possibly not contiguous
    stored: int | None = None  # bytes of the storage it views (torch pickles): less than nbytes when expanded

    @property
    def data_offset(self) -> int:
        """Where the data starts in the shard's file: safetensors sources only (a torch pickle's records
        carry the tensor itself)."""
        if self.offset is None:
            raise RuntimeError(f"{self.shard.path}: '{self.key}' has no byte range (a torch file's tensor)")
        return self.offset

    def read(self) -> Tensor:
        """The tensor: read from its byte range of the opened shard for safetensors sources (the header
        is not parsed again)."""
        if self.tensor is not None:
            return self.tensor.contiguous()
        data = bytearray(self.nbytes)
        try:
            view, filled = memoryview(data), 0
            while filled < self.nbytes:
                count = os.preadv(self.shard.opened.descriptor, [view[filled:]], self.data_offset + filled)
                if not count:
                    raise OSError(f"the file ends {self.nbytes - filled} bytes early; it changed while being read")
                filled += count
        except OSError as exc:
            raise ValueError(
                f"{shown(self.shard.path)}: cannot read '{shown(self.key)}' ({shown(one_line(exc))})"
            ) from None
        dtype = STORED_DTYPES[self.dtype]
        if not data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(self.shape)


@dataclass(eq=False)
class Shard:
    """One file of a checkpoint: ``path`` is read; ``name`` is the output file's name (a ``.bin`` shard
    becomes ``.safetensors``)."""

    name: str
    path: Path
    metadata: dict[str, str]
    records: dict[str, TensorRecord] = field(default_factory=dict)
    file: OpenedFile | None = None  # open for the run's length: every read of its bytes goes through it

    @property
    def nbytes(self) -> int:
        return sum(record.nbytes for record in self.records.values())

    @property
    def opened(self) -> OpenedFile:
        """The file, opened: every shard is opened before any of its bytes are read."""
        if self.file is None:
            raise RuntimeError(f"{self.path}: read before it was opened")
        return self.file


@dataclass(eq=False)
class Checkpoint:
    """A checkpoint's layout: ``kind`` is "file", "directory" (one model file), "sharded", "torch" or
    "dcp" (a ``torch.distributed.checkpoint`` folder).

    ``index_name`` is the output index's name; ``index_path`` the index that was read (a DCP folder's
    ``.metadata``). ``other_inputs``: files read beside those (a DCP folder's provenance); ``entries``:
    what a format's writer needs beyond the records (:class:`._dcp.DcpEntries`).
    """

    source: Path
    kind: str
    shards: list[Shard]
    index_name: str | None = None
    index_metadata: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    index_path: Path | None = None
    files: list[OpenedFile] = field(default_factory=list)  # every input opened: shards and index
    index_file: OpenedFile | None = None
    other_inputs: list[Path] = field(default_factory=list)
    entries: object | None = None

    @property
    def output_index_name(self) -> str:
        """The output index's name: a sharded checkpoint has one."""
        if self.index_name is None:
            raise RuntimeError(f"{self.source}: a {self.kind} checkpoint has no index")
        return self.index_name

    @property
    def opened_index(self) -> OpenedFile:
        """The index file that was read, opened: a sharded checkpoint has one."""
        if self.index_file is None:
            raise RuntimeError(f"{self.source}: a {self.kind} checkpoint has no index file")
        return self.index_file

    def check_unchanged(self) -> None:
        """Fail, naming the file, if any input was replaced or written to since it was opened."""
        for opened in self.files:
            opened.check_unchanged()

    def close(self) -> None:
        for opened in self.files:
            opened.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def records(self) -> dict[str, TensorRecord]:
        return {key: record for shard in self.shards for key, record in shard.records.items()}

    @property
    def writes_directory(self) -> bool:
        return self.kind in ("directory", "sharded", "dcp")

    def recorded(self, key: str) -> list[tuple[Path, object]]:
        """Each value of metadata ``key`` stored in the files (shards, then the index), with its file."""
        found: list[tuple[Path, object]] = [(s.path, s.metadata[key]) for s in self.shards if key in s.metadata]
        if self.index_path is not None and key in self.index_metadata:
            found.append((self.index_path, self.index_metadata[key]))
        return found


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
