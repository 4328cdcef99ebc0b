"""Where the output may go: the rules that keep a run from deleting or overwriting what is not ours.

* DST never is, holds or replaces a file that the run reads. Every input file (shards, index,
  companion files) is resolved through its symlinks and compared by path and by inode.
* An existing DST is replaced only with ``force``: a file only if it is a regular file; a folder only
  if every entry is a regular file that a checkpoint output names: the shards and the index this run
  writes or that the folder's own index lists, plus the companion files this run copies. A
  subdirectory, a symlink or any other file refuses the run, and nothing is touched.
* Companion files: the non-weight files beside a checkpoint folder's shards (``config.json``,
  tokenizer files, README...) are copied byte for byte into the output folder.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ._checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint
from ._text import option, shown

# Files that hold weights (or pickles) in the formats a model folder ships: never copied as companions,
# since the output holds the converted weights and a stale copy of the originals could be loaded instead.
WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json", ".h5", ".msgpack", ".onnx", ".gguf",
    ".ggml", ".onnx_data", ".pb", ".tflite", ".ot", ".npz", ".pkl", ".pickle",
)


@dataclass(frozen=True)
class Companion:
    """A file copied unchanged into the output folder: its name there, and the path it is read from."""

    name: str
    path: Path


def check_destination(source: Path, kind: str, destination: Path, *, force: bool) -> None:
    """The checks that need only paths, before anything is read."""
    writes_directory = kind in ("directory", "sharded")
    if writes_directory and destination.name.endswith((".safetensors", ".json")):
        raise ValueError(
            f"{shown(destination)}: {shown(source)} is a checkpoint directory, so DST must be a directory "
            "(the shards keep their names), not a file name"
        )
    if not writes_directory and not destination.name.endswith(".safetensors"):
        raise ValueError(
            f"{shown(destination)}: the output is one safetensors file, so DST must end in .safetensors"
        )
    if not destination.parent.resolve().is_dir():
        raise FileNotFoundError(f"{shown(destination.parent)}: the folder for DST does not exist; create it first")
    source_root = source.resolve()
    if writes_directory and not source.is_dir():
        source_root = source_root.parent  # an index file: its shards sit beside it
    target = destination.resolve()
    if target == source_root or (writes_directory and target in source_root.parents):
        raise ValueError(f"{shown(destination)}: DST would overwrite the input {shown(source)}; write to another path")
    if not os.path.lexists(destination):
        return
    if writes_directory:
        if destination.is_symlink():
            raise ValueError(
                f"{shown(destination)}: is a symbolic link; the output folder is put in place as a whole, so "
                "DST must be a real folder: give the link's target, or choose another DST"
            )
        if not destination.is_dir():
            raise ValueError(
                f"{shown(destination)}: exists and is not a directory; remove it or choose another DST"
            )
        entries = sorted(os.listdir(destination))
        if not entries:
            return
        if not force:
            raise FileExistsError(f"{shown(destination)}: already exists; pass {option('force')} to replace it")
        for name in entries:  # the names are checked once the output is planned; the kinds right away
            _check_entry_kind(destination, name)
    else:
        if destination.is_dir() and not destination.is_symlink():
            raise ValueError(f"{shown(destination)}: is a directory, but the output is one .safetensors file")
        if not force:
            raise FileExistsError(f"{shown(destination)}: already exists; pass {option('force')} to replace it")
        _check_replaceable_file(destination)


def check_replaceable(destination: Path, *, directory: bool, writes: set[str], reads: list[Path]) -> None:
    """Refuse unless replacing ``destination`` (when it exists) loses nothing: it is not and does not
    hold any file in ``reads``, and a folder holds only regular files named in ``writes`` or in its own
    index. Run once the output is planned, and again just before the output is moved into place."""
    _check_not_an_input(destination, reads)
    if not os.path.lexists(destination):
        return
    if not directory:
        _check_replaceable_file(destination)
        return
    entries = sorted(os.listdir(destination))
    for name in entries:  # kinds first: the folder's index is read only once it is known to be a file
        _check_entry_kind(destination, name)
    named = writes | _previous_output_names(destination, entries)
    for name in entries:
        if name not in named:
            _refuse_entry(destination, name, "which this output does not write")


def find_companions(checkpoint: Checkpoint) -> tuple[list[Companion], list[str]]:
    """The files to copy beside the output's shards, and a note for each file of the folder left out."""
    if not checkpoint.writes_directory:
        return [], []
    folder = checkpoint.source if checkpoint.source.is_dir() else checkpoint.source.parent
    read = {path.name for path in input_files(checkpoint, []) if path.parent == folder}
    companions, skipped = [], []
    for name in sorted(os.listdir(folder)):
        if name in read:
            continue
        path = folder / name
        try:
            mode = os.stat(path).st_mode  # follows symlinks: a Hugging Face cache folder is all symlinks
        except OSError:
            skipped.append(f"did not copy {shown(name)}: a broken symbolic link")
            continue
        if stat.S_ISDIR(mode):
            skipped.append(f"did not copy {shown(name)}/: a subdirectory (only the folder's own files are copied)")
        elif not stat.S_ISREG(mode):
            skipped.append(f"did not copy {shown(name)}: not a regular file")
        elif name.endswith(WEIGHT_SUFFIXES):
            skipped.append(f"did not copy {shown(name)}: a weight file this run does not convert")
        else:
            companions.append(Companion(name, path))
    return companions, skipped


