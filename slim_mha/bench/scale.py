"""``python -m slim_mha.bench --scale``: how time and memory grow with the number of tokens.

Set and point-cloud transformers attend over tens of thousands of tokens. This sweep runs stock
``nn.MultiheadAttention`` and slim at token counts N from 1k to 100k (to 1M on a GPU), for a
point-cloud shape (E=64, H=4) and a transformer shape (E=512, H=8), with and without a key padding
mask, in inference and training, always with ``need_weights=False``.

* **One process per case.** Each (contender, shape, mode, mask, N) runs in a fresh child process, so
  an out-of-memory failure is recorded as "OOM at N" and the sweep goes on. On CPU the child caps
  its own address space (``RLIMIT_AS``, default half the memory available when the sweep starts),
  so a contender that needs more fails at once with the allocator's error instead of swapping or
  waking the kernel's OOM killer on a shared machine. A child that is killed or runs past its
  timeout is recorded as such.
* **Time** is the median of one to five calls (forward in inference, forward and backward in
  training), repeated until a second has passed. **Memory** is the child's own peak: on CPU the
  peak resident set size above the resident size just before the calls (the high-water mark is
  reset there through ``/proc/self/clear_refs``), on CUDA ``max_memory_allocated`` above what was
  allocated before. Inputs, weights and the runtime are in the baseline; what remains is what the
  call needs.
* **Order and budgets.** The first configuration (point-cloud inference without a mask, by default)
  runs over every N first, then the others in order of N. A contender's curve stops after it
  fails, after a call takes longer than the case budget, or when the call at the next N is
  extrapolated (from the slope of its last two points) to take longer, unless it is extrapolated
  to need more memory than the cap (it then fails at once, which is the point to record); the sweep
  starts no case once its total budget is spent. Every case not run is recorded with the reason.

Output: JSON, a Markdown report (tables, the largest N each contender handled, memory at a common
N) and a log-log plot of time and memory against N.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["Series", "Settings", "build_series", "main", "measure_case", "run_sweep"]

SHAPES = {"point-cloud": (64, 4), "transformer": (512, 8)}  # name -> (embed_dim, num_heads)
MODES = ("inference", "train")
CONTENDERS = ("stock", "slim")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS = {
    "cpu": (1024, 8192, 32768, 100_000),
    "cuda": (1024, 4096, 16384, 65536, 131072, 262144, 524288, 1_000_000),
}
# Per device: (sweep budget, case budget) in seconds. The CPU default keeps the sweep to about five
# minutes on a 2-core machine; the curves it cuts short say where and why.
BUDGETS = {"cpu": (300.0, 30.0), "cuda": (600.0, 60.0)}
PADDED_FRACTION = 8  # with a padding mask, the last N // 8 keys of every sequence are padding
_RESULT_MARKER = "SLIM_MHA_SCALE_RESULT "
_OOM_MESSAGES = ("can't allocate memory", "out of memory", "cannot allocate memory")

_EXAMPLES = """\
examples:
  python -m slim_mha.bench --scale                          # default sweep (about 5 minutes on a 2-core CPU)
  python -m slim_mha.bench --scale --shape point-cloud --mode inference --padding-mask without
  python -m slim_mha.bench --scale --tokens 1024,8192,65536 --budget-s 1800 --case-budget-s 60
  python -m slim_mha.bench --scale --memory-cap 4GiB --json out/scale.json --markdown out/scale.md
  python -m slim_mha.bench --scale --dry-run                # list the cases without running them
