"""The function/model checker: measuring, asserting, formatting, locating the broken submodule."""

from __future__ import annotations

import inspect
import os
import re

import pytest
import torch
from torch import nn

from slim_mha import (
    EquivarianceError,
    SlimMultiheadAttention,
    assert_permutation_equivariant,
    assert_permutation_invariant,
    format_permutation_error,
    permutation_equivariance_error,
)
from slim_mha.equivariance import TOLERANCE, PermutationErrors
from slim_mha.equivariance._measure import draw_permutation, draw_permutations, input_share

B, N, D = 2, 6, 5


def tokens(*shape: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def per_token(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2.0


def running_sum(x: torch.Tensor) -> torch.Tensor:
    """Order-dependent: each token sees the ones before it."""
    return x.cumsum(dim=1)


# ------------------------------------------------------------------------------------ measuring


def test_measuring_returns_numbers_and_no_verdict():
    x = tokens(B, N, D)
    result = permutation_equivariance_error(per_token, x, dim=1, seed=4)
    assert isinstance(result, PermutationErrors)
    assert torch.equal(result.permutation, draw_permutations(N, 4, B)) and result.seed == 4  # one per sample
    assert torch.equal(result.permutation[0], draw_permutation(N, 4))
    assert result.input_dims == ((1,),)
    (output,) = result.outputs
    assert output.name == "output" and output.error.dims == (1,) and output.error.max_abs == 0.0
    # the larger of the output's magnitude and a share of the permuted input's: rounding grows with both
    share = input_share(torch.float32)
    assert share == pytest.approx(32 * torch.finfo(torch.float32).eps / 1e-4)
    assert output.error.scale == pytest.approx(max(per_token(x).abs().max().item(), share * x.abs().max().item()))
    assert result.submodules is None

    broken = permutation_equivariance_error(running_sum, x, dim=1)  # measured, not raised
    assert broken.outputs[0].error.max_rel > 0.1 and not broken.passed()


def test_seeds_draw_from_a_private_generator():
    x = tokens(B, N, D)
    before = torch.get_rng_state()
    first = permutation_equivariance_error(per_token, x, seed=1).permutation
    assert torch.equal(first, permutation_equivariance_error(per_token, x, seed=1).permutation)
    assert not torch.equal(first, permutation_equivariance_error(per_token, x, seed=2).permutation)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_given_permutation_is_used():
    permutation = torch.tensor([5, 4, 3, 2, 1, 0])
    result = permutation_equivariance_error(per_token, tokens(B, N, D), permutation=permutation)
    assert torch.equal(result.permutation, permutation) and result.seed is None


def test_drawn_permutations_never_are_the_identity():
    assert all(not torch.equal(draw_permutation(2, seed), torch.arange(2)) for seed in range(20))


# ------------------------------------------------------------------------------------ asserting


def test_assert_passes_on_equivariant_functions_and_returns_the_result():
    result = assert_permutation_equivariant(per_token, tokens(B, N, D), dim=1)
    assert result.passed()
    assert_permutation_invariant(lambda x: x.sum(dim=1), tokens(B, N, D), dim=1)
    assert_permutation_equivariant(lambda x: x - x.mean(dim=0), tokens(N, D), dim=0)


def test_assert_fails_on_an_order_dependent_function():
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(running_sum, tokens(B, N, D), dim=1, seed=3)
    error = caught.value
    message = str(error)
    assert message.startswith("running_sum is not permutation-equivariant: 1 of 1 outputs broke")
    assert "output (2, 6, 5) float64, expected permuted along dim 1: BROKEN, max abs error" in message
    assert "(float64: 1e-10 x max|expected|" in message
    assert "it is neither unchanged nor permuted along any axis of length 6" in message
    assert "(fn is not an nn.Module: pass module=... to find the submodule that breaks it)" in message
    drawn = draw_permutations(N, 3, B)
    assert (
        f"permutations, one per sample (seed 3, {B} samples of 6 tokens, as draw_permutations(6, 3, {B}) "
        f"draws them): sample 0: {draw_permutation(N, 3).tolist()}; sample 1: {drawn[1].tolist()}; "
        "permuted: input 0 on dim 1"
    ) in message
    assert error.seed == 3 and torch.equal(error.permutations["inputs"], draw_permutations(N, 3, B))
    assert error.errors[0].where is not None and error.result.outputs[0].error is error.errors[0]


def test_assert_fails_on_a_function_that_is_not_invariant():
    with pytest.raises(EquivarianceError, match="expected unchanged: BROKEN"):
        assert_permutation_invariant(per_token, tokens(B, N, D), dim=1)


def test_tolerance_is_relative_and_overrides_the_table():
    x = tokens(B, N, D)

    def slightly_positional(x: torch.Tensor) -> torch.Tensor:
        return x + 1e-7 * torch.arange(x.shape[1], dtype=x.dtype).view(1, -1, 1)

    with pytest.raises(EquivarianceError):
        assert_permutation_equivariant(slightly_positional, x)  # float64's 1e-10 sees it
    assert_permutation_equivariant(slightly_positional, x, tolerance=1e-4)
    with pytest.raises(ValueError, match="tolerance must be a number >= 0, relative to each output's largest"):
        assert_permutation_equivariant(per_token, x, tolerance=-1.0)


def test_the_default_tolerance_follows_the_dtype():
    """The table in float32 and float64; in low precision, what the call rounded against a float32 rerun."""
    for dtype, relative in TOLERANCE.items():
        x = tokens(B, N, D, dtype=dtype)
        error = permutation_equivariance_error(per_token, x).outputs[0].error
        assert error.dtype == dtype
        if dtype in (torch.float32, torch.float64):
            assert error.rounding is None
            assert error.tolerance() == pytest.approx(relative * error.scale)
        else:
            expected = (per_token(x).double() - per_token(x.float()).double()).abs().max().item()
            assert error.rounding == pytest.approx(expected)
            floor = 2 * torch.finfo(dtype).eps * error.scale
            assert error.tolerance() == pytest.approx(floor + 2 * error.rounding)
            assert error.tolerance(relative) == pytest.approx(relative * error.scale)  # an explicit one wins


def test_nan_matches_nan_but_not_a_number():
    x = tokens(B, N, D)
    x[0, 2, 1] = float("nan")
    assert_permutation_equivariant(per_token, x)
    with pytest.raises(EquivarianceError, match="NaN or inf on one side only"):
        assert_permutation_equivariant(lambda x: torch.where(torch.arange(N).view(1, -1, 1) == 0, x * torch.nan, x), x)


def test_the_assertions_hide_themselves_from_pytest_tracebacks():
    for function in (assert_permutation_equivariant, assert_permutation_invariant):
        assert "__tracebackhide__" in function.__code__.co_varnames


def test_format_on_a_passing_result():
    result = permutation_equivariance_error(per_token, tokens(B, N, D))
    text = format_permutation_error(result)
    assert text.startswith("per_token is permutation-equivariant within tolerance")
    assert "output (2, 6, 5) float64, expected permuted along dim 1: ok, max abs error 0.00e+00" in text


# -------------------------------------------------------------------------- inputs and outputs


def test_several_inputs_with_their_own_axes():
    x, adjacency, scale = tokens(B, N, D), tokens(N, N, seed=1), 0.5

    def message_passing(x: torch.Tensor, adjacency: torch.Tensor, scale: float) -> torch.Tensor:
        return scale * torch.einsum("ij,bjd->bid", adjacency, x)  # (B, N, D)

    assert_permutation_equivariant(message_passing, x, adjacency, scale, dim=(1, (0, 1), None), output_dim=1)
    with pytest.raises(EquivarianceError):  # the adjacency has to move with its nodes
        assert_permutation_equivariant(message_passing, x, adjacency, scale, dim=(1, None, None), output_dim=1)


def test_an_int_dim_permutes_every_tensor_input_and_skips_the_rest():
    result = permutation_equivariance_error(lambda x, y, k: x + y * k, tokens(B, N, D), tokens(B, N, D, seed=1), 3.0)
    assert result.input_dims == ((1,), (1,), ()) and result.passed()


def test_tuple_and_dict_outputs():
    def stats(x: torch.Tensor):
        return per_token(x), {"total": x.sum(dim=1), "count": x.shape[1]}, None

    result = assert_permutation_equivariant(stats, tokens(B, N, D), dim=1, output_dim=(1, None, None, None))
    # the count and None are compared too, by equality
    assert [output.name for output in result.outputs] == [
        "output[0]",
        "output[1]['total']",
        "output[1]['count']",
        "output[2]",
    ]
    assert [output.error.dims for output in result.outputs] == [(1,), (), (), ()]


def test_kwargs_are_passed_unpermuted():
    def masked_mean(x: torch.Tensor, *, weights: torch.Tensor) -> torch.Tensor:
        return (x * weights).sum(dim=1)

    weights = tokens(1, 1, D, seed=2)
    assert_permutation_invariant(masked_mean, tokens(B, N, D), kwargs={"weights": weights})


def test_a_tensor_passed_twice_stays_one_tensor():
    seen = []

    def record(query, key):
        seen.append(query is key)
        return query + key

    assert_permutation_equivariant(record, *(2 * [tokens(B, N, D)]))
    assert seen == [True, True]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: permutation_equivariance_error(per_token), "no inputs given: pass the tensors to permute after fn"),
        (lambda: permutation_equivariance_error(per_token, tokens(B, N, D), dim=None), "dim=None permutes nothing"),
        (
            lambda: permutation_equivariance_error(per_token, tokens(B, N, D), dim=(1, 1)),
            "dim has 2 entries but 1 inputs were given: pass one entry per input",
        ),
        (
            lambda: permutation_equivariance_error(per_token, tokens(B, N, D), dim=3),
            r"dim for input 0 \(2, 6, 5\): axis 3 is out of range for a tensor with 3 dimensions",
        ),
        (
            lambda: permutation_equivariance_error(lambda x, y: x, tokens(B, N, D), tokens(B, N + 1, D)),
            "permuted axes have different lengths: input 0 dim 1 has 6 tokens, input 1 dim 1 has 7",
        ),
        (
            lambda: permutation_equivariance_error(per_token, tokens(B, 1, D)),
            "the permuted axes have 1 token",
        ),
        (
            lambda: permutation_equivariance_error(lambda x, k: x, tokens(B, N, D), 2.0, dim=(1, 0)),
            r"dim\[1\]=0 but input 1 is a float, not a tensor: pass None for it",
        ),
        (
            lambda: permutation_equivariance_error(lambda x: x, tokens(B, N, D), dim=(None,)),
            "no input is permuted: give at least one tensor input a token axis in dim",
        ),
        (
            lambda: permutation_equivariance_error(lambda x: x.sum(1), tokens(B, N, D)),
            r"output has shape \(2, 5\): dim 1 has 5 entries but the inputs have 6 tokens\. .*pass output_dim",
        ),
        (
            lambda: permutation_equivariance_error(lambda x: (x, x), tokens(B, N, D), output_dim=(1,)),
            r"output_dim=\(1,\) does not fit the 2 returned element\(s\)",
        ),
        (
            lambda: permutation_equivariance_error(
                per_token, tokens(B, N, D), permutation=torch.tensor([0, 0, 1, 2, 3, 4])
            ),
            r"permutation must contain each of 0..5 exactly once \(the inputs have 6 tokens\)",
        ),
    ],
)
def test_bad_arguments_are_reported(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------ module conditions


class TokenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(D)
        self.body = nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, D))
        self.attention = SlimMultiheadAttention(D, 1, dropout=0.5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        x = self.body(x)
        return x + self.attention(x, x, x, need_weights=False)[0]


def test_train_mode_with_dropout_and_batch_norm_has_no_side_effects():
    torch.manual_seed(0)
    model = TokenMLP().double().train()
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    before = torch.get_rng_state()
    assert_permutation_equivariant(model, tokens(B, N, D), dim=1)
    assert all(module.training for module in model.modules())
    assert all(torch.equal(buffer, buffers[name]) for name, buffer in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), before)


