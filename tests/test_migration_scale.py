"""Scale: the migration streams. Unchanged tensors are never read into memory, and peak memory stays
well under 1.5x the largest shard (the slow test measures it in a child process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from slim_mha.migration import fold_checkpoint, to_stock_checkpoint
from slim_mha.migration._records import TensorRecord

from _migration_checkpoints import (
    key_bias_free,
    prefixed,
    save_sharded,
    stock_attention,
)
from _migration_helpers import private_ledger  # noqa: F401 (autouse)


def test_fold_reads_only_the_biases_it_rewrites(tmp_path, monkeypatch):
    tensors = {
        **prefixed(stock_attention(add_bias_kv=True), "a."),
        **prefixed(stock_attention(seed=1), "b."),
        "big.weight": torch.randn(64, 64),
    }
    save_sharded(
        tensors,
        tmp_path / "ckpt",
        [[k for k in tensors if not k.startswith("b.")], [k for k in tensors if k.startswith("b.")]],
    )
    reads = []
    real_read = TensorRecord.read

    def recording_read(record):
        reads.append(record.key)
        return real_read(record)

    monkeypatch.setattr(TensorRecord, "read", recording_read)
    fold_checkpoint(tmp_path / "ckpt", tmp_path / "slim")
    assert set(reads) == {"a.in_proj_bias", "a.bias_k", "b.in_proj_bias"}

    reads.clear()
    (tmp_path / "v1").mkdir()
    save_file(key_bias_free(stock_attention(seed=1), "b."), tmp_path / "v1" / "model.safetensors")
    to_stock_checkpoint(tmp_path / "v1", tmp_path / "back")
    assert set(reads) == {"b.q_proj_bias", "b.v_proj_bias"}


_CHILD = """
import sys
import slim_mha.migration._migrate  # torch and the run's modules, imported on first use: not counted either
from slim_mha.migration.cli import main
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS mark, so the imports' peak is not counted
start = status("VmRSS")
main(sys.argv[1:])
print(start, status("VmHWM"))
"""


def _extra_memory(*argv: str) -> int:
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert result.returncode == 0, result.stderr
    start, peak = map(int, result.stdout.split())
    return peak - start


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("options", [[], ["--verify", "--fold-value-bias"]], ids=["fold", "fold_verify"])
def test_peak_memory_stays_below_one_and_a_half_largest_shards(tmp_path, options):
    embed_dim, layers = 512, 12  # ~4 MiB of attention per layer, plus a 32 MiB block per shard
    tensors = {}
    for layer in range(layers):
        module = stock_attention(embed_dim, seed=layer)
        tensors.update(prefixed(module, f"layers.{layer}.attn."))
    keys = list(tensors)
    shards = [keys[i::3] for i in range(3)]
    for number, shard in enumerate(shards):
        tensors[f"filler.{number}"] = torch.randn(8 * 2**20 // 1)  # 32 MiB of float32
        shard.append(f"filler.{number}")
    source = save_sharded(tensors, tmp_path / "stock", shards)
    largest = max(path.stat().st_size for path in source.glob("*.safetensors"))
    extra = _extra_memory("fold", str(source), str(tmp_path / "slim"), "--quiet", *options)
    assert extra <= 1.5 * largest, f"peak {extra / 2**20:.1f} MiB above start, largest shard {largest / 2**20:.1f} MiB"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_for_a_single_large_file_is_flat(tmp_path):
    tensors = {**prefixed(stock_attention(256), "attn."), "filler": torch.randn(32 * 2**20)}  # 128 MiB
    save_file(tensors, tmp_path / "big.safetensors")
    extra = _extra_memory("fold", str(tmp_path / "big.safetensors"), str(tmp_path / "out.safetensors"), "--quiet")
    assert extra <= 0.25 * (tmp_path / "big.safetensors").stat().st_size
