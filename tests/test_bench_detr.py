"""DETR's decoder layer through ``bench model`` (``slim_mha/bench/models.py``) at a tiny size.

Its weights-path counts are tested in tests/test_unread_weights.py. Never timings: only that they
were taken, interleaved, with paired ratios for every pair, and that slim_skip took the skipping path.
"""

from __future__ import annotations

import json

from slim_mha.bench import __main__ as bench

QUICK = ["--repeats", "3", "--warmup", "0", "--min-sample-ms", "0"]
DETR = ["model", "slim_mha.bench.models:detr_decoder_layer", "--input-fn", "slim_mha.bench.models:detr_inputs"]


def test_a_tiny_detr_run_times_three_contenders_paired_and_names_their_paths(tmp_path, capfd):
    path = tmp_path / "detr.json"
    tiny = ["--input", "4x2x256", "--input", "9x2x256", "--skip-unread-weights"]
    assert bench.main([*DETR, *tiny, *QUICK, "--json", str(path)]) == 0
    printed = capfd.readouterr()
    assert "profiler_start" not in printed.out + printed.err and "USDT" not in printed.out + printed.err
    result = json.loads(path.read_text())
    assert result["agrees"] and result["inputs"] == [[4, 2, 256], [9, 2, 256], [2, 9], [9, 2, 256], [4, 2, 256]]
    errors = result["errors"]["eval output"]
    assert max(errors["slim_error"], errors["slim_skip_error"]) <= errors["bound"]
    for mode in ("inference", "train"):
        timed = result[mode]
        assert set(timed["paired"]) == {"stock_over_slim", "stock_over_slim_skip", "slim_over_slim_skip"}
        assert set(timed["peak_bytes"]) == {"stock", "slim", "slim_skip"}
        paired = timed["paired"]["stock_over_slim"]
        assert timed["stalled"] or paired["quartiles"][0] <= paired["median"] <= paired["quartiles"][1]
    skipped = {row["why"] for row in result["paths"]["slim_skip"]["eval"]}
    assert skipped == {"slim's own option skip_unread_weights"}  # the weights DETR never reads are not made
    assert "skip_unread_weights" not in {row["why"] for row in result["paths"]["slim"]["eval"]}
    assert max(len(line) for line in printed.out.splitlines()) < 200


def test_input_fn_takes_the_input_shapes_and_defaults_without_them():
    from slim_mha.bench.models import detr_inputs, padded_tokens

    tgt, memory, padding, pos, query_pos = detr_inputs()
    assert (tgt.shape, memory.shape, padding.shape) == ((100, 2, 256), (950, 2, 256), (2, 950))
    assert padding[-1].sum() == 950 - int(950 * 0.85) and not padding[0].any()
    tokens, mask, padding = padded_tokens((4, 8, 16))
    assert tokens.shape == (4, 8, 16) and mask is None
    assert padding.tolist() == [[False] * 8, [False] * 6 + [True] * 2] * 2
