"""Where the viewer reads a run from: a small protocol, and its implementation over a finished run's folder.

``OutDirSource`` reads what ``launch`` wrote: results.jsonl (one row per session), trajectories.jsonl (one line per
trace; indexed once by byte offset so opening a session reads only its own lines) and capture/ (the proxy's journal
per session, read with polar_gym.journal, for per-call timings), or where the journals stayed on the nodes (Slurm,
node-local scratch) calls.jsonl, the call logs the gateways shipped with the results. Files are re-read when they
change, so the viewer
can be started while a run is still writing. The rollout server's implementation over its live store is in
polar_gym.server.viewer (the server sits above this layer).
"""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any, Protocol

import orjson

from polar_gym.journal import (
    ATTEMPTS_DIR,
    CURRENT_ATTEMPT,
    RECORDS_FILE,
    is_blob_line,
    read_current_attempt,
    read_file,
)
from polar_gym.view.model import SessionData, session_row, valid_session_id
from polar_gym.view.tokens import TokenText, find_tokenizer

__all__ = ["OutDirSource", "ViewSource"]

#: record fields the viewer leaves out: the request and response bodies, and the token arrays (counted instead)
_HEAVY = frozenset({"request", "normalized_request", "response", "prompt_ids", "response_ids", "response_logprobs"})
_HEAD = re.compile(rb'^\{"session_id": ?"((?:[^"\\]|\\.)*)"')


class ViewSource(Protocol):
    """What the viewer's routes read. Every method is a read; answers are bounded by the caller."""

    #: shown in the page's header (the run's folder, or "live")
    title: str

    async def rows(self) -> list[dict[str, Any]]:
        """Every session of the run as a table row (polar_gym.view.model.session_row)."""

    async def session(self, session_id: str) -> SessionData | None:
        """One session, or None when the run has no such session."""

    def tokens(self) -> TokenText | None:
        """The run's tokenizer, when one is known."""


def _count(field: Any) -> int:
    """Tokens in a journal record's token field: a reference ``{keep, len}`` (the first ``keep`` tokens are shared
    with an earlier record, ``len`` are stored here) or, from an older writer, the list itself."""
    if isinstance(field, dict):
        return int(field.get("keep", 0) or 0) + int(field.get("len", 0) or 0)
    return len(field) if isinstance(field, list) else 0


