"""The sweep's results as a terminal table and a Markdown report."""

from __future__ import annotations

from .cases import PADDED_FRACTION, SHAPES

__all__ = [
    "common_n_memory",
    "fit_line",
    "format_cell",
    "format_markdown",
    "format_mib",
    "format_table",
    "largest_handled",
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
        lines += [
            "",
            f"**{shape} (E={E}, H={H}), {mode}**",
            "",
            "| N | " + " | ".join(columns) + " |",
            "|--:|" + "--:|" * len(columns),
        ]
        for n in tokens:
            lines.append(
                f"| {n:,} | "
                + " | ".join(format_cell(cells[(n, c)]) if (n, c) in cells else "" for c in columns)
                + " |"
            )
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
    rows = [f"{'case':<40} {'N':>9}  result"]
    for record in cases:
        detail = format_cell(record) if record["status"] in ("ok", "oom") else record.get("detail", record["status"])
        if record["status"] == "oom":
            detail = f"OOM: {record.get('detail', '')}"
        rows.append(fit_line(f"{record['name']:<40} {record['tokens']:>9,}  {detail}"))
    return "\n".join(rows)
