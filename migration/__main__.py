"""``python -m slim_mha.migration``: the same CLI as ``slim-mha-migrate``."""

import sys

from .cli import main

sys.exit(main(prog="python -m slim_mha.migration"))
