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

import json
import os
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ._dcp import METADATA_NAME, PROVENANCE_NAME, is_dcp_folder, open_dcp, provenance
from ._inputs import InputProblem, OpenedFile, open_input
from ._records import Checkpoint, Shard, TensorRecord, one_line
from ._torch_pickles import open_torch
from .report import shown

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TORCH_INDEX_NAME = "pytorch_model.bin.index.json"
TORCH_SINGLE_NAME = "pytorch_model.bin"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def source_kind(source: Path) -> str:
    """Classify SRC by its path alone (no reads): the output's shape follows from it."""
    if is_dcp_folder(source):
        return "dcp"
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
        shard, notes = open_torch(opened, source.name)
        return Checkpoint(source, kind, [shard], notes=notes)
    folder = source if source.is_dir() else source.parent
    root = Path(os.path.realpath(folder))  # every file read must lie in it (see _inputs)
    if kind == "dcp":
        return _open_dcp(source, root, opener)
    if kind == "directory":
        single = lone_checkpoint_file(source)
        opened = opener.open(single, root, "replace it with the checkpoint file")
        if single.name.endswith(".safetensors"):
            return Checkpoint(source, kind, [_open_safetensors(opened, single.name)])
        shard, notes = open_torch(opened, output_name(single.name))
        return Checkpoint(source, kind, [shard], notes=notes)
    if source.is_dir():
        index_path = next(source / name for name in (INDEX_NAME, TORCH_INDEX_NAME) if _present(source / name))
        index = opener.open(index_path, root, "pass the index file itself")
    else:
        index_path = source
        index = opener.open(index_path, None, "pass the index file itself")
    return _open_sharded(source, index, root, opener)


def _open_dcp(source: Path, root: Path, opener: _Opener) -> Checkpoint:
    opened = opener.open(source / METADATA_NAME, root, "pass a folder that dcp.save wrote")
    fix = "copy the whole folder dcp.save wrote"
    checkpoint, entries = open_dcp(source, opened, lambda path, listed: opener.open(path, root, fix, listed=listed))
    checkpoint.entries = entries
    if _present(source / PROVENANCE_NAME):  # an earlier run's record, read as a safetensors file's metadata is
        recorded = opener.open(source / PROVENANCE_NAME, root, "remove it, or copy the folder again")
        checkpoint.index_metadata = provenance(recorded)
        checkpoint.other_inputs.append(recorded.path)
    return checkpoint


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
            f"{shown(path)}: not a valid safetensors file ({shown(one_line(exc))}); it is truncated, corrupt "
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
    header = json.loads(opened.read_all(length, 8))
    return header, 8 + length


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
            shard, shard_notes = open_torch(opened, out)
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
        index = json.loads(opened_index.read_all(opened_index.size).decode("utf-8"))
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
