"""The scale sweep's machinery at tiny N, and the guard that refuses attention weights that cannot fit.

Never timings: the sweep's numbers belong in benchmarks/RESULTS.md. The sweep tests run real child
processes (a few seconds each) because recording a child's failure is the point.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch._dynamo

from slim_mha import SlimMultiheadAttention
from slim_mha import _explicit_attention as guard
from slim_mha import _memory as memory
from slim_mha.bench import __main__ as bench
from slim_mha.bench.scale import child as scale_child
from slim_mha.bench.scale import report as scale_report
from slim_mha.bench.scale import sweep as scale_sweep
from slim_mha.bench.scale.cases import Series, Settings

from _reference import STOCK_MHA, assert_close_scaled, randomize_parameters

POINT_CLOUD = {"shape": "point-cloud", "embed_dim": 64, "num_heads": 4}
STOCK_INFERENCE = Series("stock", **POINT_CLOUD, mode="inference", padding_mask=False)
SLIM_INFERENCE = Series("slim", **POINT_CLOUD, mode="inference", padding_mask=False)


# ------------------------------------------------------------------- the weights-size guard


def slim_and_stock(embed_dim: int = 8, num_heads: int = 2):
    torch.manual_seed(0)
    stock = randomize_parameters(STOCK_MHA(embed_dim, num_heads, batch_first=True))
    slim = SlimMultiheadAttention(embed_dim, num_heads, batch_first=True)
    slim.load_state_dict(stock.state_dict())
    return slim, stock


def largest_allocation(call) -> int:
    """Bytes of the largest CPU allocation ``call`` made (the profiler sees every allocator call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        call()
    sizes = [event.nbytes() for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    return max(sizes, default=0)


@pytest.mark.parametrize(
    "grad, average", [(True, True), (False, True), (False, False)], ids=["graph", "averaged", "per_head"]
)
def test_weights_that_cannot_fit_fail_fast_with_our_message(grad, average):
    slim, _ = slim_and_stock()
    tokens = 200_000  # weights of 149 GiB and more: beyond this machine, and (checked) beyond this process
    available, _ = guard.available_bytes(torch.device("cpu"))
    if available is not None and available > 2 * tokens * tokens * 4:
        pytest.skip("this machine has room for 200k x 200k weights")
    x = torch.randn(1, tokens, 8, requires_grad=grad)
    errors = []

    def call():
        with torch.set_grad_enabled(grad):
            try:
                slim(x, x, x, need_weights=True, average_attn_weights=average)
            except torch.OutOfMemoryError as error:
                errors.append(error)

    biggest = largest_allocation(call)
    assert len(errors) == 1, "the call did not raise torch.OutOfMemoryError"
    message = str(errors[0])
    assert isinstance(errors[0], RuntimeError)  # what handlers written for stock's failure catch
    assert message.startswith(
        "need_weights=True: attention weights over 200,000 queries and 200,000 keys need at least "
    )
    assert "pass need_weights=False" in message and "DefaultCPUAllocator" not in message
    assert biggest < 64 << 20, f"an allocation of {biggest} bytes was attempted before refusing"


def test_error_message_is_pinned(monkeypatch):
    monkeypatch.setattr(guard, "available_bytes", lambda device: (100 << 20, "the test's limit"))
    slim, _ = slim_and_stock()
    x = torch.zeros(3, 6000, 8)  # (B, H, L, S) = (3, 2, 6000, 6000) float32: 864 MB
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError) as caught:
        slim(x, x, x, average_attn_weights=False)
    assert str(caught.value) == (
        "need_weights=True: attention weights over 6,000 queries and 6,000 keys need at least 824.0 MiB "
        "(the weights, (B, H, L, S) = (3, 2, 6000, 6000), float32), more than this process can get "
        "(100.0 MiB, the test's limit); pass need_weights=False, which never materialises them and keeps "
        "memory linear in the number of tokens, or attend over fewer tokens"
    )


def test_small_calls_never_read_the_limits_and_match_stock(monkeypatch):
    def must_not_run(device):
        raise AssertionError("the limits were read for a small call")

    monkeypatch.setattr(guard, "available_bytes", must_not_run)
    slim, stock = slim_and_stock(16, 4)
    x = torch.randn(2, 50, 16, requires_grad=True)
    for average in (True, False):
        out, weights = slim(x, x, x, average_attn_weights=average)
        expected_out, expected_weights = stock(x, x, x, average_attn_weights=average)
        assert_close_scaled(out, expected_out)
        assert_close_scaled(weights, expected_weights, "weights")


def test_guard_can_refuse_any_size_once_its_threshold_is_lowered(monkeypatch, slims_own_paths):
    """What the tracing tests below rely on: with no threshold even a tiny eager call is checked."""
    monkeypatch.setattr(guard, "_CHECK_ABOVE_BYTES", 0)
    monkeypatch.setattr(guard, "available_bytes", lambda device: (0, "the test's limit"))
    slim, _ = slim_and_stock()
    x = torch.randn(2, 5, 8)
    with pytest.raises(torch.OutOfMemoryError, match="the test's limit"):
        slim(x, x, x)
    slim(x, x, x, need_weights=False)  # the SDPA path allocates no weights and is never checked


def test_guard_is_skipped_while_compiling(monkeypatch):
    """Reading /proc inside a traced forward would break the graph (fullgraph=True makes that an error)."""
    monkeypatch.setattr(guard, "_CHECK_ABOVE_BYTES", 0)
    slim, stock = slim_and_stock()
    x = torch.randn(2, 5, 8)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(slim, fullgraph=True, backend="aot_eager")
        out, weights = compiled(x, x, x)
    finally:
        torch._dynamo.reset()
    expected_out, expected_weights = stock(x, x, x)
    assert_close_scaled(out, expected_out)
    assert_close_scaled(weights, expected_weights, "weights")


@pytest.mark.parametrize("strict", (True, False), ids=("strict", "non_strict"))
def test_guard_is_skipped_while_exporting(monkeypatch, strict):
    monkeypatch.setattr(guard, "_CHECK_ABOVE_BYTES", 0)
    monkeypatch.setattr(guard, "available_bytes", lambda device: (0, "the test's limit"))
    slim, _ = slim_and_stock()
    x = torch.randn(2, 5, 8)
    program = torch.export.export(slim, (x, x, x), strict=strict)
    monkeypatch.setattr(guard, "_CHECK_ABOVE_BYTES", 1 << 28)
    assert_close_scaled(program.module()(x, x, x)[1], slim(x, x, x)[1], "weights")


def test_guard_adds_nothing_to_a_jit_trace():
    """Under torch.jit.trace sizes are recorded values: comparing them would warn and bake in a constant."""
    slim, _ = slim_and_stock()
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(slim, (x, x, x), check_trace=False)
        weights, expected = traced(x, x, x)[1], slim(x, x, x)[1]
    # The guard is the part of the weights module from its section line on: every line of it, as
    # when it was a file of its own.
    source = inspect.getsource(guard).splitlines()
    guard_start = next(number for number, line in enumerate(source, 1) if line.endswith(" the memory guard"))
    guard_lines = range(guard_start, len(source) + 1)
    assert [str(w.message) for w in caught if w.filename == guard.__file__ and w.lineno in guard_lines] == []
    assert_close_scaled(weights, expected, "weights")


_UNDER_ADDRESS_SPACE_CAP = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from torch import nn
    from slim_mha import SlimMultiheadAttention

    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (2 << 30), resource.RLIM_INFINITY))  # 2 GiB more
    heads, token_counts = int(sys.argv[1]), [int(tokens) for tokens in sys.argv[2:]]
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(8, heads, batch_first=True)
    slim = SlimMultiheadAttention(8, heads, batch_first=True)
    slim.load_state_dict(stock.state_dict())
    report = {}
    for tokens in token_counts:
        x = torch.randn(1, tokens, 8)
        with torch.no_grad():
            for name, module in (("stock", stock), ("slim", slim)):
                try:
                    weights = module(x, x, x)[1]
                    report[f"{name} {tokens}"] = ["ok", weights[0, :3, :3].tolist()]
                except RuntimeError as error:
                    report[f"{name} {tokens}"] = [type(error).__name__, str(error).splitlines()[0]]
            # A row of weights depends on its query alone: stock's first three, where all of them fail
            report[f"stock {tokens}, 3 queries"] = stock(x[:, :3], x, x)[1][0, :3, :3].tolist()
    print(json.dumps(report))
    """
)


def run_under_address_space_cap(heads: int, *token_counts: int) -> dict:
    """Stock and slim averaged weights at each token count in a child limited to 2 GiB more address space."""
    arguments = [str(heads), *map(str, token_counts)]
    completed = subprocess.run(
        [sys.executable, "-c", _UNDER_ADDRESS_SPACE_CAP, *arguments], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_refuses_under_rlimit_as_only_where_stock_fails_too():
    """Under a 2 GiB address-space cap: 8.7k tokens fit (both serve them; slim's 303 MB of averaged
    weights are above the threshold, so the limits are read), 24k do not (the averaged weights alone
    are 2.3 GB, so the guard's blocks shrink to one row and it still refuses; stock needs 4x that): stock fails in the allocator, slim with our message naming RLIMIT_AS."""
    report = run_under_address_space_cap(2, 8700, 24000)
    assert report["stock 8700"][0] == report["slim 8700"][0] == "ok"
    torch.testing.assert_close(torch.tensor(report["slim 8700"][1]), torch.tensor(report["stock 8700"][1]))
    assert report["stock 24000"][0] == "RuntimeError" and "can't allocate memory" in report["stock 24000"][1]
    kind, message = report["slim 24000"]
    assert kind == "OutOfMemoryError"
    assert (
        "need at least 2.1 GiB (the averaged weights, (B, L, S) = (1, 24000, 24000), one block of scores, "
        "(B, H, rows, S) = (1, 2, 1, 24000), and its average, float32)"
    ) in message
    assert "the address space left under RLIMIT_AS" in message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_blocked_averaging_is_served_under_a_cap_that_every_head_s_scores_exceed():
    """12k tokens and 8 heads under the 2 GiB cap: the averaged weights (576 MB) and one block of
    scores fit, so the guard lets slim through; stock's (B, H, L, S) scores (4.6 GB) do not.
    (tests/test_memory_guard.py checks the guard's estimate path by path.)"""
    report = run_under_address_space_cap(8, 12000)
    assert report["stock 12000"][0] == "RuntimeError" and "can't allocate memory" in report["stock 12000"][1]
    assert report["slim 12000"][0] == "ok", report["slim 12000"]
    torch.testing.assert_close(torch.tensor(report["slim 12000"][1]), torch.tensor(report["stock 12000, 3 queries"]))


def test_cgroup_headroom_reads_v1_and_v2_limits(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "jobs" / "one").mkdir(parents=True)
    (v2 / "jobs" / "memory.max").write_text("8000\n")
    (v2 / "jobs" / "memory.current").write_text("3000\n")
    # Active file cache is reclaimable too: a container full of recently read files still has room.
    (v2 / "jobs" / "memory.stat").write_text("anon 2000\nactive_file 6000\ninactive_file 500\nshmem 700\n")
    (v2 / "jobs" / "one" / "memory.max").write_text("max\n")
    (v2 / "proc_cgroup").write_text("0::/jobs/one\n")
    assert memory._cgroup_headroom(str(v2 / "proc_cgroup"), str(v2)) == 8000 - 3000 + 6000 + 500

    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)  # inside a namespace: the process's path is not under the mount
    (v1 / "memory" / "memory.limit_in_bytes").write_text("4096\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1024\n")
    (v1 / "memory" / "memory.stat").write_text("active_file 1\ntotal_active_file 100\ntotal_inactive_file 24\n")
    (v1 / "proc_cgroup").write_text("5:cpu:/\n4:memory:/process_api/abc\n")
    assert memory._cgroup_headroom(str(v1 / "proc_cgroup"), str(v1)) == 4096 - 1024 + 100 + 24

    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")  # v1's "no limit"
    assert memory._cgroup_headroom(str(v1 / "proc_cgroup"), str(v1)) is None
    assert memory._cgroup_headroom(str(tmp_path / "missing"), str(v1)) is None


