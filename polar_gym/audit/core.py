"""The mismatch audit: recompute the logprob of every trained token of every trace under the weights of the policy
version that sampled it, compare with the logprob the engine reported, and judge the run against thresholds.

The comparison (:func:`judge_trace`, :func:`check_thresholds`, :func:`summarize`) is pure; :func:`audit_traces`
drives a recompute function (by default :func:`polar_gym.audit.recompute.token_logprobs` with one model loaded at a
time, so several versions never sit in memory together); :func:`write_audit` writes audit.jsonl and
audit_summary.json.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.audit.inputs import AuditTrace
from polar_gym.audit.metrics import mismatch_metrics

__all__ = [
    "DEFAULT_MODEL",
    "AuditSettings",
    "AuditSummary",
    "AuditThresholds",
    "Outlier",
    "Recompute",
    "TraceAudit",
    "audit_traces",
    "check_thresholds",
    "judge_trace",
    "model_for",
    "summarize",
    "write_audit",
]

#: the key of ``AuditSettings.models`` used for every version that has no model of its own
DEFAULT_MODEL = "*"
SUMMARY_FILE = "audit_summary.json"
TRACES_FILE = "audit.jsonl"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AuditThresholds(_Model):
    """Past any of these the run fails (None: not checked). Defaults follow what healthy RL runs report: k3 KL
    around 1e-3 or lower, Pearson of token probabilities above 0.99, almost no importance ratio above 2."""

    max_k3_kl: float | None = Field(default=1e-3, description="rollout_corr/k3_kl over the run")
    max_abs_diff: float | None = Field(default=1.0, description="largest |training - rollout| logprob of any token")
    min_pearson: float | None = Field(default=0.99, description="training/rollout_actor_probs_pearson_corr")
    max_ratio_fraction_high: float | None = Field(default=0.01,
                                                  description="rollout_corr/rollout_is_ratio_fraction_high")
    max_nonfinite_tokens: int | None = Field(default=0, description="tokens with a -inf or NaN logprob")
    is_threshold: float = Field(default=2.0, gt=1.0, description="importance ratio counted as high above this")


class AuditSettings(_Model):
    """Which weights audit which version, and how to run them."""

    models: dict[str, str] = Field(description="policy version (as a string) -> model directory; '*' for the rest")
    dtype: str = "float32"
    lm_head_fp32: bool = Field(default=False, description="the output layer in fp32 whatever dtype (as a trainer "
                               "with trainer.lm_head_fp32 computes it)")
    device: str = "cpu"
    chunk_tokens: int = Field(default=4096, ge=1, description="decoder body chunk (bounds attention memory)")
    head_rows: int = Field(default=256, ge=1, description="output-layer rows at once (bounds logits memory)")
    outlier_abs_diff: float = Field(default=0.1, ge=0.0, description="a token is an outlier past this |delta|")
    max_outliers: int = Field(default=20, ge=0, description="outliers kept per trace and for the run")


class Outlier(_Model):
    session_id: str
    trace_index: int
    position: int = Field(description="index in the trace's response")
    absolute_position: int = Field(description="index in prompt + response")
    token_id: int
    token: str | None = None
    policy_version: int | str | None = None
    rollout_logprob: float
    training_logprob: float
    abs_diff: float


class TraceAudit(_Model):
    session_id: str
    trace_index: int
    task_id: str | None = None
    skipped: str | None = Field(default=None, description="why the trace was not audited (no_logprobs, ...)")
    policy_versions: list[str] = Field(default_factory=list)
    tokens: int = 0
    unaudited_tokens: int = Field(default=0, description="trained tokens of a version with no model to audit it")
    metrics: dict[str, float | int | None] = Field(default_factory=dict)
    outliers: list[Outlier] = Field(default_factory=list)
    worst: Outlier | None = Field(default=None, description="the token with the largest |delta|, outlier or not")


class AuditSummary(_Model):
    input: str
    models: dict[str, str]
    dtype: str
    device: str
    lm_head_fp32: bool = False
    traces: int
    audited: int
    skipped: dict[str, int] = Field(default_factory=dict)
    unaudited_tokens: int = 0
    metrics: dict[str, float | int | None] = Field(default_factory=dict)
    thresholds: AuditThresholds
    failures: list[str] = Field(default_factory=list)
    outliers: list[Outlier] = Field(default_factory=list)
    worst: Outlier | None = None
    seconds: float = 0.0
    tokens_per_second: float | None = None

    @property
    def passed(self) -> bool:
        return not self.failures and self.audited > 0


#: (model directory, trace, response indices) -> recomputed logprobs of those tokens, in order
Recompute = Callable[[str, AuditTrace, list[int]], list[float]]


def model_for(models: Mapping[str, str], version: int | str | None) -> str | None:
    """The model directory that audits ``version``: its own, else the default, else None."""
    if version is not None and str(version) in models:
        return models[str(version)]
    return models.get(DEFAULT_MODEL)


def _outliers(trace: AuditTrace, positions: list[int], training: list[float], settings: AuditSettings,
              decode: Callable[[int], str | None]) -> tuple[list[Outlier], Outlier | None]:
    """The tokens past the outlier bar, worst first, and the worst token of all (past the bar or not)."""
    found = []
    for i, train in zip(positions, training, strict=True):
        roll = trace.logprobs[i]
        diff = abs(train - roll) if math.isfinite(train) and math.isfinite(roll) else math.inf
        found.append((diff, i, train, roll))
    found.sort(key=lambda x: -x[0])
    prompt = len(trace.prompt_ids)
    tokens = [Outlier(session_id=trace.session_id, trace_index=trace.trace_index, position=i,
                      absolute_position=prompt + i, token_id=trace.response_ids[i],
                      token=decode(trace.response_ids[i]), policy_version=trace.version_at(i), rollout_logprob=roll,
                      training_logprob=train, abs_diff=diff)
              for diff, i, train, roll in found[:max(settings.max_outliers, 1)]]
    return [o for o in tokens if o.abs_diff > settings.outlier_abs_diff][:settings.max_outliers], \
        (tokens[0] if tokens else None)


def judge_trace(trace: AuditTrace, positions: list[int], training: list[float], unaudited: int,
                settings: AuditSettings, thresholds: AuditThresholds,
                decode: Callable[[int], str | None] = lambda _: None) -> TraceAudit:
    """The audit of one trace from its recomputed logprobs at ``positions`` (response indices)."""
    rollout = [trace.logprobs[i] for i in positions]
    metrics = mismatch_metrics([training], [rollout], thresholds.is_threshold)
    versions = sorted({str(trace.version_at(i)) for i in positions}, key=str)
    outliers, worst = _outliers(trace, positions, training, settings, decode)
    return TraceAudit(session_id=trace.session_id, trace_index=trace.trace_index, task_id=trace.task_id,
                      skipped=None if metrics is not None else "no_finite_tokens", policy_versions=versions,
                      tokens=len(positions), unaudited_tokens=unaudited,
                      metrics=metrics.as_dict() if metrics is not None else {},
                      outliers=outliers, worst=worst)


def check_thresholds(metrics: Mapping[str, float | int | None], thresholds: AuditThresholds) -> list[str]:
    """One line per threshold the run's metrics are past (empty: the run passes)."""
    checks: list[tuple[str, float | None, bool]] = [
        ("rollout_corr/k3_kl", thresholds.max_k3_kl, True),
        ("audit/logprob_abs_diff_max", thresholds.max_abs_diff, True),
        ("training/rollout_actor_probs_pearson_corr", thresholds.min_pearson, False),
        ("rollout_corr/rollout_is_ratio_fraction_high", thresholds.max_ratio_fraction_high, True),
        ("audit/nonfinite_tokens", thresholds.max_nonfinite_tokens, True),
    ]
    failures = []
    for name, limit, is_max in checks:
        value = metrics.get(name)
        if limit is None or value is None:
            continue
        if (value > limit) if is_max else (value < limit):
            failures.append(f"{name} = {value:.6g} {'>' if is_max else '<'} {limit:g}")
    return failures


