"""What a checked call of the equivariance modes costs, against the same training step without them.

    python benchmarks/equivariance_mode_cost.py [--repeats 15] [--threads 1] [--batch 8 --length 128 --width 256]

A training step (forward, backward, SGD step) of a 2-layer nn.TransformerEncoder with slim
attention (H=8, feed-forward 4E, dropout 0.1, train mode), timed in blocks of 10 steps inside one
scope, interleaved: each repeat runs every setting's block once in a fresh random order. Printed:
the median time per step, its ratio to the plain step's, and the paired ratio (the median of the
ratios within a repeat, where bursts of load from other processes cancel). Settings: plain; the per-call mode (every attention call checked); the
model-level mode checking every call (dim=1, every=1) and every 10th (every=10).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from contextlib import nullcontext

import torch
from torch import nn

import slim_mha


def build(width: int) -> nn.Module:
    torch.manual_seed(0)
    with slim_mha.patched():
        layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.1, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    model = build(options.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(options.batch, options.length, options.width)
    settings = {
        "plain": lambda: nullcontext(),
        "per-call mode, every=1": lambda: slim_mha.checking_equivariance(model, every=1),
        "model mode dim=1, every=1": lambda: slim_mha.checking_equivariance(model, every=1, dim=1),
        "model mode dim=1, every=10": lambda: slim_mha.checking_equivariance(model, every=10, dim=1),
    }
    times = {name: [] for name in settings}

    def block(name: str) -> float:
        """10 steps in one scope (every=10 checks the first of them), timed; returns seconds per step."""
        with settings[name]():
            start = time.perf_counter()
            for _ in range(10):
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            return (time.perf_counter() - start) / 10

    for name in settings:  # warm-up
        block(name)
    for _ in range(options.repeats):
        order = list(settings)
        random.shuffle(order)
        for name in order:
            times[name].append(block(name))
    plain = statistics.median(times["plain"])
    print(
        f"torch {torch.__version__}, {options.threads} threads, {options.repeats} repeats of 10 steps, "
        f"B={options.batch} L={options.length} E={options.width}, 1-min load {os.getloadavg()[0]:.1f}"
    )
    for name, values in times.items():
        # paired: the ratio within each repeat (the settings ran back to back there), then the median
        paired = statistics.median(value / base for value, base in zip(values, times["plain"]))
        print(
            f"{name:28s} {statistics.median(values) * 1e3:8.2f} ms/step  "
            f"{statistics.median(values) / plain:5.2f}x plain, paired {paired:5.2f}x"
        )


if __name__ == "__main__":
    main()
