"""The assertion mode of SlimMultiheadAttention: switching it, what a checked call checks, its side effects.

Broken modules are subclasses whose ``_slim_general`` leaks token positions: the check must catch them in
every configuration, and must stay silent on correct modules in every configuration and dtype.
"""

from __future__ import annotations

import inspect
import os
import pickle
import random
import re
import subprocess
import sys
import textwrap
import threading
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from slim_mha import EquivarianceError, SlimMultiheadAttention, checking_equivariance
from slim_mha._matrix import APPENDED, ATTENTION_KINDS, WEIGHTS, appended_options
from slim_mha._stock_checks import AttentionCall
from slim_mha.equivariance import ENVIRONMENT_VARIABLE, _mode
from slim_mha.equivariance._measure import draw_permutation

from _reference import attention_tokens

E, H, KDIM, VDIM = 16, 4, 10, 12
L_TGT, S_SRC, BATCH = 5, 7, 3


pytestmark = pytest.mark.usefixtures("fresh_equivariance_mode")  # tests/conftest.py


@pytest.fixture
def checks(record_checks) -> list:
    """Records each call that was actually checked (the module), in order."""
    return record_checks(lambda check: check.module)


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

    def _slim_general(self, call, dropout_p=None, plan=None):
        output, weights = super()._slim_general(call, dropout_p)
        return output + _ramp(output, _token_axis(self, call.query), 0.5), weights


class KeyPositionLeak(SlimMultiheadAttention):
    """Adds each key's position to the key: reordering keys and values changes the output."""

    def _slim_general(self, call, dropout_p=None, plan=None):
        key = call.key + _ramp(call.key, _token_axis(self, call.key), 2.0)
        return super()._slim_general(call._replace(key=key), dropout_p)


class WeightColumnLeak(SlimMultiheadAttention):
    """Returns the right output but weights whose columns are rolled by one."""

    def _slim_general(self, call, dropout_p=None, plan=None):
        output, weights = super()._slim_general(call, dropout_p)
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
        **appended_options(case.appended),
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
        kind=rng.choice(ATTENTION_KINDS),
        appended=rng.choice(APPENDED),
        mask_kind=mask_kind,
        key_padding_mask=rng.random() < 0.5,
        attn_mask=rng.choice(["none", "2d", "3d"]),
        weights=rng.choice(WEIGHTS),
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


QUERY_LEAK = "permuting the queries does not permute the output rows"
KEY_LEAK = "permuting the keys and values together changes the output"
WEIGHT_LEAK = r"(?m)^  weights: "


@pytest.mark.parametrize("case", TARGETED + SWEEP, ids=lambda case: f"{case}")
def test_correct_calls_pass_and_broken_ones_raise(case, checks):
    inputs = make_inputs(case)
    with checking_equivariance():
        build(case)(**inputs)
        assert len(checks) == 1
        with pytest.raises(EquivarianceError, match=QUERY_LEAK):
            build(case, QueryPositionLeak)(**inputs)
        with pytest.raises(EquivarianceError, match=KEY_LEAK):
            build(case, KeyPositionLeak)(**inputs)
        if case.weights != "none":
            with pytest.raises(EquivarianceError, match=WEIGHT_LEAK):
                build(case, WeightColumnLeak)(**inputs)


def assert_every_leak_is_caught(case: Case, seeds, monkeypatch) -> None:
    """Each leak raises whatever permutations the check draws: the seeds are forced, one per call."""
    __tracebackhide__ = True
    inputs = make_inputs(case)
    leaks = {QueryPositionLeak: QUERY_LEAK, KeyPositionLeak: KEY_LEAK, WeightColumnLeak: WEIGHT_LEAK}
    if case.weights == "none":
        del leaks[WeightColumnLeak]
    modules = {build(case, cls, check_equivariance=True): message for cls, message in leaks.items()}
    for seed in seeds:
        monkeypatch.setattr(_mode, "_next_seed", lambda seed=seed: seed)
        for module, message in modules.items():
            with pytest.raises(EquivarianceError, match=message):
                module(**inputs)


def test_every_drawn_permutation_catches_the_leaks_of_sweep_case_7(monkeypatch):
    # Sweep case 7 (5 tokens) once passed WeightColumnLeak: a check whose key permutation was a
    # cyclic shift cannot tell columns rolled by one from correct ones (rolling then permuting by a
    # shift equals permuting then rolling). Which seed a test got depended on the checks run before
    # it in the process; seeds 11 and 23 were two of those that missed the leak.
    assert_every_leak_is_caught(SWEEP[7], range(40), monkeypatch)


