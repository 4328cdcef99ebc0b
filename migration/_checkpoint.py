"""Reading checkpoints: a safetensors file, a sharded directory or a torch pickle, as tensor records.

Opening a checkpoint reads each file's header once (and, for a torch pickle, maps the file). Tensor
data is read on demand, straight from its byte range, so that only the attention tensors a migration
needs are ever materialised; every other tensor is copied byte for byte when the output is written.
The cost of a run is therefore linear in the number of tensors: no read re-parses a header.

Every file is opened once, judged by the descriptor that was opened, and read through it only (see
:mod:`._inputs`): a named pipe or a device is refused unopened, a link leaving SRC is refused before a
byte is parsed, and a file that changes meanwhile is caught by :meth:`Checkpoint.check_unchanged`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from packaging.version import Version
from safetensors import SafetensorError, safe_open
from torch import Tensor

from ._inputs import InputProblem, OpenedFile, open_input
from .report import shown, with_article

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TORCH_INDEX_NAME = "pytorch_model.bin.index.json"
TORCH_SINGLE_NAME = "pytorch_model.bin"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_WRAPPERS = ("state_dict", "model")
# How a torch.save file starts: a zip archive (the default since torch 1.6; an empty one has only its end
# record), or the legacy format, a pickle of protocol 2 or later. Anything else is not a torch checkpoint.
_TORCH_MAGIC = (b"PK\x03\x04", b"PK\x05\x06", b"\x80")
# torch.load(weights_only=True) is unsafe on a crafted file before this release: 2.6 closed a bypass,
# and 2.10.0 a heap corruption in the weights-only unpickler that can run code (GHSA-63cw-57p8-fm3p).
# A pre-release or dev build of it may predate the fix, so only a release counts.
SAFE_PICKLE_TORCH = (2, 10, 0)

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
                f"{shown(self.shard.path)}: cannot read '{shown(self.key)}' ({shown(_one_line(exc))})"
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
    """A checkpoint's layout: ``kind`` is "file", "directory" (one model file), "sharded" or "torch".

    ``index_name`` is the output index's name; ``index_path`` the index that was read.
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
        return self.kind in ("directory", "sharded")

    def recorded(self, key: str) -> list[tuple[Path, object]]:
        """Each value of metadata ``key`` stored in the files (shards, then the index), with its file."""
        found: list[tuple[Path, object]] = [(s.path, s.metadata[key]) for s in self.shards if key in s.metadata]
        if self.index_path is not None and key in self.index_metadata:
            found.append((self.index_path, self.index_metadata[key]))
        return found


def source_kind(source: Path) -> str:
    """Classify SRC by its path alone (no reads): the output's shape follows from it."""
    if source.is_dir():
        has_index = any(_present(source / name) for name in (INDEX_NAME, TORCH_INDEX_NAME))
        return "sharded" if has_index else "directory"
    name = source.name
    if name.endswith(".index.json"):
        return "sharded"
    if name.endswith(".safetensors"):
        return "file"
    if name.endswith(TORCH_SUFFIXES):
        return "torch"
    raise ValueError(
        f"{shown(source)}: unsupported input format; expected a .safetensors file, a directory with "
        f"{INDEX_NAME} or {TORCH_INDEX_NAME}, an *.index.json file, or a {'/'.join(TORCH_SUFFIXES)} "
        "state dict"
    )


def open_checkpoint(source: Path, *, follow_outside_links: bool = False) -> Checkpoint:
    """Open every file of SRC once, read every header and check that the files agree with each other;
    no tensor data is read. The files stay open until :meth:`Checkpoint.close`.

    A shard or index that a symbolic link takes outside SRC's folder is refused before a byte of it is
    parsed, unless ``follow_outside_links``; a file SRC is the file the user named, read wherever it is.
    """
    opener = _Opener(follow_outside_links)
    try:
        checkpoint = _open_layout(source, opener)
    except BaseException:
        opener.close()
        raise
    checkpoint.files = opener.files
    if checkpoint.recorded("slim_mha.value_bias_folded"):  # written by an earlier --fold-value-bias run
        checkpoint.notes += (
            "an earlier run folded the value bias into out_proj.bias (slim_mha.value_bias_folded): these "
            "weights compute the original model's outputs in eval mode only",
        )
    return checkpoint


