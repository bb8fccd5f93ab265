"""SFT examples from datagen's exports, as token ids and a loss mask.

Two line shapes are read (either may appear in one file):

- datagen's ``sft/train.jsonl`` (:class:`polar_gym.datagen.export.DatagenRecord`): OpenAI-style ``messages`` and
  ``tools``. They are rendered with the model's chat template; every assistant turn is trained (its reasoning,
  content and tool calls, up to and including ``<|im_end|>``), everything else is context. A turn's span is where
  rendering ``messages[:i]`` with the generation prompt and ``messages[:i + 1]`` differ, and it must be a prefix of
  the whole conversation's rendering (templates that rewrite earlier turns, e.g. drop old reasoning, fail this and
  the record is skipped with a reason rather than trained on text the model would never see).
- a launch's ``trajectories.jsonl`` (:class:`polar_gym.merge.exports.TraceLine`) or any line with ``prompt_ids``,
  ``response_ids`` and ``loss_mask``: the sampled tokens as they are (token-faithful, nothing re-encoded).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from polar_gym.merge.exports import template_tool
from polar_gym.trainer.batch import TrainSequence, sequence_of_trace

__all__ = ["ChatTokenizer", "SkippedRecord", "assistant_spans", "load_sft_file", "sequence_of_record",
           "template_message"]


class ChatTokenizer(Protocol):
    """The part of a transformers fast tokenizer this module uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


class SkippedRecord(ValueError):
    """A record that cannot be trained on faithfully (the reason says why)."""


def _arguments(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as vLLM hands it to the chat template (as :func:`polar_gym.proxy.tokenizer.template_messages`
    does for requests): null content as "", tool-call arguments parsed into objects."""
    out = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{**call, "function": {**call["function"],
                                                   "arguments": _arguments(call["function"].get("arguments"))}}
                             for call in message["tool_calls"]]
    return out


def _render(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
            generation_prompt: bool) -> str:
    # tools as the engine hands them to the template (exports older than template_tool kept pi's "strict": false)
    shown = [template_tool(t["function"] if isinstance(t.get("function"), Mapping) else t) for t in tools]
    text = tokenizer.apply_chat_template([template_message(m) for m in messages], tools=shown or None,
                                         tokenize=False, add_generation_prompt=generation_prompt)
    return str(text)


def assistant_spans(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] = ()) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn (trailing whitespace after the end
    of turn left out: the model never samples it)."""
    full = _render(tokenizer, messages, tools, False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, True) if i else ""
        upto = _render(tokenizer, messages[:i + 1], tools, False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise SkippedRecord(f"the chat template renders assistant turn {i} differently in the whole "
                                "conversation (a template that rewrites earlier turns)")
        spans.append((len(before), len(upto.rstrip())))
    if not spans:
        raise SkippedRecord("no assistant turn to train on")
    return full, spans


def sequence_of_record(record: Mapping[str, Any], tokenizer: ChatTokenizer | None) -> TrainSequence:
    """One datagen record or trace line as a TrainSequence (see the module docstring)."""
    reward = float(record.get("reward") or 0.0)
    if "response_ids" in record:
        logprobs = record.get("response_logprobs") or []
        values = [x["logprob"] if isinstance(x, Mapping) else x for x in logprobs]
        return sequence_of_trace(record.get("prompt_ids") or [], record["response_ids"], record["loss_mask"],
                                 values, reward=reward)
    if "messages" not in record:
        raise SkippedRecord("neither messages nor prompt_ids/response_ids/loss_mask")
    if tokenizer is None:
        raise SkippedRecord("a messages record needs a tokenizer")
    text, spans = assistant_spans(tokenizer, record["messages"], record.get("tools") or [])
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
    mask = [int(any(a <= s and e <= b for a, b in spans) and e > s) for s, e in offsets]
    if not any(mask):
        raise SkippedRecord("no token falls inside an assistant turn")
    first = mask.index(1)
    if first == 0:
        raise SkippedRecord("the conversation starts with an assistant turn: nothing predicts its first token")
    return TrainSequence(prompt_ids=ids[:first], response_ids=ids[first:], loss_mask=mask[first:], reward=reward)


def load_sft_file(paths: Iterable[str | Path], tokenizer: ChatTokenizer | None,
                  min_reward: float | None = None) -> tuple[list[TrainSequence], list[str]]:
    """Every trainable record of the JSONL files, and a reason line for each one skipped. ``min_reward`` keeps
    only records whose reward is at least that (datagen's train split already holds passing ones only)."""
    out: list[TrainSequence] = []
    skipped: list[str] = []
    for path in paths:
        with Path(path).open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if min_reward is not None and float(record.get("reward") or 0.0) < min_reward:
                    skipped.append(f"{path}:{n}: reward below {min_reward}")
                    continue
                try:
                    out.append(sequence_of_record(record, tokenizer))
                except SkippedRecord as exc:
                    skipped.append(f"{path}:{n}: {exc}")
    return out, skipped