@pytest.mark.slow  # 32 cases x 20 seeds x 3 leaks: minutes under load
@pytest.mark.parametrize("case", TARGETED + SWEEP, ids=lambda case: f"{case}")
def test_every_drawn_permutation_catches_the_leaks(case, monkeypatch):
    assert_every_leak_is_caught(case, range(20), monkeypatch)


def _cycle_lengths(permutation: torch.Tensor) -> list[int]:
    unseen, lengths = set(range(permutation.numel())), []
    while unseen:
        position, length = unseen.pop(), 1
        follower = int(permutation[position])
        while follower != position:
            unseen.remove(follower)
            follower, length = int(permutation[follower]), length + 1
        lengths.append(length)
    return sorted(lengths)


@pytest.mark.parametrize("length", [4, 5, 6, 7, 8, 9, 12, 16, 30])
def test_drawn_permutations_are_one_cycle_commuting_with_no_shift_and_not_with_the_reversal(length):
    positions = torch.arange(length)
    blind_spots = [positions.roll(shift) for shift in range(1, length)] + [positions.flip(0)]
    for seed in range(100):
        permutation = draw_permutation(length, seed)
        assert torch.equal(permutation, draw_permutation(length, seed))
        assert _cycle_lengths(permutation) == [length], (seed, permutation)  # every token moves, in one cycle
        for other in blind_spots:
            assert not torch.equal(permutation[other], other[permutation]), (seed, permutation, other)


def test_drawn_permutations_of_2_and_3_tokens_are_every_one_but_the_identity():
    assert {tuple(draw_permutation(2, seed).tolist()) for seed in range(20)} == {(1, 0)}
    drawn = {tuple(draw_permutation(3, seed).tolist()) for seed in range(100)}
    assert drawn == {(0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)}
    assert draw_permutation(1, 0).tolist() == [0] and draw_permutation(0, 0).numel() == 0


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


ACCEPTED = (
    r"SLIM_MHA_CHECK_EQUIVARIANCE='yes2' is not understood: use 1 \(or true, yes, on\) to check every slim "
    r"attention call, N > 1 to check every N-th call of each module, or 0 \(or false, no, off, or unset\) "
    r"to turn checking off$"
)


def test_a_bad_environment_value_is_reported_at_first_use_not_when_configured(checks):
    _mode._configure_environment("yes2")  # what importing slim_mha does: it must not raise
    assert _mode.SWITCH.active  # so that the next call comes to the check and reports it
    module = build(Case())
    for _ in range(2):  # every call that follows the variable says so, not just the first
        with pytest.raises(ValueError, match=ACCEPTED):
            module(**make_inputs(Case()))
    build(Case(), check_equivariance=False)(**make_inputs(Case()))  # opted out: the variable is not read
    with checking_equivariance():  # a scope decides for itself: the variable is not read
        module(**make_inputs(Case()))
    assert checks == [module]


@pytest.mark.parametrize("value", ["yes2", "-1", "1.5", "every"])
def test_environment_values_that_are_not_understood(value):
    _mode._configure_environment(value)
    with pytest.raises(ValueError, match=rf"SLIM_MHA_CHECK_EQUIVARIANCE={value!r} is not understood"):
        build(Case())(**make_inputs(Case()))


def test_a_zero_written_with_leading_zeros_is_off():
    _mode._configure_environment("00")
    assert _mode.SWITCH.active is False and _mode._environment_scope is None


def test_a_bad_environment_value_fails_no_import_and_no_cli():
    # A fresh interpreter: importing slim_mha (and the migration CLI's --help) must work, and the
    # first attention call gives the one-line error, not a traceback from the import.
    code = textwrap.dedent(
        """
        import contextlib, io, torch
        import slim_mha
        from slim_mha.migration.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as help_text:
            try:
                main(["--help"])
            except SystemExit as stop:
                assert stop.code == 0, stop.code
        assert "usage" in help_text.getvalue()
        x = torch.randn(2, 5, 8)
        try:
            slim_mha.SlimMultiheadAttention(8, 2, batch_first=True)(x, x, x)
        except ValueError as error:
            print(error)
        """
    )
    environment = {**os.environ, ENVIRONMENT_VARIABLE: "yes2"}
    completed = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    assert re.fullmatch(ACCEPTED.replace("$", ""), completed.stdout.strip())


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
            def _slim_general(self, call, dropout_p=None, plan=None):
                output, weights = super()._slim_general(call, dropout_p)
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
    assert "query (3, 5, 16), key (3, 7, 16), value (3, 7, 16), tokens on dim 1 (batch_first=True)" in message
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