"""


@dataclass(frozen=True)
class Series:
    """One curve: a contender on one shape, mode and mask, over N."""

    contender: str
    shape: str
    embed_dim: int
    num_heads: int
    mode: str
    padding_mask: bool

    @property
    def name(self) -> str:
        return f"{self.contender} {self.shape} {self.mode}{' +mask' if self.padding_mask else ''}"


@dataclass(frozen=True)
class Settings:
    device: str = "cpu"
    dtype: str = "fp32"
    batch: int = 1
    budget_s: float = 300.0
    case_budget_s: float = 20.0
    case_timeout_s: float = 120.0
    memory_cap_bytes: int | None = None  # CPU children only; None: no cap
    threads: int | None = None
    seed: int = 0


def build_series(shapes=None, modes=None, padding_masks=None, contenders=None) -> list[Series]:
    """The curves to draw, grouped so that stock and slim of one configuration run side by side."""
    return [
        Series(contender, shape, *SHAPES[shape], mode, masked)
        for shape in shapes or SHAPES
        for mode in modes or MODES
        for masked in (padding_masks if padding_masks is not None else (False, True))
        for contender in contenders or CONTENDERS
    ]


# ----------------------------------------------------------------------------------- the child


def measure_case(series: Series, tokens: int, settings: Settings) -> dict:
    """Run one case in this process and return its measurement (called in the child)."""
    device = torch.device(settings.device)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.memory_cap_bytes is not None and device.type == "cpu":
        _cap_address_space(settings.memory_cap_bytes)
    try:
        step, reset, stock_path = _build_step(series, tokens, settings, device)
        peak = _PeakMemory(device)
        times = _time_calls(step, reset, device)
        return {"status": "ok", "time_s": statistics.median(times), "times_s": times,
                "peak_bytes": peak.above_baseline(), "stock_path": stock_path}
    except Exception as error:  # noqa: BLE001 - anything else is recorded as an error, below
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        oom = isinstance(error, (MemoryError, torch.OutOfMemoryError)) or any(
            text in message.lower() for text in _OOM_MESSAGES
        )
        return {"status": "oom" if oom else "error", "detail": f"{type(error).__name__}: {message}"[:300]}


def _cap_address_space(cap_bytes: int) -> None:
    """Let this process map at most ``cap_bytes`` more than it has mapped now."""
    import resource  # POSIX only; the sweep caps its CPU cases through it

    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + cap_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _build_step(series: Series, tokens: int, settings: Settings, device: torch.device):
    """The timed step, its untimed reset, and which path stock took (after a small warm-up call)."""
    from torch import nn

    from ..attention import SlimMultiheadAttention

    dtype = DTYPES[settings.dtype]
    torch.manual_seed(settings.seed)
    E, H = series.embed_dim, series.num_heads
    module = nn.MultiheadAttention(E, H, batch_first=True, device=device, dtype=dtype)
    with torch.no_grad():  # trained-looking biases, the key slice included
        module.in_proj_bias.normal_(std=0.1)
        module.out_proj.bias.normal_(std=0.1)
    if series.contender == "slim":
        slim = SlimMultiheadAttention(E, H, batch_first=True, device=device, dtype=dtype)
        slim.load_state_dict(module.state_dict())
        module = slim
    training = series.mode == "train"
    module.train(training)

    def inputs(length: int):
        generator = torch.Generator(device="cpu").manual_seed(settings.seed + 1)
        x = torch.randn(settings.batch, length, E, generator=generator).to(device, dtype)  # (B, N, E)
        mask = None
        if series.padding_mask:
            mask = torch.zeros(settings.batch, length, dtype=torch.bool, device=device)  # (B, N)
            mask[:, length - max(1, length // PADDED_FRACTION) :] = True
        return x.requires_grad_(training), mask

    def step_on(x, mask):
        if training:
            out, _ = module(x, x, x, key_padding_mask=mask, need_weights=False)
            out.backward(torch.ones_like(out))
        else:
            with torch.inference_mode():
                module(x, x, x, key_padding_mask=mask, need_weights=False)

    def reset():
        for tensor in [*module.parameters(), x]:
            tensor.grad = None

    small = inputs(min(tokens, 64))
    stock_path = _warm_up_and_name_path(lambda: step_on(*small), series)
    x, mask = inputs(tokens)
    return (lambda: step_on(x, mask)), reset, stock_path


def _warm_up_and_name_path(step, series: Series) -> str | None:
    """One small call (kernels, thread pools); for stock at inference, whether it took its fast path."""
    if series.contender != "stock" or series.mode != "inference":
        step()
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    names = {event.key for event in profiler.key_averages()}
    return "native fast path" if "aten::_native_multi_head_attention" in names else "Python path"


class _PeakMemory:
    """Peak memory from here on, above what is in use now."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)
            return
        self.baseline = _status_bytes("VmRSS")
        try:  # reset the high-water mark to the current resident size (Linux 4.0+)
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            pass

    def above_baseline(self) -> int | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        peak = _status_bytes("VmHWM")
        return None if peak is None or self.baseline is None else max(0, peak - self.baseline)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _time_calls(step, reset, device: torch.device, *, min_total_s: float = 1.0, max_calls: int = 5) -> list[float]:
    times: list[float] = []
    while len(times) < max_calls and sum(times) < min_total_s:
        reset()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def _child_main() -> None:
    """Entry point of a case's process: argv[1] is the case as JSON; prints one result line."""
    spec = json.loads(sys.argv[1])
    result = measure_case(Series(**spec["series"]), spec["tokens"], Settings(**spec["settings"]))
    print(_RESULT_MARKER + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------- the sweep


def _run_child(series: Series, tokens: int, settings: Settings) -> dict:
    """Run one case in a fresh process; a crash, kill or timeout becomes a result, never an exception."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    spec = json.dumps({"series": asdict(series), "tokens": tokens, "settings": asdict(settings)})
    command = [sys.executable, "-c", "from slim_mha.bench.scale import _child_main; _child_main()", spec]
    started = time.perf_counter()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=settings.case_timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "detail": f"no result after {settings.case_timeout_s:.0f} s (killed)",
                "wall_s": time.perf_counter() - started}
    wall = time.perf_counter() - started
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith(_RESULT_MARKER):
            return {**json.loads(line[len(_RESULT_MARKER):]), "wall_s": wall}
    if completed.returncode < 0:
        status, detail = "killed", f"killed by signal {-completed.returncode} (out of memory?)"
    else:
        last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        oom = any(text in last.lower() for text in _OOM_MESSAGES)
        status, detail = ("oom" if oom else "error"), f"exit code {completed.returncode}: {last[:300]}"
    return {"status": status, "detail": detail, "wall_s": wall}


def _extrapolated(points: list[tuple[int, float]], tokens: int) -> float | None:
    """The value at ``tokens`` from the slope of the last two points in log-log, held between 1 and 2."""
    points = [(n, value) for n, value in points if value > 0]
    if not points:
        return None
    n_last, last = points[-1]
    slope = 2.0
    if len(points) >= 2:
        n_previous, previous = points[-2]
        slope = min(2.0, max(1.0, math.log(last / previous) / math.log(n_last / n_previous)))
    return last * (tokens / n_last) ** slope


def _over_time_budget(measured: list[dict], tokens: int, settings: Settings) -> str | None:
    """Why the curve should stop before ``tokens`` for time, or ``None``.

    A case that may need more memory than the cap (its peak grown quadratically from the last point)
    is run all the same: it fails at its first large allocation, at once, and that failure is the
    point the sweep is there to record.
    """
    if not measured:
        return None
    # Quadratic from the last point: an upper bound (the scores are N x N at most), where the local
    # slope would underestimate, as fixed costs flatten the small-N end of stock's curve.
    last_peak = measured[-1]["peak_bytes"] or 0
    memory = last_peak * (tokens / measured[-1]["tokens"]) ** 2
    if settings.memory_cap_bytes is not None and memory is not None and memory > settings.memory_cap_bytes:
        return None
    last = measured[-1]
    if last["time_s"] > settings.case_budget_s:
        return f"stopped after N={last['tokens']:,}: it took {last['time_s']:.0f} s > case budget {settings.case_budget_s:.0f} s"
    # From two points at least: a single small-N time is mostly fixed costs, and squaring it from
    # there would stop curves that have minutes to go (the case timeout still bounds a wrong guess).
    predicted = _extrapolated([(r["tokens"], r["time_s"]) for r in measured], tokens) if len(measured) >= 2 else None
    if predicted is not None and predicted > settings.case_budget_s:
        return f"stopped before N={tokens:,}: extrapolated {predicted:.0f} s > case budget {settings.case_budget_s:.0f} s"
    return None


def _stop_for_time(stops: dict, series: Series, measured: list[dict], tokens: int, settings: Settings) -> bool:
    reason = _over_time_budget(measured, tokens, settings)
    if reason is not None:
        stops[series] = reason
    return reason is not None


def run_sweep(
    series_list: list[Series], tokens: list[int], settings: Settings, *, lead: int = 0, on_case=None, run_case=None
) -> dict:
    """Every (N, series) case, stock and slim side by side; returns the cases and why curves stopped.

    The first ``lead`` curves run over every N first, then the rest in order of N, so that a short
    budget still follows the leading configuration to its limits. ``run_case(series, tokens,
    settings)`` returns a case's result (default: measured in a child process).
    """
    run_case = run_case or _run_child
    started = time.perf_counter()
    cases, stops = [], {}
    measured: dict[Series, list[dict]] = {series: [] for series in series_list}
    order = [(n, series) for group in (series_list[:lead], series_list[lead:]) for n in sorted(tokens) for series in group]
    for n, series in order:
        record = {"series": asdict(series), "name": series.name, "tokens": n, "batch": settings.batch}
        if series not in stops and time.perf_counter() - started > settings.budget_s:
            record.update(status="skipped", detail=f"not run: the sweep budget of {settings.budget_s:.0f} s was spent")
        elif series in stops or _stop_for_time(stops, series, measured[series], n, settings):
            record.update(status="skipped", detail=stops[series])
        else:
            record["load_average"] = _load_average()
            record.update(run_case(series, n, settings))
            if record["status"] == "ok":
                measured[series].append(record)
            else:
                stops[series] = f"{record['status'].upper() if record['status'] == 'oom' else record['status']} at N={n:,}"
        cases.append(record)
        if on_case is not None:
            on_case(record)
    return {"cases": cases, "stops": {series.name: reason for series, reason in stops.items()},
            "elapsed_s": time.perf_counter() - started}


def _load_average() -> list[float] | None:
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except OSError:
        return None


def default_memory_cap() -> int | None:
    """Half the memory available now (``MemAvailable``, cgroup and ``RLIMIT_AS`` headroom)."""
    from .._memory_guard import available_bytes

    available, _ = available_bytes(torch.device("cpu"))
    return None if available is None else available // 2


# ---------------------------------------------------------------------------------- reporting


def _mib(count: int | None) -> str:
    return "?" if count is None else f"{count / 2**20:,.0f} MiB"


def _cell(record: dict) -> str:
    status = record["status"]
    if status == "ok":
        return f"{record['time_s']:.3g} s, +{_mib(record['peak_bytes'])}"
    if status == "oom":
        return "**OOM**"
    if status == "skipped":
        if "sweep budget" in record["detail"]:
            return "not run (sweep budget)"
        return "not run (time)" if "case budget" in record["detail"] else "—"
    return f"**{status}**"


def largest_handled(cases: list[dict]) -> dict[str, int | None]:
    """Per series name, the largest N it ran."""
    largest: dict[str, int | None] = {}
    for record in cases:
        largest.setdefault(record["name"], None)
        if record["status"] == "ok":
            largest[record["name"]] = max(largest[record["name"]] or 0, record["tokens"])
    return largest


def common_n_memory(cases: list[dict]) -> dict[tuple, tuple[int, int | None, int | None]]:
    """Per (shape, mode, padding mask): the largest N both stock and slim ran, and their peaks there."""
    ran: dict[tuple, dict[int, dict[str, int | None]]] = {}
    for record in cases:
        if record["status"] == "ok":
            series = record["series"]
            key = (series["shape"], series["mode"], series["padding_mask"])
            ran.setdefault(key, {}).setdefault(record["tokens"], {})[series["contender"]] = record["peak_bytes"]
    common = {}
    for key, by_n in ran.items():
        both = [n for n, peaks in by_n.items() if {"stock", "slim"} <= set(peaks)]
        if both:
            n = max(both)
            common[key] = (n, by_n[n]["stock"], by_n[n]["slim"])
    return common


def format_markdown(payload: dict) -> str:
    settings, cases = payload["settings"], payload["cases"]
    environment = payload["environment"]
    cap = settings["memory_cap_bytes"]
    lines = [
        f"Command: `{payload['command']}`",
        "",
        f"{environment['device_name']} ({environment['cpu_count']} cores, {environment['torch_threads']} torch threads), "
        f"torch {environment['torch']}, {settings['dtype']}, B={settings['batch']}, `need_weights=False`, "
        f"commit {environment.get('git_commit') or '?'}, {environment['date']}. "
        f"Memory cap per case: {'none' if cap is None else _mib(cap)}; budgets: {settings['budget_s']:.0f} s "
        f"for the sweep, {settings['case_budget_s']:.0f} s per call; 1-minute load average "
        f"{payload['load_before']} before, {payload['load_after']} after; {payload['elapsed_s']:.0f} s in all.",
        "",
        "Each cell: median time of one call, peak memory above the baseline (RSS on CPU). "
        f"With a padding mask the last N/{PADDED_FRACTION} keys are padding.",
    ]
    groups: dict[tuple[str, str], dict[tuple[int, str], dict]] = {}
    for record in cases:
        series = record["series"]
        column = f"{series['contender']}{', padding mask' if series['padding_mask'] else ''}"
        groups.setdefault((series["shape"], series["mode"]), {})[(record["tokens"], column)] = record
    for (shape, mode), cells in groups.items():
        E, H = SHAPES.get(shape, ("?", "?"))
        columns = list(dict.fromkeys(column for _, column in cells))
        tokens = sorted({n for n, _ in cells})
        lines += ["", f"**{shape} (E={E}, H={H}), {mode}**", "",
                  "| N | " + " | ".join(columns) + " |", "|--:|" + "--:|" * len(columns)]
        for n in tokens:
            lines.append(f"| {n:,} | " + " | ".join(_cell(cells[(n, c)]) if (n, c) in cells else "" for c in columns) + " |")
    lines += ["", "Memory at the largest N both contenders ran:", ""]
    common = common_n_memory(cases)
    if not common:
        lines.append("* none: no N was run by both")
    for (shape, mode, masked), (n, stock, slim) in common.items():
        lines.append(f"* {shape} {mode}{' +mask' if masked else ''}, N={n:,}: stock +{_mib(stock)}, slim +{_mib(slim)}"
                     + (f" ({stock / slim:,.1f}x less)" if stock and slim else ""))
    lines += ["", "Largest N each contender ran, and why its curve stopped:", ""]
    unrun = {r["name"]: r["tokens"] for r in reversed(cases) if "sweep budget" in r.get("detail", "")}
    for name, largest in largest_handled(cases).items():
        reason = payload["stops"].get(name) or (
            f"the sweep budget was spent before N={unrun[name]:,}" if name in unrun else "ran every N"
        )
        lines.append(f"* {name}: {'none' if largest is None else f'{largest:,}'} ({reason})")
    lines += [f"* note: {note}" for note in payload.get("notes", [])]
    return "\n".join(lines)


def format_table(cases: list[dict]) -> str:
    rows = [f"{'case':<40} {'N':>9}  result"]
    for record in cases:
        detail = _cell(record) if record["status"] in ("ok", "oom") else record.get("detail", record["status"])
        if record["status"] == "oom":
            detail = f"OOM: {record.get('detail', '')}"
        rows.append(f"{record['name']:<40} {record['tokens']:>9,}  {detail}")
    return "\n".join(rows)


_COLOURS = {"stock": "tab:red", "slim": "tab:blue"}
_STYLES = {"point-cloud": "-", "transformer": "--"}


def plot_scale(payload: dict, path: Path) -> str:
    """Log-log time and memory against N, inference and training side by side; a one-line note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'slim-mha[bench]')"
    cases = payload["cases"]
    modes = [mode for mode in MODES if any(r["series"]["mode"] == mode for r in cases)]
    if not modes:
        return "plot skipped: no case ran"
    figure, axes = plt.subplots(2, len(modes), figsize=(6.5 * len(modes), 9), squeeze=False)
    cap = payload["settings"]["memory_cap_bytes"]
    for column, mode in enumerate(modes):
        time_axis, memory_axis = axes[0][column], axes[1][column]
        time_points: list[tuple[float, float]] = []
        memory_points: list[tuple[float, float]] = []
        by_series: dict[str, list[dict]] = {}
        for record in cases:
            if record["series"]["mode"] == mode:
                by_series.setdefault(record["name"], []).append(record)
        for name, records in by_series.items():
            series = records[0]["series"]
            style = dict(color=_COLOURS.get(series["contender"], "k"), linestyle=_STYLES.get(series["shape"], ":"),
                         marker="s" if series["padding_mask"] else "o",
                         markerfacecolor="none" if series["padding_mask"] else None)
            ok = [r for r in records if r["status"] == "ok"]
            if not ok and not any(r["status"] in ("oom", "killed", "timeout") for r in records):
                continue  # never ran: no legend entry
            label = f"{series['contender']} {series['shape']}{' +mask' if series['padding_mask'] else ''}"
            time_axis.plot([r["tokens"] for r in ok], [r["time_s"] for r in ok], label=label, **style)
            memory = [(r["tokens"], r["peak_bytes"] / 2**20) for r in ok if r.get("peak_bytes")]
            memory_axis.plot([n for n, _ in memory], [m for _, m in memory], label=label, **style)
            time_points += [(r["tokens"], r["time_s"]) for r in ok]
            memory_points += memory
            failed = [r for r in records if r["status"] in ("oom", "killed", "timeout")]
            for record in failed:
                level = cap / 2**20 if cap else max((m for _, m in memory), default=1.0)
                memory_axis.plot([record["tokens"]], [level], marker="X", markersize=11, color=style["color"], linestyle="")
                memory_axis.annotate(f"{record['status'].upper()} at {record['tokens']:,}", (record["tokens"], level),
                                     textcoords="offset points", xytext=(-30, 8), fontsize=8, color=style["color"])
        if cap:
            memory_axis.axhline(cap / 2**20, color="grey", linewidth=0.8, linestyle=":")
            memory_axis.annotate("memory cap per case", (0.01, cap / 2**20), xycoords=("axes fraction", "data"),
                                 fontsize=8, color="grey", textcoords="offset points", xytext=(0, -12))
        for axis, what, points in (
            (time_axis, "time of one call (s)", time_points),
            (memory_axis, "peak memory above baseline (MiB)", memory_points),
        ):
            if not any(y > 0 for _, y in points):  # e.g. tiny N, where nothing rose above the baseline
                axis.text(0.5, 0.5, "nothing above the baseline", transform=axis.transAxes, ha="center")
                continue
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.set_xlabel("tokens N")
            axis.set_ylabel(what)
            axis.grid(True, which="both", alpha=0.3)
            _draw_slopes(axis, points)
        time_axis.set_title(f"{mode}: time")
        memory_axis.set_title(f"{mode}: memory (quadratic: N x N scores; linear: SDPA)")
        time_axis.legend(fontsize=8)
    environment = payload["environment"]
    figure.suptitle(f"stock vs slim MHA against N, need_weights=False ({environment['device_name']}, "
                    f"{payload['settings']['dtype']}, B={payload['settings']['batch']})", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot written to {path}"


def _draw_slopes(axis, points: list[tuple[float, float]]) -> None:
    """Grey guide lines of slope 1 and 2 from the lowest measured point (log-log)."""
    points = [(x, y) for x, y in points if x > 0 and y > 0]
    if len({x for x, _ in points}) < 2:
        return
    x0, x1 = min(x for x, _ in points), max(x for x, _ in points)
    y0 = min(y for _, y in points)
    for slope, label in ((1, "∝ N"), (2, "∝ N²")):
        axis.plot([x0, x1], [y0, y0 * (x1 / x0) ** slope], color="grey", linewidth=0.7, linestyle=":")
        axis.annotate(label, (x1, y0 * (x1 / x0) ** slope), fontsize=8, color="grey")


# ---------------------------------------------------------------------------------------- CLI


def _csv(choices=None, kind=str):
    def parse(text: str) -> list:
        items = [kind(item.strip()) for item in text.split(",") if item.strip()]
        bad = [item for item in items if choices is not None and item not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(str, bad))}; choose from {', '.join(choices)}")
        return items

    return parse


