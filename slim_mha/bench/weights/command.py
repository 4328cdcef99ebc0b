"""``python -m slim_mha.bench weights``: inference with averaged weights, stock's default call.

Times stock (its native kernel), slim (the same kernel given ``[b_q; 0; b_v]``, then its own
average over heads) and the floor (the bare score matmul, softmax, value matmul and mean over
heads, with the projections: ``matrix/contenders.py``) interleaved, at the shapes of every weights case of
the quick matrix, beside ``--busy`` busy processes, with the allocator warm, cold or as inherited
(``measure/allocator.py``). Prints stock/slim and slim/floor both as the ratio of the medians and as the
median (with quartiles) of the per-repeat ratio, and each contender's peak memory. ``--one-pass``
also times slim's own one-pass path, which it takes where stock's kernel does not apply (masks,
odd head counts, cross-attention); ``--blocks N`` slim forced into N blocks of query rows,
the path it takes only where one pass does not fit in memory (``--min-sample-ms 0`` times single
calls, as a plain loop would). ``--masks`` passes boolean masks to every contender: stock's fast
path takes them into its kernel, slim takes its own path."""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch

from ...paths import forcing_blocks
from ..matrix.cases import TARGET_SHAPES, Case, parse_shape
from ..matrix.contenders import (
    MASKS,
    Contender,
    build_contenders,
    fast_path_enabled,
    output_error,
)
from ..matrix.runner import measure_step_memory
from ..measure.allocator import allocator_state, prepare_cold_call
from ..measure.environment import describe_environment, load_average
from ..measure.load import competing_load
from ..measure.options import add_timing_options, subcommand, timing_settings
from ..measure.output import excess_text, write_json
from ..measure.timing import measure, median_of_ratios, quartiles_of_ratios

__all__ = ["DEFAULT_SHAPES", "add_parser", "run"]

# The quick matrix's weights shapes and the smallest of its sweep: where stock's native kernel is
# the floor, so slim has the least room.
DEFAULT_SHAPES = (*TARGET_SHAPES, (16, 64, 256, 8))
_PAIRS = (("stock", "slim"), ("slim", "floor"), ("stock", "blocks"), ("stock", "one_pass"))
_EXAMPLES = """\
examples:
  python -m slim_mha.bench weights                       # the default shapes, quiet
  python -m slim_mha.bench weights --busy 1 --repeats 21  # beside one busy process
  python -m slim_mha.bench weights --shape 4x512x512x8 --blocks 2 --threads 1
  python -m slim_mha.bench weights --one-pass             # slim's own path beside stock's kernel
  python -m slim_mha.bench weights --masks padding        # a key padding mask, as sets of two sizes
  python -m slim_mha.bench weights --busy 2 --allocator inherited --min-sample-ms 0 --warmup 0
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subcommand(
        subparsers,
        "weights",
        help="inference with averaged weights: stock, slim and the floor (and slim in blocks)",
        description=__doc__.split("\n\n")[1],
        examples=_EXAMPLES,
    )
    parser.add_argument(
        "--shape",
        action="append",
        metavar="BxLxExH",
        help="batch x seq_len x embed_dim x heads; repeatable (default: 4x512x512x8, 8x128x256x8, 16x64x256x8)",
    )
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="run beside N busy processes (default: 0)")
    parser.add_argument(
        "--allocator",
        choices=("warm", "cold", "inherited"),
        default="warm",
        help="the C allocator's state while timing (default: warm; inherited: as the process left it)",
    )
    parser.add_argument(
        "--blocks", type=int, default=0, metavar="N", help="also time slim forced into N blocks of query rows"
    )
    parser.add_argument(
        "--one-pass",
        action="store_true",
        help="also time slim's own one-pass path, which it takes where stock's kernel does not apply",
    )
    parser.add_argument(
        "--masks",
        choices=MASKS,
        default="none",
        help="boolean masks for every contender: padding (the last quarter of the keys of every other "
        "batch row), causal, or both (default: none)",
    )
    add_timing_options(parser, repeats_help="timed repeats per contender (default: 15)", cold=False)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.set_defaults(handler=run, parser=parser)
    return parser


def _slim_within(slim: Contender, name: str, context) -> Contender:
    """Slim with each of its calls, timed and untimed, made inside ``context()``."""

    def within(call):
        def run():
            with context():
                return call()

        return run

    return Contender(name, within(slim.step), within(slim.forward), slim.parameters, slim.reset, slim.external)


def _in_blocks(slim: Contender, shape: tuple[int, int, int, int], blocks: int) -> Contender:
    """Slim with its averaged weights forced into ``blocks`` blocks of query rows."""
    batch, length, _, heads = shape
    block_bytes = batch * heads * length * -(-length // blocks) * 4  # fp32 scores of one block

    return _slim_within(slim, "blocks", lambda: forcing_blocks(block_bytes))


def _in_one_pass(slim: Contender) -> Contender:
    """Slim on its own path: stock's fast path switched off around its calls, which slim follows."""
    return _slim_within(slim, "one_pass", lambda: fast_path_enabled(False))


