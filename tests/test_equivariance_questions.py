"""The questions users ask about attention and permutations, answered by the checker.

* Is multi-head attention permutation-equivariant? Yes, stock and slim; it is not invariant.
* Why does ``torch.equal`` say it is not? Reordered floating-point sums differ in the last bits.
* Why does my Linformer-style set model break? Its learned projection along the sequence axis
  mixes tokens by position; the checker names that projection. With full attention it passes.
* Is attention pooling with learned queries invariant? Yes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha import (
    EquivarianceError,
    SlimMultiheadAttention,
    assert_permutation_equivariant,
    assert_permutation_invariant,
)

E, H, N = 16, 4, 11  # embedding, heads, tokens (a set of N points)
ATTENTION_CLASSES = {"stock": nn.MultiheadAttention, "slim": SlimMultiheadAttention}


def points(batch: int = 3, tokens: int = N, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, tokens, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def self_attention(module: nn.MultiheadAttention):
    def attend(x: torch.Tensor) -> torch.Tensor:
        return module(x, x, x, need_weights=False)[0]

    return attend


# ----------------------------------------------------------------- equivariant, not invariant


@pytest.mark.parametrize("kind", ATTENTION_CLASSES)
def test_attention_is_equivariant(kind):
    torch.manual_seed(0)
    attention = ATTENTION_CLASSES[kind](E, H, batch_first=True)
    result = assert_permutation_equivariant(self_attention(attention), points(), dim=1, module=attention)
    assert result.passed() and result.max_rel < 1e-5


@pytest.mark.parametrize("kind", ATTENTION_CLASSES)
def test_attention_with_weights_is_equivariant_on_both_weight_axes(kind):
    # Self-attention weights (B, L, L): rows follow the queries, columns the keys.
    torch.manual_seed(0)
    attention = ATTENTION_CLASSES[kind](E, H, batch_first=True)
    x = points()
    assert_permutation_equivariant(lambda x: attention(x, x, x), x, dim=1, output_dim=(1, (1, 2)), module=attention)


@pytest.mark.parametrize("kind", ATTENTION_CLASSES)
def test_attention_is_not_invariant_and_the_error_says_it_is_equivariant(kind):
    torch.manual_seed(0)
    attention = ATTENTION_CLASSES[kind](E, H, batch_first=True)
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_invariant(self_attention(attention), points(), dim=1, module=attention)
    message = str(caught.value)
    assert "is not permutation-invariant: 1 of 1 outputs broke" in message
    assert "expected unchanged: BROKEN" in message
    assert "it is permuted along dim 1 instead" in message
    assert "the function is consistent, just not in the way output_dim asked" in message


@pytest.mark.parametrize("kind", ATTENTION_CLASSES)
def test_keys_and_values_are_invariant_for_fixed_queries(kind):
    torch.manual_seed(0)
    attention = ATTENTION_CLASSES[kind](E, H, batch_first=True)
    queries, memory = points(tokens=5, seed=1), points(seed=2)
    assert_permutation_invariant(
        lambda q, kv: attention(q, kv, kv, need_weights=False)[0], queries, memory, dim=(None, 1), module=attention
    )


def test_torch_equal_is_the_wrong_test():
    """Bit-exact comparison fails on a correct layer; the tolerance-based checker passes."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(64, 4, batch_first=True).eval()
    bit_exact = []
    for seed in range(5):
        x = torch.randn(4, 96, 64, generator=torch.Generator().manual_seed(seed))
        permutation = slim_mha.equivariance._measure.draw_permutation(96, seed)  # sample 0's
        with torch.no_grad():
            moved_after = attention(x, x, x)[0][:, permutation]
            moved_before = attention(x[:, permutation], x[:, permutation], x[:, permutation])[0]
        bit_exact.append(torch.equal(moved_before, moved_after))
        result = assert_permutation_equivariant(self_attention(attention), x, dim=1, seed=seed, module=attention)
        assert torch.equal(result.permutation[0], permutation)
    assert not all(bit_exact), "every comparison was bit-exact: this platform sums in a fixed order"


# ------------------------------------------------------------------------ a Linformer-style set model


