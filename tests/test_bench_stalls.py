"""The benchmark never prints a ratio of stalls: a stalled case is measured again, and flagged if it
still is (slim_mha/bench/measure/timing.py). The stalls are injected: a sleep inside timed calls."""

from __future__ import annotations

import time

import torch

from slim_mha.bench.matrix import report
from slim_mha.bench.matrix.runner import time_interleaved
from slim_mha.bench.measure.timing import STALL_FACTOR, Settings, measure

SETTINGS = Settings(repeats=5, min_repeats=5, warmup=2, min_sample_s=0.0, max_case_s=5.0, cold_repeats=0)
CPU = torch.device("cpu")
CALL_S = 0.002  # a sleep's own jitter on a busy machine stays well under STALL_FACTOR times this


def sleeper(stall_calls):
    """A step that takes CALL_S, and 40x longer on the calls ``stall_calls(n)`` picks (n counts from 0)."""
    count = [0]

    def step():
        time.sleep(CALL_S * 40 if stall_calls(count[0]) else CALL_S)
        count[0] += 1

    return step


def test_one_stalled_call_makes_the_case_measured_again_and_the_second_round_counts():
    stalls = measure(
        {"stock": (sleeper(lambda n: n == 4), lambda: None), "slim": (sleeper(lambda n: False), lambda: None)},
        CPU,
        SETTINGS,
    )
    assert stalls["stock"].remeasured and stalls["slim"].remeasured  # the whole case, interleaved again
    assert not stalls["stock"].stalled  # the second round's median is a measurement
    assert stalls["stock"].median_ms < STALL_FACTOR * stalls["stock"].best_ms


def test_a_case_that_stalls_again_is_flagged_and_prints_no_ratio():
    warmup = SETTINGS.warmup
    contenders = {
        "stock": (sleeper(lambda n: n >= warmup), lambda: None),  # every timed call stalls
        "slim": (sleeper(lambda n: False), lambda: None),
    }
    summaries = measure(contenders, CPU, SETTINGS)
    assert summaries["stock"].stalled and summaries["stock"].remeasured and not summaries["slim"].stalled
    assert summaries["stock"].as_dict()["stalled"] is True


def test_the_runner_records_stalls_and_the_reports_leave_them_out():
    class Fake:
        def __init__(self, step):
            self.step, self.reset = step, lambda: None

    result = time_interleaved(  # three calls of four stall, whatever the untimed calls before took
        {
            "stock": Fake(sleeper(lambda n: n % 4 != 0)),
            "slim": Fake(sleeper(lambda n: False)),
            "floor": Fake(sleeper(lambda n: False)),
        },
        CPU,
        SETTINGS,
        ratios=(("stock", "slim"), ("slim", "floor"), ("stock", "floor")),
        spreads=(("stock", "slim"), ("slim", "floor")),
    )
    assert result["stalled"] == ["stock"] and result["remeasured"]
    assert report.is_stalled(result)
    assert report.ratio_text(result, "stock_over_slim") == "stalled (stock): no ratio"
    result.update(
        name="case",
        case={"mode": "inference", "dtype": "fp32"},
        agrees=True,
        relative_error={"slim": 0.0},
        memory={name: {"peak_bytes": 1} for name in ("stock", "slim", "floor")},
    )
    speed = next(check for check in report.evaluate_targets([result], "cpu") if "fast" in check.target)
    assert speed.total == 0  # a stalled case is not judged
    assert "1 case(s) stalled even when measured again" in report.format_summary([result])


def test_the_profilers_device_probe_is_kept_out_of_the_output(capfd):
    """A CUDA build of torch without a GPU: the profiler's library prints its failed device probe."""
    import os

    from slim_mha.bench.measure.memory import _profiler_chatter_silenced, profile_step

    with _profiler_chatter_silenced():
        os.write(
            2, b"ERROR:2026-12-04 16:50:48 24322:24322 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n"
        )
        os.write(2, b"a warning of the step's own\n")
    x = torch.randn(8, 8)
    profile_step(lambda: x @ x, CPU)  # the real profiler, on whatever build this is
    err = capfd.readouterr().err
    assert "gpuGetDeviceCount" not in err and "a warning of the step's own" in err
