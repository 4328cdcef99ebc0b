"""Stock's default call in stock's default layout: sequence-first self-attention that returns weights.

    python benchmarks/sequence_first_weights.py [--repeats 21] [--threads 2] [--busy N] [--cross] [--shape 8x128x256x8 ...]

``nn.MultiheadAttention(E, H)`` is sequence-first, and ``attn(x, x, x)`` asks for the averaged
weights. Stock's fast path refuses that layout, so stock runs its Python path; slim runs stock's
native kernel with the query as a batch-first view. Timed in inference, interleaved with the
benchmark's own timer (``slim_mha.bench.measure.timing``), the allocator warm, beside ``--busy`` busy
processes (``slim_mha.bench.measure.load``): stock, slim, and slim's own
one-pass path (stock's fast path switched off around its calls, which slim follows). Printed per
shape: the median ms, and paired stock/slim and stock/one_pass (the median of the per-repeat ratios).
``--cross``: encoder-decoder attention instead, over a memory of ``L`` tokens passed as key and
value; both modules run their Python paths there, so only stock and slim are timed.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
from _script import parse_script_arguments, script_parser
from torch import nn

from slim_mha import SlimMultiheadAttention
from slim_mha.bench.matrix.cases import parse_shape
from slim_mha.bench.matrix.contenders import fast_path_enabled
from slim_mha.bench.measure.allocator import allocator_state
from slim_mha.bench.measure.load import competing_load
from slim_mha.bench.measure.timing import Settings, measure

SHAPES = ("8x128x256x8", "4x512x512x8", "16x64x256x8")


def steps(shape: tuple[int, int, int, int], cross: bool = False) -> dict:
    batch, length, width, heads = shape
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(width, heads).eval()
    with torch.no_grad():  # trained-looking biases, the key slice included
        stock.in_proj_bias.normal_(std=0.1)
        stock.out_proj.bias.normal_(std=0.1)
    slim = SlimMultiheadAttention(width, heads).eval()
    slim.load_state_dict(stock.state_dict())
    x = torch.randn(length, batch, width)  # (L, B, E)
    memory = torch.randn(length, batch, width) if cross else x

    def call(module, context=contextlib.nullcontext):
        def step() -> None:
            with context(), torch.inference_mode():
                module(x, memory, memory)

        return step, lambda: None

    with torch.inference_mode():
        expected, actual = stock(x, memory, memory), slim(x, memory, memory)
    error = max(float((a - e).abs().max() / e.abs().max()) for a, e in zip(actual, expected))
    if cross:
        return {"stock": call(stock), "slim": call(slim)}, error
    own_path = call(slim, lambda: fast_path_enabled(False))
    return {"stock": call(stock), "slim": call(slim), "one_pass": own_path}, error


def main() -> None:
    parser = script_parser(__doc__, SHAPES)
    parser.add_argument("--cross", action="store_true", help="encoder-decoder attention instead of self-attention")
    args = parse_script_arguments(parser)
    print(f"{'cross' if args.cross else 'self'}-attention")
    with competing_load(args.busy, 1800), allocator_state("warm"):
        for text in args.shape or SHAPES:
            shape = parse_shape(text)
            contenders, error = steps(shape, args.cross)
            timings = measure(contenders, torch.device("cpu"), Settings(repeats=args.repeats))
            stock = timings["stock"].samples_ms

            def paired(name: str, stock=stock, timings=timings) -> float:
                return statistics.median(a / b for a, b in zip(stock, timings[name].samples_ms))

            ms = "  ".join(f"{name} {summary.median_ms:.2f}" for name, summary in timings.items())
            ratios = ", ".join(f"stock/{name} {paired(name):.3f}x" for name in timings if name != "stock")
            print(
                f"B={shape[0]} L={shape[1]} E={shape[2]} H={shape[3]}: ms {ms}; paired {ratios}; "
                f"relative error {error:.1e}"
            )


if __name__ == "__main__":
    main()
