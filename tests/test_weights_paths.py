"""Every weights path against stock: one pass, blocks of query rows, and the memory guard's choice.

Without a graph, averaged weights take one pass wherever it fits in memory and blocks of query
rows where it does not (``_explicit_attention.rows_per_block``). Each path runs here on small inputs,
through the module, over the attention kinds, appended tokens and masks, and is compared with
stock ``nn.MultiheadAttention``: the path is forced (``forcing_blocks``) or chosen by the guard
under a memory limit the test sets. Timing is the benchmark's (``python -m slim_mha.bench run --need-weights true``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from slim_mha import SlimMultiheadAttention
from slim_mha import _explicit_attention as explicit
from slim_mha._matrix import APPENDED, ATTENTION_KINDS, appended_options
from slim_mha.bench.measure.memory import profile_step

from _reference import (
    STOCK_MHA,
    assert_close_scaled,
    assert_matches_stock,
    attention_tokens,
    float64_reference,
    randomize_parameters,
)

BATCH, TGT_LEN, SRC_LEN, EMBED, HEADS = 2, 7, 5, 12, 3
# These tests exercise slim's own weights paths: not stock's Python path, which small calls take by default.
pytestmark = pytest.mark.usefixtures("slims_own_paths")
MASKS = ("none", "key_padding", "attn_mask_float", "attn_mask_bool")
# One pass, blocks of one query row, blocks of about a third of the rows (the last one shorter where
# they do not divide), and the blocks the guard picks one byte short of one pass.
PATHS = ("one_pass", "blocks_of_1", "blocks_of_a_third", "guard_blocks")


def modules(kind: str, appended: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    widths = {"kdim": 10, "vdim": 6} if kind == "kdim_vdim" else {}
    options = dict(batch_first=True, dtype=dtype, **appended_options(appended), **widths)
    stock = randomize_parameters(STOCK_MHA(EMBED, HEADS, **options))
    slim = SlimMultiheadAttention(EMBED, HEADS, **options)
    slim.load_state_dict(stock.state_dict())
    return stock.eval(), slim.eval()


def inputs(kind: str, mask: str, appended: str, dtype: torch.dtype) -> tuple[tuple, dict]:
    generator = torch.Generator().manual_seed(len(kind) * 7 + len(mask))
    tgt_len = TGT_LEN if kind != "self" else SRC_LEN
    tokens = attention_tokens(
        kind,
        batched=True,
        batch_first=True,
        dtype=dtype,
        generator=generator,
        batch=BATCH,
        tgt_len=tgt_len,
        src_len=SRC_LEN,
        embed_dim=EMBED,
        kdim=10,
        vdim=6,
    )
    src_len = SRC_LEN + int("bias_kv" in appended or appended == "both") + int("zero" in appended or appended == "both")
    masks = {}
    if mask == "key_padding":
        padding = torch.zeros(BATCH, SRC_LEN, dtype=torch.bool)
        padding[0, -2:] = True
        masks["key_padding_mask"] = padding
    elif mask.startswith("attn_mask"):
        attn_mask = torch.randn(BATCH * HEADS, tgt_len, src_len - (src_len - SRC_LEN), generator=generator)
        masks["attn_mask"] = attn_mask > 1.5 if mask.endswith("bool") else attn_mask.to(dtype)
    return tokens, masks


def force(path: str, monkeypatch, forced_blocks, rows_seen: list, one_pass_bytes: int) -> None:
    """Make the averaged no-graph call take ``path``; record the rows of every blocked call."""
    run_in_blocks = explicit._attention_averaged_in_blocks
    monkeypatch.setattr(
        explicit, "_attention_averaged_in_blocks", lambda *a, **kw: rows_seen.append(a[4]) or run_in_blocks(*a, **kw)
    )
    if path == "blocks_of_1":
        forced_blocks(1)
    elif path == "blocks_of_a_third":
        forced_blocks(one_pass_bytes // 3)
    elif path == "guard_blocks":  # one byte short of one pass
        monkeypatch.setattr(explicit, "_CHECK_ABOVE_BYTES", 0)
        monkeypatch.setattr(explicit, "available_bytes", lambda device: (one_pass_bytes - 1, "the test's limit"))


def compare(
    kind, appended, mask, path, monkeypatch, forced_blocks, *, dtype=torch.float64, mode="inference_mode", average=True
):
    stock, slim = modules(kind, appended, dtype)
    tokens, masks = inputs(kind, mask, appended, dtype)
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context():
        expected = stock(*tokens, average_attn_weights=average, **masks)
        rows_seen = []
        tgt_len, src_len = expected[1].shape[-2:]
        force(path, monkeypatch, forced_blocks, rows_seen, BATCH * (HEADS + 1) * tgt_len * src_len * dtype.itemsize)
        out, weights = slim(*tokens, average_attn_weights=average, **masks)
        reference = float64_reference(stock, *tokens, average_attn_weights=average, **masks)
    assert_matches_stock(out, expected[0], reference[0])
    assert_matches_stock(weights, expected[1], reference[1], "weights")
    return rows_seen


CASES = list(itertools.product(ATTENTION_KINDS, APPENDED, MASKS, PATHS))


@pytest.mark.parametrize("kind,appended,mask,path", CASES)
def test_every_path_matches_stock(kind, appended, mask, path, monkeypatch, forced_blocks):
    rows_seen = compare(kind, appended, mask, path, monkeypatch, forced_blocks)
    tgt_len = SRC_LEN if kind == "self" else TGT_LEN
    if path == "one_pass":
        assert rows_seen == []
    elif path == "blocks_of_1":
        assert rows_seen == [1]
    elif path == "blocks_of_a_third":
        assert len(rows_seen) == 1 and 1 < rows_seen[0] < tgt_len, rows_seen
    else:
        assert len(rows_seen) == 1 and rows_seen[0] < tgt_len, rows_seen


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_every_path_matches_stock_in_each_dtype_and_mode(path, dtype, mode, monkeypatch, forced_blocks):
    compare("self", "none", "key_padding", path, monkeypatch, forced_blocks, dtype=dtype, mode=mode)


@pytest.mark.parametrize("path", PATHS)
def test_per_head_weights_take_one_pass_whatever_memory_says(path, monkeypatch, forced_blocks):
    """Per-head weights are (B, H, L, S) anyway: blocks would save nothing."""
    assert compare("cross", "none", "attn_mask_float", path, monkeypatch, forced_blocks, average=False) == []


def test_half_precision_one_pass_is_as_close_to_float64_as_stock():
    """bf16: slim's one pass against a float64 run, allowed twice stock's error plus the tolerance."""
    stock, slim = modules("self", "none", torch.float64)
    x = torch.randn(BATCH, 9, EMBED, dtype=torch.float64)
    with torch.inference_mode():
        exact = stock(x, x, x)
        stock_half, slim_half = stock.to(torch.bfloat16), slim.to(torch.bfloat16)
        xh = x.to(torch.bfloat16)
        errors = [
            max((a.double() - b).abs().max().item() for a, b in zip(module(xh, xh, xh), exact))
            for module in (stock_half, slim_half)
        ]
    assert errors[1] <= 2 * errors[0] + 2e-2, errors


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
def test_an_empty_batch_or_sequence_takes_one_pass(shape, monkeypatch):
    batch, length = shape
    stock, slim = modules("self", "none", torch.float32)
    x = torch.randn(batch, length, EMBED)
    with torch.inference_mode():
        out, weights = slim(x, x, x)
        expected = stock(x, x, x)
    assert out.shape == expected[0].shape and weights.shape == expected[1].shape


def test_one_pass_is_taken_for_large_scores_where_memory_suffices(monkeypatch):
    """Blocks only where one pass would not fit: not above any fixed size."""
    q = torch.empty(1, 8, 4096, 8)  # (B, H, L, D): 512 MiB of float32 scores
    plan = lambda: explicit.plan_weights_path(q, 4096, dropout_p=0.0, average=True, records_graph=False, symbolic=False)  # noqa: E731
    monkeypatch.setattr(explicit, "available_bytes", lambda device: (1 << 40, "the test's limit"))
    assert plan().rows == 4096
    monkeypatch.setattr(explicit, "available_bytes", lambda device: (None, "unknown"))
    assert plan().rows == 4096
    monkeypatch.setattr(explicit, "available_bytes", lambda device: (256 << 20, "the test's limit"))
    # Half of 256 MiB less the 64 MiB average leaves 64 MiB: 455 rows of 144 KiB (8 heads' scores and
    # their average), so 10 blocks of 410 rows.
    assert plan().rows == 410


def test_the_comparison_fails_on_a_wrong_average(monkeypatch, forced_blocks):
    """The check can fail: weights summed over heads instead of averaged, on the one-pass path."""
    monkeypatch.setattr(explicit, "mean_over_heads", lambda scores: scores.sum(dim=1))
    with pytest.raises(AssertionError, match="weights: max error"):
        compare("self", "none", "none", "one_pass", monkeypatch, forced_blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_comparison_fails_on_a_dropped_value_bias_by_orders_of_magnitude(dtype, monkeypatch):
    """The stock-error yardstick still catches a wrong function: b_v dropped from slim's projection."""
    stock, slim = modules("cross", "none", dtype)
    tokens, _ = inputs("cross", "none", "none", dtype)
    with torch.no_grad():
        slim.in_proj_bias[2 * EMBED :] = 0.0
        expected, actual = stock(*tokens), slim(*tokens)
        reference = float64_reference(stock, *tokens)
    stock_error = (expected[0].double() - reference[0]).abs().max().item()
    error = (actual[0].double() - reference[0]).abs().max().item()
    assert error > 1e4 * max(stock_error, 1e-12), (error, stock_error)
    with pytest.raises(AssertionError, match="output: max error"):
        assert_matches_stock(actual[0], expected[0], reference[0])


