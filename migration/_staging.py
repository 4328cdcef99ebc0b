"""Putting the output in place so that a crash at any moment loses nothing.

Every run writes into a staging path beside DST, named ``.{DST}.slim-mha-staging-{8 hex}``, and holds
an exclusive ``flock`` on it for as long as the run lives. The kernel drops that lock when the process
dies, however it dies (SIGKILL included), so the next run can tell litter (unlocked) from another run
still writing (locked), and removes only the former, saying so.

The staging path is created readable by its owner only (whatever the umask), gets DST's permission
bits just before it is moved into place, and is synced: each shard is fsynced as it is written, the
companion files together (``syncfs``: one call for thousands of small files), then the folder. It is
moved into place in one step:

* a file replaces DST with ``rename``, which is atomic;
* a folder is swapped with an existing DST by ``renameat2(RENAME_EXCHANGE)`` on Linux, so DST is the
  old tree or the new one at every instant; the old tree is then removed from the staging path.
  Where the kernel or the file system cannot exchange, DST is first renamed aside to
  ``.{DST}.slim-mha-retired-{8 hex}`` and the new tree renamed in: a crash between the two renames
  leaves DST absent with the old tree whole under that name, and the next run renames it back;
* a DST that does not exist is claimed with ``RENAME_NOREPLACE``, so a DST that appears meanwhile is
  never overwritten.

A staging path whose name would pass ``NAME_MAX`` takes a hash of DST's name instead of the name.

Litter is acted on only if this tool's ledger recorded it: each staging path, and each DST moved
aside, is written in a small ledger under the user's state folder (``$XDG_STATE_HOME/slim_mha``, or
``~/.local/state/slim_mha``) with its ``(st_dev, st_ino)``, before the run can leave it behind. A
folder that is merely named like ours, planted or not, is never restored into DST nor deleted: the
run says so and leaves it.

The commit, from the last check of DST to the removal of the replaced tree, is one block that no
SIGINT, SIGTERM or SIGHUP can cut: in the main thread (where Python runs every signal handler,
whichever thread the signal reached) the handlers are swapped for a recorder for the block, and the
first signal recorded acts just after it. So what the CLI says after an interruption matches what is
on disk (:class:`Journal`), and no staging or retired path is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import importlib
import json
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ._inputs import identity
from .report import shown

fcntl: ModuleType | None
try:
    fcntl = importlib.import_module("fcntl")
except ImportError:  # pragma: no cover - not POSIX: litter is never removed automatically
    fcntl = None

STAGING_TAG = "slim-mha-staging"
RETIRED_TAG = "slim-mha-retired"
_DEFERRED_SIGNALS = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)}
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


@dataclass
class Journal:
    """What one run did to the disk, for the CLI's message after an interruption or a failure."""

    destination: Path | None = None
    committed: bool = False  # DST now holds the new output, complete
    leftovers: list[Path] = field(default_factory=list)  # litter this run could not remove


_JOURNAL: ContextVar[Journal | None] = ContextVar("slim_mha_migration_journal", default=None)


@contextlib.contextmanager
def journal() -> Iterator[Journal]:
    """Record what the migrations run inside this block do (the CLI wraps each run in one)."""
    record = Journal()
    token = _JOURNAL.set(record)
    try:
        yield record
    finally:
        _JOURNAL.reset(token)


def _note(**changes) -> None:
    record = _JOURNAL.get()
    if record is None:
        return
    for name, value in changes.items():
        if name == "leftover":
            record.leftovers.append(value)
        else:
            setattr(record, name, value)


_deferring = [0]  # how deep the main thread is in signals_deferred blocks


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back for the block: their handlers run just after it, never
    between a rename and the record of it, nor in the middle of removing a staging path.

    Python runs signal handlers in the main thread, whichever thread the signal reached, so masking
    the main thread alone is not enough: there, the handlers are replaced by a recorder for the block,
    and the first signal recorded is handed to the handler it was meant for once the block ends."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - not POSIX
        yield
        return
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED_SIGNALS)
    try:
        if threading.current_thread() is not threading.main_thread() or _deferring[0]:
            _deferring[0] += threading.current_thread() is threading.main_thread()
            try:
                yield
            finally:
                _deferring[0] -= threading.current_thread() is threading.main_thread()
            return
        pending: list[int] = []
        handlers = {}
        for signum in _DEFERRED_SIGNALS:
            handler = signal.getsignal(signum)
            if handler not in (signal.SIG_IGN, None):
                handlers[signum] = signal.signal(signum, lambda number, frame: pending.append(number))
        _deferring[0] = 1
        try:
            yield
        finally:
            _deferring[0] = 0
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            if pending:
                _deliver(pending[0], handlers[pending[0]])
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)


