"""Memory of one step: bytes saved for backward, peak of allocations, parameter and Adam-state bytes.

* **Saved for backward** (training): every tensor that autograd packs during the forward passes
  through ``torch.autograd.graph.saved_tensors_hooks``. Bytes are counted per storage, once (q, k
  and v views of one projection are one buffer), and storages of parameters and of the caller's
  inputs are left out: they exist anyway. What remains is the activation memory the layer adds.
* **Peak** (all modes): on CUDA, ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``, minus what was allocated before the step. On CPU there is no such
  counter, so the step runs once under ``torch.profiler`` with ``profile_memory=True``, which records
  every allocation and free of the CPU allocator (kernel-internal workspaces included, which a
  tensor-level tracker would miss inside stock's fused native kernel); summing them in time order
  gives the live bytes, and their maximum is the peak the step adds on top of what existed before.
  The same run gives the total bytes allocated, which on CPU is fresh memory to fault in: on a
  machine where first touches are slow it explains much of a timing difference.
* **Parameters and Adam state**: bytes of the parameters, and of ``torch.optim.Adam``'s state after
  one step taken on copies of them (``exp_avg``, ``exp_avg_sq`` and ``step``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

__all__ = [
    "StepProfile",
    "adam_state_bytes",
    "parameter_bytes",
    "profile_step",
    "saved_tensor_bytes",
    "took_native_fast_path",
]

_NATIVE_FAST_PATH = "aten::_native_multi_head_attention"
# What the profiler's native code (Kineto) writes straight to the process's stdout/stderr on every
# start and stop, e.g. "USDT:2026-12-02 18:56:03 6332:6332 SyncActivityProfilerHandler.cpp:52] profiler_start",
# and the allocator's note when a block from before the start is freed during it. That free is left out
# as its allocation is, so the peak the events give is unaffected.
_PROFILER_CHATTER = re.compile(
    r"^(USDT|STAGE):|\] (profiler_start|profiler_stop|Completed Stage)"
    r"|\] Memory block of unknown size was allocated before the profiling started"
    # A CUDA build of torch on a machine without a GPU: the profiler's library probes for devices.
    r"|\] gpuGetDeviceCount failed with code"
)


@contextlib.contextmanager
def _profiler_chatter_silenced() -> Iterator[None]:
    """Capture file descriptors 1 and 2 (native code bypasses ``sys.stdout``) around a profiled step.

    Lines other than the profiler's own start/stop chatter are written back to stderr afterwards,
    so a real warning or error from inside the step is not lost.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    with tempfile.TemporaryFile() as sink:
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            _flush_c_streams()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for descriptor in saved:
                os.close(descriptor)
            sink.seek(0)
            kept = [
                line for line in sink.read().decode(errors="replace").splitlines() if not _PROFILER_CHATTER.search(line)
            ]
            if kept:
                print("\n".join(kept), file=sys.stderr)


def _flush_c_streams() -> None:
    """Flush C's stdio buffers, so that nothing native code printed lands after the descriptors are restored."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _storage_key(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def saved_tensor_bytes(step: Callable[[], None], external: list[Tensor]) -> int:
    """Unique bytes autograd saves during ``step``, other than the storages of ``external`` tensors."""
    excluded = {_storage_key(tensor) for tensor in external}
    seen: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(seen.values())


@dataclass(frozen=True)
class StepProfile:
    """What one profiled step allocated, and which aten ops it ran."""

    peak_bytes: int  # above what was live before the step
    allocated_bytes: int | None  # sum of every allocation (CPU only): fresh memory the step touched
    op_names: list[str]
    op_calls: int  # aten ops dispatched, nested ones included: a measure of per-call overhead


def profile_step(step: Callable[[], None], device: torch.device) -> StepProfile:
    """Run ``step`` once under the profiler (CPU activity: it names aten ops on either device)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with warnings.catch_warnings(), _profiler_chatter_silenced():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=not cuda) as profiler:
            step()
            if cuda:
                torch.cuda.synchronize(device)
    events = profiler.profiler.kineto_results.events()
    ops = [event.name() for event in events if event.name().startswith("aten::")]
    if cuda:
        return StepProfile(torch.cuda.max_memory_allocated(device) - before, None, sorted(set(ops)), len(ops))
    changes = sorted((event.start_ns(), event.nbytes()) for event in events if event.name() == "[memory]")
    live = peak = 0
    for _, change in changes:
        live += change
        peak = max(peak, live)
    allocated = sum(change for _, change in changes if change > 0)
    return StepProfile(peak, allocated, sorted(set(ops)), len(ops))


def took_native_fast_path(op_names: list[str]) -> bool:
    return _NATIVE_FAST_PATH in op_names


def parameter_bytes(parameters: list[Tensor]) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in parameters)


def adam_state_bytes(parameters: list[Tensor]) -> int:
    """Bytes of Adam's state for these parameters, measured on copies after one step."""
    copies = [parameter.detach().clone().requires_grad_() for parameter in parameters]
    for copy in copies:
        copy.grad = torch.zeros_like(copy)
    optimizer = torch.optim.Adam(copies)
    optimizer.step()
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, Tensor)
    )
