"""Code that names ``in_proj_bias`` as the registered Parameter it is on stock, done to both, compared.

Optimizer lists (eager and compiled steps), ``clip_grad_norm_``, autograd hooks, copies of a model
with its optimizer, ``jit.script`` mid-training, ``functional_call``, selecting parameters by name,
parametrizations, ``prune``, fx, ``safetensors``/accelerate saving and loading, DDP, and a walk that
fills ``parameters()`` in order: each must give stock's numbers. Never a silent difference.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import slim_mha
from slim_mha import SlimMultiheadAttention, convert
from tests._reference import (
    STOCK_MHA,
    TOLERANCE,
    assert_close_scaled,
    randomize_parameters,
)
from tests.test_in_the_wild import CONFIGS, E, assert_same, inputs, stock_and_slim


def loss_of(module, query, key, value):
    return module(query, key, value)[0].pow(2).mean()


def listed_parameters(module):
    """The explicit list training scripts write for an attention module, in stock's names."""
    return [module.in_proj_weight, module.in_proj_bias, module.out_proj.weight, module.out_proj.bias]


# --------------------------------------------------------------------------- optimizers by attribute


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "sgd_foreach_momentum"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_an_optimizer_given_in_proj_bias_by_attribute_trains_it_as_stock(optimizer, set_to_none):
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    make = {
        "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
        "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
        "sgd_foreach_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True),
    }[optimizer]
    for module in (stock, slim):
        module.train()
        step = make(listed_parameters(module))
        for _ in range(5):
            step.zero_grad(set_to_none=set_to_none)
            loss_of(module, query, key, value).backward()
            step.step()
        module.eval()
    assert_same(stock, slim, f"after 5 {optimizer} steps over an explicit list")
    assert not torch.equal(slim.in_proj_bias[:E], stock_and_slim()[1].in_proj_bias[:E])  # the bias did move


def test_module_zero_grad_clears_what_an_optimizer_over_in_proj_bias_reads():
    """model.zero_grad() clears the parameters; in_proj_bias.grad, read from them, is cleared too."""
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    for module in (stock, slim):
        step = torch.optim.SGD(listed_parameters(module), lr=0.05)
        for _ in range(3):
            module.zero_grad()
            loss_of(module, query, key, value).backward()
            step.step()
    assert_same(stock, slim, "after steps cleared by Module.zero_grad")


def test_clip_grad_norm_over_an_explicit_list_matches_stock():
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    norms = []
    for module in (stock, slim):
        loss_of(module, query, key, value).mul(100.0).backward()
        norms.append(torch.nn.utils.clip_grad_norm_([module.in_proj_weight, module.in_proj_bias], 1.0))
        torch.optim.SGD(listed_parameters(module), lr=0.5).step()
    assert_close_scaled(norms[1], norms[0], "total norm")
    assert norms[0] > 1.0  # the clipping did scale
    assert_same(stock, slim, "after a clipped step")


# ------------------------------------------------------------------------ flags: freezing the bias


