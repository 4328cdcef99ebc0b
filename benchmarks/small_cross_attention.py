"""Cross-attention with weights and a padding mask, as DETR's decoder calls it, paired in one
process: stock; slim as it is ("slim"), with its "stock ops" path at any size ("ops") and at no size
("own": slim's own path); and stock's own function without its module
(``F.multi_head_attention_forward``).

Sequence-first queries ``(L, B, E)`` attend over a memory ``(S, B, E)``; the key is the memory plus
a position embedding and the value the memory itself, so the three projections are separate
matmuls, and the last batch row's keys are padded on their last 15%, as DETR pads an image. Every
call keeps stock's default ``need_weights=True``. ``--shape BxLxExH`` gives the queries, ``--memory``
(repeatable) the keys; inference runs under ``torch.no_grad``, training runs forward and backward.
``--inputs`` picks other calls of the same sizes: ``kv``, the key and value one tensor (an
encoder-decoder's cross-attention); ``qk``, the query and key one tensor and the value another, over
the memory's length (DETR's decoder self-attention: target plus positions, then the target).

    python benchmarks/small_cross_attention.py
    python benchmarks/small_cross_attention.py --busy 1 --threads 1
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _script import parse_script_arguments, script_parser
from torch import nn

from slim_mha import SlimMultiheadAttention, paths
from slim_mha.bench.matrix.cases import parse_shape
from slim_mha.bench.measure.allocator import allocator_state
from slim_mha.bench.measure.load import competing_load
from slim_mha.bench.measure.timing import Settings, measure, median_of_ratios

SHAPES = ("2x20x256x8", "2x100x256x8")
MEMORIES = (50, 100, 200, 400, 950)


def timed_call(module: nn.Module | None, arguments: tuple, mode: str, stock_ops_up_to: int | None = None):
    """One step of ``module`` (``None``: stock's function on ``arguments[-1]``'s weights) and its reset.
    ``stock_ops_up_to``: the "stock ops" path's limit in bytes of scores for the step (``1 << 40``:
    any size; ``-1``: none, so slim's own path runs), the sequence-first calls' limit with it."""
    queries, key, value, padding, stock = arguments

    def call() -> tuple:
        if module is not None:
            return module(queries, key, value, key_padding_mask=padding)
        inputs = (queries, key, value)
        if stock.batch_first:  # the function takes sequence-first views, as stock's module passes them
            inputs = tuple(x.transpose(0, 1) for x in inputs)
        return F.multi_head_attention_forward(
            *inputs, stock.embed_dim, stock.num_heads, stock.in_proj_weight, stock.in_proj_bias,
            None, None, False, 0.0, stock.out_proj.weight, stock.out_proj.bias, training=mode == "train",
            key_padding_mask=padding,
        )  # fmt: skip

    def step() -> None:
        tables = (paths.STOCK_OPS_MAX_SCORE_BYTES, paths.STOCK_OPS_SEQUENCE_FIRST_MAX_SCORE_BYTES)
        saved = [dict(table) for table in tables]
        if stock_ops_up_to is not None:
            for table in tables:
                table.update(dict.fromkeys(table, stock_ops_up_to))
        try:
            if mode == "train":
                call()[0].sum().backward()
            else:
                with torch.no_grad():
                    call()
        finally:
            for table, entries in zip(tables, saved):
                table.update(entries)

    return step, lambda: stock.zero_grad(set_to_none=True) if module is None else module.zero_grad(set_to_none=True)


def main() -> None:
    parser = script_parser(__doc__, SHAPES)
    parser.add_argument("--memory", type=int, action="append", help=f"repeatable (default: {MEMORIES})")
    parser.add_argument("--batch-first", action="store_true", help="batch-first modules and inputs (DETR's are not)")
    parser.add_argument("--inputs", choices=("detr", "kv", "qk"), default="detr", help="which call (default: detr)")
    args = parse_script_arguments(parser)
    if any(memory < 1 for memory in args.memory or ()):
        parser.error("--memory: key counts must be positive integers")
    with competing_load(args.busy, 1800), allocator_state("warm"):
        for text in args.shape or SHAPES:
            batch, length, width, heads = parse_shape(text)
            for memory in args.memory or MEMORIES:
                torch.manual_seed(0)
                stock = nn.MultiheadAttention(width, heads, batch_first=args.batch_first)
                with torch.no_grad():
                    stock.in_proj_bias.normal_(std=0.1)
                slim = SlimMultiheadAttention(width, heads, batch_first=args.batch_first)
                slim.load_state_dict(stock.state_dict())
                value = torch.randn(memory, batch, width)
                padding = torch.zeros(batch, memory, dtype=torch.bool)
                padding[-1, int(memory * 0.85) :] = True
                queries, key = torch.randn(length, batch, width), value + torch.randn_like(value)
                if args.inputs == "kv":
                    key = value
                elif args.inputs == "qk":
                    queries = key
                if args.batch_first:  # the same tensors' values, (B, len, E)
                    queries, key, value = (x.transpose(0, 1).contiguous() for x in (queries, key, value))
                arguments = (queries, key, value, padding, stock)
                for mode in ("inference", "train"):
                    for module in (stock, slim):
                        module.train(mode == "train")
                    steps = {
                        "stock": timed_call(stock, arguments, mode),
                        "slim": timed_call(slim, arguments, mode),
                        "ops": timed_call(slim, arguments, mode, stock_ops_up_to=1 << 40),
                        "own": timed_call(slim, arguments, mode, stock_ops_up_to=-1),
                        "function": timed_call(None, arguments, mode),
                    }
                    timed = measure(steps, torch.device("cpu"), Settings(repeats=args.repeats, cold_repeats=0))
                    samples = {name: summary.samples_ms for name, summary in timed.items()}
                    ratios = ", ".join(
                        f"stock/{name} {median_of_ratios(samples['stock'], samples[name]):.3f}x"
                        for name in ("slim", "ops", "own", "function")
                    )
                    queried = queries.shape[1 if args.batch_first else 0]  # the memory's length with --inputs qk
                    scores = batch * heads * queried * memory * 4 // 1024
                    print(
                        f"B={batch} L={queried} S={memory} E={width} H={heads} {mode:<9} {scores:>5} KiB of scores"
                        + (", batch-first: " if args.batch_first else ": ")
                        + f"stock {timed['stock'].median_ms * 1e3:7.1f} us; {ratios}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
