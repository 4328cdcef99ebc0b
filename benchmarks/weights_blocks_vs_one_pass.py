"""Averaged attention weights on CPU: blocks of query rows against one pass, beside N busy processes.

Issue 12's open trade-off. Above 16 MiB of scores, slim computes averaged weights a few blocks of
query rows at a time (``slim_mha/_explicit_attention.py``); one pass would allocate the whole
``(B, H, L, S)`` scores at once. This times stock, slim with blocks and slim forced to one pass,
interleaved in a fresh random order every repeat, and prints the medians of the paired ratios.

    python benchmarks/weights_blocks_vs_one_pass.py --busy 0 --repeats 41
    python benchmarks/weights_blocks_vs_one_pass.py --busy 2 --repeats 41

It sets a private constant to force one pass: a measuring tool, not an API.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch import nn

import slim_mha._explicit_attention as explicit
from slim_mha import SlimMultiheadAttention
from slim_mha.bench.load import competing_load

SHAPES = ((4, 512, 512, 8), (8, 128, 256, 8), (2, 1024, 256, 8))  # B, L, E, H
BLOCKS, ONE_PASS = explicit._CPU_BLOCK_SCORES_BYTES, 1 << 62


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=0, help="competing busy processes")
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    torch.manual_seed(0)
    with competing_load(args.busy, 900), torch.inference_mode():
        for B, L, E, H in SHAPES:
            stock = nn.MultiheadAttention(E, H, batch_first=True).eval()
            slim = SlimMultiheadAttention(E, H, batch_first=True).eval()
            slim.load_state_dict(stock.state_dict())
            x = torch.randn(B, L, E)

            def run_slim(limit: int):
                explicit._CPU_BLOCK_SCORES_BYTES = limit
                return slim(x, x, x, need_weights=True)

            contenders = {
                "stock": lambda: stock(x, x, x, need_weights=True),
                "blocks": lambda: run_slim(BLOCKS),
                "one pass": lambda: run_slim(ONE_PASS),
            }
            reference = contenders["stock"]()
            for name in ("blocks", "one pass"):
                for got, want in zip(contenders[name](), reference):
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            times = {name: [] for name in contenders}
            for _ in range(args.repeats):
                order = list(contenders)
                random.shuffle(order)
                for name in order:
                    start = time.perf_counter()
                    contenders[name]()
                    times[name].append(time.perf_counter() - start)
            explicit._CPU_BLOCK_SCORES_BYTES = BLOCKS

            def ratio(a: str, b: str) -> float:
                return statistics.median(x / y for x, y in zip(times[a], times[b]))

            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(
                f"busy {args.busy}  B={B} L={L} E={E} H={H}: stock {ms['stock']:.1f} ms, blocks "
                f"{ms['blocks']:.1f}, one pass {ms['one pass']:.1f} | stock/blocks "
                f"{ratio('stock', 'blocks'):.2f}x  stock/one-pass {ratio('stock', 'one pass'):.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
