"""The equivariance checks never change the step they check.

Each scenario runs the same seeded training step with and without the check and compares everything
the user can see afterwards: outputs, gradients, module attributes, buffers and the random generators
(torch's, Python's, NumPy's), bit for bit. The scenarios are those a model meets in real use: an
auxiliary loss kept as an attribute, a step counter, an EMA buffer used in the same forward, spectral
norm, host randomness per batch, an input edited in place, sets of 0 or 1 tokens, a model shared by
two threads, and ``every=`` around each step.
"""

from __future__ import annotations

import copy
import random
import threading

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import slim_mha
from slim_mha.equivariance import EquivarianceError, checking_equivariance
from slim_mha.equivariance import _mode as equivariance_mode

B, N, D, H = 3, 8, 16, 4


@pytest.fixture(autouse=True)
def fresh_counts():
    equivariance_mode.reset()
    yield
    equivariance_mode.reset()


class SetModel(nn.Module):
    """Attention over a set, with the habits of real models switched on by name."""

    def __init__(self, habit: str = "") -> None:
        super().__init__()
        self.habit = habit
        self.embed = nn.Linear(D, D)
        self.attention = slim_mha.SlimMultiheadAttention(D, H, dropout=0.1, batch_first=True)
        self.gate = nn.Linear(D, 1)
        self.dropout = nn.Dropout(0.2)
        self.norm = nn.BatchNorm1d(D)
        self.register_buffer("scale", torch.ones(()))
        self.steps = 0
        self.aux_loss: Tensor | None = None

    def forward(self, x: Tensor, padding: Tensor | None = None) -> Tensor:
        if self.habit == "edits its input":
            x.masked_fill_(padding[..., None], 0.0)
        if self.habit == "host randomness":
            x = x * (1.0 + random.random()) * (1.0 + float(np.random.rand()))
        self.steps += 1
        h = self.embed(x)
        if self.habit == "ema buffer":
            self.scale.mul_(0.9).add_(0.1 * h.detach().abs().mean())
            h = h / self.scale
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)  # batch norm over batch and tokens
        h = h + self.attention(h, h, h, key_padding_mask=padding, need_weights=False)[0]
        gates = self.gate(h).sigmoid()
        self.aux_loss = gates.mean() ** 2  # an MoE-style balance loss, read after forward
        return self.dropout(h * gates)


def step(model: nn.Module, check: bool, *, every: int = 1, tokens: int = N, seed: int = 0, precision: str = ""):
    """One seeded training step; everything it leaves behind. ``precision``: "bfloat16" runs the
    model and its input in bfloat16, "autocast" under CPU bfloat16 autocast (the check then reruns
    the call in float32 to measure its rounding, which must leave the step alone as well)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    leaf = torch.randn(B, tokens, D, dtype=dtype, requires_grad=True)
    x = leaf * 1.0  # an upstream layer's output, as a model's input is: not a leaf
    padding = torch.zeros(B, tokens, dtype=torch.bool)
    if tokens > 2:
        padding[0, -2:] = True
    scope = checking_equivariance(model, dim={"x": 1, "padding": 1}, every=every) if check else _nothing()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast")
    with scope, autocast:
        out = model(x, padding)
    loss = out.float().square().mean() + model.aux_loss
    loss.backward()
    return {
        "out": out.detach(),
        "grad x": leaf.grad,
        **{f"grad {name}": p.grad for name, p in model.named_parameters()},
        **{f"buffer {name}": b.clone() for name, b in model.named_buffers()},
        "steps": model.steps,
        "rng": (torch.rand(2), random.random(), float(np.random.rand())),
    }


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def assert_same(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for key in first:
        a, b = first[key], second[key]
        if isinstance(a, Tensor):
            assert torch.equal(a, b), key
        elif key == "rng":
            assert torch.equal(a[0], b[0]) and a[1:] == b[1:], key
        else:
            assert a == b, key


def twins(habit: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = SetModel(habit).train()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("habit", ["", "ema buffer", "host randomness", "edits its input"])
def test_a_checked_training_step_is_the_unchecked_step_bit_for_bit(habit):
    unchecked, checked = twins(habit)
    expected = step(unchecked, check=False)
    actual = step(checked, check=True)  # the check runs (and passes: the model has no position)
    assert_same(actual, expected)


@pytest.mark.parametrize("precision", ["bfloat16", "autocast"])
@pytest.mark.parametrize("habit", ["", "ema buffer"])
def test_a_low_precision_step_with_its_float32_rerun_is_the_unchecked_step(habit, precision):
    unchecked, checked = twins(habit)
    if precision == "bfloat16":
        unchecked, checked = unchecked.to(torch.bfloat16), checked.to(torch.bfloat16)
    expected = step(unchecked, check=False, precision=precision)
    actual = step(checked, check=True, precision=precision)
    assert_same(actual, expected)
    assert all(p.dtype == expected[f"grad {name}"].dtype for name, p in checked.named_parameters())


def test_the_auxiliary_loss_attribute_keeps_its_graph():
    """A no-grad rerun that overwrote ``aux_loss`` would drop its gradient from the step."""
    unchecked, checked = twins("")
    expected = step(unchecked, check=False)
    actual = step(checked, check=True)
    assert checked.aux_loss.requires_grad
    assert actual["grad gate.weight"].abs().sum() > 0
    assert torch.equal(actual["grad gate.weight"], expected["grad gate.weight"])


@pytest.mark.parametrize("tokens", [0, 1])
def test_sets_of_no_token_or_one_token_are_nothing_to_permute(tokens):
    unchecked, checked = twins("")
    expected = step(unchecked, check=False, tokens=tokens)
    assert_same(step(checked, check=True, tokens=tokens), expected)


def test_every_counts_a_models_steps_across_blocks():
    """The docs' snippet wraps one step in each block: ``every=10`` over 20 steps checks 2 of them."""
    torch.manual_seed(0)
    model = SetModel().train()
    calls = []
    model.embed.register_forward_hook(lambda *_: calls.append(1))
    for index in range(20):
        step(model, check=True, every=10, seed=index)
    assert len(calls) == 20 + 2 * 2  # each check runs the model twice more


