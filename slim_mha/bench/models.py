"""Models and inputs for ``python -m slim_mha.bench model``, the ones this project records.

Each factory takes no argument (the command calls it twice, stock and patched); each input function
takes the ``--input`` shapes, when given, as tuples. ``nn.MultiheadAttention`` is looked up when a
model is built, so ``slim_mha.patched()`` reaches every one.

* ``detr_decoder_layer`` (and ``..._no_dropout``) with ``detr_inputs``: DETR's decoder layer, whose
  calls keep only ``[0]`` of stock's default ``need_weights=True`` (``--skip-unread-weights``);
* ``transformer_encoder`` (and ``..._unnested``) with ``padded_tokens``: ``nn.TransformerEncoder``,
  whose layers run stock's fused kernel in inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "DetrStyleDecoderLayer",
    "detr_decoder_layer",
    "detr_decoder_layer_no_dropout",
    "detr_inputs",
    "padded_tokens",
    "transformer_encoder",
    "transformer_encoder_unnested",
]


class DetrStyleDecoderLayer(nn.Module):
    """A post-norm transformer decoder layer whose attention calls are written as DETR writes them.

    Inputs are sequence-first: ``tgt`` ``(L, B, E)`` (the object queries' state), ``memory``
    ``(S, B, E)`` (the encoder's image tokens), ``memory_key_padding_mask`` ``(B, S)`` (``True`` on
    image padding), ``pos`` ``(S, B, E)`` and ``query_pos`` ``(L, B, E)`` added to keys and queries.
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

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None = None,
        pos: Tensor | None = None,
        query_pos: Tensor | None = None,
    ) -> Tensor:
        q = k = tgt if query_pos is None else tgt + query_pos
        tgt = self.norm1(tgt + self.dropout1(self.self_attn(q, k, value=tgt)[0]))  # weights dropped by subscript
        attended = self.multihead_attn(
            query=tgt if query_pos is None else tgt + query_pos,
            key=memory if pos is None else memory + pos,
            value=memory,
            key_padding_mask=memory_key_padding_mask,
        )[0]
        tgt = self.norm2(tgt + self.dropout2(attended))
        return self.norm3(tgt + self.dropout3(self.linear2(self.dropout(F.relu(self.linear1(tgt))))))


def detr_decoder_layer(dropout: float = 0.1) -> nn.Module:
    """DETR's decoder layer at its usual width (E=256, H=8, feed-forward 2048), attention biases random:
    a zero key bias would hide a wrong fold."""
    layer = DetrStyleDecoderLayer(256, 8, 2048, dropout)
    with torch.no_grad():
        for parameter in [*layer.self_attn.parameters(), *layer.multihead_attn.parameters()]:
            parameter.normal_(0.0, 0.05)
    return layer


def detr_decoder_layer_no_dropout() -> nn.Module:
    return detr_decoder_layer(dropout=0.0)


def detr_inputs(queries: tuple = (100, 2, 256), memory: tuple = (950, 2, 256)) -> tuple:
    """100 object queries over a ~800x1200 image's 950 tokens, batch 2 (or the ``--input`` shapes, each
    ``(L, B, E)``); the last image is padded on its last 15% of tokens."""
    generator = torch.Generator().manual_seed(1)
    tgt, query_pos = (torch.randn(queries, generator=generator) for _ in range(2))
    tokens, pos = (torch.randn(memory, generator=generator) for _ in range(2))
    padding = torch.zeros(memory[1], memory[0], dtype=torch.bool)
    padding[-1, int(memory[0] * 0.85) :] = True
    return tgt, tokens, padding, pos, query_pos


def transformer_encoder(nested: bool = True) -> nn.Module:
    """Two batch-first layers, E=256, H=8, feed-forward 1024: ``nested`` is ``enable_nested_tensor``."""
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)


def transformer_encoder_unnested() -> nn.Module:
    return transformer_encoder(nested=False)


def padded_tokens(shape: tuple = (4, 512, 256)) -> tuple:
    """Tokens ``(B, L, E)`` and, as ``src_key_padding_mask``, the last quarter of every other sequence
    padded: stock's encoder then runs the batch as a nested tensor (``enable_nested_tensor=True``)."""
    batch, length, _ = shape
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1::2, length - length // 4 :] = True
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)), None, padding
