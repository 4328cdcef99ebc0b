"""Refuse an attention-weights request that cannot fit, before anything is allocated for it.

Attention weights are quadratic in the number of tokens: at B=1 and 100,000 tokens the averaged
``(B, L, S)`` float32 weights alone are 37 GiB, and the per-head scores behind them H times that.
Left to the allocator, such a call either fails with ``can't allocate memory: you tried to allocate
...`` (above the kernel's overcommit limit) or, below it, succeeds on paper and lets the kernel's
out-of-memory killer end this process or a neighbour while the pages are written. Either way the
user learns nothing about the fix, which is ``need_weights=False``: scaled_dot_product_attention
never materialises the weights and its memory grows linearly with the number of tokens.

**When to refuse.** :func:`check_weights_fit` compares what slim's weights path
(``slim_mha/_explicit_attention.py``) will hold at once with the memory this process can get. Only
its tensors that grow with ``L x S`` are counted; the linear ones (projections, output) are left out,
so the estimate stays a lower bound of the call's need. Each of these paths holds no more than stock
``nn.MultiheadAttention`` does for the same call, so a call is refused only when stock would fail
too; stock still tries, and fails in the allocator or, under overcommit, in the OOM killer:

===========================================  ====================================  =====================
call                                         slim's path holds at once             stock holds at least
===========================================  ====================================  =====================
a graph is recorded (training), or a         scores and probabilities,             the same
``torch.func`` transform                     2 x (B, H, L, S); the average,
                                             (B, L, S), comes once the scores
                                             are freed
no graph, per-head weights                   the weights, (B, H, L, S)             the same
no graph, averaged, where one pass fits      the scores of every head, softmaxed   (B, H, L, S) scores
(:func:`rows_per_block` returns L)           in place, (B, H, L, S), and their     and their average,
                                             average, (B, L, S)                    (B, L, S)
no graph, averaged, where it does not        the averaged weights, (B, L, S), one  the same as above
                                             block of query rows' scores,
                                             (B, H, rows, S), and its average,
                                             (B, rows, S); rows from
                                             :func:`rows_per_block`
===========================================  ====================================  =====================

**Stock's kernel.** Below the checked size, calls that stock's fast path would take (unmasked
batch-first self-attention without a graph), and their sequence-first twins, run stock's native
kernel itself, which holds what it holds for stock, plus the ``3E``-element bias ``[b_q; 0; b_v]``
that slim gives it; above, they take the paths in the table.

**One pass or blocks.** Without a graph, averaged weights take one pass, which holds what stock's
native kernel holds, wherever it fits in the memory this process can get; only where it does not
are they computed a block of query rows at a time (:func:`rows_per_block`), with blocks as large as
half of that memory allows: the other half is left for what the estimate does not count. Where
stock's pass would not fit, the blocks are what lets the call run at all.

Attention dropout without a graph (a module in training mode under ``torch.no_grad``) also runs
the path of the first row, but the guard is not told the dropout probability, so it counts such a
call as the no-graph path: an underestimate, which can let a call through, never refuse one.

**What the process can get** (:func:`available_bytes`): on CPU, the smallest of the address space
left under ``RLIMIT_AS``, the headroom under the cgroup's memory limit (v2 ``memory.max`` or v1
``memory.limit_in_bytes``, reclaimable file cache counted as free) and the kernel's ``MemAvailable``
plus free swap (``CommitLimit - Committed_AS`` under strict overcommit); on CUDA, the device's free
memory plus what the caching allocator holds unused. Anything it cannot read counts as unlimited:
an unknown limit never refuses a call.

**Cost.** Below :data:`_CHECK_ABOVE_BYTES` the check is one flag read and a few integer
multiplications; the limits are read only for requests large enough that computing them takes
tens of milliseconds or more. Under ``torch.compile``/``torch.export``/``torch.jit.trace`` tracing
(sizes may be symbolic or recorded) and for meta tensors and tensor subclasses it does nothing.

**The error** is ``torch.OutOfMemoryError``, a ``RuntimeError``: stock's failure here is the
allocator's ``RuntimeError`` on CPU and ``torch.OutOfMemoryError`` on CUDA, so handlers written for
stock (``except RuntimeError``, batch-size finders that catch out-of-memory errors) catch ours too,
which a ``MemoryError`` would slip past.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ._torch_compat import is_capturing_graph

__all__ = ["available_bytes", "below_checked_size", "check_weights_fit", "rows_per_block", "weights_path_bytes"]

# Requests below this are not checked: reading the limits costs tens of microseconds, a rounding
# error next to writing 256 MiB of scores, and smaller requests are not where memory runs out.
_CHECK_ABOVE_BYTES = 1 << 28
_UNLIMITED_CGROUP = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def check_weights_fit(q: Tensor, src_len: int, plan, *, symbolic: bool = True) -> None:
    """Raise ``torch.OutOfMemoryError`` if the weights path ``plan`` for ``q`` ``(B, H, L, D)`` cannot fit.

    ``src_len`` is the number of keys (appended ``bias_k``/zero-attention tokens included); ``plan``
    is the path the call takes (``_explicit_attention.plan_weights_path``), so the estimate counts
    what that very path holds. ``symbolic=False`` (``is_symbolic_call`` said so) skips asking
    whether a graph is being captured, which it would have ruled out.
    """
    if symbolic and is_capturing_graph():  # symbolic or recorded sizes: no allocation here
        return
    head_maps = q.numel() // q.size(-1) * src_len * q.element_size()  # bytes of one (B, H, L, S) tensor
    if 2 * head_maps + head_maps // q.size(1) < _CHECK_ABOVE_BYTES:  # the most any path below holds
        return
    needed, what = weights_path_bytes(q, src_len, plan)
    if needed >= _CHECK_ABOVE_BYTES:
        _refuse_if_too_large(q, src_len, needed, what)


def below_checked_size(batch: int, heads: int, tgt_len: int, src_len: int, itemsize: int) -> bool:
    """Whether weights without a graph for these sizes are too small to check: every head's scores
    and their average, held at once, stay below :data:`_CHECK_ABOVE_BYTES`, so one pass always runs."""
    return batch * (heads + 1) * tgt_len * src_len * itemsize < _CHECK_ABOVE_BYTES


def weights_path_bytes(q: Tensor, src_len: int, plan) -> tuple[int, str]:
    """Bytes of the ``L x S``-sized tensors the weights path ``plan`` holds at once for ``q``
    ``(B, H, L, D)`` and ``src_len`` keys, in ``q``'s dtype, and what they are (the table above)."""
    B, H, L, _ = q.shape
    S, itemsize = src_len, q.element_size()
    head_maps, averaged = B * H * L * S * itemsize, B * L * S * itemsize
    average_text = f"and their average, (B, L, S) = {(B, L, S)}"
    if plan.functional:  # the average is taken once the scores are freed: it never adds to the two
        return 2 * head_maps, f"scores and probabilities, each (B, H, L, S) = {(B, H, L, S)}"
    if not plan.average:
        return head_maps, f"the weights, (B, H, L, S) = {(B, H, L, S)}"
    rows = plan.rows
    if rows < L:  # a block's average is written to a temporary, then copied into the weights
        block = f"one block of scores, (B, H, rows, S) = {(B, H, rows, S)}, and its average"
        block_bytes = B * (H + 1) * rows * S * itemsize
        return averaged + block_bytes, f"the averaged weights, (B, L, S) = {(B, L, S)}, {block}"
    return head_maps + averaged, f"the scores of every head, (B, H, L, S) = {(B, H, L, S)}, {average_text}"


