"""SlimMultiheadAttention against stock nn.MultiheadAttention built from the same weights.

Every comparison runs both modules on the same inputs and compares the output, the attention
weights, and the gradients with respect to the inputs and to every parameter slim keeps, with a
tolerance chosen by dtype.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from slim_mha import SlimMultiheadAttention
from slim_mha._matrix import APPENDED, ATTENTION_KINDS, MODES, WEIGHTS
from slim_mha.bias import fold_key_bias, fold_value_bias_into_output

from _reference import TOLERANCE, attention_tokens

E, H, KDIM, VDIM = 16, 4, 10, 12
L_TGT, S_SRC, BATCH = 5, 6, 3

# TOLERANCE is relative to the largest magnitude of the reference tensor (see assert_close_scaled).

MASKS = ("none", "bool", "float")
ATTN_MASKS = ("none", "2d_bool", "2d_float", "3d_bool", "3d_float")


@dataclass(frozen=True)
class Case:
    batch_first: bool = True
    batched: bool = True
    kind: str = "self"
    bias: bool = True
    appended: str = "none"
    key_padding_mask: str = "none"
    attn_mask: str = "none"
    is_causal: bool = False
    weights: str = "averaged"
    mode: str = "train"
    dtype: torch.dtype = torch.float64
    seed: int = 0

    def module_kwargs(self) -> dict:
        kwargs = dict(
            bias=self.bias,
            add_bias_kv=self.appended in ("bias_kv", "both"),
            add_zero_attn=self.appended in ("zero_attn", "both"),
            batch_first=self.batch_first,
        )
        if self.kind == "kdim_vdim":
            kwargs.update(kdim=KDIM, vdim=VDIM)
        return kwargs


def build_pair(case: Case) -> tuple[nn.MultiheadAttention, SlimMultiheadAttention]:
    """Stock with every parameter random (so the key bias is non-zero), and slim loaded from it."""
    torch.manual_seed(case.seed)
    stock = nn.MultiheadAttention(E, H, **case.module_kwargs()).to(case.dtype)
    with torch.no_grad():
        for parameter in stock.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
    slim = SlimMultiheadAttention(E, H, **case.module_kwargs()).to(case.dtype)
    slim.load_state_dict(stock.state_dict(), strict=True)
    training = case.mode == "train"
    return stock.train(training), slim.train(training)


def make_inputs(case: Case) -> dict:
    """Query/key/value in the module's layout, and masks that never mask a whole row."""
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
    src_len = L_TGT if case.kind == "self" else S_SRC

    inputs = dict(query=query, key=key, value=value)
    batch_shape = (BATCH,) if case.batched else ()
    if case.key_padding_mask != "none":
        # Key 0 is never padded, so no row is fully masked.
        padded = torch.rand(*batch_shape, src_len, generator=generator) < 0.4
        padded[..., 0] = False
        inputs["key_padding_mask"] = _as_mask(padded, case.key_padding_mask, case.dtype, generator)
    if case.is_causal:
        # Top-left aligned, as SDPA's is_causal; boolean when the padding mask is, as stock asks.
        future = torch.ones(L_TGT, src_len, dtype=torch.bool).triu(1)
        as_float = torch.zeros(L_TGT, src_len, dtype=case.dtype).masked_fill(future, float("-inf"))
        inputs["attn_mask"] = future if case.key_padding_mask == "bool" else as_float
        inputs["is_causal"] = True
    elif case.attn_mask != "none":
        dims, kind = case.attn_mask.split("_")
        leading = ((BATCH if case.batched else 1) * H,) if dims == "3d" else ()
        blocked = torch.rand(*leading, L_TGT, src_len, generator=generator) < 0.3
        blocked[..., 0] = False
        inputs["attn_mask"] = _as_mask(blocked, kind, case.dtype, generator)
    inputs["need_weights"] = case.weights != "none"
    inputs["average_attn_weights"] = case.weights == "averaged"
    return inputs


