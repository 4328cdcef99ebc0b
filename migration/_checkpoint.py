"""Reading checkpoints: a safetensors file, a sharded directory or a torch pickle, as tensor records.

Opening a checkpoint reads headers only (and, for a torch pickle, maps the file). Tensor data is
read on demand, one tensor at a time, so that only the attention biases a migration changes are
ever materialised; every other tensor is copied byte for byte when the output is written.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_WRAPPERS = ("state_dict", "model")

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
    tensor: Tensor | None = None  # the tensor itself (torch pickles)

    def read(self) -> Tensor:
        """The tensor, read from disk for safetensors sources."""
        if self.tensor is not None:
            return self.tensor
        try:
            with safe_open(self.shard.path, framework="pt") as handle:
                return handle.get_tensor(self.key)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{self.shard.path}: cannot read '{self.key}' ({_one_line(exc)})") from None


@dataclass(eq=False)
class Shard:
    """One file of a checkpoint; ``name`` is kept for the output file."""

    name: str
    path: Path
    metadata: dict[str, str]
    records: dict[str, TensorRecord] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(record.nbytes for record in self.records.values())


@dataclass(eq=False)
class Checkpoint:
    """A checkpoint's layout: ``kind`` is "file", "directory" (one model.safetensors), "sharded" or "torch"."""

    source: Path
    kind: str
    shards: list[Shard]
    index_name: str | None = None
    index_metadata: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def records(self) -> dict[str, TensorRecord]:
        return {key: record for shard in self.shards for key, record in shard.records.items()}

    @property
    def writes_directory(self) -> bool:
        return self.kind in ("directory", "sharded")


def source_kind(source: Path) -> str:
    """Classify SRC by its path alone (no reads): the output's shape follows from it."""
    if source.is_dir():
        return "sharded" if (source / INDEX_NAME).is_file() else "directory"
    name = source.name
    if name.endswith(".index.json"):
        return "sharded"
    if name.endswith(".safetensors"):
        return "file"
    if name.endswith(TORCH_SUFFIXES):
        return "torch"
    raise ValueError(
        f"{source}: unsupported input format; expected a .safetensors file, a directory with "
        f"{INDEX_NAME}, an *.index.json file, or a {'/'.join(TORCH_SUFFIXES)} state dict"
    )


def open_checkpoint(source: Path) -> Checkpoint:
    """Read every header of SRC and check that the files agree with each other; no tensor data is read."""
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such file or directory")
    kind = source_kind(source)
    if kind == "file":
        return Checkpoint(source, kind, [_open_safetensors(source, source.name)])
    if kind == "torch":
        shard, notes = _open_torch(source)
        return Checkpoint(source, kind, [shard], notes=notes)
    if kind == "directory":
        single = source / SINGLE_NAME
        if not single.is_file():
            raise ValueError(
                f"{source}: directory has neither {INDEX_NAME} nor {SINGLE_NAME}; "
                "pass the checkpoint file or its index instead"
            )
        return Checkpoint(source, kind, [_open_safetensors(single, SINGLE_NAME)])
    index_path = source / INDEX_NAME if source.is_dir() else source
    return _open_sharded(source, index_path)


# ------------------------------------------------------------------------------------ safetensors


def _open_safetensors(path: Path, name: str) -> Shard:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    # safe_open validates the whole layout (header, offsets, file length) before we trust offsets.
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
    except SafetensorError as exc:
        raise ValueError(
            f"{path}: not a valid safetensors file ({_one_line(exc)}); it is truncated, corrupt or "
            "another format: re-download or re-save it"
        ) from None
    header, data_start = _read_header(path)
    shard = Shard(name, path, metadata)
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        shard.records[key] = TensorRecord(
            key, entry["dtype"], tuple(entry["shape"]), end - begin, shard, offset=data_start + begin
        )
    return shard


