"""A dry run of every path on fake CUDA tensors, on a machine without a GPU.

``FakeTensorMode`` builds CUDA tensors without a device and runs forward calls through the
dispatcher: shapes, dtypes, strides and devices, no values. Each path slim can take on CUDA runs here
beside stock's call on the same fake module, and must give stock's output metadata; a tensor slim
creates on the wrong device (the ``3E`` bias, the head-average matrix, a mask), a missing table entry
or a CPU-only op fails the run. Backward needs a real device, so only forward calls are made.

A CPU-only build of torch cannot run CUDA ops even on fake tensors (it is "not linked with support
for cuda devices"): there the module skips, naming that reason. CUDA builds (every other row of
``.ci/run``) run it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha import encoder_layer
from slim_mha._stock_checks import AttentionCall
from slim_mha.bias import key_slot_zeroer
from slim_mha.paths import PATHS_TAKEN, choose_path

try:
    from torch._subclasses.fake_tensor import FakeTensorMode
except ImportError:  # pragma: no cover - every tested torch has it
    FakeTensorMode = None


def _why_fake_cuda_cannot_run() -> str | None:
    if FakeTensorMode is None:
        return "this torch has no torch._subclasses.fake_tensor.FakeTensorMode"
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(2, 3, device="cuda")
            (x.t().contiguous() @ x).sum()
    except Exception as error:
        return f"this torch's fake mode cannot run CUDA ops ({type(error).__name__}: {error})"
    return None


REASON = _why_fake_cuda_cannot_run()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

E, H, B, FF = 16, 4, 2, 32
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fake_pair(dtype: torch.dtype, mode, **options) -> tuple[nn.Module, nn.Module]:
    """Stock's attention and slim's, on fake CUDA (built on meta: no random init to run)."""
    stock = nn.MultiheadAttention(E, H, batch_first=True, device="meta", dtype=dtype, **options)
    slim = slim_mha.SlimMultiheadAttention(E, H, batch_first=True, device="meta", dtype=dtype, **options)
    with mode:
        stock.to_empty(device="cuda"), slim.to_empty(device="cuda")
    return stock, slim


def metadata(result) -> tuple:
    """What a fake run tells: each tensor's shape, dtype, device and strides (weights: shape and dtype,
    since stock's fake kernel returns an empty tensor where the real one returns None)."""
    out, weights = result if isinstance(result, tuple) else (result, None)
    out_meta = (tuple(out.shape), out.dtype, out.device.type, out.stride())
    weights_meta = None if weights is None or weights.numel() == 0 else (tuple(weights.shape), weights.dtype)
    return out_meta, weights_meta


