"""``python -m slim_mha.bench weights``: averaged weights on CPU, in blocks of query rows or in one pass.

Above a size, slim computes averaged attention weights on CPU a few blocks of query rows at a time
(``slim_mha/_explicit_attention.py``); one pass would hold the whole ``(B, H, L, S)`` scores at once.
This times stock, slim in blocks and slim forced to one pass, interleaved, beside ``--busy`` busy
processes, with the allocator warm, cold or as inherited (``allocator.py``); it prints the ratios
of the medians and the paired per-repeat medians. ``--min-sample-ms 0``
times single calls, as a plain loop would. It sets a private constant to force one pass: a measuring
tool, not an API.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
from torch import nn

from .. import _explicit_attention as explicit
from ..attention import SlimMultiheadAttention
from .allocator import allocator_state, prepare_cold_call
from .cases import parse_shape
from .contenders import output_error
from .load import competing_load
from .options import add_timing_options, timing_settings
from .report import write_json
from .runner import _load_average, _paired_ratio, describe_environment
from .timing import measure

__all__ = ["add_parser", "run"]

_DEFAULT_SHAPES = ("4x512x512x8",)
_ONE_PASS = 1 << 62  # a block limit no scores reach
_EXAMPLES = """\
examples:
  python -m slim_mha.bench weights --busy 2 --repeats 41
  python -m slim_mha.bench weights --busy 2 --allocator inherited --min-sample-ms 0 --warmup 0
  python -m slim_mha.bench weights --shape 8x128x256x8 --shape 2x1024x256x8
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "weights",
        help="CPU averaged weights: stock, slim in blocks, slim in one pass",
        description=__doc__.split("\n\n")[1],
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--shape", action="append", metavar="BxLxExH", help="batch x seq_len x embed_dim x heads (default: 4x512x512x8)"
    )
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="run beside N busy processes (default: 0)")
    parser.add_argument(
        "--allocator",
        choices=("warm", "cold", "inherited"),
        default="warm",
        help="the C allocator's state while timing (default: warm; inherited: as the process left it)",
    )
    add_timing_options(parser, repeats_help="timed repeats per contender (default: 15)", cold=False)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.set_defaults(handler=run, parser=parser)
    return parser


def _contenders(shape: tuple[int, int, int, int], cold: bool) -> tuple[dict, dict[str, float]]:
    """The three timed steps, and the relative error of slim's outputs (blocks, one pass) against stock's."""
    batch, length, width, heads = shape
    stock = nn.MultiheadAttention(width, heads, batch_first=True).eval()
    with torch.no_grad():
        stock.in_proj_bias.normal_(std=0.1)
    slim = SlimMultiheadAttention(width, heads, batch_first=True).eval()
    slim.load_state_dict(stock.state_dict())
    x = torch.randn(batch, length, width)  # (B, L, E)
    blocks = explicit._CPU_BLOCK_SCORES_BYTES

    def slim_with(limit: int):
        def step() -> None:
            explicit._CPU_BLOCK_SCORES_BYTES = limit
            try:
                with torch.inference_mode():
                    slim(x, x, x, need_weights=True)
            finally:
                explicit._CPU_BLOCK_SCORES_BYTES = blocks

        return step

    def stock_step() -> None:
        with torch.inference_mode():
            stock(x, x, x, need_weights=True)

    def outputs(limit: int | None):
        explicit._CPU_BLOCK_SCORES_BYTES = blocks if limit is None else limit
        try:
            with torch.inference_mode():
                return (stock if limit is None else slim)(x, x, x, need_weights=True)
        finally:
            explicit._CPU_BLOCK_SCORES_BYTES = blocks

    reference = outputs(None)
    errors = {"blocks": output_error(reference, outputs(blocks)), "one pass": output_error(reference, outputs(_ONE_PASS))}
    reset = prepare_cold_call if cold else (lambda: None)
    steps = {"stock": (stock_step, reset), "blocks": (slim_with(blocks), reset), "one pass": (slim_with(_ONE_PASS), reset)}
    return steps, errors


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Time the weights paths as ``args`` say; ``argv`` is recorded as the command."""
    parser, device = args.parser, torch.device("cpu")
    try:
        shapes = [parse_shape(text) for text in args.shape or _DEFAULT_SHAPES]
    except ValueError as error:
        parser.error(f"--shape: {error}")
    if args.busy < 0 or args.busy > 64:
        parser.error(f"--busy must be between 0 and 64 competing processes, got {args.busy}")
    settings = timing_settings(parser, args, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(settings.seed)
    state = contextlib.nullcontext() if args.allocator == "inherited" else allocator_state(args.allocator)
    print(f"expected time: at most about {len(shapes) * (settings.max_case_s + 2):.0f} s", flush=True)
    results = []
    with competing_load(args.busy, 1800), state:
        for shape in shapes:
            load_before = _load_average()
            steps, errors = _contenders(shape, args.allocator == "cold")
            timings = measure(steps, device, settings)
            ms = {name: summary.median_ms for name, summary in timings.items()}
            paired = {name: _paired_ratio(timings["stock"].samples_ms, timings[name].samples_ms)
                      for name in ("blocks", "one pass")}
            results.append({
                "shape": list(shape),
                "median_ms": ms,
                "faults_per_call": {name: summary.faults_per_call for name, summary in timings.items()},
                "paired_stock_over": paired,
                "samples_ms": {name: summary.samples_ms for name, summary in timings.items()},
                "calls_per_sample": timings["stock"].calls_per_sample,
                "relative_error": errors,
                "load_average": [load_before, _load_average()],
            })
            print(
                f"B={shape[0]} L={shape[1]} E={shape[2]} H={shape[3]}, busy {args.busy}, allocator {args.allocator}: "
                f"ms stock {ms['stock']:.1f}, blocks {ms['blocks']:.1f}, one pass {ms['one pass']:.1f}\n"
                f"  stock/blocks {ms['stock'] / ms['blocks']:.2f}x (paired {paired['blocks']:.2f}x), stock/one-pass "
                f"{ms['stock'] / ms['one pass']:.2f}x (paired {paired['one pass']:.2f}x)\n"
                f"  faults/call stock {timings['stock'].faults_per_call:.0f}, blocks "
                f"{timings['blocks'].faults_per_call:.0f}, one pass {timings['one pass'].faults_per_call:.0f}\n"
                f"  relative error against stock: blocks {errors['blocks']:.1e}, one pass {errors['one pass']:.1e}",
                flush=True,
            )
    if args.json:
        payload = {"command": " ".join(["python -m slim_mha.bench", *argv]), "settings": settings.__dict__,
                   "allocator_state": args.allocator, "busy_processes": args.busy,
                   "environment": describe_environment(device), "results": results}
        write_json(args.json, payload)
    return 0
