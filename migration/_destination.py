"""Where the output may go: the rules that keep a run from deleting or overwriting what is not ours.

* DST never is, holds or replaces a file that the run reads, and is neither inside SRC nor around
  it. Files are compared by inode, and folders by the ``(st_dev, st_ino)`` of every ancestor, so that a
  bind mount or another spelling of the same folder is caught.
* Nothing from outside SRC reaches DST: a shard or a companion file whose link leaves SRC's folder
  is refused (a shard) or left out with a note (a companion), unless ``follow_outside_links``; the
  files are judged when opened (:mod:`._inputs`, which also owns the hub cache exception).
* An existing DST is replaced only with ``force``, and only if it is an output of this tool: a file
  only if it is a regular safetensors file carrying this tool's metadata (``slim_mha.format_version``);
  a folder only if every entry is a regular file that this run would write and that is ours: a shard
  or the index (named by this run or by the folder's own index) that carries that metadata, or a
  companion file that the previous output recorded (``slim_mha.companions``, a SHA-256 per name) and
  that is unchanged since, or that is byte for byte the file this run copies. Anything else (another
  model's checkpoint above all) refuses the run, naming a file, and nothing is touched.
* Permissions are those of ``cp -p``: each output file gets its source file's permission bits, and a
  new output folder its source folder's; a replaced DST keeps its own bits, less any the source lacks.
* Companion files: the non-weight files beside a checkpoint folder's shards (``config.json``,
  tokenizer files, README...) are copied byte for byte into the output folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from safetensors import SafetensorError, safe_open

from ._checkpoint import INDEX_NAME, SINGLE_NAME
from ._inputs import identity, opened_for_library, outside_source, resolved_input
from ._records import Checkpoint
from .report import option, shown

COMPANIONS_KEY = "slim_mha.companions"  # metadata: {name: sha256} of the companion files an output holds
OURS_KEY = "slim_mha.format_version"  # metadata every output of this tool carries
_PERMISSIONS = 0o777  # cp -p keeps these; set-id and sticky bits never come along

# Files that hold weights (or pickles) in the formats a model folder ships: never copied as companions,
# since the output holds the converted weights and a stale copy of the originals could be loaded instead.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".index.json",
    ".h5",
    ".msgpack",
    ".onnx",
    ".gguf",
    ".ggml",
    ".onnx_data",
    ".pb",
    ".tflite",
    ".ot",
    ".npz",
    ".pkl",
    ".pickle",
)


@dataclass(frozen=True)
class Companion:
    """A file copied unchanged into the output folder: its name there, the path it is read from, and
    what one stat of it found (a model folder may hold thousands: each is looked at once)."""

    name: str
    path: Path
    size: int = 0
    mode: int = 0o644  # its permission bits, which the copy gets


def check_destination(source: Path, kind: str, destination: Path, *, force: bool, dry_run: bool = False) -> None:
    """The checks that need only paths, before anything is read."""
    writes_directory = kind in ("directory", "sharded", "dcp")
    if writes_directory and destination.name.endswith((".safetensors", ".json")):
        raise ValueError(
            f"{shown(destination)}: {shown(source)} is a checkpoint directory, so DST must be a directory "
            "(the shards keep their names), not a file name"
        )
    if not writes_directory and not destination.name.endswith(".safetensors"):
        raise ValueError(f"{shown(destination)}: the output is one safetensors file, so DST must end in .safetensors")
    if not destination.parent.resolve().is_dir() and not dry_run:
        raise FileNotFoundError(f"{shown(destination.parent)}: the folder for DST does not exist; create it first")
    source_root = Path(os.path.realpath(source))
    if writes_directory and not source.is_dir():
        source_root = source_root.parent  # an index file: its shards sit beside it
    target = Path(os.path.realpath(destination))
    source_identity = identity(source_root)
    if target == source_root:
        raise ValueError(f"{shown(destination)}: DST would overwrite the input {shown(source)}; write to another path")
    if writes_directory and (
        target in source_root.parents or (identity(target) is not None and identity(target) in _ancestry(source_root))
    ):
        raise ValueError(
            f"{shown(destination)}: DST holds the input {shown(source)}, and the output folder replaces DST as a "
            f"whole; write to a new folder, such as {shown(destination / (source_root.name + '.slim'))}"
        )
    if writes_directory and (source_root in target.parents or source_identity in _ancestry(target.parent)):
        raise ValueError(
            f"{shown(destination)}: DST is inside SRC {shown(source)}, which is never modified; write outside it"
        )
    if not os.path.lexists(destination):
        return
    if writes_directory:
        if destination.is_symlink():
            raise ValueError(
                f"{shown(destination)}: is a symbolic link; the output folder is put in place as a whole, so "
                "DST must be a real folder: give the link's target, or choose another DST"
            )
        if not destination.is_dir():
            raise ValueError(f"{shown(destination)}: exists and is not a directory; remove it or choose another DST")
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


def check_replaceable(
    destination: Path, *, directory: bool, writes: set[str], reads: list[Path], companions: Sequence[Companion] = ()
) -> None:
    """Refuse unless replacing ``destination`` (when it exists) loses nothing: it is not and does not
    hold any file in ``reads``, and a folder holds only files this run writes that are ours (see the
    module's docstring). Run once the output is planned, and again just before the output is moved
    into place."""
    check_not_an_input(destination, reads)
    if not os.path.lexists(destination):
        return
    if not directory:
        _check_replaceable_file(destination)
        _check_ours(destination, destination)
        return
    entries = sorted(os.listdir(destination))
    for name in entries:  # kinds first: the folder's index is read only once it is known to be a file
        _check_entry_kind(destination, name)
    index = _previous_index(destination, entries)
    shards = {SINGLE_NAME} | _listed_shards(index)
    copied = {companion.name: companion.path for companion in companions}
    recorded = _recorded_companions(destination, entries, index)
    for name in entries:
        if name not in writes and name not in shards:
            _refuse_entry(destination, name, "which this output does not write")
        path = destination / name
        if name.endswith(".index.json"):
            index_file = _read_index(path)
            if index_file is None:
                _refuse_entry(destination, name, "which does not read as a checkpoint index")
            if OURS_KEY not in (index_file.get("metadata") or {}):
                _refuse_foreign(destination, name)
        elif name in copied:
            if not (recorded.get(name) == _digest(path) or _same_bytes(path, copied[name])):
                _refuse_entry(destination, name, "which no earlier run wrote, or which was changed since")
        else:
            _check_ours(path, destination, name)


def _ancestry(folder: Path) -> set[tuple[int, int]]:
    """The ``(st_dev, st_ino)`` of ``folder`` and of each folder above it: a folder reached through a bind
    mount, or spelled another way, has the same identity as the original."""
    found = (identity(folder), *(identity(parent) for parent in folder.parents))
    return {one for one in found if one is not None}


def permissions(path: Path) -> int:
    """``path``'s permission bits (its target's, for a symlink), as ``cp -p`` keeps them."""
    return os.stat(path).st_mode & _PERMISSIONS


def output_permissions(wanted: int, destination: Path, *, force: bool) -> int:
    """The bits DST gets: the source's (``wanted``); for a DST that is replaced, its own, less any the
    source lacks."""
    if force and os.path.lexists(destination) and not os.path.islink(destination):
        wanted &= os.lstat(destination).st_mode & _PERMISSIONS
    return wanted


def companion_record(digests: dict[str, str]) -> str:
    """The metadata value that lets a later ``force`` run know these files as its own."""
    return json.dumps(dict(sorted(digests.items())), separators=(",", ":"))


def find_companions(checkpoint: Checkpoint, *, follow_outside_links: bool = False) -> tuple[list[Companion], list[str]]:
    """The files to copy beside the output's shards, and a note for each file of the folder left out.

    A file whose resolved path leaves SRC's folder is left out (a README.md linked to a private key
    would otherwise be copied into an output that is shared), unless ``follow_outside_links``. This is
    the listing only: each file is judged again when it is opened for the copy (:mod:`._inputs`)."""
    if not checkpoint.writes_directory:
        return [], []
    folder = checkpoint.source if checkpoint.source.is_dir() else checkpoint.source.parent
    root = Path(os.path.realpath(folder))
    read = {path.name for path in input_files(checkpoint, []) if path.parent == folder}
    companions, skipped = [], []
    for entry in sorted(os.scandir(folder), key=lambda entry: entry.name):
        name = entry.name
        if name in read:
            continue
        path = folder / name
        try:
            info = entry.stat()  # follows symlinks: a Hugging Face cache folder is all symlinks
        except OSError:
            skipped.append(f"did not copy {shown(name)}: a broken symbolic link")
            continue
        mode = info.st_mode
        if stat.S_ISDIR(mode):
            skipped.append(f"did not copy {shown(name)}/: a subdirectory (only the folder's own files are copied)")
        elif not stat.S_ISREG(mode):
            skipped.append(f"did not copy {shown(name)}: not a regular file")
        elif name.endswith(WEIGHT_SUFFIXES):
            skipped.append(f"did not copy {shown(name)}: a weight file this run does not convert")
        elif (
            entry.is_symlink()
            and not follow_outside_links
            and (outside := outside_source(resolved_input(path), root)) is not None
        ):
            skipped.append(
                f"did not copy {shown(name)}: a symbolic link that leads outside SRC, to {shown(outside)} "
                f"({option('follow_outside_links')} copies it)"
            )
        else:
            companions.append(Companion(name, path, info.st_size, mode & _PERMISSIONS))
    return companions, skipped


def input_files(checkpoint: Checkpoint, companions: list[Companion]) -> list[Path]:
    """Every file the run reads, as the user named it (resolved when compared)."""
    paths = [checkpoint.source] + [shard.path for shard in checkpoint.shards] + [c.path for c in companions]
    paths += checkpoint.other_inputs
    if checkpoint.index_path is not None:
        paths.append(checkpoint.index_path)
    return paths


# ------------------------------------------------------------------------------------ the rules


def _resolved(path: Path, parents: dict[str, str]) -> Path:
    """``realpath(path)``, resolving each folder once (``parents`` caches them): only a symbolic link
    itself needs the full walk, and a model folder's thousands of plain files share one folder."""
    text = os.fspath(path)
    folder, name = os.path.split(text)
    if name in ("", ".", "..") or os.path.islink(text):
        return resolved_input(Path(text))
    if folder not in parents:  # resolved as spelled: realpath, not abspath, gets "link/.." right
        parents[folder] = os.path.realpath(folder or ".")
    return Path(os.path.join(parents[folder], name))


