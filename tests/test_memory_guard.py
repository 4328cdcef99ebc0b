"""The memory guard's estimate is what the weights path allocates, path by path.

``_explicit_attention.weights_path_bytes`` counts the ``L x S``-sized tensors each path of
``slim_mha/_explicit_attention.py`` holds at once. Here every path runs under the CPU allocator's
profiler and its peak is compared with the estimate; the refusal is then checked at the estimate's
edge: a limit of exactly the estimate serves the call, one byte less refuses it. The guard's other
tests (the message, the threshold, tracing, real address-space limits, cgroup and meminfo parsing)
are in tests/test_scale.py.
"""

from __future__ import annotations

import pytest
import torch

from slim_mha import SlimMultiheadAttention
from slim_mha import _explicit_attention as explicit
from slim_mha import _explicit_attention as guard
from slim_mha._explicit_attention import plan_weights_path
from slim_mha.bench.measure.memory import profile_step

from _reference import STOCK_MHA, assert_close_scaled, randomize_parameters

EMBED_DIM = 8
# What the estimate leaves out at these sizes: the projections, the output and the bias, a few
# (1, L, E) and (1, H, L, D) tensors of 70 KB each. One missing (B, L, S) or block term is 3 MB or more.
LINEAR_SLACK = 1 << 20

# (graph recorded, averaged weights, heads, tokens): one case per row of the guard's table.
PATHS = {
    "graph_averaged": (True, True, 2, 1500),
    "graph_per_head": (True, False, 2, 1500),
    "per_head": (False, False, 2, 2100),
    "averaged_in_one_piece": (False, True, 2, 1000),  # scores of 8 MB in one pass
    "averaged_in_blocks": (False, True, 8, 2100),  # scores of 141 MB, in blocks of at most 16 MiB
}
# Blocks are taken only where one pass does not fit; the blocked case forces them at this size.
BLOCK_BYTES = 16 << 20


@pytest.fixture(autouse=True)
def blocks_where_named(request, forced_blocks):
    """The blocked case in blocks of ``BLOCK_BYTES`` whatever memory this machine has."""
    if "averaged_in_blocks" in request.node.name:
        forced_blocks(BLOCK_BYTES)


def slim_and_stock(num_heads: int):
    stock = randomize_parameters(STOCK_MHA(EMBED_DIM, num_heads, batch_first=True), scale=0.2)
    slim = SlimMultiheadAttention(EMBED_DIM, num_heads, batch_first=True)
    slim.load_state_dict(stock.state_dict())
    return slim, stock


