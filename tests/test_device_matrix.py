"""The device correctness matrix (``tests/device_matrix.py``), run on CPU: it passes, and it can fail.

On a lent GPU, ``benchmarks/cuda_run.sh`` runs the same script on CUDA.
"""

from __future__ import annotations

import json

import device_matrix as correctness


def test_correctness_check_passes_on_cpu(capsys, tmp_path):
    path = tmp_path / "correctness.json"
    assert correctness.main(["--device", "cpu", "--sweep", "4", "--limit", "24", "--json", str(path)]) == 0
    summary = json.loads(path.read_text())["summary"]
    assert summary["configurations"] == 24 and summary["failed"] == 0
    assert "24/24 configurations pass" in capsys.readouterr().out


def test_correctness_check_fails_on_a_wrong_module(capsys, monkeypatch):
    """The checker must be able to fail: slim with its output bias zeroed is not stock."""
    original = correctness._modules

    def broken(config, device):
        stock, slim, reference = original(config, device)
        slim.out_proj.bias.data.zero_()
        return stock, slim, reference

    monkeypatch.setattr(correctness, "_modules", broken)
    assert correctness.main(["--device", "cpu", "--sweep", "0", "--limit", "3"]) == 1
    assert "FAIL" in capsys.readouterr().out