def _deliver(signum: int, handler) -> None:
    """Act on a signal held back: its Python handler, or, for the default action, the signal itself."""
    if callable(handler):
        handler(signum, None)
    else:  # SIG_DFL: what the signal would have done (ends the process), now that the block is over
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        signal.raise_signal(signum)


# ------------------------------------------------------------------------------------ the ledger


def _ledger_folder() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "slim_mha" / "migration"


def _identity(path: Path) -> tuple[int, int] | None:
    return identity(path, follow_symlinks=False)  # the path itself: litter is never followed through a link


def _record(path: Path, identity: tuple[int, int] | None = None) -> str | None:
    """Write in the ledger that this tool made ``path`` (with that identity: its own by default);
    returns the entry's token, or None where the ledger cannot be written (the path is then never
    removed automatically)."""
    identity = identity or _identity(path)
    if identity is None:
        return None
    token = secrets.token_hex(16)
    entry = {"path": os.fsencode(os.path.abspath(path)).hex(), "device": identity[0], "inode": identity[1]}
    folder = _ledger_folder()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(folder / token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(descriptor, "w", encoding="ascii") as file:
            json.dump(entry, file)
    except OSError:
        return None
    return token


def _forget(token: str | None) -> None:
    if token:
        with contextlib.suppress(OSError):
            os.unlink(_ledger_folder() / token)


def _recorded(path: Path) -> str | None:
    """The token of the ledger entry naming ``path`` with its present identity, or None: a path only
    named like ours is not ours."""
    identity = _identity(path)
    wanted = os.fsencode(os.path.abspath(path)).hex()
    try:
        entries = list(os.scandir(_ledger_folder()))
    except OSError:
        return None
    for entry in entries:
        try:
            with open(entry.path, encoding="ascii") as file:
                record = json.load(file)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("path") == wanted:
            if identity is not None and (record.get("device"), record.get("inode")) == identity:
                return entry.name
    return None


# ------------------------------------------------------------------------------------ litter


_NAME_MAX = 255
# Where a run may be held still, so that a test can kill or interrupt it there: a function of the
# point's name that tests set from a driver of their own (tests/_paused_migration.py). None in every
# real run: nothing here reads the environment or waits.
AT_POINT: Callable[[str], None] | None = None


def pause_for_tests(point: str) -> None:
    """Hand ``point`` to :data:`AT_POINT` where a test set it; a no-op otherwise."""
    if AT_POINT is not None:
        AT_POINT(point)


def _stem(destination: Path) -> str:
    """What litter beside ``destination`` is named after: DST's name, or a hash of it where the name
    with our suffix would pass ``NAME_MAX`` (a legal long DST must still get a staging path)."""
    name = destination.name
    longest = f".{name}.{RETIRED_TAG}-{'0' * 8}"
    if len(os.fsencode(longest)) <= _NAME_MAX:
        return name
    return hashlib.sha256(os.fsencode(name)).hexdigest()[:32]


def _aside(destination: Path, tag: str) -> Path:
    return destination.parent / f".{_stem(destination)}.{tag}-{secrets.token_hex(4)}"


def _litter_pattern(destination: Path) -> re.Pattern[str]:
    tags = f"{STAGING_TAG}|{RETIRED_TAG}"
    return re.compile(rf"\.{re.escape(_stem(destination))}\.({tags})-[0-9a-f]{{8}}")


_LEGACY = r"\.{name}\.[0-9a-f]{{8}}\.tmp(\.old)?"  # the names used before this scheme; never removed


def remove_litter(destination: Path) -> tuple[str, ...]:
    """Remove what interrupted runs left beside ``destination`` (only paths this tool's ledger records,
    only when no live run holds them, and only if they hold nothing but regular files); return what
    was done."""
    notes: list[str] = []
    pattern = _litter_pattern(destination)
    legacy = re.compile(_LEGACY.format(name=re.escape(destination.name)))
    parent = destination.parent
    for name in sorted(os.listdir(parent)):
        path = parent / name
        if legacy.fullmatch(name):
            notes.append(f"{shown(path)} looks left by an interrupted run of an older slim_mha; remove it by hand")
            continue
        match = pattern.fullmatch(name)
        if not match:
            continue
        token = _recorded(path)
        if token is None:
            notes.append(
                f"left {shown(path)}: it is named like slim-mha-migrate's staging, but no record of this tool's runs "
                "says it made it; look inside and remove it by hand"
            )
            continue
        try:
            notes.append(_remove_one(path, destination, retired=match.group(1) == RETIRED_TAG, token=token))
        except OSError as exc:  # litter we cannot remove must not stop the run; it is only litter
            notes.append(f"could not remove {shown(path)}, left by an interrupted run ({exc.strerror or exc})")
    return tuple(notes)


def _remove_one(path: Path, destination: Path, *, retired: bool, token: str) -> str:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{shown(path)} vanished while being cleaned up"
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)) or (
        stat.S_ISDIR(info.st_mode) and not _only_regular_files(path)
    ):
        return f"left {shown(path)}: named like our staging, but it holds something we never write"
    with _held(path) as locked:
        if not locked:
            return f"left {shown(path)}: another slim-mha-migrate run is writing it"
        if retired and not os.path.lexists(destination):
            with signals_deferred():
                os.rename(path, destination)
                _forget(token)
            return (
                f"restored {shown(destination)} from {shown(path)}, where an interrupted run had moved it "
                "while replacing it"
            )
        kind = "the previous DST moved aside" if retired else "a partial output"
        with signals_deferred():
            _delete(path)
            _forget(token)
        return f"removed {shown(path)}, {kind} left by an interrupted run"


