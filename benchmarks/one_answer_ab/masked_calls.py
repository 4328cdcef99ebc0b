"""Paired stock/slim medians of small masked attention calls (a padding mask), in one process:

    python benchmarks/one_answer_ab/masked_calls.py OUT.json

B=2 L=16 E=64 H=4 and B=8 L=64 E=256 H=8; inference (under inference_mode) and a training step
(forward and backward), with and without weights; 21 interleaved repeats of stock then slim.
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

SHAPES = ((2, 16, 64, 4), (8, 64, 256, 8))


def one_call(module: nn.Module, x: torch.Tensor, padding: torch.Tensor, training: bool, need_weights: bool) -> None:
    if not training:
        with torch.inference_mode():
            module(x, x, x, key_padding_mask=padding, need_weights=need_weights)
        return
    module(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0].sum().backward()


def measure(batch: int, length: int, width: int, heads: int, training: bool, need_weights: bool) -> dict:
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(width, heads, batch_first=True).train(training)
    slim = slim_mha.convert(copy.deepcopy(stock)).train(training)
    x = torch.randn(batch, length, width, requires_grad=training)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[0, -length // 4 :] = True
    calls = 200 if length == 16 else 30
    for _ in range(20):
        one_call(stock, x, padding, training, need_weights)
        one_call(slim, x, padding, training, need_weights)
    ratios, stock_us, slim_us = [], [], []
    for _ in range(21):
        start = time.perf_counter()
        for _ in range(calls):
            one_call(stock, x, padding, training, need_weights)
        middle = time.perf_counter()
        for _ in range(calls):
            one_call(slim, x, padding, training, need_weights)
        end = time.perf_counter()
        ratios.append((middle - start) / (end - middle))
        stock_us.append((middle - start) / calls * 1e6)
        slim_us.append((end - middle) / calls * 1e6)
    return {
        "B": batch,
        "L": length,
        "E": width,
        "H": heads,
        "mode": "training" if training else "inference",
        "need_weights": need_weights,
        "stock_over_slim": statistics.median(ratios),
        "stock_us": statistics.median(stock_us),
        "slim_us": statistics.median(slim_us),
    }


def main(out: str) -> None:
    torch.set_num_threads(2)
    results = []
    for shape in SHAPES:
        for training in (False, True):
            for need_weights in (True, False):
                result = measure(*shape, training, need_weights)
                results.append(result)
                print(
                    f"B={result['B']} L={result['L']} {result['mode']} weights={need_weights}: "
                    f"stock/slim {result['stock_over_slim']:.3f} ({result['stock_us']:.0f} / {result['slim_us']:.0f} us)",
                    flush=True,
                )
    with open(out, "w", encoding="utf-8") as file:
        json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "results": results}, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
