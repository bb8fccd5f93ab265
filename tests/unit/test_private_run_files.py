"""Issue 35: run files that hold prompts or completions are their owner's only (0600 files, 0700 directories), like
the token files: the capture journal (its streams and attempt pointer), the launch's outputs, the datagen export.
They were 0644 under 0755 folders. Real files, a real journal; the whole of a finished run is walked in
tests/launch/test_run_folder.py."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_gym.datagen import write_dataset
from polar_gym.launch.outputs import write_outputs
from polar_gym.private_files import open_private, private_dir, write_secret
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.schema import CompletionRecord


@pytest.fixture(autouse=True)
def open_umask() -> Iterator[None]:
    """The widest usual umask: what the modes are must not depend on the user's."""
    old = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in root.rglob("*")}


def _record(session: str) -> CompletionRecord:
    messages = [{"role": "user", "content": "a secret prompt"}]
    return CompletionRecord(completion_id="c1", session_id=session, index=-1, provider="anthropic", engine="oracle",
                            request={"model": "m", "messages": messages, "max_tokens": 5},
                            normalized_request={"model": "m", "messages": messages}, prompt_ids=[1, 2, 3],
                            response_ids=[4, 5], response_logprobs=[-0.5, -0.25], finish_reason="stop")


def test_private_dir_closes_only_the_folders_it_makes(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)  # out_dir=. or a folder the user made: left as it is
    private_dir(shared / "a" / "b")
    assert _modes(tmp_path) == {"shared": "0o755", "shared/a": "0o700", "shared/a/b": "0o700"}


def test_open_private_narrows_an_existing_file_and_appends_or_truncates(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text("old\n")
    path.chmod(0o644)
    with open_private(path, "a") as f:
        f.write("more\n")
    assert path.read_text() == "old\nmore\n" and _modes(tmp_path) == {"results.jsonl": "0o600"}
    with open_private(path) as f:
        f.write("new\n")
    assert path.read_text() == "new\n"
    write_secret(tmp_path / "harness.stdout", b"\xffbytes")
    assert (tmp_path / "harness.stdout").read_bytes() == b"\xffbytes"
    assert _modes(tmp_path)["harness.stdout"] == "0o600"


async def test_the_capture_journal_s_files_are_private(tmp_path: Path) -> None:
    journal = CaptureJournal(tmp_path / "capture")
    await journal.begin_attempt("s1", "a1")
    await journal.append(_record("s1"))
    journal.close()
    modes = _modes(tmp_path)
    assert any(name.endswith("records.jsonl") for name in modes) and any("current-attempt" in n for n in modes)
    assert len(modes) >= 6 and {m for m in modes.values()} <= {"0o600", "0o700"}, modes
    assert modes["capture"] == "0o700"


def test_the_launch_outputs_and_the_datagen_export_are_private(tmp_path: Path) -> None:
    out = tmp_path / "run"
    totals = write_outputs(out, [], 0.0)
    write_dataset(out / "datagen", [], [])
    assert "report_error" not in totals
    modes = _modes(tmp_path)
    assert {"run/trajectories.jsonl", "run/results.jsonl", "run/calls.jsonl", "run/summary.md", "run/report.html",
            "run/datagen/sft/train.jsonl", "run/datagen/datagen_summary.json"} <= modes.keys()
    assert {m for m in modes.values()} <= {"0o600", "0o700"}, modes
