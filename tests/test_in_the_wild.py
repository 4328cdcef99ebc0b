"""What users and libraries do to attention modules, done to stock and to slim alike, then compared.

Each test builds a stock module with every parameter random, a slim one loaded from it, does the
same thing to both (an update idiom, a cast, a trace, a transform...) and compares the outputs
with the tolerance of the dtype. Nothing here may make slim differ silently.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import slim_mha
from slim_mha import SlimMultiheadAttention, convert
from tests._reference import STOCK_MHA, assert_close_scaled, randomize_parameters

E, H, L, S, B = 16, 4, 5, 7, 3
CONFIGS = {
    "bias": dict(),
    "bias_kv": dict(add_bias_kv=True),
    "zero_attn": dict(add_zero_attn=True),
    "kdim_vdim": dict(kdim=6, vdim=5),
}


def stock_and_slim(dtype=torch.float32, seed=0, **kwargs):
    """A random stock module (its key bias too) and a slim one loaded from it: the same numbers."""
    stock = randomize_parameters(STOCK_MHA(E, H, dtype=dtype, **kwargs), seed=seed).eval()
    slim = SlimMultiheadAttention(E, H, dtype=dtype, **kwargs).eval()
    slim.load_state_dict(stock.state_dict())
    return stock, slim


def inputs(module, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(L, B, E, generator=generator, dtype=torch.float64).to(dtype)
    key = torch.randn(S, B, module.kdim, generator=generator, dtype=torch.float64).to(dtype)
    value = torch.randn(S, B, module.vdim, generator=generator, dtype=torch.float64).to(dtype)
    return query, key, value


def assert_same(stock, slim, what, dtype=torch.float32, grad_too=True):
    """Outputs and weights under no_grad (the path without a graph) and with grad (the other path)."""
    __tracebackhide__ = True
    query, key, value = inputs(stock, dtype)
    modes = (False, True) if grad_too else (False,)
    for grad in modes:
        with torch.set_grad_enabled(grad):
            expected, expected_weights = stock(query, key, value)
            actual, actual_weights = slim(query, key, value)
            assert_close_scaled(actual, expected, f"{what} (grad={grad})")
            assert_close_scaled(actual_weights, expected_weights, f"{what} weights (grad={grad})")


def assert_same_after_writing_in_proj_bias(stock, slim, write):
    """``write`` in place through each module's ``in_proj_bias``."""
    __tracebackhide__ = True
    with torch.no_grad():
        write(stock.in_proj_bias), write(slim.in_proj_bias)
    assert_same(stock, slim, "after a write through in_proj_bias")


def in_place_on_every_parameter(update):
    def apply(module):
        with torch.no_grad():
            for parameter in module.parameters():
                update(parameter)

    return apply


# ----------------------------------------------------------------- updates that bump no version


@pytest.mark.parametrize("name", ["bias", "zero_attn", "kdim_vdim"])
@pytest.mark.parametrize(
    "idiom",
    [
        # EMA / weight averaging writes .data in place (linear maps: exact for every layout)
        pytest.param(lambda p: p.data.mul_(0.5), id="data.mul_"),
        pytest.param(lambda p: p.data.mul_(0.5).add_(1.0), id="data.mul_.add_"),
        pytest.param(lambda p: p.data.zero_(), id="data.zero_"),
        pytest.param(lambda p: p.detach().numpy().__imul__(-1.5), id="numpy write"),
    ],
)
def test_in_place_updates_that_bump_no_version_are_seen(name, idiom):
    stock, slim = stock_and_slim(**CONFIGS[name])
    assert_same(stock, slim, "before")  # a no-grad call first: nothing from it may be reused
    for module in (stock, slim):
        in_place_on_every_parameter(idiom)(module)
    assert_same(stock, slim, "after")


