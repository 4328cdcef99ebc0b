"""The equivariance checks at their edges: no silent pass, no false alarm from rounding or labels,
blame that names the input, and graph batches permuted within each graph."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha import (
    EquivarianceError,
    assert_permutation_equivariant,
    checking_equivariance,
)

B, N, D = 2, 6, 8


class Positional(nn.Module):
    """Adds a learned position table: not equivariant, wherever its tensors come in or go out."""

    def __init__(self, wrap_output=None):
        super().__init__()
        self.position = nn.Parameter(torch.randn(N, D))
        self.wrap_output = wrap_output

    def forward(self, xs):
        x = xs[0] if isinstance(xs, (list, tuple)) else xs["x"] if isinstance(xs, dict) else xs
        out = x + self.position
        return self.wrap_output(out) if self.wrap_output else out


@dataclasses.dataclass
class Out:
    t: torch.Tensor


class Plain:
    def __init__(self, t):
        self.t = t


@pytest.mark.parametrize("inputs", ["list", "dict"])
def test_the_model_mode_finds_tensors_inside_containers(inputs):
    model = Positional()
    x = torch.randn(B, N, D)
    argument = [x] if inputs == "list" else {"x": x}
    with pytest.raises(EquivarianceError, match="Positional is not permutation-equivariant"):
        with checking_equivariance(model, dim=1):
            model(argument)


def test_a_call_with_no_tensor_the_check_can_find_warns_once():
    class Opaque:  # like a PyG Data: not registered with torch's pytree
        def __init__(self, x):
            self.x = x

    model = nn.Module()
    model.forward = lambda data: data.x * 2  # noqa: E731
    with pytest.warns(
        UserWarning, match=r"call 1 of Module has no tensor input the check can find \(its inputs: Opaque\)"
    ):
        with checking_equivariance(model, dim=1):
            model(Opaque(torch.randn(B, N, D)))
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # once per scope
                model(Opaque(torch.randn(B, N, D)))


@pytest.mark.parametrize("wrap", [Out, Plain, lambda t: {"out": [Out(t)]}], ids=["dataclass", "plain", "nested"])
def test_outputs_inside_dataclasses_and_objects_are_compared(wrap):
    model = Positional(wrap_output=wrap)
    x = torch.randn(B, N, D)
    with pytest.raises(EquivarianceError, match=r"output(\['out'\]\[0\])?\.t \(2, 6, 8\)"):
        assert_permutation_equivariant(model, x, dim=1)
    with pytest.raises(EquivarianceError):
        with checking_equivariance(model, dim=1):
            model(x)


def test_string_outputs_are_compared_and_an_output_without_tensors_is_refused():
    x = torch.randn(B, N, D)
    with pytest.raises(EquivarianceError, match=r"output\[1\].*in the original run"):
        assert_permutation_equivariant(lambda x: (x, str(x[0, 0, 0].item())), x, dim=1)
    assert_permutation_equivariant(lambda x: (x, "same", None), x, dim=1)
    with pytest.raises(ValueError, match="output holds no tensor to compare"):
        assert_permutation_equivariant(lambda x: None, x, dim=1)


@pytest.mark.parametrize("seed", range(10))
def test_a_point_cloud_far_from_the_origin_raises_no_false_alarm(seed):
    torch.manual_seed(seed)
    with slim_mha.patched():
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    embed = nn.Linear(3, 32)
    model = nn.Sequential(embed, layer).eval()
    points = torch.randn(2, 1024, 3) + 1e3  # a centred cloud 1e3 from the origin
    points = points - points.mean(dim=1, keepdim=True) + 1e3
    assert_permutation_equivariant(model, points, dim=1)
    with checking_equivariance(model, dim=1):
        model(points)


def test_the_tolerance_follows_the_inputs_magnitude():
    """Centring a cloud 1e4 from the origin sums large numbers in another order once permuted: a
    rounding error of the inputs' size in a small output, not a break."""

    class Centred(nn.Module):
        def forward(self, points):
            return points - points.mean(dim=1, keepdim=True)

    generator = torch.Generator().manual_seed(0)
    points = torch.randn(2, 1024, 3, generator=generator) + 1e4
    model = Centred()
    result = assert_permutation_equivariant(model, points, dim=1)
    error = result.outputs[0].error
    # beyond 1e-4 of the output's own magnitude (the false alarm before), far within the inputs'
    assert error.scale_of == "inputs" and error.max_abs > 1e-4 * model(points).abs().max().item()
    with checking_equivariance(model, dim=1):
        model(points)


