"""The benchmark's allocator control and page-fault counter (slim_mha/bench/measure/allocator.py). Never timings."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys

import pytest

from slim_mha.bench.measure import allocator

PAGE = mmap.PAGESIZE
GLIBC = allocator.describe_allocator()["controlled"]


def test_the_fault_counter_counts_fresh_pages():
    pages = 2048
    mapping = mmap.mmap(-1, pages * PAGE)  # anonymous: no page is resident until it is touched
    try:
        before = allocator.minor_faults()
        for offset in range(0, pages * PAGE, PAGE):
            mapping[offset] = 1
        faulted = allocator.minor_faults() - before
    finally:
        mapping.close()
    assert faulted >= pages // 2, faulted  # huge pages may serve some; never none


def test_touching_resident_pages_faults_nothing_new():
    mapping = mmap.mmap(-1, 256 * PAGE)
    try:
        for offset in range(0, 256 * PAGE, PAGE):
            mapping[offset] = 1
        before = allocator.minor_faults()
        for offset in range(0, 256 * PAGE, PAGE):
            mapping[offset] = 2
        assert allocator.minor_faults() - before < 64
    finally:
        mapping.close()


_COLD_AND_WARM = """
import json, torch
from slim_mha.bench.measure import allocator
from slim_mha.bench.measure.timing import Settings, measure

def step():  # a fresh 8 MiB tensor each call, written once: what a layer's activations do
    torch.empty(2 << 20, dtype=torch.float32).fill_(1.0)

settings = Settings(repeats=5, min_repeats=5, warmup=1, min_sample_s=0.0, max_case_s=10.0)
with allocator.allocator_state("cold") as controlled:
    cold = measure({"alloc": (step, allocator.prepare_cold_call)}, torch.device("cpu"), settings)["alloc"]
with allocator.allocator_state("warm"):
    settled_after = allocator.settle(step, lambda: None)
    warm = measure({"alloc": (step, lambda: None)}, torch.device("cpu"), settings)["alloc"]
print(json.dumps([controlled, cold.faults_per_call, warm.faults_per_call, settled_after]))
"""


@pytest.mark.skipif(not GLIBC, reason="the allocator states are set through glibc's mallopt")
def test_cold_faults_every_call_and_warm_none():
    """In a fresh process, so that the heap's history is this script's alone."""
    completed = subprocess.run([sys.executable, "-c", _COLD_AND_WARM], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    controlled, cold, warm, settled_after = json.loads(completed.stdout.strip().splitlines()[-1])
    assert controlled and settled_after < allocator.SETTLE_CALLS
    assert cold >= (8 << 20) // PAGE // 2, cold
    assert warm < 64, warm


def test_the_json_describes_the_allocator():
    description = allocator.describe_allocator()
    assert set(description) >= {"library", "controlled", "environment"}
    if description["controlled"]:
        assert description["library"].startswith("glibc ")
        assert description["warm"] == allocator.WARM and description["cold"]["M_MMAP_THRESHOLD"] == 65536


def test_an_unknown_state_is_refused():
    with pytest.raises(ValueError, match=r"^allocator state 'hot': choose 'warm' or 'cold'$"):
        with allocator.allocator_state("hot"):
            pass
