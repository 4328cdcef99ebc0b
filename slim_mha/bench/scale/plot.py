"""The sweep's log-log plot of time and memory against N."""

from __future__ import annotations

from pathlib import Path

from ..measure.output import plain_mib_ticks
from .cases import MODES

__all__ = ["plot_scale"]


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