def _read_header(path: Path) -> tuple[dict, int]:
    """The JSON header and the offset where tensor data starts (the file was validated by safe_open)."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    return header, 8 + length


def _open_sharded(source: Path, index_path: Path) -> Checkpoint:
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path}: no such file")
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{index_path}: not a valid index ({exc.msg} at line {exc.lineno}); "
            "expected JSON with a 'weight_map' of tensor name -> shard file"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{index_path}: not a valid index (not UTF-8 text); expected a JSON file") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(key, str) and isinstance(name, str) for key, name in weight_map.items()
    ):
        raise ValueError(
            f"{index_path}: not a valid index: 'weight_map' must map tensor names to shard file names"
        )
    first_key: dict[str, str] = {}
    for key, name in weight_map.items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(
                f"{index_path}: shard name '{name}' (for '{key}') is not a plain file name; "
                "shards must sit beside the index"
            )
        first_key.setdefault(name, key)
    shards = []
    for name in sorted(first_key):
        path = index_path.parent / name
        if not path.is_file():
            raise FileNotFoundError(
                f"{index_path}: shard '{name}' is listed in the weight_map (for '{first_key[name]}') "
                f"but {path} does not exist; restore the shard or fix the index"
            )
        shards.append(_open_safetensors(path, name))
    _check_index_matches(index_path, weight_map, shards)
    metadata = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
    metadata = {key: value for key, value in metadata.items() if key != "total_size"}
    return Checkpoint(source, "sharded", shards, index_name=index_path.name, index_metadata=metadata)


def _check_index_matches(index_path: Path, weight_map: dict[str, str], shards: list[Shard]) -> None:
    seen: dict[str, str] = {}
    for shard in shards:
        for key in shard.records:
            if key in seen:
                raise ValueError(
                    f"{index_path}: '{key}' is stored in both {seen[key]} and {shard.name}; "
                    "keep it in one shard"
                )
            seen[key] = shard.name
            if weight_map.get(key) != shard.name:
                raise ValueError(
                    f"{shard.path}: '{key}' is stored here but the index maps it to "
                    f"{weight_map.get(key)!r}; fix the index"
                )
    for key, name in weight_map.items():
        if key not in seen:
            raise ValueError(
                f"{index_path.parent / name}: '{key}' is listed in the index for this shard but the "
                "shard does not contain it; fix the index"
            )


# ---------------------------------------------------------------------------------- torch pickles


def _open_torch(path: Path) -> tuple[Shard, tuple[str, ...]]:
    loaded = _torch_load(path)
    state_dict, notes = _unwrap_state_dict(path, loaded)
    shard = Shard(path.name, path, {"format": "pt"})
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise ValueError(f"{path}: state-dict key {key!r} is not a string; safetensors keys are strings")
        if not isinstance(value, Tensor):
            raise ValueError(
                f"{path}: '{key}' holds a {type(value).__name__}, not a tensor; safetensors stores tensors "
                "only: save model.state_dict() alone"
            )
        if value.layout != torch.strided or value.is_quantized or value.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"{path}: '{key}' is a {value.layout} {value.dtype} tensor, which safetensors cannot store; "
                "convert it to a dense tensor of a plain dtype first"
            )
        tensor = value.detach().contiguous()
        shard.records[key] = TensorRecord(
            key, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), tensor.numel() * tensor.element_size(), shard,
            tensor=tensor,
        )
    return shard, notes


def _torch_load(path: Path) -> object:
    """``torch.load(weights_only=True)``: a pickle that needs anything but tensors is refused unread."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as exc:
        reason = _one_line(exc)
        if "Weights only load failed" in reason:
            detail = next(
                (line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                "it holds objects other than tensors",
            )
            raise ValueError(
                f"{path}: refused: the pickle needs more than tensors ({detail}) and was not executed; "
                "re-save it from trusted code as torch.save(model.state_dict(), path)"
            ) from None
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({reason})") from None
    except Exception as exc:  # torch raises many types for corrupt files
        raise ValueError(
            f"{path}: not a readable PyTorch checkpoint ({type(exc).__name__}: {_one_line(exc)}); "
            "it is truncated, corrupt or another format"
        ) from None


def _unwrap_state_dict(path: Path, loaded: object) -> tuple[Mapping, tuple[str, ...]]:
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
        f"{path}: holds a {type(loaded).__name__}, not a state dict; expected a dict of tensors, "
        "or one under 'state_dict' or 'model'"
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
