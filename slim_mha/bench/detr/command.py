"""``python -m slim_mha.bench detr``: DETR's decoder layer with ``skip_unread_weights`` off and on."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..measure.allocator import allocator_state
from ..measure.options import (
    add_device_option,
    add_timing_options,
    device_and_settings,
    subcommand,
)
from ..measure.output import write_json
from .layer import format_detr, format_detr_lines, run_detr

__all__ = ["add_parser", "run"]

_EXAMPLES = """\
examples:
  python -m slim_mha.bench detr
  python -m slim_mha.bench detr --repeats 31 --json out/detr.json --markdown out/detr.md
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subcommand(
        subparsers,
        "detr",
        help="DETR's decoder layer: stock, slim, slim with skip_unread_weights=True",
        description="Time DETR's decoder layer (L=100, S=950, E=256, H=8, B=2) with stock, slim and slim with\n"
        "skip_unread_weights=True, in inference and training (slim_mha/bench/detr/layer.py).",
        examples=_EXAMPLES,
    )
    add_device_option(parser)
    add_timing_options(parser, repeats_help="timed repeats per contender (default: 15 on CPU)")
    parser.add_argument("--json", type=Path, help="results file (default: bench-out/detr_<device>.json)")
    parser.add_argument("--markdown", type=Path, help="also write the results as a Markdown table here")
    parser.set_defaults(handler=run, parser=parser)
    return parser


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Time the DETR layer as ``args`` say; ``argv`` is recorded as the command."""
    device, settings = device_and_settings(args)
    print(f"expected time: at most about {3 * (settings.max_case_s + 10) / 60:.0f} minutes (three modes)", flush=True)
    with allocator_state("warm"):
        payload = run_detr(settings, device)
    payload["command"] = " ".join(["python -m slim_mha.bench", *argv])
    json_path = args.json or Path("bench-out") / f"detr_{device.type}.json"
    write_json(json_path, payload)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(format_detr(payload) + "\n")
    print(format_detr_lines(payload))
    print(f"results written to {json_path}")
    return 0
