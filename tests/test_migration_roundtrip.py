"""The issue's round trip on a real nn.Transformer checkpoint.

stock -> fold -> a patched (slim) model loads it with strict=True and gives the same outputs ->
to-stock -> stock loads it with strict=True and gives the same outputs.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import slim_mha
from slim_mha.migration import fold_checkpoint, inspect_checkpoint
from slim_mha.migration._torch_pickles import torch_reads_pickles_safely

from _migration_checkpoints import load_sharded, randomize, save_sharded
from _migration_helpers import private_ledger  # noqa: F401 (autouse)
from _reference import assert_close_scaled

pytestmark = pytest.mark.filterwarnings(
    "ignore:enable_nested_tensor is True", "ignore:The PyTorch API of nested tensors"
)
DIMS = dict(d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, dropout=0.0)


def build(batch_first: bool) -> nn.Transformer:
    return nn.Transformer(**DIMS, batch_first=batch_first)


def run(model: nn.Transformer, batch_first: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    source = torch.randn(2, 6, 16, generator=generator)  # (B, S, E)
    target = torch.randn(2, 5, 16, generator=generator)  # (B, T, E)
    if not batch_first:
        source, target = source.transpose(0, 1), target.transpose(0, 1)  # (S, B, E), (T, B, E)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        return model.eval()(
            source, target, tgt_mask=causal, src_key_padding_mask=padding, memory_key_padding_mask=padding
        )


def save(tensors: dict, tmp_path, layout: str):
    if layout == "safetensors":
        save_file(tensors, tmp_path / "stock.safetensors")
        return tmp_path / "stock.safetensors", tmp_path / "slim.safetensors", None
    if layout == "sharded":
        keys = list(tensors)
        thirds = [keys[: len(keys) // 3], keys[len(keys) // 3 : 2 * len(keys) // 3], keys[2 * len(keys) // 3 :]]
        return save_sharded(tensors, tmp_path / "stock", thirds), tmp_path / "slim", tmp_path / "back"
    torch.save({"model": tensors, "step": 1000}, tmp_path / "stock.pt")
    return tmp_path / "stock.pt", tmp_path / "slim.safetensors", tmp_path / "back.safetensors"


def load(path) -> dict:
    return load_sharded(path) if path.is_dir() else load_file(path)


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("layout", ["safetensors", "sharded", "torch"])
def test_transformer_round_trip(tmp_path, layout, batch_first):
    if layout == "torch" and not torch_reads_pickles_safely():
        pytest.skip("pickle-based inputs need a torch release >= 2.10.0")
    stock = randomize(build(batch_first), seed=0).eval()
    expected = run(stock, batch_first)
    tensors = {key: value.detach().clone().contiguous() for key, value in stock.state_dict().items()}
    source, slim_path, back_path = save(tensors, tmp_path, layout)

    report = fold_checkpoint(source, slim_path, verify=True)
    assert len(report.modules) == 6 and len(report.changed) == 6  # 2 encoder + 2x2 decoder attentions
    folded = load(slim_path)
    assert folded.keys() == tensors.keys()  # stock's layout

    with slim_mha.patched():
        patched = build(batch_first)
    assert all(
        isinstance(m, slim_mha.SlimMultiheadAttention)
        for m in patched.modules()
        if isinstance(m, nn.MultiheadAttention)
    )
    patched.load_state_dict(folded, strict=True)
    assert_close_scaled(run(patched, batch_first), expected, "slim model loading fold's output")

    restored = build(batch_first)
    restored.load_state_dict(folded, strict=True)
    assert_close_scaled(run(restored, batch_first), expected, "stock model loading fold's output")
    assert all(module.layout == "stock" for module in inspect_checkpoint(slim_path).modules)