def test_averaging_state_dicts_with_bias_kv_is_exact():
    """Weight averaging (model soups) of saved state dicts: linear, and so is the fold of b_k."""
    models = [stock_and_slim(add_bias_kv=True, seed=seed) for seed in (0, 5)]
    averaged = []
    for index in (0, 1):
        states = [pair[index].state_dict() for pair in models]
        average = {key: 0.75 * states[0][key] + 0.25 * states[1][key] for key in states[0]}
        module = copy.deepcopy(models[0][index])
        module.load_state_dict(average)
        averaged.append(module)
    assert_same(*averaged, "averaged")


@pytest.mark.parametrize("name", ["bias", "bias_kv", "zero_attn"])
def test_vector_to_parameters_repoints_every_parameter(name):
    stock, slim = stock_and_slim(**CONFIGS[name])
    assert_same(stock, slim, "before")
    for module in (stock, slim):
        vector = parameters_to_vector(module.parameters())
        vector_to_parameters(vector * 0.5, module.parameters())  # p.data = slice of a new vector
    assert_same(stock, slim, "after vector_to_parameters")
    assert_same_after_writing_in_proj_bias(stock, slim, lambda bias: bias[:E].add_(0.25))
    for module in (stock, slim):
        module.float()  # a cast gives each parameter memory of its own: aliased again
    assert_same_after_writing_in_proj_bias(stock, slim, lambda bias: bias.add_(0.25))


def test_hogwild_updates_from_another_process_are_seen():
    stock, slim = stock_and_slim()
    assert_same(stock, slim, "before")
    context = torch.multiprocessing.get_context("fork")
    for module in (stock, slim):
        module.share_memory()
        worker = context.Process(target=in_place_on_every_parameter(lambda p: p.add_(0.5)), args=(module,))
        worker.start()
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert_same(stock, slim, "after the other process's update")


# ------------------------------------------------------------------------------- stock idioms


@pytest.mark.parametrize("name", ["bias", "bias_kv", "zero_attn", "kdim_vdim"])
@pytest.mark.parametrize(
    "idiom",
    [
        pytest.param(lambda m: nn.init.constant_(m.in_proj_bias, 0.3), id="init.constant_"),
        pytest.param(lambda m: nn.init.zeros_(m.in_proj_bias), id="init.zeros_"),
        pytest.param(
            lambda m: nn.init.normal_(m.in_proj_bias, generator=torch.Generator().manual_seed(3)), id="init.normal_"
        ),
        pytest.param(lambda m: m.in_proj_bias.data.copy_(torch.linspace(-1, 1, 3 * E)), id="data.copy_"),
        pytest.param(lambda m: m.in_proj_bias.data.zero_(), id="data.zero_"),
        pytest.param(lambda m: m.in_proj_bias.data.mul_(-2.0), id="data.mul_"),
    ],
)
def test_writes_through_in_proj_bias_reach_the_parameters(name, idiom):
    stock, slim = stock_and_slim(**CONFIGS[name])
    assert_same(stock, slim, "before")
    for module in (stock, slim):
        idiom(module)
    assert_same(stock, slim, "after the write")
    assert torch.equal(slim.in_proj_bias.detach(), stock.in_proj_bias.detach())


@pytest.mark.parametrize("name", ["bias", "bias_kv"])
def test_in_place_ops_on_in_proj_bias_under_no_grad(name):
    stock, slim = stock_and_slim(**CONFIGS[name])
    with torch.no_grad():
        for module in (stock, slim):
            module.in_proj_bias.copy_(torch.arange(3 * E, dtype=torch.float32) / 10)
            module.in_proj_bias[E:].zero_()
    assert_same(stock, slim, "after copy_ and zero_")
    assert torch.equal(slim.in_proj_bias.detach(), stock.in_proj_bias.detach())


