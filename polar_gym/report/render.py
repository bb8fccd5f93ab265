"""report.html as text: one self-contained page (inline CSS, inline SVG plots, no script, no request).

Every string that comes from a run (task ids, reasons, causes, stderr, config values) is escaped by :func:`_e`,
which also replaces control characters; a Content-Security-Policy forbids scripts and every outside request, so
even a mistake here could not make the page run code or call home."""

from __future__ import annotations

import datetime
import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from polar_gym.report.model import (
    TIMED_STAGES,
    RunData,
    cause_counts,
    reward_per_task,
    slot_use,
    stage_stats,
    status_counts,
)
from polar_gym.report.training import trained_summary

__all__ = ["CSP", "MAX_ROWS", "render_html"]

#: rows a table shows at most (a page for 100k sessions stays one a browser opens quickly)
MAX_ROWS = 2000

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_CSS = """
:root { --fg:#1d2330; --muted:#5b6475; --line:#dde2ea; --bg:#f6f7fa; --card:#fff; --red:#b3261e; --green:#11723f; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; color:var(--fg);
       background:var(--bg); }
header { padding:18px 28px 8px; } header h1 { margin:0 0 4px; font-size:22px; }
header p { margin:0; color:var(--muted); }
main { padding:0 28px 40px; max-width:1500px; }
.cards { display:flex; flex-wrap:wrap; gap:12px; margin:14px 0 6px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 14px; min-width:140px; }
.card .value { font-size:22px; font-weight:600; } .card .label { color:var(--muted); font-size:12px; }
.card.bad .value { color:var(--red); } .card.good .value { color:var(--green); }
section { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:12px 18px;
          margin:16px 0; }
section h2 { font-size:17px; margin:2px 0 10px; }
.row { display:flex; flex-wrap:wrap; gap:18px; align-items:flex-start; }
figure { margin:0; } figure svg { max-width:100%; height:auto; }
table { border-collapse:collapse; font-size:13px; margin:6px 0; }
th, td { border-bottom:1px solid var(--line); padding:3px 10px 3px 0; text-align:left; vertical-align:top; }
th { color:var(--muted); font-weight:600; } td.num, th.num { text-align:right; }
.infra { color:var(--red); font-weight:600; }
pre { background:#f1f3f7; padding:8px; border-radius:6px; overflow:auto; max-height:420px; font-size:12px;
      white-space:pre-wrap; word-break:break-all; }
code { font-size:12px; } details summary { cursor:pointer; color:var(--muted); margin:4px 0; }
.note { color:var(--muted); font-size:12px; }
.banner { margin:14px 0 0; padding:10px 14px; border-radius:8px; font-weight:600; }
.banner.bad { background:#fbe9e7; border:1px solid var(--red); color:var(--red); }
"""


def _e(value: object) -> str:
    """Escaped text: printable characters (newlines and tabs kept), ``<>&"'`` as entities."""
    text = "".join(c if c.isprintable() or c in "\n\t" else "\N{REPLACEMENT CHARACTER}" for c in str(value))
    return html.escape(text, quote=True)


def _num(value: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def _table(header: Sequence[str], rows: Iterable[Sequence[object]], numeric: Iterable[int] = (),
           raw: Iterable[int] = ()) -> str:
    """A table; cells are escaped unless their column is in ``raw`` (markup built here from escaped parts)."""
    numbers, markup = set(numeric), set(raw)
    head = "".join(f'<th{" class=num" if i in numbers else ""}>{_e(h)}</th>' for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in numbers else ""}>'
                                    f'{cell if i in markup else _e(cell)}</td>' for i, cell in enumerate(row))
                   + "</tr>\n" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>"


def _more(total: int) -> str:
    return (f'<p class="note">the first {MAX_ROWS} of {total} rows; every one is in results.jsonl</p>'
            if total > MAX_ROWS else "")


def _figure(figures: Mapping[str, str], name: str) -> str:
    svg = figures.get(name)
    return f'<figure id="fig-{name}">{svg}</figure>' if svg else ""


