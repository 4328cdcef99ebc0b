"""The sweep: every case in a fresh process, in the order and within the budgets of ``cases``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ..measure.environment import load_averages
from .cases import OOM_MESSAGES, RESULT_MARKER, Series, Settings

__all__ = ["run_sweep"]


def _run_child(series: Series, tokens: int, settings: Settings) -> dict:
    """Run one case in a fresh process; a crash, kill or timeout becomes a result, never an exception."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    spec = json.dumps({"series": asdict(series), "tokens": tokens, "settings": asdict(settings)})
    command = [sys.executable, "-c", "from slim_mha.bench.scale.child import main; main()", spec]
    started = time.perf_counter()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=settings.case_timeout_s)
    except subprocess.TimeoutExpired:
        return {
            "status": "timeout",
            "detail": f"no result after {settings.case_timeout_s:.0f} s (killed)",
            "wall_s": time.perf_counter() - started,
        }
    wall = time.perf_counter() - started
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return {**json.loads(line[len(RESULT_MARKER) :]), "wall_s": wall}
    if completed.returncode < 0:
        status, detail = "killed", f"killed by signal {-completed.returncode} (out of memory?)"
    else:
        last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        oom = any(text in last.lower() for text in OOM_MESSAGES)
        status, detail = ("oom" if oom else "error"), f"exit code {completed.returncode}: {last[:300]}"
    return {"status": status, "detail": detail, "wall_s": wall}


def _extrapolated(points: list[tuple[int, float]], tokens: int) -> float | None:
    """The value at ``tokens`` from the slope of the last two points in log-log, held between 1 and 2."""
    points = [(n, value) for n, value in points if value > 0]
    if not points:
        return None
    n_last, last = points[-1]
    slope = 2.0
    if len(points) >= 2:
        n_previous, previous = points[-2]
        slope = min(2.0, max(1.0, math.log(last / previous) / math.log(n_last / n_previous)))
    return last * (tokens / n_last) ** slope


def _over_time_budget(measured: list[dict], tokens: int, settings: Settings) -> str | None:
    """Why the curve should stop before ``tokens`` for time, or ``None``.

    A case that may need more memory than the cap (its peak grown quadratically from the last point)
    is run all the same: it fails at its first large allocation, at once, and that failure is the
    point the sweep is there to record.
    """
    if not measured:
        return None
    # Quadratic from the last point: an upper bound (the scores are N x N at most), where the local
    # slope would underestimate, as fixed costs flatten the small-N end of stock's curve.
    last_peak = measured[-1]["peak_bytes"] or 0
    memory = last_peak * (tokens / measured[-1]["tokens"]) ** 2
    if settings.memory_cap_bytes is not None and memory is not None and memory > settings.memory_cap_bytes:
        return None
    last = measured[-1]
    if last["time_s"] > settings.case_budget_s:
        return f"stopped after N={last['tokens']:,}: it took {last['time_s']:.0f} s > case budget {settings.case_budget_s:.0f} s"
    # From two points at least: a single small-N time is mostly fixed costs, and squaring it from
    # there would stop curves that have minutes to go (the case timeout still bounds a wrong guess).
    predicted = _extrapolated([(r["tokens"], r["time_s"]) for r in measured], tokens) if len(measured) >= 2 else None
    if predicted is not None and predicted > settings.case_budget_s:
        return (
            f"stopped before N={tokens:,}: extrapolated {predicted:.0f} s > case budget {settings.case_budget_s:.0f} s"
        )
    return None


def _stop_for_time(stops: dict, series: Series, measured: list[dict], tokens: int, settings: Settings) -> bool:
    reason = _over_time_budget(measured, tokens, settings)
    if reason is not None:
        stops[series] = reason
    return reason is not None


def run_sweep(
    series_list: list[Series], tokens: list[int], settings: Settings, *, lead: int = 0, on_case=None, run_case=None
) -> dict:
    """Every (N, series) case, stock and slim side by side; returns the cases and why curves stopped.

    The first ``lead`` curves run over every N first, then the rest in order of N, so that a short
    budget still follows the leading configuration to its limits. ``run_case(series, tokens,
    settings)`` returns a case's result (default: measured in a child process).
    """
    run_case = run_case or _run_child
    started = time.perf_counter()
    cases: list[dict] = []
    stops: dict[Series, str] = {}
    measured: dict[Series, list[dict]] = {series: [] for series in series_list}
    order = [
        (n, series) for group in (series_list[:lead], series_list[lead:]) for n in sorted(tokens) for series in group
    ]
    for n, series in order:
        record = {"series": asdict(series), "name": series.name, "tokens": n, "batch": settings.batch}
        if series not in stops and time.perf_counter() - started > settings.budget_s:
            record.update(status="skipped", detail=f"not run: the sweep budget of {settings.budget_s:.0f} s was spent")
        elif series in stops or _stop_for_time(stops, series, measured[series], n, settings):
            record.update(status="skipped", detail=stops[series])
        else:
            record["load_average"] = load_averages()
            record.update(run_case(series, n, settings))
            if record["status"] == "ok":
                measured[series].append(record)
            else:
                stops[series] = (
                    f"{record['status'].upper() if record['status'] == 'oom' else record['status']} at N={n:,}"
                )
        cases.append(record)
        if on_case is not None:
            on_case(record)
    return {
        "cases": cases,
        "stops": {series.name: reason for series, reason in stops.items()},
        "elapsed_s": time.perf_counter() - started,
    }
