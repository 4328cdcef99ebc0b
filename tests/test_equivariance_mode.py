"""The assertion mode of SlimMultiheadAttention: switching it, what a checked call checks, its side effects.

Broken modules are subclasses whose ``_attend`` leaks token positions: the check must catch them in
every configuration, and must stay silent on correct modules in every configuration and dtype.
"""

from __future__ import annotations

import inspect
import os
import pickle
import random
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from _reference import attention_tokens
from slim_mha import EquivarianceError, SlimMultiheadAttention, checking_equivariance
from slim_mha.equivariance import ENVIRONMENT_VARIABLE, TOLERANCE, _mode, draw_permutation

E, H, KDIM, VDIM = 16, 4, 10, 12
L_TGT, S_SRC, BATCH = 5, 7, 3


@pytest.fixture(autouse=True)
def environment_off():
    """Every test starts with the environment variable's mode off, whatever the shell set."""
    _mode._configure_environment(None)
    yield
    _mode._configure_environment(os.environ.get(ENVIRONMENT_VARIABLE))


@pytest.fixture
def checks(monkeypatch) -> list:
    """Records each call that was actually checked (the module), in order."""
    seen = []
    run = _mode._AttentionCheck.run

    def counting_run(self, result):
        seen.append(self.module)
        return run(self, result)

    monkeypatch.setattr(_mode._AttentionCheck, "run", counting_run)
    return seen


# ------------------------------------------------------------------------------ broken modules


def _token_axis(module: SlimMultiheadAttention, tensor: torch.Tensor) -> int:
    return 1 if tensor.dim() == 3 and module.batch_first else 0


def _ramp(tensor: torch.Tensor, axis: int, height: float) -> torch.Tensor:
    """``height * max|tensor| * position / length`` along ``axis``, broadcastable to ``tensor``.

    Scaled by the tensor's own magnitude (which permutations do not change), so the break is a
    fixed fraction of the signal, whatever the dtype and the weights.
    """
    shape = [1] * tensor.dim()
    shape[axis] = -1
    ramp = torch.linspace(0.0, height, tensor.shape[axis], dtype=tensor.dtype).view(shape)
    return ramp * tensor.detach().abs().amax()


class QueryPositionLeak(SlimMultiheadAttention):
    """Adds each query's position to its output row: the output no longer follows the queries."""

    def _attend(self, query, key, value, *args):
        output, weights = super()._attend(query, key, value, *args)
        return output + _ramp(output, _token_axis(self, query), 0.5), weights


class KeyPositionLeak(SlimMultiheadAttention):
    """Adds each key's position to the key: reordering keys and values changes the output."""

    def _attend(self, query, key, value, *args):
        return super()._attend(query, key + _ramp(key, _token_axis(self, key), 2.0), value, *args)


class WeightColumnLeak(SlimMultiheadAttention):
    """Returns the right output but weights whose columns are rolled by one."""

    def _attend(self, query, key, value, *args):
        output, weights = super()._attend(query, key, value, *args)
        return output, None if weights is None else weights.roll(1, dims=-1)


# ------------------------------------------------------------------------- configuration matrix


@dataclass(frozen=True)
class Case:
    batch_first: bool = True
    batched: bool = True
    kind: str = "cross"  # self, cross_shared_kv, cross, kdim_vdim
    appended: str = "none"  # none, bias_kv, zero_attn, both
    mask_kind: str = "none"  # none, bool, float (for both masks)
    key_padding_mask: bool = False
    attn_mask: str = "none"  # none, 2d, 3d
    weights: str = "averaged"  # none, averaged, per_head
    training: bool = False
    dtype: torch.dtype = torch.float64
    seed: int = 0


def build(case: Case, cls=SlimMultiheadAttention, **options) -> SlimMultiheadAttention:
    torch.manual_seed(case.seed)
    kwargs = dict(
        add_bias_kv=case.appended in ("bias_kv", "both"),
        add_zero_attn=case.appended in ("zero_attn", "both"),
        batch_first=case.batch_first,
        dropout=0.25 if case.training else 0.0,
    )
    if case.kind == "kdim_vdim":
        kwargs.update(kdim=KDIM, vdim=VDIM)
    module = cls(E, H, **kwargs, **options).to(case.dtype)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
    return module.train(case.training)


