"""SFT on datagen's export shapes: messages rendered with the real chat template (assistant turns trained), token-id
lines used as they are, and the loop end to end (metrics, plot, a checkpoint that loads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from polar_gym.assets import tokenizer_dir
from polar_gym.trainer import SkippedRecord, TrainerSettings, load_policy, load_sft_file, run_sft, sequence_of_record

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Add the numbers."},
    {"role": "assistant", "content": "", "reasoning_content": "use bash",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "calc.py"},
    {"role": "assistant", "content": "Done: 3."},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


def _text(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids))


def test_messages_train_exactly_the_assistant_turns(tokenizer: Any) -> None:
    seq = sequence_of_record({"messages": MESSAGES, "reward": 1.0}, tokenizer)
    trained = [t for t, m in zip(seq.response_ids, seq.loss_mask, strict=True) if m]
    context = [t for t, m in zip(seq.response_ids, seq.loss_mask, strict=True) if not m]
    text = _text(tokenizer, trained)
    assert text.startswith("<think>\nuse bash\n</think>") and text.endswith("Done: 3.<|im_end|>")
    assert text.count("<|im_end|>") == 2 and '"name": "bash"' in text
    assert "calc.py" in _text(tokenizer, context) and "calc.py" not in text
    assert _text(tokenizer, seq.prompt_ids).endswith("<|im_start|>assistant\n")
    assert seq.reward == 1.0
    full = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert _text(tokenizer, seq.prompt_ids + seq.response_ids) == full.rstrip() + "\n"


def test_token_lines_are_used_as_they_are_and_bad_records_skipped(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "mixed.jsonl"
    lines = [{"prompt_ids": [1, 2], "response_ids": [3, 4], "loss_mask": [1, 0], "reward": 0.0,
              "response_logprobs": [{"token": None, "token_id": 3, "logprob": -0.5},
                                    {"token": None, "token_id": 4, "logprob": -0.25}]},
             {"messages": [{"role": "user", "content": "hi"}]},
             {"something": "else"},
             {"messages": MESSAGES, "reward": 0.5}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    sequences, skipped = load_sft_file([path], tokenizer)
    assert len(sequences) == 2 and sequences[0].response_ids == [3, 4] and sequences[0].old_logprobs == [-0.5, -0.25]
    assert [s.split(": ", 1)[1] for s in skipped] == ["no assistant turn to train on",
                                                       "neither messages nor prompt_ids/response_ids/loss_mask"]
    kept, dropped = load_sft_file([path], tokenizer, min_reward=0.5)
    assert len(kept) == 1 and len(dropped) == 3
    with pytest.raises(SkippedRecord):
        sequence_of_record({"messages": MESSAGES}, None)


def test_sft_loop_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    from tests.trainer._tiny import small_qwen3_dir

    data = tmp_path / "sft" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"messages": MESSAGES, "reward": 1.0}) + "\n" for _ in range(2)))
    settings = TrainerSettings(algorithm="sft", model=str(small_qwen3_dir(tmp_path)), data=[str(data)], steps=6,
                               batch_size=2, learning_rate=3e-3)
    out = tmp_path / "run"
    lines: list[str] = []
    final = run_sft(settings, out, echo=lines.append)
    rows = [json.loads(x) for x in (out / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and len(lines) == 6
    losses = [r["loss"] for r in rows]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.5, losses
    assert all(r["tokens"] > 0 and r["seconds"] > 0 for r in rows)
    assert (out / "train_metrics.svg").read_text().startswith("<svg")
    assert final == out / "checkpoints" / "final" and (final / "tokenizer.json").exists()
    load_policy(final)
