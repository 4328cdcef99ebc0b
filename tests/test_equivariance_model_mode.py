"""The model-level mode: ``checking_equivariance(model, dim=...)`` checks the model's own calls.

Real cases: a position table added inline, an attention subclass that adds positions to q/k in its
``forward``, ``linformer-pytorch``'s sequence projection, attention pooling (invariant), a stock
encoder, a graph model with ``edge_index``. Then what the mode must not change (outputs,
gradients, RNG, buffers, flags, the graph, a whole training run bit for bit), and the conditions it
shares with the per-call mode (compile, trace, vmap, threads, nesting, the environment variable).
"""

from __future__ import annotations

import inspect
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slim_mha
from slim_mha import (
    EquivarianceError,
    SlimMultiheadAttention,
    assert_permutation_equivariant,
    checking_equivariance,
)
from slim_mha.equivariance import _model_mode

B, N, D, HEADS = 2, 6, 16, 4

pytestmark = pytest.mark.usefixtures("fresh_equivariance_mode")  # tests/conftest.py


@pytest.fixture
def measured(monkeypatch) -> list:
    """The inputs of each model call the model-level mode actually checked, in order."""
    seen = []
    measure = _model_mode.measure

    def recording_measure(call, **options):
        seen.append(call.inputs)
        return measure(call, **options)

    monkeypatch.setattr(_model_mode, "measure", recording_measure)
    return seen


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _line_of(function, text: str) -> int:
    source, first = inspect.getsourcelines(function)
    return first + next(index for index, line in enumerate(source) if text in line)


def _path() -> str:
    return os.path.relpath(__file__)


# ------------------------------------------------------------------------------- models