def test_flags_and_buffers_are_restored_when_the_check_fails():
    torch.manual_seed(0)
    model = nn.Sequential(TokenMLP(), nn.Linear(D, D)).double().train()
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with pytest.raises(EquivarianceError):
        assert_permutation_equivariant(lambda x: model(x).cumsum(1), tokens(B, N, D), module=model)
    assert all(module.training for module in model.modules())
    assert all(torch.equal(buffer, buffers[name]) for name, buffer in model.named_buffers())


def test_works_in_eval():
    torch.manual_seed(0)
    assert_permutation_equivariant(TokenMLP().double().eval(), tokens(B, N, D))


# ---------------------------------------------------------------------- locating the broken module


class PositionEmbedding(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(tokens, dim, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table


class Encoder(nn.Module):
    def __init__(self, with_positions: bool) -> None:
        super().__init__()
        self.project = nn.Linear(D, D).double()
        self.positions = PositionEmbedding(N, D) if with_positions else nn.Identity()
        self.attention = SlimMultiheadAttention(D, 1, batch_first=True).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.positions(self.project(x))
        return self.attention(h, h, h)[0]


def test_the_first_submodule_that_breaks_is_named_not_the_ones_after_it():
    torch.manual_seed(0)
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(Encoder(with_positions=True), tokens(B, N, D))
    assert caught.value.module_name == "positions"
    message = str(caught.value)
    assert "'positions' (PositionEmbedding, call 1), after 1 submodule call that kept it" in message
    assert "    its output (2, 6, 5), closest reading '" in message
    result = caught.value.result
    assert [call.name for call in result.submodules] == ["project", "positions", "attention"]  # in execution order
    assert [call.passed() for call in result.submodules] == [True, False, False]  # downstream differs too


def test_self_attention_weights_are_accepted_on_both_token_axes():
    torch.manual_seed(0)
    result = permutation_equivariance_error(Encoder(with_positions=False), tokens(B, N, D), submodules=True)
    attention = next(call for call in result.submodules if call.name == "attention")
    assert attention.passed() and len(attention.outputs) == 2  # output (B, N, D), weights (B, N, N)
    weights_readings = [error.dims for error in attention.outputs[1]]
    assert weights_readings == [(), (1,), (2,), (1, 2)]


class InlinePositions(nn.Module):
    """The break is in forward's own code, between submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.before, self.after = nn.Linear(D, D).double(), nn.Linear(D, D).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(self.before(x) + torch.arange(x.shape[1], dtype=x.dtype).view(1, -1, 1))


def test_a_break_between_submodules_is_blamed_on_the_forward_code():
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(InlinePositions(), tokens(B, N, D))
    message = str(caught.value)
    assert caught.value.module_name == ""  # the checked module's own code, not 'after' that receives it
    assert "the break is in the code in `InlinePositions.forward` before `before`" not in message
    line = _line_of(InlinePositions.forward, "return self.after(")
    assert (
        f"the break is in the code in `InlinePositions.forward` between `before` (call 1) and `after` (call 1) ("
        f"{_path()}, line {line})" in message
    )
    assert (
        "    'after' (Linear, call 1) receives an input that is neither unchanged nor permuted along its token "
        "axes, after 1 submodule call that kept it: its input (2, 6, 5), closest reading" in message
    )
    assert "first submodule" not in message


def _line_of(function, text: str) -> int:
    """The line number of the first line of ``function`` that contains ``text``."""
    source, first = inspect.getsourcelines(function)
    return first + next(index for index, line in enumerate(source) if text in line)


def _path() -> str:
    return os.path.relpath(__file__)


class InlineViT(nn.Module):
    """ViT-style: the position table is added inline in forward, not by a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D).double()
        self.pos = nn.Parameter(torch.randn(N, D, dtype=torch.float64))
        self.attn = SlimMultiheadAttention(D, 1, batch_first=True).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos
        return self.attn(h, h, h, need_weights=False)[0]


def test_an_inline_position_embedding_is_blamed_on_forward_not_on_the_attention():
    torch.manual_seed(0)
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(InlineViT(), tokens(B, N, D))
    error = caught.value
    first, last = _line_of(InlineViT.forward, "h = self.embed(x)"), _line_of(InlineViT.forward, "self.attn(h")
    culprit = error.result.culprit()
    assert (culprit.kind, culprit.module_name, culprit.submodule.name) == ("code", "", "attn")
    assert culprit.code == "the code in `InlineViT.forward` between `embed` (call 1) and `attn` (call 1)"
    assert culprit.location == f"{_path()}, lines {first}-{last}"
    assert error.module_name == ""
    message = str(error)
    assert f"  the break is in {culprit.code} ({culprit.location})" in message
    assert "'attn' (SlimMultiheadAttention, call 1) receives an input that is neither unchanged nor permuted" in message
    assert "its query (2, 6, 5), closest reading" in message
    assert "first submodule" not in message  # the attention is innocent
    # Once the table is its own module, that module is named, as before.
    torch.manual_seed(0)
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(Encoder(with_positions=True), tokens(B, N, D))
    assert caught.value.module_name == "positions" and caught.value.result.culprit().kind == "submodule"


def test_the_same_model_without_positions_passes():
    model = InlineViT()
    with torch.no_grad():
        model.pos.zero_()
    assert_permutation_equivariant(model, tokens(B, N, D))


def test_a_break_inside_a_submodule_names_that_submodule_and_its_code():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D).double(), InlineViT())
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(model, tokens(B, N, D))
    culprit = caught.value.result.culprit()
    assert caught.value.module_name == "1"  # the InlineViT whose forward holds the code
    assert culprit.code == "the code in `InlineViT.forward` between `1.embed` (call 1) and `1.attn` (call 1)"
    assert "after 2 submodule calls that kept it" in str(caught.value)  # 0 and 1.embed


class PositionsBeforeTheFirstCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(D, D).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], dtype=x.dtype).view(1, -1, 1)
        return self.layer(x + positions)


def test_a_break_before_the_first_call_is_blamed_on_the_code_before_it():
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(PositionsBeforeTheFirstCall(), tokens(B, N, D))
    culprit = caught.value.result.culprit()
    first = PositionsBeforeTheFirstCall.forward.__code__.co_firstlineno
    last = _line_of(PositionsBeforeTheFirstCall.forward, "return self.layer(")
    assert culprit.code == "the code in `PositionsBeforeTheFirstCall.forward` before `layer` (call 1)"
    assert culprit.location == f"{_path()}, lines {first}-{last}"
    assert "after 0 submodule calls that kept it" in str(caught.value)


class SplitAcrossMethods(nn.Module):
    """The embedding runs in forward, the attention in a helper method (as in nn.TransformerDecoderLayer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D).double()
        self.attn = SlimMultiheadAttention(D, 1, batch_first=True).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self._block(h + torch.linspace(0, 1, x.shape[1], dtype=x.dtype).view(1, -1, 1))

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return self.attn(h, h, h, need_weights=False)[0]


def test_code_spread_over_two_functions_names_both_calls_and_places():
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(SplitAcrossMethods(), tokens(B, N, D))
    culprit = caught.value.result.culprit()
    embed_line = _line_of(SplitAcrossMethods.forward, "h = self.embed(x)")
    attn_line = _line_of(SplitAcrossMethods._block, "return self.attn(")
    assert culprit.code == (
        f"the code between `embed` (call 1), called in `SplitAcrossMethods.forward` ({_path()}, line {embed_line}), "
        "and `attn` (call 1), called in `SplitAcrossMethods._block`"
    )
    assert culprit.location == f"{_path()}, line {attn_line}"


class BrokenOutputOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(D, D).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).cumsum(dim=1)


def test_no_submodule_breaks_it_points_at_the_modules_own_forward():
    first = _line_of(BrokenOutputOnly.forward, "return self.layer(x)")
    expected = (
        r"no submodule call breaks it \(1 compared\): the break is in BrokenOutputOnly's own forward code, between "
        r"its submodules or after them: the code in `BrokenOutputOnly.forward` after `layer` \(call 1\) \("
        + re.escape(f"{_path()}, line {first})")
    )
    with pytest.raises(EquivarianceError, match=expected) as caught:
        assert_permutation_equivariant(BrokenOutputOnly(), tokens(B, N, D))
    assert caught.value.module_name == ""


def test_a_submodule_whose_own_code_breaks_it_after_its_submodules_is_named_with_that_code():
    model = nn.Sequential(nn.Linear(D, D).double(), BrokenOutputOnly())
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(model, tokens(B, N, D))
    assert caught.value.module_name == "1"
    line = _line_of(BrokenOutputOnly.forward, "return self.layer(x)")
    assert "'1' (BrokenOutputOnly, call 1), after 2 submodule calls that kept it" in str(caught.value)
    assert (
        f"    its own submodule calls kept it: the break is in the code in `BrokenOutputOnly.forward` after "
        f"`1.layer` (call 1) ({_path()}, line {line})"
    ) in str(caught.value)


class SharedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(D, D).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.layer(x).cumsum(dim=1))


def test_a_shared_submodule_is_reported_by_its_call():
    expected = r"the code in `SharedLayer.forward` between `layer` \(call 1\) and `layer` \(call 2\)"
    with pytest.raises(EquivarianceError, match=expected):
        assert_permutation_equivariant(SharedLayer(), tokens(B, N, D))
    shared = nn.Sequential(nn.Linear(D, D).double(), PositionEmbedding(N, D))
    model = nn.Sequential(shared, shared)  # the second call of the table breaks it again: the first is named
    with pytest.raises(EquivarianceError, match=r"'0.1' \(PositionEmbedding, call 1\), after 1 submodule call"):
        assert_permutation_equivariant(model, tokens(B, N, D))


def test_a_bound_method_of_a_module_is_searched_and_module_can_be_given():
    model = BrokenOutputOnly()
    with pytest.raises(EquivarianceError, match="no submodule call breaks it"):
        assert_permutation_equivariant(model.forward, tokens(B, N, D))
    # Through a lambda, the module's own call is located too: the break is in its code, not the lambda's.
    line = _line_of(BrokenOutputOnly.forward, "return self.layer(x)")
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(lambda x: model(x), tokens(B, N, D), module=model)
    assert "'BrokenOutputOnly' (BrokenOutputOnly, call 1), after 1 submodule call that kept it" in str(caught.value)
    assert (
        f"its own submodule calls kept it: the break is in the code in `BrokenOutputOnly.forward` after "
        f"`layer` (call 1) ({_path()}, line {line})"
    ) in str(caught.value)
    assert caught.value.module_name == ""


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(D, D).double(), nn.Linear(D, D).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.first if x[0, 0, 0] > 0 else self.second  # depends on which token comes first
        return branch(x).cumsum(dim=1)


def test_diverging_control_flow_is_reported():
    x = tokens(B, N, D)
    x[0, :, 0] = torch.linspace(-1, 1, N, dtype=x.dtype)
    x[0, 0, 0] = 1.0
    permutation = torch.tensor([1, 0, 2, 3, 4, 5])  # token 1 (negative) comes first
    with pytest.raises(EquivarianceError, match="submodule calls diverge at call 0: 'first' ran on the original"):
        assert_permutation_equivariant(DataDependent(), x, permutation=permutation)


def test_errors_of_the_assertion_mode_inside_a_checked_model_carry_its_names():
    class Leak(SlimMultiheadAttention):
        def _slim_general(self, call, dropout_p=None, plan=None):
            output, weights = super()._slim_general(call, dropout_p)
            return output + torch.arange(output.shape[1], dtype=output.dtype).view(1, -1, 1), weights

    model = nn.Module()
    model.inner = nn.Module()
    model.inner.attention = Leak(D, 1, batch_first=True, check_equivariance=True).double()
    with pytest.raises(EquivarianceError, match="Leak 'inner.attention' is not permutation-equivariant on this call"):
        assert_permutation_equivariant(lambda x: model.inner.attention(x, x, x)[0], tokens(B, N, D), module=model)


def test_a_classifier_checked_for_equivariance_is_pointed_to_the_invariant_check():
    """Its logits have no token axis: the message names the check that fits, in both entry points."""
    import slim_mha

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(16, 4, batch_first=True)
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))

    model = slim_mha.convert(Classifier())
    x = torch.randn(2, 10, 16)
    pointed = r"assert_permutation_invariant, or checking_equivariance\(\.\.\., invariant=True\)"
    with pytest.raises(ValueError, match=pointed):
        assert_permutation_equivariant(model, x, dim=1)
    with pytest.raises(ValueError, match=pointed):
        with slim_mha.checking_equivariance(model, dim=1), torch.no_grad():
            model(x)
    assert_permutation_invariant(model, x, dim=1)  # the check it points to passes