def test_spectral_norm_is_not_advanced_by_the_per_call_check():
    torch.manual_seed(0)
    attention = slim_mha.SlimMultiheadAttention(D, H, batch_first=True).train()
    torch.nn.utils.parametrizations.spectral_norm(attention.out_proj)
    twin = copy.deepcopy(attention)
    x = torch.randn(B, N, D)
    attention(x, x, x)
    with checking_equivariance():
        twin(x, x, x)
    u = "out_proj.parametrizations.weight.0._u"
    assert torch.equal(dict(twin.named_buffers())[u], dict(attention.named_buffers())[u])


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_per_call_check_changes_no_output_in_its_last_bits(dtype, need_weights):
    """The check follows the path the call takes; it used to force slim's general path (in bf16
    without weights, 2e-3 off stock's kernel's answer)."""
    torch.manual_seed(0)
    attention = slim_mha.SlimMultiheadAttention(64, 4, batch_first=True, dtype=dtype).eval()
    x = torch.randn(2, 16, 64, dtype=dtype)
    with torch.no_grad():
        plain = attention(x, x, x, need_weights=need_weights)
        with checking_equivariance():
            checked = attention(x, x, x, need_weights=need_weights)
    assert torch.equal(checked[0], plain[0])
    assert (checked[1] is None and plain[1] is None) or torch.equal(checked[1], plain[1])


def test_a_model_shared_with_another_thread_keeps_its_dropout_there():
    """The check's runs switch dropout off in their own thread alone: no module flag is flipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Dropout(1.0)).train()  # p=1: every training output is zero
    x = torch.randn(B, N, D)
    outputs, stop = [], threading.Event()

    def other_thread():
        for _ in range(200):
            outputs.append(model(x))

    def checking_thread():
        while not stop.is_set():
            with checking_equivariance(model, dim=1):
                model(x)

    checker = threading.Thread(target=checking_thread)
    worker = threading.Thread(target=other_thread)
    checker.start(), worker.start()
    worker.join(60)
    stop.set()
    checker.join(60)
    assert len(outputs) == 200 and all(bool((out == 0).all()) for out in outputs)
    assert all(m.training for m in model.modules())


def test_a_real_break_still_raises_after_all_this():
    torch.manual_seed(0)

    class Leaky(SetModel):
        def forward(self, x, padding=None):
            return super().forward(x + torch.linspace(0, 1, x.shape[1])[:, None], padding)

    model = Leaky().train()
    with pytest.raises(EquivarianceError):
        step(model, check=True)