@pytest.fixture
def single_process_group():
    """A one-rank gloo group in this process (DDP's reducer runs its checks even at world size 1)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_after_freezing_in_proj_bias_trains_as_stock(single_process_group):
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    for module in (stock, slim):
        module.train()
        module.in_proj_bias.requires_grad_(False)
        wrapped = nn.parallel.DistributedDataParallel(module)
        step = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.05)
        for _ in range(2):  # the second step is where an unreduced gradient fails
            step.zero_grad()
            wrapped(query, key, value)[0].pow(2).mean().backward()
            step.step()
        module.eval()
    assert_same(stock, slim, "after DDP steps with a frozen bias")


# -------------------------------------------------------------------------- saving with shared memory


def test_safetensors_save_model_and_load_model_round_trip(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    stock, slim = stock_and_slim(**CONFIGS["bias_kv"])
    model = nn.Sequential(slim)
    safetensors_torch.save_model(model, str(tmp_path / "model.safetensors"))
    target = nn.Sequential(SlimMultiheadAttention(E, 4, add_bias_kv=True).eval())
    missing, unexpected = safetensors_torch.load_model(target, str(tmp_path / "model.safetensors"))
    assert not missing and not unexpected
    assert_same(stock, target[0], "after safetensors save_model/load_model")


def test_accelerate_save_model_keeps_the_value_bias(tmp_path, capfd):
    accelerate = pytest.importorskip("accelerate")
    stock, slim = stock_and_slim()
    accelerate.Accelerator(cpu=True).save_model(nn.Sequential(slim), tmp_path, safe_serialization=True)
    assert "Removed shared tensor" not in capfd.readouterr().err
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    assert set(state) == {"0." + name for name in slim.state_dict()}
    target = SlimMultiheadAttention(E, 4).eval()
    target.load_state_dict({name[2:]: tensor for name, tensor in state.items()}, strict=True)
    assert_same(stock, target, "after accelerate's save_model and a strict reload")


# ------------------------------------------------------------------------------ functional_call


@pytest.mark.parametrize("name", ["bias", "bias_kv", "zero_attn"])
def test_functional_call_with_stock_names_computes_stock_and_leaves_the_module_alone(name):
    stock, slim = stock_and_slim(**CONFIGS[name])
    query, key, value = inputs(stock)
    before = dict(slim.named_parameters())
    # MAML-style fast weights: plain tensors derived from stock's parameters, with a graph.
    fast = {n: (p * 1.5).detach().requires_grad_() for n, p in stock.named_parameters()}
    expected = torch.func.functional_call(stock, fast, (query, key, value))[0]
    actual = torch.func.functional_call(slim, fast, (query, key, value))[0]
    assert_close_scaled(actual, expected, "functional_call output")
    gradient = torch.autograd.grad(actual.pow(2).sum(), fast["in_proj_bias"])[0]
    expected_gradient = torch.autograd.grad(expected.pow(2).sum(), fast["in_proj_bias"])[0]
    assert_close_scaled(gradient, expected_gradient, "gradient reaching the passed in_proj_bias")
    assert dict(slim.named_parameters()) == before  # the very objects optimizers hold
    assert_same(stock, slim, "after functional_call")


def test_functional_call_with_stock_parameter_objects_restores_the_module():
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    before = dict(slim.named_parameters())
    packed = slim.in_proj_bias
    with torch.no_grad():
        expected = stock(query, key, value)[0]
        actual = torch.func.functional_call(slim, dict(stock.named_parameters()), (query, key, value))[0]
    assert_close_scaled(actual, expected, "functional_call output")
    assert dict(slim.named_parameters()) == before and slim.in_proj_bias is packed


def test_functional_call_strict_with_stock_names_computes_stock():
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    other = {name: tensor * 0.5 for name, tensor in stock.named_parameters()}
    with torch.no_grad():
        expected = torch.func.functional_call(stock, other, (query, key, value), strict=True)[0]
        actual = torch.func.functional_call(slim, other, (query, key, value), strict=True)[0]
    assert_close_scaled(actual, expected, "strict functional_call")


def test_vmap_ensembling_over_stock_modules_through_functional_call():
    stocks = [randomize_parameters(STOCK_MHA(E, 4), seed=seed).eval() for seed in range(3)]
    slim = SlimMultiheadAttention(E, 4).eval()
    parameters, buffers = torch.func.stack_module_state(stocks)
    query, key, value = inputs(stocks[0])

    def call(module, params):
        return torch.func.functional_call(module, (params, buffers), (query, key, value))[0]

    expected = torch.vmap(lambda p: call(stocks[0], p))(parameters)
    actual = torch.vmap(lambda p: call(slim, p))(parameters)
    assert_close_scaled(actual, expected, "vmapped ensemble")


# ---------------------------------------------------------------------------- name-based tools


def test_register_parameter_in_proj_bias_registers_it_as_stock_does():
    stock, slim = stock_and_slim()
    new = torch.randn(3 * E)
    new[E : 2 * E] = 0.0
    for module in (stock, slim):
        module.register_parameter("in_proj_bias", nn.Parameter(new.clone()))
    assert_same(stock, slim, "after register_parameter('in_proj_bias', ...)")
    assert slim.in_proj_bias is slim._parameters["in_proj_bias"] and torch.equal(slim.in_proj_bias.detach(), new)


def test_prune_on_in_proj_bias_prunes_as_on_stock():
    prune = pytest.importorskip("torch.nn.utils.prune")
    stock, slim = stock_and_slim()
    for module in (stock, slim):
        prune.l1_unstructured(module, "in_proj_bias", amount=0.3)
    assert_same(stock, slim, "after pruning in_proj_bias")
    assert torch.equal(slim.in_proj_bias_mask, stock.in_proj_bias_mask)
    for module in (stock, slim):
        prune.remove(module, "in_proj_bias")
    assert [name for name, _ in slim.named_parameters()] == [name for name, _ in stock.named_parameters()]


# ----------------------------------------------------------------------------- shapes and traces


@pytest.mark.parametrize("shape", [(0, 5), (2, 0)], ids=["batch_0", "length_0"])
@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "grad"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_empty_batches_and_sequences_as_stock(shape, context, need_weights):
    stock, slim = stock_and_slim(batch_first=True)
    x = torch.randn(*shape, E)
    manager = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}[context]
    with manager():
        expected, expected_weights = stock(x, x, x, need_weights=need_weights)
        actual, actual_weights = slim(x, x, x, need_weights=need_weights)
    assert actual.shape == expected.shape == x.shape
    if need_weights:  # stock's native kernel returns None here, its Python path an empty (B, L, S)
        assert actual_weights.shape == (shape[0], shape[1], shape[1])
    else:
        assert actual_weights is None and expected_weights is None


@pytest.mark.parametrize("name", ["bias", "bias_kv", "kdim_vdim"])
def test_jit_trace_with_its_default_check_matches_stock(name):
    stock, slim = stock_and_slim(**CONFIGS[name])
    query, key, value = inputs(stock)
    traced = torch.jit.trace(slim, (query, key, value))  # check_trace=True re-traces and compares
    with torch.no_grad():
        expected, expected_weights = stock(query, key, value)
        actual, actual_weights = traced(query, key, value)
    assert_close_scaled(actual, expected, "traced output")
    assert_close_scaled(actual_weights, expected_weights, "traced weights")


# ---------------------------------------------------------------- bf16 training of a masked stack


def masked_transformer_gradients(model, dtype, weighting, generator_seed=0):
    """Parameter and input gradients of nn.Transformer with padding, causal and sparse masks."""
    generator = torch.Generator().manual_seed(generator_seed)
    batch, src_len, tgt_len, width = 3, 10, 8, model.d_model
    src = torch.randn(batch, src_len, width, generator=generator).to(dtype).requires_grad_()
    tgt = torch.randn(batch, tgt_len, width, generator=generator).to(dtype).requires_grad_()
    src_padding = torch.zeros(batch, src_len, dtype=torch.bool)
    src_padding[0, 7:] = True
    tgt_padding = torch.zeros(batch, tgt_len, dtype=torch.bool)
    tgt_padding[1, 5:] = True
    causal = torch.triu(torch.ones(tgt_len, tgt_len, dtype=torch.bool), 1)
    sparse = torch.rand(src_len, src_len, generator=generator) < 0.7
    sparse[:, 0] = False  # every query keeps one unpadded key: no row masked from every key
    out = model(
        src,
        tgt,
        src_mask=sparse,
        tgt_mask=causal,
        src_key_padding_mask=src_padding,
        tgt_key_padding_mask=tgt_padding,
        memory_key_padding_mask=src_padding,
    )
    (out.float() * weighting).sum().backward()
    gradients = {"src": src.grad, "tgt": tgt.grad}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            gradients[name] = parameter.grad
    return {name: grad.float() for name, grad in gradients.items()}


@pytest.mark.parametrize("weighting_seed", range(8))
def test_bf16_masked_transformer_gradients_are_as_close_to_fp32_as_stock_s(weighting_seed):
    """slim's error against the fp32 run <= 2 x stock's error + 2% of the gradient's magnitude."""
    torch.manual_seed(0)
    stock = nn.Transformer(16, 4, 1, 1, 32, dropout=0.0, batch_first=True)
    slim = convert(copy.deepcopy(stock))
    weighting = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(100 + weighting_seed))
    exact = masked_transformer_gradients(copy.deepcopy(stock), torch.float32, weighting)
    stock_grads = masked_transformer_gradients(copy.deepcopy(stock).bfloat16(), torch.bfloat16, weighting)
    slim_grads = masked_transformer_gradients(copy.deepcopy(slim).bfloat16(), torch.bfloat16, weighting)
    assert set(slim_grads) == set(stock_grads)
    for name, reference in exact.items():
        stock_error = (stock_grads[name] - reference).abs().max().item()
        slim_error = (slim_grads[name] - reference).abs().max().item()
        bound = 2 * stock_error + TOLERANCE[torch.bfloat16] * reference.abs().max().item()
        assert slim_error <= bound, f"{name}: slim {slim_error:.3e} > {bound:.3e} (stock {stock_error:.3e})"