def check_not_an_input(destination: Path, reads: list[Path]) -> None:
    target = Path(os.path.realpath(destination))
    identities = {}
    parents: dict[str, str] = {}
    for path in reads:
        real = _resolved(path, parents)
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


def _refuse_entry(destination: Path, name: str, why: str) -> NoReturn:
    raise ValueError(
        f"{shown(destination)}: {option('force')} would delete '{shown(name)}', {why}; a folder is replaced "
        "only if it holds nothing but the shards, index and companion files of a checkpoint output: move "
        "it away or choose another DST"
    )


def _previous_index(destination: Path, entries: list[str]) -> dict | None:
    """DST's own index, when it reads as one (a dict with a 'weight_map' dict); else None."""
    return _read_index(destination / INDEX_NAME) if INDEX_NAME in entries else None


def _read_index(path: Path) -> dict | None:
    try:
        with open(path, "rb") as file:  # a regular file: checked by the caller first
            index = json.loads(file.read(64 * 1024 * 1024))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        return None
    return index


def _listed_shards(index: dict | None) -> set[str]:
    """The shard names that the folder's own index lists: a previous output sharded differently."""
    if index is None:
        return set()
    listed = {name for name in index["weight_map"].values() if isinstance(name, str)}
    return {name for name in listed if Path(name).name == name and name.endswith(".safetensors")}