class _Cached:
    """A file's parsed form, rebuilt when its size or mtime changes."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.value: Any = None


def _stat_key(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class OutDirSource:
    """A finished (or running) launch's out dir."""

    def __init__(self, out_dir: str | Path, *, tokenizer: str | Path | None = None, decode: bool = True) -> None:
        self.out_dir = Path(out_dir).resolve()
        self.title = str(self.out_dir)
        self._lock = threading.Lock()
        self._results, self._index, self._calls_index = _Cached(), _Cached(), _Cached()
        self._rows_of: dict[str, dict[str, Any]] | None = None  # the results the cached rows were made from
        self._rows_cache: list[dict[str, Any]] = []
        self._tokens: TokenText | None = None
        if decode:
            found = Path(tokenizer) if tokenizer else find_tokenizer(self._configured_tokenizer())
            self._tokens = TokenText(found) if found is not None else None

    def _configured_tokenizer(self) -> str | None:
        path = self.out_dir / "config.yaml"
        if not path.is_file():
            return None
        try:
            from omegaconf import OmegaConf

            value = OmegaConf.select(OmegaConf.load(path), "inference.tokenizer", default=None)
        except Exception:  # an unreadable config: the default tokenizer (or ids)
            return None
        return str(value) if value else None

    def tokens(self) -> TokenText | None:
        return self._tokens

    # -- results.jsonl ------------------------------------------------------------------------------------------

    def _read_results(self) -> dict[str, dict[str, Any]]:
        path = self.out_dir / "results.jsonl"
        key = _stat_key(path)
        with self._lock:
            if key is not None and key == self._results.key:
                results: dict[str, dict[str, Any]] = self._results.value
                return results
        results = {}
        if key is not None:
            for line in path.read_bytes().splitlines():
                try:
                    data = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a torn last line of a run still writing
                if isinstance(data, dict) and isinstance(data.get("session_id"), str):
                    results[data["session_id"]] = data
        with self._lock:
            self._results.key, self._results.value = key, results
        return results

    def _rows(self) -> list[dict[str, Any]]:
        results = self._read_results()
        with self._lock:
            if self._rows_of is results:
                return self._rows_cache
        rows = [session_row(r) for r in results.values()]
        with self._lock:
            self._rows_of, self._rows_cache = results, rows
        return rows

    async def rows(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._rows)

    # -- trajectories.jsonl -------------------------------------------------------------------------------------

    def _line_index(self, name: str, cache: _Cached) -> tuple[Path, dict[str, list[tuple[int, int]]]]:
        """session id -> (offset, length) of each of its lines in ``name`` (a JSONL file whose lines start with the
        session id), built in one pass over the file and kept until it changes."""
        path = self.out_dir / name
        key = _stat_key(path)
        with self._lock:
            if key is not None and key == cache.key:
                return path, cache.value
        index: dict[str, list[tuple[int, int]]] = {}
        if key is not None:
            offset = 0
            with path.open("rb") as fh:
                for line in fh:
                    match = _HEAD.match(line)
                    if match:
                        sid = orjson.loads(b'"' + match.group(1) + b'"')
                    else:
                        try:
                            sid = orjson.loads(line).get("session_id")
                        except (orjson.JSONDecodeError, AttributeError):
                            sid = None
                    if isinstance(sid, str):
                        index.setdefault(sid, []).append((offset, len(line)))
                    offset += len(line)
        with self._lock:
            cache.key, cache.value = key, index
        return path, index

    def _lines(self, name: str, cache: _Cached, session_id: str) -> list[dict[str, Any]]:
        path, index = self._line_index(name, cache)
        spans = index.get(session_id)
        if not spans:
            return []
        lines = []
        with path.open("rb") as fh:
            for offset, length in spans:
                fh.seek(offset)
                try:
                    data = orjson.loads(fh.read(length))
                except orjson.JSONDecodeError:
                    continue
                if isinstance(data, dict):
                    lines.append(data)
        return lines

    def _traces(self, session_id: str) -> list[dict[str, Any]]:
        traces = self._lines("trajectories.jsonl", self._index, session_id)
        traces.sort(key=lambda t: t.get("trace_index", 0) if isinstance(t.get("trace_index"), int) else 0)
        return traces

    def _shipped_calls(self, session_id: str) -> list[dict[str, Any]]:
        """The call log the gateway shipped with the result (calls.jsonl): what a run whose journals stayed on its
        nodes' local scratch has instead of capture/."""
        for line in self._lines("calls.jsonl", self._calls_index, session_id):
            calls = line.get("calls")
            if isinstance(calls, list):
                return [c for c in calls if isinstance(c, dict)]
        return []

    # -- capture/ -----------------------------------------------------------------------------------------------

    def _calls(self, session_id: str) -> list[dict[str, Any]]:
        """The session's captured calls (its current dispatch attempt): every field but the bodies and the token
        arrays, which the page does not need (a count each). Read from the journal's record lines without
        rebuilding the prompts: a 200-turn session's prompts are millions of ids."""
        capture = self.out_dir / "capture"
        session_dir = capture / session_id
        if not session_dir.is_dir() or session_dir.resolve().parent != capture.resolve():
            return []
        attempt = read_current_attempt(session_dir) if (session_dir / CURRENT_ATTEMPT).exists() else None
        if attempt is not None and not valid_session_id(attempt):
            return []
        stream = session_dir / ATTEMPTS_DIR / attempt if attempt else session_dir
        calls = []
        for line in read_file(stream / RECORDS_FILE).splitlines():
            if is_blob_line(line):
                continue  # a tool list or system prompt its records refer to
            try:
                data = orjson.loads(line)
            except orjson.JSONDecodeError:
                break  # a torn last line: the journal's own reader stops there too
            if not isinstance(data, dict):
                continue
            call = {k: v for k, v in data.items() if k not in _HEAVY}
            call["prompt_tokens"], call["response_tokens"] = _count(data.get("prompt_ids")), _count(
                data.get("response_ids"))
            calls.append(call)
        return calls

    def _session(self, session_id: str) -> SessionData | None:
        results = self._read_results()
        row = results.get(session_id)
        if row is None or not valid_session_id(session_id):
            return None  # only ids the run itself names ever become paths
        return SessionData(row=row, traces=self._traces(session_id),
                           calls=self._calls(session_id) or self._shipped_calls(session_id))

    async def session(self, session_id: str) -> SessionData | None:
        return await asyncio.to_thread(self._session, session_id)
