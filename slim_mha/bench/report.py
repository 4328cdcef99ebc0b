"""Turning results into a terminal table, a target verdict, a JSON file and a speed-up plot."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "TargetCheck",
    "evaluate_targets",
    "format_markdown",
    "format_profiles",
    "format_table",
    "format_targets",
    "plot_speedup",
    "write_json",
]

_MIB = 1024 * 1024
CONTENDER_ORDER = ("stock", "slim", "floor")


@dataclass(frozen=True)
class TargetCheck:
    """One target against the cases it applies to: how many meet it, and the worst case."""

    target: str
    threshold: float
    met: int
    total: int
    worst_value: float | None
    worst_case: str | None
    # For speed targets: stock/floor at the worst case, the most any implementation of the same
    # operations could reach there; a threshold above it cannot be met by trimming the module.
    floor_bound: float | None = None

    @property
    def passed(self) -> bool:
        return self.met == self.total

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _ms(summary: dict) -> str:
    return f"{summary['median_ms']:9.2f} ±{summary['iqr_over_median'] * 50:3.0f}%"


def _ratio(result: dict, key: str) -> str:
    """Median of the per-repeat ratios and their quartiles: ``1.45x (1.31-1.60)``."""
    low, high = result.get("ratio_spread", {}).get(key, (None, None))
    spread = f" ({low:.2f}-{high:.2f})" if low is not None else ""
    return f"{result['ratios'][key]:.2f}x{spread}"


def _mib(value: int | None) -> str:
    return "      -" if value is None else f"{value / _MIB:7.1f}"


def format_table(results: list[dict]) -> str:
    """One row per case: median ms (± half the IQR), ratios, peak and saved-for-backward MiB."""
    header = (
        f"{'mode':<18} {'attn':<5} w {'shape':<26} {'dtype':<5}|"
        f"{'stock ms':>15}{'slim ms':>15}{'floor ms':>15} |"
        f"{'stock/slim (IQR)':>20}{'slim/floor (IQR)':>20} |"
        f"{'peak MiB stock':>15}{'slim':>8}{'floor':>8} |"
        f"{'saved MiB stock':>16}{'slim':>8}"
    )
    lines = [header, "-" * len(header)]
    for result in results:
        case, time, memory = result["case"], result["time"], result["memory"]
        shape = f"B={case['batch']} L={case['seq_len']} E={case['embed_dim']} H={case['num_heads']}"
        flag = "" if result["agrees"] else "  MISMATCH"
        lines.append(
            f"{case['mode']:<18} {case['attention']:<5} {'w' if case['need_weights'] else '-'} "
            f"{shape:<26} {case['dtype']:<5}|"
            f"{_ms(time['stock'])}{_ms(time['slim'])}{_ms(time['floor'])} |"
            f"{_ratio(result, 'stock_over_slim'):>20}{_ratio(result, 'slim_over_floor'):>20} |"
            f"{_mib(memory['stock']['peak_bytes']):>15}{_mib(memory['slim']['peak_bytes']):>8}"
            f"{_mib(memory['floor']['peak_bytes']):>8} |"
            f"{_mib(memory['stock']['saved_bytes']):>16}{_mib(memory['slim']['saved_bytes']):>8}{flag}"
        )
    return "\n".join(lines)


def format_profiles(results: list[dict]) -> str:
    """Top ops by self time per contender, for the cases profiled with ``--profile``."""
    blocks = []
    for result in results:
        if not result.get("profile"):
            continue
        lines = [f"profile: {' '.join(result['name'].split())} (per step; self time)"]
        for name, rows in result["profile"].items():
            memory = result["memory"][name]
            allocated = memory.get("allocated_bytes")
            extra = f", {allocated / _MIB:.1f} MiB allocated" if allocated is not None else ""
            lines.append(f"  {name}: {memory.get('aten_calls')} aten calls{extra}")
            for row in rows:
                device = f" {row['self_device_ms']:8.2f} ms device" if row["self_device_ms"] else ""
                lines.append(f"    {row['op'][:44]:<44} {row['self_cpu_ms']:8.2f} ms cpu{device}  x{row['calls']:g}")
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def format_markdown(payload: dict) -> str:
    """The run as markdown: environment, one table row per case, the target verdicts, the notes."""
    environment = payload["environment"]
    lines = [
        f"- command: `{payload['command']}`",
        f"- date: {environment['date']}; torch {environment['torch']}; slim_mha {environment['slim_mha']}"
        + (f" (commit {environment['git_commit']})" if environment.get("git_commit") else ""),
        f"- device: {environment['device_name']}; {environment['torch_threads']} torch threads; "
        f"elapsed {payload.get('elapsed_s', 0):.0f} s",
        "",
        "| mode | attn | weights | B | L | E | H | dtype | stock ms | slim ms | floor ms | stock/slim | slim/floor "
        "| peak MiB stock / slim / floor | saved MiB stock / slim |",
        "|---|---|---|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for result in payload["cases"]:
        case, time, memory = result["case"], result["time"], result["memory"]
        peaks = " / ".join(_mib(memory[name]["peak_bytes"]).strip() for name in CONTENDER_ORDER)
        saved = " / ".join(_mib(memory[name]["saved_bytes"]).strip() for name in ("stock", "slim"))
        times = [
            f"{time[name]['median_ms']:.2f} ±{time[name]['iqr_over_median'] * 50:.0f}%"
            for name in CONTENDER_ORDER
        ]
        lines.append(
            f"| {case['mode']} | {case['attention']} | {'yes' if case['need_weights'] else 'no'} | {case['batch']} "
            f"| {case['seq_len']} | {case['embed_dim']} | {case['num_heads']} | {case['dtype']} | {' | '.join(times)} "
            f"| {_ratio(result, 'stock_over_slim')} | {_ratio(result, 'slim_over_floor')} | {peaks} | {saved} |"
        )
    checks = [
        TargetCheck(**{key: value for key, value in target.items() if key != "passed"})
        for target in payload.get("targets", [])
    ]
    lines += ["", "```", format_targets(checks), "```"]
    lines += [f"- {note}" for note in payload.get("notes", [])]
    return "\n".join(lines)


def _check(
    target: str,
    threshold: float,
    rows: list[tuple[str, float]],
    *,
    at_most: bool = False,
    bounds: dict[str, float] | None = None,
) -> TargetCheck:
    if not rows:
        return TargetCheck(target, threshold, 0, 0, None, None)
    met = sum((value <= threshold) if at_most else (value >= threshold) for _, value in rows)
    worst_case, worst_value = (max if at_most else min)(rows, key=lambda row: row[1])
    bound = bounds.get(worst_case) if bounds else None
    return TargetCheck(target, threshold, met, len(rows), worst_value, worst_case, bound)


def evaluate_targets(results: list[dict], device: str) -> list[TargetCheck]:
    """Issue 6's CPU targets, or issue 7's CUDA targets, against the measured cases.

    Cases with the equivariance check on do extra work by design; they are reported as the cost of
    the check and left out of the speed, floor and memory targets.
    """
    plain = [result for result in results if result["case"]["mode"] != "train-equivariance"]

    def ratio(key: str, selected: list[dict]) -> list[tuple[str, float]]:
        return [(result["name"], result["ratios"][key]) for result in selected]

    bounds = dict(ratio("stock_over_floor", results))

    inference = [result for result in plain if result["case"]["mode"] == "inference"]
    training = [result for result in plain if result["case"]["mode"] == "train"]
    peak_ratio = [
        (result["name"], result["memory"]["slim"]["peak_bytes"] / max(result["memory"]["stock"]["peak_bytes"], 1))
        for result in plain
    ]
    agreement = [(result["name"], 1.0 if result["agrees"] else 0.0) for result in results]
    if device == "cuda":
        checks = [
            _check("inference: stock/slim >= 1.2", 1.2, ratio("stock_over_slim", inference), bounds=bounds),
            _check("training fwd+bwd: stock/slim >= 1.05", 1.05, ratio("stock_over_slim", training), bounds=bounds),
        ]
    else:
        targeted = [result for result in inference if result["target_shape"] and result["case"]["attention"] == "self"]
        checks = [
            _check(
                "CPU inference at the target shapes, need_weights=False: stock/slim >= 1.5",
                1.5,
                ratio("stock_over_slim", [r for r in targeted if not r["case"]["need_weights"]]),
                bounds=bounds,
            ),
            _check(
                "CPU inference at the target shapes, need_weights=True: stock/slim >= 1.5",
                1.5,
                ratio("stock_over_slim", [r for r in targeted if r["case"]["need_weights"]]),
                bounds=bounds,
            ),
            _check("CPU training fwd+bwd: stock/slim >= 1.1", 1.1, ratio("stock_over_slim", training), bounds=bounds),
        ]
    checks += [
        _check("every case: stock/slim >= 0.97", 0.97, ratio("stock_over_slim", plain), bounds=bounds),
        _check("every case: slim/floor <= 1.10", 1.10, ratio("slim_over_floor", plain), at_most=True),
        _check("every case: peak memory slim/stock <= 1.0", 1.0, peak_ratio, at_most=True),
        _check("every case: slim agrees with stock (relative error within dtype tolerance)", 1.0, agreement),
    ]
    return checks


def format_targets(checks: list[TargetCheck]) -> str:
    lines = ["Targets:"]
    for check in checks:
        if not check.total:
            lines.append(f"  n/a   {check.target} (no case measured)")
            continue
        verdict = "MET " if check.passed else "MISS"
        bound = f" (floor: stock/floor {check.floor_bound:.3f})" if check.floor_bound is not None else ""
        lines.append(
            f"  {verdict}  {check.target}: {check.met}/{check.total} cases; "
            f"worst {check.worst_value:.3f} at {' '.join(check.worst_case.split())}{bound}"
        )
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    temporary.replace(path)  # a run cut short never leaves half a file behind


_LINE_STYLES = {("self", False): "-", ("self", True): "--", ("cross", False): ":", ("cross", True): "-."}


def plot_speedup(results: list[dict], path: Path) -> str:
    """Speed-up against sequence length: one row of two panels per mode; returns a one-line note.

    In each row the left panel is stock/slim (median and quartiles of the per-repeat ratios), the
    right one floor/slim. Colour tells the width (E, H, dtype), line style the attention kind and
    whether weights were returned.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'slim-mha[bench]')"

    # (mode, attention, need_weights, width label) -> [(seq_len, speed-up, floor share, q1, q3)]
    lines: dict[tuple, list[tuple]] = defaultdict(list)
    for result in results:
        case, ratios = result["case"], result["ratios"]
        width = f"E={case['embed_dim']} H={case['num_heads']} {case['dtype']}"
        low, high = result.get("ratio_spread", {}).get("stock_over_slim", (ratios["stock_over_slim"],) * 2)
        point = (case["seq_len"], ratios["stock_over_slim"], 1.0 / ratios["slim_over_floor"], low, high)
        lines[(case["mode"], case["attention"], case["need_weights"], width)].append(point)
    lines = {key: sorted(points) for key, points in lines.items() if len({p[0] for p in points}) >= 2}
    if not lines:
        return "plot skipped: no configuration was measured at two or more sequence lengths"

    modes = [mode for mode in ("inference", "train", "train-equivariance") if any(key[0] == mode for key in lines)]
    widths = sorted({key[3] for key in lines})
    colours = {width: f"C{index % 10}" for index, width in enumerate(widths)}
    lengths = sorted({point[0] for points in lines.values() for point in points})
    figure, axes = plt.subplots(len(modes), 2, figsize=(15, 4.2 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        speed, floor = axes[row]
        for (line_mode, attention, weights, width), points in sorted(lines.items()):
            if line_mode != mode:
                continue
            style = dict(color=colours[width], linestyle=_LINE_STYLES[(attention, weights)], marker="o", markersize=4)
            xs = [point[0] for point in points]
            errors = [[p[1] - p[3] for p in points], [p[4] - p[1] for p in points]]
            label = f"{attention} {'weights' if weights else 'no weights'}, {width}"
            speed.errorbar(xs, [p[1] for p in points], yerr=errors, capsize=2, label=label, **style)
            floor.plot(xs, [p[2] for p in points], **style)
        speed.axhline(1.0, color="grey", linewidth=0.8)
        floor.axhline(1.0, color="grey", linewidth=0.8)
        floor.axhline(1 / 1.1, color="grey", linewidth=0.8, linestyle="--")
        speed.set(xscale="log", ylabel="stock time / slim time", title=f"{mode}: speed-up over stock")
        floor.set(xscale="log", ylabel="floor time / slim time", title=f"{mode}: share of the floor's speed")
        for axis in (speed, floor):
            axis.set_xticks(lengths, [str(length) for length in lengths])
            axis.minorticks_off()
            axis.set_xlabel("sequence length")
        floor.legend(*speed.get_legend_handles_labels(), fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot written to {path}"