# ------------------------------------------------------------ idioms that hold by construction


def train_steps(module, optimizer, steps=3, seed=5, loss=None):
    """SGD-style steps on self-attention over seeded tokens; ``loss(module, x)`` for other modules."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 3, E, generator=generator)
        optimizer.zero_grad()
        (loss(module, x) if loss else loss_of(module, x, x, x)).backward()
        optimizer.step()


class SelfAttention(nn.Module):
    """A model around one attention module, as scripts and tracers see models."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, x):
        return self.attention(x, x, x)[0]


@pytest.mark.parametrize(
    "make", [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.Adam(p, lr=0.05)], ids=["sgd", "adam"]
)
def test_a_compiled_optimizer_step_over_in_proj_bias_trains_it_as_stock(make):
    stock, slim = stock_and_slim()
    for module in (stock, slim):
        optimizer = make(listed_parameters(module))
        step = torch.compile(optimizer.step, backend="eager")
        generator = torch.Generator().manual_seed(5)
        for _ in range(3):
            query = torch.randn(5, 3, E, generator=generator)
            optimizer.zero_grad()
            loss_of(module, query, query, query).backward()
            step()
    assert not torch.equal(slim.in_proj_bias[:E], stock_and_slim()[1].in_proj_bias[:E])
    assert_same(stock, slim, "after compiled optimizer steps")