def _only_regular_files(folder: Path) -> bool:
    try:
        return all(entry.is_file(follow_symlinks=False) for entry in os.scandir(folder))
    except OSError:
        return False


@contextlib.contextmanager
def _held(path: Path) -> Iterator[bool]:
    """Try to take the exclusive lock a live run holds on its staging path."""
    if fcntl is None:  # pragma: no cover - cannot tell a live run from litter: leave it
        yield False
        return
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(descriptor)


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        # The staging folder may already carry DST's bits, which a read-only source makes read-only;
        # it is ours (locked), so its owner may empty it.
        os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) | stat.S_IRWXU)
        shutil.rmtree(path)
    else:
        path.unlink()


# ------------------------------------------------------------------------------------ staging


class Staging:
    """A locked staging file or folder beside ``destination``; :meth:`commit` moves it into place.

    Used as a context manager: leaving the block without a commit removes the staging path.
    """

    def __init__(self, destination: Path, *, directory: bool, mode: int = 0o755) -> None:
        self.destination = destination
        self.directory = directory
        self.mode = mode  # a folder's permission bits once in place (a file's are set by its writer)
        self.path = _aside(destination, STAGING_TAG)
        self.committed = False
        self._entries: list[tuple[str | None, Path]] = []  # ledger entries this run wrote, and their paths
        self.notes: list[str] = []  # for the report: what could not be cleaned up after the commit
        self._lock: int | None = None

    def __enter__(self) -> Staging:
        _note(destination=self.destination, committed=False)
        if self.directory:
            self.path.mkdir(mode=0o700)
            self._lock = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        else:
            self._lock = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o600)
        if fcntl is not None:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        self._entries.append((_record(self.path), self.path))
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if not self.committed and os.path.lexists(self.path):
                try:
                    with signals_deferred():
                        _delete(self.path)
                except OSError:
                    _note(leftover=self.path)  # locked until we exit; the next run removes it
        finally:
            if self._lock is not None:
                os.close(self._lock)
            for token, path in self._entries:  # a path still there is litter the next run may remove
                if not os.path.lexists(path):
                    _forget(token)

    def commit(self, *, replace: bool, check: Callable[[], None]) -> None:
        """Move the staging path to DST. ``replace`` allows an existing DST to be replaced; ``check()``
        re-runs the destination checks just before, as DST may have changed while we wrote. No signal
        can land inside: it acts before the block or after it (see :func:`signals_deferred`)."""
        if self.directory:
            os.chmod(self.path, self.mode)  # the staging name is ours alone, held by our lock
            _sync(self.path)
        with signals_deferred():
            pause_for_tests("inside-commit")
            self._commit(replace=replace, check=check)

    def _commit(self, *, replace: bool, check: Callable[[], None]) -> None:
        exists = os.path.lexists(self.destination)
        if not exists:
            with signals_deferred():
                _rename_no_replace(self.path, self.destination)
                self._record_commit()
        elif not replace:
            raise FileExistsError(f"{shown(self.destination)}: appeared while writing; it was left as it was")
        else:
            check()
            if self.directory:
                self._swap_directory()
            else:
                with signals_deferred():
                    os.replace(self.path, self.destination)
                    self._record_commit()
        _sync(self.destination.parent)

    def _record_commit(self) -> None:
        self.committed = True
        _note(committed=True)

    def _swap_directory(self) -> None:
        old = os.open(self.destination, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if fcntl is not None:  # the old tree is ours to remove: no other run may restore or delete it
                fcntl.flock(old, fcntl.LOCK_EX)
            old_identity = _identity(self.destination)
            with signals_deferred():
                # Recorded before the rename: a run killed before it removes the old tree leaves it known as ours.
                exchanged = _record(self.path, old_identity)
                if _renameat2(self.path, self.destination, _RENAME_EXCHANGE):
                    self._entries.append((exchanged, self.path))
                    self._record_commit()
                    aside = self.path  # the old tree now sits under the staging name
                else:
                    _forget(exchanged)
                    aside = _aside(self.destination, RETIRED_TAG)
                    self._entries.append((_record(aside, old_identity), aside))
                    os.rename(self.destination, aside)
                    try:
                        os.rename(self.path, self.destination)
                    except BaseException:
                        os.rename(aside, self.destination)  # put the old tree back before reporting
                        raise
                    self._record_commit()
            try:
                with signals_deferred():
                    _remove_old_tree(aside)
            except OSError as exc:
                _note(leftover=aside)
                self.notes.append(
                    f"left {shown(aside)}, the replaced {shown(self.destination)}: it could not be removed "
                    f"({exc.strerror or exc}); look inside and remove it"
                )
        finally:
            os.close(old)


def _remove_old_tree(folder: Path) -> None:
    """Delete the replaced DST: its regular files (all it held when it was checked), then the folder.
    Anything else that appeared since makes the last step fail and leaves the folder for a person."""
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
    os.rmdir(folder)


def _rename_no_replace(source: Path, target: Path) -> None:
    if _renameat2(source, target, _RENAME_NOREPLACE):
        return
    if os.path.lexists(target):  # no atomic no-replace here: check, then rename
        raise FileExistsError(f"{shown(target)}: appeared while writing; it was left as it was")
    os.rename(source, target)


@functools.cache
def _libc_function(name: str, *argtypes) -> Callable | None:
    """The Linux C library's ``name`` (returning an int, setting errno), looked up once; None elsewhere
    or where this C library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


def _renameat2(source: Path, target: Path, flags: int) -> bool:
    """``renameat2(source, target, flags)``; False where the C library, the kernel or the file system
    cannot do it, so that the caller falls back to plain renames."""
    renameat2 = _libc_function("renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    if code == errno.EEXIST:
        raise FileExistsError(f"{shown(target)}: appeared while writing; it was left as it was")
    raise OSError(code, os.strerror(code))


def sync_files(folder: Path, names: list[str]) -> None:
    """Make the data of the files ``names`` in ``folder`` durable: one ``syncfs`` of the folder's file
    system on Linux, since one fsync per file costs a journal commit per file; one fsync each where
    ``syncfs`` is not available."""
    if not names:
        return
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _syncfs(descriptor):
            return
    finally:
        os.close(descriptor)
    for name in names:
        file = os.open(folder / name, os.O_RDONLY)
        try:
            os.fsync(file)
        finally:
            os.close(file)


def _syncfs(descriptor: int) -> bool:
    syncfs = _libc_function("syncfs", ctypes.c_int)
    if syncfs is None:
        return False
    if syncfs(descriptor) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code))


def _sync(path: Path) -> None:
    """fsync a folder so that the names in it (the new files, a rename) survive a power cut."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:  # some file systems cannot sync a folder; nothing to do there
            raise
    finally:
        os.close(descriptor)


__all__ = ["Journal", "Staging", "journal", "pause_for_tests", "remove_litter", "signals_deferred", "sync_files"]
