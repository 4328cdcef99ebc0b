"""Code that names ``in_proj_bias`` as the registered Parameter it is on stock, done to both, compared.

Optimizer lists, ``clip_grad_norm_``, ``functional_call``, ``safetensors``/accelerate ``save_model``,
DDP, ``prune``, ``register_parameter``, ``jit.trace``: each gets stock's numbers, or a refusal whose
message names ``in_proj_bias`` and the fix. Never a silent difference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from slim_mha import SlimMultiheadAttention, convert
from tests._reference import STOCK_MHA, TOLERANCE, assert_close_scaled, randomize_parameters
from tests.test_in_the_wild import CONFIGS, E, assert_same, inputs, stock_and_slim

UNALIASED = "cannot reach q_proj_bias/v_proj_bias: their memory is managed by someone else"


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
    assert not torch.equal(slim.q_proj_bias, stock_and_slim()[1].q_proj_bias)  # the bias did move


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


def test_in_proj_bias_grad_is_the_parameters_gradients_and_writes_reach_them():
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    assert slim.in_proj_bias.grad is None
    for module in (stock, slim):
        loss_of(module, query, key, value).backward()
    packed = slim.in_proj_bias.grad
    assert packed is slim.in_proj_bias.grad  # one tensor, as long as nothing replaces the parts' grads
    assert_close_scaled(packed[:E], stock.in_proj_bias.grad[:E], "q slot")
    assert_close_scaled(packed[2 * E :], stock.in_proj_bias.grad[2 * E :], "v slot")
    assert torch.equal(packed[E : 2 * E], torch.zeros(E))  # the dropped key bias: stock's is rounding
    packed.mul_(0.5)  # clip_grad_norm_ scales in place
    assert torch.equal(slim.q_proj_bias.grad, packed[:E]) and torch.equal(slim.v_proj_bias.grad, packed[2 * E :])
    slim.half()  # casts re-point each .grad's data in place: the packed gradient follows
    assert slim.in_proj_bias.grad.dtype == torch.float16
    assert slim.q_proj_bias.grad.data_ptr() == slim.in_proj_bias.grad.data_ptr()
    slim.in_proj_bias.grad = None
    assert slim.q_proj_bias.grad is None and slim.v_proj_bias.grad is None
    with pytest.raises(RuntimeError, match=r"assigned grad has data of a different size: in_proj_bias is \(48,\)"):
        slim.in_proj_bias.grad = torch.zeros(E)


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


@pytest.mark.parametrize("how", ["requires_grad_", "attribute"])
def test_freezing_in_proj_bias_reaches_the_parameters_at_once(how):
    _, slim = stock_and_slim()
    if how == "requires_grad_":
        slim.in_proj_bias.requires_grad_(False)
    else:
        slim.in_proj_bias.requires_grad = False
    # Before any forward: a wrapper built now (DDP) must see the biases frozen.
    assert not slim.q_proj_bias.requires_grad and not slim.v_proj_bias.requires_grad
    assert not slim.in_proj_bias.requires_grad
    slim.in_proj_bias.requires_grad_(True)
    assert slim.q_proj_bias.requires_grad and slim.v_proj_bias.requires_grad


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


def test_state_dict_entries_still_write_through_to_the_parameters():
    """EMA code copies into state_dict()'s tensors: entries with storages of their own still alias."""
    _, slim = stock_and_slim()
    state = slim.state_dict()
    assert state["q_proj_bias"].untyped_storage().data_ptr() != state["v_proj_bias"].untyped_storage().data_ptr()
    state["q_proj_bias"].fill_(0.5)
    state["v_proj_bias"].fill_(-0.5)
    assert torch.equal(slim.q_proj_bias.detach(), torch.full((E,), 0.5))
    assert torch.equal(slim.in_proj_bias.detach()[2 * E :], torch.full((E,), -0.5))


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
    assert slim.in_proj_bias is slim.in_proj_bias and slim.q_proj_bias.data_ptr() == slim.in_proj_bias.data_ptr()
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


