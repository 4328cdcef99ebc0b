"""Where slim steps around stock's machinery (the encoder's fused kernel, ``torch.jit.script``, the
patched classes), it still does what stock does.

The rule of when stock's ``nn.TransformerEncoderLayer`` fuses is derived here from stock itself: each
case of the sweep counts the calls stock's layer makes to its fused kernel, and slim's one copy of the
rule (``why_stock_layer_is_not_fused``) must agree. On the same case slim's layer must give stock's
outputs, dtype, exception type and hook inputs, at lengths on both sides of slim's thresholds.
"""

import abc
import copy
import itertools
import warnings
from typing import Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

import slim_mha
from slim_mha import encoder_layer
from slim_mha._stock_checks import why_stock_layer_is_not_fused
from slim_mha._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA, stock_layer_unfuses_for_hooks
from slim_mha.patching import PatchedMultiheadAttention, PatchedTransformerEncoderLayer

from _reference import assert_matches_stock, float64_reference

E, H, FF, B = 16, 4, 32, 3
SHORT, LONG = 6, 400  # either side of every FUSED_LAYER_MAX_LENGTH (96 with a mask, 384 without)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # nested tensors' prototype warning


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """How many times stock's fused layer kernel ran."""
    count, fused = [0], torch._transformer_encoder_layer_fwd

    def counted(*args):
        count[0] += 1
        return fused(*args)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counted)
    return count


def gated_class(base: type) -> type:
    """A user's layer whose self-attention block is gated, as a subclass of ``base``."""

    class Gated(base):
        def _sa_block(self, x, attn_mask, key_padding_mask, is_causal=False):
            return 0.5 * super()._sa_block(x, attn_mask, key_padding_mask, is_causal=is_causal)

    return Gated


def layer_pair(variant: str) -> tuple[nn.Module, nn.Module]:
    """Stock's layer and slim's (built patched, same weights), of one ``variant``."""
    kwargs = dict(dim_feedforward=FF, dropout=0.1, batch_first=True)
    if variant == "sequence first":
        kwargs["batch_first"] = False
    if variant == "norm first":
        kwargs["norm_first"] = True
    if variant == "odd heads":
        heads = 1
    else:
        heads = H
    if variant == "no bias":
        kwargs["bias"] = False
    if variant == "other activation":
        kwargs["activation"] = torch.tanh

    def build(slim: bool) -> nn.Module:
        # A user's subclass of slim's layer subclasses slim's class: a subclass of nn's, even one
        # defined while patched, is the user's own on stock's base.
        base = PatchedTransformerEncoderLayer if slim and variant == "gated subclass" else STOCK_ENCODER_LAYER
        cls = gated_class(base) if variant == "gated subclass" else base
        layer = cls(E, heads, **kwargs)
        if variant == "other eps":
            layer.norm2.eps = 1e-3
        return layer

    torch.manual_seed(0)
    stock = build(slim=False)
    for p in stock.parameters():
        with torch.no_grad():
            p.add_(0.3 * torch.randn_like(p))
    with slim_mha.patched():
        slim = build(slim=True)
    slim.load_state_dict(stock.state_dict())
    return stock.eval(), slim.eval()