class PositionalBias(SlimMultiheadAttention):
    """Adds a bias by query/key distance (ALiBi-like) to the mask: a mask that does not follow the tokens."""

    def _slim_general(self, call, dropout_p=None, plan=None):
        query, key, attn_mask = call.query, call.key, call.attn_mask
        axis = _token_axis(self, query)
        rows = torch.arange(query.shape[axis], dtype=query.dtype)
        columns = torch.arange(key.shape[axis], dtype=query.dtype)
        bias = -(rows.view(-1, 1) - columns.view(1, -1)).abs()  # (L, S), fixed by position
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(attn_mask, float("-inf"))
        attn_mask = bias if attn_mask is None else attn_mask + bias
        return super()._slim_general(call._replace(attn_mask=attn_mask, is_causal=False), dropout_p)


def causal_inputs(case: Case, mask_dtype: torch.dtype | None = None, **overrides) -> dict:
    inputs = make_inputs(case)
    inputs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L_TGT, dtype=mask_dtype or case.dtype)
    if mask_dtype == torch.bool:
        inputs["attn_mask"] = inputs["attn_mask"].isinf()
    inputs.update(is_causal=True, need_weights=False)
    inputs.update(overrides)
    return inputs


@pytest.mark.parametrize(
    "case, options",
    [
        (Case(kind="self"), {}),  # the hint path: SDPA's causal kernel, no mask
        (Case(kind="self", batch_first=False), dict(need_weights=True)),  # weights: the mask is used
        (Case(kind="self", key_padding_mask=True, mask_kind="float"), {}),  # padding: the mask is used
        (Case(kind="self", training=True), {}),  # dropout: a dropout-free reference is recomputed
        (Case(kind="self", dtype=torch.float32, appended="both"), dict(mask_dtype=torch.bool)),
        (Case(kind="self", batched=False), {}),
    ],
    ids=str,
)
def test_a_causal_call_with_a_mask_is_checked_with_the_mask_following_the_tokens(case, options, checks):
    inputs = causal_inputs(case, **options)
    module = build(case, check_equivariance=True)
    module(**inputs)
    assert checks == [module]
    with pytest.raises(EquivarianceError, match=r"PositionalBias\(.*\) .*is not permutation-equivariant on this call"):
        build(case, PositionalBias, check_equivariance=True)(**inputs)


def test_a_causal_call_reports_its_hint():
    with pytest.raises(EquivarianceError) as caught:
        build(Case(kind="self"), PositionalBias, check_equivariance=True)(**causal_inputs(Case(kind="self")))
    assert (
        "is_causal=True (a hint: the check permutes attn_mask, so a mask that is not the causal one shows up "
        "here as a break)" in str(caught.value)
    )


def test_a_hint_that_does_not_match_the_mask_is_caught():
    # is_causal=True with a mask that is not causal: stock and slim use the causal kernel and ignore
    # the mask, so the output is not f(x, M); the check, which follows the mask, sees it.
    case = Case(kind="self")
    inputs = causal_inputs(case, attn_mask=torch.zeros(L_TGT, L_TGT, dtype=case.dtype))
    with pytest.raises(EquivarianceError, match=r"is_causal=True \(a hint"):
        build(case, check_equivariance=True)(**inputs)


def test_is_causal_without_a_mask_has_nothing_to_permute():
    # Stock's rules reject is_causal=True without a mask before any check; a direct call still refuses.
    case = Case(kind="self")
    module = build(case, check_equivariance=True)
    inputs = make_inputs(case)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        module(**{**inputs, "is_causal": True})
    query = inputs["query"]
    result = module(query, query, query, need_weights=False)
    with pytest.raises(
        EquivarianceError,
        match=r"is_causal=True and no attn_mask, which is order-dependent by "
        r"construction .* Pass the causal mask as attn_mask",
    ):
        _mode.check_call(module, result, AttentionCall(query, query, query, None, False, None, True, True))