def _recorded_companions(destination: Path, entries: list[str], index: dict | None) -> dict[str, str]:
    """The companion files the previous output recorded as its own, with their SHA-256."""
    value = None
    if index is not None and isinstance(index.get("metadata"), dict):
        value = index["metadata"].get(COMPANIONS_KEY)
    elif SINGLE_NAME in entries:
        try:
            with opened_for_library(destination / SINGLE_NAME) as readable:
                with safe_open(readable, framework="pt") as handle:
                    value = (handle.metadata() or {}).get(COMPANIONS_KEY)
        except (SafetensorError, OSError):
            value = None
    try:
        record = json.loads(value) if isinstance(value, str) else {}
    except (ValueError, RecursionError):
        return {}
    return (
        {name: digest for name, digest in record.items() if isinstance(digest, str)} if isinstance(record, dict) else {}
    )


def _check_ours(path: Path, destination: Path, name: str | None = None) -> None:
    try:
        with opened_for_library(path) as readable, safe_open(readable, framework="pt") as handle:
            ours = OURS_KEY in (handle.metadata() or {})
    except (SafetensorError, OSError):
        if name is None:
            raise ValueError(
                f"{shown(destination)}: {option('force')} replaces a file only if it reads as a safetensors file, "
                "and this one does not: move it away or choose another DST"
            ) from None
        _refuse_entry(destination, name, "which does not read as a safetensors file")
    if not ours:
        _refuse_foreign(destination, name)


def _refuse_foreign(destination: Path, name: str | None) -> NoReturn:
    """A checkpoint this tool did not write: never replaced, however much it looks like an output."""
    where = destination / name if name else destination
    raise ValueError(
        f"{shown(where)}: {option('force')} replaces only what slim-mha-migrate wrote, and this checkpoint file "
        "carries no slim_mha metadata (someone else's checkpoint?); move it away or choose another DST"
    )


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, as recorded for companion files."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1024 * 1024), b""):
            digest.update(block)
    return digest.hexdigest()


def _digest(path: Path) -> str | None:
    try:
        return file_digest(path)
    except OSError:
        return None


def _same_bytes(path: Path, other: Path) -> bool:
    try:
        if os.path.getsize(path) != os.path.getsize(other):
            return False
        with open(path, "rb") as first, open(other, "rb") as second:
            while True:
                block = first.read(1024 * 1024)
                if block != second.read(1024 * 1024):
                    return False
                if not block:
                    return True
    except OSError:
        return False


__all__ = [
    "COMPANIONS_KEY",
    "OURS_KEY",
    "check_not_an_input",
    "Companion",
    "WEIGHT_SUFFIXES",
    "check_destination",
    "check_replaceable",
    "companion_record",
    "file_digest",
    "find_companions",
    "input_files",
    "output_permissions",
    "permissions",
]