@pytest.mark.parametrize("copier", ["deepcopy", "torch.save"])
def test_a_copy_of_model_and_optimizer_keeps_training_the_biases(copier):
    stock, slim = stock_and_slim(**CONFIGS["bias_kv"])
    copies = []
    for module in (stock, slim):
        bundle = {"model": module, "optimizer": torch.optim.SGD(listed_parameters(module), lr=0.1)}
        if copier == "deepcopy":
            bundle = copy.deepcopy(bundle)
        else:
            buffer = io.BytesIO()
            torch.save(bundle, buffer)
            buffer.seek(0)
            bundle = torch.load(buffer, weights_only=False)
        assert bundle["optimizer"].param_groups[0]["params"][1] is bundle["model"].in_proj_bias
        train_steps(bundle["model"], bundle["optimizer"])
        copies.append(bundle["model"])
    assert not torch.equal(copies[1].in_proj_bias[:E], slim.in_proj_bias[:E])  # the copy's biases moved
    assert_same(*copies, f"copies trained after {copier}")


def test_jit_script_mid_training_leaves_the_optimizer_training_the_same_parameters():
    stock, slim = stock_and_slim()
    models = [SelfAttention(stock), SelfAttention(slim)]
    for model in models:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_steps(model.attention, optimizer, steps=2, seed=1)
        scripted = torch.jit.script(model)  # torch swaps slim for stock in model's own _modules
        train_steps(model.attention, optimizer, steps=2, seed=2)  # eager training goes on
        assert model.attention.in_proj_bias is optimizer.param_groups[0]["params"][1]
        query = inputs(model.attention)[0]
        with torch.no_grad():
            assert_close_scaled(scripted(query), model(query), "scripted against eager")
    assert_same(models[0].attention, models[1].attention, "after scripting mid-training")