def test_system_available_counts_swap_and_strict_overcommit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal: 100 kB\nMemAvailable: 40 kB\nSwapFree: 10 kB\nCommitLimit: 70 kB\nCommitted_AS: 65 kB\n"
    )
    overcommit = tmp_path / "overcommit"
    overcommit.write_text("0\n")
    assert memory._system_available(str(meminfo), str(overcommit)) == 50 * 1024
    overcommit.write_text("2\n")
    assert memory._system_available(str(meminfo), str(overcommit)) == 5 * 1024


# ------------------------------------------------------------------------------- the sweep


def test_oom_in_a_child_is_recorded_and_the_sweep_goes_on():
    """Under a 160 MiB cap, stock's fast path needs 256 MiB of scores at N=4096: its child records
    the allocator's failure, its curve stops there, and slim's curve (linear memory) goes on."""
    settings = Settings(memory_cap_bytes=160 << 20, case_timeout_s=240, budget_s=600, case_budget_s=100)
    result = scale_sweep.run_sweep([STOCK_INFERENCE, SLIM_INFERENCE], [4096, 4100], settings)
    by_case = {(record["name"], record["tokens"]): record for record in result["cases"]}
    oom = by_case[("stock point-cloud inference", 4096)]
    assert oom["status"] == "oom", oom
    assert "can't allocate memory" in oom["detail"]
    assert by_case[("stock point-cloud inference", 4100)] == {
        **by_case[("stock point-cloud inference", 4100)],
        "status": "skipped",
        "detail": "OOM at N=4,096",
    }
    assert "wall_s" not in by_case[("stock point-cloud inference", 4100)]  # no process was started
    for tokens in (4096, 4100):
        record = by_case[("slim point-cloud inference", tokens)]
        assert record["status"] == "ok", record
        assert 0 <= record["peak_bytes"] < 160 << 20 and record["time_s"] > 0
    assert by_case[("slim point-cloud inference", 4096)]["stock_path"] is None
    assert result["stops"] == {"stock point-cloud inference": "OOM at N=4,096"}

    payload = {
        "command": "test",
        "settings": dataclasses.asdict(settings),
        "cases": result["cases"],
        "stops": result["stops"],
        "environment": {"device_name": "cpu", "cpu_count": 2, "torch_threads": 2, "torch": "x", "date": "d"},
        "load_before": None,
        "load_after": None,
        "elapsed_s": result["elapsed_s"],
    }
    markdown = scale_report.format_markdown(payload)
    assert "| 4,096 | **OOM** |" in markdown
    assert "* stock point-cloud inference: none (OOM at N=4,096)" in markdown
    assert "* slim point-cloud inference: 4,100 (ran every N)" in markdown
    slim_peak = by_case[("slim point-cloud inference", 4096)]["peak_bytes"]
    assert "Memory at the largest N both contenders ran:\n\n* none: no N was run by both" in markdown
    assert slim_peak is not None


