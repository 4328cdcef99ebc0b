"""What autograd saves for backward in whole models: slim's total is at most stock's.

A single call can look lean and still cost memory in a model: a tensor slim keeps beside one it
shares with its neighbours (the block's input, SDPA's output) is a storage stock does not keep. So
the count is taken as a model sees it: unique storages saved under ``saved_tensors_hooks`` over a
stack of blocks (attention, residual, LayerNorm, MLP) and over ``nn.TransformerEncoder``, parameters
and the model's input left out.
"""

import copy
import itertools

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA
from slim_mha.bench.measure.memory import saved_tensor_bytes


def saved_bytes(model: nn.Module, *inputs: torch.Tensor | None, **kwargs) -> int:
    """Bytes of the unique storages autograd saves in one training step, parameters and inputs left out."""
    tensors = [x for x in (*inputs, *kwargs.values()) if isinstance(x, torch.Tensor)]
    return saved_tensor_bytes(
        lambda: model(*inputs, **kwargs).float().sum().backward(), list(model.parameters()) + tensors
    )


class Block(nn.Module):
    """A set-transformer block: attention, residual, LayerNorm, MLP."""

    def __init__(
        self, width: int, heads: int, *, batch_first: bool, cross: bool, weights: bool, dropout: float
    ) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=batch_first)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.cross, self.weights = cross, weights

    def forward(self, x: torch.Tensor, memory: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        source = memory if self.cross else x
        out, weights = self.attention(x, source, source, key_padding_mask=padding, need_weights=self.weights)
        x = x + out + (0.0 if weights is None else weights.mean() * 0.0)
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self, depth: int, **kwargs) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(64, 4, **kwargs) for _ in range(depth))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, memory, padding)
        return x


def stock_and_slim(build) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    stock = build()
    slim = slim_mha.convert(copy.deepcopy(stock))
    assert any(isinstance(m, slim_mha.SlimMultiheadAttention) for m in slim.modules())
    return stock, slim


def compare(stock: nn.Module, slim: nn.Module, *inputs, **kwargs) -> tuple[int, int]:
    """Stock's bytes, and slim's less its one constant: the cached bool mask ``3E`` long that zeroes
    the key slot of the bias (``slim_mha.bias``), one storage for every module of that width, which
    grows with neither batch, length nor depth."""
    torch.manual_seed(1)
    expected = saved_bytes(stock, *inputs, **kwargs)
    torch.manual_seed(1)
    actual = saved_bytes(slim, *inputs, **kwargs)
    widths = {m.embed_dim for m in slim.modules() if isinstance(m, slim_mha.SlimMultiheadAttention)}
    return expected, actual - sum(3 * width for width in widths)


def test_four_stacked_blocks_save_no_more_than_stock():
    """The reported case: 4 blocks at 4x1024x64, fp32, batch-first self-attention without weights."""
    stock, slim = stock_and_slim(lambda: Stack(4, batch_first=True, cross=False, weights=False, dropout=0.0))
    x = torch.randn(4, 1024, 64, requires_grad=True)
    expected, actual = compare(stock, slim, x, x)
    assert actual <= expected, f"slim saves {actual / 2**20:.2f} MiB, stock {expected / 2**20:.2f} MiB"


CONFIGS = list(
    itertools.product(
        (torch.float32, torch.bfloat16),
        (True, False),
        ("self", "cross"),
        (False, True),
        ("none", "padding"),
        (0.0, 0.1),
    )
)


@pytest.mark.parametrize("dtype,batch_first,kind,weights,mask,dropout", CONFIGS)
def test_stacked_blocks_save_no_more_than_stock_in_every_configuration(
    dtype, batch_first, kind, weights, mask, dropout
):
    stock, slim = stock_and_slim(
        lambda: Stack(2, batch_first=batch_first, cross=kind == "cross", weights=weights, dropout=dropout).to(dtype)
    )
    batch, length = 2, 128
    shape = (batch, length, 64) if batch_first else (length, batch, 64)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    memory = torch.randn((batch, 96, 64) if batch_first else (96, batch, 64), dtype=dtype) if kind == "cross" else x
    source = memory.shape[1] if batch_first else memory.shape[0]
    padding = None
    if mask == "padding":
        padding = torch.zeros(batch, source, dtype=torch.bool)
        padding[1, source // 2 :] = True
    expected, actual = compare(stock, slim, x, memory, padding)
    assert actual <= expected, f"slim saves {actual} bytes, stock {expected}"


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_six_layer_encoder_with_padding_and_dropout_saves_no_more_than_stock(norm_first):
    def build() -> nn.Module:
        layer = STOCK_ENCODER_LAYER(64, 4, 128, dropout=0.1, batch_first=True, norm_first=norm_first)
        return nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)

    stock, slim = stock_and_slim(build)
    assert all(type(m.self_attn) is not STOCK_MHA for m in slim.layers)
    x = torch.randn(4, 256, 64, requires_grad=True)
    padding = torch.zeros(4, 256, dtype=torch.bool)
    padding[1, 200:] = True
    padding[3, 100:] = True
    expected, actual = compare(stock, slim, x, src_key_padding_mask=padding)
    assert actual <= expected, f"slim saves {actual / 2**20:.2f} MiB, stock {expected / 2**20:.2f} MiB"


def test_a_small_torchvision_vit_saves_no_more_than_stock():
    models = pytest.importorskip("torchvision.models")
    stock, slim = stock_and_slim(
        lambda: models.VisionTransformer(
            image_size=32, patch_size=4, num_layers=6, num_heads=4, hidden_dim=128, mlp_dim=256
        )
    )
    images = torch.randn(2, 3, 32, 32, requires_grad=True)
    expected, actual = compare(stock, slim, images)
    assert actual <= expected


def test_the_count_sees_a_kept_copy():
    """The measure is not vacuous: a block that keeps one more (B, L, E) copy counts it."""

    class Copying(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x, memory, padding=None):
            return self.inner(x, memory, padding) + x.exp()  # exp saves its output: one (B, L, E) more

    stock, _ = stock_and_slim(lambda: Stack(1, batch_first=True, cross=False, weights=False, dropout=0.0))
    x = torch.randn(2, 64, 64, requires_grad=True)
    base = saved_bytes(stock, x, x)
    assert saved_bytes(Copying(stock), x, x) > base
