"""torch's TransformerEncoder/Decoder/Transformer built while patched, against stock, in fp32.

Each test builds the stock model with random parameters, saves its state dict, builds the same
architecture under ``patched()`` and loads the stock checkpoint with ``strict=True``.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from slim_mha import patched, to_stock
from slim_mha.patching import PatchedMultiheadAttention

from _reference import STOCK_MHA, assert_close_scaled, randomize_parameters

E, H, FF = 16, 4, 32
BATCH, SRC, TGT = 3, 7, 5
KINDS = ("encoder", "decoder", "transformer")

pytestmark = [
    # nn.Transformer cannot pass enable_nested_tensor=False; torch explains why it is off.
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype:UserWarning"),
]


def build(kind: str, batch_first: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind == "encoder":
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=batch_first)
        return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=batch_first)
    if kind == "decoder":
        layer = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=batch_first)
        return nn.TransformerDecoder(layer, num_layers=2)
    return nn.Transformer(E, H, 2, 2, FF, dropout=0.0, batch_first=batch_first)


def stock_and_patched(kind: str, batch_first: bool = True) -> tuple[nn.Module, nn.Module]:
    """Stock with random parameters, and the patched build loaded from its saved checkpoint."""
    stock = randomize_parameters(build(kind, batch_first))
    buffer = io.BytesIO()
    torch.save(stock.state_dict(), buffer)
    buffer.seek(0)
    with patched():
        slim = build(kind, batch_first)
    slim.load_state_dict(torch.load(buffer), strict=True)
    attention = [m for m in slim.modules() if isinstance(m, STOCK_MHA)]
    assert attention and all(type(m) is PatchedMultiheadAttention for m in attention)
    return stock, slim


def inputs(kind: str, batch_first: bool, causal: bool, padding: bool) -> dict:
    """Keyword arguments for the model's forward; padding masks are left-aligned (trailing pads)."""
    generator = torch.Generator().manual_seed(1)

    def sequence(length):
        shape = (BATCH, length, E) if batch_first else (length, BATCH, E)
        return torch.randn(*shape, generator=generator)

    def padding_mask(length):
        lengths = torch.tensor([length, length - 2, length - 3])
        padded = torch.arange(length)[None, :] >= lengths[:, None]
        # Same mask type as the float causal mask: torch warns about mixing bool and float masks.
        return torch.zeros(padded.shape).masked_fill(padded, float("-inf")) if causal else padded

    causal_mask = nn.Transformer.generate_square_subsequent_mask
    if kind == "encoder":
        call = {"src": sequence(SRC)}
        if causal:
            call.update(mask=causal_mask(SRC), is_causal=True)
        if padding:
            call["src_key_padding_mask"] = padding_mask(SRC)
        return call
    call = {"tgt": sequence(TGT)}
    call["memory" if kind == "decoder" else "src"] = sequence(SRC)
    if causal:
        call.update(tgt_mask=causal_mask(TGT), tgt_is_causal=True)
    if padding:
        call["memory_key_padding_mask"] = padding_mask(SRC)
        call["tgt_key_padding_mask"] = padding_mask(TGT)
        if kind == "transformer":
            call["src_key_padding_mask"] = padding_mask(SRC)
    return call


def _as_leaf(value):
    is_sequence = torch.is_tensor(value) and value.is_floating_point() and value.dim() == 3
    return value.clone().requires_grad_() if is_sequence else value


def run_with_grads(model: nn.Module, call: dict) -> dict:
    """Output, and gradients of a fixed projection of it w.r.t. the inputs and shared-name weights."""
    call = {k: _as_leaf(v) for k, v in call.items()}
    output = model(**call)
    cotangent = torch.randn(output.shape, generator=torch.Generator().manual_seed(2))
    watched_names = ("in_proj_weight", "out_proj.bias", "linear1.weight")
    watched = {n: p for n, p in model.named_parameters() if n.endswith(watched_names)}
    leaves = {k: v for k, v in call.items() if torch.is_tensor(v) and v.requires_grad}
    grads = torch.autograd.grad((output * cotangent).sum(), [*leaves.values(), *watched.values()])
    result = {"output": output.detach()}
    result.update({f"grad {name}": grad for name, grad in zip([*leaves, *watched], grads, strict=True)})
    return result


@pytest.mark.parametrize("batch_first", (True, False))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("kind", KINDS)
def test_train_mode_matches_stock(kind, causal, batch_first):
    stock, slim = stock_and_patched(kind, batch_first)
    call = inputs(kind, batch_first, causal=causal, padding=True)
    expected, actual = run_with_grads(stock.train(), call), run_with_grads(slim.train(), call)
    assert set(actual) == set(expected)
    for name in expected:
        assert_close_scaled(actual[name], expected[name], f"{kind} {name}")


@pytest.mark.parametrize("grad_mode", ("no_grad", "grad"), ids=("native_fast_path", "python_path"))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("kind", KINDS)
def test_eval_matches_stock(kind, causal, grad_mode):
    """``no_grad`` lets the encoder layers take torch's native fast path, which reads in_proj_bias."""
    stock, slim = stock_and_patched(kind)
    call = inputs(kind, batch_first=True, causal=causal, padding=False)
    with torch.set_grad_enabled(grad_mode == "grad"):
        assert_close_scaled(slim.eval()(**call), stock.eval()(**call), f"{kind} eval output")


def test_encoder_nested_tensor_fast_path_matches_stock():
    """With a padding mask in inference, the encoder packs the batch into a nested tensor.

    That path returns exact zeros at padded positions (``to_padded_tensor(0.)``) where the Python
    path returns values, which proves it was taken by both models.
    """
    stock, slim = stock_and_patched("encoder")
    assert slim.use_nested_tensor
    call = inputs("encoder", batch_first=True, causal=False, padding=True)
    padded = call["src_key_padding_mask"]
    with torch.inference_mode():
        expected, actual = stock.eval()(**call), slim.eval()(**call)
    for output in (expected, actual):
        assert torch.all(output[padded] == 0), "the nested-tensor fast path was not taken"
    assert_close_scaled(actual, expected, "nested fast path output")


def test_patched_state_dicts_load_into_stock_after_to_stock():
    stock, slim = stock_and_patched("transformer")
    call = inputs("transformer", batch_first=True, causal=True, padding=True)
    fresh_stock = build("transformer", batch_first=True)
    fresh_stock.load_state_dict(slim.state_dict(), strict=True)  # stock's keys: no lock-in
    with torch.no_grad():
        assert_close_scaled(fresh_stock.eval()(**call), stock.eval()(**call), "stock loading slim's state")
    fresh_stock.load_state_dict(to_stock(slim).state_dict(), strict=True)
    with torch.no_grad():
        assert_close_scaled(fresh_stock.eval()(**call), stock.eval()(**call), "reloaded stock output")
