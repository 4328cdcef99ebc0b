"""Checkpoints for the migration tests, built from real modules with every parameter random.

Default initialisation zeroes the input biases, and a zero key bias would let a wrong fold pass, so
every tensor is overwritten with seeded noise.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from slim_mha._torch_compat import (
    STOCK_MHA,  # stock even while slim_mha.patched() is active
)
from slim_mha.bias import fold_key_bias

from _reference import randomize_parameters as randomize


def stock_attention(
    embed_dim: int = 8,
    *,
    bias: bool = True,
    add_bias_kv: bool = False,
    add_zero_attn: bool = False,
    kdim: int | None = None,
    vdim: int | None = None,
    seed: int = 0,
    num_heads: int = 2,
) -> nn.MultiheadAttention:
    module = STOCK_MHA(
        embed_dim, num_heads, bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim
    )
    return randomize(module, seed).eval()


def prefixed(module: nn.Module, prefix: str, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    return {
        prefix + key: (value if dtype is None else value.to(dtype)).detach().clone().contiguous()
        for key, value in module.state_dict().items()
    }


def key_bias_free(module: nn.Module, prefix: str, *, add_zero_attn: bool = False) -> dict[str, Tensor]:
    """The module's state in the key-bias-free layout (format v1: q_proj_bias, v_proj_bias, and
    k_proj_bias for add_zero_attn), as an earlier strip or fold wrote it."""
    state = {key: value.detach().clone() for key, value in module.state_dict().items()}
    biases = fold_key_bias(state.pop("in_proj_bias"), state.pop("bias_k", None), add_zero_attn=add_zero_attn)
    state.update({key: value for key, value in biases._asdict().items() if value is not None})
    return {prefix + key: value.contiguous() for key, value in state.items()}


def save_sharded(tensors: dict[str, Tensor], directory: Path, shards: list[list[str]], metadata=None) -> Path:
    """Write ``shards`` (lists of keys) as an HF-style sharded checkpoint; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for number, keys in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file({key: tensors[key] for key in keys}, directory / name, metadata=metadata)
        weight_map.update({key: name for key in keys})
    assert set(weight_map) == set(tensors), "every tensor must be in exactly one shard"
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    ours = {key: value for key, value in (metadata or {}).items() if key.startswith("slim_mha.")}  # an output's
    index = {"metadata": {"total_size": total, "origin": "tests", **ours}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


def load_sharded(directory: Path) -> dict[str, Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(directory / name))
    return tensors


def tree_digest(path: Path) -> dict[str, str]:
    """File name -> sha256 of every file under ``path`` (or of ``path`` itself), to prove it unchanged."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(file): hashlib.sha256(file.read_bytes()).hexdigest() for file in files}


def module_state(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {key[len(prefix) :]: value for key, value in tensors.items() if key.startswith(prefix)}


def attention_inputs(embed_dim: int, kdim: int | None = None, vdim: int | None = None, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(4, 3, embed_dim, generator=generator)  # (L, B, E)
    key = torch.randn(6, 3, kdim or embed_dim, generator=generator)  # (S, B, kdim)
    value = torch.randn(6, 3, vdim or embed_dim, generator=generator)  # (S, B, vdim)
    return query, key, value
