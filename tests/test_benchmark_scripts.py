"""The scripts in ``benchmarks/`` that record the project's figures still run against the benchmark's
helpers they import. Never timings: the figures belong in ``benchmarks/``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *arguments: str) -> subprocess.CompletedProcess:
    """``benchmarks/<name>`` run as its README says, with this checkout's slim_mha; fails on a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "benchmarks" / name), *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=env, check=True, timeout=600)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs this git checkout")
def test_the_smallest_calls_script_times_stock_then_and_now_in_every_case():
    result = run_script("smallest_calls_ab.py", "--against", "HEAD", "--repeats", "1")
    rows = [line for line in result.stdout.splitlines() if line.startswith("B=2 L=16 E=64 H=4")]
    assert len(rows) == 8, result.stdout  # inference and training, masked or not, weights or not
    for row in rows:
        ratios = re.findall(r"(stock|then)/now (\d+\.\d+)x", row)
        assert [name for name, _ in ratios] == ["stock", "then"], row
        assert all(float(value) > 0 for _, value in ratios), row
    assert "then: slim_mha at HEAD" in result.stdout


def test_the_small_cross_attention_script_times_every_contender_in_both_modes():
    result = run_script(
        "small_cross_attention.py", "--shape", "2x4x32x4", "--memory", "6", "--memory", "9", "--repeats", "1"
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("B=2 L=4 S=")]
    assert [row.split()[2] + " " + row.split()[5] for row in rows] == [
        f"S={memory} {mode}" for memory in (6, 9) for mode in ("inference", "train")
    ], result.stdout
    for row in rows:
        ratios = re.findall(r"stock/(slim|ops|own|function) (\d+\.\d+)x", row)
        assert [name for name, _ in ratios] == ["slim", "ops", "own", "function"], row
        assert all(float(v) > 0 for _, v in ratios), row


def test_the_small_cross_attention_script_takes_other_calls_and_the_batch_first_layout():
    """``--inputs qk``: the query is the key, so as many queries as keys; ``--batch-first`` says so."""
    result = run_script(
        "small_cross_attention.py", "--shape", "2x4x32x4", "--memory", "6", "--repeats", "1", "--inputs", "qk",
        "--batch-first",
    )  # fmt: skip
    rows = [line for line in result.stdout.splitlines() if line.startswith("B=2 ")]
    assert len(rows) == 2 and all(row.startswith("B=2 L=6 S=6 ") and "batch-first" in row for row in rows), rows
