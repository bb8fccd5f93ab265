"""load_tokenizer: the tokenizer AutoTokenizer would load, without importing torch where AutoTokenizer's choice is
plain (a tokenizer-only directory naming its class); AutoTokenizer itself everywhere else."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.proxy.tokenizer import _named_class, load_tokenizer

TEXTS = ["", "hi", "hi <|im_end|> there  \n\n  ünïcödé 😀", "def f(x):\n\treturn x ** 2  # ok", " " * 7 + "x",
         "<think>\nplan\n</think>\n\n<tool_call>\n{\"name\": \"bash\"}\n</tool_call>"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXTS[2]},
            {"role": "assistant", "content": "ok", "reasoning_content": "think",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "bash", "arguments": {"cmd": "ls"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a b"}]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    if not (tokenizer_dir() / ".complete").exists():
        pytest.skip("the Qwen tokenizer is not built (bash scripts/setup.sh)")
    return tokenizer_dir()


def test_the_tokenizer_is_the_one_autotokenizer_loads(qwen_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(qwen_dir), AutoTokenizer.from_pretrained(str(qwen_dir), local_files_only=True)
    assert type(ours) is type(auto) and len(ours) == len(auto)
    assert (ours.all_special_ids, ours.eos_token_id, ours.pad_token_id) == (
        auto.all_special_ids, auto.eos_token_id, auto.pad_token_id)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    for generation in (True, False):
        assert ours.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=generation, tokenize=False) \
            == auto.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=generation, tokenize=False)


def test_a_proxy_tokenizer_loads_without_torch(qwen_dir: Path) -> None:
    code = ("import sys; from polar_gym.proxy.tokenizer import HFChatTokenizer; "
            f"t = HFChatTokenizer({str(qwen_dir)!r}); assert t.encode('hi'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_every_other_directory_goes_through_autotokenizer(qwen_dir: Path, tmp_path: Path) -> None:
    config = json.loads((qwen_dir / "tokenizer_config.json").read_text())

    def with_config(name: str, tokenizer_config: dict, model_config: dict | None = None) -> Path:
        folder = tmp_path / name
        shutil.copytree(qwen_dir, folder)
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        if model_config is not None:
            (folder / "config.json").write_text(json.dumps(model_config))
        return folder

    assert _named_class(qwen_dir).__name__ == "Qwen2Tokenizer"
    assert _named_class(with_config("fast", {**config, "tokenizer_class": "Qwen2TokenizerFast"})) \
        is _named_class(qwen_dir)
    # a model's directory (its config may correct the class), remote code, Llama's rerouting, nonsense: AutoTokenizer
    assert _named_class(with_config("model", config, {"model_type": "qwen3"})) is None
    assert _named_class(with_config("remote", {**config, "auto_map": {"AutoTokenizer": ["x.T", None]}})) is None
    assert _named_class(with_config("llama", {**config, "tokenizer_class": "LlamaTokenizerFast"})) is None
    assert _named_class(with_config("odd", {**config, "tokenizer_class": "os.system"})) is None
    assert _named_class(with_config("model-class", {**config, "tokenizer_class": "PreTrainedModel"})) is None
    assert _named_class(with_config("unknown", {**config, "tokenizer_class": "NoSuchTokenizer"})) is None
    assert _named_class(with_config("none", {k: v for k, v in config.items() if k != "tokenizer_class"})) is None
    assert _named_class(tmp_path / "missing") is None
    model = load_tokenizer(with_config("model2", config, {"model_type": "qwen3"}))
    assert model.encode(TEXTS[2]) == load_tokenizer(qwen_dir).encode(TEXTS[2])
