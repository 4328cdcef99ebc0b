"""Every probe into torch's behaviour beyond its documented API, in one file.

When torch changes, this is the file to read. Each probe says what it relies on; all were checked
on torch 2.4.1 and 2.13.0 (the tested range's ends at the time of writing).
"""

from __future__ import annotations

import functools

import torch
import torch.fx
import torch.nn.functional as F
import torch.nn.modules.activation
import torch.nn.modules.transformer
import torch.utils.backend_registration
from torch import Tensor, nn
from torch.utils import _pytree as pytree  # private, public in all but name: tree_leaves/flatten/unflatten

__all__ = [
    "STOCK_ENCODER_LAYER",
    "STOCK_MHA",
    "fx_proxy_of",
    "is_capturing_graph",
    "is_capturing_or_transforming",
    "is_symbolic_call",
    "stock_head_split",
    "stock_layer_masks",
    "nested_from_padded",
    "pytree",
    "ACCELERATOR_DEVICES",
    "dcp_storage_info",
    "stock_kernel",
    "sdpa_zeroes_rows_masked_from_every_key",
    "stock_layer_unfuses_for_hooks",
    "wrap_jit_prepare",
]

# torch's own class, captured when slim_mha is first imported, which is before anything can patch
# it: while patched, torch.nn.MultiheadAttention is slim's class.
STOCK_MHA = torch.nn.modules.activation.MultiheadAttention
# Likewise the encoder layer, whose fused inference kernel takes the attention's parameters directly.
STOCK_ENCODER_LAYER = torch.nn.modules.transformer.TransformerEncoderLayer


def is_capturing_graph() -> bool:
    """``torch.compile``/``torch.export`` (Dynamo) or ``torch.jit.trace`` is recording this call.

    Public API both: ``torch.compiler.is_compiling`` (Dynamo folds it to True) and
    ``torch.jit.is_tracing``. Sizes are symbolic or recorded there, and no state may change.
    """
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def is_capturing_or_transforming() -> bool:
    """A graph is being captured or a ``torch.func`` transform (``vmap``, ``grad``...) wraps this
    call's tensors: no state may change, no data pointers are real.

    Private: ``torch._C._are_functorch_transforms_active``, present on every tested version. Dynamo
    on torch 2.4 cannot trace that call ("torch.* op returned non-Tensor bool"), so the graph checks
    come first: Dynamo folds ``is_compiling()`` to True and never reaches it.
    """
    return is_capturing_graph() or torch._C._are_functorch_transforms_active()


# Looked up once: stock's default call runs this check right after the previous call's large ops,
# where each attribute look-up costs several times its idle price.
_is_exporting = getattr(torch.compiler, "is_exporting", None)


def is_symbolic_call(query: object) -> bool:
    """Whether this call's tensors may not be real ones: captured, exported, transformed or faked.

    Beyond :func:`is_capturing_or_transforming`: ``torch.compiler.is_exporting`` (torch >= 2.5; older
    export runs Dynamo, which ``is_compiling`` sees), stand-ins for tensors (FX proxies), and a
    non-empty ``torch_dispatch`` mode stack (``make_fx``, ``FakeTensorMode``, non-strict export;
    private: ``torch._C._len_torch_dispatch_stack``). ``torch.jit.script`` needs no check: scripted
    code never runs Python.
    """
    return (
        torch.compiler.is_compiling()  # first: Dynamo folds it to True and traces nothing below
        or (_is_exporting is not None and _is_exporting())
        or torch._C._get_tracing_state() is not None  # torch.jit.trace
        or not isinstance(query, Tensor)
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._len_torch_dispatch_stack() > 0
    )