class _Opener:
    """Opens the run's inputs (:func:`._inputs.open_input`) and keeps them, so that all are closed together."""

    def __init__(self, follow_outside_links: bool) -> None:
        self.follow_outside_links = follow_outside_links
        self.files: list[OpenedFile] = []

    def open(self, path: Path, root: Path | None, fix: str, *, listed: str = "") -> OpenedFile:
        """``path`` opened and judged; a problem is raised naming it (after ``listed``, for a shard an index
        lists), with ``fix``."""
        try:
            opened = open_input(path, root, follow_outside_links=self.follow_outside_links)
        except InputProblem as problem:
            if problem.complete:
                raise
            if problem.missing:
                where = f"{listed} but {shown(path)} does not exist" if listed else f"{shown(path)}: no such file"
                raise FileNotFoundError(where + (f"; {fix}" if listed else "")) from None
            where = f"{listed} but {shown(path)}" if listed else f"{shown(path)}:"
            raise ValueError(f"{where} {problem.problem}; {fix}") from None
        self.files.append(opened)
        return opened

    def close(self) -> None:
        for opened in self.files:
            opened.close()


def _open_layout(source: Path, opener: _Opener) -> Checkpoint:
    if not _present(source):
        raise FileNotFoundError(f"{shown(source)}: no such file or directory")
    kind = source_kind(source)
    if kind in ("file", "torch"):
        opened = opener.open(source, None, "pass the checkpoint file itself")
        if kind == "file":
            return Checkpoint(source, kind, [_open_safetensors(opened, source.name)])
        shard, notes = _open_torch(opened, source.name)
        return Checkpoint(source, kind, [shard], notes=notes)
    folder = source if source.is_dir() else source.parent
    root = Path(os.path.realpath(folder))  # every file read must lie in it (see _inputs)
    if kind == "directory":
        single = lone_checkpoint_file(source)
        opened = opener.open(single, root, "replace it with the checkpoint file")
        if single.name.endswith(".safetensors"):
            return Checkpoint(source, kind, [_open_safetensors(opened, single.name)])
        shard, notes = _open_torch(opened, output_name(single.name))
        return Checkpoint(source, kind, [shard], notes=notes)
    if source.is_dir():
        index_path = next(source / name for name in (INDEX_NAME, TORCH_INDEX_NAME) if _present(source / name))
        index = opener.open(index_path, root, "pass the index file itself")
    else:
        index_path = source
        index = opener.open(index_path, None, "pass the index file itself")
    return _open_sharded(source, index, root, opener)


def lone_checkpoint_file(folder: Path) -> Path:
    """The one weight file of a folder without an index: Hugging Face's names first, else the only
    ``.safetensors`` or torch file it holds, under any name. Refuses none or several, naming them."""
    for name in (SINGLE_NAME, TORCH_SINGLE_NAME):
        if _present(folder / name):
            return folder / name
    found = sorted(
        name
        for name in os.listdir(folder)
        if name.endswith((".safetensors", *TORCH_SUFFIXES)) and not os.path.isdir(folder / name)
    )
    if len(found) == 1:
        return folder / found[0]
    held = (
        f"holds {len(found)} weight files ({', '.join(shown(name) for name in found[:4])})"
        if found
        else ("holds no weight file (.safetensors, .pt, .pth, .bin, .ckpt)")
    )
    raise ValueError(
        f"{shown(folder)}: directory has no index ({INDEX_NAME} or {TORCH_INDEX_NAME}) and {held}; pass the "
        "checkpoint file or its index instead"
    )


def output_name(name: str) -> str:
    """The safetensors name a torch shard is written under, as Hugging Face names them:
    ``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``."""
    if name.endswith(".index.json"):
        return output_name(name.removesuffix(".index.json")) + ".index.json"
    for suffix in TORCH_SUFFIXES:
        if name.endswith(suffix):
            stem = name.removesuffix(suffix)
            return (stem.replace("pytorch_model", "model", 1) if stem.startswith("pytorch_model") else stem) + (
                ".safetensors"
            )
    return name


# ---------------------------------------------------------------------------------- files on disk


