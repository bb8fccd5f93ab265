"""The journal codec on its own: pure encoding and decoding, the attempt layout, and no dependency on the proxy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polar_gym.journal as journal
from polar_gym.journal import (
    ATTEMPTS_DIR,
    CURRENT_ATTEMPT,
    SessionStore,
    count_attempts,
    decode,
    is_superseded_attempt,
    read_current_attempt,
    read_session,
)
from polar_gym.schema import CompletionRecord


def record(index: int, prompt: list[int], response: list[int]) -> CompletionRecord:
    messages = [{"role": "user", "content": str(i)} for i in range(index + 1)]
    return CompletionRecord(completion_id=f"c{index}", session_id="s", index=index, provider="openai_chat",
                            engine="oracle", request={"messages": messages}, normalized_request={"messages": messages},
                            prompt_ids=prompt, response_ids=response, response_logprobs=[-0.5] * len(response))


def encoded(records: list[CompletionRecord]) -> tuple[list[bytes], bytes, bytes]:
    store, lines, tokens, logprobs = SessionStore(), [], b"", b""
    for rec in records:
        line, tok, lp = store.encode(rec)
        lines.append(line)
        tokens += tok
        logprobs += lp
    return lines, tokens, logprobs


def test_encode_then_decode_is_exact_and_shares_prefixes():
    records = [record(0, [1, 2, 3], [4, 5]), record(1, [1, 2, 3, 4, 5, 6], [7])]
    lines, tokens, logprobs = encoded(records)
    assert decode(lines, tokens, logprobs) == records
    assert len(tokens) // 4 == 3 + 2 + 1 + 1  # the second prompt stored only its new token


def test_decode_stops_at_a_torn_tail():
    records = [record(0, [1, 2], [3]), record(1, [1, 2, 3, 9], [8, 7])]
    lines, tokens, logprobs = encoded(records)
    assert decode(lines, tokens[:-4], logprobs) == records[:1]  # the last line's tokens are missing
    assert decode([lines[0], lines[1][:10]], tokens, logprobs) == records[:1]  # the last line is cut


def test_attempt_layout(tmp_path: Path):
    session = tmp_path / "sess"
    assert read_current_attempt(session) is None and count_attempts(session) == {}
    for attempt, n in (("a1", 2), ("a2", 1)):
        stream = session / ATTEMPTS_DIR / attempt
        stream.mkdir(parents=True)
        lines, tokens, logprobs = encoded([record(i, [1, i], [2]) for i in range(n)])
        (stream / journal.RECORDS_FILE).write_bytes(b"".join(lines))
        (stream / journal.TOKENS_FILE).write_bytes(tokens)
        (stream / journal.LOGPROBS_FILE).write_bytes(logprobs)
    (session / CURRENT_ATTEMPT).write_text("a2\n")
    assert read_current_attempt(session) == "a2"
    assert count_attempts(session) == {"a1": 2, "a2": 1}
    assert is_superseded_attempt(session / ATTEMPTS_DIR / "a1")
    assert not is_superseded_attempt(session / ATTEMPTS_DIR / "a2") and not is_superseded_attempt(session)
    assert len(read_session(session / ATTEMPTS_DIR / "a1")) == 2
    assert journal.stored_bytes(session / ATTEMPTS_DIR / "a2") > 0


def test_reading_journals_never_imports_the_proxy():
    code = ("import sys, polar_gym.journal, polar_gym.merge.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('polar_gym.proxy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
