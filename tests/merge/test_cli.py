"""``python -m polar_gym.merge`` as a user runs it: on capture journals written by CaptureJournal, each format, the
summary table, and clear errors for a path without a journal or an unknown builder."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import atif
import orjson
import pytest

from polar_gym.merge import TraceLine, check_contiguity
from polar_gym.proxy.capture import CaptureJournal
from tests.merge._sessions import EOT, rec

ROOT = Path(__file__).resolve().parents[2]

# sess-a: a main chain of two turns and an interleaved sub-agent; sess-b: one good call and one failed call.
SESSIONS = {
    "sess-a": [rec(0, [1, 2, 3], [10, 11, EOT]), rec(1, [200, 201], [30, EOT]),
               rec(2, [1, 2, 3, 10, 11, EOT, 50, 51], [20, 21, EOT])],
    "sess-b": [rec(0, [1, 2], [12, EOT]), rec(1, [1, 2, 12, EOT, 52], [], status="error", error="boom")],
}


@pytest.fixture(scope="module")
def captures(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("captures")

    async def write() -> None:
        journal = CaptureJournal(root)
        try:
            for sid, records in SESSIONS.items():
                for r in records:
                    await journal.append(r.model_copy(update={"session_id": sid}))
        finally:
            journal.close()

    asyncio.run(write())
    return root


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "polar_gym.merge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def rows(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def summary_value(stdout: str, name: str) -> int:
    match = re.search(rf"{re.escape(name)}\W+(\d+)", stdout)
    assert match, f"{name!r} missing from the summary:\n{stdout}"
    return int(match.group(1))


def test_traces_from_a_capture_root(captures, tmp_path):
    out = tmp_path / "out" / "traces.jsonl"
    proc = run("--builder", "prefix_merging", captures, "--out", out, "--config", f'{{"end_of_turn_ids": [{EOT}]}}')
    assert proc.returncode == 0, proc.stderr
    lines = [TraceLine.model_validate(row) for row in rows(out)]
    assert [(t.session_id, t.trace_index) for t in lines] == [("sess-a", 0), ("sess-a", 1), ("sess-b", 0)]
    main = lines[0]
    assert main.response_ids == [10, 11, EOT, 50, 51, 20, 21, EOT] and main.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert main.metadata["weight"] == 0.5 and lines[2].metadata["weight"] == 1.0
    for name, value in (("sessions", 2), ("traces", 3), ("completions", 5), ("completions merged", 1),
                        ("rows written", 3), ("breaks: new_context", 1), ("excluded: error", 1),
                        ("trainable tokens", 10), ("masked tokens", 2)):
        assert summary_value(proc.stdout, name) == value


def test_per_request_on_one_session_directory(captures, tmp_path):
    out = tmp_path / "pr.jsonl"
    proc = run("--builder", "per_request", captures / "sess-a", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert [row["metadata"]["completion_ids"] for row in rows(out)] == [["c0"], ["c1"], ["c2"]]
    assert summary_value(proc.stdout, "sessions") == 1 and summary_value(proc.stdout, "completions merged") == 0


def test_nemo_slime_and_sft_formats(captures, tmp_path):
    outs = {fmt: tmp_path / f"{fmt}.jsonl" for fmt in ("nemo", "slime", "sft")}
    for fmt, out in outs.items():
        proc = run("--builder", "prefix_merging", captures, "--out", out, "--format", fmt)
        assert proc.returncode == 0, proc.stderr
    nemo = rows(outs["nemo"])
    assert [len(row["items"]) for row in nemo] == [2, 1, 1]
    for row in nemo:
        check_contiguity(row["items"])
    slime = rows(outs["slime"])
    for sample in slime:
        assert len(sample["tokens"]) == sample["metadata"]["prompt_length"] + sample["response_length"]
        assert len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == sample["response_length"]
        assert sample["status"] == "completed"
    sft = rows(outs["sft"])
    assert [row["session_id"] for row in sft] == ["sess-a", "sess-a", "sess-b"]
    assert sft[0]["messages"][-1]["role"] == "assistant"


def test_atif_format_writes_one_validated_document_per_session(captures, tmp_path):
    """The issue's command as written: the builder defaults to prefix_merging."""
    out = tmp_path / "atif.jsonl"
    proc = run(captures, "--out", out, "--format", "atif")
    assert proc.returncode == 0, proc.stderr
    docs = [atif.Trajectory.model_validate_json(line) for line in out.read_bytes().splitlines()]
    assert [d.session_id for d in docs] == ["sess-a", "sess-b"] and summary_value(proc.stdout, "rows written") == 2
    assert "prefix_merging" in proc.stdout
    main, other = docs
    # these records hold no request messages: the chain's last reply is its one step, the other completion is named
    assert [s.message for s in main.steps] == ["reply 2"]
    assert main.extra is not None and main.extra["completions_without_a_message"] == ["c0"]
    assert main.steps[0].metrics is not None and main.steps[0].metrics.completion_token_ids == [20, 21, EOT]
    (sub,) = main.subagent_trajectories or []
    assert sub.trajectory_id == "sess-a/chain-1" and sub.steps[0].metrics is not None
    assert other.extra is not None and other.extra["diagnostics"]["excluded"] == {"error": ["c1"]}