ATTENTION_CASES = {
    # path: (module mode, need_weights, the slim method that runs the path)
    "stock kernel": ("eval", True, "_slim_stock_kernel"),
    "sdpa": ("eval", False, "_slim_sdpa"),
    "stock ops": ("train", True, "_slim_stock_ops"),
    "general": ("train", False, "_slim_general"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", list(ATTENTION_CASES))
def test_each_attention_path_gives_stocks_metadata_on_cuda(path, dtype):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    stock, slim = fake_pair(dtype, mode)
    training, need_weights, method = ATTENTION_CASES[path]
    for module in (stock, slim):
        module.train(training == "train")
    with mode, torch.no_grad():
        x = torch.empty(B, 7, E, device="cuda", dtype=dtype)
        expected = stock(x, x, x, need_weights=need_weights)
        call = AttentionCall(x, x, x, None, need_weights, None, True, False)
        if method == "_slim_general":
            actual = slim._slim_general(call)
        else:  # the path forced, with the facts the choice learns of the call as CUDA would run it
            actual = getattr(slim, method)(call, choose_path(slim, call, as_real=True)._replace(path=path))
    assert metadata(actual) == metadata(expected)
    assert actual[0].device.type == "cuda"


GENERAL_CALLS = {
    "padding mask": dict(key_padding_mask="padding"),
    "causal mask, weights": dict(attn_mask="causal", need_weights=True),
    "per-head weights": dict(need_weights=True, average_attn_weights=False),
    "cross-attention": dict(key="other"),
    "unbatched": dict(unbatched=True),
    "appended tokens": dict(options={"add_bias_kv": True, "add_zero_attn": True}),
    "sequence first": dict(options={"batch_first": False}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(GENERAL_CALLS))
def test_calls_with_masks_weights_and_layouts_give_stocks_metadata_on_cuda(case, dtype):
    spec = dict(GENERAL_CALLS[case])
    options = spec.pop("options", {})
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    batch_first = options.pop("batch_first", True)
    stock = nn.MultiheadAttention(E, H, batch_first=batch_first, device="meta", dtype=dtype, **options)
    slim = slim_mha.SlimMultiheadAttention(E, H, batch_first=batch_first, device="meta", dtype=dtype, **options)
    with mode:
        stock.to_empty(device="cuda"), slim.to_empty(device="cuda")
        shape = (7, E) if spec.pop("unbatched", False) else ((B, 7, E) if batch_first else (7, B, E))
        x = torch.empty(shape, device="cuda", dtype=dtype)
        key = torch.empty(
            shape[:-2] + (9, E) if batch_first or len(shape) == 2 else (9, B, E), device="cuda", dtype=dtype
        )
        kwargs = {"need_weights": spec.pop("need_weights", False)}
        if spec.pop("key", None):
            args = (x, key, key)
        else:
            args = (x, x, x)
        if spec.pop("key_padding_mask", None):
            kwargs["key_padding_mask"] = torch.zeros(B, 7, dtype=torch.bool, device="cuda")
        if spec.pop("attn_mask", None):
            kwargs["attn_mask"] = torch.ones(7, 7, dtype=torch.bool, device="cuda").triu(1)
        kwargs.update(spec)
        for module in (stock, slim):
            module.eval()
        with torch.no_grad():
            expected, actual = stock(*args, **kwargs), slim(*args, **kwargs)
    assert metadata(actual) == metadata(expected)


def test_the_tensors_slim_makes_are_on_the_inputs_device():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _, slim = fake_pair(torch.float32, mode)
    with mode:
        bias = slim.in_proj_bias
        packed = key_slot_zeroer(bias.shape[0], bias.dtype, bias.device)(bias)  # [b_q; 0; b_v], a cached mask
        assert packed.device.type == "cuda" and packed.shape == (3 * E,)
        x = torch.empty(B, 7, E, device="cuda")
        slim.eval()
        with torch.no_grad():  # averaged weights: the head-average matrix
            _, weights = slim._slim_general(AttentionCall(x, x, x, None, True, None, True, False))
    assert weights.device.type == "cuda"


def test_a_recording_block_records_cuda_maps():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _, slim = fake_pair(torch.float32, mode)
    slim.eval()
    with mode, torch.no_grad(), slim_mha.recording_attention(slim, per_head=True) as maps:
        x = torch.empty(B, 7, E, device="cuda")
        slim(x, x, x, need_weights=False)
    ((recorded,),) = maps.values()
    assert recorded.device.type == "cuda" and tuple(recorded.shape) == (B, H, 7, 7)


def test_the_per_call_equivariance_check_leaves_fake_calls_alone():
    """Fake tensors hold no values to compare: the check skips them, as it skips compiled calls."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _, slim = fake_pair(torch.float32, mode)
    with mode, torch.no_grad(), slim_mha.checking_equivariance():
        x = torch.empty(B, 7, E, device="cuda")
        out, _ = slim(x, x, x, need_weights=False)
    assert out.device.type == "cuda"


# --------------------------------------------------------------------------------- the encoder layer


def fake_layers(mode, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module]:
    stock = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, device="meta", dtype=dtype)
    slim = slim_mha.convert(copy.deepcopy(stock))
    with mode:
        stock.to_empty(device="cuda"), slim.to_empty(device="cuda")
    return stock.eval(), slim.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["stock layer", "stock fused layer", "slim layer", "unfused layer"])
def test_each_layer_path_gives_stocks_metadata_on_cuda(path, dtype):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    stock, slim = fake_layers(mode, dtype)
    with mode, torch.no_grad():
        src = torch.empty(B, 400 if path == "slim layer" else 16, E, device="cuda", dtype=dtype)
        soft = torch.empty(src.shape[1], src.shape[1], device="cuda", dtype=dtype)  # a float mask
        if path == "stock layer":
            stock.train(), slim.train()
            expected, actual = stock(src), slim(src)
        elif path == "stock fused layer":
            expected, actual = stock(src), slim(src)  # a fake call: stock's forward runs on both
        elif path == "slim layer":
            expected = stock(src)
            actual = encoder_layer._as_the_fused_kernel(slim, src, None, None)
        else:
            previous = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            try:
                expected = stock(src, src_mask=soft)
            finally:
                torch.backends.mha.set_fastpath_enabled(previous)
            actual = encoder_layer._unfused(slim, src, soft, None, False)
    assert metadata(actual) == metadata(expected)


# ------------------------------------------------------------------------------------- the path table


def quick_matrix_calls():
    from slim_mha.bench.matrix.cases import TARGET_SHAPES

    for batch, length, width, heads in TARGET_SHAPES:
        for need_weights in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                yield batch, length, width, heads, need_weights, dtype


@pytest.mark.parametrize("training", [False, True])
def test_every_quick_matrix_case_has_a_path_on_cuda(training):
    """What ``choose_path`` decides for real CUDA tensors of each quick-matrix case: a path it names,
    never an error or a table entry missing (``benchmarks/cuda_paths.md`` records the table)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    seen = set()
    for batch, length, width, heads, need_weights, dtype in quick_matrix_calls():
        slim = slim_mha.SlimMultiheadAttention(width, heads, batch_first=True, device="meta", dtype=dtype)
        with mode:
            slim.to_empty(device="cuda")
            x = torch.empty(batch, length, width, device="cuda", dtype=dtype)
        slim.train(training)
        with torch.no_grad():
            path = choose_path(slim, AttentionCall(x, x, x, None, need_weights, None, True, False), as_real=True).path
        assert path in PATHS_TAKEN
        seen.add(path)
    assert seen  # the table is not empty