def _present(path: Path) -> bool:
    """Whether anything is at ``path``: a dangling symlink counts, so that it can be reported as one."""
    return path.exists() or path.is_symlink()


# ------------------------------------------------------------------------------------ safetensors


def _open_safetensors(opened: OpenedFile, name: str) -> Shard:
    # safe_open validates the whole layout (header, offsets, file length) before we trust offsets; it
    # reads the opened file itself (its /proc/self/fd path). The header is then parsed once more, here,
    # for the offsets that safe_open does not expose.
    path = opened.path
    try:
        with safe_open(opened.readable_path(), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
    except SafetensorError as exc:
        raise ValueError(
            f"{shown(path)}: not a valid safetensors file ({shown(_one_line(exc))}); it is truncated, corrupt "
            "or another format: re-download or re-save it"
        ) from None
    header, data_start = _read_header(opened)
    shard = Shard(name, path, metadata, file=opened)
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        shard.records[key] = TensorRecord(
            key, entry["dtype"], tuple(entry["shape"]), end - begin, shard, offset=data_start + begin
        )
    return shard


def _read_header(opened: OpenedFile) -> tuple[dict, int]:
    """The JSON header and the offset where tensor data starts (the file was validated by safe_open)."""
    length = int.from_bytes(opened.read_at(8, 0), "little")
    header = json.loads(_read_all(opened, length, 8))
    return header, 8 + length


def _read_all(opened: OpenedFile, length: int, offset: int = 0) -> bytes:
    chunks, done = [], 0
    while done < length:
        chunk = opened.read_at(length - done, offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def _open_sharded(source: Path, opened_index: OpenedFile, root: Path, opener: _Opener) -> Checkpoint:
    index_path = opened_index.path
    index, weight_map = _read_index(opened_index)
    first_key = _shard_names(index_path, weight_map)
    shards: list[Shard] = []
    written_as: dict[str, str] = {}  # output shard name -> the input shard written under it
    notes: list[str] = []
    for name in sorted(first_key):
        path = index_path.parent / name
        listed = (
            f"{shown(index_path)}: shard '{shown(name)}' is listed in the weight_map (for '{shown(first_key[name])}')"
        )
        out = output_name(name)
        if out in written_as:
            raise ValueError(
                f"{shown(index_path)}: shards '{shown(written_as[out])}' and '{shown(name)}' would both be written "
                f"as '{shown(out)}'; rename one of them"
            )
        written_as[out] = name
        if not name.endswith((".safetensors", *TORCH_SUFFIXES)):
            raise ValueError(
                f"{listed} but it is neither .safetensors nor {'/'.join(TORCH_SUFFIXES)}; shards must be "
                "safetensors files or torch state dicts"
            )
        fix = (
            "restore the shard or fix the index" if not _present(path) else "put the shard file there or fix the index"
        )
        opened = opener.open(path, root, fix, listed=listed)
        if name.endswith(".safetensors"):
            shards.append(_open_safetensors(opened, out))
        else:
            shard, shard_notes = _open_torch(opened, out)
            notes += [f"{name}: {note}" for note in shard_notes]
            shards.append(shard)
    _check_index_matches(index_path, weight_map, shards)
    given = index.get("metadata")
    metadata = {key: value for key, value in given.items() if key != "total_size"} if isinstance(given, dict) else {}
    return Checkpoint(
        source,
        "sharded",
        shards,
        index_name=output_name(index_path.name),
        index_metadata=metadata,
        notes=tuple(notes),
        index_path=index_path,
        index_file=opened_index,
    )


def _read_index(opened_index: OpenedFile) -> tuple[dict, dict[str, str]]:
    """The index's JSON and its ``weight_map`` (tensor name -> shard file), each checked."""
    index_path = opened_index.path
    try:
        index = json.loads(_read_all(opened_index, opened_index.size).decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{shown(index_path)}: not a valid index ({exc.msg} at line {exc.lineno}); "
            "expected JSON with a 'weight_map' of tensor name -> shard file"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{shown(index_path)}: not a valid index (not UTF-8 text); expected a JSON file") from None
    except RecursionError:
        raise ValueError(
            f"{shown(index_path)}: not a valid index (its JSON is nested too deeply to read); expected a "
            "'weight_map' of tensor name -> shard file"
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(key, str) and isinstance(name, str) for key, name in weight_map.items()
    ):
        raise ValueError(
            f"{shown(index_path)}: not a valid index: 'weight_map' must map tensor names to shard file names"
        )
    return index, weight_map


def _shard_names(index_path: Path, weight_map: dict[str, str]) -> dict[str, str]:
    """Each shard the index names, with the first tensor it names it for; refuses a name that is not
    a plain file name beside the index."""
    first_key: dict[str, str] = {}
    for key, name in weight_map.items():
        if "\0" in name:
            raise ValueError(
                f"{shown(index_path)}: shard name '{shown(name)}' (for '{shown(key)}') holds a NUL byte, which no "
                "file name can; fix the index"
            )
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(
                f"{shown(index_path)}: shard name '{shown(name)}' (for '{shown(key)}') is not a plain file name; "
                "shards must sit beside the index"
            )
        first_key.setdefault(name, key)
    return first_key


def _check_index_matches(index_path: Path, weight_map: dict[str, str], shards: list[Shard]) -> None:
    seen: dict[str, Shard] = {}
    for shard in shards:
        for key in shard.records:
            if key in seen:
                raise ValueError(
                    f"{shown(index_path)}: '{shown(key)}' is stored in both {shown(seen[key].path.name)} and "
                    f"{shown(shard.path.name)}; keep it in one shard"
                )
            seen[key] = shard
            if weight_map.get(key) != shard.path.name:
                raise ValueError(
                    f"{shown(shard.path)}: '{shown(key)}' is stored here but the index maps it to "
                    f"{shown(repr(weight_map.get(key)))}; fix the index"
                )
    for key, name in weight_map.items():
        if key not in seen:
            raise ValueError(
                f"{shown(index_path.parent / name)}: '{shown(key)}' is listed in the index for this shard but the "
                "shard does not contain it; fix the index"
            )


# ---------------------------------------------------------------------------------- torch pickles


def _open_torch(opened: OpenedFile, name: str) -> tuple[Shard, tuple[str, ...]]:
    path = opened.path
    loaded = _torch_load(opened)
    state_dict, notes = _unwrap_state_dict(path, loaded)
    shard = Shard(name, path, {"format": "pt"}, file=opened)
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise ValueError(
                f"{shown(path)}: state-dict key {shown(repr(key))} is not a string; safetensors keys are strings"
            )
        _check_key(path, key)
        if not isinstance(value, Tensor):
            raise ValueError(
                f"{shown(path)}: '{shown(key)}' holds {with_article(type(value).__name__)}, not a tensor; safetensors stores "
                "tensors only: save model.state_dict() alone"
            )
        if value.layout != torch.strided or value.is_quantized or value.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"{shown(path)}: '{shown(key)}' is a {value.layout} {value.dtype} tensor, which safetensors cannot "
                "store; convert it to a dense tensor of a plain dtype first"
            )
        if value.device.type == "meta":
            raise ValueError(
                f"{shown(path)}: '{shown(key)}' is a meta tensor, which holds no data; save the state dict of a "
                "model whose weights are loaded, not one built on the meta device"
            )
        # Not made contiguous here: an expanded tensor (stride 0) would be materialised before the run
        # can refuse it; its size and its storage's are recorded, and the migration decides.
        tensor = value.detach()
        shard.records[key] = TensorRecord(
            key,
            DTYPE_NAMES[tensor.dtype],
            tuple(tensor.shape),
            tensor.numel() * tensor.element_size(),
            shard,
            tensor=tensor,
            stored=tensor.untyped_storage().nbytes(),
        )
    return shard, notes


def _check_key(path: Path, key: str) -> None:
    """Refuse, before anything is written, a key that the safetensors header cannot hold."""
    if key == "__metadata__":
        raise ValueError(
            f"{shown(path)}: a tensor is named '__metadata__', the name safetensors reserves for its metadata; "
            "rename that key in the state dict"
        )
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{shown(path)}: the key {shown(ascii(key))} is not valid Unicode text (it holds a lone surrogate), "
            "which a safetensors header cannot store; rename that key in the state dict"
        ) from None


def torch_reads_pickles_safely(version: str | None = None) -> bool:
    """Whether this torch's ``weights_only`` unpickler is one that a crafted file cannot break out of:
    a release (not a pre-release or dev build) at or after :data:`SAFE_PICKLE_TORCH`."""
    parsed = Version(version or torch.__version__)
    return parsed.release[:3] >= SAFE_PICKLE_TORCH and not (parsed.is_prerelease or parsed.is_devrelease)


def _torch_load(opened: OpenedFile) -> object:
    """``torch.load(weights_only=True)`` of the opened file: a pickle that needs anything but tensors is
    refused unread.

    Bytes that do not start like a torch.save file are refused before unpickling, so that a corrupt or
    foreign file is called what it is, not a pickle that needs more than tensors. A zip archive whose
    entries are compressed is refused before torch opens it: torch.save never compresses, and a
    compressed entry can expand far beyond the file's size.
    """
    path = opened.path
    if not torch_reads_pickles_safely():
        raise ValueError(
            f"{shown(path)}: refused: reading a pickle (.pt, .bin...) needs a torch release >= "
            f"{'.'.join(map(str, SAFE_PICKLE_TORCH))}, whose weights-only unpickler a crafted file cannot use to "
            f"run code, and this is torch {torch.__version__}; upgrade torch, or save the weights as safetensors"
        )
    corrupt = f"{shown(path)}: not a readable PyTorch checkpoint ({{}}); it is truncated, corrupt or another format"
    start = opened.read_at(4, 0)
    if not start.startswith(_TORCH_MAGIC):
        what = "it is empty" if not start else "it starts with neither a zip header nor a pickle header"
        raise ValueError(corrupt.format(what))
    if start.startswith(b"PK"):
        _check_stored_zip(opened, corrupt)
    readable = opened.readable_path()
    try:
        try:
            return torch.load(readable, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(readable, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as exc:
        reason = _one_line(exc)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # The weights-only unpickler's own complaint, without torch's advice around it.
        detail = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line or "Can only" in line), None)
        if "Weights only load failed" in reason and detail and "Unsupported operand" not in detail:
            raise ValueError(
                f"{shown(path)}: refused: the pickle needs more than tensors ({shown(detail)}) and was not "
                "executed; re-save it from trusted code as torch.save(model.state_dict(), path)"
            ) from None
        raise ValueError(corrupt.format(shown(detail or reason))) from None
    except Exception as exc:  # torch raises many types for corrupt files
        raise ValueError(corrupt.format(f"{type(exc).__name__}: {shown(_one_line(exc))}")) from None


def _check_stored_zip(opened: OpenedFile, corrupt: str) -> None:
    """Read the zip's central directory only (no entry is inflated) and refuse compressed entries."""
    path = opened.path
    try:
        with io.FileIO(os.dup(opened.descriptor), "rb") as file, zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ValueError(corrupt.format(f"a damaged zip archive: {shown(_one_line(exc))}")) from None
    packed = next((entry for entry in entries if entry.compress_type != zipfile.ZIP_STORED), None)
    if packed is not None:
        raise ValueError(
            f"{shown(path)}: a compressed zip archive ('{shown(packed.filename)}' is compressed); torch.save "
            "never compresses, and a compressed entry can expand without bound: re-save it with torch.save"
        )


def _unwrap_state_dict(path: Path, loaded: object) -> tuple[Mapping, tuple[str, ...]]:
    """The state dict itself, or the one under 'state_dict' (Lightning, many trainers) or 'model'."""
    notes: tuple[str, ...] = ()
    if isinstance(loaded, Mapping):
        for wrapper in _WRAPPERS:
            inner = loaded.get(wrapper)
            if isinstance(inner, Mapping):
                others = sorted(str(key) for key in loaded if key != wrapper)
                note = f"read the state dict under '{wrapper}'"
                notes = (note + (f"; ignored: {', '.join(others)}" if others else ""),)
                return inner, notes
        return loaded, notes
    raise ValueError(
        f"{shown(path)}: holds {with_article(type(loaded).__name__)}, not a state dict; expected a dict of tensors, "
        "or one under 'state_dict' or 'model'"
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
