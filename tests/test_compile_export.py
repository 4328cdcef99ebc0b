"""torch.compile(fullgraph=True), torch.export and CPU autocast, for slim modules and a patched encoder.

``fullgraph=True`` turns any graph break into an error, so compiling at all is the check. The
default run compiles with the ``aot_eager`` backend: Dynamo tracing and AOTAutograd are exactly
what inductor sees, without minutes of C++ code generation on a small CPU machine. The inductor
runs are marked slow (``pytest -m slow``).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch._dynamo
from torch import nn

from slim_mha import SlimMultiheadAttention, convert, patched

from _reference import STOCK_MHA, TOLERANCE, assert_close_scaled, randomize_parameters

E, H, FF = 16, 4, 32
BATCH, LENGTH = 3, 7

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype:UserWarning")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def stock_and_slim_attention(**kwargs) -> tuple[nn.MultiheadAttention, SlimMultiheadAttention]:
    torch.manual_seed(0)
    stock = randomize_parameters(STOCK_MHA(E, H, batch_first=True, **kwargs))
    return stock, convert(copy.deepcopy(stock))


def stock_and_patched_encoder() -> tuple[nn.TransformerEncoder, nn.TransformerEncoder]:
    def build():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=2)

    stock = randomize_parameters(build())
    with patched():
        slim = build()
    slim.load_state_dict(stock.state_dict(), strict=True)
    return stock, slim


def sequence(seed: int = 1) -> torch.Tensor:
    return torch.randn(BATCH, LENGTH, E, generator=torch.Generator().manual_seed(seed))


def padding_mask() -> torch.Tensor:
    mask = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    mask[1, 5:] = mask[2, 4:] = True  # left-aligned, as the nested-tensor path requires
    return mask


def output_and_grads(module: nn.Module, call) -> list[torch.Tensor]:
    """The output, then the gradient of its sum w.r.t. every parameter (in registration order)."""
    output = call(module)
    output = output[0] if isinstance(output, tuple) else output
    if not output.requires_grad:
        return [output]
    return [output.detach(), *torch.autograd.grad(output.sum(), list(module.parameters()))]


def assert_compiled_matches(module: nn.Module, call, backend: str, *, stock: nn.Module | None = None) -> None:
    """Compiled output and gradients equal eager's. Given ``stock``, a failure to compile that stock
    shares, with the same error, is this torch's bug: the test skips with it as the reason."""
    __tracebackhide__ = True
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    expected = output_and_grads(module, call)
    try:
        actual = output_and_grads(compiled, call)
    except torch._dynamo.exc.TorchDynamoException as error:
        if stock is not None:
            skip_if_stock_fails_alike(stock, call, backend, error)
        raise
    assert len(actual) == len(expected)
    for index, (a, b) in enumerate(zip(actual, expected, strict=True)):
        assert_close_scaled(a, b, "output" if index == 0 else f"grad of parameter {index - 1}")