def test_autograd_hooks_and_targeted_backward_on_in_proj_bias_work_as_on_stock():
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    keep_query_slot = torch.cat([torch.ones(E), torch.zeros(2 * E)])
    accumulated = {}
    for module in (stock, slim):
        module.in_proj_bias.register_hook(lambda grad: grad * keep_query_slot)  # b_k and b_v frozen
        module.in_proj_bias.register_post_accumulate_grad_hook(
            lambda p, m=module: accumulated.setdefault(id(m), []).append(1)
        )
        optimizer = torch.optim.SGD(listed_parameters(module), lr=0.5)
        before = module.in_proj_bias.detach().clone()
        train_steps(module, optimizer)
        assert torch.equal(module.in_proj_bias[2 * E :].detach(), before[2 * E :]), "the masked b_v trained"
    assert len(accumulated[id(slim)]) == len(accumulated[id(stock)]) == 3
    assert_same(stock, slim, "after training with a gradient hook on in_proj_bias")
    for module in (stock, slim):
        module.zero_grad(set_to_none=True)
        loss_of(module, query, key, value).backward(inputs=[module.in_proj_bias])
        assert module.in_proj_bias.grad is not None and module.in_proj_weight.grad is None
        gradient = torch.autograd.grad(loss_of(module, query, key, value), [module.in_proj_bias], allow_unused=True)[0]
        assert gradient is not None
    assert_close_scaled(slim.in_proj_bias.grad, stock.in_proj_bias.grad, "backward(inputs=[in_proj_bias])")


@pytest.mark.parametrize("copier", ["deepcopy", "copy", "pickle", "torch.save"])
def test_a_key_bias_written_through_in_proj_bias_survives_copies(copier):
    stock, slim = stock_and_slim(**CONFIGS["bias_kv"])
    copied = []
    for module in (stock, slim):
        with torch.no_grad():
            nn.init.normal_(module.in_proj_bias, generator=torch.Generator().manual_seed(4))
        if copier == "deepcopy":
            copied.append(copy.deepcopy(module))
        elif copier == "copy":
            copied.append(copy.copy(module))
        elif copier == "pickle":
            copied.append(pickle.loads(pickle.dumps(module)))
        else:
            buffer = io.BytesIO()
            torch.save(module, buffer)
            buffer.seek(0)
            copied.append(torch.load(buffer, weights_only=False))
    assert copied[1].in_proj_bias[E : 2 * E].abs().max() > 0.1
    assert_same(*copied, f"after {copier}")


@pytest.mark.parametrize("name", ["bias", "bias_kv", "zero_attn"])
def test_an_init_over_in_proj_bias_after_loading_a_stock_state_dict_matches_stock(name):
    stock, slim = stock_and_slim(**CONFIGS[name])
    slim.load_state_dict(stock.state_dict())  # a nonzero key bias, loaded as stock's own
    for module in (stock, slim):
        with torch.no_grad():
            nn.init.normal_(module.in_proj_bias, generator=torch.Generator().manual_seed(8))
    assert_same(stock, slim, "after nn.init.normal_(in_proj_bias)")


def test_selecting_parameters_by_name_gives_stocks_groups():
    stock, slim = stock_and_slim()
    for module in (stock, slim):
        for name, parameter in module.named_parameters():
            if name.endswith("in_proj_bias"):
                parameter.requires_grad_(False)
        groups = [
            {"params": [p for n, p in module.named_parameters() if "in_proj" in n and p.requires_grad], "lr": 0.5},
            {"params": [p for n, p in module.named_parameters() if "in_proj" not in n], "lr": 0.01},
        ]
        train_steps(module, torch.optim.SGD(groups))
    names = lambda m: [(n, p.requires_grad) for n, p in m.named_parameters()]  # noqa: E731
    assert names(slim) == names(stock)
    assert_same(stock, slim, "after training with groups chosen by name")


