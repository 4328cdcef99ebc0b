"""``nn.TransformerEncoderLayer`` whose inference fast path reaches slim's attention.

Stock's layer, in eval without a graph, calls one fused kernel (``torch._transformer_encoder_layer_fwd``)
with the attention's parameters and never calls the attention module. That kernel builds the
``(B, H, L, L)`` scores, and with a padding mask it is several times heavier than slim's attention
(``benchmarks/RESULTS.md``, "Encoders"). :class:`SlimTransformerEncoderLayer` is stock's layer with
one change: :func:`layer_path` decides, per call, whether stock's ``forward`` runs, or slim computes
what the fused kernel computes, with slim's attention in place of the kernel's.

Slim takes a call only where stock's layer would fuse it, by stock's own rule
(:func:`~slim_mha._stock_checks.why_stock_layer_is_not_fused`): hooks, training, autocast, a graph and
every other case run stock's ``forward`` itself.

**One reference.** Stock's documented function is what its ``forward`` computes unfused (its fast path
off, or in training). Where the fused kernel departs from it (:func:`why_the_fused_kernel_departs`: a
float mask, which the kernel reads as a bool one; a row masked from every key, which it turns to NaN;
appended tokens, an attention ``forward`` of its own, dropout left in training mode, blocks or a GELU
it never computes), slim runs stock's unfused ``forward`` at every length, so one model gives one
answer whatever its length. Elsewhere slim computes from exactly the kernel's inputs: the attention's
and the norms' parameters, ``norm1.eps``, relu or gelu, and the masks read as the kernel reads them
(non-zero: masked), and it raises the kernel's errors for masks of the wrong shape.

A nested tensor (what ``nn.TransformerEncoder`` makes of a padded batch in inference) reaches slim as
a padded batch with its padding mask, and leaves as a nested tensor again: the padded rows are
dropped, so the layer returns what stock's returns.
"""

from __future__ import annotations

import functools

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from . import inspection
from ._stock_checks import AttentionCall, a_row_sees_no_key, why_stock_layer_is_not_fused
from ._swap import prepare_scriptable, script_on_shadows
from ._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA, is_symbolic_call, nested_from_padded, stock_layer_masks
from .attention import SlimMultiheadAttention

__all__ = ["SlimTransformerEncoderLayer", "layer_path", "FUSED_LAYER_MAX_LENGTH"]

# Up to these many tokens stock's fused layer is at least as fast as slim's attention in its place:
# the whole layer is one kernel, and its (B, H, L, L) scores are small. Above them slim wins in memory
# (half of stock's peak from L=192 on, a fourteenth at L=2048) and is at parity or faster. A nested
# batch (nn.TransformerEncoder's padded batch) keeps stock's kernel longer: it computes no padded
# token. Measured on 2 CPU threads, 2 layers, B=4 E=256 H=8, allocator warm (benchmarks/RESULTS.md,
# "Encoders", where the inherited allocator is measured too).
FUSED_LAYER_MAX_LENGTH = {"no mask": 384, "mask": 96, "nested": 384}


# What each path is, in the words explain prints where layer_path gives no reason.
LAYER_PATHS_TAKEN = {
    "slim layer": "what stock's fused kernel computes, with slim's attention in its place",
}


def layer_path(layer: nn.TransformerEncoderLayer, src: Tensor, src_mask, src_key_padding_mask) -> tuple[str, str]:
    """The path a call of ``layer`` takes, and why:

    * ``"stock layer"``: stock's ``forward``, which does not fuse this call (its general path, with
      slim's attention where the layer holds one); the reason is stock's own;
    * ``"unfused layer"``: stock's ``forward`` as it runs unfused, the reference, where stock would
      fuse the call but its fused kernel departs from the reference; the reason names the departure;
    * ``"stock fused layer"``: stock's ``forward``, which hands the call to its fused kernel;
    * ``"slim layer"``: what the fused kernel computes, with slim's attention in its place.
    """
    if isinstance(src, torch.fx.Proxy):  # fx traces stock's forward, as it traces stock's layer
        return "stock layer", "torch.fx symbolic tracing"
    why = why_stock_layer_is_not_fused(layer, src, src_mask, src_key_padding_mask)
    if why:
        return "stock layer", why
    why = why_the_fused_kernel_departs(layer, src, src_mask, src_key_padding_mask)
    if why:
        return "unfused layer", why
    if not isinstance(layer.self_attn, SlimMultiheadAttention):
        return "stock fused layer", "the layer holds a stock attention module"
    if is_symbolic_call(src):
        return "stock fused layer", "a trace, transform or fake tensor"
    if torch.is_autocast_enabled(src.device.type):
        return "stock fused layer", "autocast, whose casts the fused kernel's output dtype follows"
    if src.is_nested:  # nn.TransformerEncoder's padded batch (stock's rule: no mask beside it)
        kind, length = "nested", max((sequence.shape[0] for sequence in src.unbind()), default=0)
    else:
        kind = "no mask" if src_mask is None and src_key_padding_mask is None else "mask"
        length = src.shape[1]  # batch-first: stock fuses no other layout
    if length <= FUSED_LAYER_MAX_LENGTH[kind]:
        return (
            "stock fused layer",
            f"{length} tokens ({kind}): the fused kernel is faster up to {FUSED_LAYER_MAX_LENGTH[kind]}",
        )
    return "slim layer", ""


