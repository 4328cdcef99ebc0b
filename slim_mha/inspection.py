"""Seeing inside a model without editing it: :func:`recording_attention` hands over the attention
maps of every slim attention call, and :func:`explain` says which path each call took, and why.

Many models call attention with ``need_weights=False`` (``nn.TransformerEncoderLayer``, torchvision's
ViT, open_clip; stock's own default is ``True``), so the weights never exist and a user who wants
them edits the model's code. A model
patched or converted with slim routes every attention call through slim's ``forward``, which asks
:func:`slim_mha.paths.choose_path` for its path: while a recording block watches a module, that one
owner of the choice names the path ``"recorded"``, and the call computes stock's weights on the path
it would otherwise take with weights, gives them to the block, and returns what its caller asked for.
:func:`explain` reads the same owner's answers (and :func:`slim_mha.encoder_layer.layer_path`'s for
encoder layers): there is no second copy of the rules.

Both keep their state only while their block is open, and nothing after it: no hook, no attribute.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from ._features import INSPECTION
from ._swap import slim_stands_for
from ._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA

__all__ = ["AttentionMaps", "PathReport", "PathRow", "explain", "recording_attention"]

# The open blocks, innermost last, kept where attention's calls read them (slim_mha._features), so the
# core never imports this module. Read without the lock on every attention call (a list's truth is
# one check); changed in place under it (append and remove are each atomic for a reader).
RECORDING: list[_Recording] = INSPECTION.recording
EXPLAINING: list[PathReport] = INSPECTION.explaining
_LOCK = threading.Lock()


class AttentionMaps(dict):
    """``maps[name]``: the maps of the attention module ``name`` (as ``named_modules()`` names it), one
    detached tensor per call, in call order: ``(B, L, S)`` averaged over heads, or ``(B, H, L, S)``
    per head (unbatched calls: without ``B``), as stock returns its weights."""


@dataclass
class _Recording:
    names: dict[int, str]  # id(module) -> its qualified name
    per_head: bool
    maps: AttentionMaps
    thread: int  # the thread that opened the block: it alone is recorded


def _watching(module: nn.Module) -> Iterator[tuple[_Recording, str]]:
    """Each open recording block of this thread that watches ``module``, with the name it knows it by."""
    thread = threading.get_ident()
    for recording in RECORDING:
        name = recording.names.get(id(module))
        if name is not None and recording.thread == thread:
            yield recording, name


def watched(module: nn.Module) -> bool:
    """Whether an open :func:`recording_attention` block of this thread watches ``module``.

    Raises a ``RuntimeError`` inside ``torch.compile``: a compiled graph keeps no maps, and an empty
    map would read as a model that attends to nothing.
    """
    if not any(True for _ in _watching(module)):
        return False
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"recording_attention: {name_of(module)} was called inside torch.compile, whose graph computes "
            "no attention maps; record the uncompiled model (a compiled module's ._orig_mod) instead"
        )
    return True


@contextmanager
def recording_attention(model: nn.Module, per_head: bool = False) -> Iterator[AttentionMaps]:
    """Record the attention maps of every slim attention call in ``model`` while the block is open.

    Each map is what stock returns on the same inputs with ``need_weights=True`` and
    ``average_attn_weights=not per_head``, detached. Where the caller asked for those weights, the map
    is them (in training, after dropout); otherwise it is computed beside the call, without dropout,
    a graph or a random draw. The model's outputs are what they are without the block, bit for bit,
    and so are its random draws: each call runs as it would unrecorded. Encoder layers that stock
    hands to its fused kernel (which computes no weights) get their maps beside the kernel's call; a
    nested batch's maps are padded as the output is (padded keys get weight 0, padded query rows are
    zero). A query masked from every key gets a row of zeros. Blocks nest. A block records the calls
    of the thread that opened it. Nested tensors handed to a bare attention module keep stock's
    kernel and record nothing.

    Raises:
        ValueError: ``model`` holds no slim attention module (patch or convert it first).
        torch.OutOfMemoryError: a map would not fit in memory; the message names the module and the
            bytes, and nothing is allocated.
        RuntimeError: a watched module runs inside ``torch.compile`` (record the uncompiled model).
    """
    names = _slim_attention_names(model, "recording_attention")
    maps = AttentionMaps({name: [] for name in names.values()})
    recording = _Recording(names, bool(per_head), maps, threading.get_ident())
    with _opened(RECORDING, recording):
        yield recording.maps


def deliver(module: nn.Module, heads: Tensor | None, averaged: Tensor | None = None) -> None:
    """Hand one call's maps to every block watching ``module``: every head's (``(B, H, L, S)`` or
    ``(H, L, S)``), and their average where the call returned it (else it is taken of ``heads``)."""
    for recording, name in _watching(module):
        if recording.per_head:
            recording.maps[name].append(cast(Tensor, heads).detach())
        else:
            recording.maps[name].append(
                (averaged if averaged is not None else cast(Tensor, heads).mean(dim=-3)).detach()
            )


def wants_every_head(module: nn.Module) -> bool:
    """Whether a block watching ``module`` records every head's map."""
    return any(recording.per_head for recording, _ in _watching(module))