def summarize(source: str, audits: list[TraceAudit], run_training: list[list[float]],
              run_rollout: list[list[float]], settings: AuditSettings, thresholds: AuditThresholds,
              seconds: float) -> AuditSummary:
    """The run's metrics over every audited token, the failures, the worst outliers."""
    skipped = Counter(a.skipped for a in audits if a.skipped)
    metrics = mismatch_metrics(run_training, run_rollout, thresholds.is_threshold)
    values = metrics.as_dict() if metrics is not None else {}
    failures = check_thresholds(values, thresholds)
    if metrics is None:
        failures.append("no token could be audited")
    outliers = sorted((o for a in audits for o in a.outliers), key=lambda o: -o.abs_diff)[:settings.max_outliers]
    tokens = sum(a.tokens for a in audits if not a.skipped)
    worst = max((a.worst for a in audits if a.worst is not None), key=lambda o: o.abs_diff, default=None)
    return AuditSummary(
        input=source, models=dict(settings.models), dtype=settings.dtype, device=settings.device,
        lm_head_fp32=settings.lm_head_fp32, traces=len(audits), audited=sum(1 for a in audits if not a.skipped),
        skipped=dict(skipped),
        unaudited_tokens=sum(a.unaudited_tokens for a in audits), metrics=values, thresholds=thresholds,
        failures=failures, outliers=outliers, worst=worst, seconds=round(seconds, 3),
        tokens_per_second=round(tokens / seconds, 1) if seconds > 0 and tokens else None)