def test_in_place_on_in_proj_bias_with_grad_fails_as_stock():
    stock, slim = stock_and_slim()
    for module in (stock, slim):
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            module.in_proj_bias.zero_()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_open_clip_style_low_precision_conversion(dtype):
    """open_clip's convert_weights_to_lp assigns ``t.data = t.data.to(dtype)`` to in_proj_bias."""

    def to_low_precision(model):
        for module in model.modules():
            if isinstance(module, nn.MultiheadAttention):
                for name in (
                    "in_proj_weight",
                    "q_proj_weight",
                    "k_proj_weight",
                    "v_proj_weight",
                    "in_proj_bias",
                    "bias_k",
                    "bias_v",
                ):
                    tensor = getattr(module, name)
                    if tensor is not None:
                        tensor.data = tensor.data.to(dtype)
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.to(dtype)
                if module.bias is not None:
                    module.bias.data = module.bias.data.to(dtype)

    stock, slim = stock_and_slim(add_bias_kv=True)
    assert_same(stock, slim, "before")
    to_low_precision(stock), to_low_precision(slim)
    assert_same(stock, slim, "after the conversion", dtype=dtype)
    assert slim.in_proj_bias.dtype == dtype
    assert torch.equal(slim.state_dict()["in_proj_bias"], stock.in_proj_bias.detach())


def test_open_clip_style_conversion_then_move_keeps_the_function():
    stock, slim = stock_and_slim()
    for module in (stock, slim):
        module.in_proj_bias.data = module.in_proj_bias.data.to(torch.float64)
        module.in_proj_weight.data = module.in_proj_weight.data.to(torch.float64)
        module.out_proj.to(torch.float64)
        module.to("cpu")  # _apply with in_proj_bias re-pointed and not yet taken in
    assert_same(stock, slim, "after", dtype=torch.float64)


def test_in_proj_bias_data_assignment_right_before_compile():
    """The re-pointing is taken in when it happens: the compiled forward never runs eagerly first."""
    stock, slim = stock_and_slim()
    new_bias = torch.linspace(-2.0, 2.0, 3 * E)
    for module in (stock, slim):
        module.in_proj_bias.data = new_bias.clone()
    query, key, value = inputs(stock)
    with torch.no_grad():
        compiled = torch.compile(slim, backend="eager", fullgraph=True)
        assert_close_scaled(compiled(query, key, value)[0], stock(query, key, value)[0], "compiled")


@pytest.mark.parametrize("grad", (False, True), ids=("no_grad", "grad"))
def test_key_bias_written_through_in_proj_bias_compiles_as_stock(grad):
    """With ``add_bias_kv`` a key bias written into in_proj_bias shifts the keys against ``bias_k``
    (as in stock): the compiled forward reads that middle slot as eager does."""
    stock, slim = stock_and_slim(add_bias_kv=True)
    for module in (stock, slim):
        nn.init.normal_(module.in_proj_bias, generator=torch.Generator().manual_seed(3))
    assert slim.in_proj_bias[E : 2 * E].abs().max() > 0.1  # the slot the compiled forward must read
    query, key, value = inputs(stock)
    compiled = torch.compile(slim, backend="aot_eager", fullgraph=True)
    with torch.set_grad_enabled(grad):
        expected, expected_weights = stock(query, key, value)
        eager, _ = slim(query, key, value)
        actual, actual_weights = compiled(query, key, value)
    assert_close_scaled(actual, expected, "compiled output")
    assert_close_scaled(actual_weights, expected_weights, "compiled weights")
    assert_close_scaled(actual, eager, "compiled against eager")
    if grad:
        parameters = list(slim.parameters())
        eager_grads = torch.autograd.grad(eager.sum(), parameters)
        for index, (a, b) in enumerate(zip(torch.autograd.grad(actual.sum(), parameters), eager_grads, strict=True)):
            assert_close_scaled(a, b, f"grad of parameter {index}")