def test_functional_call_strict_with_stock_names_is_refused_by_name():
    stock, slim = stock_and_slim()
    with pytest.raises(RuntimeError) as refused:
        torch.func.functional_call(slim, dict(stock.named_parameters()), inputs(stock), strict=True)
    assert "Unexpected key(s): 'in_proj_bias'" in str(refused.value)
    assert "Missing key(s): 'q_proj_bias', 'v_proj_bias'" in str(refused.value)


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
    assert torch.equal(slim.q_proj_bias.detach(), new[:E])


def test_prune_on_in_proj_bias_is_refused_before_anything_changes():
    prune = pytest.importorskip("torch.nn.utils.prune")
    stock, slim = stock_and_slim()
    before = dict(slim.named_parameters())
    with pytest.raises(ValueError) as refused:
        prune.l1_unstructured(slim, "in_proj_bias", amount=0.3)
    assert str(refused.value) == (
        "cannot register in_proj_bias as parameter 'in_proj_bias_orig': SlimMultiheadAttention's parameters are "
        "q_proj_bias and v_proj_bias (in_proj_bias is their packed view, not a registered parameter). Prune or "
        "re-register q_proj_bias/v_proj_bias instead, or use slim_mha.to_stock(module)"
    )
    assert dict(slim.named_parameters()) == before and not slim._forward_pre_hooks
    prune.l1_unstructured(slim, "q_proj_bias", amount=0.3)  # the named fix works
    assert int((slim.q_proj_bias == 0).sum()) >= int(0.3 * E)


# --------------------------------------------- in_proj_bias over memory someone else manages


def test_writes_and_optimizers_on_a_computed_in_proj_bias_refuse_loudly():
    stock, slim = stock_and_slim()
    for module in (stock, slim):
        vector_to_parameters(parameters_to_vector(module.parameters()).clone(), module.parameters())
    assert_same(stock, slim, "after vector_to_parameters")
    assert int(slim.in_proj_bias[0]) == int(stock.in_proj_bias[0]) and len(list(slim.in_proj_bias)) == 3 * E
    read, expected = slim.in_proj_bias.detach().clone(), stock.in_proj_bias.detach()
    assert type(read) is torch.Tensor  # a copy of a computed in_proj_bias is a plain tensor
    assert_close_scaled(read[:E], expected[:E], "q slot read")  # reads are exact
    assert_close_scaled(read[2 * E :], expected[2 * E :], "v slot read")
    for write in (
        lambda bias: nn.init.zeros_(bias),
        lambda bias: bias.data.copy_(torch.zeros(3 * E)),
        lambda bias: bias.detach().add_(1.0),
        lambda bias: bias.requires_grad_(False),
        lambda bias: setattr(bias, "data", torch.zeros(3 * E)),
        lambda bias: bias.__iadd__(1.0),  # bias += 1.0
        lambda bias: bias.__setitem__(0, 1.0),  # bias[0] = 1.0
    ):
        with pytest.raises(RuntimeError, match=UNALIASED):
            with torch.no_grad():
                write(slim.in_proj_bias)
    query, key, value = inputs(stock)
    loss_of(slim, query, key, value).backward()
    with pytest.raises(RuntimeError, match=UNALIASED):
        torch.nn.utils.clip_grad_norm_([slim.in_proj_weight, slim.in_proj_bias], 1.0)
    slim.to(slim.q_proj_bias.device)  # the fix the message names: memory of their own again
    for module in (stock, slim):
        with torch.no_grad():
            nn.init.zeros_(module.in_proj_bias)
    assert_same(stock, slim, "after the fix and a write")


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
        src, tgt, src_mask=sparse, tgt_mask=causal, src_key_padding_mask=src_padding,
        tgt_key_padding_mask=tgt_padding, memory_key_padding_mask=src_padding,
    )
    (out.float() * weighting).sum().backward()
    gradients = {"src": src.grad, "tgt": tgt.grad}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None and not name.endswith("proj_bias"):  # the bias layouts differ
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