def test_an_explicit_causal_mask_is_permuted_with_its_tokens(checks):
    # Without the is_causal hint, the mask is data: it moves with the tokens and the check passes.
    case = Case(kind="self")
    inputs = make_inputs(case)
    inputs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L_TGT, dtype=case.dtype)
    build(case, check_equivariance=True)(**inputs)
    assert len(checks) == 1


# --------------------------------------------------------------------------------- silent no-ops


def stock_model() -> nn.Module:
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, batch_first=True), 2, enable_nested_tensor=False)


def test_a_model_without_slim_attention_warns_once_and_points_to_patch_and_convert():
    model = stock_model()
    expected = (
        r"^checking_equivariance\(model\): TransformerEncoder has nothing to check: its 2 nn.MultiheadAttention "
        r"modules are stock and only slim attention checks its calls; build the model inside `with "
        r"slim_mha.patched\(\):` \(or after slim_mha.patch\(\)\), or convert it with slim_mha.convert\(model\)$"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with checking_equivariance(model):
                model(torch.randn(BATCH, L_TGT, E))
    assert len(caught) == 1 and caught[0].category is UserWarning
    assert re.match(expected, str(caught[0].message))
    assert caught[0].filename == __file__  # points at the `with` line, not at slim_mha
    with pytest.raises(ValueError, match=expected):
        with checking_equivariance(model, strict=True):
            pass
    assert _mode.SWITCH.active is False


def test_a_model_without_any_attention_and_one_whose_modules_opted_out_warn_too():
    with pytest.warns(UserWarning, match=r"Linear has nothing to check: it has no attention module and only slim"):
        with checking_equivariance(nn.Linear(E, E)):
            pass
    model = nn.Sequential(build(Case(), check_equivariance=False), build(Case(), check_equivariance=False))
    expected = r"Sequential has nothing to check: all its 2 slim attention modules opted out with check_equivariance"
    with pytest.raises(ValueError, match=expected):
        with checking_equivariance(model, strict=True):
            pass
    with pytest.raises(ValueError, match=r"strict must be True or False, got 'yes'"):
        with checking_equivariance(model, strict="yes"):
            pass


def test_patched_and_converted_models_do_not_warn(checks):
    import slim_mha

    with slim_mha.patched():
        patched = stock_model()
    converted = slim_mha.convert(stock_model())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for model in (patched, converted):
            with checking_equivariance(model, strict=True):
                model(torch.randn(BATCH, L_TGT, E))
    assert len(checks) == 4


# ----------------------------------------------------------------------------- no side effects


def _train_step(module: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    leaf = x.clone().requires_grad_()
    output, weights = module(leaf, leaf, leaf, key_padding_mask=mask)
    (output.square().sum() + weights.sum()).backward()
    grads = [leaf.grad] + [parameter.grad for parameter in module.parameters()]
    module.zero_grad(set_to_none=True)
    return [output.detach(), weights.detach()] + grads, torch.get_rng_state()


def test_outputs_gradients_and_rng_identical_with_the_mode_on_in_train_mode_with_dropout(checks, slims_own_paths):
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


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # functorch's fallback for SDPA
def test_functorch_transforms_skip_the_check(checks):
    module = build(Case(kind="self", dtype=torch.float32), check_equivariance=True)
    x = torch.randn(2, BATCH, L_TGT, E)
    attend = lambda x: module(x, x, x, need_weights=False)[0]  # noqa: E731
    mapped = torch.func.vmap(attend)(x)  # would draw random permutations inside vmap
    gradient = torch.func.grad(lambda x: attend(x).square().sum())(x[0])
    with checking_equivariance():
        torch.func.vmap(attend)(x)
    assert checks == []
    torch.testing.assert_close(mapped, torch.stack([attend(x[0]), attend(x[1])]))
    leaf = x[0].clone().requires_grad_()
    attend(leaf).square().sum().backward()
    torch.testing.assert_close(gradient, leaf.grad, rtol=1e-4, atol=1e-4)  # two layouts' rounding
    assert checks == [module] * 3  # eager calls still check


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
            # The tolerance is the call's own rounding against a float32 rerun, not the table's.
            with pytest.raises(
                EquivarianceError, match=f"{str(dtype).removeprefix('torch.')}: .* against a float32 rerun"
            ):
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
