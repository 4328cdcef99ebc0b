"""A permutation per sample: a model that mixes the samples of a batch is caught.

With one permutation shared by every sample, ``h - h.mean(0)`` and a sequence-first layer fed
batch-first data (it attends across the batch) moved every sample's tokens alike and passed. Each
sample now gets its own permutation wherever every moved input has a batch axis; inputs that the
whole batch shares (an ``(L, L)`` mask) or that number the nodes of the whole batch (``edge_index``)
keep one permutation for all.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import slim_mha
from slim_mha.equivariance import EquivarianceError, assert_permutation_equivariant, checking_equivariance
from slim_mha.equivariance._inputs import input_plan
from slim_mha.equivariance._measure import draw_permutation, draw_permutations, permute

B, N, D, H = 3, 8, 16, 4


def tokens(*shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_centring_over_the_batch_mixes_samples():
    x = tokens(B, N, D)
    with pytest.raises(EquivarianceError, match="one per sample"):
        assert_permutation_equivariant(lambda h: h - h.mean(0), x, dim=1)
    assert_permutation_equivariant(lambda h: h - h.mean(1, keepdim=True), x, dim=1)  # over the set: fine


@pytest.mark.parametrize("batch_first", [False, True])
def test_a_layer_fed_the_other_layout_attends_across_the_batch(batch_first):
    """A sequence-first layer fed (B, N, C) attends over B at each of the N positions."""
    torch.manual_seed(0)
    with slim_mha.patched():
        layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=batch_first).eval()
    x = tokens(B, N, D)
    if batch_first:
        assert_permutation_equivariant(layer, x, dim=1)
        with checking_equivariance(layer, dim=1):
            layer(x)
        return
    with pytest.raises(EquivarianceError):
        assert_permutation_equivariant(layer, x, dim=1)
    with pytest.raises(EquivarianceError), checking_equivariance(layer, dim=1):
        layer(x)


def test_sequence_first_inputs_take_their_batch_from_axis_one():
    torch.manual_seed(0)
    with slim_mha.patched():
        layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0).eval()
    x = tokens(N, B, D)
    padding = torch.zeros(B, N, dtype=torch.bool)
    padding[0, -2:] = True
    result = assert_permutation_equivariant(
        lambda x, padding: layer(x, src_key_padding_mask=padding), x, padding, dim=[0, 1], module=layer
    )
    assert result.permutation.shape == (B, N)
    assert input_plan([0, 1], (x, padding)).samples == B


def test_an_output_pooled_over_the_batch_names_the_mixing():
    x = tokens(B, N, D)
    with pytest.raises(EquivarianceError, match="no axis of the batch's 3 samples besides its tokens"):
        assert_permutation_equivariant(lambda h: h.sum(0), x, dim=1, output_dim=0)


def test_shared_inputs_keep_one_permutation_for_all():
    x = tokens(B, N, D)
    causal = torch.triu(torch.ones(N, N, dtype=torch.bool), 1)
    assert input_plan([1, (0, 1)], (x, causal)).samples == 0  # an (L, L) mask has no batch axis
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 3]])
    assert input_plan(0, (tokens(N, D), edge_index)).samples == 0  # a set of nodes: no batch
    assert input_plan(1, (x,)).samples == B
    assert input_plan(1, (x[:1],)).samples == 0  # one sample: nothing to tell apart
    result = assert_permutation_equivariant(lambda h, m: h + m.sum(-1, keepdim=True), x, causal, dim=[1, (0, 1)])
    assert result.permutation.shape == (N,)


def test_each_sample_moves_by_its_own_row():
    x = tokens(B, N, D)
    permutation = draw_permutations(N, 5, B)
    assert torch.equal(permutation[0], draw_permutation(N, 5)) and not torch.equal(permutation[0], permutation[1])
    moved = permute(x, (1,), permutation)
    for b in range(B):
        assert torch.equal(moved[b], x[b, permutation[b]])
    sequence_first = x.transpose(0, 1)
    assert torch.equal(permute(sequence_first, (0,), permutation), moved.transpose(0, 1))
    mask = torch.rand(B, N, N) < 0.5
    both = permute(mask, (1, 2), permutation)
    for b in range(B):
        assert torch.equal(both[b], mask[b][permutation[b]][:, permutation[b]])
    many = draw_permutations(N, 5, 20)  # draws repeat past 8 samples
    assert torch.equal(many[8], many[0]) and many.shape == (20, N)


def test_a_given_permutation_per_sample_is_used_and_checked():
    x = tokens(B, N, D)
    given = torch.stack([torch.randperm(N, generator=torch.Generator().manual_seed(b)) for b in range(B)])
    result = assert_permutation_equivariant(lambda h: h * 2, x, dim=1, permutation=given)
    assert torch.equal(result.permutation, given) and result.seed is None
    shared = assert_permutation_equivariant(lambda h: h - h.mean(0), x, dim=1, permutation=given[0])
    assert shared.permutation.shape == (N,)  # one given permutation: every sample alike, as asked
    with pytest.raises(ValueError, match="permutation has 2 rows, one per sample, but the inputs have 3 samples"):
        assert_permutation_equivariant(lambda h: h, x, dim=1, permutation=given[:2])
    with pytest.raises(ValueError, match="must contain each of 0..7 exactly once"):
        assert_permutation_equivariant(lambda h: h, x, dim=1, permutation=given.clamp(max=3))


# ------------------------------------------------------------------------- token indices


class KnnModel(nn.Module):
    """Point features gathered from precomputed nearest neighbours ``knn`` ``(B, N, k)``."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * D, D)

    def forward(self, x: Tensor, knn: Tensor) -> Tensor:
        neighbours = torch.stack([x[b][knn[b]] for b in range(x.shape[0])])  # (B, N, k, D)
        return self.mix(torch.cat([x, neighbours.mean(2)], -1))


