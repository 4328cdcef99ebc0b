"""``python -m slim_mha.bench [run]``: the matrix of cases, slim against stock and the floor.

Each case checks that the contenders agree, measures their memory, then times them interleaved:
first with the C allocator cold (every call faults its memory in; page faults per call), then warm
(buffers reused: the compute ratio). ``measure/allocator.py`` says how each state is set and why.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..measure.allocator import allocator_state
from ..measure.environment import describe_environment
from ..measure.load import competing_load
from ..measure.options import (
    AddsArguments,
    add_device_option,
    add_timing_options,
    check_bounds,
    comma_list,
    resolve_device,
    subcommand,
    timing_settings,
)
from ..measure.output import write_json
from .cases import DTYPES, MASKINGS, MODES, build_matrix, parse_shape
from .report import (
    evaluate_targets,
    format_markdown,
    format_summary,
    format_table,
    format_targets,
    is_stalled,
    paired_ratio,
)
from .runner import CaseOptions, run_case

__all__ = ["EXAMPLES", "add_options", "add_parser", "run"]

EXAMPLES = """\
examples:
  python -m slim_mha.bench                  # the quick run (same as: python -m slim_mha.bench run)
  python -m slim_mha.bench run --full       # the whole matrix
  python -m slim_mha.bench run --shape 8x128x256x8 --mode inference --need-weights false
  python -m slim_mha.bench run --shape 4x512x512x8 --seq-len 128,256,512 --mode train --repeats 9
  python -m slim_mha.bench run --device cuda --dtype bf16 --json out/cuda.json
  python -m slim_mha.bench run --full --dry-run   # list the cases without running them
  python -m slim_mha.bench run --busy 2     # the quick run beside 2 busy processes (a shared CPU)
  python -m slim_mha.bench run --threads 1  # ratios that reproduce when other processes share the CPU
  python -m slim_mha.bench run --mode inference --need-weights true --one-pass --blocks 2  # slim's other paths
  python -m slim_mha.bench run --mode inference --masks padding,causal  # bool masks, self-attention
"""


def add_options(parser: AddsArguments) -> None:
    """The run's options, on the ``run`` subcommand and on the bare command (the run is the default)."""
    parser.add_argument("--full", action="store_true", help="run the whole matrix instead of the quick one")
    add_device_option(parser)
    parser.add_argument(
        "--matrix",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="which device's default matrix to build (default: the device's)",
    )
    parser.add_argument(
        "--dtype",
        type=comma_list(str, DTYPES),
        help="comma list of fp32, bf16, fp16, bf16-autocast (fp32 modules under autocast; default: fp32 on CPU, bf16,fp16 on CUDA)",
    )
    parser.add_argument(
        "--shape", action="append", metavar="BxLxExH", help="batch x seq_len x embed_dim x heads; repeatable"
    )
    parser.add_argument(
        "--seq-len", type=comma_list(int), metavar="L,L,...", help="sweep these lengths for every shape"
    )
    parser.add_argument(
        "--mode", type=comma_list(str, MODES), metavar="MODE,...", help=f"comma list of {', '.join(MODES)}"
    )
    parser.add_argument(
        "--attention", type=comma_list(str, ("self", "cross")), metavar="KIND,...", help="comma list of self, cross"
    )
    parser.add_argument("--need-weights", choices=("both", "true", "false"), help="default: both")
    parser.add_argument(
        "--masks",
        type=comma_list(str, MASKINGS),
        metavar="MASKS,...",
        help="comma list of none, padding (the last quarter of the keys of every other row), causal, both; "
        "bool, self-attention only",
    )
    parser.add_argument(
        "--one-pass",
        action="store_true",
        help="also time slim's own one-pass path, which it takes where stock's kernel does not apply",
    )
    parser.add_argument(
        "--blocks", type=int, default=0, metavar="N", help="also time slim forced into N blocks of query rows"
    )
    add_timing_options(parser, repeats_help="timed repeats per contender (default: 15 quick, 21 full on CPU)")
    parser.add_argument("--time-budget-s", type=float, help="start no new case after this many seconds")
    parser.add_argument(
        "--equivariance-every", type=int, metavar="N", help="sampling of the equivariance check, if slim offers one"
    )
    parser.add_argument("--json", type=Path, help="results file (default: bench-out/slim_mha_bench_<device>.json)")
    # Options of earlier releases: --no-plot and --targets change nothing now; the others are refused (_RETIRED).
    parser.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plot", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--markdown", type=Path, help="the full table and targets as markdown (default: the JSON path with .md)"
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="run beside N busy processes (started and stopped by the benchmark), as on a shared CPU",
    )
    parser.add_argument(
        "--busy-max-s",
        type=float,
        default=1800.0,
        help="the busy processes end by themselves after this many seconds at most (default: 1800)",
    )
    parser.add_argument("--targets", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="stock and slim each under torch.compile (default backend: inductor), graph breaks counted",
    )
    parser.add_argument("--dry-run", action="store_true", help="list the cases and exit")