def estimate(grad: bool, average: bool, heads: int, tokens: int, device: str = "cpu") -> tuple[int, str]:
    q = torch.empty(1, heads, tokens, EMBED_DIM // heads, device=device)  # (B, H, L, D)
    plan = plan_weights_path(q, tokens, dropout_p=0.0, average=average, records_graph=grad, symbolic=False)
    return guard.weights_path_bytes(q, tokens, plan)


def rows(heads: int, tokens: int) -> int:
    q = torch.empty(1, heads, tokens, EMBED_DIM // heads)
    return plan_weights_path(q, tokens, dropout_p=0.0, average=True, records_graph=False, symbolic=False).rows


def test_the_cases_take_the_paths_they_are_named_after(forced_blocks):
    """What the cases below rely on: the blocked case is blocked, the one-piece case is not."""
    _, _, heads, tokens = PATHS["averaged_in_one_piece"]
    assert rows(heads, tokens) == tokens
    _, _, heads, tokens = PATHS["averaged_in_blocks"]
    assert rows(heads, tokens) == tokens  # one pass fits here
    forced_blocks(BLOCK_BYTES)
    assert rows(heads, tokens) < tokens


@pytest.mark.parametrize("path", PATHS)
def test_the_estimate_is_the_peak_the_path_reaches(path):
    grad, average, heads, tokens = PATHS[path]
    slim, _ = slim_and_stock(heads)
    x = torch.randn(1, tokens, EMBED_DIM, requires_grad=grad)
    needed, _ = estimate(grad, average, heads, tokens)

    def call():
        with torch.set_grad_enabled(grad):
            slim(x, x, x, average_attn_weights=average)

    peak = profile_step(call, torch.device("cpu")).peak_bytes
    assert needed <= peak <= needed + LINEAR_SLACK, f"estimated {needed:,} bytes, the call's peak was {peak:,}"


def test_blocked_averaging_needs_far_less_than_every_head_s_scores(forced_blocks):
    """The point of the blocked path, and what a guard counting (B, H, L, S) would wrongly refuse."""
    forced_blocks(BLOCK_BYTES)
    _, _, heads, tokens = PATHS["averaged_in_blocks"]
    needed, what = estimate(False, True, heads, tokens)
    every_head = heads * tokens * tokens * 4
    assert needed < every_head / 3
    block_rows = rows(heads, tokens)
    assert what == (
        f"the averaged weights, (B, L, S) = (1, {tokens}, {tokens}), one block of scores, "
        f"(B, H, rows, S) = (1, {heads}, {block_rows}, {tokens}), and its average"
    )


def test_where_one_pass_fits_averaged_weights_count_every_head_s_scores():
    """One pass holds every head's scores and their average, as stock's native kernel does."""
    _, _, heads, tokens = PATHS["averaged_in_blocks"]
    needed, what = estimate(False, True, heads, tokens, device="meta")
    assert needed == (heads + 1) * tokens * tokens * 4
    assert what.startswith(f"the scores of every head, (B, H, L, S) = (1, {heads}, {tokens}, {tokens})")


@pytest.mark.parametrize("path", [path for path in PATHS if path != "averaged_in_one_piece"])
def test_a_call_is_served_at_its_estimate_and_refused_one_byte_below(path, monkeypatch):
    grad, average, heads, tokens = PATHS[path]
    slim, stock = slim_and_stock(heads)
    x = torch.randn(1, tokens, EMBED_DIM, requires_grad=grad)
    needed, what = estimate(grad, average, heads, tokens)
    monkeypatch.setattr(guard, "_CHECK_ABOVE_BYTES", 0)  # these calls are below the threshold

    monkeypatch.setattr(guard, "available_bytes", lambda device: (needed, "the test's limit"))
    with torch.set_grad_enabled(grad):
        out, weights = slim(x, x, x, average_attn_weights=average)
        expected_out, expected_weights = stock(x, x, x, average_attn_weights=average)
    assert_close_scaled(out, expected_out)
    assert_close_scaled(weights, expected_weights, "weights")

    monkeypatch.setattr(guard, "available_bytes", lambda device: (needed - 1, "the test's limit"))
    with torch.set_grad_enabled(grad), pytest.raises(torch.OutOfMemoryError) as refused:
        slim(x, x, x, average_attn_weights=average)
    message = str(refused.value)
    assert f"need at least {guard._format_bytes(needed)} ({what}, float32)" in message
    assert "pass need_weights=False" in message


def test_averaged_weights_go_in_blocks_one_byte_below_one_pass_and_are_refused_below_one_row(monkeypatch):
    """Without a graph the guard picks blocks where one pass does not fit, and refuses only where a
    block of one query row does not fit either."""
    _, _, heads, tokens = PATHS["averaged_in_one_piece"]
    slim, stock = slim_and_stock(heads)
    x = torch.randn(1, tokens, EMBED_DIM)
    one_pass, _ = estimate(False, True, heads, tokens)
    one_row = (heads + 1) * tokens * 4  # every head's scores of one query row, and their average
    averaged = tokens * tokens * 4
    monkeypatch.setattr(guard, "_CHECK_ABOVE_BYTES", 0)
    blocks = []
    run_in_blocks = explicit._attention_averaged_in_blocks
    monkeypatch.setattr(
        explicit, "_attention_averaged_in_blocks", lambda *a, **kw: blocks.append(a[4]) or run_in_blocks(*a, **kw)
    )
    with torch.no_grad():
        expected = stock(x, x, x)
        # One byte short of 12 MB: half of it less the 4 MB average leaves 166 rows of 12 KB: 7 blocks of 143.
        for limit, rows in ((one_pass, None), (one_pass - 1, 143), (averaged + one_row, 1)):
            monkeypatch.setattr(guard, "available_bytes", lambda device, limit=limit: (limit, "the test's limit"))
            out, weights = slim(x, x, x)
            assert blocks[-1:] == ([] if rows is None else [rows]), limit
            assert_close_scaled(out, expected[0])
            assert_close_scaled(weights, expected[1], "weights")
        monkeypatch.setattr(guard, "available_bytes", lambda device: (averaged + one_row - 1, "the test's limit"))
        with pytest.raises(torch.OutOfMemoryError, match="one block of scores"):
            slim(x, x, x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["graph_averaged", "per_head", "averaged_in_one_piece"])
def test_the_estimate_is_the_peak_on_cuda(path):
    """On CUDA averaged weights come from every head's scores at once, whatever their size."""
    grad, average, heads, tokens = PATHS[path]
    device = torch.device("cuda")
    slim, _ = slim_and_stock(heads)
    slim.to(device)
    x = torch.randn(1, tokens, EMBED_DIM, device=device, requires_grad=grad)
    needed, _ = estimate(grad, average, heads, tokens, device="cuda")
    with torch.set_grad_enabled(grad):
        slim(x, x, x, average_attn_weights=average)  # once first: cuBLAS allocates its workspace
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        slim(x, x, x, average_attn_weights=average)
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    assert needed <= peak <= needed + LINEAR_SLACK, f"estimated {needed:,} bytes, the call's peak was {peak:,}"
