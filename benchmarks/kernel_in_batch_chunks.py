"""Stock's default call, with stock's kernel run on slices of the batch: an experiment, not shipped.

    python benchmarks/kernel_in_batch_chunks.py [--repeats 21] [--threads 2] [--busy N] [--shape 4x512x512x8 ...]

Slim runs stock's native kernel for stock's default call (self-attention that returns averaged
weights). Its peak is the kernel's, held for the whole batch: every head's scores, the packed q, k
and v, and both projections. Called on slices of the batch, with each slice's output and average
written into the whole call's, the kernel holds one slice's worth, and its scores stay in cache.
This times, interleaved (``slim_mha.bench.timing``, the allocator warm, beside ``--busy`` busy
processes from ``slim_mha.bench.load``): stock, slim, and the kernel on slices of about 8 and 16 MiB
of scores. Printed per shape: each contender's peak above the call's start, and paired stock/x
(the median of the per-repeat ratios). The outputs are checked against stock first.
"""

from __future__ import annotations

import statistics

import torch
from torch import Tensor, nn

from slim_mha import SlimMultiheadAttention
from slim_mha._explicit_attention import mean_over_heads
from slim_mha._torch_compat import stock_kernel_with_head_weights
from slim_mha.bench.allocator import allocator_state
from slim_mha.bench.cases import parse_shape
from slim_mha.bench.load import competing_load
from slim_mha.bench.options import parse_script_arguments, script_parser
from slim_mha.bench.memory import profile_step
from slim_mha.bench.timing import Settings, measure
from slim_mha.bias import without_key_bias_eager

SHAPES = ("4x512x512x8", "8x512x256x8", "2x1024x256x8", "4x1024x256x8", "16x256x256x8", "8x128x256x8")
SLICE_SCORES_MIB = (8, 16)


def in_batch_slices(slim: SlimMultiheadAttention, x: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Stock's kernel on ``rows`` batch rows at a time, each slice's results written into the call's."""
    batch, length, _ = x.shape
    bias = without_key_bias_eager(slim.in_proj_bias)
    out, weights = x.new_empty(x.shape), x.new_empty(batch, length, length)
    for start in range(0, batch, rows):
        part = x[start : start + rows]
        part_out, head_weights = stock_kernel_with_head_weights(
            part, slim.num_heads, slim.in_proj_weight, bias, slim.out_proj.weight, slim.out_proj.bias
        )
        out[start : start + rows] = part_out
        weights[start : start + rows] = mean_over_heads(head_weights)
        del part_out, head_weights  # freed before the next slice's kernel allocates
    return out, weights


def contenders(shape: tuple[int, int, int, int]) -> tuple[dict, float]:
    batch, length, width, heads = shape
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(width, heads, batch_first=True).eval()
    with torch.no_grad():  # trained-looking biases, the key slice included
        stock.in_proj_bias.normal_(std=0.1)
        stock.out_proj.bias.normal_(std=0.1)
    slim = SlimMultiheadAttention(width, heads, batch_first=True).eval()
    slim.load_state_dict(stock.state_dict())
    x = torch.randn(batch, length, width)
    row_scores = heads * length * length * x.element_size()
    calls = {"stock": lambda: stock(x, x, x), "slim": lambda: slim(x, x, x)}
    for mib in SLICE_SCORES_MIB:
        rows = max(1, (mib << 20) // row_scores)
        if rows < batch:
            calls[f"slices_{mib}MiB"] = lambda rows=rows: in_batch_slices(slim, x, rows)
    with torch.inference_mode():
        expected = stock(x, x, x)
        error = max(
            float((got - want).abs().max() / want.abs().max())
            for call in calls.values()
            for got, want in zip(call(), expected)
        )

    def timed(call):
        def step() -> None:
            with torch.inference_mode():
                call()

        return step, lambda: None

    return {name: timed(call) for name, call in calls.items()}, error


def main() -> None:
    args = parse_script_arguments(script_parser(__doc__, SHAPES))
    with competing_load(args.busy, 1800), allocator_state("warm"):
        for text in args.shape or SHAPES:
            shape = parse_shape(text)
            steps, error = contenders(shape)
            peaks = {name: profile_step(step, torch.device("cpu")).peak_bytes / 2**20 for name, (step, _) in steps.items()}
            timings = measure(steps, torch.device("cpu"), Settings(repeats=args.repeats))
            stock = timings["stock"].samples_ms
            ratios = "  ".join(
                f"{name} {statistics.median(a / b for a, b in zip(stock, timings[name].samples_ms)):.3f}x"
                for name in steps if name != "stock"
            )
            memory = "  ".join(f"{name} {peak:.1f}" for name, peak in peaks.items())
            print(f"B={shape[0]} L={shape[1]} E={shape[2]} H={shape[3]}: stock {timings['stock'].median_ms:.2f} ms; "
                  f"paired stock/x: {ratios}; peak MiB: {memory}; relative error {error:.1e}")


if __name__ == "__main__":
    main()