class _WithoutDefaults:
    """A parser's ``add_argument`` with every default suppressed: an option left out leaves the
    namespace alone, where the bare command's parser has already put its default or its value."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._parser = parser

    def add_argument(self, *names: str, **options) -> argparse.Action:
        return self._parser.add_argument(*names, **{**options, "default": argparse.SUPPRESS})


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The ``run`` subcommand, with the run's options and no defaults of its own (the bare command's apply)."""
    parser = subcommand(
        subparsers,
        "run",
        help="the matrix of cases, slim against stock and the floor (the default)",
        description=__doc__.split("\n\n")[1],
        examples=EXAMPLES,
    )
    add_options(_WithoutDefaults(parser))
    parser.set_defaults(handler=run, parser=parser)
    return parser


_RETIRED = {
    "plot": "bench run draws no plot now: its numbers are in the markdown and JSON files (bench scale still plots)",
    "profile": "bench run profiles no more: run torch.profiler on your own step, or slim_mha.explain for the paths",
}


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, fix in _RETIRED.items():
        if getattr(args, name, None):
            parser.error(f"--{name}: {fix}")
    if args.busy < 0 or args.busy > 64:
        parser.error(f"--busy must be between 0 and 64 competing processes, got {args.busy}")
    check_bounds(parser, args, {"equivariance_every": 1, "blocks": 0}, positive=("busy_max_s",))
    if any(length <= 0 for length in args.seq_len or ()):
        parser.error("--seq-len: lengths must be positive integers")


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> tuple[list, list[str]]:
    """The cases to run and the notes about what was left out."""
    try:
        shapes = [parse_shape(text) for text in args.shape] if args.shape else None
    except ValueError as error:
        parser.error(f"--shape: {error}")
    matrix = device.type if args.matrix == "auto" else args.matrix
    dtypes = args.dtype or (["bf16", "fp16"] if matrix == "cuda" else ["fp32"])
    need_weights = None if args.need_weights in (None, "both") else [args.need_weights == "true"]
    cases = build_matrix(
        device=matrix,
        dtypes=dtypes,
        full=args.full,
        shapes=shapes,
        seq_lens=args.seq_len,
        modes=args.mode,
        attentions=args.attention,
        need_weights=need_weights,
        masks=args.masks,
    )
    if any(args.blocks > case.seq_len for case in cases):
        parser.error(f"--blocks must be at most every case's sequence length, got {args.blocks}")
    notes = []
    if device.type == "cpu" and any(case.seq_len > 1024 for case in cases):
        notes.append("note: sequence lengths above 1024 on CPU are slow; the CPU matrix stops at 1024")
    return cases, notes


def _run_cases(cases: list, device: torch.device, args: argparse.Namespace, payload: dict, json_path: Path) -> None:
    """Run every case in order, saving the JSON after each so that a cut-short run keeps its cases."""
    settings = timing_settings(args.parser, args, device, full=args.full)
    options = CaseOptions(args.equivariance_every, args.compile, args.one_pass, args.blocks)
    started = time.perf_counter()
    for index, case in enumerate(cases, 1):
        if args.time_budget_s is not None and time.perf_counter() - started > args.time_budget_s:
            payload["notes"].append(
                f"time budget of {args.time_budget_s:.0f} s spent: {len(cases) - index + 1} cases not run"
            )
            break
        result = run_case(case, device, settings, options)
        payload["cases"].append(result)
        write_json(json_path, payload)
        ratios = result["ratios"]
        left = (time.perf_counter() - started) / index * (len(cases) - index)
        verdict = (
            "stalled twice: no ratio"
            if is_stalled(result)
            else f"stock/slim {ratios['stock_over_slim']:.2f}x (paired {paired_ratio(result):.2f}x)"
        )
        if "graph_breaks" in result:
            verdict += "  graph breaks " + ", ".join(f"{n} {b['count']}" for n, b in result["graph_breaks"].items())
        print(
            f"[{index:>3}/{len(cases)}] {' '.join(case.name.split())}  {verdict}"
            + (f"  about {left:.0f} s left" if left else ""),
            file=sys.stderr,
            flush=True,
        )
    payload["elapsed_s"] = time.perf_counter() - started


def _matmul_rate(device: torch.device) -> float:
    """Floating-point operations per second of a 512 x 512 fp32 matmul here and now (load included)."""
    a = torch.randn(512, 512, device=device)
    torch.mm(a, a)  # the first call loads the kernel
    started = time.perf_counter()
    for _ in range(5):
        torch.mm(a, a)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 5 * 2 * 512**3 / max(time.perf_counter() - started, 1e-9)


