"""Competing load for ``--busy N``: N processes that each keep one core busy while the matrix runs.

Real CPUs are rarely quiet (data-loader workers, a second job, a test runner), and a layer that is
fast alone can be slow beside them: every multi-threaded op waits at a barrier for its slowest
thread, so a step made of many small ops loses more than one made of a few large ones. The busy
processes are plain Python loops, started before the first case and stopped after the last one.

They are bounded three ways, so that none can outlive the benchmark: the benchmark stops them on
its way out (also on an error or Ctrl-C), each one exits by itself after ``max_seconds``, and each
one exits as soon as its parent process is gone (checked every 0.1 s).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["competing_load"]

# Spins until the deadline or until its parent (the benchmark) is gone; reparenting changes getppid().
_SPIN = """\
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline and os.getppid() == parent:
    end = time.monotonic() + 0.1
    while time.monotonic() < end:
        pass
"""


@contextlib.contextmanager
def competing_load(processes: int, max_seconds: float) -> Iterator[list[int]]:
    """Run ``processes`` busy loops for the duration of the block; yields their process ids."""
    started: list[subprocess.Popen] = []
    try:
        for _ in range(processes):
            started.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(os.getpid()), str(max_seconds)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield [process.pid for process in started]
    finally:
        for process in started:
            process.terminate()
        for process in started:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
