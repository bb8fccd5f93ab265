"""How old a sample is: the policy version of each sampled token, a sample's staleness against the trainer's version,
and the masks asynchronous GRPO applies (pure: no torch, no I/O; any trainer can import it).

A token's version is the one its completion span names in the trace's ``metadata["spans"]`` (the builders write a
span per completion, and one per version when a weight update cut a generation); a trace without spans takes its
single ``metadata["policy_versions"]`` entry. Versions the trainer did not number (None, a label such as "stock")
are *unknown*: they count as fresh (staleness 0) and are reported apart, since no age can be read from them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polar_gym.schema import Trace

__all__ = ["SampleAge", "StalenessStats", "mixed_version_mask", "numeric_version", "sample_age", "staleness_stats",
           "token_versions", "trace_age", "trace_versions"]


def numeric_version(version: Any) -> int | None:
    """A version the trainer numbered (an int, or a string of digits from a JSON round trip), else None."""
    if isinstance(version, bool):
        return None
    if isinstance(version, int):
        return version
    if isinstance(version, str) and version.isdigit():
        return int(version)
    return None


def token_versions(response_length: int, metadata: Mapping[str, Any]) -> list[int | str | None]:
    """The policy version of each of a trace's response tokens (None where no span covers it: tool results and
    other tokens the policy did not sample), from its ``metadata`` as the builders write it."""
    out: list[int | str | None] = [None] * response_length
    spans = metadata.get("spans")
    if isinstance(spans, list) and spans:
        for span in spans:
            start, end = (span.get("start"), span.get("end")) if isinstance(span, Mapping) else (None, None)
            if not isinstance(start, int) or not isinstance(end, int):  # a malformed span marks nothing
                continue
            for i in range(max(0, start), min(end, response_length)):
                out[i] = span.get("policy_version")
        return out
    versions = metadata.get("policy_versions") or []
    if len(versions) == 1:
        return [versions[0]] * response_length
    return out


def trace_versions(trace: Trace) -> list[int | str | None]:
    """:func:`token_versions` of a trace."""
    return token_versions(len(trace.response_ids), trace.metadata)


@dataclass(frozen=True)
class SampleAge:
    """One trace's age at training time: ``oldest``/``newest`` numbered versions among its trained tokens (None:
    none numbered), ``staleness`` = trainer version - oldest (0 when unknown)."""

    oldest: int | None
    newest: int | None
    staleness: int
    known: bool


def sample_age(versions: Sequence[int | str | None], loss_mask: Sequence[int], trainer_version: int) -> SampleAge:
    """The age of a trace whose response tokens have ``versions``, trained where ``loss_mask`` is 1, when the
    trainer holds ``trainer_version``."""
    numbered = [v for v, m in zip((numeric_version(v) for v in versions), loss_mask, strict=True)
                if m and v is not None]
    if not numbered:
        return SampleAge(None, None, 0, known=False)
    oldest, newest = min(numbered), max(numbered)
    return SampleAge(oldest, newest, max(0, trainer_version - oldest), known=True)


def trace_age(trace: Trace, trainer_version: int) -> SampleAge:
    """:func:`sample_age` of a trace."""
    return sample_age(trace_versions(trace), trace.loss_mask, trainer_version)


def mixed_version_mask(versions: Sequence[int | str | None], loss_mask: Sequence[int]) -> list[int]:
    """``loss_mask`` with the trained tokens of a trace's older versions set to 0 (``mixed_version_tokens: mask``):
    when a generation was cut by a weight update, or a session spanned updates, only its newest version's tokens
    stay trained."""
    numbered = [numeric_version(v) for v in versions]
    newest = max((v for v, m in zip(numbered, loss_mask, strict=True) if m and v is not None), default=None)
    if newest is None:
        return [int(bool(m)) for m in loss_mask]
    return [0 if m and v is not None and v < newest else int(bool(m)) for v, m in zip(numbered, loss_mask,
                                                                                   strict=True)]


@dataclass(frozen=True)
class StalenessStats:
    """A step's staleness, one entry per trained sample (trace), for its metrics row."""

    per_sample: list[int]
    unknown: int

    def as_row(self) -> dict[str, Any]:
        """``staleness/*`` keys of a train_metrics.jsonl row (``per_sample`` is what the plot draws)."""
        known = self.per_sample
        return {"staleness/mean": sum(known) / len(known) if known else 0.0,
                "staleness/max": max(known, default=0), "staleness/min": min(known, default=0),
                "staleness/per_sample": list(known), "staleness/unknown": self.unknown}


def staleness_stats(ages: Iterable[SampleAge]) -> StalenessStats:
    """The step's :class:`StalenessStats` from its samples' ages."""
    ages = list(ages)
    return StalenessStats([a.staleness for a in ages if a.known], sum(not a.known for a in ages))
