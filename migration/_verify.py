"""``--verify``: rebuild a module from its original and its migrated tensors and compare the outputs,
then read every written file back and compare every tensor with what it must hold.

Both modules are torch's stock class, whatever the layout: the key-bias-free layout is turned into
stock's first (:func:`slim_mha.bias.unfold_key_bias`), so the check depends on stock alone.
Measuring (:func:`module_output_error`), checking (:func:`check_module_error`) and formatting (the
message) are separate. One head suffices: the key-bias shift ``q·b_k`` is per query and per head
alike, so a fold that is exact for one head is exact for any split of the same projections.

The read-back (:func:`check_written_file`) maps the written file and compares each tensor's bytes,
unchanged and converted alike, with the source's bytes or the converted tensor: a fault anywhere
between the plan and the disk (a copy that went wrong, a flipped byte) fails the run before the
output is moved into place. It reads the file through the page cache, as any reader would; a fault
below it (the disk's own) is the file system's to catch.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterable
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from slim_mha._matrix import TOLERANCE
from slim_mha._torch_compat import STOCK_MHA
from slim_mha.bias import BIAS_NAMES, SlimBiases, unfold_key_bias

from ._writer import OutputTensor
from .report import option, shown

# The largest relative output error accepted is the project's slim-vs-stock TOLERANCE of the least
# precise dtype the migrated module stores: folding rounds bias_k - b_k (and out_proj.bias + W_o b_v)
# once to that dtype, everything else is copied exactly, and the comparison runs in float64.
_COMPUTE = torch.float64
_BATCH, _TARGET_LENGTH, _SOURCE_LENGTH = 2, 3, 5
_COMPARE = 1024 * 1024  # bytes compared at a time: memory stays flat whatever the tensor's size


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
            f"{shown(where)}: {option('verify')} failed for '{shown(module)}': the migrated module's output differs from the "
            f"original's by {error:.3g} (relative), more than the {tolerance:g} allowed for {dtype}; "
            "nothing was written"
        )


def _rebuild(tensors: dict[str, Tensor], embed_dim: int, kdim: int, vdim: int, zero_attn: bool) -> nn.Module:
    """A one-head stock module holding exactly these tensors; the key-bias-free layout is first turned
    into stock's (a dropped key bias and a folded value bias become zero slots, as stock computes them)."""
    tensors = dict(tensors)
    if any(name in tensors for name in BIAS_NAMES):
        q_bias, k_bias, v_bias = (tensors.pop(name, None) for name in BIAS_NAMES)
        in_proj_bias, _ = unfold_key_bias(SlimBiases(q_bias, k_bias, v_bias, bias_k=None), embed_dim=embed_dim)
        if in_proj_bias is not None:  # some bias was stored, so the packed one exists
            tensors["in_proj_bias"] = in_proj_bias
    module = STOCK_MHA(
        embed_dim,
        1,
        bias="in_proj_bias" in tensors,
        add_bias_kv="bias_k" in tensors,
        add_zero_attn=zero_attn,
        kdim=kdim,
        vdim=vdim,
        device="meta",  # assign=True below puts the given tensors in place; nothing is allocated twice
    )
    module.load_state_dict(tensors, strict=True, assign=True)
    return module.eval()


def check_written_file(path: Path, tensors: list[OutputTensor], *, shown_as: Path) -> int:
    """Map the file at ``path`` and compare its header and every tensor's bytes with ``tensors``; raise
    ``RuntimeError`` naming ``shown_as`` (where the file will end up) at the first difference.

    Returns the number of tensors compared."""

    def fail(problem: str) -> RuntimeError:
        return RuntimeError(
            f"{shown(shown_as)}: {option('verify')} read the written file back and {problem}; nothing was written"
        )

    with ExitStack() as stack:
        written = _mapped(path, stack)
        length = int.from_bytes(written[:8], "little")
        try:
            header = json.loads(written[8 : 8 + length])
        except (ValueError, RecursionError):
            raise fail("its header does not read") from None
        header.pop("__metadata__", None)
        expected = {tensor.key: tensor for tensor in tensors}
        if set(header) != set(expected):
            raise fail(f"it holds {len(header)} tensors where {len(expected)} were planned")
        sources: dict[Path, mmap.mmap] = {}
        for key, tensor in expected.items():
            entry = header[key]
            begin, end = entry["data_offsets"]
            if (entry["dtype"], tuple(entry["shape"]), end - begin) != (
                tensor.dtype,
                tuple(tensor.shape),
                tensor.nbytes,
            ):
                raise fail(f"'{shown(key)}' has dtype {entry['dtype']} and shape {entry['shape']}, not as planned")
            source, start, what = _expected_bytes(tensor, sources, stack)
            at = _first_difference(written, 8 + length + begin, source, start, tensor.nbytes)
            if at is not None:
                raise fail(f"'{shown(key)}' differs from {what} at byte {at} of the tensor")
    return len(expected)


def _mapped(path: Path, stack: ExitStack) -> mmap.mmap:
    file = stack.enter_context(open(path, "rb"))
    return stack.enter_context(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))


def _expected_bytes(tensor: OutputTensor, sources: dict, stack: ExitStack):
    """What the tensor's bytes must be: a buffer, where they start in it, and what it is, for messages."""
    record = tensor.record
    in_memory = tensor.tensor if tensor.tensor is not None else (record.tensor if record else None)
    if in_memory is not None:
        what = (
            "the converted tensor" if tensor.tensor is not None else f"the tensor in {shown(tensor.source.shard.path)}"
        )
        return in_memory.contiguous().reshape(-1).view(torch.uint8).numpy().data, 0, what
    opened = tensor.source.shard.opened
    if opened.path not in sources:  # the opened shard itself, never its path again
        sources[opened.path] = stack.enter_context(mmap.mmap(opened.descriptor, 0, access=mmap.ACCESS_READ))
    return sources[opened.path], tensor.source.data_offset, f"its bytes in {shown(opened.path)}"


def _first_difference(written, written_start: int, source, source_start: int, length: int) -> int | None:
    for done in range(0, length, _COMPARE):
        step = min(_COMPARE, length - done)
        mine = written[written_start + done : written_start + done + step]
        theirs = bytes(source[source_start + done : source_start + done + step])
        # Compared pages leave the process's mapping (they stay in the page cache), so a large file
        # does not count against its memory.
        _release(written, written_start + done, step)
        _release(source, source_start + done, step)
        if mine != theirs:
            return done + next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
    return None


def _release(buffer, start: int, length: int) -> None:
    if isinstance(buffer, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        aligned = start - start % mmap.PAGESIZE
        buffer.madvise(mmap.MADV_DONTNEED, aligned, min(length + start - aligned, len(buffer) - aligned))


def check_written_text(path: Path, text: str, *, shown_as: Path) -> None:
    """Compare a written index with the text it must hold."""
    if path.read_text(encoding="utf-8") != text:
        raise RuntimeError(
            f"{shown(shown_as)}: {option('verify')} read the written index back and it differs from what was "
            "planned; nothing was written"
        )
