"""The configuration matrix and the slim-vs-stock tolerance table, defined once.

The unit tests, the benchmark's correctness run and the migration's ``--verify`` all import these,
so a new axis or a tightened tolerance reaches every comparison with stock at once. The
equivariance checks keep their own table (``slim_mha.equivariance.TOLERANCE``): they compare a
module with itself under reordered sums, not slim with stock.
"""

from __future__ import annotations

import torch

__all__ = ["APPENDED", "ATTENTION_KINDS", "MODES", "TOLERANCE", "WEIGHTS", "appended_options"]

# How query, key and value relate: one tensor three times, a shared key/value tensor, three
# tensors, and keys and values of their own widths (kdim, vdim).
ATTENTION_KINDS = ("self", "cross_shared_kv", "cross", "kdim_vdim")
# Tokens appended after the projection, where the key bias matters.
APPENDED = ("none", "bias_kv", "zero_attn", "both")
# need_weights off, on with the average over heads, on per head.
WEIGHTS = ("none", "averaged", "per_head")
# train (dropout 0), eval, no_grad and inference_mode (where stock takes its native fast path).
MODES = ("train", "eval", "no_grad", "inference_mode")

# Largest error allowed, relative to max(1, largest magnitude of the expected tensor). In bf16 and
# fp16 two correct implementations round differently: comparisons there measure both against a
# float64 run and allow slim twice stock's error plus this.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 1e-2,
}


def appended_options(appended: str) -> dict[str, bool]:
    """The constructor options of an ``APPENDED`` entry."""
    return {"add_bias_kv": appended in ("bias_kv", "both"), "add_zero_attn": appended in ("zero_attn", "both")}
