"""Options that the benchmark's subcommands share: the device and the timing settings."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from .timing import Settings

__all__ = [
    "AddsArguments",
    "add_device_option",
    "add_timing_options",
    "check_bounds",
    "comma_list",
    "resolve_device",
    "timing_settings",
    "device_and_settings",
    "subcommand",
]

# Per device, (repeats, min_repeats, min_sample_s, max_case_s) for the quick and the full run.
_SETTINGS = {
    ("cpu", False): (15, 5, 0.02, 6.0),
    ("cpu", True): (21, 7, 0.05, 20.0),
    ("cuda", False): (25, 8, 0.005, 1.2),
    ("cuda", True): (41, 15, 0.01, 4.0),
}


class AddsArguments(Protocol):
    """What the option helpers need of a parser: ``add_argument`` (a parser, or a wrapper around one)."""

    def add_argument(self, *names: str, **options: Any) -> argparse.Action: ...


def comma_list(kind: Callable[[str], Any] = str, choices: Iterable[str] | None = None) -> Callable[[str], list]:
    """An option's ``type``: ``"a,b"`` -> ``[kind("a"), kind("b")]``, each one of ``choices`` when given."""
    allowed = None if choices is None else tuple(choices)

    def parse(text: str) -> list:
        items = [kind(item.strip()) for item in text.split(",") if item.strip()]
        bad = [item for item in items if allowed is not None and item not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad[0]!r}; choose from {', '.join(allowed or ())}")
        return items

    return parse


def check_bounds(
    parser: argparse.ArgumentParser, args: argparse.Namespace, least: dict[str, float], positive: tuple[str, ...] = ()
) -> None:
    """A one-line error through ``parser`` for an option below its ``least`` value, or not above 0 where
    it is named in ``positive``; options left unset (``None``) pass."""
    for name, bound in [*least.items(), *((name, 0) for name in positive)]:
        value = getattr(args, name, None)
        if value is not None and (value <= bound if name in positive else value < bound):
            rule = "positive" if name in positive else f"at least {bound}"
            parser.error(f"--{name.replace('_', '-')} must be {rule}, got {value}")


def add_device_option(parser: AddsArguments) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available")


def add_timing_options(parser: AddsArguments, *, repeats_help: str, cold: bool = True) -> None:
    """``--repeats`` and the rest; ``cold``: also ``--cold-repeats``, for commands that time both states."""
    parser.add_argument("--repeats", type=int, help=repeats_help)
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per contender first (default: 2)")
    if cold:
        parser.add_argument(
            "--cold-repeats",
            type=int,
            default=5,
            help="CPU: repeats with the allocator cold, for page faults per call (default: 5; 0: none)",
        )
    parser.add_argument("--min-sample-ms", type=float, help="each timed sample lasts at least this long")
    parser.add_argument(
        "--max-case-s", type=float, help="stop repeating a case after this many seconds (minimum repeats first)"
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for CPU runs")
    parser.add_argument("--seed", type=int, default=0)


def resolve_device(parser: argparse.ArgumentParser, requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available to this torch; use --device cpu")
    return torch.device(requested)


def timing_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device, *, full: bool = False
) -> Settings:
    """The timing settings from the options, after checking them (one-line errors through ``parser``)."""
    check_bounds(parser, args, {"repeats": 1, "warmup": 0, "cold_repeats": 0, "threads": 1})
    repeats, min_repeats, min_sample_s, max_case_s = _SETTINGS[(device.type, full)]
    repeats = args.repeats or repeats
    return Settings(
        repeats=repeats,
        min_repeats=min(min_repeats, repeats),
        warmup=args.warmup,
        min_sample_s=args.min_sample_ms / 1e3 if args.min_sample_ms is not None else min_sample_s,
        max_case_s=args.max_case_s if args.max_case_s is not None else max_case_s,
        seed=args.seed,
        cold_repeats=getattr(args, "cold_repeats", 0) if device.type == "cpu" else 0,
    )


def subcommand(subparsers, name: str, *, help: str, description: str, examples: str) -> argparse.ArgumentParser:
    """A subcommand's parser, its description and examples printed as written."""
    return subparsers.add_parser(
        name, help=help, description=description, epilog=examples, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def device_and_settings(args: argparse.Namespace, *, full: bool = False) -> tuple[torch.device, Settings]:
    """A subcommand's device and timing settings from its options; ``--threads`` applied."""
    device = resolve_device(args.parser, args.device)
    settings = timing_settings(args.parser, args, device, full=full)
    if args.threads:
        torch.set_num_threads(args.threads)
    return device, settings
