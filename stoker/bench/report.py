"""Presenting a bench run: rich tables and a live progress bar on the terminal;
results.json, report.md and PNG plots in --out DIR.

Tables are built once as rows of strings and rendered twice (rich, markdown)
so the terminal and the report never disagree."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from stoker.bench.stats import (
    COMPARE_METRICS,
    HIGHER_IS_BETTER,
    LATENCY_METRICS,
    metric,
)

Rows = tuple[list[str], list[list[str]]]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def throughput_rows(merged: Sequence[dict[str, Any]]) -> Rows:
    header = ["target", "stage", "ok", "failed", "out tok/s", "total tok/s", "req/s", "goodput"]
    costed = any("cost_per_million_output" in m["summary"] for m in merged)
    if costed:
        header += ["$/1M out", "$/1M total"]
    cached = any(m["summary"].get("cached_share") is not None for m in merged)
    if cached:
        header += ["cached"]
    rows = []
    for m in merged:
        s = m["summary"]
        failed = str(s["failed"]) + (
            " (" + ", ".join(f"{k}: {v}" for k, v in s["failures"].items()) + ")" if s["failures"] else ""
        )
        goodput = f"{s['goodput'] * 100:.0f}%" if "goodput" in s else "-"
        rows.append(
            [
                m["target"],
                m["stage"],
                str(s["completed"]),
                failed,
                _num(s["output_tok_s"]),
                _num(s["total_tok_s"]),
                _num(s["req_s"], ".2f"),
                goodput,
            ]
            + (
                [_num(s.get("cost_per_million_output"), ".3f"), _num(s.get("cost_per_million_total"), ".3f")]
                if costed
                else []
            )
            + (
                [_num(s["cached_share"] * 100, ".0f") + "%" if s.get("cached_share") is not None else "-"]
                if cached
                else []
            )
        )
    return header, rows


def latency_rows(merged: Sequence[dict[str, Any]]) -> Rows:
    header = ["target", "stage", "metric (ms)", "mean", "p50", "p90", "p99", "max"]
    rows = []
    for m in merged:
        for name in LATENCY_METRICS:
            p = m["summary"][name]
            rows.append(
                [
                    m["target"],
                    m["stage"],
                    name.upper(),
                    _ms(p["mean"]),
                    _ms(p["p50"]),
                    _ms(p["p90"]),
                    _ms(p["p99"]),
                    _ms(p["max"]),
                ]
            )
    return header, rows


def compare_rows(comparisons: Sequence[dict[str, Any]], merged: Sequence[dict[str, Any]]) -> Rows:
    """One row per (stage, other server, metric): pooled values side by side,
    then the geometric mean of per-repetition ratios and their spread."""
    header = ["stage", "metric", "base", "other", "base value", "other value", "base ÷ other", "pairs min–max"]
    pooled = {(m["target"], m["stage"]): m["summary"] for m in merged}
    rows = []
    for c in comparisons:
        for name in COMPARE_METRICS:
            r = c["ratios"][name]
            b, o = (metric(pooled.get((t, c["stage"]), {}), name) for t in (c["base"], c["other"]))
            show = _num if name in HIGHER_IS_BETTER else _ms
            label = name if name in HIGHER_IS_BETTER else f"{name} (ms)"
            rows.append(
                [
                    c["stage"],
                    label,
                    c["base"],
                    c["other"],
                    show(b),
                    show(o),
                    "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
                    "-" if r["ratio"] is None else f"{r['min']:.2f}–{r['max']:.2f} ({r['pairs']})",
                ]
            )
    return header, rows


def render_rich(console: Console, title: str, rows: Rows) -> None:
    header, body = rows
    table = Table(title=escape(title), title_justify="left")
    for i, h in enumerate(header):
        numeric = all(_numeric(r[i]) for r in body)
        table.add_column(escape(h), justify="right" if numeric else "left")
    for row in body:
        table.add_row(*(escape(c) for c in row))
    console.print(table)


def _numeric(cell: str) -> bool:
    head = cell.split(" ")[0].split("–")[0].rstrip("%x")
    try:
        float(head)
    except ValueError:
        return cell == "-"
    return True


def render_markdown(title: str, rows: Rows) -> str:
    header, body = rows
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def print_report(console: Console, merged: Sequence[dict[str, Any]], comparisons: Sequence[dict[str, Any]]) -> None:
    render_rich(console, "Throughput", throughput_rows(merged))
    render_rich(console, "Latency", latency_rows(merged))
    if comparisons:
        render_rich(
            console, "Side by side (ratio: geometric mean over paired repetitions)", compare_rows(comparisons, merged)
        )


def make_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[red]{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def write_outputs(out_dir: str, result: dict[str, Any], command: str) -> list[str]:
    """results.json (every request), report.md, and plots; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "report.md")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    md = [
        "# stoker bench serve\n",
        f"```\n{command}\n```\n",
        render_markdown("Throughput", throughput_rows(result["merged"])),
        render_markdown("Latency", latency_rows(result["merged"])),
    ]
    if result.get("comparisons"):
        md.append(
            render_markdown(
                "Side by side (ratio: geometric mean over paired repetitions)",
                compare_rows(result["comparisons"], result["merged"]),
            )
        )
    plots = plot_all(out_dir, result)
    md += [f"![{os.path.basename(p)}]({os.path.basename(p)})\n" for p in plots]
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    return paths + plots


