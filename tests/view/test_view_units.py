"""The viewer's pure parts and edges: error causes of a live result, the tokenizer seam, torn and odd files, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_gym.view import OutDirSource, TokenText, find_tokenizer
from polar_gym.view.__main__ import parse_args
from polar_gym.view.model import call_rows, error_cause, valid_session_id
from tests.view._view_kit import make_session, write_run


@pytest.mark.parametrize(("result", "cause"), [
    ({"status": "COMPLETED"}, None),
    ({"status": "TIMEOUT"}, "timeout"),
    ({"status": "ERROR", "reason": "upstream_timeout: 600 s"}, "upstream_timeout"),
    ({"status": "ERROR", "reason": "init: the sandbox did not start"}, "init_failed"),
    ({"status": "ERROR", "reason": "something else"}, "error"),
    ({"status": "ERROR", "metadata": {"artifacts": {"error_cause": "engine_error"}}}, "engine_error"),
    ({"status": "ERROR", "error_cause": "upstream_error"}, "upstream_error"),  # launch's own word wins
])
def test_error_cause_of_a_result(result: dict, cause: str | None) -> None:
    assert error_cause(result) == cause


@pytest.mark.parametrize(("sid", "ok"), [("demo-calc-add-0-c1876cf4", True), ("a.b:c@d", True), ("..", False),
                                         ("a/b", False), (".hidden", False), ("a..b", False), ("", False),
                                         ("x" * 300, False), ("a\nb", False)])
def test_session_ids(sid: str, ok: bool) -> None:
    assert valid_session_id(sid) is ok


def test_a_broken_tokenizer_falls_back_to_ids(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert TokenText(tmp_path).texts([1, 2]) is None
    assert find_tokenizer(str(tmp_path)) == tmp_path  # the run's configured directory is taken first


def test_ids_outside_the_vocabulary(tmp_path: Path) -> None:
    found = find_tokenizer(None)
    if found is None:
        pytest.skip("the cached Qwen tokenizer is not built (scripts/setup.sh builds it)")
    texts = TokenText(found).texts([9_999_999, 151644])
    assert texts is not None and texts[9_999_999] == "<9999999>" and texts[151644] == "<|im_start|>"


def test_the_run_config_names_the_tokenizer(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [make_session("s")])
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (run / "config.yaml").write_text(f"inference:\n  tokenizer: {tok}\n")
    assert OutDirSource(run).tokens().directory == tok  # type: ignore[union-attr]
    (run / "config.yaml").write_text(": : not yaml [")
    assert OutDirSource(run)._configured_tokenizer() is None  # an unreadable config: the default (or ids)


async def test_torn_and_foreign_lines_are_skipped(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [make_session("s1", turns=2), make_session("s2", turns=2, seed=1)])
    with (run / "results.jsonl").open("a") as fh:
        fh.write('{"session_id": "half')  # a run still writing
    with (run / "trajectories.jsonl").open("a") as fh:
        fh.write(json.dumps({"trace_index": 0, "session_id": "s2", "note": "key order differs"}) + "\n[1, 2]\n")
        fh.write('{"session_id": "s1", "prompt_ids": [1, 2')
    with (run / "capture" / "s1" / "attempts" / "a1" / "records.jsonl").open("ab") as fh:
        fh.write(b'{"completion_id": "torn')
    source = OutDirSource(run, decode=False)
    assert sorted(r["session_id"] for r in await source.rows()) == ["s1", "s2"]
    s1 = await source.session("s1")
    assert s1 is not None and len(s1.traces) == 1 and len(s1.calls) == 2
    s2 = await source.session("s2")
    assert s2 is not None and len(s2.traces) == 2
    (run / "capture" / "s2" / "current-attempt").write_text("../../elsewhere")
    assert (await source.session("s2")).calls == []  # type: ignore[union-attr]


def test_cli_needs_a_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args([str(tmp_path)])
    assert "no results.jsonl" in capsys.readouterr().err
    run = write_run(tmp_path / "run", [make_session("s")])
    args = parse_args([str(run), "--port", "0", "--ids"])
    assert args.host == "127.0.0.1" and args.port == 0 and args.ids


def test_a_call_cut_by_weight_updates_is_one_row_over_all_its_tokens() -> None:
    """A generation cut by a weight update is one model call whose trace span the builders split per version
    (``cut: true``): the viewer's call row covers every token of it, and keeps the record's final version."""
    spans = [{"completion_id": "c1", "start": 0, "end": 4, "policy_version": 0},
             {"completion_id": "c2", "start": 6, "end": 9, "policy_version": 0, "cut": True},
             {"completion_id": "c2", "start": 9, "end": 15, "policy_version": 1, "cut": True}]
    traces = [{"metadata": {"spans": spans}}]
    calls = [{"completion_id": "c1", "policy_version": 0}, {"completion_id": "c2", "policy_version": 1}]
    rows = call_rows(traces, calls)
    assert [(r["completion_id"], r["span"], r["policy_version"]) for r in rows] == [
        ("c1", [0, 4], 0), ("c2", [6, 15], 1)]
