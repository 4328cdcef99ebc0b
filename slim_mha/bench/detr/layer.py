"""DETR's decoder layer with ``skip_unread_weights`` off and on: ``python -m slim_mha.bench detr``.

DETR (and the detectors built on it) call both attention modules of every decoder layer with the
default ``need_weights=True`` and keep only ``[0]``. :class:`DetrStyleDecoderLayer` makes those calls
the same way: sequence-first tensors, positional embeddings added to queries and keys, the weights
dropped by subscript. Three contenders run the same layer, weights and inputs, interleaved:

* ``stock``: the layer with torch's ``nn.MultiheadAttention``;
* ``slim``: the same layer after ``slim_mha.convert(layer)`` (weights computed, as asked);
* ``slim_skip``: after ``slim_mha.convert(layer, skip_unread_weights=True)`` (weights skipped).

Modes: ``inference`` (``eval()`` + ``inference_mode``), ``train`` (forward and backward, DETR's
attention dropout 0.1) and ``train-no-dropout``. Before timing, each contender's output is compared
with stock's (outputs agree when no dropout draws are involved), and one profiled step counts the
softmax calls made outside ``scaled_dot_product_attention``: the explicit weights path.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from ...conversion import convert
from ..matrix.contenders import (
    Contender,
    _clear_grads,
    _inference_step,
    _training_step,
    output_error,
)
from ..matrix.report import ratio_text
from ..matrix.runner import measure_step_memory, time_interleaved
from ..measure.environment import describe_environment, load_average
from ..measure.memory import _profiler_chatter_silenced
from ..measure.output import mib_text
from ..measure.timing import Settings

__all__ = [
    "DetrStyleDecoderLayer",
    "DetrShape",
    "explicit_softmax_calls",
    "format_detr",
    "format_detr_lines",
    "run_detr",
]

CONTENDERS = ("stock", "slim", "slim_skip")
MODES = ("inference", "train", "train-no-dropout")
_SOFTMAX_OPS = frozenset({"aten::softmax", "aten::_softmax", "aten::_safe_softmax"})
_SDPA = "aten::scaled_dot_product_attention"


class DetrStyleDecoderLayer(nn.Module):
    """A post-norm transformer decoder layer whose attention calls are written as DETR writes them.

    Inputs are sequence-first: ``tgt`` ``(L, B, E)`` (the object queries' state), ``memory``
    ``(S, B, E)`` (the encoder's image tokens), ``query_pos`` ``(L, B, E)``, ``pos`` ``(S, B, E)``,
    ``memory_key_padding_mask`` ``(B, S)`` (``True`` on image padding). Returns ``(L, B, E)``.
    ``nn.MultiheadAttention`` is looked up when the layer is built, so ``slim_mha.patch()`` applies.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.multihead_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout1, self.dropout2, self.dropout3 = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)

    @staticmethod
    def with_pos_embed(tensor: Tensor, pos: Tensor | None) -> Tensor:
        return tensor if pos is None else tensor + pos

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        pos: Tensor | None = None,
        query_pos: Tensor | None = None,
    ) -> Tensor:
        q = k = self.with_pos_embed(tgt, query_pos)
        tgt2 = self.self_attn(q, k, value=tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        tgt = self.norm1(tgt + self.dropout1(tgt2))
        tgt2 = self.multihead_attn(
            query=self.with_pos_embed(tgt, query_pos),
            key=self.with_pos_embed(memory, pos),
            value=memory,
            attn_mask=memory_mask,
            key_padding_mask=memory_key_padding_mask,
        )[0]
        tgt = self.norm2(tgt + self.dropout2(tgt2))
        tgt2 = self.linear2(self.dropout(F.relu(self.linear1(tgt))))
        return self.norm3(tgt + self.dropout3(tgt2))


@dataclass(frozen=True)
class DetrShape:
    """DETR's decoder at its usual scale: 100 object queries over a ~800x1200 image's 950 tokens."""

    queries: int = 100
    memory: int = 950
    embed_dim: int = 256
    heads: int = 8
    batch: int = 2
    feedforward: int = 2048


def detr_inputs(shape: DetrShape, generator: torch.Generator, device: torch.device) -> dict[str, Tensor]:
    """The layer's keyword inputs; the second image is padded on its last 15% of tokens."""

    def draw(length: int) -> Tensor:
        return torch.randn(length, shape.batch, shape.embed_dim, generator=generator).to(device)

    padding = torch.zeros(shape.batch, shape.memory, dtype=torch.bool)
    padding[-1, int(shape.memory * 0.85) :] = True
    return {
        "tgt": draw(shape.queries),
        "memory": draw(shape.memory),
        "query_pos": draw(shape.queries),
        "pos": draw(shape.memory),
        "memory_key_padding_mask": padding.to(device),
    }


def build_layers(shape: DetrShape, dropout: float, seed: int, device: torch.device) -> dict[str, nn.Module]:
    """Stock, slim and slim-with-skipping layers holding the same weights (every bias non-zero)."""
    torch.manual_seed(seed)
    stock = DetrStyleDecoderLayer(shape.embed_dim, shape.heads, shape.feedforward, dropout).to(device)
    with torch.no_grad():  # random attention biases: a zero key bias would hide a wrong fold
        for parameter in [*stock.self_attn.parameters(), *stock.multihead_attn.parameters()]:
            parameter.normal_(0.0, 0.05)
    return {
        "stock": stock,
        "slim": convert(copy.deepcopy(stock)),
        "slim_skip": convert(copy.deepcopy(stock), skip_unread_weights=True),
    }


def explicit_softmax_calls(step: Callable[[], None]) -> int:
    """Softmax calls in one profiled ``step`` that are not inside ``scaled_dot_product_attention``.

    The weights path is the only place a layer calls softmax itself; SDPA's math fallback (CPU
    training with dropout) runs one inside the SDPA op, which materialises no weights for the caller.
    """
    with _profiler_chatter_silenced(), profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    count = 0
    for event in profiler.events():
        if event.name not in _SOFTMAX_OPS or (event.cpu_parent is not None and event.cpu_parent.name in _SOFTMAX_OPS):
            continue  # count each softmax call once, not its nested aten::_softmax too
        parent = event.cpu_parent
        while parent is not None and parent.name != _SDPA:
            parent = parent.cpu_parent
        count += parent is None
    return count


def _contenders(layers: dict[str, nn.Module], inputs: dict[str, Tensor], *, trains: bool) -> dict[str, Contender]:
    """Each layer as a benchmark contender: the layer's output is what it returns, with no weights."""
    grad_out = torch.randn_like(inputs["tgt"])
    contenders = {}
    for name, layer in layers.items():
        layer.train(trains)
        parameters: list[Tensor] = [*layer.parameters()]

        def forward(layer=layer) -> tuple[Tensor, None]:
            return layer(**inputs), None

        contenders[name] = Contender(
            name=name,
            step=_training_step(forward, grad_out) if trains else _inference_step(forward),
            forward=forward,
            parameters=parameters,
            reset=_clear_grads(parameters) if trains else (lambda: None),
            external=list(inputs.values()),
        )
    return contenders


def _output_errors(layers: dict[str, nn.Module], contenders: dict[str, Contender], *, eval_mode: bool) -> dict:
    """Each slim contender's relative error against stock; in eval when dropout would draw differently."""
    outputs = {}
    for name, contender in contenders.items():
        training = layers[name].training
        layers[name].train(training and not eval_mode)
        contender.reset()
        with torch.no_grad():
            outputs[name] = contender.forward()
        layers[name].train(training)
    return {name: output_error(outputs["stock"], outputs[name]) for name in CONTENDERS[1:]}


def run_detr_mode(mode: str, shape: DetrShape, settings: Settings, device: torch.device) -> dict:
    """Correctness, weights-path check, memory and interleaved time of the three contenders in ``mode``."""
    load_before, started = load_average(), time.perf_counter()
    trains = mode != "inference"
    layers = build_layers(shape, 0.1 if mode == "train" else 0.0, settings.seed, device)
    inputs = detr_inputs(shape, torch.Generator().manual_seed(settings.seed + 1), device)
    contenders = _contenders(layers, inputs, trains=trains)

    errors = _output_errors(layers, contenders, eval_mode=mode == "train")

    memory = {}
    for name, contender in contenders.items():
        contender.reset()
        softmax_calls = explicit_softmax_calls(contender.step)
        step_memory, _ = measure_step_memory(contender, device, trains=trains)
        memory[name] = {**step_memory, "explicit_softmax_calls": softmax_calls}

    pairs = (("slim", "slim_skip"), ("stock", "slim_skip"))
    return {
        "mode": mode,
        "attention_dropout": 0.1 if mode == "train" else 0.0,
        "relative_error": errors,
        **time_interleaved(contenders, device, settings, ratios=pairs, spreads=pairs),
        "memory": memory,
        "load_average": [load_before, load_average()],
        "elapsed_s": time.perf_counter() - started,
    }


def run_detr(
    settings: Settings, device: torch.device, modes: tuple[str, ...] = MODES, shape: DetrShape = DetrShape()
) -> dict:
    return {
        "schema": 1,
        "case": "detr-decoder-layer",
        "shape": shape.__dict__,
        "environment": describe_environment(device),
        "settings": {**settings.__dict__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()},
        "modes": [run_detr_mode(mode, shape, settings, device) for mode in modes],
    }


def _ms(summary: dict) -> str:
    return f"{summary['median_ms']:.2f} ±{summary['iqr_over_median'] * 50:.0f}%"


def format_detr(payload: dict) -> str:
    """A markdown table: time, ratios, peak and saved memory, explicit softmax calls, errors."""
    shape = payload["shape"]
    lines = [
        f"DETR decoder layer: L={shape['queries']} queries, S={shape['memory']} memory tokens, "
        f"E={shape['embed_dim']}, H={shape['heads']}, B={shape['batch']}, FF={shape['feedforward']}, fp32",
        "",
        "| mode | stock ms | slim ms | slim_skip ms | slim/slim_skip | stock/slim_skip "
        "| peak MiB stock / slim / skip | saved MiB stock / slim / skip | explicit softmax calls "
        "| rel. error slim / skip |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for result in payload["modes"]:
        times, memory = result["time"], result["memory"]
        mode = result["mode"] + (f" (attn dropout {result['attention_dropout']})" if result["mode"] == "train" else "")
        lines.append(
            f"| {mode} | {_ms(times['stock'])} | {_ms(times['slim'])} | {_ms(times['slim_skip'])} "
            f"| {ratio_text(result, 'slim_over_slim_skip')} | {ratio_text(result, 'stock_over_slim_skip')} "
            f"| {' / '.join(mib_text(memory[name]['peak_bytes']).strip() for name in CONTENDERS)} "
            f"| {' / '.join(mib_text(memory[name]['saved_bytes']).strip() for name in CONTENDERS)} "
            f"| {' / '.join(str(memory[name]['explicit_softmax_calls']) for name in CONTENDERS)} "
            f"| {result['relative_error']['slim']:.1e} / {result['relative_error']['slim_skip']:.1e} |"
        )
    loads = [load for result in payload["modes"] for load in result["load_average"] if load is not None]
    if loads:
        cores = payload["settings"]["cpu_count"]
        lines += ["", f"1-minute load average {min(loads):.1f} to {max(loads):.1f} on {cores} cores"]
    return "\n".join(lines)


def format_detr_lines(payload: dict) -> str:
    """The same results for a terminal: a few short lines per mode instead of one wide table row."""
    shape = payload["shape"]
    lines = [
        f"DETR decoder layer: L={shape['queries']} queries, S={shape['memory']} memory tokens, "
        f"E={shape['embed_dim']}, H={shape['heads']}, B={shape['batch']}, FF={shape['feedforward']}, fp32",
        "ms: medians with the allocator warm; ratios: of those medians (paired: per-repeat median, quartiles)",
    ]
    for result in payload["modes"]:
        times, memory = result["time"], result["memory"]
        mode = result["mode"] + (f" (attn dropout {result['attention_dropout']})" if result["mode"] == "train" else "")
        lines += [
            "",
            f"{mode}:",
            "  ms stock / slim / slim_skip:    " + " / ".join(f"{times[name]['median_ms']:.2f}" for name in CONTENDERS),
            f"  slim/slim_skip:  {ratio_text(result, 'slim_over_slim_skip')}",
            f"  stock/slim_skip: {ratio_text(result, 'stock_over_slim_skip')}",
            "  peak MiB stock / slim / skip:  "
            + " / ".join(mib_text(memory[name]["peak_bytes"]).strip() for name in CONTENDERS),
            "  saved MiB stock / slim / skip: "
            + " / ".join(mib_text(memory[name]["saved_bytes"]).strip() for name in CONTENDERS),
            "  explicit softmax calls:        "
            + " / ".join(str(memory[name]["explicit_softmax_calls"]) for name in CONTENDERS),
            f"  relative error slim / skip:    {result['relative_error']['slim']:.1e} / "
            f"{result['relative_error']['slim_skip']:.1e}",
        ]
    loads = [load for result in payload["modes"] for load in result["load_average"] if load is not None]
    if loads:
        lines += [
            "",
            f"1-minute load average {min(loads):.1f} to {max(loads):.1f} on {payload['settings']['cpu_count']} cores",
        ]
    return "\n".join(lines)
