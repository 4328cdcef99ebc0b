"""Opening what a run reads: each input is opened once, judged by the file that was opened, and read
through that descriptor only.

A path checked a moment before it is opened can name another file by then (a link swapped in, a file
renamed over it). So every input (shard, index, companion) is opened without following a final
symbolic link (``O_NOFOLLOW``); a link is resolved once and its target opened the same way. The
descriptor is then judged with ``fstat`` (a regular file) and, on Linux, by where the kernel says the
opened file is (``/proc/self/fd``): inside SRC's folder, or, for a Hugging Face cache snapshot, in the
same repository's ``blobs/``. Its permission bits come from that ``fstat`` too, and every later read
(tensor bytes, the copy into DST, ``verify``'s comparison) goes through the descriptor.

SRC must not change under the run: each input's ``(st_dev, st_ino, size, mtime_ns)`` is recorded at
open and compared after the last read (:meth:`OpenedFile.check_unchanged`); a file replaced or written
meanwhile fails the run, and nothing is moved into place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .report import option, shown

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_PROC_FD = "/proc/self/fd"
_KINDS = (
    (stat.S_ISDIR, "is a directory, not a file"),
    (stat.S_ISFIFO, "is a named pipe (FIFO), not a regular file"),
    (stat.S_ISCHR, "is a character device, not a regular file"),
    (stat.S_ISBLK, "is a block device, not a regular file"),
    (stat.S_ISSOCK, "is a socket, not a regular file"),
)


class InputProblem(ValueError):
    """A file that cannot be read as an input: ``problem`` says why, in words that follow its path;
    ``complete`` when it already says what to do (a caller adds its own fix otherwise)."""

    def __init__(self, path: Path, problem: str, *, missing: bool = False, complete: bool = False) -> None:
        super().__init__(f"{shown(path)}: {problem}")
        self.path, self.problem, self.missing, self.complete = path, problem, missing, complete


@dataclass(eq=False)
class OpenedFile:
    """One input, open for reading: ``path`` as the user named it, for messages."""

    path: Path
    descriptor: int
    device: int
    inode: int
    size: int
    mtime_ns: int
    mode: int  # permission bits, from the fstat of the descriptor

    def readable_path(self) -> str:
        """A path that opens this same file (for libraries that take a path): ``/proc/self/fd/N``
        where the kernel offers it, else the user's path, whose identity :meth:`check_unchanged` checks."""
        proc = f"{_PROC_FD}/{self.descriptor}"
        return proc if os.path.exists(proc) else os.fspath(self.path)

    def read_at(self, length: int, offset: int) -> bytes:
        return os.pread(self.descriptor, length, offset)

    def read_all(self, length: int, offset: int = 0) -> bytes:
        """``length`` bytes from ``offset``, or fewer where the file ends first (the parser says what is wrong)."""
        chunks, done = [], 0
        while done < length:
            chunk = self.read_at(length - done, offset + done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` naming the file if it was written to since it was opened, or if its
        path now names another file (replaced by a rename, or a link swapped in)."""
        now = os.fstat(self.descriptor)
        try:
            named = os.stat(self.path)
            same_file = (named.st_dev, named.st_ino) == (self.device, self.inode)
        except OSError:
            same_file = False
        if not same_file or (now.st_size, now.st_mtime_ns) != (self.size, self.mtime_ns):
            what = "written to" if same_file else "replaced"
            raise ValueError(
                f"{shown(self.path)}: changed while this run read it (it was {what}); nothing was written: rerun "
                "when nothing writes to SRC"
            )

    def close(self) -> None:
        if self.descriptor >= 0:
            os.close(self.descriptor)
            self.descriptor = -1


def open_input(path: Path, root: Path | None, *, follow_outside_links: bool = False) -> OpenedFile:
    """Open ``path`` for reading and judge the opened file (see the module docstring).

    ``root`` is SRC's resolved folder, which the file must lie in (or, for a hub cache snapshot, in its
    repository's ``blobs/``); None for a file the user named as SRC, which is read wherever it is.

    Raises:
        InputProblem: not a regular file, missing, unreadable, or (without ``follow_outside_links``) a
            link that leads outside SRC.
    """
    target = path
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise InputProblem(path, "does not exist", missing=True) from None
    except OSError as exc:
        raise InputProblem(path, f"cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISLNK(info.st_mode):
        target = resolved_input(path)
        if root is not None and not follow_outside_links and (outside := outside_source(target, root)):
            raise _leaving(path, outside)
        try:
            info = os.lstat(target)
        except FileNotFoundError:
            raise InputProblem(path, "is a dangling symbolic link") from None
        except OSError as exc:
            raise InputProblem(path, f"cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):  # refused unopened: opening a device or a pipe can act on it
        raise InputProblem(path, _kind(info.st_mode))
    try:
        descriptor = os.open(target, _FLAGS | _NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link appeared since the lstat
            raise InputProblem(
                path,
                "changed while this run opened it (a symbolic link appeared); rerun when nothing writes to SRC",
                complete=True,
            ) from None
        raise InputProblem(path, f"cannot be read ({exc.strerror or exc})") from None
    try:
        opened = os.fstat(descriptor)
        if not stat.S_ISREG(opened.st_mode):
            raise InputProblem(path, _kind(opened.st_mode))
        if root is not None and not follow_outside_links:
            where = _opened_at(descriptor)
            if where is not None and (outside := outside_source(where, root)):
                raise _leaving(path, outside)
    except BaseException:
        os.close(descriptor)
        raise
    return OpenedFile(
        path,
        descriptor,
        opened.st_dev,
        opened.st_ino,
        opened.st_size,
        opened.st_mtime_ns,
        stat.S_IMODE(opened.st_mode) & 0o777,
    )


def resolved_input(path: Path) -> Path:
    """``realpath(path)`` for a file of SRC. ``os.path.realpath`` reads a link that its ``lstat`` just
    found, and a link replaced by a file in between makes that read fail (``EINVAL``): that is SRC
    changing under the run, said so in one line naming the file."""
    try:
        return Path(os.path.realpath(path))
    except OSError:
        raise InputProblem(
            path,
            "changed while this run resolved it (a symbolic link was replaced); rerun when nothing writes to SRC",
            complete=True,
        ) from None


@contextlib.contextmanager
def opened_for_library(path: Path) -> Iterator[str]:
    """A path naming the file at ``path`` that any library can open: ``/proc/self/fd/N`` of a
    descriptor held for the block where the kernel offers it (safetensors takes only UTF-8 paths, and a
    file name need not be UTF-8), else ``path`` itself."""
    descriptor = os.open(path, _FLAGS)
    try:
        proc = f"{_PROC_FD}/{descriptor}"
        yield proc if os.path.exists(proc) else os.fspath(path)
    finally:
        os.close(descriptor)


def identity(path: Path, *, follow_symlinks: bool = True) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of what ``path`` names, or None where nothing can be stat'ed."""
    try:
        info = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def outside_source(real: Path, root: Path) -> Path | None:
    """``real`` (a resolved path) when it lies outside ``root``, SRC's resolved folder; None inside.

    A Hugging Face cache keeps a repository as ``models--ORG--NAME/{blobs,refs,snapshots}``, each
    snapshot's files being links into ``blobs/``: those are inside, for a snapshot folder at any depth
    (``snapshots/REV/unet/``), when the layout is really that one and the link lands in that same
    repository's ``blobs/``."""
    if real == root or root in real.parents:
        return None
    blobs = hub_blobs(root)
    if blobs is not None and real.parent == blobs:
        return None
    return real


def hub_blobs(root: Path) -> Path | None:
    """The ``blobs/`` folder of the hub cache repository that ``root`` is a snapshot folder of, or None."""
    snapshots = next((folder for folder in root.parents if folder.name == "snapshots"), None)
    if snapshots is None or not snapshots.parent.name.startswith("models--"):
        return None
    blobs = snapshots.parent / "blobs"
    if all(os.path.isdir(folder) and not os.path.islink(folder) for folder in (blobs, snapshots)):
        return blobs
    return None


def _opened_at(descriptor: int) -> Path | None:
    """Where the kernel says the opened file is, or None where it does not tell (no ``/proc``)."""
    try:
        where = os.readlink(f"{_PROC_FD}/{descriptor}")
    except OSError:
        return None
    return Path(where) if where.startswith("/") else None


def _leaving(path: Path, outside: Path) -> InputProblem:
    return InputProblem(
        path,
        f"a symbolic link that leads outside SRC, to {shown(outside)}; its data would be copied into DST: copy "
        f"the file into SRC, or pass {option('follow_outside_links')} if you trust where it leads",
        complete=True,
    )


def _kind(mode: int) -> str:
    return next((text for test, text in _KINDS if test(mode)), "is a special file, not a regular file")


__all__ = [
    "InputProblem",
    "OpenedFile",
    "hub_blobs",
    "identity",
    "open_input",
    "opened_for_library",
    "outside_source",
    "resolved_input",
]
