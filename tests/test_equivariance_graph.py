"""A real client library: torch_geometric's GPSConv (a graph transformer layer) on slim attention.

GPSConv (``attn_type='multihead'``) builds ``torch.nn.MultiheadAttention``, so under
``slim_mha.patched()`` it gets slim attention: it must give stock's outputs and gradients, and the
whole layer (a GIN message-passing branch plus global attention over the nodes) must stay
equivariant to node permutations when the edges are relabelled with the nodes. The edges are given
as a dense adjacency matrix, which a permutation moves along both axes; the layer gets its
``edge_index`` from it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha import (
    EquivarianceError,
    SlimMultiheadAttention,
    assert_permutation_equivariant,
    checking_equivariance,
)

from _reference import STOCK_MHA, assert_close_scaled, randomize_parameters

pytest.importorskip("torch_geometric")
from torch_geometric.nn import GATConv, GCNConv, GINConv, GPSConv  # noqa: E402

CHANNELS, HEADS, NODES = 16, 4, 12


def make_layer() -> GPSConv:
    local = GINConv(nn.Sequential(nn.Linear(CHANNELS, CHANNELS), nn.ReLU(), nn.Linear(CHANNELS, CHANNELS)))
    return GPSConv(CHANNELS, local, heads=HEADS)


def stock_and_slim(randomize: bool = True) -> tuple[GPSConv, GPSConv]:
    torch.manual_seed(0)
    stock = make_layer()
    torch.manual_seed(0)
    with slim_mha.patched():
        slim = make_layer()
    assert type(stock.attn) is STOCK_MHA and isinstance(slim.attn, SlimMultiheadAttention)
    if randomize:  # every bias non-zero, the key bias included (the default initialisation zeroes them)
        randomize_parameters(stock, seed=3)
        slim.load_state_dict(stock.state_dict())
    return stock, slim


def graph() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(NODES, CHANNELS, generator=generator)
    adjacency = torch.rand(NODES, NODES, generator=generator) < 0.3  # (N, N), directed edges
    return features, adjacency


def edges(adjacency: torch.Tensor) -> torch.Tensor:
    return adjacency.nonzero().t()  # (2, E)


def test_the_same_seed_builds_a_layer_with_stocks_outputs():
    stock, slim = stock_and_slim(randomize=False)
    features, adjacency = graph()
    with torch.no_grad():
        assert_close_scaled(slim.eval()(features, edges(adjacency)), stock.eval()(features, edges(adjacency)))


def test_eval_outputs_and_a_training_steps_gradients_match_stock():
    stock, slim = stock_and_slim()
    features, adjacency = graph()
    with torch.no_grad():
        assert_close_scaled(slim.eval()(features, edges(adjacency)), stock.eval()(features, edges(adjacency)), "eval")
    results = []
    for layer in (stock, slim):
        leaf = features.clone().requires_grad_()
        output = layer.train()(leaf, edges(adjacency))  # batch norm on batch statistics
        output.square().mean().backward()
        results.append((output.detach(), leaf.grad, dict(layer.named_parameters())))
    (stock_output, stock_input_grad, stock_parameters), (slim_output, slim_input_grad, slim_parameters) = results
    assert_close_scaled(slim_output, stock_output, "train output")
    assert_close_scaled(slim_input_grad, stock_input_grad, "input gradient")
    assert list(slim_parameters) == list(stock_parameters)
    for name in stock_parameters:
        assert_close_scaled(slim_parameters[name].grad, stock_parameters[name].grad, f"grad {name}")
    key_grad = slim_parameters["attn.in_proj_bias"].grad.chunk(3)[1]
    assert torch.equal(key_grad, torch.zeros_like(key_grad))  # stock's is rounding noise: why slim drops it


@pytest.mark.parametrize("training", [False, True])
def test_the_whole_layer_is_node_permutation_equivariant(training):
    _, slim = stock_and_slim()
    slim.train(training)
    features, adjacency = graph()
    layer = lambda features, adjacency: slim(features, edges(adjacency))  # noqa: E731
    # Nodes along dim 0 of the features; the adjacency moves along both axes, which relabels the edges.
    result = assert_permutation_equivariant(layer, features, adjacency, dim=(0, (0, 1)), module=slim)
    assert result.passed() and slim.training is training
    with checking_equivariance(slim, strict=True):  # the mode checks the attention call inside it too
        slim(features, edges(adjacency))


def test_edges_that_do_not_follow_the_nodes_are_caught_in_the_message_passing():
    _, slim = stock_and_slim()
    features, adjacency = graph()
    layer = lambda features, adjacency: slim(features, edges(adjacency))  # noqa: E731
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(layer, features, adjacency, dim=(0, None), module=slim)
    culprit = caught.value.result.culprit()
    # The integer edge_index is not judged; the gathered messages are the first broken tensor.
    assert (culprit.kind, caught.value.module_name, culprit.submodule.name) == ("code", "conv", "conv.aggr_module")
    assert culprit.code == "the code in `MessagePassing.aggregate` before `conv.aggr_module` (call 1)"


@pytest.mark.parametrize("conv", [GCNConv, GATConv])
def test_a_break_after_a_conv_that_appends_self_loops_is_blamed_after_it(conv):
    """GCNConv and GATConv append a self-loop per node after the edges: their per-edge messages
    are neither unchanged nor permuted while their per-node output is. The blame lands on the code
    that breaks the property after the conv, not on the conv's own bookkeeping."""

    class AfterConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = conv(CHANNELS, CHANNELS)
            self.positions = nn.Parameter(torch.randn(NODES, CHANNELS))

        def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
            return self.conv(x, edge_index) + self.positions  # planted after the conv

    torch.manual_seed(0)
    features, adjacency = graph()
    model = AfterConv()
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(model, features, edges(adjacency), dim=0)
    assert caught.value.module_name == ""
    message = str(caught.value)
    assert "no submodule call breaks it" in message and "AfterConv.forward` after `conv` (call 1)" in message
    model.positions.data.zero_()
    assert_permutation_equivariant(model, features, edges(adjacency), dim=0)
