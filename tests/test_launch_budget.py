"""Launch budget: slim dispatches about as many aten ops per forward as stock's Python path, whatever H.

Each aten op is a kernel launch on CUDA and, on a CPU shared with other processes, a barrier where a
multi-threaded op waits for its slowest thread; a per-head loop made slim 0.3-0.6x stock under load.
The count is taken with ``torch.profiler`` on CPU (the ops, not their timings, are what matters, and
they are the same ops that would run on CUDA) for every path that can run on CUDA: SDPA without
weights, stock's kernel (unmasked self-attention with weights, no graph), the batched weights path
(averaged and per head) without a graph, and the autograd path.
The blocked path, taken only where one pass does not fit in memory, is not counted here.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from slim_mha import SlimMultiheadAttention

from _reference import STOCK_MHA, randomize_parameters

BATCH, LENGTH, EMBED = 2, 16, 64
# Ops slim may dispatch above stock's Python path. Measured: 16 in training with weights (about 18 on
# torch 2.4.1), where slim builds the fused projection's bias [b_q; 0; b_v] from in_proj_bias (9 ops:
# two slices, a fresh zero block and a cat; two of them are kernels) and copies q, k and v into
# head-major batches one by one (stock copies them in one op); 0 to 2 with a padding mask; fewer than
# stock without a graph or without weights. A per-head loop adds at least six ops per head: 72 more
# at H=16 than at H=4.
SLACK = 18

WEIGHTS = {"none": {"need_weights": False}, "averaged": {}, "per_head": {"average_attn_weights": False}}
CASES = list(itertools.product(WEIGHTS, ("train", "eval"), (False, True)))


def aten_ops(module: torch.nn.Module, mode: str, weights: str, padded: bool, heads: int) -> int:
    """Aten ops (nested ones included) that one forward of ``module`` dispatches."""
    generator = torch.Generator().manual_seed(heads)
    x = torch.randn(BATCH, LENGTH, EMBED, generator=generator, requires_grad=mode == "train")
    padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    padding[0, -3:] = True
    kwargs = dict(WEIGHTS[weights], key_padding_mask=padding if padded else None)
    with warnings.catch_warnings(), torch.set_grad_enabled(mode == "train"):
        warnings.simplefilter("ignore")  # the profiler's own warnings, if any
        module(x, x, x, **kwargs)  # warm-up: lazy initialisation and cached bias are not per-call work
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            module(x, x, x, **kwargs)
    return sum(event.name.startswith("aten::") for event in profiler.events())


def modules(heads: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    stock = randomize_parameters(STOCK_MHA(EMBED, heads, batch_first=True))
    slim = SlimMultiheadAttention(EMBED, heads, batch_first=True)
    slim.load_state_dict(stock.state_dict())
    return stock, slim


@pytest.mark.parametrize("weights,mode,padded", CASES)
def test_aten_ops_per_forward_stay_within_stocks_python_path_whatever_the_heads(weights, mode, padded, slims_own_paths):
    """Slim's own path (stock's kernel, which some small calls take, is one opaque op)."""
    counts = {}
    for heads in (4, 16):
        stock, slim = modules(heads)
        stock.train()  # stock's Python path in both modes (its native kernel is one opaque op)
        slim.train(mode == "train")
        counts[heads] = (aten_ops(stock, mode, weights, padded, heads), aten_ops(slim, mode, weights, padded, heads))
    (stock_4, slim_4), (stock_16, slim_16) = counts[4], counts[16]
    assert stock_4 == stock_16, counts  # stock's Python path does not loop over heads either
    assert slim_4 == slim_16, f"slim's op count depends on the number of heads: {counts}"
    assert slim_16 <= stock_16 + SLACK, f"slim {slim_16} aten ops per forward, stock's Python path {stock_16}"


def test_the_budget_check_fails_on_a_head_by_head_loop(monkeypatch, slims_own_paths):
    """The check can fail: the weights computed one head at a time, as slim once did."""
    import slim_mha._explicit_attention as explicit

    def head_by_head(q, k, v, mask, dropout_p, average, q_scaled=False, **_):
        if q_scaled:  # stock's head split scaled the queries already
            q = q * (q.shape[-1] ** 0.5)
        outs, weights = zip(
            *(
                explicit._attention_functional(
                    q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], mask, dropout_p, False
                )
                for h in range(q.shape[1])
            )
        )
        weights = torch.cat(weights, dim=1)
        return torch.cat(outs, dim=1), weights.mean(dim=1) if average else weights

    monkeypatch.setattr("slim_mha.attention.attention_with_weights", head_by_head)
    # Padded: a call without masks in eval takes stock's kernel, which never reaches this function.
    ops = {heads: aten_ops(modules(heads)[1].eval(), "eval", "averaged", True, heads) for heads in (4, 16)}
    assert ops[16] > ops[4] + SLACK


# ------------------------------------------------------------------- zero-fills in the backward

FILL_SHAPE = {"tgt_len": 32, "src_len": 64, "batch": 2, "embed": 128, "heads": 4}  # large enough to be filled by ops


def filled_elements(module: torch.nn.Module, kind: str) -> int:
    """Elements that ``aten::fill_`` writes in one training step of ``module`` (sequence-first, as DETR
    calls it): zero-filled gradients are memory traffic a step should not need."""
    shape = FILL_SHAPE
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(shape["tgt_len"], shape["batch"], shape["embed"], generator=generator)
    memory = torch.randn(shape["src_len"], shape["batch"], shape["embed"], generator=generator)
    padding = torch.zeros(shape["batch"], shape["src_len"], dtype=torch.bool)
    padding[1, -5:] = True
    positioned = x + 1.0
    calls = {
        "self-attention": ((x, x, x), {}),
        "queries and keys shared, values apart": ((positioned, positioned, x), {}),  # DETR's self-attention
        "cross-attention with padding": ((x, memory, memory), {"key_padding_mask": padding}),  # DETR's cross
    }
    args, kwargs = calls[kind]
    module(*args, **kwargs)[0].sum().backward()  # warm-up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        module(*args, **kwargs)[0].sum().backward()
    return sum(
        math.prod(event.input_shapes[0])
        for event in profiler.events()
        if event.name == "aten::fill_" and event.input_shapes and event.input_shapes[0]
    )


@pytest.mark.parametrize(
    "kind", ["self-attention", "queries and keys shared, values apart", "cross-attention with padding"]
)
def test_a_training_step_zero_fills_no_more_than_stocks(kind):
    """Slices of the packed projection, or a mask added in place on a product's view, make autograd
    zero-fill a whole parameter's or a (B, H, L, S) gradient in the backward; stock does neither."""
    stock = randomize_parameters(STOCK_MHA(FILL_SHAPE["embed"], FILL_SHAPE["heads"]))
    slim = SlimMultiheadAttention(FILL_SHAPE["embed"], FILL_SHAPE["heads"])
    slim.load_state_dict(stock.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's own warnings, if any
        stock_filled, slim_filled = filled_elements(stock, kind), filled_elements(slim, kind)
    assert slim_filled <= stock_filled, f"slim zero-fills {slim_filled} elements per step, stock {stock_filled}"
