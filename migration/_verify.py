"""``--verify``: rebuild a module from its original and its migrated tensors and compare the outputs.

Measuring (:func:`module_output_error`), checking (:func:`check_module_error`) and formatting (the
message) are separate. One head suffices: the key-bias shift ``q·b_k`` is per query and per head
alike, so a fold that is exact for one head is exact for any split of the same projections.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from slim_mha import SlimMultiheadAttention
from slim_mha._matrix import TOLERANCE
from slim_mha._torch_compat import STOCK_MHA

from ._text import shown

# The largest relative output error accepted is the project's slim-vs-stock TOLERANCE of the least
# precise dtype the migrated module stores: folding rounds bias_k - b_k (and out_proj.bias + W_o b_v)
# once to that dtype, everything else is copied exactly, and the comparison runs in float64.
_COMPUTE = torch.float64
_BATCH, _TARGET_LENGTH, _SOURCE_LENGTH = 2, 3, 5


def module_output_error(
    original: dict[str, Tensor],
    migrated: dict[str, Tensor],
    *,
    embed_dim: int,
    kdim: int,
    vdim: int,
    zero_attn: bool,
    seed: int = 0,
) -> float:
    """Largest ``|migrated - original|`` over the outputs on random inputs, relative to the largest output.

    Args:
        original, migrated: the module's tensors by local name (``"in_proj_weight"``, ...), in the
            stock or the slim layout; tensors shared by both are converted to float64 once (pass
            float64 tensors to avoid even that copy).
        embed_dim, kdim, vdim: the module's dimensions, as found from the shapes.
        zero_attn: whether the module was built with ``add_zero_attn=True``.
    """
    wide = {id(tensor): tensor.to(_COMPUTE) for tensor in [*original.values(), *migrated.values()]}
    modules = [
        _rebuild({local: wide[id(tensor)] for local, tensor in tensors.items()}, embed_dim, kdim, vdim, zero_attn)
        for tensors in (original, migrated)
    ]
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(_TARGET_LENGTH, _BATCH, embed_dim, generator=generator, dtype=_COMPUTE)  # (L, B, E)
    key = torch.randn(_SOURCE_LENGTH, _BATCH, kdim, generator=generator, dtype=_COMPUTE)  # (S, B, kdim)
    value = torch.randn(_SOURCE_LENGTH, _BATCH, vdim, generator=generator, dtype=_COMPUTE)  # (S, B, vdim)
    with torch.no_grad(), _one_thread():
        expected, actual = (module(query, key, value, need_weights=False)[0] for module in modules)
    scale = expected.abs().max().clamp_min(torch.finfo(_COMPUTE).tiny)
    return float((actual - expected).abs().max() / scale)


@contextmanager
def _one_thread():
    """Run the few-token forward on one intra-op thread. Split across threads, each call waits for
    its workers at a barrier, which on a busy machine measured 50x slower (5 ms against 0.1 ms per
    attention call), so that verifying thousands of small modules took minutes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tolerance_for(dtypes: Iterable[torch.dtype]) -> tuple[float, torch.dtype]:
    """The tolerance of the least precise of ``dtypes`` (the migrated module's), and that dtype."""
    dtype = max(dtypes, key=lambda dtype: torch.finfo(dtype).eps)
    return TOLERANCE[dtype], dtype


def check_module_error(error: float, tolerance: float, *, module: str, where: str, dtype: torch.dtype) -> None:
    """Raise when the measured error exceeds the tolerance; the message names the module and its file."""
    if not error <= tolerance:  # also catches NaN
        raise RuntimeError(
            f"{shown(where)}: --verify failed for '{shown(module)}': the migrated module's output differs from the "
            f"original's by {error:.3g} (relative), more than the {tolerance:g} allowed for {dtype}; "
            "nothing was written"
        )


def _rebuild(tensors: dict[str, Tensor], embed_dim: int, kdim: int, vdim: int, zero_attn: bool) -> nn.Module:
    """A one-head module of the layout the tensors are in, holding exactly those tensors."""
    slim = any(name in tensors for name in ("q_proj_bias", "k_proj_bias", "v_proj_bias"))
    cls = SlimMultiheadAttention if slim else STOCK_MHA
    module = cls(
        embed_dim,
        1,
        bias="in_proj_bias" in tensors or "q_proj_bias" in tensors,
        add_bias_kv="bias_k" in tensors,
        add_zero_attn=zero_attn,
        kdim=kdim,
        vdim=vdim,
        device="meta",  # assign=True below puts the given tensors in place; nothing is allocated twice
    )
    if slim and "v_proj_bias" not in tensors:
        module.v_proj_bias = None  # the value bias was folded into out_proj.bias
    module.load_state_dict(tensors, strict=True, assign=True)
    return module.eval()