# Beside busy processes a two-thread call was measured up to about 30 times slower than alone (each
# multi-threaded op waits for a core at its barrier); the upper end of the estimate allows 20 times.
_SLOWDOWN = 20.0


def _estimate(cases: list, settings, device: torch.device) -> str:
    """The run's expected time as a range, from each case's matmul work at the rate this machine gives now.

    A case runs about ten untimed calls per contender (warm-ups, the agreement check, memory
    profiling), its cold repeats, and its warm repeats until ``max_case_s`` (past the minimum);
    each sample lasts at least ``min_sample_s``. Training counts three times the forward's work.
    The low end takes every call at the measured rate; the high end ``_SLOWDOWN`` times slower,
    as beside busy processes, where the warm repeats still stop at ``max_case_s``.
    """
    rate = _matmul_rate(device)

    def case_seconds(case, slowdown: float) -> float:
        batch, length, width, _ = case.shape
        flops = 8 * batch * length * width * width + 4 * batch * length * length * width  # projections + attention
        call = flops * (3 if case.trains else 1) / rate * slowdown
        repeat = 3 * max(call, settings.min_sample_s)  # one sample of each contender
        warm = min(settings.repeats * repeat, max(settings.max_case_s + repeat, settings.min_repeats * repeat))
        return 3 * 10 * call + settings.cold_repeats * repeat + warm

    low, high = (_duration(sum(case_seconds(case, slowdown) for case in cases)) for slowdown in (1.0, _SLOWDOWN))
    span = f"about {low}" if low == high else f"{low} to {high}"
    return f"expected time: {span} for {len(cases)} case(s) (quiet to beside busy processes)"


def _duration(seconds: float) -> str:
    return f"{max(seconds, 1):.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"


def _busy_machine_note(results: list[dict], busy: int) -> str | None:
    loads = [load for result in results for load in result["load_average"] if load is not None]
    cores = os.cpu_count() or 1
    if busy:
        load = f"; 1-minute load {min(loads):.1f} to {max(loads):.1f} on {cores} cores" if loads else ""
        return f"ran beside {busy} competing busy process{'es' if busy > 1 else ''} (--busy){load}"
    if not loads or max(loads) <= cores + 0.5:
        return None
    warning = (
        f"warning: the machine was busy (1-minute load up to {max(loads):.1f} on {cores} cores);\n"
        "other processes shared the CPU, so spreads are wide and single cases may be off"
    )
    if torch.get_num_threads() == 1:
        return warning
    return warning + (
        ". Each op waits\nfor its slowest thread: --threads 1 gives ratios that reproduce from run to run on a busy CPU"
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the matrix ``args`` describe; ``argv`` is recorded as the command."""
    parser = args.parser
    device = resolve_device(parser, args.device)
    _validate(parser, args)
    settings = timing_settings(parser, args, device, full=args.full)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases, notes = _plan(parser, args, device)
    if args.dry_run:
        matrix = device.type if args.matrix == "auto" else args.matrix
        print(f"{len(cases)} cases on {device.type} ({matrix} matrix):")
        print("\n".join([f"  {case.name}" for case in cases] + notes))
        return 0

    json_path = args.json or Path("bench-out") / f"slim_mha_bench_{device.type}.json"
    payload: dict[str, Any] = {
        "schema": 1,
        "command": " ".join(["python -m slim_mha.bench", *argv]),
        "environment": describe_environment(device),
        "settings": {
            **settings.__dict__,
            "full": args.full,
            "threads": torch.get_num_threads(),
            "equivariance_every": args.equivariance_every,
            "busy_processes": args.busy,
        },
        "notes": notes,
        "cases": [],
    }
    busy = f", beside {args.busy} busy processes" if args.busy else ""
    print(
        f"slim_mha benchmark: {len(cases)} cases on {payload['environment']['device_name']} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads{busy})",
        flush=True,
    )
    with competing_load(args.busy, args.busy_max_s), allocator_state("warm"):
        print(_estimate(cases, settings, device), flush=True)  # at the speed the busy processes leave
        _run_cases(cases, device, args, payload, json_path)

    checks = evaluate_targets(payload["cases"], device.type, busy=args.busy)
    payload["targets"] = [check.as_dict() for check in checks]
    load_note = _busy_machine_note(payload["cases"], args.busy) if device.type == "cpu" else None
    if load_note:
        notes.append(load_note)
    write_json(json_path, payload)
    markdown_path = args.markdown or json_path.with_suffix(".md")
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(format_markdown(payload) + "\n")

    print(format_table(payload["cases"]))
    print(format_summary(payload["cases"]))
    print(format_targets(checks))  # the same verdicts, in the same words, as the markdown file
    print("\n".join(notes))
    print(f"results ({payload['elapsed_s']:.0f} s): {json_path}\nfull table and targets: {markdown_path}")
    return 0
