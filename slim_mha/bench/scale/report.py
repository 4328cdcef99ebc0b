"""The sweep's results as a terminal table, a Markdown report and a log-log plot of time and memory
against N."""

from __future__ import annotations

from pathlib import Path

from ..measure.output import table
from .cases import MODES, PADDED_FRACTION, SHAPES

__all__ = [
    "common_n_memory",
    "fit_line",
    "format_cell",
    "format_markdown",
    "format_mib",
    "format_table",
    "largest_handled",
    "plain_mib_ticks",
    "plot_scale",
]


MAX_COLUMNS = 119  # terminal lines stay below 120 columns; the JSON keeps every detail in full


def fit_line(line: str) -> str:
    """``line`` cut to :data:`MAX_COLUMNS`, ending in '...' where it was cut."""
    return line if len(line) <= MAX_COLUMNS else line[: MAX_COLUMNS - 3] + "..."


def format_mib(count: int | None) -> str:
    return "?" if count is None else f"{count / 2**20:,.0f} MiB"


def format_cell(record: dict) -> str:
    status = record["status"]
    if status == "ok":
        return f"{record['time_s']:.3g} s, +{format_mib(record['peak_bytes'])}"
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
        f"Memory cap per case: {'none' if cap is None else format_mib(cap)}; budgets: {settings['budget_s']:.0f} s "
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
        rows = [[f"{n:,}", *(format_cell(cells[(n, c)]) if (n, c) in cells else "" for c in columns)] for n in tokens]
        lines += ["", f"**{shape} (E={E}, H={H}), {mode}**", ""]
        lines += table(["N", *columns], rows, "r" * (len(columns) + 1), markdown=True)
    lines += ["", "Memory at the largest N both contenders ran:", ""]
    common = common_n_memory(cases)
    if not common:
        lines.append("* none: no N was run by both")
    for (shape, mode, masked), (n, stock, slim) in common.items():
        lines.append(
            f"* {shape} {mode}{' +mask' if masked else ''}, N={n:,}: stock +{format_mib(stock)}, slim +{format_mib(slim)}"
            + (f" ({stock / slim:,.1f}x less)" if stock and slim else "")
        )
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
    rows = []
    for record in cases:
        detail = format_cell(record) if record["status"] == "ok" else record.get("detail", record["status"])
        rows.append(
            [record["name"], f"{record['tokens']:,}", f"OOM: {detail}" if record["status"] == "oom" else detail]
        )
    return "\n".join(fit_line(line) for line in table(["case", "N", "result"], rows, "lrl"))


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
        _plot_mode(
            axes[0][column],
            axes[1][column],
            [record for record in cases if record["series"]["mode"] == mode],
            mode,
            cap,
        )
    environment = payload["environment"]
    figure.suptitle(
        f"stock vs slim MHA against N, need_weights=False ({environment['device_name']}, "
        f"{payload['settings']['dtype']}, B={payload['settings']['batch']})",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot written to {path}"


def _plot_mode(time_axis, memory_axis, cases: list[dict], mode: str, cap: int | None) -> None:
    """One mode's column: time above, memory below, every series of ``cases`` (that mode's), failures marked."""
    time_points: list[tuple[float, float]] = []
    memory_points: list[tuple[float, float]] = []
    by_series: dict[str, list[dict]] = {}
    for record in cases:
        by_series.setdefault(record["name"], []).append(record)
    for records in by_series.values():
        series = records[0]["series"]
        style = dict(
            color=_COLOURS.get(series["contender"], "k"),
            linestyle=_STYLES.get(series["shape"], ":"),
            marker="s" if series["padding_mask"] else "o",
            markerfacecolor="none" if series["padding_mask"] else None,
        )
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
            memory_axis.annotate(
                f"{record['status'].upper()} at {record['tokens']:,}",
                (record["tokens"], level),
                textcoords="offset points",
                xytext=(-30, 8),
                fontsize=8,
                color=style["color"],
            )
    _finish_axes(time_axis, memory_axis, time_points, memory_points, cap)
    time_axis.set_title(f"{mode}: time")
    memory_axis.set_title(f"{mode}: memory (quadratic: N x N scores; linear: SDPA)")
    time_axis.legend(fontsize=8)


def _finish_axes(time_axis, memory_axis, time_points: list, memory_points: list, cap: int | None) -> None:
    """The memory cap drawn, both axes log-log with their labels and slopes (or a note where empty)."""
    if cap:
        memory_axis.axhline(cap / 2**20, color="grey", linewidth=0.8, linestyle=":")
        memory_axis.annotate(
            "memory cap per case",
            (0.01, cap / 2**20),
            xycoords=("axes fraction", "data"),
            fontsize=8,
            color="grey",
            textcoords="offset points",
            xytext=(0, -12),
        )
    for axis, what, points in (
        (time_axis, "time of one call (s)", time_points),
        (memory_axis, "peak memory above baseline (MiB)", memory_points),
    ):
        if not any(y > 0 for _, y in points):  # e.g. tiny N, where nothing rose above the baseline
            axis.text(0.5, 0.5, "nothing above the baseline", transform=axis.transAxes, ha="center")
            continue
        axis.set_xscale("log")
        axis.set_yscale("log")
        if axis is memory_axis:
            plain_mib_ticks(axis.yaxis)  # plain MiB (0.5, 2, 60), not 6x10^1
        axis.set_xlabel("tokens N")
        axis.set_ylabel(what)
        axis.grid(True, which="both", alpha=0.3)
        _draw_slopes(axis, points)


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


def plain_mib_ticks(axis) -> None:
    """Plain numbers on a log axis of MiB (0.5, 2, 60), where matplotlib would write 6x10^1."""
    from matplotlib.ticker import (  # the optional bench extra
        FuncFormatter,
        LogLocator,
        NullFormatter,
    )

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())
