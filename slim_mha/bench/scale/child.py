"""A scale case's own process: build the contender, time its calls, measure its peak memory above
the baseline, and cap its address space (CPU)."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ..._memory import available_bytes
from ...attention import SlimMultiheadAttention
from ..measure.allocator import minor_faults
from .cases import (
    DTYPES,
    OOM_MESSAGES,
    PADDED_FRACTION,
    RESULT_MARKER,
    Series,
    Settings,
)

__all__ = ["PeakMemory", "cap_address_space", "default_memory_cap", "main", "measure_case"]


def measure_case(series: Series, tokens: int, settings: Settings) -> dict:
    """Run one case in this process and return its measurement (called in the child)."""
    device = torch.device(settings.device)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.memory_cap_bytes is not None and device.type == "cpu":
        cap_address_space(settings.memory_cap_bytes)
    try:
        step, reset, stock_path = _build_step(series, tokens, settings, device)
        peak = PeakMemory(device)
        times, faults = _time_calls(step, reset, device)
        return {
            "status": "ok",
            "time_s": statistics.median(times),
            "times_s": times,
            "faults_per_call": faults,
            "peak_bytes": peak.above_baseline(),
            "stock_path": stock_path,
        }
    except Exception as error:  # noqa: BLE001 - anything else is recorded as an error, below
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        oom = isinstance(error, (MemoryError, torch.OutOfMemoryError)) or any(
            text in message.lower() for text in OOM_MESSAGES
        )
        return {"status": "oom" if oom else "error", "detail": f"{type(error).__name__}: {message}"[:300]}


def _build_step(series: Series, tokens: int, settings: Settings, device: torch.device):
    """The timed step, its untimed reset, and which path stock took (after a small warm-up call)."""
    dtype = DTYPES[settings.dtype]
    torch.manual_seed(settings.seed)
    E, H = series.embed_dim, series.num_heads
    module = nn.MultiheadAttention(E, H, batch_first=True, device=device, dtype=dtype)
    with torch.no_grad():  # trained-looking biases, the key slice included
        module.in_proj_bias.normal_(std=0.1)
        module.out_proj.bias.normal_(std=0.1)
    if series.contender == "slim":
        slim = SlimMultiheadAttention(E, H, batch_first=True, device=device, dtype=dtype)
        slim.load_state_dict(module.state_dict())
        module = slim
    training = series.mode == "train"
    module.train(training)

    def inputs(length: int):
        generator = torch.Generator(device="cpu").manual_seed(settings.seed + 1)
        x = torch.randn(settings.batch, length, E, generator=generator).to(device, dtype)  # (B, N, E)
        mask = None
        if series.padding_mask:
            mask = torch.zeros(settings.batch, length, dtype=torch.bool, device=device)  # (B, N)
            mask[:, length - max(1, length // PADDED_FRACTION) :] = True
        return x.requires_grad_(training), mask

    def step_on(x, mask):
        if training:
            out, _ = module(x, x, x, key_padding_mask=mask, need_weights=False)
            out.backward(torch.ones_like(out))
        else:
            with torch.inference_mode():
                module(x, x, x, key_padding_mask=mask, need_weights=False)

    def reset():
        for tensor in [*module.parameters(), x]:
            tensor.grad = None

    small = inputs(min(tokens, 64))
    stock_path = _warm_up_and_name_path(lambda: step_on(*small), series)
    x, mask = inputs(tokens)
    return (lambda: step_on(x, mask)), reset, stock_path


def _warm_up_and_name_path(step, series: Series) -> str | None:
    """One small call (kernels, thread pools); for stock at inference, whether it took its fast path."""
    if series.contender != "stock" or series.mode != "inference":
        step()
        return None
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    names = {event.key for event in profiler.key_averages()}
    return "native fast path" if "aten::_native_multi_head_attention" in names else "Python path"


def _time_calls(
    step, reset, device: torch.device, *, min_total_s: float = 1.0, max_calls: int = 5
) -> tuple[list[float], list[int]]:
    """Seconds of each call, and its minor page faults: at large N the first call maps all of its
    memory, and with one call timed that cost is in the time (the faults say how much)."""
    times: list[float] = []
    faults: list[int] = []
    while len(times) < max_calls and sum(times) < min_total_s:
        reset()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        before = minor_faults()
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
        faults.append(minor_faults() - before)
    return times, faults


def main() -> None:
    """Entry point of a case's process: argv[1] is the case as JSON; prints one result line."""
    spec = json.loads(sys.argv[1])
    result = measure_case(Series(**spec["series"]), spec["tokens"], Settings(**spec["settings"]))
    print(RESULT_MARKER + json.dumps(result), flush=True)


def cap_address_space(cap_bytes: int) -> None:
    """Let this process map at most ``cap_bytes`` more than it has mapped now."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + cap_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))


class PeakMemory:
    """Peak memory from here on, above what is in use now."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline: int | None = torch.cuda.memory_allocated(device)
            return
        self.baseline = _status_bytes("VmRSS")
        try:  # reset the high-water mark to the current resident size (Linux 4.0+)
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            pass

    def above_baseline(self) -> int | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - (self.baseline or 0)
        peak = _status_bytes("VmHWM")
        return None if peak is None or self.baseline is None else max(0, peak - self.baseline)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_memory_cap() -> int | None:
    """Half the memory available now (``MemAvailable``, cgroup and ``RLIMIT_AS`` headroom)."""
    available, _ = available_bytes(torch.device("cpu"))
    return None if available is None else available // 2