def test_the_head_average_is_kept_per_heads_dtype_and_device_and_serves_every_mode():
    """The one constant the path keeps: a row of 1/H, keyed on everything it depends on."""
    rows = [
        explicit._head_average(heads, dtype, torch.device("cpu"))
        for heads, dtype in ((3, torch.float32), (4, torch.float32), (3, torch.float64))
    ]
    assert [(row.shape[-1], row.dtype) for row in rows] == [(3, torch.float32), (4, torch.float32), (3, torch.float64)]
    assert rows[0] is explicit._head_average(3, torch.float32, torch.device("cpu"))
    assert not any(row.is_inference() or row.requires_grad for row in rows)
    stock, slim = modules("self", "none", torch.float32)
    x = torch.randn(BATCH, 5, EMBED)
    for context in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with context():
            assert_close_scaled(slim(x, x, x)[1], stock(x, x, x)[1], "weights")


def test_a_learned_mask_and_appended_tokens_alone_needing_grad_match_stock():
    """Frozen projections, a learned mask and trainable appended tokens: autograd records the call
    through them alone (``_stock_checks.module_records_graph`` reads the masks and every parameter),
    so the whole path records it, not the one pass made for calls without a graph."""
    torch.manual_seed(0)
    stock = STOCK_MHA(16, 4, add_bias_kv=True, batch_first=True)
    slim = SlimMultiheadAttention(16, 4, add_bias_kv=True, batch_first=True)
    slim.load_state_dict(stock.state_dict())
    for module in (stock, slim):
        for name, parameter in module.named_parameters():
            parameter.requires_grad_(name.startswith("bias_"))
    x = torch.randn(2, 5, 16)
    results = []
    for module in (stock, slim):
        mask = torch.zeros(5, 5, requires_grad=True)
        out, weights = module(x, x, x, attn_mask=mask)
        (out.sum() + weights.sum()).backward()
        results.append((out.detach(), weights.detach(), mask.grad, module.bias_k.grad))
    for actual, expected in zip(results[1], results[0]):
        assert_close_scaled(actual, expected)


