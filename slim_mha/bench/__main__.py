"""``python -m slim_mha.bench`` / ``slim-mha-bench``: slim against stock and the floor, speed and memory."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .cases import DTYPES, MODES, build_matrix, parse_shape
from .contenders import equivariance_support
from .load import competing_load
from .report import (
    evaluate_targets,
    format_markdown,
    format_profiles,
    format_summary,
    format_table,
    format_targets,
    plot_speedup,
    write_json,
)
from .runner import describe_environment, run_case
from .timing import Settings

_EXAMPLES = """\
examples:
  python -m slim_mha.bench                         # quick run (about a minute on a 2-core CPU)
  python -m slim_mha.bench --full                  # the whole matrix (CPU: about 45 minutes)
  python -m slim_mha.bench --shape 8x128x256x8 --mode inference --need-weights false
  python -m slim_mha.bench --shape 4x512x512x8 --seq-len 128,256,512 --mode train --repeats 9
  python -m slim_mha.bench --device cuda --dtype bf16 --json out/cuda.json --plot out/cuda.png
  python -m slim_mha.bench --full --dry-run        # list the cases without running them
  python -m slim_mha.bench --busy 2                # the quick run beside 2 busy processes (a shared CPU)
  python -m slim_mha.bench --targets               # also check the project's speed and memory targets
  python -m slim_mha.bench --detr                  # DETR decoder layer, skip_unread_weights off vs on