def rows_per_block(q: Tensor, src_len: int) -> int:
    """Query rows that averaged weights without a graph compute at once for ``q`` ``(B, H, L, D)``:
    all ``L`` (one pass) wherever that fits in the memory this process can get, else blocks as
    equal as possible whose scores and the averaged weights take at most half of it (at least one
    row: :func:`check_weights_fit` then refuses what even that cannot fit)."""
    B, H, L, _ = q.shape
    if below_checked_size(B, H, L, src_len, q.element_size()) or is_capturing_graph() or not _allocates(q):
        return L
    itemsize = _result_dtype(q).itemsize
    averaged = B * L * src_len * itemsize
    available, _ = available_bytes(q.device)
    if available is None or B * H * L * src_len * itemsize + averaged <= available:
        return L
    row_bytes = B * (H + 1) * src_len * itemsize  # one query row of every head's scores and their average
    most = max(1, (available // 2 - averaged) // max(row_bytes, 1))
    blocks = -(-L // most)  # as few as the budget allows, as equal as possible
    return min(L, -(-L // blocks))


def _allocates(q: Tensor) -> bool:
    """False for fake, meta and subclass tensors, which allocate elsewhere or not at all."""
    return type(q) is Tensor and q.device.type in ("cpu", "cuda")


def _result_dtype(q: Tensor) -> torch.dtype:
    """The dtype of the scores: q's, or autocast's where its matmuls produce a narrower one."""
    if torch.is_autocast_enabled(q.device.type):
        autocast_dtype = torch.get_autocast_dtype(q.device.type)
        if autocast_dtype.itemsize < q.dtype.itemsize:
            return autocast_dtype
    return q.dtype


def _refuse_if_too_large(q: Tensor, src_len: int, needed: int, what: str) -> None:
    if not _allocates(q):
        return
    dtype = _result_dtype(q)
    needed = needed * dtype.itemsize // q.element_size()
    available, source = available_bytes(q.device)
    if available is None or needed <= available:
        return
    raise torch.OutOfMemoryError(
        f"need_weights=True: attention weights over {q.shape[2]:,} queries and {src_len:,} keys need at least "
        f"{_format_bytes(needed)} ({what}, {str(dtype).removeprefix('torch.')}), more than this process "
        f"can get ({_format_bytes(max(available, 0))}, {source}); pass need_weights=False, which never "
        "materialises them and keeps memory linear in the number of tokens, or attend over fewer tokens"
    )


def available_bytes(device: torch.device) -> tuple[int | None, str]:
    """The most memory a new allocation on ``device`` can get, and what limits it (``None``: unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, f"free memory on {device}"
    if device.type != "cpu":
        return None, "unknown"
    limits = [
        (_address_space_left(), "the address space left under RLIMIT_AS"),
        (_cgroup_headroom(), "the headroom under the cgroup memory limit"),
        (_system_available(), "MemAvailable in /proc/meminfo"),
    ]
    known = [limit for limit in limits if limit[0] is not None]
    return min(known) if known else (None, "unknown")


def _address_space_left() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as statm:
            return soft - int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError):
        return None


def _read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes, by field name."""
    fields = {}
    with open(path) as meminfo:
        for line in meminfo:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def _system_available(
    meminfo_path: str = "/proc/meminfo", overcommit_path: str = "/proc/sys/vm/overcommit_memory"
) -> int | None:
    try:
        fields = _read_meminfo(meminfo_path)
        with open(overcommit_path) as overcommit:
            strict = overcommit.read().strip() == "2"
    except (OSError, ValueError):
        return None
    if strict and "CommitLimit" in fields and "Committed_AS" in fields:
        return fields["CommitLimit"] - fields["Committed_AS"]
    if "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


def _cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Least ``limit - usage + file cache`` over this process's memory cgroup and its ancestors.

    Usage counts the page cache, and the kernel reclaims all of it, active and inactive, before it
    refuses an allocation, so both lists count as headroom (shared memory is not on them).
    """
    try:
        with open(proc_cgroup) as cgroups:
            lines = cgroups.read().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2
            base, files = root, ("memory.max", "memory.current", ("active_file", "inactive_file"))
        elif "memory" in controllers.split(","):  # v1
            base, files = (
                os.path.join(root, "memory"),
                ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file")),
            )
        else:
            continue
        headrooms += _headrooms_along(base, path, *files)
    return min(headrooms) if headrooms else None


def _headrooms_along(base: str, path: str, limit_file: str, usage_file: str, cache_keys: tuple[str, ...]) -> list[int]:
    """Headroom of every cgroup directory from ``base/path`` up to ``base`` that sets a limit.

    Inside a cgroup namespace ``path`` may not exist under ``base`` (``base`` is then the process's
    own cgroup), so missing directories are skipped.
    """
    parts = [part for part in path.split("/") if part]
    headrooms = []
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(base, *parts[:depth])
        try:
            with open(os.path.join(directory, limit_file)) as file:
                text = file.read().strip()
            if text == "max" or int(text) >= _UNLIMITED_CGROUP:
                continue
            with open(os.path.join(directory, usage_file)) as file:
                usage = int(file.read())
        except (OSError, ValueError):
            continue
        stat = os.path.join(directory, "memory.stat")
        headrooms.append(int(text) - usage + sum(_stat_field(stat, key) for key in cache_keys))
    return headrooms


def _stat_field(path: str, key: str) -> int:
    try:
        with open(path) as stat:
            for line in stat:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _format_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"