def _cards(run: RunData) -> str:
    s, f = run.sessions, run.fidelity
    completed = sum(x.status == "COMPLETED" for x in s)
    rewards = [x.reward for x in s if x.reward is not None]
    causes = cause_counts(s)
    errors = ", ".join(f"{n} {c}" for c, n in causes.items()) or "none"
    infra = any(c in run.infra_causes for c in causes)
    cards = [("sessions", str(len(s)), ""), ("completed", str(completed), "good" if s and completed == len(s) else ""),
             ("errors by cause", errors, "bad" if infra else ""),
             ("mean reward", _num(sum(rewards) / len(rewards) if rewards else None), ""),
             ("traces", str(f.traces), ""), ("trainable tokens", str(f.trainable_tokens), ""),
             ("contiguity", "ok" if not f.not_contiguous else f"BROKEN in {f.not_contiguous}",
              "bad" if f.not_contiguous else "good")]
    if run.wall_seconds is not None:
        cards.append(("wall seconds", f"{run.wall_seconds:.1f}", ""))
    return '<div class="cards">' + "".join(
        f'<div class="card {cls}" data-key="{_e(key)}"><div class="value">{_e(value)}</div>'
        f'<div class="label">{_e(key)}</div></div>' for key, value, cls in cards) + "</div>"


def _sessions_section(run: RunData, figures: Mapping[str, str]) -> str:
    statuses, causes = status_counts(run.sessions), cause_counts(run.sessions)
    first: dict[str, str] = {}
    for x in run.sessions:
        if x.cause is not None:
            first.setdefault(x.cause, x.reason)
    cause_rows = [(f'<span class="infra">{_e(c)}</span>' if c in run.infra_causes else _e(c), n,
                   "infrastructure" if c in run.infra_causes else "run", first.get(c, "")[:300])
                  for c, n in causes.items()]
    text = _table(["status", "sessions"], statuses.items(), numeric=[1])
    if causes:
        text += _table(["cause", "sessions", "kind", "first reason"], cause_rows, numeric=[1], raw=[0])
        text += ('<p class="note">Infrastructure causes (the fleet failed, not the policy) are unscored: they are '
                 "not rewards of 0.</p>")
    if run.lost_jobs:
        text += _table(["lost job", "name", "state", "replaced by"],
                       [(j.get("job_id"), j.get("name"), j.get("state"), j.get("replaced_by") or "-")
                        for j in run.lost_jobs])
        text += ('<p class="note">A lost gateway\'s sessions were re-dispatched to the others; a lost server or '
                 "inference job ended the run (its unfinished sessions: job_lost).</p>")
    return (f'<section id="sessions"><h2>Sessions by status and cause</h2><div class="row">'
            f'{_figure(figures, "status")}<div>{text}</div></div></section>')


def _rewards_section(run: RunData, figures: Mapping[str, str]) -> str:
    tasks = reward_per_task(run.sessions)
    rows = [(t.task_id, t.sessions, t.scored, _num(t.mean)) for t in tasks[:MAX_ROWS]]
    table = _table(["task", "sessions", "scored", "mean reward"], rows, numeric=[1, 2, 3]) + _more(len(tasks))
    if len(rows) > 20:
        table = f"<details><summary>reward of each of the {len(tasks)} tasks</summary>{table}</details>"
    return (f'<section id="rewards"><h2>Rewards</h2><div class="row">{_figure(figures, "rewards")}'
            f'{_figure(figures, "reward-histogram")}</div>{table}</section>')


def _timings_section(run: RunData, figures: Mapping[str, str]) -> str:
    stats = [(st.stage, st.count, f"{st.p50:.3f}", f"{st.p90:.3f}", f"{st.max:.3f}")
             for st in stage_stats(run.sessions, TIMED_STAGES)]
    use = slot_use(run.sessions)
    peaks = ", ".join(f"{stage} {use.peak(stage)}" for stage in use.counts if use.peak(stage)) or "-"
    return (f'<section id="timings"><h2>Stage timings and run-slot use</h2><div class="row">'
            f'{_figure(figures, "stages")}{_figure(figures, "slots")}</div>'
            f'{_table(["stage", "sessions", "p50 s", "p90 s", "max s"], stats, numeric=[1, 2, 3, 4])}'
            f'<p>Most sessions at once, by stage: <span id="slot-peaks">{_e(peaks)}</span></p></section>')


