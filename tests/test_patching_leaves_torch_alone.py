"""A patch changes which class torch's constructors build, and nothing else.

Each test runs the same code unpatched (stock) and patched, and compares: pickles (of stock modules
built before the patch, of ``to_stock``'s result, of whole models saved while patched and loaded
where slim_mha cannot be imported), base-class calls by name, copies, fx, and slim's private method
names against a subclass's.
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx
from torch import nn

import slim_mha
from slim_mha import SlimMultiheadAttention, patched, unpatch
from slim_mha.patching import PatchedMultiheadAttention, PatchedTransformerEncoderLayer

from _reference import STOCK_MHA, randomize_parameters

STOCK_LAYER = nn.TransformerEncoderLayer
E, H, FF = 8, 2, 16


@pytest.fixture(autouse=True)
def unpatched_after():
    yield
    unpatch()
    assert not slim_mha.is_patched()


def model(patch: bool) -> nn.Module:
    """The same seeded model (weights randomised, every bias non-zero), built patched or not."""
    torch.manual_seed(0)
    if patch:
        with patched():
            built = nn.Sequential(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True), nn.Linear(E, 3))
    else:
        built = nn.Sequential(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True), nn.Linear(E, 3))
    return randomize_parameters(built).eval()


def saved(module: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------- pickles


def test_stock_modules_pickle_while_patched_as_they_do_unpatched():
    stock_attention, stock_layer = STOCK_MHA(E, H), STOCK_LAYER(E, H, FF)
    converted = slim_mha.to_stock(model(patch=True))
    expected = [type(m) for m in (stock_attention, stock_layer, converted)]
    with patched():
        loaded = [pickle.loads(pickle.dumps(m)) for m in (stock_attention, stock_layer, converted)]
        restored = [torch.load(io.BytesIO(saved(m)), weights_only=False) for m in (stock_attention, stock_layer)]
    assert [type(m) for m in loaded] == expected
    assert [type(m) for m in restored] == expected[:2]
    assert all(type(m) is STOCK_MHA for m in loaded[2].modules() if isinstance(m, STOCK_MHA))


_LOAD_WITHOUT_SLIM = textwrap.dedent(
    """
    import io, sys
    sys.modules["slim_mha"] = None  # slim_mha cannot be imported in this process
    import torch
    from torch import nn
    data = sys.stdin.buffer.read()
    weights_only = sys.argv[1] == "weights_only"
    if weights_only:
        torch.serialization.add_safe_globals([
            nn.Sequential, nn.TransformerEncoderLayer, nn.MultiheadAttention, nn.Linear, nn.LayerNorm,
            nn.Dropout, nn.modules.linear.NonDynamicallyQuantizableLinear, torch.nn.functional.relu,
            set,  # a module's own state holds one; torch 2.4 does not allow it by default
        ])
    loaded = torch.load(io.BytesIO(data), weights_only=weights_only)
    torch.manual_seed(1)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        out = loaded(x)
    print(sorted({type(m).__module__ + "." + type(m).__qualname__ for m in loaded.modules()}))
    print(out.sum().item())
    """
)


@pytest.mark.parametrize("mode", ["weights_only", "full"])
def test_a_model_saved_while_patched_loads_as_stock_where_slim_mha_is_absent(mode):
    """No lock-in: the file a patched codebase saves is the file the same code saves unpatched, as far
    as a process without slim_mha can tell: same classes, same outputs."""
    printed = {}
    for patch in (False, True):
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_WITHOUT_SLIM, mode],
            input=saved(model(patch)),
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        printed[patch] = done.stdout.decode().splitlines()
    assert printed[True][0] == printed[False][0]  # stock's classes, by name
    assert "slim_mha" not in printed[True][0]
    assert float(printed[True][1]) == pytest.approx(float(printed[False][1]), rel=1e-5, abs=1e-5)


def test_a_directly_imported_slim_module_keeps_its_own_name():
    slim = SlimMultiheadAttention(E, H)
    assert type(pickle.loads(pickle.dumps(slim))) is SlimMultiheadAttention


def test_a_folded_value_bias_refuses_to_pickle_under_stocks_name():
    with patched():
        attention = nn.MultiheadAttention(E, H)
    slim_mha.fold_value_bias(attention.eval())
    with pytest.raises(ValueError, match="fold_value_bias"):
        pickle.dumps(attention)


def test_copies_keep_the_patched_class_and_encoders_clone_it():
    with patched():
        attention = nn.MultiheadAttention(E, H)
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF), 2, enable_nested_tensor=False)
    assert type(copy.copy(attention)) is PatchedMultiheadAttention
    assert type(copy.deepcopy(attention)) is PatchedMultiheadAttention
    assert [type(layer) for layer in encoder.layers] == [PatchedTransformerEncoderLayer] * 2
    copied = copy.deepcopy(attention)
    assert copied.in_proj_weight is not attention.in_proj_weight
    assert torch.equal(copied.in_proj_weight, attention.in_proj_weight)


# ------------------------------------------------------------------------------- base-class calls


def user_classes() -> dict[str, type]:
    """A user's classes that call stock's methods by name, as code written for stock does."""

    class ByNameAttention(nn.MultiheadAttention):
        def __init__(self, *args, **kwargs):
            nn.MultiheadAttention.__init__(self, *args, **kwargs)

        def forward(self, *args, **kwargs):
            return nn.MultiheadAttention.forward(self, *args, **kwargs)

    class ByNameLayer(nn.TransformerEncoderLayer):
        def forward(self, src, *args, **kwargs):
            return 2.0 * nn.TransformerEncoderLayer.forward(self, src, *args, **kwargs)

    return {"attention": ByNameAttention, "layer": ByNameLayer}


@pytest.mark.parametrize("defined", ["before the patch", "while patched"])
def test_base_class_calls_by_name_work_as_unpatched(defined):
    if defined == "before the patch":
        classes = user_classes()
        context = patched()
    else:
        with patched():
            classes = user_classes()
        context = patched()
    x = torch.randn(2, 5, E)
    outputs = {}
    for patch in (False, True):
        torch.manual_seed(0)
        with context if patch else _nothing():
            attention = classes["attention"](E, H, batch_first=True).eval()
            layer = classes["layer"](E, H, FF, dropout=0.0, batch_first=True).eval()
        with torch.no_grad():
            outputs[patch] = (attention(x, x, x)[0], layer(x))
    for unpatched_out, patched_out in zip(outputs[False], outputs[True]):
        torch.testing.assert_close(patched_out, unpatched_out)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -------------------------------------------------------------------------------- private names


_PRIVATE_NAMES = (
    "_sdpa",
    "_general",
    "_project",
    "_stock_ops",
    "_stock_kernel",
    "_stock_forward",
    "_recorded",
    "_unrecorded",
    "_traced",
    "_packed_bias",
    "_append_tokens",
    "_general_with_options",
)


def _users_method(self, *args, **kwargs):
    raise AssertionError("slim called a subclass's own private method")


UserNamedAttention = type(
    "UserNamedAttention", (SlimMultiheadAttention,), {name: _users_method for name in _PRIVATE_NAMES}
)


@pytest.mark.parametrize(
    "case", ["eval", "eval without weights", "train", "padding", "cross", "appended tokens", "recorded"]
)
def test_a_subclass_with_private_names_of_its_own_is_never_called_by_slim(case):
    torch.manual_seed(0)
    options = {"add_bias_kv": True} if case == "appended tokens" else {}
    user = UserNamedAttention(E, H, batch_first=True, **options)
    plain = SlimMultiheadAttention(E, H, batch_first=True, **options)
    plain.load_state_dict(user.state_dict())
    for module in (user, plain):
        module.train(case == "train")
    x, y = torch.randn(2, 5, E), torch.randn(2, 7, E)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, -1] = True
    kwargs = {
        "eval without weights": {"need_weights": False},
        "padding": {"key_padding_mask": padding},
    }.get(case, {})
    key = y if case == "cross" else x

    def run(module):
        if case == "recorded":
            with slim_mha.recording_attention(module):
                return module(x, key, key, **kwargs)
        return module(x, key, key, **kwargs)

    expected, actual = run(plain), run(user)
    torch.testing.assert_close(actual[0], expected[0])


# ------------------------------------------------------------------------------------------- fx


def test_fx_tracing_the_attention_as_root_raises_stocks_exception():
    raised = {}
    for name, module in (("stock", STOCK_MHA(E, H)), ("slim", SlimMultiheadAttention(E, H))):
        with pytest.raises(Exception) as caught:
            torch.fx.symbolic_trace(module)
        raised[name] = (type(caught.value), str(caught.value))
    assert raised["slim"] == raised["stock"]
    assert raised["stock"][0] is torch.fx.proxy.TraceError


class _Caller(nn.Module):
    """Calls its attention as ``nn.TransformerEncoderLayer._sa_block`` does, by keyword."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x, padding):
        return self.attention(x, x, x, key_padding_mask=padding, need_weights=False)[0]


