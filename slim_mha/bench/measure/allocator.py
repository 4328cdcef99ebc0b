"""The C allocator's state, set by the benchmark rather than inherited from the process's history.

On glibc, whether a large buffer freed by one call is reused by the next depends on the allocator's
state: a buffer at or above the mmap threshold gets a fresh mapping on every call, which the kernel
then faults in page by page, and the threshold itself moves as the process frees mapped chunks. Two
processes running the same code can land in either state, and a contender that allocates more per
call (stock's native path does) pays for it in one state and not in the other. So the benchmark
sets the state itself, through ``mallopt``, and measures each state for what it is:

* **warm**: no buffer is mapped (``M_MMAP_MAX=0``) and freed memory is never given back
  (``M_TRIM_THRESHOLD`` at its maximum), so once the heap has grown to a call's needs every buffer
  comes from pages the process already holds and a call faults no page. Aligned allocations can
  land on free chunks whose pages were handed back earlier (by the cold state's ``malloc_trim``)
  for a few calls before they settle, so :func:`settle` repeats a step untimed until calls fault
  (almost) nothing several times in a row, at most :data:`SETTLE_CALLS` calls. This is the steady
  state of a long-running job, and the compute ratio is measured in it.
* **cold**: every buffer of 64 KiB or more gets a fresh mapping (``M_MMAP_THRESHOLD=65536``, as
  ``MALLOC_MMAP_THRESHOLD_=65536`` does), and before each call ``malloc_trim(0)`` hands back the
  free pages the heap still holds, so every call faults in all of its working memory. The minor page
  faults per call and the time in this state are what a contender's memory traffic costs.

``M_ARENA_MAX`` is left alone: the two settings above apply to every arena, and the fault counts
per call (zero when warm) show that no arena escapes them. Elsewhere than glibc nothing is set; the
JSON then says the allocator was inherited, and the fault counts still show its state.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import resource
from collections.abc import Callable, Iterator

__all__ = ["COLD", "SETTLE_CALLS", "WARM", "allocator_state", "describe_allocator", "minor_faults", "prepare_cold_call"]

# mallopt's parameter numbers, from glibc's <malloc.h>.
_PARAMETERS = {"M_TRIM_THRESHOLD": -1, "M_MMAP_THRESHOLD": -3, "M_MMAP_MAX": -4}
_INT_MAX = 2**31 - 1  # mallopt takes an int
WARM = {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": _INT_MAX}
SETTLE_CALLS = 40
_SETTLED_FAULTS = 16  # pages a settled call may still fault (Python's own small allocations)
_SETTLED_RUN = 3  # quiet calls in a row that count as settled
# glibc's defaults for M_MMAP_MAX and M_TRIM_THRESHOLD; the mmap threshold pinned at 64 KiB.
COLD = {"M_MMAP_MAX": 65536, "M_TRIM_THRESHOLD": 128 * 1024, "M_MMAP_THRESHOLD": 64 * 1024}


def _load_glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``), else ``None``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
        return libc
    except (OSError, AttributeError):
        return None


_GLIBC = _load_glibc()


def minor_faults() -> int:
    """Minor page faults of this process so far, all threads (the kernel mapping a fresh page)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _apply(settings: dict[str, int]) -> bool:
    if _GLIBC is None:
        return False
    return all(_GLIBC.mallopt(_PARAMETERS[name], value) == 1 for name, value in settings.items())


def settle(step: Callable[[], None], reset: Callable[[], None]) -> int:
    """Call ``step`` untimed until :data:`_SETTLED_RUN` calls in a row fault at most a few pages each,
    at most :data:`SETTLE_CALLS` times; returns the calls made.

    One quiet call is not enough: ``malloc_trim`` in the cold state hands back the pages of free chunks
    inside the heap too, and successive calls can land on different such chunks, each faulting once.
    """
    quiet = 0
    for calls in range(1, SETTLE_CALLS + 1):
        reset()
        before = minor_faults()
        step()
        quiet = quiet + 1 if minor_faults() - before <= _SETTLED_FAULTS else 0
        if quiet == _SETTLED_RUN:
            return calls
    return SETTLE_CALLS


def prepare_cold_call() -> None:
    """Hand the heap's free pages back to the kernel, so that the next call faults its memory in anew."""
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)


@contextlib.contextmanager
def allocator_state(state: str) -> Iterator[bool]:
    """Hold the allocator ``"warm"`` or ``"cold"`` for the block, warm after it; yields whether it was set."""
    if state not in ("warm", "cold"):
        raise ValueError(f"allocator state {state!r}: choose 'warm' or 'cold'")
    applied = _apply(WARM if state == "warm" else COLD)
    if state == "cold":
        prepare_cold_call()
    try:
        yield applied
    finally:
        _apply(WARM)


def describe_allocator() -> dict:
    """For the JSON: which allocator, whether the benchmark controls it, the settings of each state."""
    environment = {name: value for name, value in os.environ.items() if name.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    if _GLIBC is None:
        return {
            "library": "unknown (not glibc)",
            "controlled": False,
            "environment": environment,
            "note": "the allocator's state was inherited; page faults per call show what it was",
        }
    return {
        "library": f"glibc {_GLIBC.gnu_get_libc_version().decode()}",
        "controlled": True,
        "warm": dict(WARM),
        "cold": {**COLD, "malloc_trim_before_each_call": True},
        "environment": environment,
    }