def test_a_child_past_its_timeout_is_killed_and_recorded():
    record = scale_sweep._run_child(SLIM_INFERENCE, 64, Settings(case_timeout_s=0.5))
    assert record["status"] == "timeout" and "killed" in record["detail"]


def fake_case(seconds_per_token_squared: float, fail_at: int | None = None):
    calls = []

    def run_case(series, tokens, settings):
        calls.append((series.contender, tokens))
        if fail_at is not None and series.contender == "stock" and tokens >= fail_at:
            return {"status": "killed", "detail": "killed by signal 9 (out of memory?)"}
        return {"status": "ok", "time_s": seconds_per_token_squared * tokens**2, "peak_bytes": tokens}

    return run_case, calls


def test_curves_stop_on_failure_case_budget_and_extrapolation():
    run_case, calls = fake_case(1e-6, fail_at=2000)  # 1k tokens: 1 s, 2k: 4 s, 4k: 16 s
    settings = Settings(case_budget_s=10, budget_s=1000)
    result = scale_sweep.run_sweep(
        [STOCK_INFERENCE, SLIM_INFERENCE], [1000, 2000, 3000, 4000], settings, run_case=run_case
    )
    assert calls == [("stock", 1000), ("slim", 1000), ("stock", 2000), ("slim", 2000), ("slim", 3000)]
    assert result["stops"] == {
        "stock point-cloud inference": "killed at N=2,000",
        "slim point-cloud inference": "stopped before N=4,000: extrapolated 16 s > case budget 10 s",
    }
    statuses = [
        (r["contender"] if "contender" in r else r["series"]["contender"], r["tokens"], r["status"])
        for r in result["cases"]
    ]
    assert ("stock", 3000, "skipped") in statuses and ("slim", 4000, "skipped") in statuses

    run_case, calls = fake_case(1e-5)  # a call over the case budget stops its curve after it
    result = scale_sweep.run_sweep([SLIM_INFERENCE], [1000, 1100], Settings(case_budget_s=5), run_case=run_case)
    assert calls == [("slim", 1000)]
    assert result["stops"] == {"slim point-cloud inference": "stopped after N=1,000: it took 10 s > case budget 5 s"}

    run_case, calls = fake_case(1e-6)  # one point predicts nothing: 1k took 1 s, 8k (64 s if quadratic) runs
    scale_sweep.run_sweep([SLIM_INFERENCE], [1000, 8000], Settings(case_budget_s=10), run_case=run_case)
    assert calls == [("slim", 1000), ("slim", 8000)]


