"""Running one case: check the contenders agree, measure their memory, then time them interleaved."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..measure.allocator import (
    allocator_state,
    prepare_cold_call,
    settle,
)
from ..measure.environment import load_average
from ..measure.memory import (
    adam_state_bytes,
    parameter_bytes,
    profile_step,
    saved_tensor_bytes,
    took_native_fast_path,
)
from ..measure.timing import Settings, measure, paired_summary
from .cases import Case
from .contenders import Contender, build_contenders, output_error, slim_variants

__all__ = ["TOLERANCE", "CaseOptions", "run_case", "time_interleaved"]

# Relative error ‖slim − stock‖ / ‖stock‖ above which a case is flagged: the two compute the same
# function, so anything past a few roundings of the dtype is a bug, not noise.
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 5e-3, "bf16-autocast": 3e-2}

_adam_cache: dict[tuple, int] = {}


def _state_bytes(case: Case, name: str, parameters) -> int:
    key = (case.embed_dim, case.dtype, name, str(parameters[0].device))
    if key not in _adam_cache:
        _adam_cache[key] = adam_state_bytes(parameters)
    return _adam_cache[key]


@dataclass(frozen=True)
class CaseOptions:
    """What a run asks of every case beyond the case itself.

    ``compile_backend``: stock and slim each under ``torch.compile`` with it, their graph breaks
    counted first. ``one_pass`` and ``blocks``: slim also timed on those paths (``slim_variants``).
    """

    equivariance_every: int | None = None
    compile_backend: str | None = None
    one_pass: bool = False
    blocks: int = 0


def run_case(case: Case, device: torch.device, settings: Settings, options: CaseOptions = CaseOptions()) -> dict:
    """Everything measured for one case, as a JSON-ready dict."""
    load_before, started = load_average(), time.perf_counter()
    contenders = build_contenders(
        case,
        device,
        seed=settings.seed,
        equivariance_every=options.equivariance_every,
        compile_backend=options.compile_backend,
    )
    variants = slim_variants(contenders["slim"], case, one_pass=options.one_pass, blocks=options.blocks)
    contenders.update(variants)
    errors = _relative_errors(case, contenders)
    memory, stock_ops = _measure_memory(case, contenders, device)
    against_stock = tuple(("stock", name) for name in ("slim", *variants))
    timed = time_interleaved(
        contenders,
        device,
        settings,
        ratios=(*against_stock, ("slim", "floor"), ("stock", "floor")),
        spreads=(*against_stock, ("slim", "floor")),
    )
    return {
        "case": case.as_dict(),
        "name": case.name,
        "target_shape": case.is_target,
        "stock_path": "native fast path" if took_native_fast_path(stock_ops) else "python path",
        "floor_kind": contenders["floor"].kind,
        "relative_error": errors,
        "agrees": max(errors.values()) <= TOLERANCE[case.dtype],
        **timed,
        "memory": memory,
        **(
            {
                "compile_backend": options.compile_backend,
                "graph_breaks": {name: c.graph_breaks for name, c in contenders.items() if c.graph_breaks is not None},
            }
            if options.compile_backend
            else {}
        ),
        # 1-minute load average before and after: above the core count, other processes shared the
        # CPU and the timings are noisier (interleaving keeps the ratios fair, not the spread small).
        "load_average": [load_before, load_average()],
        "elapsed_s": time.perf_counter() - started,
    }


def time_interleaved(
    contenders: dict[str, Contender],
    device: torch.device,
    settings: Settings,
    *,
    ratios: tuple[tuple[str, str], ...],
    spreads: tuple[tuple[str, str], ...] = (),
) -> dict:
    """The contenders timed interleaved with the allocator warm, then (CPU) cold; for each ``(a, b)``
    in ``ratios`` the ratio ``a_over_b``.

    * ``time`` and ``ratios``: warm allocator, no page faulted per call: the compute ratio. A ratio is
      the ratio of the two median times, so it always agrees with the milliseconds printed beside it.
    * ``paired_ratios``: for the ``spreads`` pairs, the median and quartiles of the ratio within one
      repeat (the contenders of a repeat ran back to back, so drift and bursts of load cancel in it).
    * ``cold`` and ``cold_ratios`` (CPU, ``settings.cold_repeats`` > 0): every call faults its memory
      in anew; the median time and minor page faults per call show what each contender's memory
      traffic costs.
    """
    steps = {name: (c.step, c.reset) for name, c in contenders.items()}
    result: dict = {"allocator_controlled": None}
    if device.type == "cpu" and settings.cold_repeats:
        with allocator_state("cold") as controlled:
            cold_settings = replace(settings, repeats=settings.cold_repeats, min_repeats=settings.cold_repeats)
            cold = measure(
                {name: (step, _then_cold(reset)) for name, (step, reset) in steps.items()}, device, cold_settings
            )
        result["cold"] = {
            name: {"median_ms": s.median_ms, "faults_per_call": s.faults_per_call} for name, s in cold.items()
        }
        result["cold_ratios"] = {f"{a}_over_{b}": cold[a].median_ms / cold[b].median_ms for a, b in ratios}
    with allocator_state("warm") as controlled:
        for step, reset in steps.values():
            settle(step, reset)
        timings = measure(steps, device, settings)
    result["allocator_controlled"] = controlled
    # Stalls (timing.py): which contenders' medians are still stalls after a re-measure; no ratio is
    # printed for such a case.
    result["remeasured"] = any(summary.remeasured for summary in timings.values())
    result["stalled"] = sorted(name for name, summary in timings.items() if summary.stalled)
    samples = {name: summary.samples_ms for name, summary in timings.items()}
    result["time"] = {name: summary.as_dict() for name, summary in timings.items()}
    result["ratios"] = {f"{a}_over_{b}": timings[a].median_ms / timings[b].median_ms for a, b in ratios}
    result["paired_ratios"] = {f"{a}_over_{b}": paired_summary(samples[a], samples[b]) for a, b in spreads}
    return result


def _then_cold(reset: Callable[[], None]) -> Callable[[], None]:
    def reset_cold() -> None:
        reset()
        prepare_cold_call()

    return reset_cold


def _relative_errors(case: Case, contenders: dict) -> dict[str, float]:
    """Each contender's relative error against stock, from one untimed call each."""
    outputs = {}
    for name, contender in contenders.items():
        contender.reset()
        if case.trains:
            outputs[name] = contender.forward()
        else:
            with torch.inference_mode():
                outputs[name] = contender.forward()
    return {name: output_error(outputs["stock"], outputs[name]) for name in outputs if name != "stock"}


def _measure_memory(case: Case, contenders: dict, device: torch.device) -> tuple[dict, list[str]]:
    """Per contender: peak and allocated bytes, aten calls, (training) bytes saved for backward,
    parameter and Adam bytes; and the aten ops stock ran. Gradients are reset around each step."""
    memory: dict[str, dict] = {}
    stock_ops: list[str] = []
    for name, contender in contenders.items():
        contender.reset()
        profiled = profile_step(contender.step, device)
        contender.reset()
        saved = saved_tensor_bytes(contender.step, contender.parameters + contender.external) if case.trains else None
        contender.reset()
        if name == "stock":
            stock_ops = profiled.op_names
        memory[name] = {
            "peak_bytes": profiled.peak_bytes,
            "allocated_bytes": profiled.allocated_bytes,
            "aten_calls": profiled.op_calls,
            "saved_bytes": saved,
            "parameter_bytes": parameter_bytes(contender.parameters),
            "adam_state_bytes": _state_bytes(case, name, contender.parameters),
        }
    return memory, stock_ops