def test_requires_grad_on_in_proj_bias_freezes_the_biases_as_stock():
    stock, slim = stock_and_slim()
    stock.in_proj_bias.requires_grad_(False), slim.in_proj_bias.requires_grad_(False)
    query, key, value = inputs(stock)
    for module in (stock, slim):
        module(query, key, value)[0].sum().backward()
    assert slim.in_proj_bias.grad is None and stock.in_proj_bias.grad is None
    for module in (stock, slim):
        module.in_proj_bias.requires_grad_(True)
        module(query, key, value)[0].sum().backward()
    assert_close_scaled(slim.in_proj_bias.grad, stock.in_proj_bias.grad, "in_proj_bias.grad")


@pytest.mark.parametrize("name", ["bias", "zero_attn"])
def test_gradients_of_code_using_in_proj_bias_itself_reach_the_parameters(name):
    """Stock's in_proj_bias is a Parameter: a loss on it (weight decay by hand, a probe) trains it."""
    stock, slim = stock_and_slim(**CONFIGS[name])
    query, key, value = inputs(stock)
    for module in (stock, slim):
        loss = module(query, key, value)[0].pow(2).mean() + 0.1 * module.in_proj_bias.pow(2).sum()
        loss.backward()
    # The weight-decay term reaches every slot; the attention adds nothing to the key slot on slim
    # (exactly) and rounding noise on stock.
    assert_close_scaled(slim.in_proj_bias.grad, stock.in_proj_bias.grad, "in_proj_bias.grad")


def test_an_optimizer_step_on_a_loss_over_in_proj_bias_matches_stock():
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, slim)]
    for module, optimizer in zip((stock, slim), optimizers):
        (module(query, key, value)[0].sum() + module.in_proj_bias.sum()).backward()
        optimizer.step()
    assert_same(stock, slim, "after one step")


# ---------------------------------------------------------------------- casts, modes, devices


@pytest.mark.parametrize("cast", ["half", "double", "bfloat16"])
def test_casts_after_a_no_grad_call(cast):
    stock, slim = stock_and_slim(add_bias_kv=True)
    assert_same(stock, slim, "before", grad_too=False)
    dtype = {"half": torch.float16, "double": torch.float64, "bfloat16": torch.bfloat16}[cast]
    for module in (stock, slim):
        module.half() if cast == "half" else module.double() if cast == "double" else module.to(dtype)
    assert_same(stock, slim, f"after .{cast}()", dtype=dtype)
    assert slim.in_proj_bias.dtype == dtype


def test_patched_transformer_decoder_casts_after_a_no_grad_call():
    def decoder():
        torch.manual_seed(0)
        layer = nn.TransformerDecoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
        return nn.TransformerDecoder(layer, num_layers=2).eval()

    stock = decoder()
    with slim_mha.patched():
        slim = decoder()
    assert isinstance(slim.layers[0].self_attn, SlimMultiheadAttention)
    randomize_parameters(stock)
    slim.load_state_dict(stock.state_dict())
    target, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    with torch.no_grad():
        slim(target, memory), stock(target, memory)
    stock.double(), slim.double()
    with torch.no_grad():
        assert_close_scaled(slim(target.double(), memory.double()), stock(target.double(), memory.double()))


def test_module_built_under_inference_mode_runs():
    with torch.inference_mode():
        stock, slim = stock_and_slim()
        assert_same(stock, slim, "inside inference mode", grad_too=False)
    with torch.no_grad():
        query, key, value = inputs(stock)
        assert_close_scaled(slim(query, key, value)[0], stock(query, key, value)[0], "outside, no_grad")


def test_mixed_dtype_bias_as_stock_python_path():
    """PyTorch's test_multihead_attn_fast_path_query_and_bias_have_different_dtypes, compared."""
    stock = randomize_parameters(STOCK_MHA(E, H, batch_first=True, dtype=torch.float64)).eval()
    slim = SlimMultiheadAttention(E, H, batch_first=True, dtype=torch.float64).eval()
    slim.load_state_dict(stock.state_dict())
    with torch.no_grad():
        for module in (stock, slim):
            module.in_proj_bias = nn.Parameter(module.in_proj_bias.to(torch.half))
        query = torch.randn(B, L, E, dtype=torch.float64)
        assert_close_scaled(slim(query, query, query)[0], stock(query, query, query)[0], "half bias")