def test_a_case_expected_to_exceed_the_memory_cap_runs_to_record_its_oom():
    """Stock's N x N scores make its time quadratic too, but the case past the cap fails at once."""
    calls = []

    def run_case(series, tokens, settings):
        calls.append(tokens)
        if tokens * tokens > settings.memory_cap_bytes:
            return {"status": "oom", "detail": "RuntimeError: DefaultCPUAllocator: can't allocate memory"}
        return {"status": "ok", "time_s": tokens * tokens * 1e-6, "peak_bytes": tokens * tokens}

    settings = Settings(case_budget_s=10, memory_cap_bytes=5_000_000)
    result = scale_sweep.run_sweep([STOCK_INFERENCE], [1000, 2000, 4000], settings, run_case=run_case)
    assert calls == [1000, 2000, 4000]  # 4000 is extrapolated to 16 s, but to 16 MB > the 5 MB cap
    assert result["cases"][-1]["status"] == "oom"
    assert result["stops"] == {"stock point-cloud inference": "OOM at N=4,000"}


def test_memory_is_extrapolated_quadratically_even_where_fixed_costs_flatten_it():
    """Stock measured at +36 MiB (1k) and +1,031 MiB (8k) has a local slope of 1.6, which predicts
    9.5 GiB at 32k; its N x N scores need 16 GiB there. The upper bound, 16.1 GiB, exceeds a 10 GiB cap."""
    measured = [
        {"tokens": 1024, "time_s": 0.45, "peak_bytes": 36 << 20},
        {"tokens": 8192, "time_s": 11.9, "peak_bytes": 1031 << 20},
    ]
    settings = Settings(case_budget_s=30, memory_cap_bytes=10 << 30)
    assert scale_sweep._over_time_budget(measured, 32768, settings) is None  # run it: it is expected to fail at once
    assert scale_sweep._over_time_budget(measured, 32768, Settings(case_budget_s=30, memory_cap_bytes=20 << 30)) == (
        "stopped before N=32,768: extrapolated 106 s > case budget 30 s"
    )