class SetModel(nn.Module):
    """A set model with a learned position table added inline: the break is outside any attention."""

    def __init__(self, positions: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.pos = nn.Parameter(torch.randn(1, N, D)) if positions else None
        self.attention = SlimMultiheadAttention(D, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.pos is not None:
            h = h + self.pos
        return self.attention(h, h, h, need_weights=False)[0]


class PositionalAttention(SlimMultiheadAttention):
    """Adds a learned position table to q and k, then calls its parent: each parent call is equivariant."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.table = nn.Parameter(torch.randn(N, self.embed_dim))

    def forward(self, query, key, value, **kwargs):
        positions = self.table[: query.shape[1]]
        return super().forward(query + positions, key + positions, value, **kwargs)


class WithPositionalAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.attention = PositionalAttention(D, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.attention(h, h, h, need_weights=False)[0]


class Pooling(nn.Module):
    """Attention pooling: learned queries attend over the set, so the output ignores its order."""

    def __init__(self, seeds: int = 3) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(1, seeds, D))
        self.attention = SlimMultiheadAttention(D, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries = self.queries.expand(x.shape[0], -1, -1)
        return self.attention(queries, x, x, need_weights=False)[0]


class GraphModel(nn.Module):
    """Message passing over ``edge_index`` (2, E), then attention over all nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.message = nn.Linear(D, D)
        self.attention = SlimMultiheadAttention(D, HEADS)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:  # x: (N, D)
        source, target = edge_index
        h = x + torch.zeros_like(x).index_add_(0, target, self.message(x)[source])
        return self.attention(h, h, h, need_weights=False)[0]


def graph(nodes: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    edge_index = (torch.rand(nodes, nodes, generator=generator) < 0.4).nonzero().t()  # (2, E)
    return torch.randn(nodes, D, generator=generator), edge_index


# ------------------------------------------------------------------------------ real cases


def test_a_position_table_added_inline_is_caught_and_named_by_its_lines(measured):
    torch.manual_seed(0)
    model = SetModel()
    x = torch.randn(B, N, D)
    with checking_equivariance(model):  # the per-call mode: each attention call is fine given its input
        model(x)
    with pytest.raises(EquivarianceError) as caught, checking_equivariance(model, dim=1):
        model(x)
    first, last = _line_of(SetModel.forward, "h = self.embed(x)"), _line_of(SetModel.forward, "return self.attention")
    message = str(caught.value)
    assert message.startswith(
        "checking_equivariance(SetModel, dim=1): call 1 of the model, run again on its inputs and on them permuted "
        "(both runs under no_grad, without dropout):\nSetModel is not permutation-equivariant: 1 of 1 outputs broke"
    )
    assert (
        f"the break is in the code in `SetModel.forward` between `embed` (call 1) and `attention` (call 1) "
        f"({_path()}, lines {first}-{last})"
    ) in message
    assert f"permutations, one per sample (seed {caught.value.seed}, {B} samples of {N} tokens" in message
    assert "; permuted: x on dim 1" in message
    assert caught.value.module_name == ""
    assert caught.value.result.culprit().kind == "code"
    assert torch.equal(caught.value.permutations["inputs"], caught.value.result.permutation)
    assert len(measured) == 1


def test_the_same_model_without_the_table_passes():
    torch.manual_seed(0)
    model = SetModel(positions=False)
    with checking_equivariance(model, dim=1):
        model(torch.randn(B, N, D)).sum().backward()


def test_an_attention_subclass_adding_positions_to_q_and_k_is_blamed_on_its_forward():
    torch.manual_seed(0)
    model = WithPositionalAttention()
    x = torch.randn(B, N, D)
    with checking_equivariance(model):  # its parent's call is equivariant given the positioned q and k
        model(x)
    with pytest.raises(EquivarianceError) as caught, checking_equivariance(model, dim=1):
        model(x)
    code = inspect.getsourcelines(PositionalAttention.forward)
    first, last = code[1], code[1] + len(code[0]) - 1
    assert caught.value.module_name == "attention"
    assert "'attention' (PositionalAttention, call 1), after 1 submodule call that kept it" in str(caught.value)
    assert (
        f"it calls no submodule: the break is in its own code, `PositionalAttention.forward` "
        f"({_path()}, lines {first}-{last})"
    ) in str(caught.value)


def test_blame_through_a_lambda_names_the_module_whose_code_breaks_it():
    torch.manual_seed(0)
    attention = PositionalAttention(D, HEADS, batch_first=True).double()
    with pytest.raises(EquivarianceError) as caught:
        assert_permutation_equivariant(lambda x: attention(x, x, x)[0], tokens(B, N, D), module=attention)
    message = str(caught.value)
    assert "'PositionalAttention' (PositionalAttention, call 1), after 0 submodule calls that kept it" in message
    assert "the break is in its own code, `PositionalAttention.forward`" in message
    assert "own forward code" not in message and "(0 compared)" not in message
    assert caught.value.module_name == ""


linformer = pytest.importorskip("linformer_pytorch", reason="the test extra installs linformer-pytorch")


def test_linformer_fails_naming_its_sequence_projection_and_passes_with_full_attention():
    torch.manual_seed(0)
    model = linformer.Linformer(input_size=N * 2, channels=D, dim_k=4, nhead=HEADS, depth=1).train()
    x = torch.randn(B, N * 2, D)
    with pytest.raises(EquivarianceError) as caught, checking_equivariance(model, dim=1):
        model(x).sum().backward()  # train mode: its dropout layers are off for the comparison
    assert caught.value.module_name == "seq.0.fn.heads.0.E"
    assert (
        "first submodule, in execution order, whose output is neither unchanged nor permuted along its token "
        "axes: 'seq.0.fn.heads.0.E' (Linear, call 1)" in str(caught.value)
    )

    torch.manual_seed(0)
    full = linformer.Linformer(input_size=N * 2, channels=D, dim_k=4, nhead=HEADS, depth=2, full_attention=True)
    with checking_equivariance(full, dim=1):
        full.train()(x).sum().backward()


def test_attention_pooling_with_learned_queries_passes_as_invariant_and_fails_as_equivariant():
    torch.manual_seed(0)
    model = Pooling()
    x = torch.randn(B, N, D)
    with checking_equivariance(model, dim=1, invariant=True):
        model(x)
    model = Pooling(seeds=N)  # as many queries as tokens, so that "permuted along dim 1" is a reading
    with pytest.raises(
        EquivarianceError, match=r"expected permuted along dim 1: BROKEN.*\n    it is unchanged instead"
    ):
        with checking_equivariance(model, dim=1):
            model(x)


def test_a_stock_transformer_encoder_without_positions_passes_in_train_and_eval():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 32, dropout=0.2, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(B, N, D)
    padding = torch.zeros(B, N, dtype=torch.bool)
    padding[:, -2:] = True
    with checking_equivariance(model, dim=1):
        model.train()(x, src_key_padding_mask=padding).sum().backward()  # the mask (B, N) moves with the tokens
        with torch.no_grad():
            model.eval()(x, src_key_padding_mask=padding)  # eval under no_grad: stock's fast path, both runs


def test_integer_index_inputs_are_relabelled_with_the_nodes():
    torch.manual_seed(0)
    model = GraphModel().double()
    x, edge_index = graph()
    with checking_equivariance(model, dim=0):  # edge_index has 2 rows, not N: token indices
        model(x.double(), edge_index)
    with checking_equivariance(model, dim=(0, "indices")):
        model(x.double(), edge_index)
    with pytest.raises(EquivarianceError) as caught, checking_equivariance(model, dim=(0, None)):
        model(x.double(), edge_index)  # edges that do not follow the nodes
    assert "relabelled" not in str(caught.value)


def test_the_report_says_which_inputs_were_relabelled():
    class Broken(GraphModel):
        def forward(self, x, edge_index):
            return super().forward(x, edge_index).cumsum(dim=0)

    torch.manual_seed(0)
    model = Broken().double()
    x, edge_index = graph()
    with pytest.raises(EquivarianceError, match=r"permuted: x on dim 0; relabelled as token indices: edge_index"):
        with checking_equivariance(model, dim=0):
            model(x.double(), edge_index)


# ------------------------------------------------------------------------- nothing changes


class Everything(nn.Module):
    """Dropout layers, functional dropout, batch norm, slim attention: everything a check could disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(D)
        self.attention = SlimMultiheadAttention(D, HEADS, dropout=0.3, batch_first=True)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x).transpose(1, 2)).transpose(1, 2)  # batch norm over (B, D, N)
        h = F.dropout(h, 0.3, self.training)  # functional dropout, in the module's own code
        h = h + self.attention(h, h, h, need_weights=False)[0]
        q = k = v = h.view(B, N, HEADS, D // HEADS).transpose(1, 2)  # (B, H, N, D/H)
        h = h + F.scaled_dot_product_attention(q, k, v, dropout_p=0.3 if self.training else 0.0).transpose(
            1, 2
        ).reshape(B, N, D)
        return self.dropout(h)


def _run(steps: int, mode: bool) -> dict:
    torch.manual_seed(0)
    model = Everything()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record = {"outputs": [], "grads": [], "input_grads": []}
    for step in range(steps):
        x = torch.randn(B, N, D, requires_grad=True)
        model.train(step != 1)  # one step in eval mode
        if mode:
            with checking_equivariance(model, dim=1):
                output = model(x)
        else:
            output = model(x)
        output.square().mean().backward()  # the graph recorded before the check still runs backward
        record["outputs"].append(output.detach())
        record["grads"].append([p.grad.clone() for p in model.parameters()])
        record["input_grads"].append(x.grad)
        optimizer.step()
        optimizer.zero_grad()
    record["rng"] = torch.get_rng_state()
    record["buffers"] = [b.clone() for b in model.buffers()]
    record["training"] = [m.training for m in model.modules()]
    return record


def _assert_identical(first, second) -> None:
    if isinstance(first, torch.Tensor):
        assert torch.equal(first, second)
    elif isinstance(first, (list, tuple)):
        assert len(first) == len(second)
        for a, b in zip(first, second):
            _assert_identical(a, b)
    elif isinstance(first, dict):
        for key in first:
            _assert_identical(first[key], second[key])
    else:
        assert first == second


def test_outputs_gradients_rng_buffers_and_flags_are_as_without_the_mode(measured):
    _assert_identical(_run(3, mode=True), _run(3, mode=False))
    assert len(measured) == 3


def test_the_check_leaves_the_running_statistics_and_flags_of_the_call():
    torch.manual_seed(0)
    model = Everything().train()
    x = torch.randn(B, N, D)
    torch.manual_seed(5)
    model(x)
    after_one_call = [b.clone() for b in model.buffers()]
    torch.manual_seed(0)
    model = Everything().train()
    torch.manual_seed(5)
    with checking_equivariance(model, dim=1):
        model(x)
    _assert_identical([b.clone() for b in model.buffers()], after_one_call)
    assert all(module.training for module in model.modules())


def test_a_dropout_model_trained_under_the_mode_raises_nothing():
    torch.manual_seed(0)
    model = Everything().train()
    with checking_equivariance(model, dim=1):
        for _ in range(3):
            model(torch.randn(B, N, D)).sum().backward()


def _transformer_losses(mode: bool) -> list[float]:
    torch.manual_seed(0)
    with slim_mha.patched():
        model = nn.Transformer(D, HEADS, 1, 1, 32, dropout=0.1, batch_first=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    mask = nn.Transformer.generate_square_subsequent_mask(N - 1)
    losses = []
    for _ in range(4):
        source, target = torch.randn(B, N, D, generator=generator), torch.randn(B, N - 1, D, generator=generator)
        if mode:  # the target's tokens move, its mask with them on both axes; the source stays put
            with checking_equivariance(model, every=1, dim={"tgt": 1, "tgt_mask": (0, 1)}):
                loss = model(source, target, tgt_mask=mask).square().mean()
        else:
            loss = model(source, target, tgt_mask=mask).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_training_nn_transformer_under_the_mode_changes_no_loss_bit_for_bit(measured):
    assert _transformer_losses(mode=True) == _transformer_losses(mode=False)
    assert len(measured) == 4


def test_the_whole_transformer_with_one_set_axis_for_source_and_target():
    torch.manual_seed(0)
    model = nn.Transformer(D, HEADS, 1, 1, 32, dropout=0.1, batch_first=True)
    with checking_equivariance(model, dim=1):  # no mask: permuting both sets permutes the output
        model(torch.randn(B, N, D), torch.randn(B, N, D)).sum().backward()


# ----------------------------------------------------------------- sampling and conditions


def test_every_checks_the_first_call_then_every_nth(measured):
    torch.manual_seed(0)
    model = SetModel(positions=False)
    inputs = [torch.randn(B, N, D) for _ in range(7)]
    with checking_equivariance(model, every=3, dim=1):
        for x in inputs:
            model(x)
    assert [next(i for i, x in enumerate(inputs) if x is seen[0]) for seen in measured] == [0, 3, 6]


def test_per_call_checks_go_on_in_the_same_block_and_the_reruns_are_not_checked(record_checks, measured):
    checked = record_checks(lambda check: check.module)
    torch.manual_seed(0)
    model = SetModel(positions=False)
    with checking_equivariance(model, dim=1):
        model(torch.randn(B, N, D))
        model(torch.randn(B, N, D))
    assert checked == [model.attention, model.attention]  # once per user call, not in the model's reruns
    assert len(measured) == 2


def test_a_leaking_attention_is_still_caught_by_its_own_call_check():
    class Leak(SlimMultiheadAttention):
        def _slim_general(self, call, dropout_p=None, plan=None):
            output, weights = super()._slim_general(call, dropout_p)
            return output + torch.arange(output.shape[1], dtype=output.dtype).view(1, -1, 1), weights

    torch.manual_seed(0)
    model = SetModel(positions=False)
    model.attention = Leak(D, HEADS, batch_first=True)
    with pytest.raises(EquivarianceError, match="Leak 'attention' is not permutation-equivariant on this call"):
        with checking_equivariance(model, dim=1):
            model(torch.randn(B, N, D))


def test_nested_scopes_apply_the_innermost_and_restore_the_outer(measured):
    torch.manual_seed(0)
    model = SetModel()
    x = torch.randn(B, N, D)
    with checking_equivariance(model, dim=1):
        with checking_equivariance(model, dim=1, every=2):
            with pytest.raises(EquivarianceError):
                model(x)
            model(x)  # the inner scope's second call: not due
        with checking_equivariance(model), pytest.raises(EquivarianceError):  # no dim: the outer one's goes on
            model(x)
        with pytest.raises(EquivarianceError):
            model(x)
    model(x)  # outside every scope
    assert len(measured) == 3
    assert not model._forward_hooks


def test_scopes_are_local_to_their_thread(measured):
    torch.manual_seed(0)
    model = SetModel()
    x = torch.randn(B, N, D)
    errors = []
    with checking_equivariance(model, dim=1):
        worker = threading.Thread(target=lambda: errors.append(model(x)))
        worker.start()
        worker.join()
        assert len(errors) == 1 and measured == []
        with pytest.raises(EquivarianceError):
            model(x)


@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning", "ignore:There is a performance drop"
)
def test_compile_trace_and_vmap_skip_the_check(measured):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SetModel()
    x = torch.randn(B, N, D)
    with checking_equivariance(model, dim=1):
        compiled = torch.compile(model, backend="eager")
        torch.testing.assert_close(compiled(x), model.forward(x))
        traced = torch.jit.trace(model, (x,), check_trace=False)
        torch.testing.assert_close(traced(x), model.forward(x))
        torch.func.vmap(model)(x.unsqueeze(0).expand(3, -1, -1, -1))
        assert measured == []
        with pytest.raises(EquivarianceError):
            model(x)  # eager calls still check


def test_the_environment_variable_does_not_check_models(monkeypatch, measured):
    from slim_mha.equivariance import _mode

    _mode.reset(environment="1")
    torch.manual_seed(0)
    model = SetModel()
    model(torch.randn(B, N, D))  # attention calls are checked; the model is not
    assert measured == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(dim=1), r"dim is the model's set axis, and no model was given"),
        (dict(model=nn.Linear(2, 2), invariant=True), r"invariant=True says how .* give that axis as dim too"),
        (dict(model=nn.Linear(2, 2), dim="1"), r"dim must be the model's set axis: an int"),
        (dict(model=nn.Linear(2, 2), dim=(1, "rows")), r"dim entry 'rows' is not understood"),
        (dict(model=nn.Linear(2, 2), dim=1, invariant=1), r"invariant must be True or False, got 1"),
    ],
)
def test_bad_options_raise_before_the_block(options, message):
    with pytest.raises(ValueError, match=message):
        with checking_equivariance(**options):
            pass


def test_inputs_that_do_not_fit_dim_say_which_call_and_input():
    torch.manual_seed(0)
    model = SetModel()
    with pytest.raises(
        ValueError,
        match=r"checking_equivariance\(SetModel, dim=\{'y': 1\}\): call 1 of SetModel "
        r"has no input 'y'; its inputs are \['x'\]",
    ):
        with checking_equivariance(model, dim={"y": 1}):
            model(torch.randn(B, N, D))

    class Indexed(nn.Module):
        def forward(self, x, index):  # index (B, K): an integer input with the token axis but not its length
            return x.sum(dim=1) + index.sum()

    indexed = Indexed()
    with pytest.raises(
        ValueError,
        match=r"call 1 of Indexed: input 1 \(2, 3\) int64 is read as token indices \(an integer "
        r"tensor without 6 tokens along the permuted axis\).* from 0 to 40, outside 0..5",
    ):
        with checking_equivariance(indexed, dim=1, invariant=True):
            indexed(torch.randn(B, N, D), torch.tensor([[0, 1, 40], [2, 3, 4]]))


def test_the_python_blocks_of_docs_equivariance_run_as_written(capsys):
    path = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "equivariance.md")
    with open(path, encoding="utf-8") as file:
        text = file.read()
    blocks = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]
    assert len(blocks) == 3
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/equivariance.md block {index}", "exec"), {"__name__": f"docs_block_{index}"})
    printed = capsys.readouterr().out
    assert "the break is in the code in `SetModel.forward` between `embed` (call 1) and `attention` (call 1)" in printed
    assert "module_name: ''" in printed


def test_functional_dropout_left_on_would_be_a_false_alarm(monkeypatch):
    """Why the comparison zeroes functional dropout: its random mask does not follow the tokens."""
    from slim_mha.equivariance import _checker

    class PassThrough(_checker._CheckRuns):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(_checker, "_CheckRuns", PassThrough)
    torch.manual_seed(0)
    model = Everything().train()
    with pytest.raises(EquivarianceError), checking_equivariance(model, dim=1):
        model(torch.randn(B, N, D))
