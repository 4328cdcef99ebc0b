"""Stock's default call in stock's default layout: sequence-first self-attention that returns weights.

    python benchmarks/sequence_first_weights.py [--repeats 21] [--threads 2] [--busy N] [--shape 8x128x256x8 ...]

``nn.MultiheadAttention(E, H)`` is sequence-first, and ``attn(x, x, x)`` asks for the averaged
weights. Stock's fast path refuses that layout, so stock runs its Python path; slim runs stock's
native kernel with the query as a batch-first view. Timed in inference, interleaved with the
benchmark's own timer (``slim_mha.bench.timing``), the allocator warm, beside ``--busy`` busy
processes (``slim_mha.bench.load``): stock, slim, and slim's own
one-pass path (stock's fast path switched off around its calls, which slim follows). Printed per
shape: the median ms, and paired stock/slim and stock/one_pass (the median of the per-repeat ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from torch import nn

from slim_mha import SlimMultiheadAttention
from slim_mha.bench.allocator import allocator_state
from slim_mha.bench.cases import parse_shape
from slim_mha.bench.contenders import fast_path_enabled
from slim_mha.bench.load import competing_load
from slim_mha.bench.timing import Settings, measure

SHAPES = ("8x128x256x8", "4x512x512x8", "16x64x256x8")


def steps(shape: tuple[int, int, int, int]) -> dict:
    batch, length, width, heads = shape
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(width, heads).eval()
    with torch.no_grad():  # trained-looking biases, the key slice included
        stock.in_proj_bias.normal_(std=0.1)
        stock.out_proj.bias.normal_(std=0.1)
    slim = SlimMultiheadAttention(width, heads).eval()
    slim.load_state_dict(stock.state_dict())
    x = torch.randn(length, batch, width)  # (L, B, E)

    def call(module, context=contextlib.nullcontext):
        def step() -> None:
            with context(), torch.inference_mode():
                module(x, x, x)

        return step, lambda: None

    with torch.inference_mode():
        expected, actual = stock(x, x, x), slim(x, x, x)
    error = max(float((a - e).abs().max() / e.abs().max()) for a, e in zip(actual, expected))
    own_path = call(slim, lambda: fast_path_enabled(False))
    return {"stock": call(stock), "slim": call(slim), "one_pass": own_path}, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="run beside N busy processes (default: 0)")
    parser.add_argument("--shape", action="append", metavar="BxLxExH", help=f"repeatable (default: {', '.join(SHAPES)})")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not 0 <= args.busy <= 64:
        parser.error(f"--busy must be between 0 and 64 competing processes, got {args.busy}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats, allocator warm, "
          f"busy {args.busy}")
    with competing_load(args.busy, 1800), allocator_state("warm"):
        for text in args.shape or SHAPES:
            shape = parse_shape(text)
            contenders, error = steps(shape)
            timings = measure(contenders, torch.device("cpu"), Settings(repeats=args.repeats))
            stock = timings["stock"].samples_ms

            def paired(name: str) -> float:
                return statistics.median(a / b for a, b in zip(stock, timings[name].samples_ms))

            ms = "  ".join(f"{name} {summary.median_ms:.2f}" for name, summary in timings.items())
            print(f"B={shape[0]} L={shape[1]} E={shape[2]} H={shape[3]}: ms {ms}; paired stock/slim "
                  f"{paired('slim'):.3f}x, stock/one_pass {paired('one_pass'):.3f}x; relative error {error:.1e}")


if __name__ == "__main__":
    main()