def test_a_path_without_a_journal_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run("--builder", "prefix_merging", tmp_path / "empty", "--out", tmp_path / "x.jsonl")
    assert proc.returncode == 2
    assert "holds no capture journal" in proc.stderr and not (tmp_path / "x.jsonl").exists()
    proc = run("--builder", "prefix_merging", tmp_path / "missing", "--out", tmp_path / "x.jsonl")
    assert proc.returncode == 2 and "no such directory" in proc.stderr


def test_unknown_builder_and_bad_config_are_clear_errors(captures, tmp_path):
    proc = run("--builder", "nope", captures, "--out", tmp_path / "x.jsonl")
    assert proc.returncode == 2 and "unknown builder 'nope'" in proc.stderr
    assert "per_request" in proc.stderr and "prefix_merging" in proc.stderr
    proc = run("--builder", "per_request", captures, "--out", tmp_path / "x.jsonl", "--config", "{oops")
    assert proc.returncode == 2 and "--config is not JSON" in proc.stderr
    proc = run("--builder", "per_request", captures, "--out", tmp_path / "x.jsonl", "--config", '{"eot": [1]}')
    assert proc.returncode == 2 and "unknown builder config keys: ['eot']" in proc.stderr
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("fmt", ["traces", "slime", "sft", "nemo", "atif"])
def test_a_parquet_export_holds_what_the_jsonl_holds(captures, tmp_path, fmt):
    """``--out X.parquet``: the same rows as the JSONL (a trace's logprobs as plain floats, not the JSONL's
    ``{token, token_id, logprob}`` objects), typed token columns, and Hugging Face datasets reads it."""
    from polar_gym.merge.parquet import read_parquet_rows

    jsonl, parquet = tmp_path / f"{fmt}.jsonl", tmp_path / f"{fmt}.parquet"
    for out in (jsonl, parquet):
        proc = run("--builder", "prefix_merging", captures, "--out", out, "--format", fmt)
        assert proc.returncode == 0, proc.stderr
        assert summary_value(proc.stdout, "rows written") == len(rows(jsonl))
    expected = rows(jsonl)
    columns = list(dict.fromkeys(k for row in expected for k in row))  # a key some rows lack is a null there
    expected = [{k: row.get(k) for k in columns} for row in expected]
    if fmt == "traces":
        for row in expected:
            row["response_logprobs"] = [item["logprob"] for item in row["response_logprobs"]]
    assert list(read_parquet_rows(parquet)) == expected


def test_hugging_face_datasets_reads_a_parquet_export_with_typed_token_columns(captures, tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets comes with the swebench and trl extras")
    out = tmp_path / "traces.parquet"
    assert run("--builder", "prefix_merging", captures, "--out", out).returncode == 0
    dataset = datasets.Dataset.from_parquet(str(out), cache_dir=str(tmp_path / "hf"))
    assert len(dataset) == 3 and dataset[0]["response_ids"] == [10, 11, EOT, 50, 51, 20, 21, EOT]
    assert dataset.features["prompt_ids"].feature.dtype == "int64"
    assert dataset.features["response_logprobs"].feature.dtype == "float64"
    assert orjson.loads(dataset[0]["metadata"])["weight"] == 0.5  # objects as JSON text