@pytest.mark.parametrize("how", ["register_parametrization", "weight_norm"])
def test_parametrizations_on_in_proj_bias_work_as_on_stock(how):
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    class Scaled(nn.Module):
        def forward(self, bias):
            return 2.0 * bias

    stock, slim = stock_and_slim()
    for module in (stock, slim):
        if how == "weight_norm":
            weight_norm(module, name="in_proj_bias", dim=0)
        else:
            parametrize.register_parametrization(module, "in_proj_bias", Scaled())
    assert_same(stock, slim, f"after {how} on in_proj_bias")
    for module in (stock, slim):
        train_steps(module, torch.optim.SGD(module.parameters(), lr=0.1))
    assert [n for n, _ in slim.named_parameters()] == [n for n, _ in stock.named_parameters()]
    assert_same(stock, slim, f"after training with {how}")


def test_resuming_a_stock_optimizer_after_patch_continues_as_stock(tmp_path):
    layer_loss = lambda layer, x: layer(x).pow(2).mean()  # noqa: E731
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(E, 4, 32, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_steps(model, optimizer, loss=layer_loss)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "resume.pt")
    resumed = []
    for patch in (False, True):
        state = torch.load(tmp_path / "resume.pt", weights_only=True)
        with slim_mha.patched() if patch else contextlib.nullcontext():
            again = nn.TransformerEncoderLayer(E, 4, 32, dropout=0.0)
        assert isinstance(again.self_attn, SlimMultiheadAttention) == patch
        again.load_state_dict(state["model"])
        again_optimizer = torch.optim.AdamW(again.parameters(), lr=0.01)
        again_optimizer.load_state_dict(state["optimizer"])
        train_steps(again, again_optimizer, seed=9, loss=layer_loss)
        resumed.append(again.eval())
    x = torch.randn(6, 2, E)
    with torch.no_grad():
        assert_close_scaled(resumed[1](x), resumed[0](x), "resumed under patch")


def test_accelerate_empty_init_and_dispatch_of_a_stock_checkpoint_under_patch(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from safetensors.torch import save_file

    stock = nn.Sequential(randomize_parameters(STOCK_MHA(E, 4, add_bias_kv=True)).eval())
    save_file({k: v.contiguous() for k, v in stock.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with slim_mha.patched(), accelerate.init_empty_weights():
        model = nn.Sequential(nn.MultiheadAttention(E, 4, add_bias_kv=True))
    assert isinstance(model[0], SlimMultiheadAttention) and model[0].in_proj_bias.is_meta
    model = accelerate.load_checkpoint_and_dispatch(model, str(tmp_path / "model.safetensors"), device_map={"": "cpu"})
    assert_same(stock[0], model[0].eval(), "dispatched stock checkpoint")


def test_fx_symbolic_trace_records_slim_attention_as_a_call_like_stock():
    class Block(nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.norm, self.attention = nn.LayerNorm(E), attention

        def forward(self, x):
            h = self.norm(x)
            out, _ = self.attention(h, h, h, need_weights=False)
            return x + out

    stock, slim = stock_and_slim(batch_first=True)
    traced = {name: torch.fx.symbolic_trace(Block(module)) for name, module in (("stock", stock), ("slim", slim))}
    assert [node.op for node in traced["slim"].graph.nodes] == [node.op for node in traced["stock"].graph.nodes]
    x = torch.randn(2, 5, E)
    with torch.no_grad():
        assert_close_scaled(traced["slim"](x), traced["stock"](x), "fx-traced block")


@pytest.mark.parametrize("name", ["bias", "bias_kv", "zero_attn", "kdim_vdim"])
def test_a_walk_filling_parameters_in_order_gives_stocks_model(name):
    """As torch's own transformer tests fill a model: cos(arange(n)) into parameters() in order."""
    modules = (STOCK_MHA(E, 4, **CONFIGS[name]).eval(), SlimMultiheadAttention(E, 4, **CONFIGS[name]).eval())
    for module in modules:
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.copy_(torch.cos(torch.arange(parameter.numel(), dtype=torch.float32)).view_as(parameter))
    assert_same(*modules, "after the parameter walk")