def pad_rows(module: nn.Module, padding: Tensor) -> None:
    """Zero the padded query rows (``padding`` ``(B, L)``, True: not a token) of ``module``'s last maps,
    as a nested batch's output is zero there."""
    for recording, name in _watching(module):
        if recording.maps[name]:
            last = recording.maps[name][-1]
            rows = padding[:, None, :, None] if last.dim() == 4 else padding[:, :, None]
            recording.maps[name][-1] = last.masked_fill(rows, 0.0)


def name_of(module: nn.Module) -> str:
    """The name a recording block knows ``module`` by, for messages."""
    return next((name for _, name in _watching(module)), type(module).__name__)


# ------------------------------------------------------------------------------------------ explain


@dataclass(frozen=True)
class PathRow:
    """One call: the module's qualified name, its kind (``attention`` or ``encoder layer``), the path
    it took, and why it did not take a shorter one (empty when it did)."""

    module: str
    kind: str
    path: str
    why: str


class PathReport(list):
    """The rows of one :func:`explain` run, in call order; ``str()`` is a table."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names
        self.grad_enabled = torch.is_grad_enabled()  # explain runs in the caller's grad mode

    def census(self) -> dict[tuple[str, str, str], int]:
        """How many calls took each (kind, path, why)."""
        counts: dict[tuple[str, str, str], int] = {}
        for row in self:
            key = (row.kind, row.path, row.why)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def __str__(self) -> str:
        header = ("module", "kind", "path", "why")
        rows = [header] + [(row.module, row.kind, row.path, row.why or "-") for row in self]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3] for row in rows]
        mode = (
            "ran with grad enabled, as it was called: inference under torch.no_grad() or torch.inference_mode() "
            "may take shorter paths; call explain inside one to see them"
            if self.grad_enabled
            else "ran without grad, as it was called"
        )
        return "\n".join([lines[0], "  ".join("-" * width for width in widths) + "  ---", *lines[1:], f"({mode})"])


def note(module: nn.Module, kind: str, path: str, why: str) -> None:
    """Record one call's path in every open :func:`explain` that knows ``module``."""
    for report in EXPLAINING:
        name = report.names.get(id(module))
        if name is not None:
            report.append(PathRow(name, kind, path, why))