def fx_proxy_of(module: nn.Module, query: object, args: tuple, kwargs: dict) -> torch.fx.Proxy | None:
    """Under ``torch.fx`` symbolic tracing, the node a leaf module would be: a call of ``module``.

    fx's tracer treats stock's class as a leaf (it lives in ``torch.nn``) and calls into any other
    module's ``forward`` with ``Proxy`` inputs, where Python control flow cannot run. Recording the
    call itself makes slim attention trace as stock's does. Public API: ``Proxy.tracer``,
    ``Tracer.path_of_module`` and ``Tracer.create_proxy``.
    """
    if not isinstance(query, torch.fx.Proxy):
        return None
    tracer = query.tracer
    if not isinstance(tracer, torch.fx.Tracer):  # a proxy of another tracer: no module paths to record
        raise TypeError(f"slim_mha: a torch.fx Proxy of a {type(tracer).__name__}, which names no modules")
    path = tracer.path_of_module(module)
    if path == "":  # the traced root itself: stock's forward branches on its proxies here, which fx refuses
        bool(query)  # raises fx's own TraceError, as stock's first branch does
    return tracer.create_proxy("call_module", path, args, kwargs)


def stock_head_split(
    query: Tensor, weight: Tensor, bias: Tensor | None, num_heads: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Stock's native kernel's input projection of batch-first self-attention ``query`` ``(B, L, E)``
    without a graph: its matmul, then one op that adds ``bias`` (zeros where ``None``), scales the
    queries by ``1/sqrt(D)`` and writes q, k, v head-major, contiguous ``(B, H, L, D)``.

    ``None`` where it does not apply: a weight or bias of another dtype than the query's, or an
    empty input, on which the op crashes the process. Private: ``torch._transform_bias_rescale_qkv``
    (no autograd), present and used so by ``nn.MultiheadAttention`` on every tested version.
    """
    if query.numel() == 0 or weight.dtype != query.dtype or (bias is not None and bias.dtype != query.dtype):
        return None
    if bias is None:
        bias = weight.new_zeros(weight.shape[0])
    return torch._transform_bias_rescale_qkv(F.linear(query, weight), bias, num_heads)


# Stock's native kernel, the op stock's ``forward`` calls on its fast path (batch-first
# self-attention, even head count, no graph, no autocast, real cpu or cuda tensors of one dtype),
# called with the same arguments as stock calls it: ``(query, key, value, embed_dim, num_heads,
# in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, mask, need_weights,
# average_attn_weights, mask_type)``, ``mask`` and ``mask_type`` what stock's ``merge_masks`` makes
# of the call's masks. It returns the output ``(B, L, E)`` and, with ``need_weights``, every head's
# weights ``(B, H, L, L)`` or their mean ``(B, L, L)`` (else ``None``). Bound, not wrapped: the
# shortest call crosses no Python frame of ours here. Private: ``torch._native_multi_head_attention``
# (no autograd), with this signature on every tested version.
stock_kernel = torch._native_multi_head_attention


def stock_layer_masks(src: Tensor, src_mask, src_key_padding_mask) -> tuple[Tensor | None, Tensor | None]:
    """``(src_mask, src_key_padding_mask)`` made canonical as ``nn.TransformerEncoderLayer.forward``
    makes them before it decides anything: bool masks additive in ``src``'s dtype, with its warnings.

    Private: ``F._canonical_mask`` and ``F._none_or_dtype``, which stock's layer calls itself, on
    every tested version (calling them keeps its warnings' wording and stack levels stock's).
    """
    src_key_padding_mask = F._canonical_mask(
        mask=src_key_padding_mask,
        mask_name="src_key_padding_mask",
        other_type=F._none_or_dtype(src_mask),
        other_name="src_mask",
        target_type=src.dtype,
    )
    src_mask = F._canonical_mask(
        mask=src_mask, mask_name="src_mask", other_type=None, other_name="", target_type=src.dtype, check_other=False
    )
    return src_mask, src_key_padding_mask


def nested_from_padded(padded: Tensor, padding: Tensor) -> Tensor:
    """A padded ``(B, L, E)`` batch back to a nested tensor, each sequence without its padded rows, as
    stock's encoder makes its nested output. Private: ``torch._nested_tensor_from_mask``, which
    ``nn.TransformerEncoder`` calls itself, on every tested version."""
    return torch._nested_tensor_from_mask(padded, padding.logical_not(), mask_check=False)


# The device types stock's encoder layer lets into its fused kernel, in its words; the last is the
# name a third-party backend registers (private: ``torch.utils.backend_registration._privateuse1_backend_name``,
# which stock's layer reads itself).
ACCELERATOR_DEVICES = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)


def wrap_jit_prepare(wrapper) -> None:
    """Route ``torch.jit.script``'s preparation of a module tree through ``wrapper(prepare)``, once.

    Private: ``torch.jit._script.call_prepare_scriptable_func``, which ``torch.jit.script`` looks up
    in its module at each call and which calls each module's ``__prepare_scriptable__`` and writes
    what it returns into the parent's ``_modules``. Present on every tested version;
    ``tests/test_encoder_contract.py`` checks that scripting leaves the eager model as it was.
    """
    import torch.jit._script as script

    if script.call_prepare_scriptable_func is not _JIT_PREPARE.get("ours"):
        _JIT_PREPARE["ours"] = script.call_prepare_scriptable_func = wrapper(script.call_prepare_scriptable_func)


_JIT_PREPARE: dict[str, object] = {}  # the wrapper wrap_jit_prepare installed, so it installs once


@functools.cache
def stock_layer_unfuses_for_hooks() -> bool:
    """Whether stock's ``nn.TransformerEncoderLayer`` leaves its fused kernel when a forward hook is
    attached to it or a submodule (torch >= 2.5 does, pytorch#128413; 2.4 fuses and skips the hooks).

    Observed, not read off a version: a tiny stock layer in eval, a hook on its attention, one call.
    Its random initialisation draws under a forked RNG, so that a seeded script's first build and
    draws are what they are without slim_mha.
    """
    with torch.random.fork_rng(devices=[]):
        layer = STOCK_ENCODER_LAYER(4, 2, 4, dropout=0.0, batch_first=True).eval()
    fired = []
    layer.self_attn.register_forward_hook(lambda *_: fired.append(True))
    with torch.no_grad(), torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        previous = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(True)
        try:
            layer(torch.zeros(1, 2, 4))
        finally:
            torch.backends.mha.set_fastpath_enabled(previous)
    return bool(fired)


@functools.cache
def sdpa_zeroes_rows_masked_from_every_key() -> bool:
    """Whether this torch's ``scaled_dot_product_attention`` on the CPU gives a query row masked from
    every key a zero output and finite gradients (torch 2.13 does; 2.4 gives NaN, pytorch#41508).

    Observed, not read off a version: one tiny call without a graph and one with its backward. CUDA's
    backends are not observed here, so CUDA calls are mended whatever this returns.
    """
    mask = torch.tensor([[0.0, 0.0], [float("-inf"), float("-inf")]])  # row 1 sees no key
    query = torch.ones(1, 1, 2, 2)
    with torch.inference_mode(False), torch.no_grad():
        if not bool((F.scaled_dot_product_attention(query, query, query, attn_mask=mask)[..., 1, :] == 0).all()):
            return False
    with torch.inference_mode(False), torch.enable_grad():
        leaf = query.clone().requires_grad_()
        out = F.scaled_dot_product_attention(leaf, leaf, leaf, attn_mask=mask)
        out.sum().backward()
    return bool((out[..., 1, :] == 0).all()) and leaf.grad is not None and bool(leaf.grad.isfinite().all())


def dcp_storage_info(relative_path: str, offset: int, length: int):
    """DCP's record of an entry's byte range in a data file (``FileSystemReader`` reads
    ``Metadata.storage_data`` values of this class): private in name since DCP's first release, with
    these three fields through 2.15."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)