def nearest(x: Tensor, k: int = 3) -> Tensor:
    return torch.cdist(x, x).topk(k, largest=False).indices  # (B, N, k), values 0..N-1


@pytest.mark.parametrize("mode", ["checker", "model"])
def test_knn_indices_are_moved_and_relabelled(mode):
    torch.manual_seed(0)
    model, x = KnnModel(), tokens(B, N, D)
    knn = nearest(x)
    plan = input_plan([1, ("indices", 1)], (x, knn))
    assert plan.dims == ((1,), (1,)) and plan.relabelled == (1,) and plan.samples == B
    if mode == "checker":
        assert_permutation_equivariant(model, x, knn, dim=[1, ("indices", 1)])
    else:
        with checking_equivariance(model, dim={"x": 1, "knn": ("indices", 1)}):
            model(x, knn)
    # Without the form the indices move but keep their labels: the check fails and says what to give.
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(model, x, knn, dim=1)
    assert (
        "input 1 moved on dim 1 holds integers in 0..7 only: if they are token indices (kNN), give it the dim "
        "entry ('indices', 1) to relabel them as well"
    ) in str(caught.value)


def test_relabelled_indices_follow_each_samples_permutation():
    x = tokens(B, N, D)
    knn = nearest(x)
    moved = assert_permutation_equivariant(lambda x, knn: x, x, knn, dim=[1, ("indices", 1)]).permutation
    from slim_mha.equivariance._inputs import permute_inputs

    _, new_knn = permute_inputs((x, knn), input_plan([1, ("indices", 1)], (x, knn)), moved)
    for b in range(B):
        new_position = torch.empty(N, dtype=torch.long)
        new_position[moved[b]] = torch.arange(N)
        assert torch.equal(new_knn[b], new_position[knn[b][moved[b]]])


def test_dim_entries_that_are_not_understood_name_the_forms():
    x = tokens(B, N, D)
    for entry in [("indices", "x"), "tokens", (), 1.0]:
        with pytest.raises(ValueError, match=r"is not understood: use an axis, .*\('indices', axis\)"):
            assert_permutation_equivariant(lambda x, y: x, x, x, dim=[1, entry])
    with pytest.raises(ValueError, match=r"dim entry \('indices', 'x'\) is not understood"):
        with checking_equivariance(KnnModel(), dim={"x": 1, "knn": ("indices", "x")}):
            pass


def test_a_two_node_graphs_edge_index_is_relabelled():
    """(2, E) beside 2 nodes has the token count on axis 0; its rows are source and target."""

    def propagate(x: Tensor, edge_index: Tensor) -> Tensor:
        source, target = edge_index
        return x + torch.zeros_like(x).index_add_(0, target, x[source])

    nodes = tokens(2, D)
    edge_index = torch.tensor([[0, 1, 1], [1, 0, 1]])
    plan = input_plan(0, (nodes, edge_index))
    assert plan.relabelled == (1,) and plan.dims[1] == () and plan.samples == 0
    assert_permutation_equivariant(propagate, nodes, edge_index, dim=0)
    ids = torch.tensor([[5, 7, 9], [3, 2, 8]])  # two tokens' ids, sequence-first: still moved
    assert input_plan(0, (tokens(2, 3, D), ids)).dims[1] == (0,)