@pytest.mark.parametrize("shape", [(8, 64, 128, 8), (16, 32, 256, 8)])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("shared_key_value", [True, False])
def test_cross_attention_with_weights_peaks_no_higher_than_stock(shape, batch_first, shared_key_value):
    """The one pass gets q, k and v head-major, each copied in one op as its projection dies, so where
    the scores are no larger than a projection slim holds no more than stock. With copies made later
    beside the projections, slim's peak was 3.19 MiB against stock's 2.69 MiB at the second shape."""
    batch, length, embed, heads = shape
    stock = randomize_parameters(STOCK_MHA(embed, heads, batch_first=batch_first)).eval()
    slim = SlimMultiheadAttention(embed, heads, batch_first=batch_first).eval()
    slim.load_state_dict(stock.state_dict())
    generator = torch.Generator().manual_seed(5)
    layout = (lambda n: (batch, n, embed)) if batch_first else (lambda n: (n, batch, embed))
    query = torch.randn(*layout(length), generator=generator)
    key = torch.randn(*layout(length + 3), generator=generator)
    value = key if shared_key_value else torch.randn(*layout(length + 3), generator=generator)
    peaks = {}
    with torch.inference_mode():
        for name, module in (("stock", stock), ("slim", slim)):
            module(query, key, value)  # warm
            peaks[name] = profile_step(lambda module=module: module(query, key, value), query.device).peak_bytes
        expected, actual = stock(query, key, value), slim(query, key, value)
        reference = float64_reference(stock, query, key, value)
    assert_matches_stock(actual[0], expected[0], reference[0])
    assert_matches_stock(actual[1], expected[1], reference[1], "weights")
    assert peaks["slim"] <= peaks["stock"], peaks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(8, 128, 256, 8), (2, 256, 128, 4)])