def make_inputs(case: Case) -> dict:
    generator = torch.Generator().manual_seed(case.seed + 1)

    query, key, value = attention_tokens(
        case.kind,
        batched=case.batched,
        batch_first=case.batch_first,
        dtype=case.dtype,
        generator=generator,
        batch=BATCH,
        tgt_len=L_TGT,
        src_len=S_SRC,
        embed_dim=E,
        kdim=KDIM,
        vdim=VDIM,
    )
    source = L_TGT if case.kind == "self" else S_SRC
    inputs = dict(query=query, key=key, value=value)
    batch = (BATCH,) if case.batched else ()
    if case.key_padding_mask:
        padded = torch.rand(*batch, source, generator=generator) < 0.4
        padded[..., 0] = False  # no fully masked row
        inputs["key_padding_mask"] = _as_mask(padded, case, generator)
    if case.attn_mask != "none":
        leading = ((BATCH if case.batched else 1) * H,) if case.attn_mask == "3d" else ()
        blocked = torch.rand(*leading, L_TGT, source, generator=generator) < 0.3
        blocked[..., 0] = False
        inputs["attn_mask"] = _as_mask(blocked, case, generator)
    inputs["need_weights"] = case.weights != "none"
    inputs["average_attn_weights"] = case.weights == "averaged"
    return inputs


def _as_mask(blocked: torch.Tensor, case: Case, generator: torch.Generator) -> torch.Tensor:
    if case.mask_kind == "bool":
        return blocked
    additive = torch.randn(blocked.shape, generator=generator, dtype=torch.float64).to(case.dtype) * 0.5
    return additive.masked_fill(blocked, float("-inf"))


def random_case(rng: random.Random, seed: int, dtype: torch.dtype = torch.float64) -> Case:
    mask_kind = rng.choice(["bool", "float"])
    return Case(
        batch_first=rng.random() < 0.5,
        batched=rng.random() < 0.75,
        kind=rng.choice(["self", "cross_shared_kv", "cross", "kdim_vdim"]),
        appended=rng.choice(["none", "bias_kv", "zero_attn", "both"]),
        mask_kind=mask_kind,
        key_padding_mask=rng.random() < 0.5,
        attn_mask=rng.choice(["none", "2d", "3d"]),
        weights=rng.choice(["none", "averaged", "per_head"]),
        training=rng.random() < 0.3,
        dtype=dtype,
        seed=seed,
    )


SWEEP = [random_case(random.Random(index), index, (torch.float64, torch.float32)[index % 2]) for index in range(24)]
TARGETED = [
    Case(),
    Case(kind="self", batch_first=False),
    Case(batched=False, kind="self", key_padding_mask=True, mask_kind="bool", attn_mask="3d"),
    Case(batched=False, kind="cross", attn_mask="2d", mask_kind="float", weights="per_head"),
    Case(appended="both", key_padding_mask=True, mask_kind="bool", attn_mask="2d", weights="per_head"),
    Case(appended="bias_kv", kind="kdim_vdim", batch_first=False, attn_mask="3d", mask_kind="float"),
    Case(appended="zero_attn", kind="cross_shared_kv", key_padding_mask=True, mask_kind="float", weights="none"),
    Case(kind="self", training=True, key_padding_mask=True, mask_kind="bool", weights="averaged"),
]


@pytest.mark.parametrize("case", TARGETED + SWEEP, ids=lambda case: f"{case}")
def test_correct_calls_pass_and_broken_ones_raise(case, checks):
    inputs = make_inputs(case)
    with checking_equivariance():
        build(case)(**inputs)
        assert len(checks) == 1
        with pytest.raises(EquivarianceError, match="permuting the queries does not permute the output rows"):
            build(case, QueryPositionLeak)(**inputs)
        with pytest.raises(EquivarianceError, match="permuting the keys and values together changes the output"):
            build(case, KeyPositionLeak)(**inputs)
        if case.weights != "none":
            with pytest.raises(EquivarianceError, match=r"(?m)^  weights: "):
                build(case, WeightColumnLeak)(**inputs)


# -------------------------------------------------------------------------------- switching it on