"""

# Per device, (repeats, min_repeats, min_sample_s, max_case_s) for the quick and the full run.
_SETTINGS = {
    ("cpu", False): (15, 5, 0.02, 6.0),
    ("cpu", True): (21, 7, 0.05, 20.0),
    ("cuda", False): (25, 8, 0.005, 1.2),
    ("cuda", True): (41, 15, 0.01, 4.0),
}


def _csv(kind):
    def parse(text: str) -> list:
        return [kind(item) for item in text.split(",") if item.strip()]

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slim-mha-bench",
        description=(
            "Time SlimMultiheadAttention against stock nn.MultiheadAttention (same weights and inputs)\n"
            "and against the bare floor (projection matmul + scaled_dot_product_attention + output\n"
            "matmul), interleaved in one run; report median and spread, ratios, peak and saved memory."
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--full", action="store_true", help="run the whole matrix instead of the quick one")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available")
    parser.add_argument(
        "--matrix",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="which device's default matrix to build (default: the device's; cuda on cpu for a dry run)",
    )
    parser.add_argument(
        "--dtype", type=_csv(str), help="comma list of fp32, bf16, fp16 (default: fp32 on CPU, bf16,fp16 on CUDA)"
    )
    parser.add_argument(
        "--shape", action="append", metavar="BxLxExH", help="batch x seq_len x embed_dim x heads; repeatable"
    )
    parser.add_argument("--seq-len", type=_csv(int), metavar="L,L,...", help="sweep these lengths for every shape")
    parser.add_argument("--mode", type=_csv(str), metavar="MODE,...", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--attention", type=_csv(str), metavar="KIND,...", help="comma list of self, cross")
    parser.add_argument("--need-weights", choices=("both", "true", "false"), help="default: both")
    parser.add_argument("--repeats", type=int, help="timed repeats per contender (default: 15 quick, 21 full on CPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per contender first (default: 2)")
    parser.add_argument("--min-sample-ms", type=float, help="each timed sample lasts at least this long")
    parser.add_argument(
        "--max-case-s", type=float, help="stop repeating a case after this many seconds (minimum repeats first)"
    )
    parser.add_argument("--time-budget-s", type=float, help="start no new case after this many seconds")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for CPU runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--equivariance-every", type=int, metavar="N", help="sampling of the equivariance check, if slim offers one"
    )
    parser.add_argument("--json", type=Path, help="results file (default: bench-out/slim_mha_bench_<device>.json)")
    parser.add_argument("--plot", type=Path, help="speed-up plot (default: the JSON path with .png)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    parser.add_argument(
        "--markdown", type=Path, help="the full table and targets as markdown (default: the JSON path with .md)"
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="run beside N competing busy processes (started and stopped by the benchmark) to see robustness",
    )
    parser.add_argument(
        "--busy-max-s",
        type=float,
        default=1800.0,
        help="the busy processes end by themselves after this many seconds at most (default: 1800)",
    )
    parser.add_argument(
        "--targets", action="store_true", help="also print the project's targets (issues 6 and 7) with verdicts"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile each contender (torch.profiler) and print its top ops"
    )
    parser.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    parser.add_argument(
        "--detr",
        action="store_true",
        help="instead of the matrix, time DETR's decoder layer (L=100, S=950, E=256, H=8, B=2) with stock, "
        "slim and slim with skip_unread_weights=True, in inference and training (slim_mha/bench/detr.py)",
    )
    parser.add_argument(
        "--scale", action="store_true", help="run the scale sweep over N instead (options: --scale --help)"
    )
    return parser


def _resolve_device(parser: argparse.ArgumentParser, requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available to this torch; use --device cpu")
    return torch.device(requested)


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> None:
    for dtype in args.dtype or ():
        if dtype not in DTYPES:
            parser.error(f"--dtype: unknown {dtype!r}; choose from {', '.join(DTYPES)}")
    for mode in args.mode or ():
        if mode not in MODES:
            parser.error(f"--mode: unknown {mode!r}; choose from {', '.join(MODES)}")
    for attention in args.attention or ():
        if attention not in ("self", "cross"):
            parser.error(f"--attention: unknown {attention!r}; choose from self, cross")
    if args.busy < 0 or args.busy > 64:
        parser.error(f"--busy must be between 0 and 64 competing processes, got {args.busy}")
    if args.busy_max_s <= 0:
        parser.error(f"--busy-max-s must be positive, got {args.busy_max_s}")
    for name in ("repeats", "warmup", "threads", "equivariance_every"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be at least {0 if name == 'warmup' else 1}, got {value}")
    if any(length <= 0 for length in args.seq_len or ()):
        parser.error("--seq-len: lengths must be positive integers")


def _settings(args: argparse.Namespace, device: torch.device) -> Settings:
    repeats, min_repeats, min_sample_s, max_case_s = _SETTINGS[(device.type, args.full)]
    repeats = args.repeats or repeats
    return Settings(
        repeats=repeats,
        min_repeats=min(min_repeats, repeats),
        warmup=args.warmup,
        min_sample_s=args.min_sample_ms / 1e3 if args.min_sample_ms is not None else min_sample_s,
        max_case_s=args.max_case_s if args.max_case_s is not None else max_case_s,
        seed=args.seed,
    )


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
    )
    notes = []
    missing_equivariance = equivariance_support()
    if missing_equivariance and any(case.mode == "train-equivariance" for case in cases):
        cases = [case for case in cases if case.mode != "train-equivariance"]
        notes.append(missing_equivariance)
    if device.type == "cpu" and any(case.seq_len > 1024 for case in cases):
        notes.append("note: sequence lengths above 1024 on CPU are slow; the CPU matrix stops at 1024")
    return cases, notes


def _run_cases(cases: list, device: torch.device, args: argparse.Namespace, payload: dict, json_path: Path) -> None:
    """Run every case in order, saving the JSON after each so that a cut-short run keeps its cases."""
    settings = _settings(args, device)
    started = time.perf_counter()
    for index, case in enumerate(cases, 1):
        if args.time_budget_s is not None and time.perf_counter() - started > args.time_budget_s:
            payload["notes"].append(
                f"time budget of {args.time_budget_s:.0f} s spent: {len(cases) - index + 1} cases not run"
            )
            break
        result = run_case(case, device, settings, equivariance_every=args.equivariance_every, profile_ops=args.profile)
        payload["cases"].append(result)
        write_json(json_path, payload)
        ratios = result["ratios"]
        print(
            f"[{index:>3}/{len(cases)}] {case.name}  stock/slim {ratios['stock_over_slim']:.2f}x  "
            f"slim/floor {ratios['slim_over_floor']:.2f}x",
            file=sys.stderr,
            flush=True,
        )
    payload["elapsed_s"] = time.perf_counter() - started


def _busy_machine_note(results: list[dict], busy: int) -> str | None:
    loads = [load for result in results for load in result["load_average"] if load is not None]
    cores = os.cpu_count() or 1
    if busy:
        load = f"; 1-minute load {min(loads):.1f} to {max(loads):.1f} on {cores} cores" if loads else ""
        return f"ran beside {busy} competing busy process{'es' if busy > 1 else ''} (--busy){load}"
    if not loads or max(loads) <= cores + 0.5:
        return None
    return (
        f"warning: the machine was busy (1-minute load up to {max(loads):.1f} on {cores} cores);\n"
        "other processes shared the CPU, so spreads are wide and single cases may be off"
    )


def _run_detr(
    parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device, argv: list[str]
) -> int:
    from . import detr

    for option in ("full", "shape", "seq_len", "mode", "attention", "need_weights", "dtype", "dry_run"):
        if getattr(args, option):
            parser.error(f"--detr runs one fixed case: drop --{option.replace('_', '-')}")
    payload = detr.run_detr(_settings(args, device), device)
    payload["command"] = " ".join(["slim-mha-bench", *argv])
    json_path = args.json or Path("bench-out") / f"detr_{device.type}.json"
    write_json(json_path, payload)
    table = detr.format_detr(payload)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    print(table)
    print(f"results written to {json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--scale" in argv:  # the scale sweep has its own options: slim_mha/bench/scale.py
        from . import scale

        return scale.main([arg for arg in argv if arg != "--scale"])
    parser = build_parser()
    args = parser.parse_args(argv)
    device = _resolve_device(parser, args.device)
    _validate(parser, args, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.detr:
        return _run_detr(parser, args, device, argv)
    cases, notes = _plan(parser, args, device)
    if args.dry_run:
        matrix = device.type if args.matrix == "auto" else args.matrix
        print(f"{len(cases)} cases on {device.type} ({matrix} matrix):")
        print("\n".join([f"  {case.name}" for case in cases] + notes))
        return 0

    json_path = args.json or Path("bench-out") / f"slim_mha_bench_{device.type}.json"
    payload = {
        "schema": 1,
        "command": " ".join(["slim-mha-bench", *(argv if argv is not None else sys.argv[1:])]),
        "environment": describe_environment(device),
        "settings": {
            **_settings(args, device).__dict__,
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
    with competing_load(args.busy, args.busy_max_s):
        _run_cases(cases, device, args, payload, json_path)

    checks = evaluate_targets(payload["cases"], device.type)
    payload["targets"] = [check.as_dict() for check in checks]
    if not args.no_plot:
        notes.append(plot_speedup(payload["cases"], args.plot or json_path.with_suffix(".png")))
    load_note = _busy_machine_note(payload["cases"], args.busy) if device.type == "cpu" else None
    if load_note:
        notes.append(load_note)
    write_json(json_path, payload)
    markdown_path = args.markdown or json_path.with_suffix(".md")
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(format_markdown(payload) + "\n")

    print(format_table(payload["cases"]))
    print(format_summary(payload["cases"]))
    if args.profile:
        print(format_profiles(payload["cases"]))
    if args.targets:
        print(format_targets(checks))
    print("\n".join(notes))
    print(f"results ({payload['elapsed_s']:.0f} s): {json_path}\nfull table and targets: {markdown_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