def call_inputs(mask: str, length: int, batch_first: bool = True) -> tuple[Tensor, dict]:
    generator = torch.Generator().manual_seed(length)
    x = torch.randn((B, length, E) if batch_first else (length, B, E), generator=generator)
    padding = torch.zeros(B, length, dtype=torch.bool)
    padding[1, length - 2 :] = True
    padding[2, length // 2 :] = True
    if mask == "padding":
        return x, {"src_key_padding_mask": padding}
    if mask == "nested":
        return torch._nested_tensor_from_mask(x, padding.logical_not(), mask_check=False), {}
    if mask == "causal mask":
        return x, {"src_mask": nn.Transformer.generate_square_subsequent_mask(length), "is_causal": True}
    if mask == "causal hint alone":
        return x, {"is_causal": True}
    if mask == "wrong padding":
        return x, {"src_key_padding_mask": torch.zeros(B, length + 1, dtype=torch.bool)}
    if mask == "wrong attention mask":
        return x, {"src_mask": torch.zeros(length + 1, length + 1)}
    return x, {}


def hooks(layer: nn.Module, where: str, seen: list) -> None:
    def record(module, args, output=None):
        value = output[0] if isinstance(output, tuple) else (output if output is not None else args[0])
        seen.append(
            (
                type(module).__name__,
                value.is_nested,
                tuple(value.to_padded_tensor(0.0).shape if value.is_nested else value.shape),
            )
        )

    if where == "attention":
        layer.self_attn.register_forward_hook(record)
    elif where == "pre-hook on linear1":
        layer.linear1.register_forward_pre_hook(record)
    elif where == "layer":
        layer.register_forward_hook(record)


def outcome(layer: nn.Module, x: Tensor, masks: dict, context: str):
    """What one call gives: ("ok", output, dtype) or ("raised", exception type)."""
    with _context(context, layer, x) as x:
        try:
            out = layer(x, **masks)
        except Exception as error:  # the type is the contract
            return ("raised", type(error)), None
    dense = out.to_padded_tensor(0.0) if out.is_nested else out
    return ("ok", out.dtype, out.is_nested), dense.detach()


def reference_outcome(layer: nn.Module, x: Tensor, masks: dict, context: str):
    """:func:`outcome` of stock's documented function: the layer with its fast path off."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        return outcome(layer, x, masks, context)
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


class _context:
    def __init__(self, context: str, layer: nn.Module, x: Tensor) -> None:
        self.context, self.layer, self.x = context, layer, x
        self.stack = []

    def __enter__(self) -> Tensor:
        c, x = self.context, self.x
        managers = {
            "no_grad": [torch.no_grad()],
            "inference_mode": [torch.inference_mode()],
            "grad": [torch.enable_grad()],
            "autocast": [torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16)],
            "fastpath off": [torch.no_grad()],
            "training": [torch.no_grad()],
        }[c]
        if c == "fastpath off":
            self.previous = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        if c == "training":
            self.layer.train()
            for m in self.layer.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
                if isinstance(m, nn.MultiheadAttention):
                    m.dropout = 0.0
        for m in managers:
            m.__enter__()
            self.stack.append(m)
        if c == "grad" and not x.is_nested:
            x = x.clone().requires_grad_()
        return x

    def __exit__(self, *exc) -> None:
        for m in reversed(self.stack):
            m.__exit__(*exc)
        if self.context == "fastpath off":
            torch.backends.mha.set_fastpath_enabled(self.previous)
        if self.context == "training":
            self.layer.eval()


VARIANTS = [
    "plain",
    "sequence first",
    "norm first",
    "odd heads",
    "no bias",
    "other activation",
    "other eps",
    "gated subclass",
]
MASKS = ["none", "padding", "nested", "causal mask", "causal hint alone", "wrong padding", "wrong attention mask"]
CONTEXTS = ["no_grad", "inference_mode", "grad", "autocast", "fastpath off", "training"]
HOOKS = ["none", "attention", "pre-hook on linear1", "layer"]

# Every variant with the plain calls, and every call, context and hook with the plain layer: 170 cases.
SWEEP = sorted(
    {(v, m, c, h) for v in VARIANTS for m in ("none", "padding", "nested") for c in ("no_grad",) for h in ("none",)}
    | {("plain", m, c, "none") for m in MASKS for c in CONTEXTS}
    | {("plain", m, "no_grad", h) for m in MASKS for h in HOOKS}
    | {("gated subclass", m, c, "none") for m in ("causal hint alone", "padding") for c in ("no_grad", "autocast")}
    | {
        ("norm first", m, c, h)
        for m in ("nested", "padding")
        for c in ("no_grad", "autocast")
        for h in ("none", "attention")
    }
)


@pytest.mark.parametrize("length", [SHORT, LONG])
@pytest.mark.parametrize("variant,mask,context,hook", SWEEP)
def test_slims_layer_fuses_where_stock_does_and_gives_what_stock_gives(
    variant, mask, context, hook, length, fused_calls
):
    stock, slim = layer_pair(variant)
    if mask == "nested" and (variant == "sequence first"):
        pytest.skip("nn.TransformerEncoder nests batch-first calls only")
    x, masks = call_inputs(mask, length, batch_first=variant != "sequence first")
    seen_stock, seen_slim = [], []
    hooks(stock, hook, seen_stock)
    hooks(slim, hook, seen_slim)

    # The rule, from stock itself: did stock's layer call its fused kernel?
    fused_calls[0] = 0
    expected, stock_out = outcome(stock, x, masks, context)
    stock_fused = fused_calls[0] == 1
    if expected[0] == "ok" or stock_fused:
        with _context(context, stock, x) as x_in:
            raw = {k: v for k, v in masks.items() if k != "is_causal"}
            why = why_stock_layer_is_not_fused(stock, x_in, raw.get("src_mask"), raw.get("src_key_padding_mask"))
        assert (why == "") == stock_fused, f"slim's rule says {why!r}; stock's layer fused: {stock_fused}"

    # Where stock fuses but its kernel departs from stock's documented function, slim gives that
    # function: stock's layer with its fast path off (a causal hint without a mask dropped, as the
    # kernel drops it: unfused, stock raises there).
    if stock_fused:
        with _context(context, stock, x) as x_in:
            departs = encoder_layer.why_the_fused_kernel_departs(
                stock, x_in, masks.get("src_mask"), masks.get("src_key_padding_mask")
            )
        if departs:
            seen_stock.clear()
            masks = {**masks, "is_causal": masks.get("is_causal", False) and "src_mask" in masks}
            expected, stock_out = reference_outcome(stock, x, masks, context)

    # Slim's layer, on the same call: stock's outputs, dtype, exception type and hook inputs.
    actual, slim_out = outcome(slim, x, masks, context)
    assert actual == expected
    assert [rest for _, *rest in seen_slim] == [rest for _, *rest in seen_stock]  # classes differ by name only
    if stock_out is not None and context == "autocast":  # bf16: as exact as stock, against float64
        with torch.no_grad():
            reference = float64_reference(stock, x, **masks)
        reference = reference.to_padded_tensor(0.0) if reference.is_nested else reference
        assert_matches_stock(slim_out, stock_out, reference)
    elif stock_out is not None:
        torch.testing.assert_close(slim_out, stock_out, rtol=1e-4, atol=1e-4)


def test_the_sweep_reaches_both_sides_of_the_rule(fused_calls):
    """The sweep is not vacuous: slim takes its own path on long calls stock fuses, and stock's elsewhere."""
    _, slim = layer_pair("plain")
    taken = {}
    with torch.no_grad():
        for mask, length in itertools.product(("none", "padding", "nested"), (SHORT, LONG)):
            x, masks = call_inputs(mask, length)
            taken[mask, length] = encoder_layer.layer_path(slim, x, None, masks.get("src_key_padding_mask"))[0]
    assert taken == {
        ("none", SHORT): "stock fused layer",
        ("none", LONG): "slim layer",
        ("padding", SHORT): "stock fused layer",
        ("padding", LONG): "slim layer",
        ("nested", SHORT): "stock fused layer",
        ("nested", LONG): "slim layer",
    }


# ------------------------------------------------------------------ the nine findings, one by one


@pytest.mark.parametrize("length", [SHORT, 100, 385])
def test_is_causal_without_a_mask_runs_as_stocks_fused_layer_ignores_it(length):
    stock, slim = layer_pair("plain")
    for mask in ("none", "padding"):
        x, masks = call_inputs(mask, length)
        with torch.no_grad():
            torch.testing.assert_close(slim(x, **masks, is_causal=True), stock(x, **masks, is_causal=True))


@pytest.mark.parametrize("length", [SHORT, 384, 385])
def test_an_overridden_sa_block_is_applied_at_every_length_as_stocks_function_applies_it(length):
    stock, slim = layer_pair("gated subclass")
    x, _ = call_inputs("none", length)
    with torch.no_grad():
        torch.testing.assert_close(slim(x), reference_outcome(stock, x, {}, "no_grad")[1], rtol=1e-5, atol=1e-5)
    stock.train(), slim.train()  # in training both run the user's block
    for m in (*stock.modules(), *slim.modules()):
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    with torch.no_grad():
        torch.testing.assert_close(slim(x), stock(x), rtol=1e-5, atol=1e-5)


def test_hooks_in_a_nested_encoder_see_what_stocks_hooks_see():
    def build(cls: type) -> nn.Module:
        torch.manual_seed(0)
        return nn.TransformerEncoder(cls(E, H, FF, dropout=0.0, batch_first=True), 2, enable_nested_tensor=True).eval()

    stock = build(STOCK_ENCODER_LAYER)
    with slim_mha.patched():
        slim = build(nn.TransformerEncoderLayer)
    slim.load_state_dict(stock.state_dict())
    x, masks = call_inputs("padding", LONG)
    seen = {"stock": [], "slim": []}
    for name, model in (("stock", stock), ("slim", slim)):
        model.layers[0].self_attn.register_forward_hook(
            lambda m, i, o, name=name: seen[name].append(o[0].to_padded_tensor(0.0).shape if o[0].is_nested else None)
        )
    with torch.no_grad():
        torch.testing.assert_close(slim(x, **masks), stock(x, **masks), rtol=1e-4, atol=1e-4)
    assert seen["slim"] == seen["stock"]
    assert seen["stock"] == ([torch.Size([B, LONG, E])] if stock_layer_unfuses_for_hooks() else [])


@pytest.mark.parametrize("base", ["layer", "attention"])
def test_the_patched_classes_accept_abc_mixins_as_stocks_do(base):
    with slim_mha.patched():
        cls = PatchedTransformerEncoderLayer if base == "layer" else PatchedMultiheadAttention

        class Mixed(cls, abc.ABC):
            pass

        class Abstract(cls, abc.ABC):
            @abc.abstractmethod
            def extra(self) -> None: ...

        module = Mixed(E, H)
    assert isinstance(module, STOCK_ENCODER_LAYER if base == "layer" else STOCK_MHA)
    assert isinstance(module, PatchedTransformerEncoderLayer if base == "layer" else PatchedMultiheadAttention)
    with pytest.raises(TypeError, match="abstract"):
        Abstract(E, H)  # ABCMeta's rules hold, as on stock's subclass with abc.ABC


@pytest.mark.parametrize("length", [SHORT, LONG])
def test_under_cpu_autocast_the_layer_gives_stocks_dtype_at_every_length(length):
    """bf16 at every length on torch >= 2.5; torch 2.4's fused kernel raises under CPU autocast, and so does slim's layer."""
    stock, slim = layer_pair("plain")
    for mask in ("none", "padding"):
        x, masks = call_inputs(mask, length)
        (expected, stock_out), (actual, slim_out) = (
            outcome(stock, x, masks, "autocast"),
            outcome(slim, x, masks, "autocast"),
        )
        assert actual == expected
        if stock_out is not None:
            assert slim_out.dtype == torch.bfloat16
            torch.testing.assert_close(slim_out, stock_out)


@pytest.mark.parametrize("length", [SHORT, 100, LONG])
@pytest.mark.parametrize("mask", ["wrong padding", "wrong attention mask"])
def test_a_wrong_mask_raises_stocks_exception_type(mask, length):
    stock, slim = layer_pair("plain")
    x, masks = call_inputs(mask, length)
    with torch.no_grad():
        with pytest.raises(Exception) as expected:
            stock(x, **masks)
        with pytest.raises(expected.type):
            slim(x, **masks)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_the_attention_raises_stocks_exception_type_for_a_wrong_padding_mask(batch_first, training, grad):
    torch.manual_seed(0)
    stock = STOCK_MHA(E, H, batch_first=batch_first).train(training)
    slim = slim_mha.convert(copy.deepcopy(stock))
    x = torch.randn((B, 10, E) if batch_first else (10, B, E))
    padding = torch.zeros(B, 11, dtype=torch.bool)
    with torch.set_grad_enabled(grad):
        with pytest.raises(Exception) as expected:
            stock(x, x, x, key_padding_mask=padding, need_weights=False)
        with pytest.raises(expected.type):
            slim(x, x, x, key_padding_mask=padding, need_weights=False)


# --------------------------------------------------------------------------------------- scripting


def doubled_layer_class(base: type) -> type:
    class Doubled(base):
        def forward(
            self,
            src: Tensor,
            src_mask: Optional[Tensor] = None,
            src_key_padding_mask: Optional[Tensor] = None,
            is_causal: bool = False,
        ) -> Tensor:
            return 2.0 * self.norm1(src)

    return Doubled


def halved_attention_class(base: type) -> type:
    class Halved(base):
        def forward(
            self,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            key_padding_mask: Optional[Tensor] = None,
            need_weights: bool = True,
            attn_mask: Optional[Tensor] = None,
            average_attn_weights: bool = True,
            is_causal: bool = False,
        ) -> Tuple[Tensor, Optional[Tensor]]:
            return 0.5 * self.out_proj(query), None

    return Halved


def _classes(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules()]


@pytest.mark.parametrize("kind", ["layer", "attention"])
def test_scripting_a_subclass_compiles_the_users_methods(kind):
    make = doubled_layer_class if kind == "layer" else halved_attention_class
    stock_base = STOCK_ENCODER_LAYER if kind == "layer" else STOCK_MHA
    with slim_mha.patched():
        slim_cls = make(PatchedTransformerEncoderLayer if kind == "layer" else PatchedMultiheadAttention)
        module = slim_cls(E, H, batch_first=True).eval()
    assert isinstance(
        module, slim_mha.SlimMultiheadAttention if kind == "attention" else encoder_layer.SlimTransformerEncoderLayer
    )
    x = torch.randn(B, 5, E)
    with torch.no_grad():
        eager = module(x) if kind == "layer" else module(x, x, x)[0]
        scripted = torch.jit.script(module)
        compiled = scripted(x) if kind == "layer" else scripted(x, x, x)[0]
        stock_scripted = torch.jit.script(make(stock_base)(E, H, batch_first=True))
    torch.testing.assert_close(compiled, eager)
    assert scripted.original_name == stock_scripted.original_name == slim_cls.__name__


@pytest.mark.parametrize("how", ["patched", "converted"])
def test_scripting_leaves_the_eager_model_as_it_was(how):
    def build() -> nn.Module:
        torch.manual_seed(0)
        layer = doubled_layer_class(nn.TransformerEncoderLayer)(E, H, FF, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()

    with slim_mha.patched():
        model = build()
        if how == "patched":
            plain = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, batch_first=True), 2).eval()
    if how == "converted":
        plain = slim_mha.convert(
            nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, batch_first=True), 2).eval()
        )
    for tree in (model, plain):
        classes, parameters = _classes(tree), list(tree.parameters())
        x = torch.randn(B, 5, E)
        with torch.no_grad():
            before = tree(x)
            scripted = torch.jit.script(tree)
            torch.testing.assert_close(scripted(x), before)
            after = tree(x)
        assert _classes(tree) == classes
        assert all(a is b for a, b in zip(tree.parameters(), parameters))
        torch.testing.assert_close(after, before)
        assert any(issubclass(c, slim_mha.SlimMultiheadAttention) for c in _classes(tree))


def test_scripting_shares_parameters_with_the_eager_model():
    with slim_mha.patched():
        model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, batch_first=True), 1).eval()
    scripted = torch.jit.script(model)
    with torch.no_grad():
        model.layers[0].self_attn.out_proj.bias.add_(1.0)
    x = torch.randn(B, 5, E)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


def test_a_subclass_that_cannot_be_rebuilt_on_stock_names_its_class():
    class Once:
        """A mixin that allows one subclass: the rebuilt class would be its second."""

        made = False

        def __init_subclass__(cls, **kwargs):
            if Once.made:
                raise RuntimeError("only one subclass")
            Once.made = True

    with slim_mha.patched():

        class Picky(PatchedMultiheadAttention, Once):
            pass

    from slim_mha._swap import _counterpart_of

    with warnings.catch_warnings(), pytest.raises(TypeError, match="Picky"):
        warnings.simplefilter("ignore")
        _counterpart_of(Picky)  # uncached: the class is rebuilt here