def _fidelity_section(run: RunData, figures: Mapping[str, str]) -> str:
    f = run.fidelity
    per = f"{f.traces / f.sessions:.2f}" if f.sessions else "-"
    rows = [("trainable tokens (mask 1: sampled by the engine)", f.trainable_tokens),
            ("masked tokens (mask 0: tool results, user turns)", f.masked_tokens),
            ("prompt tokens", f.prompt_tokens), ("traces", f.traces), ("chains (traces) per session", per),
            ("new chains by cause", ", ".join(f"{c} {n}" for c, n in f.breaks.items()) or "none"),
            ("drift breaks", f.breaks.get("drift", 0)), ("superseded retries", f.superseded),
            ("side-request traces", f.side_request_traces), ("traces without logprobs", f.without_logprobs),
            ("merged over a re-rendering", f.rerender_merged),
            ("contiguity", "ok" if not f.not_contiguous else f"BROKEN in {f.not_contiguous} traces"),
            ("prompt mode (calls)", ", ".join(f"{m} {n}" for m, n in f.prompt_modes.items()) or "unknown"),
            ("malformed tool calls (by the run's policy)", f.malformed_text())]
    note = f'<p class="note">{_e(run.fidelity_note)}</p>' if run.fidelity_note else ""
    return (f'<section id="fidelity"><h2>Token fidelity</h2><p><code id="fidelity-line">{_e(f.line())}</code></p>'
            f'{note}<div class="row">{_figure(figures, "fidelity")}{_table(["", "value"], rows, numeric=[1])}</div>'
            "</section>")


def _failures_section(run: RunData, limit: int = 50) -> str:
    if not run.harness_failures:
        return ""
    parts = []
    for h in run.harness_failures[:limit]:
        code = "-" if h.exit_code is None else str(h.exit_code)
        excerpt = h.stderr_tail[-1500:].strip() or "(empty)"
        parts.append(f"<h3>{_e(h.task_id)} #{h.sample_index} · {_e(h.harness)} · {_e(h.status)} · exit {_e(code)}"
                     f"</h3><p class=note>session <code>{_e(h.session_id)}</code></p><pre>{_e(excerpt)}</pre>")
    more = (f'<p class="note">{len(run.harness_failures) - limit} more in results.jsonl (metadata.harness)</p>'
            if len(run.harness_failures) > limit else "")
    return (f'<section id="harness-failures"><h2>Harness failures ({len(run.harness_failures)})</h2>'
            f'<p class="note">The end of each harness\'s stderr (artifacts/harness.stderr in its session folder).</p>'
            f'{"".join(parts)}{more}</section>')


def _session_table(run: RunData) -> str:
    step = any(s.step is not None for s in run.sessions)
    header = (["step"] if step else []) + ["task", "sample", "harness", "status", "cause", "reward", "traces",
                                           "completions", "seconds"]
    rows = [([s.step] if step else []) + [s.task_id, s.sample_index, s.harness, s.status, s.cause or "",
                                         _num(s.reward, "{:g}"), s.traces, s.completions, f"{s.seconds:.1f}"]
            for s in run.sessions[:MAX_ROWS]]
    shift = 1 if step else 0
    table = (_table(header, rows, numeric=[i + shift for i in (1, 6, 7, 8, 9)] + ([0] if step else []))
             + _more(len(run.sessions)))
    opened = " open" if len(rows) <= 200 else ""
    return (f'<section id="session-table"><h2>Sessions ({len(rows)})</h2><details{opened}><summary>one row per '
            f"session</summary>{table}</details></section>")


