"""Seeing inside a model without editing it: :func:`recording_attention` hands over the attention
maps of every slim attention call, and :func:`explain` says which path each call took, and why.

Models call attention with ``need_weights=False`` (torchvision's ViT, ``nn.TransformerEncoderLayer``,
open_clip), so the weights never exist and a user who wants them edits the model's code. A model
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

import torch
from torch import Tensor, nn

from ._swap import slim_stands_for
from ._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA

__all__ = ["AttentionMaps", "PathReport", "PathRow", "explain", "recording_attention"]

# The open blocks, innermost last. Read without the lock on every attention call (a list's truth is
# one check); changed in place under it (append and remove are each atomic for a reader).
RECORDING: list[_Recording] = []
EXPLAINING: list[PathReport] = []
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


def _watching(module: nn.Module) -> Iterator[tuple[_Recording, str]]:
    """Each open recording block that watches ``module``, with the name it knows the module by."""
    for recording in RECORDING:
        name = recording.names.get(id(module))
        if name is not None:
            yield recording, name


def watched(module: nn.Module) -> bool:
    """Whether an open :func:`recording_attention` block watches ``module``."""
    return any(True for _ in _watching(module))


@contextmanager
def recording_attention(model: nn.Module, per_head: bool = False) -> Iterator[AttentionMaps]:
    """Record the attention maps of every slim attention call in ``model`` while the block is open.

    Each map is what stock returns on the same inputs with ``need_weights=True`` and
    ``average_attn_weights=not per_head``, detached; in training, stock's weights after dropout. The
    model's outputs are what they would be without the block, within stock's rounding. Encoder layers
    that stock would hand to its fused kernel (which never computes the weights) compute the same
    function with slim's attention instead, at every length; a nested batch's maps are padded as the
    output is (padded keys get weight 0, padded query rows are zero). Blocks nest. Calls under CPU
    autocast that stock's fused encoder layer takes, and nested tensors handed to a bare attention
    module, keep stock's kernel and record nothing.

    Raises:
        ValueError: ``model`` holds no slim attention module (patch or convert it first).
        torch.OutOfMemoryError: a map would not fit in memory; the message names the module and the
            bytes, and nothing is allocated.
    """
    names = _slim_attention_names(model, "recording_attention")
    recording = _Recording(names, bool(per_head), AttentionMaps({name: [] for name in names.values()}))
    with _opened(RECORDING, recording):
        yield recording.maps


def deliver(module: nn.Module, weights: Tensor) -> None:
    """Hand one call's per-head weights (``(B, H, L, S)`` or ``(H, L, S)``) to every block watching ``module``."""
    for recording, name in _watching(module):
        recording.maps[name].append(weights.detach() if recording.per_head else weights.detach().mean(dim=-3))


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
        return "\n".join([lines[0], "  ".join("-" * width for width in widths) + "  ---", *lines[1:]])


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
    if not names:
        raise ValueError(
            f"{caller}: {type(model).__name__} holds no slim attention module, so no call would reach slim; "
            "build it under slim_mha.patch() (or patched()), or run slim_mha.convert(model) first"
        )
    return names


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


def record_call(module: nn.Module, run, call) -> tuple[Tensor, Tensor | None]:
    """Run ``call`` through ``run`` with every head's weights, deliver them, and return what the caller
    asked for: the output, and the weights as asked (averaged or not), or ``None``."""
    try:
        out, weights = run(call._replace(need_weights=True, average_attn_weights=False))
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(f"recording_attention: module {name_of(module)}: {error}") from None
    deliver(module, weights)
    if not call.need_weights:
        return out, None
    return out, weights.mean(dim=-3) if call.average_attn_weights else weights