def test_leading_curves_run_over_every_n_first():
    run_case, calls = fake_case(1e-9)
    masked = Series("slim", **POINT_CLOUD, mode="inference", padding_mask=True)
    scale_sweep.run_sweep([STOCK_INFERENCE, SLIM_INFERENCE, masked], [10, 20], Settings(), lead=2, run_case=run_case)
    assert calls == [("stock", 10), ("slim", 10), ("stock", 20), ("slim", 20), ("slim", 10), ("slim", 20)]


def test_sweep_budget_leaves_later_cases_unrun(monkeypatch):
    clock = iter([0.0, 1.0, 12.0, 13.0])  # the start, then before each case, then the end
    monkeypatch.setattr(scale_sweep.time, "perf_counter", lambda: next(clock))
    run_case, calls = fake_case(1e-9)
    result = scale_sweep.run_sweep([SLIM_INFERENCE], [100, 200], Settings(budget_s=10.0), run_case=run_case)
    assert calls == [("slim", 100)]
    assert result["cases"][1]["detail"] == "not run: the sweep budget of 10 s was spent"


def test_extrapolation_uses_the_last_slope_between_one_and_two():
    assert scale_sweep._extrapolated([], 10) is None
    assert scale_sweep._extrapolated([(10, 1.0)], 20) == pytest.approx(4.0)  # one point: quadratic
    assert scale_sweep._extrapolated([(10, 1.0), (20, 2.0)], 40) == pytest.approx(4.0)  # linear so far
    assert scale_sweep._extrapolated([(10, 1.0), (20, 1.0)], 40) == pytest.approx(2.0)  # flat: at least linear
    assert scale_sweep._extrapolated([(10, 1.0), (20, 8.0)], 40) == pytest.approx(32.0)  # steeper: at most N²