def test_the_mode_takes_a_tolerance():
    class Nudged(nn.Module):
        def forward(self, x):
            return x + 1e-3 * torch.arange(x.shape[1], dtype=x.dtype)[:, None]

    model, x = Nudged(), torch.randn(B, N, D)
    with pytest.raises(EquivarianceError):
        with checking_equivariance(model, dim=1):
            model(x)
    with checking_equivariance(model, dim=1, tolerance=1e-2):
        model(x)
    with pytest.raises(ValueError, match="tolerance must be a number >= 0"):
        with checking_equivariance(model, dim=1, tolerance=-1):
            pass


def test_an_integer_label_per_sample_is_left_alone():
    class Classed(nn.Module):
        def __init__(self):
            super().__init__()
            self.classes = nn.Embedding(3, D)

        def forward(self, x, label):  # label (B,): one class per set
            return x + self.classes(label)[:, None, :]

    model = Classed()
    with checking_equivariance(model, dim=1):
        model(torch.randn(B, N, D), torch.tensor([2, 1]))


def test_hand_written_randomness_is_reported_and_dropout_layers_are_not():
    class HandDropout(nn.Module):
        def forward(self, x):
            return x * (torch.rand_like(x) > 0.5)

    model = HandDropout().train()
    with pytest.raises(EquivarianceError):
        with checking_equivariance(model, dim=1):
            model(torch.randn(B, N, D))
    layer = nn.Dropout(0.5).train()
    with checking_equivariance(layer, dim=1):
        layer(torch.randn(B, N, D))


def test_the_mode_takes_output_dim():
    attention = slim_mha.SlimMultiheadAttention(D, 2, batch_first=True)

    class Weights(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def forward(self, x):
            return self.attention(x, x, x)[1]  # (B, L, L)

    class SequenceFirst(nn.Module):
        def forward(self, x):
            return x.transpose(0, 1) * 2

    x = torch.randn(B, N, D)
    with checking_equivariance(Weights(), dim=1, output_dim=(1, 2)):
        Weights()(x)
    model = SequenceFirst()
    with checking_equivariance(model, dim=1, output_dim=0):
        model(x)
    with pytest.raises(ValueError, match="pass output_dim or invariant, not both"):
        with checking_equivariance(model, dim=1, output_dim=0, invariant=True):
            pass


def test_blame_names_the_input_that_did_not_follow():
    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.MultiheadAttention(D, 2, batch_first=True)

        def forward(self, x):
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            return self.attention(x, x, x, attn_mask=mask, need_weights=False)[0]

    with slim_mha.patched():
        model = Causal()
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(model, torch.randn(B, N, D), dim=1)
    message = str(caught.value)
    assert "the break comes in with its input attn_mask (6, 6)" in message
    assert "'attention' (MultiheadAttention, call 1)" in message  # the class the user wrote
    assert "PatchedMultiheadAttention" not in message and "its own code" not in message


def _graph_batch():
    """Two graphs of 3 and 4 nodes, as PyG batches them: nodes sorted by graph."""
    x = torch.randn(7, D)
    batch = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    return x, batch


class PerGraph(nn.Module):
    """Mean-centres each graph's nodes: needs ``batch`` sorted (as a PyG pooling does)."""

    def forward(self, x, batch):
        counts = torch.bincount(batch)
        if not torch.equal(batch, torch.repeat_interleave(torch.arange(len(counts)), counts)):
            raise RuntimeError("batch must be sorted")
        means = torch.zeros(len(counts), x.shape[1]).index_add_(0, batch, x) / counts[:, None]
        return x - means[batch]


def test_graph_batches_are_permuted_within_each_graph():
    model = PerGraph()
    x, batch = _graph_batch()
    with pytest.raises(
        RuntimeError,
        match=r"checking_equivariance\(PerGraph, dim=0\): call 1 of PerGraph failed "
        r"when the check ran it again on its inputs permuted: .*batch must be sorted",
    ):
        with checking_equivariance(model, dim=0):
            model(x, batch)

    def within_graphs(x, batch):
        generator = torch.Generator().manual_seed(0)
        order = torch.arange(len(batch))
        for graph in batch.unique():
            nodes = order[batch == graph]
            order[batch == graph] = nodes[torch.randperm(len(nodes), generator=generator)]
        return order

    with checking_equivariance(model, dim=0, permutation=within_graphs):
        model(x, batch)
