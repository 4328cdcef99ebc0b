"""The checker at point-cloud scale: a set block over 50,000 points checked in bounded memory (issue 17).

The check runs the block twice (original and permuted points). With ``need_weights=False`` slim
attention never holds the ``(N, N)`` scores, so the check's peak memory grows with N, not N²: one
head's float32 scores alone would take N² x 4 bytes, 9.3 GiB at N = 50,000.

The measurement runs in a fresh interpreter, so that the peak resident set size (``ru_maxrss``)
before the check is this process's own and not the test session's.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import slim_mha

POINTS, WIDTH, HEADS = 50_000, 64, 4


class SetBlock(nn.Module):
    """Linear -> self-attention -> MLP, residual: the block of a point-cloud/set transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, WIDTH)
        self.attention = slim_mha.SlimMultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(
            nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:  # (B, N, 3) -> (B, N, WIDTH)
        h = self.embed(xyz)
        h = h + self.attention(h, h, h, need_weights=False)[0]
        return h + self.mlp(h)


def measure(points: int) -> dict:
    """Check a seeded block on ``points`` points; the peak RSS growth (bytes) and time it took."""
    torch.manual_seed(0)
    block = SetBlock()
    xyz = torch.randn(1, points, 3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        block(xyz[:, :256])  # first-call allocations out of the measurement
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    start = time.perf_counter()
    result = slim_mha.assert_permutation_equivariant(block, xyz, dim=1)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(points=points, peak_growth=after - before, seconds=seconds, max_rel=result.max_rel)


@pytest.mark.slow  # two attention passes over 50k points: minutes on a loaded 2-core machine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux only")
def test_a_point_cloud_set_block_of_50k_points_is_checked_in_bounded_memory():
    completed = subprocess.run([sys.executable, __file__, str(POINTS)], capture_output=True, text=True, timeout=1800)
    assert completed.returncode == 0, completed.stderr
    measured = json.loads(completed.stdout.strip().splitlines()[-1])
    one_head_of_scores = POINTS**2 * 4  # float32 (N, N): 9.3 GiB
    assert measured["peak_growth"] < one_head_of_scores / 16, measured  # measured: ~0.1 GiB
    assert measured["max_rel"] < 1e-4  # it passed, within float32's tolerance
    print(
        f"\n{POINTS} points: checked in {measured['seconds']:.1f} s, peak RSS +{measured['peak_growth'] / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))))