def test_positional_signature_is_stock_and_the_options_are_keyword_only():
    stock = inspect.signature(nn.MultiheadAttention.__init__).parameters
    slim = inspect.signature(SlimMultiheadAttention.__init__).parameters
    assert list(slim)[: len(stock)] == list(stock)
    assert all(slim[name].default == stock[name].default for name in stock if name != "self")
    for name, default in (("check_equivariance", None), ("check_equivariance_every", 1)):
        assert slim[name].kind is inspect.Parameter.KEYWORD_ONLY and slim[name].default == default


def test_off_by_default(checks):
    module = build(Case())
    module(**make_inputs(Case()))
    assert module.check_equivariance is None and module.check_equivariance_every == 1
    assert checks == []


def test_constructor_option_and_attribute(checks):
    inputs = make_inputs(Case())
    module = build(Case(), check_equivariance=True)
    module(**inputs)
    assert checks == [module]
    module.check_equivariance = False
    module(**inputs)
    assert checks == [module]
    other = build(Case())
    other.check_equivariance = True
    other(**inputs)
    assert checks == [module, other]


def test_scope_checks_every_module_in_it_and_stops_after(checks):
    inputs = make_inputs(Case())
    first, second = build(Case()), build(Case())
    with checking_equivariance():
        first(**inputs)
        second(**inputs)
    first(**inputs)
    assert checks == [first, second]


def test_false_opts_a_module_out_of_scopes_and_the_environment(checks):
    inputs = make_inputs(Case())
    exempt = build(Case(), QueryPositionLeak, check_equivariance=False)
    with checking_equivariance():
        exempt(**inputs)
    _mode._configure_environment("1")
    exempt(**inputs)
    assert checks == []


def test_sampling_every_n_calls_starting_with_the_first(checks):
    inputs = make_inputs(Case())
    module = build(Case(), check_equivariance=True, check_equivariance_every=3)
    for _ in range(10):
        module(**inputs)
    assert len(checks) == 4  # calls 0, 3, 6, 9

    checks.clear()
    scoped = build(Case())
    with checking_equivariance(every=4):
        for _ in range(10):
            scoped(**inputs)
        with checking_equivariance(every=1):  # the innermost scope's period applies
            scoped(**inputs)  # call 10
            scoped(**inputs)  # call 11
    assert len(checks) == 3 + 2


def test_a_sampled_check_still_catches_a_broken_module():
    inputs = make_inputs(Case())
    broken = build(Case(), QueryPositionLeak, check_equivariance=True, check_equivariance_every=5)
    with pytest.raises(EquivarianceError):
        broken(**inputs)  # the first call is always checked
    for _ in range(4):
        broken(**inputs)
    with pytest.raises(EquivarianceError):
        broken(**inputs)


@pytest.mark.parametrize(
    ("value", "every"),
    [("1", 1), ("true", 1), ("ON", 1), ("8", 8), ("0", None), ("", None), ("off", None), (None, None)],
)
def test_environment_variable_values(value, every):
    _mode._configure_environment(value)
    assert _mode.SWITCH.active is (every is not None)
    assert (_mode._environment_scope.every if _mode._environment_scope else None) == every


def test_environment_variable_rejects_other_values():
    with pytest.raises(ValueError, match=r"SLIM_MHA_CHECK_EQUIVARIANCE='maybe' is not understood: use 1 to check"):
        _mode._configure_environment("maybe")


def test_environment_variable_switches_every_module_on(checks):
    _mode._configure_environment("2")
    module = build(Case())
    for _ in range(4):
        module(**make_inputs(Case()))
    assert len(checks) == 2


@pytest.mark.slow  # a fresh interpreter imports torch: a few seconds
def test_environment_variable_end_to_end():
    code = textwrap.dedent(
        """
        import torch
        from slim_mha import EquivarianceError, SlimMultiheadAttention

        class Leak(SlimMultiheadAttention):
            def _attend(self, query, *args):
                output, weights = super()._attend(query, *args)
                return output + torch.arange(output.shape[1], dtype=output.dtype).view(1, -1, 1), weights

        x = torch.randn(2, 5, 8)
        SlimMultiheadAttention(8, 2, batch_first=True)(x, x, x)
        try:
            Leak(8, 2, batch_first=True)(x, x, x)
        except EquivarianceError:
            print("raised")
        """
    )
    environment = {**os.environ, ENVIRONMENT_VARIABLE: "1"}
    command = [sys.executable, "-c", code]
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "raised"