def explain(model: nn.Module, *args, **kwargs) -> PathReport:
    """Run ``model(*args, **kwargs)`` once, in the caller's grad mode and the model's train/eval state,
    and return one row per slim attention call and per slim encoder-layer call: the module's name,
    the path it took and why (what :func:`slim_mha.paths.choose_path` and
    :func:`slim_mha.encoder_layer.layer_path` decided). ``print()`` it for a table.

    Raises:
        ValueError: ``model`` holds no slim attention module (patch or convert it first).
    """
    names = _slim_attention_names(model, "explain")
    names.update(
        {
            id(m): name or "(the model)"
            for name, m in model.named_modules()
            if slim_stands_for(type(m)) is STOCK_ENCODER_LAYER
        }
    )
    report = PathReport(names)
    with _opened(EXPLAINING, report):
        model(*args, **kwargs)
    return report


# -------------------------------------------------------------------------------------------- both


def _slim_attention_names(model: nn.Module, caller: str) -> dict[int, str]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: expected an nn.Module, got {type(model).__name__}")
    names = {id(m): name or "(the model)" for name, m in model.named_modules() if slim_stands_for(type(m)) is STOCK_MHA}
    if not names and not any(isinstance(m, nn.MultiheadAttention) for m in model.modules()):
        raise ValueError(f"{caller}: {no_attention_here(model)}, so there is nothing slim can see")
    if not names:
        raise ValueError(
            f"{caller}: {type(model).__name__} holds no slim attention module, so no call would reach slim; "
            "build it under slim_mha.patch() (or patched()), or run slim_mha.convert(model) first"
        )
    return names


def no_attention_here(module: nn.Module) -> str:
    """Words for a model holding no ``nn.MultiheadAttention``, naming the attention classes it holds."""
    others = sorted(
        {type(m).__qualname__ for m in module.modules() if m is not module and "attention" in type(m).__name__.lower()}
    )
    found = f" (its attention classes: {', '.join(others[:6])})" if others else ""
    return (
        f"{type(module).__name__} holds no nn.MultiheadAttention{found}; slim_mha replaces torch's "
        "nn.MultiheadAttention alone, not attention classes of other libraries"
    )


@contextmanager
def _opened(registry: list, entry) -> Iterator[None]:
    """``entry`` in ``registry`` while the block is open; out of it after, whatever the block raised."""
    with _LOCK:
        registry.append(entry)
    try:
        yield
    finally:
        with _LOCK:
            registry.remove(entry)


def record_call(module: nn.Module, run, maps_of, call) -> tuple[Tensor, Tensor | None]:
    """Run ``call`` through ``run`` as asked, so its outputs and random draws are the unrecorded call's;
    deliver its weights where they are the maps the blocks want, else the maps ``maps_of(call, per_head)``
    computes beside it (without dropout or a graph; averaged over heads unless a block wants every
    head's). Returns what ``run`` returned."""
    out, weights = run(call)
    if call.need_weights and not call.average_attn_weights:
        deliver(module, weights)
    elif call.need_weights and not wants_every_head(module):
        deliver(module, None, weights)
    else:
        record_beside(module, maps_of, call)
    return out, weights


def record_beside(module: nn.Module, maps_of, call) -> None:
    """Deliver the maps ``maps_of(call, per_head)`` computes beside a call whose own result holds none:
    every head's where a block wants them, else their average (which may be computed in blocks of rows)."""
    every_head = wants_every_head(module)
    try:
        maps = maps_of(call, every_head)
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(_too_large_to_record(module, str(error), every_head)) from None
    deliver(module, *((maps, None) if every_head else (None, maps)))


def _too_large_to_record(module: nn.Module, guard: str, every_head: bool) -> str:
    """The memory guard's refusal, with the fixes that apply to a recording: the call's own
    ``need_weights`` is not the cause, the maps the block asked for are."""
    need = guard.split("; pass need_weights=False")[0].removeprefix("need_weights=True: ")
    fixes = "record maps averaged over heads (recording_attention(model, per_head=False)), or " if every_head else ""
    return f"recording_attention: module {name_of(module)}: its maps, {need}; {fixes}attend over fewer tokens"


# What attention's calls reach through the seam while a block is open.
INSPECTION.note, INSPECTION.watched, INSPECTION.record_call = note, watched, record_call
