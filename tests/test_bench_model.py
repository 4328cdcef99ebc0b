"""``python -m slim_mha.bench model MODULE:CALLABLE`` on nn.Transformer and a model of the tests' own."""

from __future__ import annotations

import json

import pytest

from slim_mha.bench import __main__ as bench

QUICK = ["--repeats", "1", "--warmup", "0", "--min-sample-ms", "0"]


def test_nn_transformer_with_two_inputs_agrees_and_is_timed(tmp_path, capsys):
    path = tmp_path / "model.json"
    code = bench.main(
        [
            "model",
            "_bench_models:tiny_transformer",
            "--input",
            "7x2x32",
            "--input",
            "5x2x32",
            *QUICK,
            "--json",
            str(path),
        ]
    )
    assert code == 0, capsys.readouterr()
    result = json.loads(path.read_text())
    assert result["attention_modules"] == 3 and result["agrees"] is True  # encoder self, decoder self and cross
    assert {"eval output", "train output", "train encoder.layers.0.self_attn.in_proj_bias"} <= set(result["errors"])
    for mode in ("inference", "train"):  # one repeat of single calls: a busy machine may stall it (no ratio then)
        timed = result[mode]
        paired = timed["paired"]["stock_over_slim"]
        assert (timed["stalled"] and paired is None) or paired["median"] > 0
        assert timed["peak_bytes"]["slim"] > 0 and timed["ms"]["slim"] > 0
    saved = result["train"]["saved_bytes"]  # what autograd keeps for backward, beside the peak
    assert saved["stock"] > 0 and saved["slim"] > 0
    out = capsys.readouterr().out
    assert "3 attention module(s) made slim" in out and "saved for backward: stock" in out
    paths = result["paths"]["slim"]  # what explain says of each call
    assert sum(row["calls"] for row in paths["eval"] if row["kind"] == "attention") == 3
    assert "slim paths in eval: encoder layer stock layer x1 (self_attn.batch_first was not True)" in out
    assert {row["why"] for row in paths["train"]} >= {"training is enabled"}


def test_a_model_of_our_own_with_an_input_function_and_dict_outputs(tmp_path, capsys):
    path = tmp_path / "set.json"
    assert (
        bench.main(
            ["model", "_bench_models:SetPooling", "--input-fn", "_bench_models:set_batch", *QUICK, "--json", str(path)]
        )
        == 0
    )
    result = json.loads(path.read_text())
    assert result["attention_modules"] == 2 and result["agrees"] and result["inputs"] == [[2, 10, 3]]


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["no_such_module:build", "--input", "2x3"], "importing 'no_such_module' failed (ModuleNotFoundError"),
        (["_bench_models:no_such_name", "--input", "2x3"], "'_bench_models' has no attribute 'no_such_name'"),
        (["_bench_models:NOT_CALLABLE", "--input", "2x3"], "'NOT_CALLABLE' is a int, not a callable"),
        (["_bench_models", "--input", "2x3"], "write it as MODULE:CALLABLE"),
        (["_bench_models:SetPooling", "--input", "2xthree"], "--input '2xthree': a shape is positive integers"),
        (["_bench_models:SetPooling", "--input", "2x10x5"], "--input: the model rejected its inputs: RuntimeError"),
        (["_bench_models:set_batch", "--input", "2x3"], "returned a tuple, not an nn.Module"),
        (["_bench_models:SetPooling"], "give the model's inputs"),
        (["_bench_models:no_attention", "--input", "2x3"], "the model holds no nn.MultiheadAttention"),
        (["_broken_import:build", "--input", "2x3"], "importing '_broken_import' failed (RuntimeError: operator"),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(arguments, message, capsys):
    assert bench.main(["model", *arguments, *QUICK]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_compile_times_both_compiled_and_counts_their_graph_breaks(tmp_path, capsys):
    """``--compile BACKEND``: both models timed under torch.compile, each counted for graph breaks in
    eval and train first. The eager backend keeps this test quick; the default is inductor."""
    path = tmp_path / "compiled.json"
    code = bench.main(
        ["model", "_bench_models:SetPooling", "--input-fn", "_bench_models:set_batch", "--compile", "eager", *QUICK]
        + ["--json", str(path)]
    )
    assert code == 0, capsys.readouterr()
    result = json.loads(path.read_text())
    assert result["compile_backend"] == "eager" and result["agrees"]
    for mode in ("inference", "train"):
        breaks = result["graph_breaks"][mode]
        assert set(breaks) == {"stock", "slim"}
        assert breaks["slim"]["count"] <= breaks["stock"]["count"], breaks  # slim adds no graph break
    out = capsys.readouterr().out
    assert "timed under torch.compile(backend='eager'); graph breaks:" in out


@pytest.mark.parametrize(
    "factory, length, padding, expected",
    [
        ("transformer_encoder", 8, False, "stock fused layer"),
        ("transformer_encoder", 400, False, "slim layer"),
        ("transformer_encoder", 400, True, "slim layer"),
        ("transformer_encoder_unnested", 8, True, "unfused layer"),
    ],
)
def test_the_encoder_benchmark_records_which_layer_ran(tmp_path, factory, length, padding, expected):
    """``bench model`` on the encoder preset: both sides agree, and the census names the layer's path."""
    path = tmp_path / "encoder.json"
    inputs = ["--input-fn", "slim_mha.bench.models:padded_tokens"] if padding else []
    argv = ["model", f"slim_mha.bench.models:{factory}", *inputs, "--input", f"4x{length}x256", "--mode", "inference"]
    assert bench.main([*argv, "--repeats", "1", "--warmup", "0", "--min-sample-ms", "0", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    layers = {row["path"] for row in result["paths"]["slim"]["eval"] if row["kind"] == "encoder layer"}
    assert layers == {expected} and result["agrees"] and "train" not in result