def why_the_fused_kernel_departs(
    layer: nn.TransformerEncoderLayer, src: Tensor, src_mask: Tensor | None, src_key_padding_mask: Tensor | None
) -> str:
    """Why stock's fused kernel would not compute stock's documented function (its unfused ``forward``)
    for a call stock would fuse; ``""`` where it computes it. The one copy of the rule.

    Each condition was observed against stock with its fast path off (tests/test_one_answer.py). A mask
    is read only where one is given, as stock's own nested path reads it.
    """
    if src.is_nested:  # stock's unfused forward raises on a nested batch: the kernel's answer is the one
        return ""
    cls, attention = type(layer), layer.self_attn
    if cls._sa_block is not STOCK_ENCODER_LAYER._sa_block or cls._ff_block is not STOCK_ENCODER_LAYER._ff_block:
        return "an overridden _sa_block or _ff_block, which the fused kernel never calls"
    if type(attention).forward not in (STOCK_MHA.forward, SlimMultiheadAttention.forward):
        return "an attention module with a forward of its own, which the fused kernel never calls"
    if attention.bias_k is not None or attention.add_zero_attn:
        return "appended tokens (add_bias_kv, add_zero_attn), which the fused kernel ignores"
    if isinstance(layer.activation, nn.GELU) and layer.activation.approximate != "none":
        return "a tanh-approximated GELU, which the fused kernel computes exactly"
    if _dropout_in_training(layer):
        return "dropout in training mode inside an eval layer, which the fused kernel ignores"
    for mask in (src_mask, src_key_padding_mask):
        if mask is not None and mask.is_floating_point() and mask.dtype == src.dtype:
            return "a float mask, which the fused kernel reads as a bool one (non-zero: masked) where stock adds it"
    if a_row_sees_no_key(src.shape[0], src.shape[1], src_mask, src_key_padding_mask):
        return "a query masked from every key, which the fused kernel turns to NaN (slim gives it zeros)"
    return ""


def _dropout_in_training(layer: nn.TransformerEncoderLayer) -> bool:
    """Whether a dropout the unfused forward applies is live in an eval layer (MC-dropout, say)."""
    attention = layer.self_attn
    if attention.training and attention.dropout > 0.0:
        return True
    modules = (getattr(layer, name, None) for name in ("dropout", "dropout1", "dropout2"))
    return any(m is not None and m.training and getattr(m, "p", 1.0) > 0.0 for m in modules)


class SlimTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """Stock's ``nn.TransformerEncoderLayer``, whose inference calls reach slim's attention where slim wins.

    Same constructor, parameters, state dict and ``forward`` signature; ``convert`` and ``patch``
    make these from stock's layers, ``to_stock`` turns them back.
    """

    _scripted_as = STOCK_ENCODER_LAYER  # what torch.jit.script compiles (slim_mha._swap)

    @functools.wraps(STOCK_ENCODER_LAYER.__init__)  # type: ignore[misc]  # stock's signature and docs
    def __init__(self, *args, **kwargs) -> None:
        script_on_shadows()
        super().__init__(*args, **kwargs)

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        path, why = layer_path(self, src, src_mask, src_key_padding_mask)
        if inspection.EXPLAINING:
            inspection.note(self, "encoder layer", path, why or LAYER_PATHS_TAKEN[path])
        if path == "stock fused layer" and inspection.RECORDING and inspection.watched(self.self_attn):
            _record_beside_the_kernel(self, src, src_mask, src_key_padding_mask)
        if path == "unfused layer":
            return _unfused(self, src, src_mask, src_key_padding_mask, is_causal)
        if path != "slim layer":
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        if src.is_nested:
            return _nested_through(self, src)
        return _as_the_fused_kernel(self, src, src_mask, src_key_padding_mask)

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script`` compiles stock's layer (or the user's subclass of it) holding these
        same submodules and parameters; the eager model is left as it is (:mod:`slim_mha._swap`)."""
        return prepare_scriptable(self)


def _as_the_fused_kernel(layer: nn.TransformerEncoderLayer, src: Tensor, src_mask, src_key_padding_mask) -> Tensor:
    """What ``torch._transformer_encoder_layer_fwd`` computes from the arguments stock's layer gives it,
    with ``layer.self_attn`` (slim's) as the attention: batch-first ``src`` ``(B, L, E)``."""
    src_mask, src_key_padding_mask = stock_layer_masks(src, src_mask, src_key_padding_mask)
    _refuse_masks_as_the_kernel(layer, src, src_mask, src_key_padding_mask)
    # A float mask of another dtype than the input reaches here, which stock's unfused forward would
    # refuse and its kernel reads so.
    src_mask, src_key_padding_mask = _as_the_kernel_reads(src_mask), _as_the_kernel_reads(src_key_padding_mask)
    attention, eps, width = layer.self_attn, layer.norm1.eps, (src.shape[-1],)  # the kernel reads norm1.eps alone
    activation = F.gelu if layer.activation_relu_or_gelu == 2 else F.relu

    def attend(x: Tensor) -> Tensor:
        # forward, not the module's call: no hooks, as in the kernel (torch 2.4 fuses with hooks)
        return attention.forward(
            x, x, x, key_padding_mask=src_key_padding_mask, need_weights=False, attn_mask=src_mask
        )[0]

    def feed_forward(x: Tensor) -> Tensor:
        return F.linear(
            activation(F.linear(x, layer.linear1.weight, layer.linear1.bias)), layer.linear2.weight, layer.linear2.bias
        )

    def norm1(x: Tensor) -> Tensor:
        return F.layer_norm(x, width, layer.norm1.weight, layer.norm1.bias, eps)

    def norm2(x: Tensor) -> Tensor:
        return F.layer_norm(x, width, layer.norm2.weight, layer.norm2.bias, eps)

    x = src
    if layer.norm_first:
        x = x + attend(norm1(x))
        return x + feed_forward(norm2(x))
    x = norm1(x + attend(x))
    return norm2(x + feed_forward(x))


def _as_the_kernel_reads(mask: Tensor | None) -> Tensor | None:
    """A canonical (additive) mask as stock's fused kernel reads it: a bool mask, non-zero masked."""
    return None if mask is None else mask != 0


def _unfused(layer: nn.TransformerEncoderLayer, src: Tensor, src_mask, src_key_padding_mask, is_causal: bool) -> Tensor:
    """What stock's ``forward`` computes where it does not fuse: its masks made canonical, then its
    blocks and norms as modules (a subclass's blocks, dropout modules and hooks on them included).

    An ``is_causal`` hint without a mask is dropped, as stock's fused kernel drops it: there stock's
    unfused forward raises where its kernel returns, and slim returns at every length.
    """
    src_mask, src_key_padding_mask = stock_layer_masks(src, src_mask, src_key_padding_mask)
    is_causal = is_causal and src_mask is not None
    x = src
    if layer.norm_first:
        x = x + layer._sa_block(layer.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        return x + layer._ff_block(layer.norm2(x))
    x = layer.norm1(x + layer._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
    return layer.norm2(x + layer._ff_block(x))


def _refuse_masks_as_the_kernel(layer: nn.TransformerEncoderLayer, src: Tensor, src_mask, src_key_padding_mask) -> None:
    """The errors stock's fused call raises for masks of the wrong shape, with its types and words."""
    if src_mask is not None:  # stock merges the masks first: its views raise on a wrong shape
        layer.self_attn.merge_masks(src_mask, None, src)
    if src_key_padding_mask is not None and tuple(src_key_padding_mask.shape) != tuple(src.shape[:2]):
        if src_mask is not None:  # merged with the attention mask by a view, as stock merges them
            src_key_padding_mask.view(src.shape[0], 1, 1, src.shape[1])
        raise RuntimeError("For mask_type == 1 mask shape should be (B, L)")  # the kernel's check


def _record_beside_the_kernel(layer: nn.TransformerEncoderLayer, src: Tensor, src_mask, src_key_padding_mask) -> None:
    """The maps of a call the fused kernel runs, which computes none: slim's attention's maps of the
    kernel's attention input (``norm1(src)`` or ``src``, the masks read as the kernel reads them)."""
    padding = None
    if src.is_nested:
        src, padding = _padded(src)
        src_key_padding_mask = padding
    src_mask, src_key_padding_mask = stock_layer_masks(src, src_mask, src_key_padding_mask)
    width = (src.shape[-1],)
    x = F.layer_norm(src, width, layer.norm1.weight, layer.norm1.bias, layer.norm1.eps) if layer.norm_first else src
    call = AttentionCall(
        x, x, x, _as_the_kernel_reads(src_key_padding_mask), False, _as_the_kernel_reads(src_mask), True, False
    )
    attention = layer.self_attn
    assert isinstance(attention, SlimMultiheadAttention)  # a recording block watches slim's alone
    inspection.record_beside(attention, attention._slim_maps, call)
    if padding is not None:
        inspection.pad_rows(attention, padding)


def _padded(src: Tensor) -> tuple[Tensor, Tensor]:
    """A nested batch as a padded one ``(B, longest, E)`` and its padding mask ``(B, longest)`` (True: not a token)."""
    lengths = torch.tensor([sequence.shape[0] for sequence in src.unbind()], device=src.device)
    padded = src.to_padded_tensor(0.0)  # (B, longest, E)
    return padded, torch.arange(padded.shape[1], device=src.device) >= lengths[:, None]


def _nested_through(layer: nn.TransformerEncoderLayer, src: Tensor) -> Tensor:
    """Run the layer on a nested batch as a padded batch with its padding mask; nested again after."""
    padded, padding = _padded(src)
    out = _as_the_fused_kernel(layer, padded, None, padding)
    if inspection.RECORDING:  # the maps' padded rows as the output's: zero
        inspection.pad_rows(layer.self_attn, padding)
    return nested_from_padded(out, padding)