def test_scale_entry_point_writes_json_markdown_and_plot(tmp_path, capsys, monkeypatch):
    """The real entry point through argv, with its cases measured in this process (the child
    processes are tested above): wiring, JSON, Markdown and the plot."""
    monkeypatch.setattr(scale_sweep, "_run_child", scale_child.measure_case)
    path = tmp_path / "scale.json"
    argv = [
        "scale",
        "--tokens",
        "64",
        "--shape",
        "point-cloud",
        "--mode",
        "inference",
        "--padding-mask",
        "with",
        "--no-memory-cap",
        "--json",
        str(path),
    ]
    if importlib.util.find_spec("matplotlib") is None:
        argv.append("--no-plot")
    assert bench.main(argv) == 0
    payload = json.loads(path.read_text())
    assert payload["kind"] == "scale" and payload["settings"]["memory_cap_bytes"] is None
    assert [(r["name"], r["tokens"], r["status"]) for r in payload["cases"]] == [
        ("stock point-cloud inference +mask", 64, "ok"),
        ("slim point-cloud inference +mask", 64, "ok"),
    ]
    assert payload["cases"][0]["stock_path"] == "native fast path"  # the path that holds N x N scores
    for record in payload["cases"]:  # one fault count per timed call
        assert len(record["faults_per_call"]) == len(record["times_s"]) and min(record["faults_per_call"]) >= 0
    markdown = path.with_suffix(".md").read_text()
    assert "**point-cloud (E=64, H=4), inference**" in markdown
    assert "| N | stock, padding mask | slim, padding mask |" in markdown
    stock_peak, slim_peak = (payload["cases"][i]["peak_bytes"] for i in (0, 1))
    assert (
        f"* point-cloud inference +mask, N=64: stock +{scale_report.format_mib(stock_peak)}, slim +{scale_report.format_mib(slim_peak)}"
        in markdown
    )
    if "--no-plot" not in argv:
        assert path.with_suffix(".png").stat().st_size > 0
    captured = capsys.readouterr()
    out = captured.out
    assert "results written to" in out and "slim point-cloud inference +mask" in out
    assert "expected time: at most about 5 minutes" in out  # said before the sweep starts
    assert [line for line in (out + captured.err).splitlines() if len(line) >= 120] == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "0,64"], "--tokens: token counts must be positive integers"),
        (["--shape", "cube"], "argument --shape: unknown 'cube'; choose from point-cloud, transformer"),
        (["--memory-cap", "4XB"], "argument --memory-cap: '4XB' is not a positive size such as 4GiB or 512MiB"),
        (["--memory-cap", "1GiB", "--no-memory-cap"], "--memory-cap and --no-memory-cap contradict each other"),
    ],
)
def test_scale_cli_errors_are_one_line_without_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        bench.main(["scale", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_dry_run_lists_the_curves(capsys):
    assert bench.main(["scale", "--dry-run", "--device", "cpu", "--memory-cap", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("16 curves x 4 token counts on cpu (memory cap 2,048 MiB):")
    assert "  slim transformer train +mask: N = 1,024, 8,192, 32,768, 100,000" in out


def test_memory_axis_ticks_are_plain_mib():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots()
    axis.bar([0, 1], [0.5, 60.0])
    axis.set_yscale("log")
    scale_report.plain_mib_ticks(axis.yaxis)
    axis.set_ylim(0.3, 100)
    figure.canvas.draw()
    labels = {label.get_text() for label in axis.get_yticklabels() if label.get_text()}
    plt.close(figure)
    assert {"0.5", "1", "2", "5", "10", "20", "50", "100"} <= labels
    assert not any("10^" in label or "times" in label or "×" in label for label in labels), labels
