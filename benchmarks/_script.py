"""The options every script in this folder takes, and its settings line: ``--repeats``, ``--threads``,
``--busy`` and ``--shape``. Scripts import it as ``_script`` (Python puts a script's own folder on
``sys.path``); it is the repository's, not the package's, so it does not ship in the wheel."""

from __future__ import annotations

import argparse

import torch


def script_parser(description: str, shapes: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options every script in ``benchmarks/`` takes: ``--repeats``, ``--threads``, ``--busy`` and
    ``--shape`` (repeatable, ``shapes`` by default); a script adds its own before parsing."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="run beside N busy processes (default: 0)")
    parser.add_argument(
        "--shape", action="append", metavar="BxLxExH", help=f"repeatable (default: {', '.join(shapes)})"
    )
    return parser


def parse_script_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, check ``--busy``, set torch's threads and print the run's settings line."""
    args = parser.parse_args()
    if not 0 <= args.busy <= 64:
        parser.error(f"--busy must be between 0 and 64 competing processes, got {args.busy}")
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats, allocator warm, "
        f"busy {args.busy}"
    )
    return args
