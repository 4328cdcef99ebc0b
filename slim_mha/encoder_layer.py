"""``nn.TransformerEncoderLayer`` whose inference fast path reaches slim's attention.

Stock's layer, in eval without a graph, calls one fused kernel (``torch._transformer_encoder_layer_fwd``)
with the attention's parameters and never calls the attention module. That kernel builds the
``(B, H, L, L)`` scores, and with a padding mask it is several times heavier than slim's attention
(``benchmarks/RESULTS.md``, "Encoders"). :class:`SlimTransformerEncoderLayer` is stock's layer with
one change: :func:`layer_path` decides, per call, whether stock's ``forward`` runs (its fused kernel
where it takes it, its own general path elsewhere) or stock's blocks run with slim's attention
(``_sa_block``, ``_ff_block`` and the norms, in the order of stock's general path). The blocks are
stock's general path itself, so the function is stock's either way.

A nested tensor (what ``nn.TransformerEncoder`` makes of a padded batch in inference) reaches the
blocks as a padded batch with its padding mask, and leaves as a nested tensor again: the padded
rows are dropped, so the layer returns what stock's returns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._swap import rebuild_as
from ._torch_compat import STOCK_ENCODER_LAYER, is_symbolic_call
from .attention import SlimMultiheadAttention

__all__ = ["SlimTransformerEncoderLayer", "layer_path", "FUSED_LAYER_MAX_LENGTH"]

# Up to these many tokens stock's fused layer is at least as fast as its blocks with slim's
# attention: the whole layer is one kernel, and its (B, H, L, L) scores are small. Above them slim's
# blocks win in memory (half of stock's peak from L=192 on, a fourteenth at L=2048) and are at parity
# or faster. A nested batch (nn.TransformerEncoder's padded batch) keeps stock's kernel longer: it
# computes no padded token. Measured on 2 CPU threads, 2 layers, B=4 E=256 H=8, allocator warm
# (benchmarks/RESULTS.md, "Encoders", where the inherited allocator is measured too).
FUSED_LAYER_MAX_LENGTH = {"no mask": 384, "mask": 96, "nested": 384}


def layer_path(layer: nn.TransformerEncoderLayer, src: Tensor, src_mask, src_key_padding_mask) -> str:
    """``"stock"`` (stock's own ``forward``) or ``"slim"`` (stock's blocks, slim's attention).

    Only a call that stock's layer could hand to its fused kernel is taken from it: in eval, no graph
    recorded, the fast path on, a real batched tensor. Every other call runs stock's ``forward``,
    whose general path calls slim's attention through ``_sa_block`` anyway.
    """
    attention = layer.self_attn
    if (
        not isinstance(attention, SlimMultiheadAttention)
        or layer.training
        or not torch.backends.mha.get_fastpath_enabled()
        or is_symbolic_call(src)
        or src.dim() != 3
        or (torch.is_grad_enabled() and (src.requires_grad or any(p.requires_grad for p in layer.parameters())))
    ):
        return "stock"
    if src.is_nested:  # nn.TransformerEncoder's padded batch: stock's layer takes no mask beside it
        if src_mask is not None or src_key_padding_mask is not None:
            return "stock"
        kind, length = "nested", max((sequence.shape[0] for sequence in src.unbind()), default=0)
    else:
        kind = "no mask" if src_mask is None and src_key_padding_mask is None else "mask"
        length = src.shape[1] if attention.batch_first else src.shape[0]
    return "stock" if length <= FUSED_LAYER_MAX_LENGTH[kind] else "slim"


class SlimTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """Stock's ``nn.TransformerEncoderLayer``, whose inference calls reach slim's attention where slim wins.

    Same constructor, parameters, state dict and ``forward`` signature; ``convert`` and ``patch``
    make these from stock's layers, ``to_stock`` turns them back.
    """

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        if layer_path(self, src, src_mask, src_key_padding_mask) == "stock":
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        if src.is_nested:
            return _nested_through(self._blocks, src)
        return self._blocks(src, src_mask, src_key_padding_mask, is_causal)

    def _blocks(self, src: Tensor, src_mask, src_key_padding_mask, is_causal: bool = False) -> Tensor:
        """Stock's general path: its masks made canonical as its ``forward`` makes them, then its blocks."""
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask", other_type=F._none_or_dtype(src_mask),
            other_name="src_mask", target_type=src.dtype,
        )
        src_mask = F._canonical_mask(
            mask=src_mask, mask_name="src_mask", other_type=None, other_name="", target_type=src.dtype,
            check_other=False,
        )
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
        return self.norm2(x + self._ff_block(x))

    def __prepare_scriptable__(self) -> nn.TransformerEncoderLayer:
        """``torch.jit.script`` compiles stock's layer holding these same submodules and parameters."""
        return rebuild_as(self, STOCK_ENCODER_LAYER)


def _nested_through(blocks, src: Tensor) -> Tensor:
    """Run ``blocks`` on a nested batch as a padded batch with its padding mask; nested again after."""
    lengths = torch.tensor([sequence.shape[0] for sequence in src.unbind()], device=src.device)
    padded = src.to_padded_tensor(0.0)  # (B, longest, E)
    padding = torch.arange(padded.shape[1], device=src.device) >= lengths[:, None]  # True: not a token
    out = blocks(padded, None, padding)
    return torch._nested_tensor_from_mask(out, padding.logical_not(), mask_check=False)
