"""``python -m slim_mha.bench`` / ``slim-mha-bench``: wires the subcommands, one subpackage each.

* ``run`` (the default, also with its options and no subcommand): ``matrix/command.py``;
* ``scale``, ``model``: ``<name>/command.py`` (``model`` runs the factories of ``models.py`` too).
"""

from __future__ import annotations

import argparse
import sys

from .matrix import command as run_command
from .model import command as model
from .scale import command as scale_command

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slim-mha-bench",
        description="Benchmark SlimMultiheadAttention against stock nn.MultiheadAttention. Without a\n"
        "subcommand, or with its options alone, it does what 'run' does.",
        epilog=run_command.EXAMPLES
        + "  python -m slim_mha.bench scale --help  # the other subcommands: scale, model\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_command.add_options(parser)
    parser.set_defaults(handler=run_command.run, parser=parser)
    subparsers = parser.add_subparsers(title="subcommands", metavar="COMMAND")
    for command in (run_command, scale_command, model):
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return args.handler(args, argv)


if __name__ == "__main__":
    sys.exit(main())