def _run_shape(shape: tuple[int, int, int, int], args: argparse.Namespace, settings) -> dict:
    device = torch.device("cpu")
    load_before = load_average()
    case = Case(*shape, "self", True, "inference", "fp32", args.masks)
    contenders = build_contenders(case, device, seed=settings.seed)
    if args.blocks:
        contenders["blocks"] = _in_blocks(contenders["slim"], shape, args.blocks)
    if args.one_pass:
        contenders["one_pass"] = _in_one_pass(contenders["slim"])
    with torch.inference_mode():
        outputs = {name: contender.forward() for name, contender in contenders.items()}
    errors = {name: output_error(outputs["stock"], outputs[name]) for name in contenders if name != "stock"}
    del outputs
    peaks = {name: measure_step_memory(c, device, trains=False)[0]["peak_bytes"] for name, c in contenders.items()}
    cold = args.allocator == "cold"
    steps = {name: (c.step, prepare_cold_call if cold else c.reset) for name, c in contenders.items()}
    timings = measure(steps, device, settings)
    samples = {name: summary.samples_ms for name, summary in timings.items()}
    pairs = [(a, b) for a, b in _PAIRS if a in timings and b in timings]
    return {
        "shape": list(shape),
        "masks": args.masks,
        "median_ms": {name: summary.median_ms for name, summary in timings.items()},
        "ratios": {f"{a}_over_{b}": timings[a].median_ms / timings[b].median_ms for a, b in pairs},
        "paired_ratios": {
            f"{a}_over_{b}": {
                "median": median_of_ratios(samples[a], samples[b]),
                "quartiles": quartiles_of_ratios(samples[a], samples[b]),
            }
            for a, b in pairs
        },
        "peak_bytes": peaks,
        "faults_per_call": {name: summary.faults_per_call for name, summary in timings.items()},
        "samples_ms": samples,
        "calls_per_sample": timings["stock"].calls_per_sample,
        "remeasured": timings["stock"].remeasured,
        "stalled": sorted(name for name, summary in timings.items() if summary.stalled),
        "relative_error": errors,
        "load_average": [load_before, load_average()],
    }


