"""bench_scale's report: the summary table (rich), the slot-use plot (polar_gym.plots) and the files under
benchmarks/results/ (the summary JSON, one line per session, slot use over time, the table as text, the plot)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.table import Table

__all__ = ["compare_table", "fmt", "plot", "table", "write_outputs"]


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(summary: dict[str, Any]) -> Table:
    s = summary
    use, lat, cpu = s["slot_use"], s["latency"], s["cpu"]
    t = Table(title=f"scale: {s['sessions']} sessions, {s['gateways']} gateways, {s['total_slots']} run slots "
                    f"({s['launcher']}), time scale {s['time_scale']}, {s['cpus']} CPUs")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("baseline / ratio", justify="right")
    t.add_row("makespan s", fmt(s["makespan_s"]), f"ideal {s['ideal_makespan_s']:.1f} s: {s['makespan_ratio']:.2f}x")
    t.add_row("throughput sessions/min", fmt(s["sessions_per_minute"]), "-")
    for name in ("makespan", "while_queued"):
        u = use[name]
        t.add_row(f"slot use, {name.replace('_', ' ')}: mean / p10",
                  f"{fmt(u['mean'], '.1%')} / {fmt(u['p10'], '.1%')}", f"vs 100 %: {fmt(u['mean'], '.2f')}x")
        for g, v in sorted(u["per_gateway"].items()):
            t.add_row(f"  {g}", f"{fmt(v['mean'], '.1%')} / {fmt(v['p10'], '.1%')}", "")
    for name, d in lat.items():
        t.add_row(f"{name.replace('_', ' ')} p50/p90/p99 ms",
                  f"{fmt(d['p50_ms'])} / {fmt(d['p90_ms'])} / {fmt(d['p99_ms'])}", f"n={d['n']}")
    t.add_row("server CPU ms / session", fmt(cpu["server_ms_per_session"], ".2f"),
              f"net of heartbeats {fmt(cpu['server_ms_per_session_net_of_heartbeats'], '.2f')}")
    t.add_row("server CPU ms / heartbeat (idle)", fmt(cpu["server_idle_ms_per_heartbeat"], ".2f"), "")
    t.add_row("gateway CPU ms / session (process)", fmt(cpu["gateway_ms_per_session"], ".1f"),
              f"sandboxes {fmt(cpu['sandbox_children_ms_per_session'], '.1f')}")
    if s["calibration"]:
        c = s["calibration"]
        t.add_row("gateway CPU ms / model call", fmt(c["gateway_cpu_ms_per_call"], ".2f"),
                  f"1-call session {fmt(c['gateway_cpu_ms_per_session_one_call'], '.1f')}")
    if s["store"]:
        st = s["store"]
        t.add_row("server alone: CPU ms / session, writes, commits", f"{st['server_cpu_ms_per_session']:.2f}, "
                  f"{st['writes_per_session']:.1f}, {st['commits_per_session']:.1f}",
                  f"{st['sessions_per_second']:.0f} sessions/s")
    r = s["results"]
    if r:
        t.add_row("result KB mean; largest: KB packed (JSON), token ids",
                  f"{r['result_kb_mean']:.1f}; {r['largest_kb']:.0f} ({r['largest_json_kb']:.0f}), "
                  f"{r['largest_token_ids']}", f"{r['bytes_per_unique_token_byte']:.2f}x unique token bytes")
        t.add_row("server event-loop CPU ms / largest result: packed vs JSON",
                  f"{r['loop_ms_packed']:.2f} vs {r['loop_ms_json']:.1f}",
                  f"{r['loop_ms_json'] / max(r['loop_ms_packed'], 1e-3):.0f}x less")
    m = s["memory"]
    t.add_row("RSS MB start / max / end: server", f"{fmt(m['server_rss_mb_start'], '.0f')} / "
              f"{fmt(m['server_rss_mb_max'], '.0f')} / {fmt(m['server_rss_mb_end'], '.0f')}",
              f"{fmt(m['server_mb_per_finished_session'], '.3f')} MB / session")
    t.add_row("RSS MB start / max / end: largest gateway", f"{fmt(m['gateway_rss_mb_start'], '.0f')} / "
              f"{fmt(m['gateway_rss_mb_max'], '.0f')} / {fmt(m['gateway_rss_mb_end'], '.0f')}",
              f"{fmt(m['gateway_mb_per_finished_session'], '.3f')} MB / session")
    t.add_row("statuses", str(s["statuses"]), f"{s['model_calls']} model calls")
    return t


def plot(series: list[dict[str, Any]], summary: dict[str, Any]) -> str | None:
    """Slot use over time (overall and per gateway) with the backlog, as SVG text (None without matplotlib)."""
    try:
        from polar_gym.plots import PALETTE, figure, svg_of
    except ImportError:
        return None
    xs = [p["t"] for p in series]
    with figure("bench-scale-slots", width=8.0, height=3.6) as (fig, ax):
        ax.plot(xs, [p["overall"] * 100 for p in series], color=PALETTE["blue"], lw=1.6, label="overall")
        for g, colour in zip(sorted(summary["run_slots"]), ("orange", "green", "purple", "sky", "red"), strict=False):
            ax.plot(xs, [p["per_gateway"][g] * 100 for p in series], color=PALETTE[colour], lw=0.6, alpha=0.7,
                    label=g)
        ax.set_xlabel("seconds since the first submit")
        ax.set_ylabel("run slots busy, %")
        ax.set_ylim(0, 105)
        twin = ax.twinx()
        twin.fill_between(xs, [p["backlog"] for p in series], color=PALETTE["grey"], alpha=0.15, lw=0)
        twin.set_ylabel("sessions waiting to run")
        ax.legend(loc="lower center", fontsize=7, ncols=5)
        ax.set_title(f"run-slot use: {summary['sessions']} sessions on {summary['total_slots']} slots")
        return svg_of(fig)


def compare_table(mine: dict[str, Any], theirs: dict[str, Any], rev: str) -> Table:
    """This tree's run against the baseline's run of the same sessions, side by side, with the ratios."""
    t = Table(title=f"this tree vs the server of {rev}: {mine['sessions']} vs {theirs['sessions']} sessions "
                    f"({mine['launcher']})")
    t.add_column("measure")
    for name in ("this tree", rev, "ratio"):
        t.add_column(name, justify="right")

    def row(name: str, a: float | None, b: float | None, spec: str) -> None:
        ratio = f"{a / b:.2f}x" if a is not None and b else "-"
        t.add_row(name, fmt(a, spec), fmt(b, spec), ratio)

    row("sessions COMPLETED once (one attempt)", mine["completed_once"], theirs["completed_once"], ".0f")
    row("makespan / ideal", mine["makespan_ratio"], theirs["makespan_ratio"], ".2f")
    row("slot use while queued", mine["slot_use"]["while_queued"]["mean"], theirs["slot_use"]["while_queued"]["mean"],
        ".1%")
    row("server CPU ms / session", mine["cpu"]["server_ms_per_session"], theirs["cpu"]["server_ms_per_session"],
        ".2f")
    for name in ("submitted_to_dispatched", "slot_freed_to_next_running"):
        row(f"{name.replace('_', ' ')} p99 ms", mine["latency"][name]["p99_ms"], theirs["latency"][name]["p99_ms"],
            ".1f")
    row("stored KB / result", mine["storage"]["stored_bytes_per_result"] / 1024,
        theirs["storage"]["stored_bytes_per_result"] / 1024, ".1f")
    row("stored / unique token bytes", mine["storage"]["stored_per_unique_token_byte"],
        theirs["storage"]["stored_per_unique_token_byte"], ".2f")
    return t


def write_outputs(res: dict[str, Any], out: Path, rendered: RenderableType) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = {**res["summary"], **({"baseline": res["baseline"]} if "baseline" in res else {})}
    (out / "bench_scale.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (out / "bench_scale_sessions.jsonl").open("w") as f:
        for row in res["sessions"]:
            f.write(json.dumps(row) + "\n")
    with (out / "bench_scale_slots.jsonl").open("w") as f:
        for point in res["series"]:
            f.write(json.dumps(point) + "\n")
    with (out / "bench_scale_samples.jsonl").open("w") as f:
        for sample in res["samples"]:
            f.write(json.dumps(sample) + "\n")
    with open(os.devnull, "w") as sink:
        text = Console(width=140, record=True, file=sink)
        text.print(rendered)
    (out / "bench_scale.md").write_text("```\n" + text.export_text() + "```\n")
    svg = plot(res["series"], res["summary"])
    if svg is not None:
        (out / "bench_scale_slots.svg").write_text(svg)