def _as_mask(blocked: torch.Tensor, kind: str, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if kind == "bool":
        return blocked
    additive = torch.randn(blocked.shape, generator=generator, dtype=torch.float64).to(dtype) * 0.5
    return additive.masked_fill(blocked, float("-inf"))


def run(module: nn.MultiheadAttention, inputs: dict, case: Case, cotangent_seed: int) -> dict:
    """Forward (and backward in grad-enabled modes); returns every tensor to compare."""
    grad_mode = case.mode in ("train", "eval")
    leaves = {}
    call = dict(inputs)
    if grad_mode:
        # Fresh leaves per module, keeping the identity pattern (self-attention passes one tensor).
        copies = {}
        for name in ("query", "key", "value"):
            tensor = inputs[name]
            if id(tensor) not in copies:
                copies[id(tensor)] = tensor.detach().clone().requires_grad_()
            call[name] = leaves[name] = copies[id(tensor)]
    context = {
        "train": torch.enable_grad,
        "eval": torch.enable_grad,
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
    }[case.mode]
    with context():
        output, weights = module(**call)
    result = {"output": output.detach(), "weights": None if weights is None else weights.detach()}
    if grad_mode:
        generator = torch.Generator().manual_seed(cotangent_seed)
        cotangent = torch.randn(output.shape, generator=generator, dtype=torch.float64).to(output.dtype)
        grads = torch.autograd.grad(
            (output * cotangent).sum(),
            list(dict.fromkeys(leaves.values())) + [p for p in module.parameters()],
            allow_unused=True,
        )
        unique_leaves = list(dict.fromkeys(leaves.values()))
        for leaf, grad in zip(unique_leaves, grads):
            result["grad_" + next(n for n, t in leaves.items() if t is leaf)] = grad
        for (name, _), grad in zip(module.named_parameters(), grads[len(unique_leaves) :]):
            result["grad_param_" + name] = grad
    return result


def assert_close_scaled(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, slack: float = 0.0
) -> None:
    """max|actual - expected| <= tol * max(1, max|expected|) + slack, with tol from the dtype table."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    finite = torch.isfinite(expected.double())
    assert torch.equal(finite, torch.isfinite(actual.double())), f"{what}: non-finite entries differ"
    scale = max(1.0, expected.double()[finite].abs().max().item() if finite.any() else 1.0)
    error = _max_error(actual, expected)
    bound = TOLERANCE[dtype] * scale + slack
    assert error <= bound, f"{what}: max error {error:.3e} > {TOLERANCE[dtype]:.0e} * {scale:.3g} + {slack:.3g}"


def compare_with_stock(case: Case) -> None:
    """In fp64, slim must equal stock within the dtype tolerance.

    Below fp64 two correct implementations differ by their rounding, which a torch release can
    change (for gradients summed over a batch in bf16 it exceeds 1e-2 of the largest entry). There,
    both are measured against stock run in float64 on the same (rounded) weights and inputs, and
    slim may be at most twice as far from it as stock is, plus the dtype tolerance.
    """
    stock, slim = build_pair(case)
    inputs = make_inputs(case)
    expected = run(stock, inputs, case, case.seed + 2)
    actual = run(slim, inputs, case, case.seed + 2)
    assert set(actual) == set(expected), f"compared tensors differ: {set(actual) ^ set(expected)}"
    reference = None
    if case.dtype != torch.float64:
        exact_case = replace(case, dtype=torch.float64)
        exact_inputs = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
        for name in ("key", "value"):  # keep the self-attention identity after the cast
            for other in ("query", "key"):
                if inputs[name] is inputs[other]:
                    exact_inputs[name] = exact_inputs[other]
        reference = run(stock.double(), exact_inputs, exact_case, case.seed + 2)
    for name in sorted(expected):
        if expected[name] is None or actual[name] is None:
            assert expected[name] is None and actual[name] is None, f"{name}: one side is None ({case})"
        elif reference is None:
            assert_close_scaled(actual[name], expected[name], case.dtype, f"{name} [{case}]")
        else:
            stock_error = _max_error(expected[name], reference[name])
            assert_close_scaled(actual[name], reference[name], case.dtype, f"{name} [{case}]", slack=2 * stock_error)


def _max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    finite = torch.isfinite(expected)
    return (actual.double()[finite] - expected.double()[finite]).abs().max().item() if finite.any() else 0.0


# ------------------------------------------------------------------------------ the matrix

STRUCTURE = list(itertools.product((True, False), (True, False), ATTENTION_KINDS, (True, False), APPENDED, WEIGHTS))


@pytest.mark.parametrize(
    "batch_first,batched,kind,bias,appended,weights",
    STRUCTURE,
    ids=["-".join(map(str, combo)) for combo in STRUCTURE],
)
def test_structure_matches_stock(batch_first, batched, kind, bias, appended, weights):
    """Layouts x attention kinds x biases x appended tokens x weights, with gradients, in float64."""
    compare_with_stock(
        Case(
            batch_first=batch_first,
            batched=batched,
            kind=kind,
            bias=bias,
            appended=appended,
            weights=weights,
            key_padding_mask="float",
            attn_mask="2d_float",
        )
    )


MASKING = [
    (kpm, attn_mask, appended, batched, weights)
    for kpm, attn_mask, appended, batched, weights in itertools.product(
        MASKS, ATTN_MASKS, APPENDED, (True, False), ("none", "per_head")
    )
    # stock warns (deprecated) when the two mask types differ; that mix gets its own test
    if not (kpm != "none" and attn_mask != "none" and (kpm == "bool") != attn_mask.endswith("bool"))
]


@pytest.mark.parametrize("kpm,attn_mask,appended,batched,weights", MASKING)
def test_masks_match_stock(kpm, attn_mask, appended, batched, weights):
    compare_with_stock(
        Case(
            key_padding_mask=kpm,
            attn_mask=attn_mask,
            appended=appended,
            batched=batched,
            weights=weights,
            kind="cross",
            batch_first=False,
        )
    )


def test_mixed_mask_types_warn_like_stock():
    case = Case(key_padding_mask="bool", attn_mask="2d_float")
    with pytest.warns(UserWarning, match="Support for mismatched key_padding_mask and attn_mask is deprecated"):
        compare_with_stock(case)


CAUSAL = list(itertools.product(("self", "cross"), MASKS, APPENDED, WEIGHTS, (True, False)))


@pytest.mark.parametrize("kind,kpm,appended,weights,batched", CAUSAL)
def test_is_causal_matches_stock(kind, kpm, appended, weights, batched):
    """is_causal with its mask: SDPA's causal flag when stock uses it, the mask otherwise."""
    compare_with_stock(
        Case(kind=kind, key_padding_mask=kpm, appended=appended, weights=weights, batched=batched, is_causal=True)
    )


DTYPE_MODES = list(itertools.product((torch.float64, torch.float32, torch.bfloat16, torch.float16), MODES, WEIGHTS))


@pytest.mark.parametrize("dtype,mode,weights", DTYPE_MODES, ids=[f"{d}-{m}-{w}" for d, m, w in DTYPE_MODES])
@pytest.mark.parametrize("kind", ["self", "cross"])
def test_dtypes_and_modes_match_stock(dtype, mode, weights, kind):
    """Eval and no-grad modes let stock take its native fast path: slim must match that too."""
    compare_with_stock(Case(dtype=dtype, mode=mode, weights=weights, kind=kind, key_padding_mask="bool"))


def random_case(rng: random.Random) -> Case:
    case = Case(
        batch_first=rng.random() < 0.5,
        batched=rng.random() < 0.8,
        kind=rng.choice(ATTENTION_KINDS),
        bias=rng.random() < 0.7,
        appended=rng.choice(APPENDED),
        key_padding_mask=rng.choice(MASKS),
        attn_mask=rng.choice(ATTN_MASKS),
        is_causal=rng.random() < 0.15,
        weights=rng.choice(WEIGHTS),
        mode=rng.choice(MODES),
        dtype=rng.choice((torch.float64, torch.float32, torch.float32, torch.bfloat16, torch.float16)),
        seed=rng.randrange(10_000),
    )
    mixed = (
        case.key_padding_mask != "none"
        and case.attn_mask != "none"
        and (case.key_padding_mask == "bool") != case.attn_mask.endswith("bool")
    )
    if mixed or case.is_causal and case.kind not in ("self", "cross"):
        case = replace(case, key_padding_mask="none", kind="self" if case.is_causal else case.kind)
    return case


SWEEP = [random_case(random.Random(seed)) for seed in range(300)]


@pytest.mark.parametrize("case", SWEEP, ids=[f"sweep{i}" for i in range(len(SWEEP))])
def test_randomized_sweep_matches_stock(case):
    compare_with_stock(case)


def test_dropout_draws_match_stock_under_one_seed():
    """With dropout, slim makes the same SDPA/dropout calls as stock, so one seed gives one result."""
    for weights in ("none", "averaged"):
        case = Case(weights=weights, kind="self")
        stock, slim = build_pair(case)
        stock.dropout = slim.dropout = 0.3
        inputs = make_inputs(case)
        torch.manual_seed(7)
        expected = run(stock, inputs, case, 3)
        torch.manual_seed(7)
        actual = run(slim, inputs, case, 3)
        assert_close_scaled(actual["output"], expected["output"], case.dtype, f"dropout output ({weights})")


# ------------------------------------------------------------------------------ parameters and state dicts

CONFIGS = {
    "plain": {},
    "no_bias": {"bias": False},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "both": {"add_bias_kv": True, "add_zero_attn": True},
    "kdim_vdim": {"kdim": KDIM, "vdim": VDIM},
}


def stock_and_slim(seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    stock = nn.MultiheadAttention(E, H, **kwargs)
    torch.manual_seed(seed)
    slim = SlimMultiheadAttention(E, H, **kwargs)
    return stock, slim


def random_stock_and_slim(seed: int = 0, **kwargs):
    """Stock with every parameter random (the key bias too), and slim loaded from it."""
    stock, slim = stock_and_slim(seed, **kwargs)
    with torch.no_grad():
        for parameter in stock.parameters():
            parameter.normal_()
    slim.load_state_dict(stock.state_dict(), strict=True)
    return stock, slim


def example_tokens(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query = torch.randn(L_TGT, BATCH, E)
    return query, torch.randn(S_SRC, BATCH, kwargs.get("kdim", E)), torch.randn(S_SRC, BATCH, kwargs.get("vdim", E))


@pytest.mark.parametrize("kwargs", [{}, {"add_bias_kv": True}, {"kdim": KDIM, "vdim": VDIM}, {"dropout": 0.1}])
def test_seeded_construction_draws_stock_weights(kwargs):
    stock, slim = stock_and_slim(3, **kwargs)
    slim_state = slim.state_dict()
    assert list(slim_state) == list(stock.state_dict())
    for name, tensor in stock.state_dict().items():
        assert torch.equal(slim_state[name], tensor), name
    # ...and consumes the global RNG exactly as stock does, so later draws in a model match too.
    torch.manual_seed(3)
    nn.MultiheadAttention(E, H, **kwargs)
    after_stock = torch.get_rng_state()
    torch.manual_seed(3)
    SlimMultiheadAttention(E, H, **kwargs)
    assert torch.equal(torch.get_rng_state(), after_stock)


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_are_stocks_by_name_order_shape_and_kind(name):
    stock, slim = stock_and_slim(**CONFIGS[name])
    described = lambda m: [(n, tuple(p.shape), p.dtype, type(p)) for n, p in m.named_parameters()]  # noqa: E731
    assert described(slim) == described(stock)
    assert list(slim.state_dict()) == list(stock.state_dict())
    if slim.in_proj_bias is not None:
        assert slim._parameters["in_proj_bias"] is slim.in_proj_bias
        assert isinstance(slim.in_proj_bias, nn.Parameter) and slim.in_proj_bias.is_leaf


def test_the_key_bias_gets_an_exactly_zero_gradient_and_never_moves():
    stock, slim = random_stock_and_slim(batch_first=True)
    optimizer = torch.optim.AdamW(slim.parameters(), lr=0.1, weight_decay=0.0)
    key_slot = slim.in_proj_bias[E : 2 * E].detach().clone()
    for _ in range(3):
        x = torch.randn(BATCH, L_TGT, E)
        y = torch.randn(BATCH, S_SRC, E)
        loss = (
            slim(x, x, x)[0].square().sum()
            + slim(x, y, y)[0].sum()
            + slim(x, y, y.flip(1), need_weights=False)[0].sum()
        )
        optimizer.zero_grad()
        loss.backward()
        assert torch.equal(slim.in_proj_bias.grad[E : 2 * E], torch.zeros(E)), "the key slot got a gradient"
        optimizer.step()
    assert torch.equal(slim.in_proj_bias[E : 2 * E].detach(), key_slot)


@pytest.mark.parametrize("value", [1e6, float("nan"), float("inf")])
@pytest.mark.parametrize("kind", ["self", "cross_shared_kv", "cross", "kdim_vdim"])
def test_the_output_does_not_depend_on_what_the_key_slot_holds(value, kind):
    """Written straight into the parameter (a loader, an init), any key bias leaves stock's function."""
    kwargs = {"kdim": KDIM, "vdim": VDIM} if kind == "kdim_vdim" else {}
    stock, slim = random_stock_and_slim(**kwargs)
    query, key, value_tokens = example_tokens(kwargs)
    if kind == "self":
        key = value_tokens = query
    elif kind == "cross_shared_kv":
        value_tokens = key
    with torch.no_grad():
        stock.in_proj_bias[E : 2 * E].zero_()
        expected, expected_weights = stock(query, key, value_tokens)
        slim.in_proj_bias[E : 2 * E].fill_(value)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            actual, weights = slim(query, key, value_tokens)
        assert_close_scaled(actual.detach(), expected, torch.float32, "output")
        assert_close_scaled(weights.detach(), expected_weights, torch.float32, "weights")


@pytest.mark.parametrize("name", CONFIGS)
def test_state_dicts_are_stocks_both_ways(name):
    kwargs = CONFIGS[name]
    stock, slim = random_stock_and_slim(**kwargs)
    for key, tensor in stock.state_dict().items():
        assert torch.equal(slim.state_dict()[key], tensor), key
    rebuilt = nn.MultiheadAttention(E, H, **kwargs)
    rebuilt.load_state_dict(slim.state_dict(), strict=True)  # no lock-in: stock loads what slim saves
    query, key, value = example_tokens(kwargs)
    torch.testing.assert_close(rebuilt(query, key, value)[0], stock(query, key, value)[0], atol=0, rtol=0)
    assert_close_scaled(slim(query, key, value)[0], stock(query, key, value)[0], torch.float32, "output")


def key_bias_free_state(stock: nn.MultiheadAttention, *, fold_value: bool = False) -> dict:
    """``stock``'s state in format version 1, as ``slim-mha-migrate strip`` writes it."""
    state = stock.state_dict()
    packed, bias_k = state.pop("in_proj_bias"), state.pop("bias_k", None)
    biases = fold_key_bias(packed, bias_k, add_zero_attn=stock.add_zero_attn)
    if fold_value:
        out_bias, new_bias_v = fold_value_bias_into_output(
            biases.v_proj_bias, state["out_proj.weight"], state["out_proj.bias"], state.get("bias_v")
        )
        state["out_proj.bias"] = out_bias
        if new_bias_v is not None:
            state["bias_v"] = new_bias_v
        biases = biases._replace(v_proj_bias=None)
    state.update({name: tensor for name, tensor in biases._asdict().items() if tensor is not None})
    return state


@pytest.mark.parametrize("name", ["plain", "bias_kv", "zero_attn", "both", "kdim_vdim"])
@pytest.mark.parametrize("fold_value", [False, True])
def test_the_key_bias_free_layout_loads_strictly_with_stocks_function(name, fold_value):
    kwargs = CONFIGS[name]
    if fold_value and kwargs.get("add_zero_attn"):
        pytest.skip("a zero value token cannot absorb the value bias")
    stock, _ = random_stock_and_slim(**kwargs)
    state = key_bias_free_state(stock, fold_value=fold_value)
    before = {key: tensor.clone() for key, tensor in state.items()}
    slim = SlimMultiheadAttention(E, H, **kwargs)
    slim.load_state_dict(state, strict=True)
    assert {key: tensor for key, tensor in state.items()}.keys() == before.keys()  # the caller's dict is left alone
    assert all(torch.equal(state[key], before[key]) for key in before)
    assert list(slim.state_dict()) == list(stock.state_dict())
    query, key, value = example_tokens(kwargs)
    assert_close_scaled(slim(query, key, value)[0], stock(query, key, value)[0], torch.float32, "output")


def test_loading_does_not_modify_the_callers_state_dict():
    stock, slim = stock_and_slim(add_bias_kv=True)
    state = stock.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    slim.load_state_dict(state)
    assert set(state) == set(before)
    assert all(torch.equal(state[k], before[k]) for k in before)


def test_state_dict_errors_use_torch_wording():
    _, slim = stock_and_slim()
    stock_state = nn.MultiheadAttention(E, H).state_dict()
    bad = dict(stock_state, in_proj_bias=torch.zeros(2 * E))
    with pytest.raises(
        RuntimeError,
        match=r"(?s)Error\(s\) in loading state_dict.*size mismatch for in_proj_bias: copying a param with shape torch.Size\(\[32\]\)",
    ):
        slim.load_state_dict(bad)
    free = key_bias_free_state(nn.MultiheadAttention(E, H))
    with pytest.raises(
        RuntimeError, match=r"size mismatch for q_proj_bias: copying a param with shape torch.Size\(\[8\]\)"
    ):
        slim.load_state_dict(dict(free, q_proj_bias=torch.zeros(8)))
    with pytest.raises(
        RuntimeError, match=r"in_proj_bias and q_proj_bias, v_proj_bias are both present: the state dict mixes"
    ):
        slim.load_state_dict(dict(free, in_proj_bias=torch.zeros(3 * E)))
    with pytest.raises(RuntimeError, match=r"missing key q_proj_bias beside v_proj_bias"):
        slim.load_state_dict({k: v for k, v in free.items() if k != "q_proj_bias"})
    missing = {k: v for k, v in stock_state.items() if k != "in_proj_bias"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "in_proj_bias"'):
        slim.load_state_dict(missing)
    no_bias = SlimMultiheadAttention(E, H, bias=False)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: .*"in_proj_bias"'):
        no_bias.load_state_dict(stock_state)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: .*"q_proj_bias"'):
        no_bias.load_state_dict(free)


def test_nested_modules_load_the_key_bias_free_layout_under_their_prefixes():
    stock_model = nn.Sequential(nn.Linear(E, E), nn.ModuleDict({"attn": nn.MultiheadAttention(E, H, add_bias_kv=True)}))
    slim_model = nn.Sequential(nn.Linear(E, E), nn.ModuleDict({"attn": SlimMultiheadAttention(E, H, add_bias_kv=True)}))
    with torch.no_grad():
        stock_model[1]["attn"].in_proj_bias.normal_()
    state = {f"0.{k}": v for k, v in stock_model[0].state_dict().items()}
    state.update({f"1.attn.{k}": v for k, v in key_bias_free_state(stock_model[1]["attn"]).items()})
    slim_model.load_state_dict(state, strict=True)
    x = torch.randn(L_TGT, BATCH, E)
    assert_close_scaled(slim_model[1]["attn"](x, x, x)[0], stock_model[1]["attn"](x, x, x)[0], torch.float32, "output")


# ------------------------------------------------------------------------------ in_proj_bias compatibility


def test_writes_and_assignments_to_in_proj_bias_reach_the_forward():
    stock, slim = random_stock_and_slim(batch_first=True, add_bias_kv=True)
    x = torch.randn(BATCH, L_TGT, E)

    def assert_same():
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                assert_close_scaled(slim(x, x, x)[0], stock(x, x, x)[0], torch.float32, "output")

    assert_same()
    for module in (stock, slim):
        with torch.no_grad():
            module.in_proj_bias.add_(1.0)
            module.in_proj_bias[2 * E :].mul_(-2.0)
        module.in_proj_bias.data = module.in_proj_bias.data * 0.5
    assert_same()
    new_bias = torch.randn(3 * E)
    slim.in_proj_bias = nn.Parameter(new_bias.clone())
    stock.in_proj_bias = nn.Parameter(new_bias.clone())
    assert slim._parameters["in_proj_bias"] is slim.in_proj_bias
    assert_same()


def test_transformer_encoder_layer_fast_path_reads_slim_bias():
    """torch's encoder layer fast path calls a native kernel with self_attn.in_proj_bias directly."""
    torch.manual_seed(0)
    stock_layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    with torch.no_grad():
        stock_layer.self_attn.in_proj_bias.normal_()
    slim_layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    slim_layer.self_attn = SlimMultiheadAttention(E, H, batch_first=True)
    slim_layer.load_state_dict(stock_layer.state_dict(), strict=True)
    x = torch.randn(BATCH, L_TGT, E)
    with torch.inference_mode():
        torch.testing.assert_close(slim_layer(x), stock_layer(x), atol=1e-5, rtol=1e-5)


def test_nested_tensor_input_takes_stocks_native_path():
    stock, slim = stock_and_slim(batch_first=True)
    with torch.no_grad():
        stock.in_proj_bias.normal_()
    slim.load_state_dict(stock.state_dict())
    stock.eval(), slim.eval()
    nested = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)])
    with torch.inference_mode():
        expected = stock(nested, nested, nested, need_weights=False)[0]
        actual = slim(nested, nested, nested, need_weights=False)[0]
    for a, b in zip(actual.unbind(), expected.unbind()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ bad input


def bad_calls():
    x = torch.randn(BATCH, L_TGT, E)
    y = torch.randn(BATCH, S_SRC, E)
    return {
        "query_4d": lambda m: m(x[None], x[None], x[None]),
        "key_2d": lambda m: m(x, y[0], y),
        "embed_dim": lambda m: m(x[..., :8], x[..., :8], x[..., :8]),
        "key_value_shape": lambda m: m(x, y, y[:, :4]),
        "padding_mask_shape": lambda m: m(x, y, y, key_padding_mask=torch.zeros(BATCH, S_SRC + 1, dtype=torch.bool)),
        "padding_mask_dims": lambda m: m(x, y, y, key_padding_mask=torch.zeros(S_SRC, dtype=torch.bool)),
        "attn_mask_2d_shape": lambda m: m(x, y, y, attn_mask=torch.zeros(L_TGT, S_SRC + 1)),
        "attn_mask_3d_shape": lambda m: m(x, y, y, attn_mask=torch.zeros(BATCH, L_TGT, S_SRC)),
        "attn_mask_4d": lambda m: m(x, y, y, attn_mask=torch.zeros(1, BATCH * H, L_TGT, S_SRC)),
        "integer_mask": lambda m: m(x, y, y, attn_mask=torch.zeros(L_TGT, S_SRC, dtype=torch.int64)),
        "causal_without_mask": lambda m: m(x, x, x, is_causal=True),
        "dtype": lambda m: m(x.double(), y.double(), y.double()),
    }


@pytest.mark.parametrize("name", list(bad_calls()))
@pytest.mark.parametrize("training", [True, False])
def test_bad_input_raises_like_stock(name, training):
    stock, slim = stock_and_slim(batch_first=True)
    stock.train(training), slim.train(training)
    call = bad_calls()[name]
    with pytest.raises(Exception) as stock_error:
        call(stock)
    with pytest.raises(type(stock_error.value)):
        call(slim)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"embed_dim": 0, "num_heads": 2}, ValueError, "embed_dim and num_heads must be greater than 0"),
        ({"embed_dim": 16, "num_heads": -1}, ValueError, "embed_dim and num_heads must be greater than 0"),
        ({"embed_dim": 10, "num_heads": 4}, AssertionError, "embed_dim must be divisible by num_heads"),
    ],
)
def test_constructor_errors_match_stock(kwargs, error, message):
    with pytest.raises(error, match=message):
        nn.MultiheadAttention(**kwargs)
    with pytest.raises(error, match=message):
        SlimMultiheadAttention(**kwargs)