def _not_trained_banner(run: RunData) -> str:
    """A red line at the top when steps of the run did not train (the rows' ``trained`` / ``not_trained_reasons``):
    a run that trained on nothing must not read as a run that trained."""
    summary = trained_summary(run.train_rows)
    return f'<p class="banner bad" id="not-trained">{_e(summary)}</p>' if summary else ""


#: the per-step mismatch and correction columns (train_metrics.jsonl keys written by the GRPO trainer), in order
CORRECTION_COLUMNS = (("|Δ logprob| mean", "audit/logprob_abs_diff_mean"), ("|Δ| max", "audit/logprob_abs_diff_max"),
                      ("k3 KL", "rollout_corr/k3_kl"), ("χ² token", "rollout_corr/chi2_token"),
                      ("IS weight mean", "rollout_corr/correction_is_mean"),
                      ("ESS", "rollout_corr/correction_is_eff_sample_size"),
                      ("truncated", "rollout_corr/correction_truncated_fraction"),
                      ("masked tokens", "masked_tokens/rollout_correction"),
                      ("tokens of unknown / dropped versions", "guard/tokens_unknown_version"))


def _correction_section(run: RunData) -> str:
    """Per GRPO step: the guard's mismatch metrics (each token against its sampling version's weights) and the
    rollout correction's statistics, with whether the step trained; absent for runs whose rows lack them."""
    rows = [r for r in run.train_rows if any(key in r for _, key in CORRECTION_COLUMNS)]
    if not rows:
        return ""

    def cell(row: Mapping[str, Any], key: str) -> str:
        value = row.get(key)
        if key == "guard/tokens_unknown_version" and value is not None:
            value = float(value) + float(row.get("guard/tokens_version_not_kept", 0.0))
        return "-" if not isinstance(value, int | float) else f"{value:.3g}"

    body = [[str(r.get("step", "")), "yes" if r.get("trained", True) else "no: " + ", ".join(
        str(x) for x in r.get("not_trained_reasons", [])), *[cell(r, key) for _, key in CORRECTION_COLUMNS]]
            for r in rows[:MAX_ROWS]]
    table = _table(["step", "trained", *[name for name, _ in CORRECTION_COLUMNS]], body,
                   numeric=range(2, 2 + len(CORRECTION_COLUMNS)))
    return ('<section id="correction"><h2>Trainer vs engine: mismatch and correction</h2>'
            '<p class="note">Mismatch: each token scored by the weights of the policy version that sampled it '
            "(trainer.mismatch_metric above trainer.max_mismatch refuses the step). Correction: importance weights "
            "of the current weights against the engine's logprobs (trainer.rollout_correction); masked tokens are "
            f"not trained.</p>{table}{_more(len(rows))}</section>")


def render_html(run: RunData, figures: Mapping[str, str], *, generated: datetime.datetime | None = None) -> str:
    """The whole page."""
    when = (generated or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d %H:%M:%S UTC")
    training = (f'<section id="training"><h2>Training</h2>{_figure(figures, "training")}'
                '<p class="note">Shaded: a 95 % interval where the step has one (reward_mean +- 1.96 reward_se; an '
                "evaluation's KEY_lo..KEY_hi).</p></section>" if "training" in figures else "")
    config = (f'<section id="config"><h2>Resolved config</h2><details><summary>config.yaml</summary>'
              f'<pre>{_e(run.config_text or "(no config.yaml)")}</pre></details></section>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(run.title)} · polar_gym run report</title><style>{_CSS}</style></head>\n<body>"
            f"<header><h1>{_e(run.title)}</h1><p>{_e(run.out_dir)} · generated {when}</p></header><main>"
            f"{_not_trained_banner(run)}{_cards(run)}{_sessions_section(run, figures)}{_rewards_section(run, figures)}"
            f"{_timings_section(run, figures)}{_fidelity_section(run, figures)}{training}{_correction_section(run)}"
            f"{_failures_section(run)}{_session_table(run)}{config}</main></body></html>\n")