def test_scopes_are_local_to_their_thread(checks):
    inputs = make_inputs(Case())
    module = build(Case())
    with checking_equivariance():
        worker = threading.Thread(target=lambda: module(**inputs))
        worker.start()
        worker.join()
        assert checks == []
        module(**inputs)
    assert checks == [module]
    assert _mode.SWITCH.active is False


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(check_equivariance="yes"), "check_equivariance must be True, False or None"),
        (dict(check_equivariance=1), "check_equivariance must be True, False or None"),
        (dict(check_equivariance_every=0), r"check_equivariance_every must be an int >= 1 .*got 0"),
        (dict(check_equivariance_every=2.5), r"check_equivariance_every must be an int >= 1 .*got 2.5"),
    ],
)
def test_constructor_rejects_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        SlimMultiheadAttention(E, H, **options)


def test_scope_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"every must be an int >= 1 \(1 checks every call, N every N-th call\)"):
        with checking_equivariance(every=0):
            pass
    with pytest.raises(ValueError, match="model must be an nn.Module"):
        with checking_equivariance("model"):
            pass
    assert _mode.SWITCH.active is False


def test_an_invalid_period_set_on_the_attribute_is_reported():
    module = build(Case(), check_equivariance=True)
    module.check_equivariance_every = 0
    with pytest.raises(ValueError, match="check_equivariance_every must be an int >= 1"):
        module(**make_inputs(Case()))


# ------------------------------------------------------------------------------------ the error


def test_error_names_the_module_the_output_the_errors_and_the_permutations():
    model = nn.Module()
    model.blocks = nn.ModuleList([build(Case()), build(Case(), QueryPositionLeak)])
    inputs = make_inputs(Case())
    with checking_equivariance(model), pytest.raises(EquivarianceError) as caught:
        model.blocks[1](**inputs)
    error = caught.value
    message = str(error)
    assert isinstance(error, AssertionError)
    assert message.startswith("QueryPositionLeak 'blocks.1' is not permutation-equivariant on this call")
    assert "  output: permuting the queries does not permute the output rows: max abs error" in message
    assert "> tolerance" in message and "(float64: 1e-10 x max|output|" not in message
    assert "(float64: 1e-10 x max|expected|" in message and "max rel error" in message
    assert "weights:" not in message  # the leak is in the output only
    assert f"query (3, 5, 16), key (3, 7, 16), value (3, 7, 16), tokens on dim 1 (batch_first=True)" in message
    assert error.module_name == "blocks.1"
    assert [e.name for e in error.errors] == ["output"] and error.errors[0].max_rel > 1e-2
    assert f"reproduce: seed {error.seed} drew query permutation" in message
    assert torch.equal(error.permutations["query"], draw_permutation(L_TGT, error.seed))
    assert torch.equal(error.permutations["key/value"], draw_permutation(S_SRC, error.seed + 1))


def test_error_reports_broken_weights():
    with pytest.raises(EquivarianceError) as caught:
        build(Case(), WeightColumnLeak, check_equivariance=True)(**make_inputs(Case()))
    message = str(caught.value)
    assert "  weights: permuting the keys and values together does more than permute the weight columns" in message
    assert "  output:" not in message
    assert [error.name for error in caught.value.errors] == ["weights"]


def test_error_without_a_model_says_how_to_get_the_name():
    with pytest.raises(EquivarianceError, match=r"pass the model to slim_mha.checking_equivariance\(model\)"):
        build(Case(), KeyPositionLeak, check_equivariance=True)(**make_inputs(Case()))


def test_error_survives_pickling():
    with pytest.raises(EquivarianceError) as caught:
        build(Case(), QueryPositionLeak, check_equivariance=True)(**make_inputs(Case()))
    copy = pickle.loads(pickle.dumps(caught.value))
    assert str(copy) == str(caught.value) and copy.seed == caught.value.seed
    assert torch.equal(copy.permutations["query"], caught.value.permutations["query"])


