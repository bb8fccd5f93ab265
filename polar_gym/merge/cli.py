"""``python -m polar_gym.merge``: rebuild trajectories offline from capture journals, so old rollouts can be
re-merged with another builder or exported for another trainer. The thin shell around the pure builders and exports:
it finds journals, reads them, writes JSONL and prints a summary table.

    python -m polar_gym.merge [--builder prefix_merging] captures/ --out traces.jsonl --format slime

``--format atif`` writes one ATIF trajectory (Harbor's Agent Trajectory Interchange Format) per session and line.
An ``--out`` ending in ``.parquet`` writes Parquet instead of JSONL (polar_gym.merge.parquet).

CAPTURES are session journal directories (holding ``records.jsonl``) or capture roots containing them at any depth.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from polar_gym.journal import RECORDS_FILE, is_superseded_attempt, read_session
from polar_gym.merge import MergeConfig, build_trajectory
from polar_gym.merge.atif import atif_json
from polar_gym.merge.exports import (
    SFTRecord,
    SlimeSample,
    TraceLine,
    nemo_item_chains,
    sft_records,
    slime_samples,
    trace_lines,
)
from polar_gym.merge.parquet import ParquetRows
from polar_gym.merge.rewards import with_session_weights
from polar_gym.registry import BUILDERS, RegistryError
from polar_gym.schema import BuilderSpec, CompletionSession, Trajectory

__all__ = ["FORMATS", "ROW_MODELS", "NoJournalError", "Summary", "find_journals", "main", "parquet_rows"]

JOURNAL_FILE = RECORDS_FILE


class NoJournalError(ValueError):
    """A CAPTURES path that holds no session journal."""


def _nemo_rows(traj: Trajectory) -> list[dict[str, Any]]:
    return [{"session_id": traj.session_id, "trace_index": i, "builder": traj.builder,
             "items": [item.model_dump() for item in items]}
            for i, items in enumerate(nemo_item_chains(traj))]


def _models(fn: Callable[[Trajectory], Sequence[BaseModel]]) -> Callable[[Trajectory], list[dict[str, Any]]]:
    return lambda traj: [m.model_dump() for m in fn(traj)]


#: output format -> rows (one JSON object per line) of one trajectory
FORMATS: dict[str, Callable[[Trajectory], list[dict[str, Any]]]] = {
    "traces": _models(trace_lines),
    "slime": _models(slime_samples),
    "nemo": _nemo_rows,
    "sft": _models(sft_records),
    "atif": lambda traj: [atif_json(traj)],  # one document per session, every chain in it
}


#: formats whose rows are a pydantic model: their Parquet columns are typed from it (polar_gym.merge.parquet)
ROW_MODELS: dict[str, tuple[type[BaseModel], Callable[[Trajectory], Sequence[BaseModel]]]] = {
    "traces": (TraceLine, trace_lines), "slime": (SlimeSample, slime_samples), "sft": (SFTRecord, sft_records)}


def parquet_rows(fmt: str, traj: Trajectory) -> list[dict[str, Any]]:
    """The rows of ``fmt`` for a Parquet file: a model's fields as they are (logprobs a list of floats, not the
    JSONL's ``{token, token_id, logprob}`` objects), or the JSONL rows of a format without a model."""
    if fmt in ROW_MODELS:
        return [dict(m) for m in ROW_MODELS[fmt][1](traj)]
    return FORMATS[fmt](traj)


def find_journals(paths: Iterable[str | Path]) -> list[Path]:
    """Session journal directories under ``paths``, in order, each once."""
    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw)
        if (path / JOURNAL_FILE).is_file():
            found[path] = None
            continue
        if not path.is_dir():
            raise NoJournalError(f"{path}: no such directory (expected a session journal or a capture root)")
        # an earlier dispatch attempt of a gateway session is a dead gateway's calls, never trained; naming its
        # directory explicitly still rebuilds it
        nested = sorted(p.parent for p in path.rglob(JOURNAL_FILE) if not is_superseded_attempt(p.parent))
        if not nested:
            raise NoJournalError(f"{path}: holds no capture journal (no {JOURNAL_FILE} in it or below it)")
        found.update(dict.fromkeys(nested))
    return list(found)