def test_is_a_stock_subclass_and_keeps_stock_attributes():
    _, slim = stock_and_slim(kdim=KDIM, vdim=VDIM, batch_first=True)
    assert isinstance(slim, nn.MultiheadAttention)
    assert (slim.embed_dim, slim.kdim, slim.vdim, slim.num_heads, slim.head_dim) == (E, KDIM, VDIM, H, E // H)
    assert slim._qkv_same_embed_dim is False and slim.batch_first is True and slim.in_proj_weight is None
    assert "embed_dim=16, num_heads=4, batch_first=True" in repr(slim)


@pytest.mark.parametrize("mode", ["train", "eval", "no_grad"])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_fully_masked_rows_match_stocks_python_path(mode, weights):
    """A query row blocked from every key: SDPA's answer (zero attention) on every path, every torch.

    Stock's own Python path gives NaN there with weights, and without them whatever this torch's SDPA
    gives (zero attention since 2.5, NaN before; checked on this torch, not pinned); its native
    inference fast path gives NaN. Slim is finite in every mode, and stock's elsewhere
    (tests/test_one_answer.py checks the zero rows themselves).
    """
    case = Case(mode=mode, weights=weights)
    stock, slim = build_pair(case)
    stock.train()  # stock's Python path, which its native kernel does not follow here
    inputs = make_inputs(case)
    blocked = torch.zeros(L_TGT, L_TGT, dtype=torch.bool)
    blocked[1] = True
    inputs["attn_mask"] = blocked
    expected = stock(**inputs)[0]
    with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        actual = slim(**inputs)[0]
    assert torch.isfinite(actual).all()
    assert torch.isnan(expected).any() == (weights != "none" or sdpa_gives_nan_on_fully_masked_rows())
    finite = ~torch.isnan(expected)
    torch.testing.assert_close(actual[finite], expected[finite].detach(), atol=1e-10, rtol=1e-10)


def sdpa_gives_nan_on_fully_masked_rows() -> bool:
    """This torch's SDPA on a query row that sees no key (NaN up to torch 2.4, zeros after)."""
    q = torch.ones(1, 1, 1, 2)
    blocked = torch.zeros(1, 1, 1, 1, dtype=torch.bool)
    return bool(nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=blocked).isnan().any())


