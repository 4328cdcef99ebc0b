"""Interleaved timing: every repeat times each contender once, in a fresh random order.

Round-robin repeats put the three contenders under the same drift (thermal state, a noisy
neighbour, the allocator's state), and shuffling the order within a repeat cancels the advantage
of always running first or last. A sample is ``inner`` consecutive calls, each timed on its own so
that the untimed ``reset`` (clearing gradients) can run between them; ``inner`` is chosen once per
case so that a sample lasts at least ``min_sample_s``. On CUDA each call is bracketed by CUDA events
and the sample is read after one synchronize; on CPU by ``time.perf_counter``. Each sample also
counts the process's minor page faults over its calls (``getrusage``): memory the allocator had to
map afresh, which the allocator's state decides (``allocator.py``).

**Stalls.** A shared machine can stop the process for whole scheduler slices (tens of ms) inside a
call that takes a tenth of one, and a case whose samples caught them would print a ratio of stalls.
Each contender's samples are held against the fastest call it was seen to make (its warm-up calls
and every sample): a sample over :data:`STALL_FACTOR` times that is a stall. A case with a stalled
sample is measured once more; if a contender's median is still a stall there, the case is flagged
(``Summary.stalled``) and the reports print no ratio for it.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from .allocator import minor_faults

__all__ = ["STALL_FACTOR", "Settings", "Summary", "measure", "median_of_ratios", "paired_summary", "summarize"]

# A sample this many times slower per call than the contender's fastest call was stalled: run to run
# a quiet or busy 2-core machine stays within 2x, and a scheduler slice stolen from a 0.1 ms call
# makes it hundreds of times slower.
STALL_FACTOR = 3.0


@dataclass(frozen=True)
class Settings:
    repeats: int = 15
    min_repeats: int = 5
    warmup: int = 2
    min_sample_s: float = 0.02
    max_case_s: float = 6.0  # stop adding repeats (past min_repeats) once a case has run this long
    seed: int = 0
    cold_repeats: int = 5  # repeats with the allocator cold (CPU), after the warm-up; 0: none


@dataclass(frozen=True)
class Summary:
    """Per-call times in milliseconds over the repeats."""

    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    max_ms: float
    samples_ms: list[float]
    calls_per_sample: int
    faults_per_call: float  # median over the samples of minor page faults per call
    best_ms: float = 0.0  # the fastest call seen: a warm-up call or a sample's per-call time
    remeasured: bool = False  # a sample stalled, so the case was measured again
    stalled: bool = False  # still stalled after that: the median is not a measurement

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q3_ms - self.q1_ms) / self.median_ms if self.median_ms else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "iqr_over_median": self.spread}


def summarize(samples_s: list[float], calls_per_sample: int, faults: list[int] | None = None) -> Summary:
    ms = [sample * 1e3 for sample in samples_s]
    if len(ms) >= 2:
        q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    else:
        q1 = q3 = ms[0]
    per_call = statistics.median(count / calls_per_sample for count in faults) if faults else 0.0
    return Summary(statistics.median(ms), q1, q3, min(ms), max(ms), ms, calls_per_sample, per_call)


class _Clock:
    """Seconds spent in ``step`` over a sample of calls, on the device that runs them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sample(self, step: Callable[[], None], reset: Callable[[], None], calls: int) -> tuple[float, int]:
        """Seconds in ``step`` over ``calls`` calls, and the minor page faults taken inside them."""
        faults = 0
        if self.cuda:
            pairs = []
            for _ in range(calls):
                reset()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before = minor_faults()
                start.record()
                step()
                end.record()
                faults += minor_faults() - before
                pairs.append((start, end))
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in pairs) / 1e3, faults
        total = 0.0
        for _ in range(calls):
            reset()
            before = minor_faults()
            begin = time.perf_counter()
            step()
            total += time.perf_counter() - begin
            faults += minor_faults() - before
        return total, faults


def measure(
    contenders: dict[str, tuple[Callable[[], None], Callable[[], None]]],
    device: torch.device,
    settings: Settings,
) -> dict[str, Summary]:
    """Time ``{name: (step, reset)}`` interleaved; returns per-call summaries by name."""
    clock = _Clock(device)
    order = list(contenders)
    shuffle = random.Random(settings.seed)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside one contender's sample is drift that interleaving cannot cancel
    try:
        first_calls: dict[str, list[float]] = {name: [] for name in order}
        for _ in range(max(1, settings.warmup)):
            for name in order:
                step, reset = contenders[name]
                first_calls[name].append(clock.sample(step, reset, 1)[0])
        slowest_call = max(min(times) for times in first_calls.values())
        calls = max(1, math.ceil(settings.min_sample_s / max(slowest_call, 1e-9)))
        best = {name: min(times) for name, times in first_calls.items()}

        def sample_round() -> tuple[dict[str, list[float]], dict[str, list[int]]]:
            samples: dict[str, list[float]] = {name: [] for name in order}
            faults: dict[str, list[int]] = {name: [] for name in order}
            started = time.perf_counter()
            for repeat in range(settings.repeats):
                shuffle.shuffle(order)
                for name in order:
                    step, reset = contenders[name]
                    seconds, count = clock.sample(step, reset, calls)
                    samples[name].append(seconds / calls)
                    faults[name].append(count)
                out_of_time = time.perf_counter() - started > settings.max_case_s
                if out_of_time and repeat + 1 >= settings.min_repeats:
                    break
            for name, values in samples.items():
                best[name] = min(best[name], *values)
            return samples, faults

        samples, faults = sample_round()
        remeasured = any(value > STALL_FACTOR * best[name] for name, values in samples.items() for value in values)
        if remeasured:
            samples, faults = sample_round()
    finally:
        if gc_was_enabled:
            gc.enable()
    summaries = {}
    for name in contenders:
        summary = summarize(samples[name], calls, faults[name])
        stalled = summary.median_ms > STALL_FACTOR * best[name] * 1e3
        summaries[name] = replace(summary, best_ms=best[name] * 1e3, remeasured=remeasured, stalled=stalled)
    return summaries


def median_of_ratios(numerator: list[float], denominator: list[float]) -> float:
    """The median of the per-repeat ratios: each repeat's pair ran side by side."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def paired_summary(numerator: list[float], denominator: list[float]) -> dict:
    """The per-repeat ratios' median and first and third quartiles, as the JSON records them."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) >= 2 else ratios * 3
    return {"median": statistics.median(ratios), "quartiles": [low, high]}