def test_is_causal_is_order_dependent_by_construction():
    case = Case(kind="self")
    inputs = make_inputs(case)
    inputs.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(L_TGT, dtype=case.dtype), is_causal=True)
    inputs["need_weights"] = False
    with pytest.raises(EquivarianceError, match=r"is_causal=True, which is order-dependent by construction"):
        build(case, check_equivariance=True)(**inputs)
    with checking_equivariance():
        build(case, check_equivariance=False)(**inputs)  # the way out: exempt the module


def test_an_explicit_causal_mask_is_permuted_with_its_tokens(checks):
    # Without the is_causal hint, the mask is data: it moves with the tokens and the check passes.
    case = Case(kind="self")
    inputs = make_inputs(case)
    inputs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L_TGT, dtype=case.dtype)
    build(case, check_equivariance=True)(**inputs)
    assert len(checks) == 1


# ----------------------------------------------------------------------------- no side effects


def _train_step(module: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    leaf = x.clone().requires_grad_()
    output, weights = module(leaf, leaf, leaf, key_padding_mask=mask)
    (output.square().sum() + weights.sum()).backward()
    grads = [leaf.grad] + [parameter.grad for parameter in module.parameters()]
    module.zero_grad(set_to_none=True)
    return [output.detach(), weights.detach()] + grads, torch.get_rng_state()


def test_outputs_gradients_and_rng_identical_with_the_mode_on_in_train_mode_with_dropout(checks):
    module = build(Case(training=True, dtype=torch.float32))
    assert module.dropout > 0 and module.training
    x = torch.randn(BATCH, L_TGT, E)
    mask = torch.zeros(BATCH, L_TGT, dtype=torch.bool)
    mask[:, -1] = True

    torch.manual_seed(123)
    off, rng_off = _train_step(module, x, mask)
    module.check_equivariance = True
    torch.manual_seed(123)
    on, rng_on = _train_step(module, x, mask)
    assert len(checks) == 1 and module.training
    assert torch.equal(rng_on, rng_off)
    for tensor_on, tensor_off in zip(on, off):
        assert torch.equal(tensor_on, tensor_off)


def test_global_rng_is_not_consumed(checks):
    module = build(Case(), check_equivariance=True)
    inputs = make_inputs(Case())
    before = torch.get_rng_state()
    module(**inputs)
    assert len(checks) == 1
    assert torch.equal(torch.get_rng_state(), before)


def _graph(root) -> list[str]:
    names, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sorted(names)


@pytest.mark.parametrize("training", [False, True])
def test_the_autograd_graph_is_the_same_with_the_mode_on(training, checks):
    module = build(Case(kind="self", training=training, dtype=torch.float32))
    x = torch.randn(BATCH, L_TGT, E, requires_grad=True)
    saved = []

    def run():
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            output, _ = module(x, x, x, need_weights=False)
        return _graph(output.grad_fn), list(saved)

    graph_off, saved_off = run()
    module.check_equivariance = True
    graph_on, saved_on = run()
    assert len(checks) == 1
    assert graph_on == graph_off and saved_on == saved_off


def test_works_under_no_grad_and_inference_mode(checks):
    module = build(Case(), check_equivariance=True)
    inputs = make_inputs(Case())
    with torch.no_grad():
        module(**inputs)
    with torch.inference_mode():
        module(**inputs)
    assert len(checks) == 2


def test_transformer_encoder_layer_with_slim_attention_in_train_mode(checks):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.1, batch_first=True)
    layer.self_attn = SlimMultiheadAttention(E, H, dropout=0.1, batch_first=True)
    x = torch.randn(BATCH, L_TGT, E)
    padding = torch.zeros(BATCH, L_TGT, dtype=torch.bool)
    padding[0, -2:] = True

    def step():
        torch.manual_seed(7)
        leaf = x.clone().requires_grad_()
        output = layer(leaf, src_key_padding_mask=padding)
        output.sum().backward()
        grads = [leaf.grad] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        return [output.detach()] + grads

    off = step()
    with checking_equivariance(layer):
        on = step()
    assert checks == [layer.self_attn]
    assert all(torch.equal(a, b) for a, b in zip(on, off))

    layer.self_attn = QueryPositionLeak(E, H, dropout=0.1, batch_first=True)
    with checking_equivariance(layer), pytest.raises(EquivarianceError) as caught:
        layer(x, src_key_padding_mask=padding)
    assert caught.value.module_name == "self_attn"
    assert "QueryPositionLeak 'self_attn'" in str(caught.value)


