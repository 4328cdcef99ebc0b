"""The migration CLI, held still at one point so that a test can kill or interrupt it there.

``python tests/_paused_migration.py POINT READY ARGS...`` runs ``python -m slim_mha.migration ARGS...``
as that command runs, except that at ``POINT`` (a name the run hands to ``_staging.AT_POINT``) it
creates the file ``READY`` and waits, a minute at most, while that file exists. The hold is set
here, from outside: no real run reads a switch for it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from slim_mha.migration import _staging
from slim_mha.migration.cli import main


def hold_at(point: str, ready: str):
    def at_point(reached: str) -> None:
        if reached != point:
            return
        Path(ready).touch()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and os.path.exists(ready):
            time.sleep(0.05)

    return at_point


if __name__ == "__main__":
    point, ready, *arguments = sys.argv[1:]
    _staging.AT_POINT = hold_at(point, ready)
    sys.argv = ["python -m slim_mha.migration", *arguments]
    sys.exit(main(prog="python -m slim_mha.migration"))
