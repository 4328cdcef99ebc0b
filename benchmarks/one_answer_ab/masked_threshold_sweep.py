"""Where stock's kernel with masks beats slim's own path: the sweep behind STOCK_KERNEL_MASKED_MAX_SCORE_BYTES.

    python benchmarks/one_answer_ab/masked_threshold_sweep.py OUT.json

Masked self-attention in inference (a padding mask), stock's module (its fast path: the native kernel
with the merged mask) against slim's with the masked table emptied (slim's own path), 15 interleaved
repeats each; fp32 and bf16, E=64 H=4 and E=256 H=8, with and without weights.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time

import torch
from torch import nn

import slim_mha
from slim_mha import paths

SIZES = ((2, 16), (2, 32), (8, 32), (2, 64), (8, 64), (4, 128))


def timed(module: nn.Module, x: torch.Tensor, padding: torch.Tensor, need_weights: bool, calls: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(calls):
            module(x, x, x, key_padding_mask=padding, need_weights=need_weights)
    return time.perf_counter() - start


def sweep_case(dtype: torch.dtype, width: int, heads: int, batch: int, length: int, need_weights: bool) -> dict:
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(width, heads, batch_first=True, dtype=dtype).eval()
    slim = slim_mha.convert(copy.deepcopy(stock))
    x = torch.randn(batch, length, width, dtype=dtype)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[0, -length // 4 :] = True
    calls = max(5, int(20000 / (batch * length * length * heads / 64 + 50)))
    saved = dict(paths.STOCK_KERNEL_MASKED_MAX_SCORE_BYTES)
    paths.STOCK_KERNEL_MASKED_MAX_SCORE_BYTES.clear()  # slim: its own path
    try:
        timed(stock, x, padding, need_weights, calls), timed(slim, x, padding, need_weights, calls)
        ratios = [
            timed(stock, x, padding, need_weights, calls) / timed(slim, x, padding, need_weights, calls)
            for _ in range(15)
        ]
    finally:
        paths.STOCK_KERNEL_MASKED_MAX_SCORE_BYTES.update(saved)
    return {
        "dtype": str(dtype),
        "E": width,
        "H": heads,
        "B": batch,
        "L": length,
        "need_weights": need_weights,
        "score_bytes": batch * heads * length * length * x.element_size(),
        "stock_over_slim_general": statistics.median(ratios),
    }


def main(out: str) -> None:
    torch.set_num_threads(2)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for width, heads in ((64, 4), (256, 8)):
            for batch, length in SIZES:
                for need_weights in (False, True):
                    row = sweep_case(dtype, width, heads, batch, length, need_weights)
                    rows.append(row)
                    print(
                        f"{row['dtype']:15s} E={width:3d} H={heads} B={batch} L={length:3d} weights={need_weights!s:5s} "
                        f"scores {row['score_bytes'] / 1024:7.1f} KiB  kernel/slim's own: {row['stock_over_slim_general']:.3f}",
                        flush=True,
                    )
    with open(out, "w", encoding="utf-8") as file:
        json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
