"""One attention call's arguments, as ``forward`` received them: recorded once, passed whole."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["AttentionCall"]


class AttentionCall(NamedTuple):
    """``forward``'s arguments in stock's order, so ``super().forward(*call)`` is stock's call.

    A NamedTuple: immutable (a recomputation makes a new one with ``_replace``), and traced by
    Dynamo on every supported torch.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    key_padding_mask: Tensor | None
    need_weights: bool
    attn_mask: Tensor | None
    average_attn_weights: bool
    is_causal: bool