def plot_all(out_dir: str, result: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, name in zip(axes.flat, LATENCY_METRICS):
        for group in _groups(result["runs"]):
            values = _latencies(group["requests"], name)
            if values:
                xs = np.sort(np.asarray(values) * 1000)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{group['target']} {group['stage']}")
        ax.set_title(f"{name.upper()} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of token gaps")
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize="small")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    paths.append(os.path.join(out_dir, "latency_cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    sweep = [m for m in result["merged"] if m.get("stage_value") is not None and m["stage"].startswith("c=")]
    if len({m["stage"] for m in sweep}) >= 2:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
        for target in dict.fromkeys(m["target"] for m in sweep):
            pts = sorted((m["stage_value"], m["summary"]) for m in sweep if m["target"] == target)
            stages = [p[0] for p in pts]
            a1.plot(stages, [p[1]["output_tok_s"] for p in pts], marker="o", label=target)
            a2.plot(stages, [(p[1]["ttft"]["p99"] or float("nan")) * 1000 for p in pts], marker="o", label=target)
        for ax, title, ylabel in ((a1, "output throughput", "tok/s"), (a2, "p99 TTFT", "ms")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(
                sorted({m["stage_value"] for m in sweep}), [f"{v:g}" for v in sorted({m["stage_value"] for m in sweep})]
            )
            ax.set_title(f"{title} vs concurrency")
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "sweep.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _groups(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs pooled by (target, stage), repetitions together."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in runs:
        g = groups.setdefault((r["target"], r["stage"]), {"target": r["target"], "stage": r["stage"], "requests": []})
        g["requests"].extend(r["requests"])
    return list(groups.values())


def _latencies(requests: Sequence[dict[str, Any]], name: str) -> list[float]:
    ok = [q for q in requests if q["ok"]]
    if name == "itl":
        return [x for q in ok for x in q["itls"]]
    return [q[name] for q in ok if q.get(name) is not None]


# ------------------------------------------------------------------- soak


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def soak_rss_rows(summary: dict[str, Any]) -> Rows:
    header = [
        "process",
        "start MiB",
        "after warm-up MiB",
        "end MiB",
        "max MiB",
        "last min",
        "growth MiB",
        "growth",
        "slope MiB/min",
    ]
    rows = []
    for role, r in summary["rss"].items():
        slope = r["slope_bytes_per_min"]
        rows.append(
            [
                role,
                _mib(r["start"]),
                _mib(r["after_warmup"]),
                _mib(r["end"]),
                _mib(r["max"]),
                f"{r['window_minutes']:.1f}",
                f"{r['growth'] / 2**20:+.1f}",
                "-" if r["growth_pct"] is None else f"{r['growth_pct']:+.2f}%",
                "-" if slope is None else f"{slope / 2**20:+.2f}",
            ]
        )
    return header, rows


def soak_request_rows(summary: dict[str, Any]) -> Rows:
    header = ["kind", "sent", "as expected", "not"]
    rows = [
        [kind, str(n), str(summary["ok_by_kind"].get(kind, 0)), str(n - summary["ok_by_kind"].get(kind, 0))]
        for kind, n in sorted(summary["by_kind"].items())
    ]
    return header, rows


def soak_error_rows(summary: dict[str, Any]) -> Rows:
    return ["status or error", "count"], [[k, str(v)] for k, v in sorted(summary["errors_by_status"].items())]


def _soak_headline(summary: dict[str, Any]) -> str:
    return (
        f"{summary['requests']} requests in {summary['seconds']:.0f}s, {summary['errors']} errors; "
        f"statuses {summary['statuses']}; GET /health after: {summary['health_after']}"
    )


def print_soak(console: Console, data: dict[str, Any]) -> None:
    s = data["summary"]
    render_rich(
        console, "Requests (json / stream / cancel: completed or cut off as planned; bad: a 4xx)", soak_request_rows(s)
    )
    if s["errors_by_status"]:
        render_rich(console, "Errors", soak_error_rows(s))
        for example in s["error_examples"]:
            console.print(f"  e.g. {escape(example)}")
    if s["rss"]:
        render_rich(console, "RSS of the server's processes", soak_rss_rows(s))
    console.print(_soak_headline(s))


def write_soak_outputs(out_dir: str, data: dict[str, Any]) -> list[str]:
    """results.json (config, summary, every RSS sample and request), report.md, rss.png."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "report.md")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    s = data["summary"]
    md = [
        "# stoker bench serve --soak\n",
        f"```\n{data.get('command', '')}\n```\n",
        _soak_headline(s) + "\n",
        render_markdown("Requests", soak_request_rows(s)),
    ]
    if s["errors_by_status"]:
        md.append(render_markdown("Errors", soak_error_rows(s)))
    if s["rss"]:
        md.append(render_markdown("RSS of the server's processes", soak_rss_rows(s)))
    if data["rss_samples"]:
        paths.append(plot_rss(out_dir, data))
        md.append("![rss.png](rss.png)\n")
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    return paths


def plot_rss(out_dir: str, data: dict[str, Any]) -> str:
    """RSS of each process over time, and requests finished, on a shared time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = data["rss_samples"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(3, 1))
    roles = dict.fromkeys(p["role"] for s in samples for p in s["procs"])
    for role in roles:
        pts = [(s["t"] / 60, p["rss"] / 2**20) for s in samples for p in s["procs"] if p["role"] == role]
        a1.plot([p[0] for p in pts], [p[1] for p in pts], label=role)
    cfg = data["config"]
    end = samples[-1]["t"] / 60
    a1.axvspan(max(0.0, end - cfg["growth_window"]), end, color="grey", alpha=0.12, label="growth window")
    a1.set_ylabel("RSS (MiB)")
    a1.set_title("RSS of the server's processes")
    a1.grid(alpha=0.3)
    a1.legend(fontsize="small")
    a2.plot([s["t"] / 60 for s in samples], [s["done"] for s in samples])
    a2.set_ylabel("requests done")
    a2.set_xlabel("minutes")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, "rss.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