@dataclass
class Summary:
    """Totals over every rebuilt session, shown as the closing table."""

    sessions: int = 0
    traces: int = 0
    completions: int = 0
    merged: int = 0
    rows: int = 0
    trainable: int = 0
    masked: int = 0
    breaks: Counter[str] = field(default_factory=Counter)
    excluded: Counter[str] = field(default_factory=Counter)
    superseded: int = 0

    def add(self, traj: Trajectory, rows: int) -> None:
        d = traj.diagnostics
        self.sessions += 1
        self.traces += len(traj.traces)
        self.completions += int(d.get("completions", 0))
        self.merged += int(d.get("completions_merged", 0))
        self.trainable += int(d.get("trainable_tokens", 0))
        self.masked += int(d.get("masked_tokens", 0))
        self.breaks.update(d.get("breaks", {}))
        self.excluded.update({k: len(v) for k, v in d.get("excluded", {}).items()})
        self.superseded += len(d.get("superseded", []))
        self.rows += rows

    def table(self, builder: str, fmt: str, out: Path) -> Table:
        table = Table(title=f"{builder}, {fmt}", caption=str(out))
        table.add_column("metric")
        table.add_column("value", justify="right")
        for name, value in (("sessions", self.sessions), ("traces", self.traces),
                            ("completions", self.completions), ("completions merged", self.merged),
                            ("rows written", self.rows), ("trainable tokens", self.trainable),
                            ("masked tokens", self.masked), ("superseded", self.superseded)):
            table.add_row(name, str(value))
        for cause, n in sorted(self.breaks.items()):
            table.add_row(f"breaks: {cause}", str(n))
        for reason, n in sorted(self.excluded.items()):
            table.add_row(f"excluded: {reason}", str(n))
        return table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.merge", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("captures", nargs="+", metavar="CAPTURES",
                        help="session journal directories or capture roots containing them")
    parser.add_argument("--builder", default="prefix_merging",
                        help=f"builder name ({', '.join(BUILDERS.names())}) or a dotted path pkg.module:function "
                             "(default: prefix_merging, as a launch)")
    parser.add_argument("--out", required=True, type=Path,
                        help="output file: JSONL, or Parquet when it ends in .parquet (Hugging Face datasets, pandas "
                             "and the trainers' loaders read it directly)")
    parser.add_argument("--config", default="{}", help="builder config as JSON (MergeConfig fields), e.g. "
                        "'{\"end_of_turn_ids\": [151645, 151643]}' (Qwen's, the default)")
    parser.add_argument("--format", dest="fmt", choices=sorted(FORMATS), default="traces")
    parser.add_argument("--weighting", choices=["traces", "tokens", "none"], default="traces",
                        help="session weights written to each trace's metadata (see polar_gym.merge.rewards)")
    return parser


def _load(directory: Path) -> CompletionSession:
    records = read_session(directory)
    session_id = records[0].session_id if records else directory.name
    return CompletionSession(session_id=session_id, completions=records)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config)
        if not isinstance(config, dict):
            raise ValueError("must be a JSON object")
        MergeConfig.from_dict(config)
        spec = BuilderSpec(strategy=args.builder, config=config)
        BUILDERS.get(spec.strategy)
        journals = find_journals(args.captures)
    except (ValueError, RegistryError) as exc:
        parser.error(str(exc) if not isinstance(exc, json.JSONDecodeError) else f"--config is not JSON: {exc}")
    to_rows = FORMATS[args.fmt]
    summary = Summary()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    progress = Progress(TextColumn("[bold]merging"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
    as_parquet = args.out.suffix == ".parquet"
    model = ROW_MODELS[args.fmt][0] if args.fmt in ROW_MODELS else None
    with progress, (ParquetRows(args.out, model=model) if as_parquet else open(args.out, "wb")) as out:
        task = progress.add_task("", total=len(journals))
        for directory in journals:
            progress.update(task, description=directory.name)
            traj = with_session_weights(build_trajectory(_load(directory), spec), args.weighting)
            if isinstance(out, ParquetRows):
                rows = parquet_rows(args.fmt, traj)
                out.add(rows)
            else:
                rows = to_rows(traj)
                out.writelines(orjson.dumps(row) + b"\n" for row in rows)
            summary.add(traj, len(rows))
            progress.advance(task)
    Console(width=100).print(summary.table(spec.strategy, args.fmt, args.out))
    return 0


if __name__ == "__main__":  # pragma: no cover - python -m polar_gym.merge.cli
    sys.exit(main())