def _bytes(text: str) -> int:
    units = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 10**9, "mb": 10**6, "b": 1}
    lowered = text.strip().lower()
    for unit, size in units.items():
        if lowered.endswith(unit):
            try:
                value = float(lowered[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return int(value * size)
            break
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive size such as 4GiB or 512MiB")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slim-mha-bench --scale",
        description="How time and memory of stock and slim attention grow with the number of tokens N "
        "(need_weights=False), each case in its own capped process.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available")
    parser.add_argument("--tokens", type=_csv(kind=int), metavar="N,N,...", help="token counts (default: 1k to 100k on CPU, to 1M on CUDA)")
    parser.add_argument("--shape", type=_csv(tuple(SHAPES)), metavar="NAME,...", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--mode", type=_csv(MODES), metavar="MODE,...", help="comma list of inference, train")
    parser.add_argument("--padding-mask", choices=("both", "with", "without"), default="both")
    parser.add_argument("--contender", type=_csv(CONTENDERS), metavar="NAME,...", help="comma list of stock, slim")
    parser.add_argument("--batch", type=int, default=1, help="sequences per call (default: 1)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--budget-s", type=float, help="start no case after this many seconds (default: 300 CPU, 600 CUDA)")
    parser.add_argument("--case-budget-s", type=float, help="stop a curve once a call takes, or is extrapolated to take, longer (default: 30 CPU, 60 CUDA)")
    parser.add_argument("--case-timeout-s", type=float, help="kill a case's process after this long (default: 4x the case budget + 60)")
    parser.add_argument("--memory-cap", type=_bytes, metavar="SIZE", help="address space each CPU case may add, e.g. 4GiB (default: half the available memory)")
    parser.add_argument("--no-memory-cap", action="store_true", help="do not cap the cases' memory (not on a shared machine)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads in each case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="results file (default: bench-out/slim_mha_scale_<device>.json)")
    parser.add_argument("--markdown", type=Path, help="Markdown report (default: the JSON path with .md)")
    parser.add_argument("--plot", type=Path, help="log-log plot (default: the JSON path with .png)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    return parser


def _settings_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available to this torch; use --device cpu")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    for name in ("batch", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("budget_s", "case_budget_s", "case_timeout_s"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if any(n < 1 for n in args.tokens or ()):
        parser.error("--tokens: token counts must be positive integers")
    if args.memory_cap is not None and args.no_memory_cap:
        parser.error("--memory-cap and --no-memory-cap contradict each other; pass one")
    budget, case_budget = BUDGETS[device]
    case_budget = args.case_budget_s or case_budget
    cap = None if args.no_memory_cap or device == "cuda" else (args.memory_cap or default_memory_cap())
    return Settings(
        device=device,
        dtype=args.dtype or ("bf16" if device == "cuda" else "fp32"),
        batch=args.batch,
        budget_s=args.budget_s or budget,
        case_budget_s=case_budget,
        case_timeout_s=args.case_timeout_s or 4 * case_budget + 60,
        memory_cap_bytes=cap,
        threads=args.threads,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = _settings_from(parser, args)
    masks = {"both": None, "with": [True], "without": [False]}[args.padding_mask]
    series_list = build_series(args.shape, args.mode, masks, args.contender)
    tokens = sorted(set(args.tokens or TOKENS[settings.device]))
    if args.dry_run:
        print(f"{len(series_list)} curves x {len(tokens)} token counts on {settings.device} "
              f"(memory cap {_mib(settings.memory_cap_bytes) if settings.memory_cap_bytes else 'none'}):")
        print("\n".join(f"  {series.name}: N = {', '.join(f'{n:,}' for n in tokens)}" for series in series_list))
        return 0

    from .report import write_json
    from .runner import describe_environment

    if settings.threads:
        torch.set_num_threads(settings.threads)
    json_path = args.json or Path("bench-out") / f"slim_mha_scale_{settings.device}.json"
    payload = {
        "schema": 1,
        "kind": "scale",
        "command": " ".join(["python -m slim_mha.bench --scale", *(argv if argv is not None else sys.argv[1:])]),
        "environment": describe_environment(torch.device(settings.device)),
        "settings": asdict(settings),
        "tokens": tokens,
        "load_before": _load_average(),
        "cases": [],
        "stops": {},
        "notes": [],
    }
    print(f"slim_mha scale sweep: {len(series_list)} curves x {len(tokens)} token counts on {settings.device}, "
          f"memory cap {_mib(settings.memory_cap_bytes) if settings.memory_cap_bytes else 'none'}, "
          f"budget {settings.budget_s:.0f} s", flush=True)

    def on_case(record: dict) -> None:
        payload["cases"].append(record)
        write_json(json_path, payload)
        if record["status"] != "skipped" or "budget" not in record.get("detail", ""):
            print(f"  {record['name']:<40} N={record['tokens']:>9,}  "
                  f"{_cell(record) if record['status'] == 'ok' else record.get('detail', record['status'])}",
                  file=sys.stderr, flush=True)

    # The first configuration (the point-cloud shape at inference, without a mask, by default) runs
    # over every N first: even a short budget then records stock's OOM point and slim's largest N.
    lead = len(args.contender or CONTENDERS)
    result = run_sweep(series_list, tokens, settings, lead=lead, on_case=on_case)
    payload.update(stops=result["stops"], elapsed_s=result["elapsed_s"], load_after=_load_average())
    if not args.no_plot:
        payload["notes"].append(plot_scale(payload, args.plot or json_path.with_suffix(".png")))
    markdown_path = args.markdown or json_path.with_suffix(".md")
    write_json(json_path, payload)
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(format_markdown(payload) + "\n")
    print(format_table(payload["cases"]))
    print("\n".join(payload["notes"]))
    print(f"results written to {json_path} and {markdown_path} ({payload['elapsed_s']:.0f} s)")
    return 0
