"""Smoke tests of the benchmark's real entry points on tiny shapes: output shape, never timings."""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import replace

import pytest
import torch

from slim_mha.bench import __main__ as bench
from slim_mha.bench.matrix import command as run_command
from slim_mha.bench.matrix import report
from slim_mha.bench.matrix.cases import TARGET_SHAPES, build_matrix
from slim_mha.bench.measure.load import competing_load
from slim_mha.bench.scale import command as scale_command

# One quick repeat: what the command does, not how fast.
_QUICK = ["--repeats", "2", "--warmup", "1", "--min-sample-ms", "0"]
TINY = ["--shape", "2x16x32x4", "--repeats", "2", "--warmup", "1", "--min-sample-ms", "0", "--device", "cpu"]


def run_bench(capsys, tmp_path, *extra: str) -> tuple[dict, str]:
    path = tmp_path / "bench.json"
    assert bench.main([*TINY, "--json", str(path), *extra]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def test_runs_the_matrix_and_writes_json_and_table(capsys, tmp_path):
    payload, out = run_bench(capsys, tmp_path, "--mode", "inference,train", "--no-plot")

    assert len(payload["cases"]) == 2 * 2 * 2  # modes x attention kinds x need_weights
    for key in ("torch", "device_name", "torch_threads", "date"):
        assert payload["environment"][key]
    for result in payload["cases"]:
        assert result["agrees"], result["relative_error"]
        assert set(result["time"]) == {"stock", "slim", "floor"}
        for timing in result["time"].values():
            assert len(timing["samples_ms"]) == 2 and timing["median_ms"] > 0
        assert set(result["ratios"]) == {"stock_over_slim", "slim_over_floor", "stock_over_floor"}
        # the ratio printed beside the ms columns is the ratio of those medians
        times = result["time"]
        assert result["ratios"]["stock_over_slim"] == times["stock"]["median_ms"] / times["slim"]["median_ms"]
        paired = result["paired_ratios"]["stock_over_slim"]
        samples = [a / b for a, b in zip(times["stock"]["samples_ms"], times["slim"]["samples_ms"])]
        assert paired["median"] == statistics.median(samples)
        # page faults per call for every contender, with the allocator warm and cold
        assert set(result["cold"]) == set(times) == {"stock", "slim", "floor"}
        for name in times:
            assert times[name]["faults_per_call"] >= 0 and result["cold"][name]["faults_per_call"] >= 0
            assert result["cold"][name]["median_ms"] > 0
        slim_memory = result["memory"]["slim"]
        assert slim_memory["parameter_bytes"] == result["memory"]["stock"]["parameter_bytes"]  # stock's parameters
        assert slim_memory["adam_state_bytes"] > 0
        assert (slim_memory["saved_bytes"] is None) == (result["case"]["mode"] == "inference")
    stock_paths = {r["stock_path"] for r in payload["cases"] if r["case"]["mode"] == "inference"}
    assert "native fast path" in stock_paths  # eval self-attention must hit stock's fast path
    assert [check["target"] for check in payload["targets"]] == [
        "slim is at least as fast as stock in every case",
        "slim is within 5% of the floor in every case",
        "slim's peak memory is at or below stock's (its 3E bias aside) in every case",
        "slim agrees with stock within the dtype's tolerance in every case",
    ]

    allocator = payload["environment"]["allocator"]
    assert set(allocator) >= {"library", "controlled", "environment"}
    if allocator["controlled"]:  # glibc: the settings of both states are recorded
        assert allocator["warm"] == {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 2**31 - 1}
        assert allocator["cold"]["M_MMAP_THRESHOLD"] == 65536 and allocator["cold"]["malloc_trim_before_each_call"]
        assert all(result["allocator_controlled"] for result in payload["cases"])
    assert "stock/slim" in out and "slim/floor" in out
    markdown = (tmp_path / "bench.md").read_text()
    verdicts = out[out.index("Targets:") :].split("\n\n")[0].splitlines()[:9]  # the console's verdicts...
    assert verdicts[0] == "Targets:" and any(line.startswith(("  MET", "  MISS")) for line in verdicts)
    assert "\n".join(verdicts) in markdown  # ...are the file's, word for word (one formatter)
    assert re.search(r"expected time: (about \d+ s|\d+ s to \d+ (s|minutes)) for 8 case\(s\) \(quiet to beside", out)
    assert "train  " in out and "cross" in out
    markdown = (tmp_path / "bench.md").read_text()  # the full table goes next to the JSON
    assert "| floor ms |" in markdown and "Targets:" in markdown


def test_output_fits_120_columns_without_profiler_chatter(capfd, tmp_path):
    """The real entry point, captured at the file descriptors, where the profiler's native chatter lands."""
    path = tmp_path / "bench.json"
    assert bench.main([*TINY, "--json", str(path), "--mode", "train-equivariance,train", "--targets", "--no-plot"]) == 0
    out, err = capfd.readouterr()
    lines = (out + err).splitlines()
    assert not [line for line in lines if "USDT" in line or "profiler_st" in line]
    assert [line for line in lines if len(line) > 120] == []
    assert "Targets:" in out and "why: " in out and "issue" not in out.lower()
    payload = json.loads(path.read_text())
    largest = max(result["relative_error"]["slim"] for result in payload["cases"])
    agreement = next(line for line in out.splitlines() if line.startswith("agreement:"))
    assert f"largest relative error {largest:.1e}" in agreement  # a measured value, not a flag


def test_table_fits_120_columns_at_the_widest_case():
    """The longest mode, attention and shape labels and two dtypes (the dtype then joins each row)."""
    case = {
        "batch": 16,
        "seq_len": 1024,
        "embed_dim": 1024,
        "num_heads": 16,
        "attention": "cross",
        "need_weights": True,
        "mode": "train-equivariance",
    }
    timing = {"median_ms": 12345.67, "iqr_over_median": 0.5}
    results = [
        {
            "case": {**case, "dtype": dtype},
            "name": dtype,
            "agrees": False,
            "time": {name: timing for name in ("stock", "slim", "floor")},
            "ratios": {"stock_over_slim": 111.27, "slim_over_floor": 10.5, "stock_over_floor": 1.0},
            "paired_ratios": {"stock_over_slim": {"median": 101.2, "quartiles": [78.48, 144.06]}},
            "cold": {name: {"median_ms": 23456.7, "faults_per_call": 1234567.0} for name in ("stock", "slim")},
            "cold_ratios": {"stock_over_slim": 111.27},
            "memory": {name: {"peak_bytes": 12345 * 2**20} for name in ("stock", "slim", "floor")},
        }
        for dtype in ("bf16", "fp16")
    ]
    results[1]["case"].update(attention="self", masks="padding")  # the longest mask name, on self-attention
    table = report.format_table(results)
    assert max(len(line) for line in table.splitlines()) <= 120, table
    assert "* MISMATCH" in table and "fp16" in table
    assert [line.split()[-1] for line in table.splitlines()[2:4]] == ["*", "*"]
    assert "train+eq  self  wp  B=16" in table and "cross w   B=16" in table  # a masked case says so in its row


def test_busy_processes_run_during_the_block_and_are_stopped_after_it():
    with competing_load(2, max_seconds=60) as pids:
        assert len(pids) == 2 and all(_running(pid) for pid in pids)
    assert not any(_running(pid) for pid in pids)
    with pytest.raises(KeyboardInterrupt), competing_load(1, max_seconds=60) as pids:
        raise KeyboardInterrupt  # Ctrl-C in the middle of a run stops them too
    assert not _running(pids[0])


def test_busy_processes_end_by_themselves_after_max_seconds():
    with competing_load(1, max_seconds=0.2) as pids:
        deadline = time.monotonic() + 20
        while _running(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(pids[0])


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child that its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_busy_run_records_the_load_and_says_so(capsys, tmp_path):
    payload, out = run_bench(
        capsys,
        tmp_path,
        "--mode",
        "inference",
        "--attention",
        "self",
        "--busy",
        "1",
        "--need-weights",
        "true",
        "--no-plot",
    )
    assert payload["settings"]["busy_processes"] == 1
    assert "beside 1 busy processes" in out and "ran beside 1 competing busy process (--busy)" in out


def test_quick_matrix_holds_the_target_shapes_in_every_mode():
    cases = build_matrix(device="cpu", dtypes=["fp32"])
    for shape in TARGET_SHAPES:
        for mode in ("inference", "train"):
            assert {case.need_weights for case in cases if case.shape == shape and case.mode == mode} == {False, True}
    assert {case.attention for case in cases} == {"self", "cross"}
    assert max(case.seq_len for case in cases) <= 1024


def test_dry_run_lists_cases(capsys):
    assert bench.main(["--device", "cpu", "--full", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "cases on cpu" in out and "B=4   L=512  E=512  H=8" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "8x128x256"], "--shape: shape '8x128x256' must be four positive integers"),
        (["--shape", "2x8x30x4"], "embed_dim 30 must be divisible by num_heads 4"),
        (["--dtype", "fp8"], "--dtype: unknown 'fp8'"),
        (["--mode", "training"], "--mode: unknown 'training'"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--busy", "-1"], "--busy must be between 0 and 64 competing processes, got -1"),
        (["--busy-max-s", "0"], "--busy-max-s must be positive, got 0.0"),
        (["--blocks", "-1"], "--blocks must be at least 0, got -1"),
        (["--plot", "out.png"], "--plot: bench run draws no plot now"),
        (["--profile"], "--profile: bench run profiles no more"),
    ],
)
def test_bad_options_are_parser_errors(capsys, argv, message):
    for command in ([], ["run"]):  # the bare command and its subcommand parse the same options
        with pytest.raises(SystemExit) as exit_info:
            bench.main([*command, "--device", "cpu", *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err.strip().splitlines()[-1] and err.count("error:") == 1  # usage, then one line


@pytest.mark.parametrize(
    "argv, handler",
    [
        ([], run_command.run),
        (["--busy", "2"], run_command.run),
        (["run", "--full"], run_command.run),
        (["scale", "--dry-run"], scale_command.run),
    ],
)
def test_subcommands_are_wired_and_the_bare_command_runs_the_matrix(argv, handler):
    assert bench.build_parser().parse_args(argv).handler is handler


def test_run_options_before_the_subcommand_are_kept():
    args = bench.build_parser().parse_args(["--busy", "2", "run", "--full"])
    assert (args.busy, args.full, args.repeats) == (2, True, None)


@pytest.mark.parametrize("command", [[], ["run"], ["scale"], ["model"]])
def test_every_help_fits_120_columns_and_names_no_issue(capsys, command):
    with pytest.raises(SystemExit):
        bench.main([*command, "--help"])
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if len(line) >= 120] == []
    assert "issue" not in out.lower() and "examples:" in out


def test_the_old_flags_are_not_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--scale"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --scale" in capsys.readouterr().err


def test_run_times_slim_on_its_other_paths_and_restores_them(capsys, tmp_path):
    """``--one-pass`` and ``--blocks`` time slim where its first choice would not apply, then put back
    stock's fast path and the block size; every path computes what stock does."""
    from slim_mha import _explicit_attention as explicit

    rows_per_block = explicit.rows_per_block
    path = tmp_path / "weights.json"
    argv = ["run", "--shape", "2x16x32x4", "--mode", "inference", "--need-weights", "true", "--attention", "self"]
    assert bench.main([*argv, "--blocks", "2", "--one-pass", *_QUICK, "--no-plot", "--json", str(path)]) == 0
    assert explicit.rows_per_block is rows_per_block and torch.backends.mha.get_fastpath_enabled()  # put back
    out = capsys.readouterr().out
    result = json.loads(path.read_text())["cases"][0]
    if result["stalled"]:  # a busy machine stopped the process inside calls: no ratio is printed, by design
        assert "stalled" in out
    else:
        assert "stock/one_pass (paired): " in out and "stock/blocks (paired): " in out
    assert set(result["time"]) == set(result["memory"]) == {"stock", "slim", "floor", "blocks", "one_pass"}
    assert {"stock_over_slim", "slim_over_floor", "stock_over_blocks", "stock_over_one_pass"} <= set(
        result["paired_ratios"]
    )
    assert max(result["relative_error"].values()) < 1e-4 and result["agrees"]


def test_run_refuses_more_blocks_than_rows(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["run", "--shape", "2x16x32x4", "--blocks", "17"])
    assert exit_info.value.code == 2
    assert "--blocks must be at most every case's sequence length, got 17" in capsys.readouterr().err


def test_a_peak_a_few_bytes_above_stocks_is_reported_in_bytes_not_rounded_to_a_ratio_of_one():
    """The memory target says how far above stock a peak is, in KiB."""
    case = {"mode": "inference", "dtype": "fp32"}
    results = [
        {
            "name": f"case {extra}",
            "case": case,
            "agrees": True,
            "relative_error": {"slim": 1e-7},
            "ratios": {"stock_over_floor": 1.0},
            "paired_ratios": {"stock_over_slim": {"median": 1.0}, "slim_over_floor": {"median": 1.0}},
            "memory": {"stock": {"peak_bytes": 9 << 20}, "slim": {"peak_bytes": (9 << 20) + extra}},
        }
        for extra in (0, 3072)
    ]
    memory = next(check for check in report.evaluate_targets(results, "cpu") if "memory" in check.target)
    assert (memory.met, memory.total) == (1, 2)
    assert memory.detail == "worst 1.0003 at case 3072, slim at most 3.0 KiB above stock"


@pytest.mark.parametrize("masks", ["padding", "causal", "both"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_masked_contenders_compute_stocks_function_and_stock_keeps_its_kernel(masks, need_weights):
    """With masks, the floor's ``-inf`` form and slim agree with stock, and stock still runs its native
    kernel (bool masks are what its fast path takes): the comparison is against stock's best."""
    from slim_mha.bench.matrix.cases import Case
    from slim_mha.bench.matrix.contenders import build_contenders, output_error
    from slim_mha.bench.measure.memory import profile_step, took_native_fast_path

    case = Case(4, 16, 32, 4, "self", need_weights, "inference", "fp32", masks)
    contenders = build_contenders(case, torch.device("cpu"))
    with torch.inference_mode():
        outputs = {name: contender.forward() for name, contender in contenders.items()}
        stock_ops = profile_step(contenders["stock"].step, torch.device("cpu")).op_names
    assert took_native_fast_path(stock_ops)
    for name in ("slim", "floor"):
        assert output_error(outputs["stock"], outputs[name]) < 1e-5, name
    unmasked = build_contenders(replace(case, masks="none"), torch.device("cpu"))["stock"]
    with torch.inference_mode():
        assert output_error(outputs["stock"], unmasked.forward()) > 1e-3  # the masks change the answer


def test_case_masks_pad_every_other_row_and_refuse_unknown_names():
    from slim_mha.bench.matrix.contenders import case_masks

    both = case_masks("both", 3, 8, torch.device("cpu"))
    padding, causal = both["key_padding_mask"], both["attn_mask"]
    assert padding.dtype == causal.dtype == torch.bool
    assert padding.tolist() == [[False] * 6 + [True] * 2, [False] * 8, [False] * 6 + [True] * 2]
    assert torch.equal(causal, torch.ones(8, 8, dtype=torch.bool).triu(1))
    assert case_masks("none", 3, 8, torch.device("cpu")) == {}
    with pytest.raises(ValueError, match="masks must be one of none, padding, causal, both, got 'pad'"):
        case_masks("pad", 3, 8, torch.device("cpu"))


def test_run_passes_causal_masks_to_every_contender_and_refuses_unknown_ones(capsys, tmp_path):
    path = tmp_path / "masked.json"
    argv = ["run", "--shape", "2x16x32x4", "--mode", "inference", "--attention", "self", "--masks", "both"]
    assert bench.main([*argv, "--one-pass", *_QUICK, "--no-plot", "--json", str(path)]) == 0
    result = json.loads(path.read_text())["cases"][0]
    assert result["case"]["masks"] == "both" and max(result["relative_error"].values()) < 1e-4
    assert "inference self  -pc B=2 L=16" in capsys.readouterr().out  # the row says which masks it ran
    assert "| inference | self | no | both | 2 | 16 | 32 | 4 |" in path.with_suffix(".md").read_text()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["run", "--shape", "2x16x32x4", "--masks", "pad"])
    assert exit_info.value.code == 2
    assert "--masks: unknown 'pad'; choose from none, padding, causal, both" in capsys.readouterr().err


def test_a_verdict_that_leaves_stalled_cases_out_says_how_many_within_120_columns():
    """'MET ... 2 of 2' once hid 13 stalled cases; the verdict counts them, and still fits the screen."""
    from slim_mha.bench.matrix.report import TargetCheck, evaluate_targets, format_targets

    targets = [check.target for check in evaluate_targets([], "cpu")]  # speed and floor judge timed cases
    worst = "inference self - B=8 L=128 E=256 H=8 fp32"
    checks = [
        TargetCheck(target, 1.0, 2, 2, 1.1, worst, left_out=13 if index < 2 else 0)
        for index, target in enumerate(targets)
    ]
    text = format_targets(checks)
    assert text.count("13 stalled left out") == 2
    assert max(len(line) for line in text.splitlines()) <= 120


def test_the_quick_matrix_holds_masked_cases_and_masks_select_them():
    """A padding mask, in inference and training, with and without weights, at a small and a target
    shape; --masks builds them as an axis, for self-attention alone, and names them."""
    from slim_mha.bench.matrix.cases import MASKED_SHAPES, build_matrix

    quick = [case for case in build_matrix(device="cpu", dtypes=["fp32"]) if case.masks == "padding"]
    assert {(case.shape, case.mode, case.need_weights) for case in quick} == {
        (shape, mode, weights)
        for shape in MASKED_SHAPES
        for mode in ("inference", "train")
        for weights in (False, True)
    }
    assert all(case.name.endswith(" padding") for case in quick)
    chosen = build_matrix(device="cpu", dtypes=["fp32"], shapes=[(2, 16, 64, 4)], masks=["none", "padding"])
    assert {case.masks for case in chosen if case.attention == "self"} == {"none", "padding"}
    assert {case.masks for case in chosen if case.attention == "cross"} == {"none"}


def test_run_compile_times_stock_and_slim_compiled_and_counts_graph_breaks(tmp_path):
    """``bench run --compile BACKEND``: both modules called through torch.compile, graph breaks counted
    per case; the eager backend keeps this quick (the default is inductor)."""
    path = tmp_path / "compiled.json"
    argv = ["run", "--shape", "2x16x64x4", "--mode", "inference,train", "--attention", "self"]
    argv += ["--need-weights", "false", "--compile", "eager", *_QUICK, "--no-plot", "--json", str(path)]
    assert bench.main(argv) == 0
    cases = json.loads(path.read_text())["cases"]
    assert len(cases) == 2
    for case in cases:
        assert case["compile_backend"] == "eager" and set(case["graph_breaks"]) == {"stock", "slim"}
        assert case["graph_breaks"]["slim"]["count"] <= case["graph_breaks"]["stock"]["count"]
        assert case["agrees"]


def test_the_estimate_says_one_time_where_its_two_ends_meet():
    from slim_mha.bench.measure.timing import Settings

    cases = build_matrix(
        device="cpu",
        dtypes=["fp32"],
        shapes=[(1, 2, 8, 2)],
        modes=["inference"],
        attentions=["self"],
        need_weights=[False],
    )
    quick = Settings(repeats=1, min_repeats=1, min_sample_s=0.0, max_case_s=0.0, cold_repeats=0)
    text = run_command._estimate(cases, quick, torch.device("cpu"))
    assert text == "expected time: about 1 s for 1 case(s) (quiet to beside busy processes)"