# ---------------------------------------------------------------------------- traces, scripts


def test_jit_trace_follows_later_weight_updates():
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    with torch.no_grad():
        traced = [torch.jit.trace(m, (query, key, value)) for m in (stock, slim)]  # check_trace on
        for module in (stock, slim):
            nn.init.normal_(module.in_proj_bias, generator=torch.Generator().manual_seed(4))
            module.out_proj.bias.add_(1.0)
        expected, actual = (t(query, key, value)[0] for t in traced)
    assert_close_scaled(actual, expected, "traced after the update")
    assert_close_scaled(actual, stock(query, key, value)[0].detach(), "traced vs eager stock")


@pytest.mark.parametrize("name", ["bias", "bias_kv", "zero_attn"])
def test_jit_script_scripts_the_equivalent_stock_module(name):
    stock, slim = stock_and_slim(**CONFIGS[name])
    query, key, value = inputs(stock)
    scripted = torch.jit.script(slim)
    with torch.no_grad():
        assert_close_scaled(scripted(query, key, value)[0], stock(query, key, value)[0], "scripted")


def test_jit_script_of_a_patched_encoder():
    def encoder():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()

    stock = encoder()
    with slim_mha.patched():
        slim = encoder()
    randomize_parameters(stock)
    slim.load_state_dict(stock.state_dict())
    x = torch.randn(B, L, E)
    scripted = torch.jit.script(slim)
    with torch.no_grad():
        assert_close_scaled(scripted(x), stock(x), "scripted encoder")


# ---------------------------------------------------------------------------------- functorch


@pytest.mark.parametrize("need_weights", [True, False])
def test_vmap_over_inputs(need_weights):
    stock, slim = stock_and_slim(add_bias_kv=True)
    batches = torch.randn(2, L, B, E)

    def run(module):
        return torch.func.vmap(lambda x: module(x, x, x, need_weights=need_weights)[0])(batches)

    with torch.no_grad():
        assert_close_scaled(run(slim), run(stock), "vmap")
    assert_close_scaled(run(slim), run(stock), "vmap with grad")


@pytest.mark.parametrize("average", [True, False])
def test_vmap_with_weights_over_large_scores(average):
    """Scores above the explicit path's large-size threshold (its no-graph, buffer-reusing branch)."""
    stock, slim = stock_and_slim()
    batches = torch.randn(2, 300, 1, E)  # (300 x 300) scores x 4 heads x 4 bytes > 1 MiB per example

    def run(module):
        return torch.func.vmap(lambda x: module(x, x, x, average_attn_weights=average))(batches)

    with torch.no_grad():
        (out, weights), (expected, expected_weights) = run(slim), run(stock)
    assert_close_scaled(out, expected, "vmap output")
    assert_close_scaled(weights, expected_weights, "vmap weights")


def test_vmap_ensembling_with_stack_module_state_and_functional_call():
    """torch.func's model-ensembling recipe, with the default need_weights=True."""
    pairs = [stock_and_slim(seed=seed) for seed in range(3)]
    query, key, value = inputs(pairs[0][0])

    def ensemble(models):
        params, buffers = torch.func.stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")

        def call(p, b):
            return torch.func.functional_call(base, (p, b), (query, key, value))

        return torch.func.vmap(call)(params, buffers)

    stock_out, stock_weights = ensemble([stock for stock, _ in pairs])
    slim_out, slim_weights = ensemble([slim for _, slim in pairs])
    assert_close_scaled(slim_out, stock_out, "ensemble output")
    assert_close_scaled(slim_weights, stock_weights, "ensemble weights")


def test_functional_call_with_other_tensors_does_not_touch_the_module():
    stock, slim = stock_and_slim()
    query, key, value = inputs(stock)
    other_stock, other_slim = stock_and_slim(seed=9)
    expected = torch.func.functional_call(stock, dict(other_stock.named_parameters()), (query, key, value))[0]
    actual = torch.func.functional_call(slim, dict(other_slim.named_parameters()), (query, key, value))[0]
    assert_close_scaled(actual, expected, "functional_call")
    assert_same(stock, slim, "the modules afterwards")


