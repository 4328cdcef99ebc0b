"""``python -m slim_mha.bench scale``: the scale sweep's command line."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..measure.environment import describe_environment, load_averages
from ..measure.options import add_device_option, check_bounds, comma_list, resolve_device, subcommand
from ..measure.output import write_json
from .cases import (
    BUDGETS,
    CONTENDERS,
    DTYPES,
    MODES,
    SHAPES,
    TOKENS,
    Settings,
    build_series,
)
from .child import default_memory_cap
from .report import fit_line, format_cell, format_markdown, format_mib, format_table, plot_scale
from .sweep import run_sweep

__all__ = ["add_parser", "run"]

_EXAMPLES = """\
examples:
  python -m slim_mha.bench scale              # the default sweep; its budget bounds the time
  python -m slim_mha.bench scale --shape point-cloud --mode inference --padding-mask without
  python -m slim_mha.bench scale --tokens 1024,8192,65536 --budget-s 1800 --case-budget-s 60
  python -m slim_mha.bench scale --memory-cap 4GiB --json out/scale.json
  python -m slim_mha.bench scale --dry-run    # list the cases without running them
"""


def _bytes(text: str) -> int:
    units = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 10**9, "mb": 10**6, "b": 1}
    lowered = text.strip().lower()
    for unit, size in units.items():
        if lowered.endswith(unit):
            try:
                value = float(lowered[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return int(value * size)
            break
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive size such as 4GiB or 512MiB")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The ``scale`` subcommand and its options."""
    parser = subcommand(
        subparsers,
        "scale",
        help="how time and memory grow with the number of tokens N",
        description="How time and memory of stock and slim attention grow with the number of tokens N\n"
        "(need_weights=False), each case in its own capped process.",
        examples=_EXAMPLES,
    )
    parser.set_defaults(handler=run, parser=parser)
    add_device_option(parser)
    parser.add_argument(
        "--tokens",
        type=comma_list(int),
        metavar="N,N,...",
        help="token counts (default: 1k to 100k on CPU, to 1M on CUDA)",
    )
    parser.add_argument(
        "--shape", type=comma_list(str, SHAPES), metavar="NAME,...", help=f"comma list of {', '.join(SHAPES)}"
    )
    parser.add_argument(
        "--mode", type=comma_list(str, MODES), metavar="MODE,...", help="comma list of inference, train"
    )
    parser.add_argument("--padding-mask", choices=("both", "with", "without"), default="both")
    parser.add_argument(
        "--contender", type=comma_list(str, CONTENDERS), metavar="NAME,...", help="comma list of stock, slim"
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences per call (default: 1)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument(
        "--budget-s", type=float, help="start no case after this many seconds (default: 300 CPU, 600 CUDA)"
    )
    parser.add_argument(
        "--case-budget-s",
        type=float,
        help="stop a curve once a call takes, or is extrapolated to take, longer (default: 30 CPU, 60 CUDA)",
    )
    parser.add_argument(
        "--case-timeout-s", type=float, help="kill a case's process after this long (default: 4x the case budget + 60)"
    )
    parser.add_argument(
        "--memory-cap",
        type=_bytes,
        metavar="SIZE",
        help="address space each CPU case may add, e.g. 4GiB (default: half the available memory)",
    )
    parser.add_argument(
        "--no-memory-cap", action="store_true", help="do not cap the cases' memory (not on a shared machine)"
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads in each case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="results file (default: bench-out/slim_mha_scale_<device>.json)")
    parser.add_argument("--markdown", type=Path, help="Markdown report (default: the JSON path with .md)")
    parser.add_argument("--plot", type=Path, help="log-log plot (default: the JSON path with .png)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    return parser


def _settings_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    device = resolve_device(parser, args.device).type
    check_bounds(parser, args, {"batch": 1, "threads": 1}, positive=("budget_s", "case_budget_s", "case_timeout_s"))
    if any(n < 1 for n in args.tokens or ()):
        parser.error("--tokens: token counts must be positive integers")
    if args.memory_cap is not None and args.no_memory_cap:
        parser.error("--memory-cap and --no-memory-cap contradict each other; pass one")
    budget, case_budget = BUDGETS[device]
    case_budget = args.case_budget_s or case_budget
    cap = None if args.no_memory_cap or device == "cuda" else (args.memory_cap or default_memory_cap())
    return Settings(
        device=device,
        dtype=args.dtype or ("bf16" if device == "cuda" else "fp32"),
        batch=args.batch,
        budget_s=args.budget_s or budget,
        case_budget_s=case_budget,
        case_timeout_s=args.case_timeout_s or 4 * case_budget + 60,
        memory_cap_bytes=cap,
        threads=args.threads,
        seed=args.seed,
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the sweep ``args`` describe; ``argv`` is recorded as the command."""
    parser = args.parser
    settings = _settings_from(parser, args)
    masks = {"both": None, "with": [True], "without": [False]}[args.padding_mask]
    series_list = build_series(args.shape, args.mode, masks, args.contender)
    tokens = sorted(set(args.tokens or TOKENS[settings.device]))
    if args.dry_run:
        print(f"{len(series_list)} curves x {len(tokens)} token counts on {settings.device} ({_cap(settings)}):")
        print("\n".join(f"  {series.name}: N = {', '.join(f'{n:,}' for n in tokens)}" for series in series_list))
        return 0

    if settings.threads:
        torch.set_num_threads(settings.threads)
    json_path = args.json or Path("bench-out") / f"slim_mha_scale_{settings.device}.json"
    payload: dict[str, Any] = {
        "schema": 1,
        "kind": "scale",
        "command": " ".join(["python -m slim_mha.bench", *argv]),
        "environment": describe_environment(torch.device(settings.device)),
        "settings": asdict(settings),
        "tokens": tokens,
        "load_before": load_averages(),
        "cases": [],
        "stops": {},
        "notes": [],
    }
    print(
        f"slim_mha scale sweep: {len(series_list)} curves x {len(tokens)} token counts on {settings.device}, "
        f"{_cap(settings)}",
        flush=True,
    )
    print(
        f"expected time: at most about {settings.budget_s / 60:.0f} minutes (the sweep budget) plus the last "
        f"case (up to {settings.case_timeout_s:.0f} s)",
        flush=True,
    )

    def on_case(record: dict) -> None:
        payload["cases"].append(record)
        write_json(json_path, payload)
        if record["status"] != "skipped" or "budget" not in record.get("detail", ""):
            detail = format_cell(record) if record["status"] == "ok" else record.get("detail", record["status"])
            print(fit_line(f"  {record['name']:<40} N={record['tokens']:>9,}  {detail}"), file=sys.stderr, flush=True)

    # The first configuration (the point-cloud shape at inference, without a mask, by default) runs
    # over every N first: even a short budget then records stock's OOM point and slim's largest N.
    lead = len(args.contender or CONTENDERS)
    result = run_sweep(series_list, tokens, settings, lead=lead, on_case=on_case)
    payload.update(stops=result["stops"], elapsed_s=result["elapsed_s"], load_after=load_averages())
    if not args.no_plot:
        payload["notes"].append(plot_scale(payload, args.plot or json_path.with_suffix(".png")))
    markdown_path = args.markdown or json_path.with_suffix(".md")
    write_json(json_path, payload)
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(format_markdown(payload) + "\n")
    print(format_table(payload["cases"]))
    print("\n".join(payload["notes"]))
    print(f"results written to {json_path} ({payload['elapsed_s']:.0f} s)\nreport: {markdown_path}")
    return 0


def _cap(settings: Settings) -> str:
    return f"memory cap {format_mib(settings.memory_cap_bytes) if settings.memory_cap_bytes else 'none'}"