def test_compiled_module_skips_the_check_and_keeps_fullgraph(checks):
    torch._dynamo.reset()
    module = build(Case(kind="self", dtype=torch.float32), check_equivariance=True)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    x = torch.randn(BATCH, L_TGT, E)
    output, _ = compiled(x, x, x, need_weights=False)
    assert checks == []
    torch.testing.assert_close(output, module(x, x, x, need_weights=False)[0])
    assert len(checks) == 1  # eager calls still check


# --------------------------------------------------------------------------------- low precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_false_alarm_in_low_precision(dtype, checks):
    rng = random.Random(str(dtype))
    calls = 0
    for seed in range(40):
        case = random_case(rng, seed=seed, dtype=dtype)
        scale = rng.choice([0.5, 1.0, 2.0])  # larger weights: sharper softmax, larger rounding errors
        module = build(case, check_equivariance=True)
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.mul_(scale)
        module(**make_inputs(case))
        calls += 1
    assert len(checks) == calls


def test_no_false_alarm_under_bfloat16_autocast(checks):
    rng = random.Random(1)
    for seed in range(20):
        case = random_case(rng, seed=seed, dtype=torch.float32)
        module = build(case, check_equivariance=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module(**make_inputs(case))
    assert len(checks) == 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_still_catches_breaks(dtype):
    rng = random.Random(3)
    for seed in range(10):
        case = random_case(rng, seed=seed, dtype=dtype)
        for cls in (QueryPositionLeak, KeyPositionLeak):
            with pytest.raises(EquivarianceError, match=f"{str(dtype).removeprefix('torch.')}: {TOLERANCE[dtype]:.0e}"):
                build(case, cls, check_equivariance=True)(**make_inputs(case))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_jit_trace_skips_the_check(checks):
    module = build(Case(kind="self", dtype=torch.float32), check_equivariance=True)
    x = torch.randn(BATCH, L_TGT, E)
    with torch.no_grad():
        traced = torch.jit.trace(module, (x, x, x), check_trace=False)
        assert checks == []
        torch.testing.assert_close(traced(x, x, x), module(x, x, x))
    assert len(checks) == 1  # the eager call


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_false_alarm_in_low_precision_long_sweep(dtype, checks):
    """Many more seeds, longer sequences and sharper softmax than the default run."""
    rng = random.Random(f"long {dtype}")
    for seed in range(400):
        case = random_case(rng, seed=seed, dtype=dtype)
        module = build(case, check_equivariance=True)
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.mul_(rng.choice([0.5, 1.0, 2.0, 3.0]))
        inputs = make_inputs(case)
        repeat = rng.choice([1, 4, 16])  # longer sequences: tokens repeated with noise
        for name in ("query", "key", "value"):
            if repeat > 1 and not (name != "query" and case.kind == "self"):
                axis = 1 if case.batched and case.batch_first else 0
                inputs[name] = inputs[name].repeat_interleave(repeat, dim=axis)
                inputs[name] = inputs[name] + 0.1 * torch.randn_like(inputs[name])
        if case.kind == "self":
            inputs["key"] = inputs["value"] = inputs["query"]
        if repeat > 1:  # masks were drawn for the short sequences
            inputs.pop("key_padding_mask", None)
            inputs.pop("attn_mask", None)
        module(**inputs)
    assert len(checks) == 400


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_checks_without_touching_the_rng(dtype, checks):
    case = Case(kind="self", training=True, key_padding_mask=True, mask_kind="bool", dtype=dtype)
    module = build(case, check_equivariance=True).cuda()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_inputs(case).items()}
    inputs["key"] = inputs["value"] = inputs["query"]
    cpu_before, cuda_before = torch.get_rng_state(), torch.cuda.get_rng_state()
    module.eval()(**inputs)
    assert torch.equal(torch.get_rng_state(), cpu_before) and torch.equal(torch.cuda.get_rng_state(), cuda_before)
    module.train()(**inputs)
    with pytest.raises(EquivarianceError):
        build(case, QueryPositionLeak, check_equivariance=True).cuda()(**inputs)
    assert len(checks) == 2
