"""The DETR case of the benchmark (slim_mha/bench/detr/layer.py) at a tiny size: what it prints and records.

Its weights-path counts are tested in tests/test_unread_weights.py.
Never timings: only that they were taken, interleaved, with their paired ratios.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from slim_mha.bench import __main__ as bench
from slim_mha.bench.detr.layer import (
    CONTENDERS,
    DetrShape,
    format_detr,
    format_detr_lines,
    run_detr,
)
from slim_mha.bench.measure.timing import Settings

TINY = DetrShape(queries=4, memory=9, embed_dim=8, heads=2, batch=2, feedforward=8)
SETTINGS = Settings(repeats=3, min_repeats=3, warmup=0, min_sample_s=0.0, max_case_s=5.0)


def test_a_tiny_run_records_paired_ratios_memory_and_prints_no_profiler_chatter(capfd):
    payload = run_detr(SETTINGS, torch.device("cpu"), modes=("inference", "train"), shape=TINY)
    table = format_detr(payload)
    printed = capfd.readouterr()
    assert "profiler_start" not in printed.out + printed.err and "USDT" not in printed.out + printed.err
    for result in payload["modes"]:
        samples = {name: result["time"][name]["samples_ms"] for name in CONTENDERS}
        assert all(len(times) == 3 for times in samples.values())  # one sample per repeat, each contender
        for key, (numerator, denominator) in {
            "slim_over_slim_skip": ("slim", "slim_skip"),
            "stock_over_slim_skip": ("stock", "slim_skip"),
        }.items():
            ratios = sorted(a / b for a, b in zip(samples[numerator], samples[denominator]))
            medians = statistics.median(samples[numerator]) / statistics.median(samples[denominator])
            assert result["ratios"][key] == medians  # agrees with the ms columns
            paired = result["paired_ratios"][key]
            assert paired["median"] == ratios[1]  # the median of the per-repeat ratios, named as such
            assert ratios[0] <= paired["quartiles"][0] <= paired["quartiles"][1] <= ratios[2]
        for name in CONTENDERS:
            memory = result["memory"][name]
            assert memory["peak_bytes"] > 0 and memory["allocated_bytes"] >= memory["peak_bytes"]
            assert (memory["saved_bytes"] is None) == (result["mode"] == "inference")
    assert "| inference |" in table and "| train (attn dropout 0.1) |" in table
    assert "| - / - / - |" in table  # inference saves nothing for backward
    lines = format_detr_lines(payload)  # what the terminal shows: short lines
    assert "inference:" in lines and "train (attn dropout 0.1):" in lines
    assert max(len(line) for line in lines.splitlines()) < 120


def test_the_detr_subcommand_refuses_matrix_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["detr", "--mode", "train"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --mode train" in capsys.readouterr().err