def test_fx_records_slim_attention_with_stocks_call_signature():
    torch.manual_seed(0)
    stock = STOCK_MHA(E, H, batch_first=True)
    slim = slim_mha.convert(copy.deepcopy(stock))
    nodes = {}
    x, padding = torch.randn(2, 5, E), torch.zeros(2, 5, dtype=torch.bool)
    for name, attention in (("stock", stock), ("slim", slim)):
        traced = torch.fx.symbolic_trace(_Caller(attention))
        (node,) = [n for n in traced.graph.nodes if n.op == "call_module"]
        nodes[name] = (node.target, [str(a) for a in node.args], {k: str(v) for k, v in node.kwargs.items()})
        torch.testing.assert_close(traced(x, padding), _Caller(attention)(x, padding))
    assert nodes["slim"] == nodes["stock"]
    assert nodes["stock"][2] == {"key_padding_mask": "padding", "need_weights": "False"}


@pytest.mark.parametrize("concrete", [False, True])
def test_fx_tracing_an_encoder_layer_fails_as_stocks_does(concrete):
    concrete_args = {"src_mask": None, "src_key_padding_mask": None, "is_causal": False} if concrete else None
    raised = {}
    stock = STOCK_LAYER(E, H, FF, dropout=0.0)
    for name, layer in (("stock", stock), ("slim", slim_mha.convert(copy.deepcopy(stock)))):
        with pytest.raises(Exception) as caught:
            torch.fx.symbolic_trace(layer, concrete_args=concrete_args)
        raised[name] = (type(caught.value), str(caught.value))
    assert raised["slim"] == raised["stock"]
