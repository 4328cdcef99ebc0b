"""The three contenders of a case, built on the same weights and inputs.

* ``stock``: ``nn.MultiheadAttention(batch_first=True)`` with random weights and biases (key bias
  included). In inference it runs under ``eval()`` and ``torch.inference_mode()``, so it takes its
  native fast path (``aten::_native_multi_head_attention``) whenever it is eligible (self-attention,
  even head count): that is the honest baseline. Which path it took is recorded per case.
* ``slim``: ``SlimMultiheadAttention`` loaded from stock's state dict (the key bias is folded away).
* ``floor``: the bare computation written out by hand, in batch-first layout, with no module and
  no argument checks: the input-projection matmul, the attention, the output-projection matmul.
  Without weights the attention is ``F.scaled_dot_product_attention``. With ``need_weights=True``
  it is the explicit path: ``softmax((q / sqrt(D)) kᵀ)``, its product with ``v``, and the
  head-averaged weights (softmax in place when no graph is recorded). With ``masks`` their ``-inf``
  form, built once, is added to the scores or handed to SDPA. In training the floor's parameters
  are leaf tensors and its backward is timed with it.

Every contender's step is the same call: forward in inference; forward then
``out.backward(grad_out)`` in training (the returned weights are not differentiated).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..._torch_compat import stock_kernel
from ...attention import SlimMultiheadAttention
from ...paths import forcing_blocks
from ..measure.compiled import graph_breaks
from .cases import AUTOCAST, DTYPES, MASKINGS, Case

__all__ = [
    "CONTENDERS",
    "MASKS",
    "Contender",
    "build_contenders",
    "slim_variants",
    "case_masks",
    "fast_path_enabled",
    "output_error",
]

CONTENDERS = ("stock", "slim", "floor")
MASKS = MASKINGS


@dataclass
class Contender:
    """One way of computing a case: ``step`` is what is timed, ``reset`` runs untimed before each step."""

    name: str
    step: Callable[[], None]
    forward: Callable[[], tuple[Tensor, Tensor | None]]
    parameters: list[Tensor]
    reset: Callable[[], None]
    # Tensors that belong to the caller (inputs) rather than to the step's own activations.
    external: list[Tensor] = field(default_factory=list)
    # The floor's computation: the fastest bare one torch offers for the case (see _fastest_floor).
    kind: str = ""
    # Under --compile: Dynamo's graph breaks in the module's call (measure.compiled.graph_breaks).
    graph_breaks: dict | None = None


@contextlib.contextmanager
def fast_path_enabled(enabled: bool) -> Iterator[None]:
    """``torch.backends.mha`` fast path set to ``enabled`` inside, restored after: off, stock's
    default call takes stock's Python path and slim's takes slim's own one pass."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def _set_equivariance_check(module: SlimMultiheadAttention, on: bool, every: int | None) -> None:
    """On for the equivariance mode; explicitly off otherwise, so neither ``SLIM_MHA_CHECK_EQUIVARIANCE``
    nor an enclosing ``checking_equivariance()`` scope can switch it on behind the benchmark's back."""
    module.check_equivariance = on
    if on and every is not None:
        module.check_equivariance_every = every


def _stock_module(case: Case, device: torch.device, dtype: torch.dtype) -> nn.MultiheadAttention:
    stock = nn.MultiheadAttention(case.embed_dim, case.num_heads, batch_first=True, device=device, dtype=dtype)
    with torch.no_grad():  # trained-looking biases, the key slice included, so dropping it is tested
        stock.in_proj_bias.normal_(std=0.1)
        stock.out_proj.bias.normal_(std=0.1)
    return stock