def format_result(result: dict, busy: int, allocator: str) -> str:
    """One shape's block of lines, each under 100 columns."""
    batch, length, width, heads = result["shape"]
    ms, peaks = result["median_ms"], result["peak_bytes"]
    names = list(ms)
    loads = [load for load in result["load_average"] if load is not None]
    load = f", 1-minute load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    masks = result.get("masks", "none")
    lines = [
        f"B={batch} L={length} E={width} H={heads}{'' if masks == 'none' else f', masks {masks}'}, "
        f"busy {busy}, allocator {allocator}, "
        f"{torch.get_num_threads()} threads{load}",
        "  ms (median)    " + "  ".join(f"{name} {ms[name]:.2f}" for name in names),
    ]
    if result.get("stalled"):  # timing.py: stalls even when measured again, so no ratio is a measurement
        lines.append(f"  stalled ({', '.join(result['stalled'])}), even measured again: no ratio")
        return "\n".join(lines)
    for key, paired in result["paired_ratios"].items():
        low, high = paired["quartiles"]
        label = key.replace("_over_", "/")
        lines.append(
            f"  {label:<13}  {result['ratios'][key]:.3f}x ratio of medians; paired {paired['median']:.3f}x "
            f"(quartiles {low:.2f}-{high:.2f})"
        )
    lines.append("  peak MiB       " + "  ".join(f"{name} {peaks[name] / 2**20:.1f}" for name in names))
    lines.append("  faults/call    " + "  ".join(f"{name} {result['faults_per_call'][name]:.0f}" for name in names))
    errors = result["relative_error"]
    lines.append("  relative error against stock: " + ", ".join(f"{name} {errors[name]:.1e}" for name in errors))
    return "\n".join(lines)


def format_verdict(results: list[dict], busy: int) -> str:
    """What holds over the shapes, in the words of the benchmark's targets."""
    least = 1.0 if busy == 0 else 0.97
    speed = [result["paired_ratios"]["stock_over_slim"]["median"] for result in results]
    floor = [result["paired_ratios"]["slim_over_floor"]["median"] for result in results]
    memory = [result["peak_bytes"]["slim"] <= result["peak_bytes"]["stock"] for result in results]
    excess = max(result["peak_bytes"]["slim"] - result["peak_bytes"]["stock"] for result in results)
    return "\n".join(
        [
            f"stock/slim (paired) >= {least:.2f} {'quiet' if busy == 0 else 'beside busy processes'}: "
            f"{sum(ratio >= least for ratio in speed)}/{len(results)} shapes (least {min(speed):.3f}x)",
            f"slim/floor (paired) <= 1.05: {sum(ratio <= 1.05 for ratio in floor)}/{len(results)} shapes "
            f"(most {max(floor):.3f}x)",
            f"peak memory slim <= stock: {sum(memory)}/{len(results)} shapes{excess_text(excess)}",
        ]
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Time the weights paths as ``args`` say; ``argv`` is recorded as the command."""
    parser, device = args.parser, torch.device("cpu")
    try:
        shapes = [parse_shape(text) for text in args.shape] if args.shape else list(DEFAULT_SHAPES)
    except ValueError as error:
        parser.error(f"--shape: {error}")
    if args.busy < 0 or args.busy > 64:
        parser.error(f"--busy must be between 0 and 64 competing processes, got {args.busy}")
    if args.blocks < 0 or any(args.blocks > length for _, length, _, _ in shapes):
        parser.error(f"--blocks must be between 0 and every shape's sequence length, got {args.blocks}")
    settings = timing_settings(parser, args, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(settings.seed)
    state = contextlib.nullcontext() if args.allocator == "inherited" else allocator_state(args.allocator)
    # Each shape stops adding repeats after max_case_s; before them come a few untimed calls per
    # contender (agreement, memory, warm-up), a second or two beside busy processes.
    print(f"expected time: at most about {len(shapes) * (settings.max_case_s + 3):.0f} s", flush=True)
    started, results = time.perf_counter(), []
    with competing_load(args.busy, 1800), state:
        for shape in shapes:
            results.append(_run_shape(shape, args, settings))
            print(format_result(results[-1], args.busy, args.allocator), flush=True)
    print(format_verdict(results, args.busy))
    print(f"elapsed {time.perf_counter() - started:.0f} s")
    if args.json:
        payload = {
            "command": " ".join(["python -m slim_mha.bench", *argv]),
            "settings": settings.__dict__,
            "allocator_state": args.allocator,
            "busy_processes": args.busy,
            "environment": describe_environment(device),
            "results": results,
        }
        write_json(args.json, payload)
    return 0