def _skip_reason(trace: AuditTrace) -> str | None:
    if not any(trace.loss_mask):
        return "no_trainable_tokens"
    if not trace.logprobs:
        return "no_logprobs"
    if len(trace.image_urls) != len(trace.images) or any(image.get("prompt_span") is None for image in trace.images):
        return "images_not_carried"  # the pixels or the placeholders' places are not in the trace
    return None


def audit_traces(traces: Iterable[AuditTrace], settings: AuditSettings, recompute: Recompute,
                 thresholds: AuditThresholds | None = None, source: str = "",
                 decode: Callable[[int], str | None] = lambda _: None) -> tuple[list[TraceAudit], AuditSummary]:
    """Audit every trace; the recompute runs model by model (all of one directory's tokens, then the next)."""
    thresholds = thresholds or AuditThresholds()
    started = time.monotonic()
    items = list(traces)
    audits: dict[int, TraceAudit] = {}
    plan: dict[str, dict[int, list[int]]] = {}  # model dir -> trace number -> response indices
    unaudited: Counter[int] = Counter()
    for n, trace in enumerate(items):
        reason = _skip_reason(trace)
        if reason:
            audits[n] = TraceAudit(session_id=trace.session_id, trace_index=trace.trace_index, task_id=trace.task_id,
                                   skipped=reason)
            continue
        for i in trace.trained_positions():
            model = model_for(settings.models, trace.version_at(i))
            if model is None or (not trace.prompt_ids and i == 0):  # the very first token has no context to score
                unaudited[n] += 1
            else:
                plan.setdefault(model, {}).setdefault(n, []).append(i)
    recomputed: dict[int, dict[int, float]] = {}
    for model, per_trace in plan.items():
        for n, positions in per_trace.items():
            values = recompute(model, items[n], positions)
            recomputed.setdefault(n, {}).update(zip(positions, values, strict=True))
    run_training, run_rollout = [], []
    for n, trace in enumerate(items):
        if n in audits:
            continue
        got = recomputed.get(n, {})
        positions = sorted(got)
        if not positions:
            audits[n] = TraceAudit(session_id=trace.session_id, trace_index=trace.trace_index, task_id=trace.task_id,
                                   skipped="no_model_for_version", unaudited_tokens=unaudited[n])
            continue
        training = [got[i] for i in positions]
        audits[n] = judge_trace(trace, positions, training, unaudited[n], settings, thresholds, decode)
        run_training.append(training)
        run_rollout.append([trace.logprobs[i] for i in positions])
    ordered = [audits[n] for n in range(len(items))]
    return ordered, summarize(source, ordered, run_training, run_rollout, settings, thresholds,
                              time.monotonic() - started)


def write_audit(out_dir: str | Path, audits: list[TraceAudit], summary: AuditSummary) -> tuple[Path, Path]:
    """audit.jsonl (one TraceAudit per line) and audit_summary.json under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    traces_path, summary_path = out / TRACES_FILE, out / SUMMARY_FILE
    with traces_path.open("w") as f:
        for audit in audits:
            f.write(audit.model_dump_json() + "\n")
    summary_path.write_text(json.dumps({**summary.model_dump(mode="json"), "passed": summary.passed}, indent=2) + "\n")
    return traces_path, summary_path