def _floor_forward(
    query: Tensor,
    memory: Tensor | None,
    in_weight: Tensor,
    in_bias: Tensor,
    out_weight: Tensor,
    out_bias: Tensor,
    num_heads: int,
    need_weights: bool,
    additive_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The bare attention layer; ``memory=None`` means self-attention. Returns ``(B, L, E)`` and weights.

    ``additive_mask`` (broadcastable to ``(B, H, L, S)``, ``-inf`` where masked) is added to the scores."""
    batch, length, width = query.shape
    head_dim = width // num_heads
    if memory is None:
        q, k, v = F.linear(query, in_weight, in_bias).split(width, dim=-1)  # 3 x (B, L, E)
    else:
        q = F.linear(query, in_weight[:width], in_bias[:width])  # (B, L, E)
        k, v = F.linear(memory, in_weight[width:], in_bias[width:]).split(width, dim=-1)  # 2 x (B, S, E)
    q = q.view(batch, length, num_heads, head_dim).transpose(1, 2)  # (B, H, L, D)
    k = k.view(batch, k.shape[1], num_heads, head_dim).transpose(1, 2)  # (B, H, S, D)
    v = v.view(batch, v.shape[1], num_heads, head_dim).transpose(1, 2)  # (B, H, S, D)
    if need_weights:
        scores = torch.matmul(q * (1.0 / math.sqrt(head_dim)), k.transpose(-2, -1))  # (B, H, L, S)
        if additive_mask is not None:
            scores = scores + additive_mask if scores.requires_grad else scores.add_(additive_mask)
        if scores.requires_grad:
            weights = torch.softmax(scores, dim=-1)
        else:
            weights = torch.softmax(scores, dim=-1, out=scores)
        out = torch.matmul(weights, v)  # (B, H, L, D)
        averaged = weights.mean(dim=1)  # (B, L, S)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask)  # (B, H, L, D)
        averaged = None
    out = out.transpose(1, 2).reshape(batch, length, width)  # (B, L, E)
    return F.linear(out, out_weight, out_bias), averaged


def case_masks(masks: str, batch: int, length: int, device: torch.device) -> dict[str, Tensor]:
    """The keyword arguments that pass ``masks`` (one of :data:`MASKS`) to a module, as bool tensors."""
    if masks not in MASKS:
        raise ValueError(f"masks must be one of {', '.join(MASKS)}, got {masks!r}")
    arguments = {}
    if masks in ("padding", "both"):
        padding = torch.zeros(batch, length, dtype=torch.bool, device=device)
        padding[::2, length - length // 4 :] = True  # never every key of a row: a row of NaN is no timing
        arguments["key_padding_mask"] = padding
    if masks in ("causal", "both"):
        arguments["attn_mask"] = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    return arguments


def _additive(arguments: dict[str, Tensor], dtype: torch.dtype) -> Tensor | None:
    """The bool masks in ``arguments`` as one ``-inf``/0 tensor broadcastable to ``(B, H, L, S)``."""
    total = None
    padding, attention = arguments.get("key_padding_mask"), arguments.get("attn_mask")
    if padding is not None:
        total = torch.zeros(padding.shape, dtype=dtype, device=padding.device).masked_fill(padding, -math.inf)
        total = total[:, None, None, :]  # (B, 1, 1, S)
    if attention is not None:
        causal = torch.zeros(attention.shape, dtype=dtype, device=attention.device).masked_fill(attention, -math.inf)
        total = causal if total is None else total + causal  # (L, S) or (B, 1, L, S)
    return total


def build_contenders(
    case: Case,
    device: torch.device,
    *,
    seed: int = 0,
    equivariance_every: int | None = None,
    compile_backend: str | None = None,
) -> dict[str, Contender]:
    """Stock, slim and floor for ``case``, sharing weights (up to slim's exact key-bias fold), inputs
    and the case's masks (one of :data:`MASKS`; self-attention only). ``compile_backend``: stock and
    slim each called through ``torch.compile`` with it, their graph breaks counted first; the floor
    stays eager."""
    masks = case.masks
    dtype = DTYPES[case.dtype]
    generator = torch.Generator(device="cpu").manual_seed(seed)
    stock, slim = _modules(case, device, dtype, seed, equivariance_every)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    batch, length, width, _ = case.shape
    query = draw(batch, length, width).requires_grad_(case.trains)
    memory = draw(batch, length, width).requires_grad_(case.trains) if case.attention == "cross" else None
    inputs = [query] if memory is None else [query, memory]
    key = query if memory is None else memory
    grad_out = draw(batch, length, width)
    if masks != "none" and memory is not None:
        raise ValueError("masks are for self-attention cases")
    mask_arguments = case_masks(masks, batch, length, device)
    additive_mask = _additive(mask_arguments, dtype)

    floor_parameters = [
        tensor.detach().clone().requires_grad_(case.trains)
        for tensor in (stock.in_proj_weight, slim.in_proj_bias, stock.out_proj.weight, stock.out_proj.bias)
        if tensor is not None  # the benchmark's modules have every bias
    ]
    in_weight, in_bias, out_weight, out_bias = floor_parameters

    def forward_of(name: str) -> Callable[[], tuple[Tensor, Tensor | None]]:
        if name == "floor":
            arguments = (query, memory, in_weight, in_bias, out_weight, out_bias, case.num_heads, case.need_weights)
            forward = lambda: _floor_forward(*arguments, additive_mask)  # noqa: E731
        else:
            module = stock if name == "stock" else slim
            forward = lambda: module(query, key, key, need_weights=case.need_weights, **mask_arguments)  # noqa: E731
        if case.dtype not in AUTOCAST:
            return forward

        def autocast_forward() -> tuple[Tensor, Tensor | None]:  # fp32 modules, each call under autocast
            with torch.autocast(device.type, dtype=AUTOCAST[case.dtype]):
                return forward()

        return autocast_forward

    floors = {"sdpa" if not case.need_weights else "explicit product": forward_of("floor")}
    fast_path = case.mode == "inference" and memory is None and masks == "none" and case.dtype not in AUTOCAST
    if fast_path and case.num_heads % 2 == 0:  # stock's native kernel where stock's fast path runs it, bare
        floors["stock's native kernel"] = lambda: stock_kernel(
            query, query, query, query.shape[2], case.num_heads, in_weight, in_bias, out_weight, out_bias,
            None, case.need_weights, True,
        )  # fmt: skip
    floor_kind = _fastest_floor(floors)

    parameters: dict[str, list[Tensor]] = {
        "stock": [*stock.parameters()],
        "slim": [*slim.parameters()],
        "floor": floor_parameters,
    }
    breaks: dict[str, dict] = {}
    if compile_backend is not None:  # counted on the eager modules, then each called compiled
        for name in ("stock", "slim"):
            with torch.inference_mode() if not case.trains else contextlib.nullcontext():
                breaks[name] = graph_breaks(forward_of(name))
        # The compiled wrappers stand in for the modules (they forward attribute reads to them).
        stock = cast(nn.MultiheadAttention, torch.compile(stock, backend=compile_backend))
        slim = cast(SlimMultiheadAttention, torch.compile(slim, backend=compile_backend))
    contenders = {
        name: _contender(
            name,
            floors[floor_kind] if name == "floor" else forward_of(name),
            parameters[name],
            case.trains,
            inputs,
            grad_out,
            floor_kind if name == "floor" else "",
        )
        for name in CONTENDERS
    }
    for name, found in breaks.items():
        contenders[name].graph_breaks = found
    return contenders


def slim_variants(slim: Contender, case: Case, *, one_pass: bool, blocks: int) -> dict[str, Contender]:
    """Slim pushed onto the paths it takes only where its first choice does not apply:

    * ``one_pass``: slim's own path, stock's fast path switched off around its calls (slim follows it),
      as where stock's kernel does not apply (masks, odd head counts, cross-attention);
    * ``blocks``: slim forced into ``blocks`` blocks of query rows, as where one pass does not fit in memory.
    """
    contexts: dict[str, Callable[[], contextlib.AbstractContextManager]] = {}
    if one_pass:
        contexts["one_pass"] = lambda: fast_path_enabled(False)
    if blocks:
        block_bytes = case.batch * case.num_heads * case.seq_len * -(-case.seq_len // blocks) * 4  # fp32 scores
        contexts["blocks"] = lambda: forcing_blocks(block_bytes)

    def within(call, context):
        def run():
            with context():
                return call()

        return run

    return {
        name: Contender(
            name, within(slim.step, context), within(slim.forward, context), slim.parameters, slim.reset, slim.external
        )
        for name, context in contexts.items()
    }


def _contender(
    name: str,
    forward: Callable[[], tuple[Tensor, Tensor | None]],
    parameters: list[Tensor],
    trains: bool,
    inputs: list[Tensor],
    grad_out: Tensor,
    kind: str,
) -> Contender:
    """One contender's timed step: forward (and backward into ``grad_out`` when it trains)."""

    def infer() -> None:
        with torch.inference_mode():
            forward()

    def train() -> None:
        out, _ = forward()
        out.backward(grad_out.to(out.dtype))  # autocast's output is bf16: the gradient follows it

    def clear_grads() -> None:
        for tensor in parameters + inputs:
            tensor.grad = None

    step, reset = (train, clear_grads) if trains else (infer, lambda: None)
    return Contender(name, step, forward, parameters, reset, inputs + [grad_out], kind)


def _modules(
    case: Case, device: torch.device, dtype: torch.dtype, seed: int, equivariance_every: int | None
) -> tuple[nn.MultiheadAttention, SlimMultiheadAttention]:
    """Stock and slim for ``case``, slim loading stock's weights, both in the case's mode."""
    torch.manual_seed(seed)
    stock = _stock_module(case, device, dtype)
    slim = SlimMultiheadAttention(case.embed_dim, case.num_heads, batch_first=True, device=device, dtype=dtype)
    slim.load_state_dict(stock.state_dict())
    _set_equivariance_check(slim, case.mode == "train-equivariance", equivariance_every)
    for module in (stock, slim):
        module.train(case.trains)
    return stock, slim


def _fastest_floor(floors: dict[str, Callable[[], tuple[Tensor, Tensor | None]]], calls: int = 5) -> str:
    """The fastest of the bare computations, by the best of a few untimed-elsewhere inference calls:
    in bf16 on the CPU stock's native kernel beats SDPA, in fp32 it does not, and a floor that is not
    the fastest would flatter whatever is measured against it."""
    if len(floors) == 1:
        return next(iter(floors))
    best = {}
    with torch.inference_mode():
        for name, forward in floors.items():
            forward()  # warm
            times = []
            for _ in range(calls):
                began = time.perf_counter()
                forward()
                times.append(time.perf_counter() - began)
            best[name] = min(times)
    return min(best, key=lambda name: best[name])


def output_error(reference: tuple[Tensor, Tensor | None], other: tuple[Tensor, Tensor | None]) -> float:
    """Largest relative error ``‖a − b‖ / ‖a‖`` over the output and, when present, the weights."""
    errors = []
    for expected, actual in zip(reference, other):
        if expected is None or actual is None:
            continue
        expected, actual = expected.detach().double(), actual.detach().double()
        errors.append(((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item())
    return max(errors) if errors else 0.0