class SequenceProjection(nn.Module):
    """Linformer's E: a learned (k, n) matrix mixing the n tokens by position into k summaries."""

    def __init__(self, tokens: int, summaries: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(summaries, tokens) / math.sqrt(tokens))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, n, D) -> (B, k, D)
        return torch.einsum("kn,bnd->bkd", self.weight, x)


class LinformerAttention(nn.Module):
    """Single-head attention whose keys and values are first projected along the sequence axis."""

    def __init__(self, dim: int, tokens: int, summaries: int) -> None:
        super().__init__()
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.project_keys = SequenceProjection(tokens, summaries)
        self.project_values = SequenceProjection(tokens, summaries)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, n, D)
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        k, v = self.project_keys(k), self.project_values(v)  # (B, k, D)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # (B, n, k)
        return self.to_out(scores.softmax(dim=-1) @ v)


class FullAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention = SlimMultiheadAttention(dim, heads, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class PointCloudEncoder(nn.Module):
    """embed -> attention -> residual MLP: a typical set/point-cloud block."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Linear(3, E)
        self.attention = attention
        self.mlp = nn.Sequential(nn.LayerNorm(E), nn.Linear(E, 2 * E), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * E, E))

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:  # (B, n, 3) -> (B, n, E)
        h = self.embed(xyz)
        h = h + self.attention(h)
        return h + self.mlp(h)


def point_cloud(tokens: int = N) -> torch.Tensor:
    return torch.randn(2, tokens, 3, generator=torch.Generator().manual_seed(3))


def test_linformer_breaks_equivariance_and_the_error_names_its_sequence_projection():
    torch.manual_seed(0)
    model = PointCloudEncoder(LinformerAttention(E, tokens=N, summaries=4))
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(model, point_cloud(), dim=1)
    error = caught.value
    assert error.module_name == "attention.project_keys"
    message = str(error)
    assert "PointCloudEncoder is not permutation-equivariant" in message
    assert "'attention.project_keys' (SequenceProjection, call 1)" in message
    assert "after 2 submodule calls that kept it" in message  # embed, attention.to_qkv
    assert "closest reading 'unchanged'" in message


def test_the_same_model_with_full_attention_passes_in_train_mode():
    torch.manual_seed(0)
    model = PointCloudEncoder(FullAttention(E, H)).train()
    assert_permutation_equivariant(model, point_cloud(), dim=1)
    assert all(module.training for module in model.modules())  # dropout was off for the check only


# ------------------------------------------------------------------------ attention pooling


class AttentionPooling(nn.Module):
    """Learned queries attend over the set: a fixed-size summary, whatever the order of the set."""

    def __init__(self, dim: int, heads: int, queries: int, attention_class=SlimMultiheadAttention) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(queries, dim))
        self.attention = attention_class(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, n, D) -> (B, m, D)
        queries = self.queries.expand(x.shape[0], -1, -1)
        return self.attention(queries, x, x, need_weights=False)[0]


@pytest.mark.parametrize("kind", ATTENTION_CLASSES)
def test_cross_attention_pooling_is_invariant(kind):
    torch.manual_seed(0)
    pooling = AttentionPooling(E, H, queries=3, attention_class=ATTENTION_CLASSES[kind])
    result = assert_permutation_invariant(pooling, points(), dim=1)
    assert result.invariant


def test_a_pooled_output_has_no_token_axis_to_be_equivariant_along():
    torch.manual_seed(0)
    pooling = AttentionPooling(E, H, queries=3)
    expected = r"output has shape \(3, 3, 16\): dim 1 has 3 entries but the inputs have 11 tokens"
    with pytest.raises(ValueError, match=expected):
        assert_permutation_equivariant(pooling, points(), dim=1)


def test_a_set_classifier_with_linformer_is_not_invariant_and_the_projection_is_named():
    # Pooling after a broken block does not repair it: the check still finds the projection first.
    torch.manual_seed(0)
    encoder = PointCloudEncoder(LinformerAttention(E, tokens=N, summaries=4))
    model = nn.Sequential(encoder, AttentionPooling(E, H, queries=2))
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_invariant(model, point_cloud(), dim=1)
    assert caught.value.module_name == "0.attention.project_keys"
