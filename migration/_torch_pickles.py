"""Reading a torch pickle (``.pt``, ``.bin``...) as tensor records, without running what it holds.

``torch.load(weights_only=True)``, memory-mapped, of the opened descriptor only; refused unread where
this torch's unpickler is not one a crafted file cannot break out of, where the bytes are not a
torch.save file, and where a zip archive is compressed.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch
from packaging.version import Version
from torch import Tensor

from ._inputs import OpenedFile
from ._records import DTYPE_NAMES, Shard, TensorRecord, one_line
from .report import shown, with_article

__all__ = ["SAFE_PICKLE_TORCH", "open_torch", "check_key", "torch_reads_pickles_safely"]

_WRAPPERS = ("state_dict", "model")
# How a torch.save file starts: a zip archive (the default since torch 1.6; an empty one has only its end
# record), or the legacy format, a pickle of protocol 2 or later. Anything else is not a torch checkpoint.
_TORCH_MAGIC = (b"PK\x03\x04", b"PK\x05\x06", b"\x80")
# torch.load(weights_only=True) is unsafe on a crafted file before this release: 2.6 closed a bypass,
# and 2.10.0 a heap corruption in the weights-only unpickler that can run code (GHSA-63cw-57p8-fm3p).
# A pre-release or dev build of it may predate the fix, so only a release counts.
SAFE_PICKLE_TORCH = (2, 10, 0)


def open_torch(opened: OpenedFile, name: str) -> tuple[Shard, tuple[str, ...]]:
    path = opened.path
    loaded = _torch_load(opened)
    state_dict, notes = _unwrap_state_dict(path, loaded)
    shard = Shard(name, path, {"format": "pt"}, file=opened)
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise ValueError(
                f"{shown(path)}: state-dict key {shown(repr(key))} is not a string; safetensors keys are strings"
            )
        check_key(path, key)
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


def check_key(path: Path, key: str) -> None:
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
        reason = one_line(exc)
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
        raise ValueError(corrupt.format(f"{type(exc).__name__}: {shown(one_line(exc))}")) from None


def _check_stored_zip(opened: OpenedFile, corrupt: str) -> None:
    """Read the zip's central directory only (no entry is inflated) and refuse compressed entries."""
    path = opened.path
    try:
        with io.FileIO(os.dup(opened.descriptor), "rb") as file, zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ValueError(corrupt.format(f"a damaged zip archive: {shown(one_line(exc))}")) from None
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
