"""Token ids to text for the viewer, with the run's tokenizer when one is on disk (a ``tokenizer.json`` directory:
the run's ``inference.tokenizer``, else the project's cached Qwen tokenizer). Without one the page shows ids.

Each distinct id is decoded once and remembered: a session repeats the same few thousand ids. A token that is part
of a multi-byte character decodes alone to U+FFFD; it is shown by its byte-level piece instead.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

__all__ = ["TokenText", "find_tokenizer"]

log = logging.getLogger(__name__)


def find_tokenizer(configured: str | None) -> Path | None:
    """The tokenizer directory a run used: its configured one, else the cached Qwen tokenizer, if present."""
    from polar_gym.assets import tokenizer_dir

    for candidate in ([Path(configured).expanduser()] if configured else []) + [tokenizer_dir()]:
        if (candidate / "tokenizer.json").is_file():
            return candidate
    return None


class TokenText:
    """Decodes single token ids, lazily loading ``tokenizer.json`` (with the ``tokenizers`` library transformers
    is built on) on first use; thread-safe, since answers are built in worker threads."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._tok: Any = None
        self._failed = False
        self._cache: dict[int, str] = {}
        self._lock = threading.Lock()

    def _load(self) -> Any:
        if self._tok is None and not self._failed:
            try:
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
            except Exception as exc:  # a broken or foreign file: the page falls back to ids
                log.warning("viewer: cannot load the tokenizer in %s (%s); showing token ids", self.directory, exc)
                self._failed = True
        return self._tok

    def texts(self, ids: list[int]) -> dict[int, str] | None:
        """The text of each distinct id in ``ids``; None when no tokenizer loads."""
        with self._lock:
            tok = self._load()
            if tok is None:
                return None
            vocab_size = tok.get_vocab_size(with_added_tokens=True)
            for i in set(ids) - self._cache.keys():
                if not 0 <= i < vocab_size:
                    self._cache[i] = f"<{i}>"
                    continue
                text = tok.decode([i], skip_special_tokens=False)
                if "\ufffd" in text:
                    text = tok.id_to_token(i) or text
                self._cache[i] = text
            return {i: self._cache[i] for i in set(ids)}