def dynamo_reason(error: Exception) -> str:
    """The line of a Dynamo error that says what went wrong (not the "Failed running ..." preamble)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if not line.startswith("Failed running")), type(error).__name__)


def skip_if_stock_fails_alike(stock: nn.Module, call, backend: str, error: Exception) -> None:
    torch._dynamo.reset()
    try:
        output_and_grads(torch.compile(stock, fullgraph=True, backend=backend), call)
    except torch._dynamo.exc.TorchDynamoException as stock_error:
        if type(stock_error) is type(error) and dynamo_reason(stock_error) == dynamo_reason(error):
            pytest.skip(f"torch {torch.__version__} cannot compile stock here either: {dynamo_reason(error)}")


# ------------------------------------------------------------------------------ torch.compile


def test_fullgraph_check_fails_on_a_graph_break():
    """What the compile tests rely on: with fullgraph=True a graph break is an error, not a fallback."""

    class Breaks(nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x + 1

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(Breaks(), fullgraph=True, backend="aot_eager")(sequence())


def test_a_compile_failure_that_stock_does_not_share_fails():
    """The skip in assert_compiled_matches is for torch bugs stock shares, not for ours."""

    class Breaks(nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x + 1

    with pytest.raises(torch._dynamo.exc.Unsupported):
        assert_compiled_matches(Breaks(), lambda m: m(sequence()), "aot_eager", stock=nn.Identity())


@pytest.mark.parametrize("need_weights", (True, False))
@pytest.mark.parametrize("grad", (True, False), ids=("grad", "no_grad"))
def test_slim_compiles_without_graph_breaks(grad, need_weights):
    _, slim = stock_and_slim_attention(add_bias_kv=True)
    x, mask = sequence(), padding_mask()
    call = {"key_padding_mask": mask, "need_weights": need_weights}
    with torch.set_grad_enabled(grad):
        assert_compiled_matches(slim, lambda m: m(x, x, x, **call), "aot_eager")


@pytest.mark.parametrize("mode", ("train", "eval", "inference"))
def test_patched_encoder_compiles_without_graph_breaks(mode):
    """In inference, eager takes the nested-tensor path (zeros at padded positions) and compiled code
    does not (torch skips it while compiling), for stock as well: only real positions are compared.
    torch 2.4 still traces into that path and fails with stock too ("NestedTensorImpl doesn't support
    sizes"): skipped there, with stock's error.
    """
    stock, encoder = stock_and_patched_encoder()
    stock.train(mode == "train"), encoder.train(mode == "train")
    x, mask = sequence(), padding_mask()
    with torch.set_grad_enabled(mode != "inference"):
        assert_compiled_matches(encoder, lambda m: m(x, src_key_padding_mask=mask)[~mask], "aot_eager", stock=stock)


@pytest.mark.slow
@pytest.mark.parametrize("need_weights", (True, False))
def test_slim_compiles_with_inductor(need_weights):
    _, slim = stock_and_slim_attention(add_bias_kv=True)
    x, mask = sequence(), padding_mask()
    assert_compiled_matches(slim, lambda m: m(x, x, x, key_padding_mask=mask, need_weights=need_weights), "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("train", "eval", "inference"))
def test_patched_encoder_compiles_with_inductor(mode):
    stock, encoder = stock_and_patched_encoder()
    stock.train(mode == "train"), encoder.train(mode == "train")
    x, mask = sequence(), padding_mask()
    causal = nn.Transformer.generate_square_subsequent_mask(LENGTH)
    with torch.set_grad_enabled(mode != "inference"):
        assert_compiled_matches(encoder, lambda m: m(x, mask=causal, is_causal=True), "inductor")
        assert_compiled_matches(encoder, lambda m: m(x, src_key_padding_mask=mask)[~mask], "inductor", stock=stock)


def structure_cases():
    """Every module structure and call shape; masks of one type (mixing bool and float makes torch
    warn, and ``warnings.warn`` is a graph break for stock as much as for slim)."""
    for bias, bias_kv, zero_attn, dims, batch_first, batched, need_weights, causal, padding in itertools.product(
        *[(False, True)] * 9
    ):
        if (causal and need_weights) or (padding and not batched):
            continue
        yield bias, bias_kv, zero_attn, dims, batch_first, batched, need_weights, causal, padding


@pytest.mark.slow
def test_slim_compiles_without_graph_breaks_in_every_structure():
    failures = []
    for bias, bias_kv, zero_attn, dims, batch_first, batched, need_weights, causal, padding in structure_cases():
        kwargs = dict(bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, batch_first=batch_first)
        if dims:
            kwargs.update(kdim=10, vdim=12)
        slim = SlimMultiheadAttention(E, H, **kwargs)
        shape = ((BATCH, LENGTH) if batch_first else (LENGTH, BATCH)) if batched else (LENGTH,)
        query = torch.randn(*shape, E)
        key, value = (torch.randn(*shape, 10), torch.randn(*shape, 12)) if dims else (query, query)
        call = {"need_weights": need_weights}
        if causal:
            call.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(LENGTH), is_causal=True)
        if padding:
            mask = padding_mask()
            call["key_padding_mask"] = torch.zeros(mask.shape).masked_fill(mask, float("-inf")) if causal else mask
        torch._dynamo.reset()
        try:
            compiled = torch.compile(slim, fullgraph=True, backend="eager")(query, key, value, **call)[0]
        except Exception as error:
            failures.append(f"{kwargs} {call.keys()}: {str(error)[:200]}")
            continue
        expected = slim(query, key, value, **call)[0]
        if not torch.allclose(compiled, expected, atol=1e-5, rtol=1e-5):
            failures.append(f"{kwargs} {call.keys()}: compiled output differs")
    assert not failures, "\n".join(failures[:5])


# ------------------------------------------------------------------------------ torch.export


@pytest.mark.parametrize("strict", (False, True), ids=("non_strict", "strict"))
@pytest.mark.parametrize("need_weights", (True, False))
def test_slim_exports(need_weights, strict):
    _, slim = stock_and_slim_attention()
    x, mask = sequence(), padding_mask()
    kwargs = {"key_padding_mask": mask, "need_weights": need_weights}
    program = torch.export.export(slim, (x, x, x), kwargs, strict=strict)
    (out, weights), (ref_out, ref_weights) = program.module()(x, x, x, **kwargs), slim(x, x, x, **kwargs)
    assert_close_scaled(out, ref_out)
    if need_weights:
        assert_close_scaled(weights, ref_weights, "attention weights")
    else:
        assert weights is None and ref_weights is None


def test_patched_encoder_exports():
    _, encoder = stock_and_patched_encoder()
    x, mask = sequence(), padding_mask()
    program = torch.export.export(encoder.eval(), (x,), {"src_key_padding_mask": mask})
    assert_close_scaled(program.module()(x, src_key_padding_mask=mask), encoder(x, src_key_padding_mask=mask))


# ------------------------------------------------------------------------------ autocast


def assert_autocast_like_stock(stock_out: torch.Tensor, slim_out: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """Same dtype as stock; no further from the fp32 result than twice stock's rounding error, plus tol.

    Two correct bf16 computations differ by their rounding, so slim is measured against the fp32
    run rather than against stock's bf16 output.
    """
    __tracebackhide__ = True
    assert slim_out.dtype == stock_out.dtype, f"{what}: dtype {slim_out.dtype} != stock's {stock_out.dtype}"
    stock_error = (stock_out.double() - exact.double()).abs().max().item()
    slim_error = (slim_out.double() - exact.double()).abs().max().item()
    bound = 2 * stock_error + TOLERANCE[torch.bfloat16] * max(1.0, exact.abs().max().item())
    assert slim_error <= bound, f"{what}: error {slim_error:.3e} vs fp32 > {bound:.3e} (stock's: {stock_error:.3e})"


@pytest.mark.parametrize("need_weights", (True, False))
def test_slim_autocast_bf16_behaves_as_stock(need_weights):
    stock, slim = stock_and_slim_attention(add_bias_kv=True)
    x, mask = sequence(), padding_mask()
    call = dict(key_padding_mask=mask, need_weights=need_weights)
    exact_out, exact_weights = stock(x, x, x, **call)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock_out, stock_weights = stock(x, x, x, **call)
        slim_out, slim_weights = slim(x, x, x, **call)
    assert_autocast_like_stock(stock_out, slim_out, exact_out, "output")
    if need_weights:
        assert_autocast_like_stock(stock_weights, slim_weights, exact_weights, "attention weights")
    else:
        assert slim_weights is None and stock_weights is None


def outcome(call):
    """The tensor ``call()`` returns, or the type and message of what it raised."""
    try:
        return call()
    except Exception as error:
        return (type(error), str(error))


@pytest.mark.parametrize(
    "mode, grad", [("train", True), ("eval", True), ("eval", False)], ids=("train", "eval", "eval_no_grad")
)
def test_patched_encoder_autocast_bf16_behaves_as_stock(mode, grad):
    """Including failure: in eval without grad, torch's native encoder fast path does not see CPU
    autocast (it checks ``torch.is_autocast_enabled()``, the CUDA flag) and stock raises
    "expected scalar type Float but found BFloat16" (pytorch/pytorch#107663, #132613). Slim must
    then raise the same error, and give stock's result where stock gives one.
    """
    stock, slim = stock_and_patched_encoder()
    stock.train(mode == "train"), slim.train(mode == "train")
    x, mask = sequence(), padding_mask()
    with torch.set_grad_enabled(grad):
        exact = stock(x, src_key_padding_mask=mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = outcome(lambda: stock(x, src_key_padding_mask=mask))
            actual = outcome(lambda: slim(x, src_key_padding_mask=mask))
    if isinstance(expected, tuple):
        assert actual == expected, f"stock raised {expected}, slim gave {actual}"
    else:
        assert torch.is_tensor(actual), f"stock ran, slim raised {actual}"
        assert_autocast_like_stock(expected, actual, exact, "encoder output")