def test_equivariance_mode_skips_under_vmap():
    _, slim = stock_and_slim()
    checked = SlimMultiheadAttention(E, H, check_equivariance=True).eval()
    checked.load_state_dict(slim.state_dict())
    batches = torch.randn(2, L, B, E)
    out = torch.func.vmap(lambda x: checked(x, x, x)[0])(batches)
    assert_close_scaled(out, torch.func.vmap(lambda x: slim(x, x, x)[0])(batches), "checked under vmap")


# ---------------------------------------------------------------------------------- loading


def test_strict_false_load_without_bias_k_behaves_as_stock():
    stock, slim = stock_and_slim(add_bias_kv=True)
    source = randomize_parameters(STOCK_MHA(E, H, add_bias_kv=True), seed=11)
    partial = {k: v for k, v in source.state_dict().items() if k != "bias_k"}
    for module in (stock, slim):
        result = module.load_state_dict(partial, strict=False)
        assert result.missing_keys == ["bias_k"]
    assert_same(stock, slim, "after the partial load")


def test_load_state_dict_assign_keeps_in_proj_bias_writable():
    stock, slim = stock_and_slim(add_bias_kv=True)
    source, _ = stock_and_slim(add_bias_kv=True, seed=12)  # b_k = 0: a later write compares (see above)
    for module in (stock, slim):
        module.load_state_dict(source.state_dict(), assign=True)
    assert_same(stock, slim, "after assign=True")
    assert_same_after_writing_in_proj_bias(stock, slim, lambda bias: bias.mul_(3.0))


@pytest.mark.parametrize("copier", ["deepcopy", "pickle"])
def test_copies_keep_the_function_and_their_own_memory(copier):
    stock, slim = stock_and_slim(add_bias_kv=True)
    copy_of = copy.deepcopy if copier == "deepcopy" else (lambda m: pickle.loads(pickle.dumps(m)))
    stock_copy, slim_copy = copy_of(stock), copy_of(slim)
    assert_same(stock_copy, slim_copy, "copies")
    with torch.no_grad():
        stock_copy.in_proj_bias.add_(1.0), slim_copy.in_proj_bias.add_(1.0)
    assert_same(stock_copy, slim_copy, "copies after a write")
    assert_same(stock, slim, "originals untouched")


def test_save_pretrained_style_shared_memory_check_passes():
    """safetensors refuses overlapping tensors; the saved biases are disjoint views."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    _, slim = stock_and_slim(add_zero_attn=True)
    restored = safetensors_torch.load(safetensors_torch.save(slim.state_dict()))
    for key, tensor in slim.state_dict().items():
        assert torch.equal(restored[key], tensor), key


# ---------------------------------------------------------------------------------- convert


def test_convert_refuses_a_parametrized_module_clearly():
    model = nn.Sequential(randomize_parameters(STOCK_MHA(E, H)))
    torch.nn.utils.parametrize.register_parametrization(model[0], "in_proj_weight", _Scale())
    with pytest.raises(ValueError, match=r"convert: module '0' is a parametrized nn.MultiheadAttention"):
        convert(model)
    assert type(model[0]).__name__ == "ParametrizedMultiheadAttention"  # nothing half-done


class _Scale(nn.Module):
    def forward(self, weight):
        return weight * 2.0


def test_numpy_import_through_in_proj_bias():
    """An importer from another framework writes the stock layout through numpy views."""
    stock, slim = stock_and_slim(add_bias_kv=True)
    values = np.linspace(-1.0, 1.0, 3 * E, dtype=np.float32)
    for module in (stock, slim):
        module.in_proj_bias.detach().numpy()[:] = values
    assert_same(stock, slim, "after the numpy write")
