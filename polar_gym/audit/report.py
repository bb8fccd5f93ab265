"""The audit as a command does it: parse ``--model`` specs, read the traces, recompute with transformers, write the
files and print the tables. ``python -m polar_gym.audit`` parses arguments and calls :func:`run_audit`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from polar_gym.audit.core import (
    DEFAULT_MODEL,
    AuditSettings,
    AuditSummary,
    AuditThresholds,
    TraceAudit,
    audit_traces,
    write_audit,
)
from polar_gym.audit.inputs import read_traces, resolve_input

__all__ = ["EXIT_FAILED", "EXIT_NOTHING", "EXIT_OK", "parse_models", "print_report", "run_audit"]

EXIT_OK, EXIT_FAILED, EXIT_NOTHING = 0, 1, 2

#: the columns of the per-trace table: (header, metric name, format)
_COLUMNS = [
    ("k3 KL", "rollout_corr/k3_kl", ".2e"),
    ("max |Δ|", "audit/logprob_abs_diff_max", ".2e"),
    ("mean |Δ|", "audit/logprob_abs_diff_mean", ".2e"),
    ("log-ppl diff", "rollout_corr/log_ppl_diff", ".2e"),
    ("pearson p", "training/rollout_actor_probs_pearson_corr", ".5f"),
    ("ρ>2", "rollout_corr/rollout_is_ratio_fraction_high", ".3f"),
    ("ESS", "rollout_corr/rollout_is_eff_sample_size", ".4f"),
]


def parse_models(specs: Sequence[str]) -> dict[str, str]:
    """``DIR`` (every version) or ``VERSION=DIR`` (the spans that version sampled) -> {version: dir}."""
    models: dict[str, str] = {}
    for spec in specs:
        version, sep, path = spec.partition("=")
        if not sep or "/" in version or Path(spec).exists():
            version, path = DEFAULT_MODEL, spec
        if not Path(path).is_dir():
            raise FileNotFoundError(f"--model {spec}: {path} is not a model directory")
        if version in models:
            raise ValueError(f"--model: two models for {'every version' if version == DEFAULT_MODEL else version}")
        models[version] = path
    if not models:
        raise ValueError("--model: at least one model directory")
    return models


def _decoder(models: dict[str, str]) -> Callable[[int], str | None]:
    """Token text for outlier reports, from the first model directory's tokenizer when it has one."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(next(iter(models.values())), local_files_only=True)
    except Exception:
        return lambda _: None
    return lambda token_id: str(tokenizer.decode([token_id]))


def run_audit(source: str | Path, settings: AuditSettings, thresholds: AuditThresholds,
              out_dir: str | Path | None = None) -> tuple[list[TraceAudit], AuditSummary, Path]:
    """Audit every trace of ``source`` (a launch output folder or a JSONL file); write audit.jsonl and
    audit_summary.json to ``out_dir`` (default: the folder, or the file's folder). Returns where they went."""
    from polar_gym.audit.recompute import ModelRecompute  # torch only when something is recomputed

    path = resolve_input(source)
    out = Path(out_dir) if out_dir is not None else path.parent
    recompute = ModelRecompute(settings.dtype, settings.device, settings.chunk_tokens, settings.head_rows,
                               settings.lm_head_fp32)
    audits, summary = audit_traces(read_traces(path), settings, recompute, thresholds, str(source),
                                   _decoder(settings.models))
    write_audit(out, audits, summary)
    return audits, summary, out


def _cell(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_report(console: Console, audits: list[TraceAudit], summary: AuditSummary, max_rows: int = 40) -> None:
    """Per-trace table (worst k3 KL first), the run's line, the worst outliers and the failures."""
    head = ", fp32 output layer" if summary.lm_head_fp32 else ""
    table = Table(title=f"mismatch audit ({summary.dtype}{head} on {summary.device})")
    for header in ["trace", "versions", "tokens", *[c[0] for c in _COLUMNS]]:
        table.add_column(header, justify="left" if header in ("trace", "versions") else "right")
    ranked = sorted((a for a in audits if not a.skipped),
                    key=lambda a: -float(a.metrics.get("rollout_corr/k3_kl") or 0.0))
    for a in ranked[:max_rows]:
        table.add_row(escape(f"{a.session_id}#{a.trace_index}"), ",".join(a.policy_versions), str(a.tokens),
                      *[_cell(a.metrics.get(name), fmt) for _, name, fmt in _COLUMNS])
    table.add_row("[bold]run[/]", "", str(summary.metrics.get("audit/tokens", 0)),
                  *[_cell(summary.metrics.get(name), fmt) for _, name, fmt in _COLUMNS], style="bold")
    console.print(table)
    if len(ranked) > max_rows:
        console.print(f"({len(ranked) - max_rows} more traces in audit.jsonl)")
    skipped = ", ".join(f"{reason}: {n}" for reason, n in sorted(summary.skipped.items())) or "none"
    console.print(f"{summary.audited}/{summary.traces} traces audited (skipped: {skipped}); "
                  f"{summary.unaudited_tokens} tokens of versions without a model; {summary.seconds:.1f}s"
                  + (f", {summary.tokens_per_second:.0f} tokens/s" if summary.tokens_per_second else ""),
                  highlight=False)
    shown = summary.outliers or ([summary.worst] if summary.worst is not None else [])
    if shown:
        worst = Table(title="worst tokens" if summary.outliers else "worst token (under the outlier bar)")
        for header in ["trace", "pos", "token id", "token", "version", "rollout", "training", "|Δ|"]:
            worst.add_column(header)
        for o in shown[:10]:
            worst.add_row(escape(f"{o.session_id}#{o.trace_index}"), str(o.position), str(o.token_id),
                          escape(repr(o.token)) if o.token is not None else "-", str(o.policy_version),
                          f"{o.rollout_logprob:.5f}", f"{o.training_logprob:.5f}", f"{o.abs_diff:.3e}")
        console.print(worst)
    for failure in summary.failures:
        console.print(f"[bold red]FAIL[/] {escape(failure)}", highlight=False)
    if not summary.failures:
        console.print("[bold green]PASS[/] every threshold holds", highlight=False)