def test_training_with_weights_peaks_no_higher_than_stock(shape, dtype):
    """The graph path frees the raw scores once softmaxed, as stock's rebinding does: autograd keeps
    softmax's output, not its input. Kept to the end of the function, they lifted slim's bf16 peak
    one (B, H, L, S) above stock's: 84 against 80 MiB at B=4 L=512 E=512, 12.3 against 11.8 at B=8 L=128."""
    batch, length, embed, heads = shape
    stock = randomize_parameters(STOCK_MHA(embed, heads, batch_first=True, dtype=dtype)).train()
    slim = SlimMultiheadAttention(embed, heads, batch_first=True, dtype=dtype).train()
    slim.load_state_dict(stock.state_dict())
    x = torch.randn(batch, length, embed, generator=torch.Generator().manual_seed(6)).to(dtype).requires_grad_()
    peaks, results = {}, {}
    for name, module in (("stock", stock), ("slim", slim)):

        def step(module=module):
            out, weights = module(x, x, x)
            (out.sum() + weights.sum()).backward()
            return out, weights

        step()  # warm
        peaks[name] = profile_step(step, x.device).peak_bytes
        x.grad = None
        out, weights = step()
        results[name] = (out.detach(), weights.detach(), x.grad.clone())
        x.grad = None
    reference = float64_reference(stock, x.detach(), x.detach(), x.detach())
    assert_matches_stock(results["slim"][0], results["stock"][0], reference[0])
    assert_matches_stock(results["slim"][1], results["stock"][1], reference[1], "weights")
    assert peaks["slim"] <= peaks["stock"], peaks


class _Scaled(torch.nn.Module):
    """A parametrization with a trainable parameter of its own, as adapters add them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.25))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.scale


@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("parametrized", ["in_proj_weight", "out_proj.weight"])
@pytest.mark.parametrize("trained", ["original", "parametrization"])
def test_weights_train_through_a_parametrized_projection_as_stock(kind, batch_first, parametrized, trained):
    """Only a parametrized projection trains (``torch.nn.utils.parametrize``): autograd records the
    call though no parameter of the module's own dictionary asks for grad. The weights path then
    records a graph: it once took the one pass and stock's head split, which has no backward."""
    torch.manual_seed(0)
    stock = randomize_parameters(STOCK_MHA(16, 4, batch_first=batch_first))
    slim = SlimMultiheadAttention(16, 4, batch_first=batch_first)
    slim.load_state_dict(stock.state_dict())
    owner_name, _, name = parametrized.rpartition(".")
    x = torch.randn(*((2, 5, 16) if batch_first else (5, 2, 16)))
    memory = torch.randn(*((2, 7, 16) if batch_first else (7, 2, 16)))
    key = x if kind == "self" else memory
    results = []
    for module in (stock, slim):
        module.requires_grad_(False)
        owner = module.get_submodule(owner_name)
        torch.nn.utils.parametrize.register_parametrization(owner, name, _Scaled())
        trainable = owner.parametrizations[name]
        trainable = trainable.original if trained == "original" else trainable[0].scale
        trainable.requires_grad_(True)
        out, weights = module(x, key, key)
        (out.sum() + weights.sum()).backward()
        results.append((out.detach(), weights.detach(), trainable.grad))
    for actual, expected, what in zip(results[1], results[0], ("output", "weights", "grad")):
        assert actual is not None, what
        assert_close_scaled(actual, expected, what)