def input_files(checkpoint: Checkpoint, companions: list[Companion]) -> list[Path]:
    """Every file the run reads, as the user named it (resolved when compared)."""
    paths = [checkpoint.source] + [shard.path for shard in checkpoint.shards] + [c.path for c in companions]
    if checkpoint.index_path is not None:
        paths.append(checkpoint.index_path)
    return paths


# ------------------------------------------------------------------------------------ the rules


def _check_not_an_input(destination: Path, reads: list[Path]) -> None:
    target = Path(os.path.realpath(destination))
    identities = {}
    for path in reads:
        real = Path(os.path.realpath(path))
        if real == target or target in real.parents:
            _refuse_input(destination, path, real)
        try:
            info = os.stat(real)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            identities[(info.st_dev, info.st_ino)] = (path, real)
    # The same file under another name (a hard link, a bind mount) is still the input.
    candidates = [destination]
    if os.path.isdir(destination) and not os.path.islink(destination):
        candidates = [destination / name for name in os.listdir(destination)]
    for candidate in candidates:
        try:
            info = os.stat(candidate, follow_symlinks=False)
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in identities:
            _refuse_input(destination, *identities[(info.st_dev, info.st_ino)])


def _refuse_input(destination: Path, path: Path, real: Path) -> None:
    through = f" (through its link, {shown(real)})" if Path(os.path.abspath(path)) != real else ""
    raise ValueError(
        f"{shown(destination)}: DST would overwrite the input {shown(path)}{through}; write to another path"
    )


def _check_replaceable_file(destination: Path) -> None:
    info = os.lstat(destination)
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(
            f"{shown(destination)}: is a symbolic link; {option('force')} replaces only a regular file: "
            "remove the link or choose another DST"
        )
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(
            f"{shown(destination)}: is not a regular file; {option('force')} replaces only a regular file: "
            "choose another DST"
        )


def _check_entry_kind(destination: Path, name: str) -> None:
    info = os.lstat(destination / name)
    if stat.S_ISLNK(info.st_mode):
        _refuse_entry(destination, name, "which is a symbolic link")
    if stat.S_ISDIR(info.st_mode):
        _refuse_entry(destination, name, "which is a directory")
    if not stat.S_ISREG(info.st_mode):
        _refuse_entry(destination, name, "which is not a regular file")


def _refuse_entry(destination: Path, name: str, why: str) -> None:
    raise ValueError(
        f"{shown(destination)}: {option('force')} would delete '{shown(name)}', {why}; a folder is replaced "
        "only if it holds nothing but the shards, index and companion files of a checkpoint output: move "
        "it away or choose another DST"
    )


def _previous_output_names(destination: Path, entries: list[str]) -> set[str]:
    """The shard names that the folder's own index lists: a previous output sharded differently."""
    names = {SINGLE_NAME, INDEX_NAME} & set(entries)
    if INDEX_NAME not in names:
        return names
    try:
        with open(destination / INDEX_NAME, "rb") as file:  # a regular file: checked by the caller first
            index = json.loads(file.read(64 * 1024 * 1024))
        weight_map = index["weight_map"]
        listed = {name for name in weight_map.values() if isinstance(name, str)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return names  # not an index we can read: only the names this run writes
    return names | {name for name in listed if Path(name).name == name and name.endswith(".safetensors")}


__all__ = [
    "Companion", "WEIGHT_SUFFIXES", "check_destination", "check_replaceable", "find_companions", "input_files",
]
