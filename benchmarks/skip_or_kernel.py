"""Where stock's kernel, weights and all, beats skipping the weights: ``SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES``.

    python benchmarks/skip_or_kernel.py [--padding] [--dtype fp32|bf16] [--repeats 15] [--threads 2] [--busy N] [--shape 4x32x64x4 ...]

Self-attention in inference (eval, ``inference_mode``), called as ``attn(x, x, x)[0]`` (with
``--padding``, ``key_padding_mask=`` the last quarter of the keys of every other sequence), so the
weights provably go unread. Timed interleaved with the benchmark's own timer, the allocator warm:
stock; slim without the option, which runs stock's kernel with the weights at these sizes (with a
padding mask, up to ``STOCK_KERNEL_MASKED_MAX_SCORE_BYTES``); and slim built with
``skip_unread_weights=True`` with the table emptied around its calls, so that it always skips them.
Printed per shape: the scores' bytes, the median microseconds, and paired slim/skip (above 1,
skipping is faster) and stock/skip.
"""

from __future__ import annotations

import torch
from _script import parse_script_arguments, script_parser
from torch import nn

from slim_mha import SlimMultiheadAttention, paths
from slim_mha.bench.matrix.cases import DTYPES, parse_shape
from slim_mha.bench.matrix.contenders import case_masks
from slim_mha.bench.measure.allocator import allocator_state
from slim_mha.bench.measure.load import competing_load
from slim_mha.bench.measure.timing import Settings, measure, median_of_ratios

SHAPES = ("2x16x64x4", "4x32x64x4", "8x32x64x4", "4x64x64x4", "16x32x64x4", "8x64x64x4", "4x64x128x8")


def step(module: nn.Module, x: torch.Tensor, padding: torch.Tensor | None, always_skip: bool = False):
    def call() -> None:
        saved = dict(paths.SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES)
        if always_skip:
            paths.SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES.clear()
        try:
            with torch.inference_mode():
                module(x, x, x, key_padding_mask=padding)[0]
        finally:
            paths.SKIP_YIELDS_TO_KERNEL_MAX_SCORE_BYTES.update(saved)

    return call, lambda: None


def main() -> None:
    parser = script_parser(__doc__, SHAPES)
    parser.add_argument("--padding", action="store_true", help="with a key padding mask")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parse_script_arguments(parser)
    dtype = DTYPES[args.dtype]
    with competing_load(args.busy, 1800), allocator_state("warm"):
        for text in args.shape or SHAPES:
            batch, length, width, heads = parse_shape(text)
            torch.manual_seed(0)
            stock = nn.MultiheadAttention(width, heads, batch_first=True, dtype=dtype).eval()
            slim = SlimMultiheadAttention(width, heads, batch_first=True, dtype=dtype).eval()
            skip = SlimMultiheadAttention(width, heads, batch_first=True, dtype=dtype, skip_unread_weights=True).eval()
            for module in (slim, skip):
                module.load_state_dict(stock.state_dict())
            x = torch.randn(batch, length, width, dtype=dtype)
            masks = case_masks("padding" if args.padding else "none", batch, length, x.device)
            padding = masks.get("key_padding_mask")
            steps = {
                "stock": step(stock, x, padding),
                "slim": step(slim, x, padding),
                "skip": step(skip, x, padding, True),
            }
            timed = measure(steps, torch.device("cpu"), Settings(repeats=args.repeats))
            samples = {name: summary.samples_ms for name, summary in timed.items()}
            us = "  ".join(f"{name} {summary.median_ms * 1e3:7.1f}" for name, summary in timed.items())
            scores = batch * heads * length * length * x.element_size() // 1024
            print(
                f"B={batch} L={length} E={width} H={heads} {args.dtype}{' padding' if args.padding else ''}, "
                f"{scores} KiB of scores: us {us};  slim/skip {median_of_ratios(samples['slim'], samples['skip']):.3f}x, "
                f"stock/skip {median_of_ratios(samples['stock'], samples['skip']):.3f}x"
            )


if __name__ == "__main__":
    main()