# ------------------------------------------------------------------------------ inference-only paths

BLOCKS = list(itertools.product(MASKS, ATTN_MASKS, APPENDED, ("no_grad", "inference_mode")))


@pytest.mark.parametrize("kpm,attn_mask,appended,mode", BLOCKS)
def test_averaged_weights_in_blocks_of_query_rows_match_stock(forced_blocks, kpm, attn_mask, appended, mode):
    """Large averaged-weights calls on CPU go a block of query rows at a time; force it on small inputs."""
    forced_blocks(1)  # one query row per block
    if kpm != "none" and attn_mask != "none" and (kpm == "bool") != attn_mask.endswith("bool"):
        kpm = attn_mask.split("_")[1]
    compare_with_stock(
        Case(key_padding_mask=kpm, attn_mask=attn_mask, appended=appended, mode=mode, weights="averaged", kind="cross")
    )


def test_slim_overrides_no_module_hook_beyond_loading():
    """Stock's contract by construction: no attribute, registration, casting, saving or pickling hook
    of its own, and nothing named ``in_proj_bias`` on the class (it is an ordinary registered Parameter).

    Only what a class defines as callables, properties or class/static methods is compared: Python
    versions add other entries to every class (``__static_attributes__``, ``__firstlineno__``).
    """

    def hooks(cls: type) -> set[str]:
        return {
            name
            for name, value in vars(cls).items()
            if callable(value) or isinstance(value, (property, classmethod, staticmethod))
        }

    stock_hooks = hooks(nn.Module) | hooks(nn.MultiheadAttention)
    assert hooks(SlimMultiheadAttention) & stock_hooks == {"__init__", "forward", "extra_repr", "_load_from_state_dict"}
    assert not any("in_proj_bias" in vars(cls) for cls in SlimMultiheadAttention.__mro__)
