"""Hugging Face transformers under ``slim_mha.patched()``: loading, initialising and saving.

Tiny ``SiglipVisionModel`` instances (their pooling head is an ``nn.MultiheadAttention``) are built
from a config, saved to ``tmp_path`` and loaded from there; nothing is downloaded. Every loaded
model is compared with the stock model the checkpoint came from.
"""

from __future__ import annotations

import pytest
import torch

import slim_mha
from slim_mha import SlimMultiheadAttention
from slim_mha.migration.cli import main as migrate
from tests._reference import assert_close_scaled

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
if not transformers.utils.is_torch_available():  # transformers 5 disables its models on torch < 2.6
    pytest.skip(
        f"transformers {transformers.__version__} has no PyTorch models on torch {torch.__version__}",
        allow_module_level=True,
    )


@pytest.fixture(autouse=True)
def _quiet_transformers():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def tiny_config():
    return transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
        vision_use_head=True,
    )


@pytest.fixture
def stock_checkpoint(tmp_path):
    """A stock model with every parameter random (so every bias matters), saved with save_pretrained."""
    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(tiny_config()).eval()
    assert type(model.head.attention) is slim_mha._torch_compat.STOCK_MHA
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "stock")
    return model, tmp_path / "stock"


def pooled(model, seed=1):
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(pixel_values=pixels).pooler_output


def migrated(source, target, command="fold"):
    assert migrate([command, str(source), str(target)]) == 0
    return target


def assert_biases_loaded(attention, stock_attention):
    """Query and value biases as in the stock model; the key slot as stock's or zeroed by ``fold``."""
    __tracebackhide__ = True
    loaded, original = attention.in_proj_bias.detach(), stock_attention.in_proj_bias.detach()
    assert torch.equal(loaded[:32], original[:32]) and torch.equal(loaded[64:], original[64:])
    assert torch.equal(loaded[32:64], original[32:64]) or not loaded[32:64].any()


def test_a_stock_checkpoint_loads_exactly_under_patch(stock_checkpoint):
    stock, path = stock_checkpoint
    with slim_mha.patched():
        model = transformers.SiglipVisionModel.from_pretrained(path).eval()
    attention = model.head.attention
    assert isinstance(attention, SlimMultiheadAttention)
    assert type(attention.in_proj_bias) is torch.nn.Parameter
    assert torch.equal(attention.in_proj_bias.detach(), stock.head.attention.in_proj_bias.detach())
    assert_close_scaled(pooled(model), pooled(stock), "stock checkpoint under patch")


def test_a_folded_checkpoint_loads_exactly_under_patch_and_unpatched(stock_checkpoint, tmp_path):
    stock, path = stock_checkpoint
    slim_path = migrated(path, tmp_path / "slim")
    with slim_mha.patched():
        model = transformers.SiglipVisionModel.from_pretrained(slim_path).eval()
    attention = model.head.attention
    assert isinstance(attention, SlimMultiheadAttention)
    # The loader's init pass must not have re-initialised anything (it guards torch.nn.init calls).
    assert_biases_loaded(attention, stock.head.attention)
    assert torch.equal(attention.in_proj_weight.detach(), stock.head.attention.in_proj_weight.detach())
    assert_close_scaled(pooled(model), pooled(stock), "folded checkpoint under patch")
    unpatched = transformers.SiglipVisionModel.from_pretrained(slim_path).eval()
    assert type(unpatched.head.attention) is slim_mha._torch_compat.STOCK_MHA
    assert_close_scaled(pooled(unpatched), pooled(stock), "folded checkpoint, stock reader")


def test_a_stock_checkpoint_loads_unpatched_then_converts(stock_checkpoint):
    stock, path = stock_checkpoint
    model = slim_mha.convert(transformers.SiglipVisionModel.from_pretrained(path).eval())
    assert isinstance(model.head.attention, SlimMultiheadAttention)
    assert_close_scaled(pooled(model), pooled(stock), "loaded then converted")


def test_the_init_pass_skips_loaded_biases_written_through_in_proj_bias(stock_checkpoint, tmp_path):
    """Without ``head.probe`` the loader initialises the pooling head, whose init writes
    ``nn.init.zeros_(attention.in_proj_bias)``: loaded biases must survive it, as stock's do."""
    stock, path = stock_checkpoint
    slim_path = migrated(path, tmp_path / "slim")
    tensors = safetensors_torch.load_file(slim_path / "model.safetensors")
    del tensors["head.probe"]
    safetensors_torch.save_file(tensors, slim_path / "model.safetensors", metadata={"format": "pt"})
    with slim_mha.patched():
        model = transformers.SiglipVisionModel.from_pretrained(slim_path).eval()
    assert_biases_loaded(model.head.attention, stock.head.attention)


def test_a_fresh_model_under_patch_initialises_as_stock():
    with slim_mha.patched():
        torch.manual_seed(3)
        model = transformers.SiglipVisionModel(tiny_config()).eval()
    torch.manual_seed(3)
    stock = transformers.SiglipVisionModel(tiny_config()).eval()
    assert isinstance(model.head.attention, SlimMultiheadAttention)
    assert torch.equal(model.head.attention.in_proj_bias.detach(), torch.zeros(96))
    assert_close_scaled(pooled(model), pooled(stock), "fresh model")


def test_save_pretrained_under_patch_is_read_by_slim_and_stock_readers(stock_checkpoint, tmp_path):
    stock, path = stock_checkpoint
    with slim_mha.patched():
        model = transformers.SiglipVisionModel.from_pretrained(migrated(path, tmp_path / "slim")).eval()
        model.save_pretrained(tmp_path / "saved_slim")  # stock's layout
        reloaded = transformers.SiglipVisionModel.from_pretrained(tmp_path / "saved_slim").eval()
    assert_close_scaled(pooled(reloaded), pooled(stock), "slim save, slim load")
    for_stock = transformers.SiglipVisionModel.from_pretrained(tmp_path / "saved_slim").eval()  # no lock-in
    assert type(for_stock.head.attention) is slim_mha._torch_compat.STOCK_MHA
    assert_close_scaled(pooled(for_stock), pooled(stock), "slim save, stock load")
