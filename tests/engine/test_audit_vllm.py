"""The mismatch audit on traces captured through the proxy from a real vLLM (CPU build, tiny Qwen3, real Qwen
tokenizer): an fp32 engine audited in fp32 is clean to 1e-4 and exits 0; the setups issue 14 names as broken
report the mismatch and exit non-zero: the session's bf16 engine audited in fp32, and traces whose tokens were
re-tokenized from the response text.

This module starts its own fp32 vLLM (the session's shared server is bfloat16, the project's default): one more
server start, 35-60 s, for the module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from polar_gym.assets import tiny_model_dir, tokenizer_dir
from polar_gym.audit.__main__ import main as audit_main
from polar_gym.merge import MergeConfig
from polar_gym.merge.exports import trace_lines
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.tokenin import VLLMTokenInEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import CompletionSession
from tests._serving import serve
from tests._vllm import VLLMServer

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def tokenizer() -> HFChatTokenizer:
    return HFChatTokenizer(tokenizer_dir())


def capture(server: VLLMServer, tokenizer: HFChatTokenizer, session: str, turns: int = 3,
            max_tokens: int = 32) -> list[dict[str, Any]]:
    """A multi-turn chat through the proxy (token-in engine) sampled at temperature 1; the prefix-merged trace
    lines of the session, as ``python -m polar_gym.merge --format traces`` writes them."""
    engine = VLLMTokenInEngine(tokenizer, parser_for("qwen3"), UpstreamPool([server.url], policy_version=0),
                               # no keep-alive: the proxy's event loop ends with this function
                               client=httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0),
                                                        limits=httpx.Limits(max_keepalive_connections=0)),
                               upstream_model=server.model)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True), model_names=[server.model])
    for running in serve(service):
        client = openai.OpenAI(base_url=running.url + "/v1", api_key=session, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me about the sea."}]
        for turn in range(turns):
            reply = client.chat.completions.create(model="policy", max_tokens=max_tokens, temperature=1.0,
                                                   messages=messages)  # type: ignore[arg-type]
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": f"Go on ({turn})."}]
        got = httpx.get(f"{running.url}/sessions/{session}/completions",
                        headers={"authorization": f"Bearer {session}"})
        got.raise_for_status()
        records = got.json()["completions"]
    traj = prefix_merging(CompletionSession.model_validate({"session_id": session, "completions": records}),
                          MergeConfig(end_of_turn_ids=tuple(tokenizer.end_of_turn_ids)))
    return [line.model_dump(mode="json") for line in trace_lines(traj)]


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def audited(out: Path) -> dict[str, Any]:
    summary = dict(json.loads((out / "audit_summary.json").read_text()))
    m = summary["metrics"]
    print(f"\n[audit] {out.name}: tokens {m.get('audit/tokens')} max|Δ| {m.get('audit/logprob_abs_diff_max')} "
          f"mean|Δ| {m.get('audit/logprob_abs_diff_mean')} k3 {m.get('rollout_corr/k3_kl')} "
          f"pearson(p) {m.get('training/rollout_actor_probs_pearson_corr')} "
          f"pearson(lp) {m.get('audit/logprob_pearson_corr')} "
          f"ρ>2 {m.get('rollout_corr/rollout_is_ratio_fraction_high')} {summary['seconds']}s "
          f"failures {summary['failures']}")
    return summary


def retokenized(row: dict[str, Any], tokenizer: HFChatTokenizer) -> dict[str, Any]:
    """The trace as a text-based pipeline rebuilds it: every sampled span decoded and encoded again, the engine's
    logprobs aligned by index (the tail repeated when the text re-encodes longer)."""
    response: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    spans = []
    old = row["response_logprobs"]
    cursor = 0
    for span in row["metadata"]["spans"]:
        bridge = row["response_ids"][cursor:span["start"]]
        response += bridge
        logprobs += [0.0] * len(bridge)
        mask += [0] * len(bridge)
        sampled = row["response_ids"][span["start"]:span["end"]]
        again = tokenizer.encode(tokenizer.decode(sampled))
        engine_lp = [e["logprob"] for e in old[span["start"]:span["end"]]]
        start = len(response)
        response += again
        logprobs += [engine_lp[min(k, len(engine_lp) - 1)] for k in range(len(again))]
        mask += [1] * len(again)
        spans.append({**span, "start": start, "end": len(response)})
        cursor = span["end"]
    return {**row, "response_ids": response, "loss_mask": mask, "response_logprobs": logprobs,
            "metadata": {**row["metadata"], "spans": spans}}


def test_fp32_engine_audits_clean(vllm_train_server: VLLMServer, tokenizer: HFChatTokenizer, tmp_path: Path) -> None:
    rows = capture(vllm_train_server, tokenizer, "audit-fp32-a") + capture(vllm_train_server, tokenizer, "audit-fp32-b")
    assert rows and all(r["metadata"]["policy_versions"] == [0] for r in rows)
    traces = write(tmp_path / "traces.jsonl", rows)
    assert audit_main(["--model", f"0={tiny_model_dir()}", str(traces)]) == 0
    s = audited(tmp_path)
    assert s["passed"] and s["audited"] == len(rows) and s["unaudited_tokens"] == 0
    assert s["metrics"]["audit/tokens"] == sum(sum(r["loss_mask"]) for r in rows) >= 150
    assert s["metrics"]["audit/logprob_abs_diff_max"] < 1e-4
    assert s["metrics"]["rollout_corr/k3_kl"] < 1e-8

    # the same tokens, re-tokenized from their text: the audit sees it and fails
    broken = [retokenized(r, tokenizer) for r in rows]
    assert [b["response_ids"] for b in broken] != [r["response_ids"] for r in rows]  # the text did not round-trip
    out = tmp_path / "retokenized"
    out.mkdir()
    assert audit_main(["--model", str(tiny_model_dir()), str(write(out / "traces.jsonl", broken))]) == 1
    s = audited(out)
    assert not s["passed"] and s["metrics"]["audit/logprob_abs_diff_max"] > 0.1
    worst = s["outliers"][0]
    assert worst["abs_diff"] > 0.1 and worst["token"] is not None


def test_bf16_engine_fails_an_fp32_audit(vllm_server: VLLMServer, tokenizer: HFChatTokenizer, tmp_path: Path) -> None:
    """The session's bf16 engine against an fp32 recompute. On this flat random model (entropy ~11.9 nats) bf16
    moves logprobs by ~1e-3 (max ~5e-3): k3 KL stays ~1e-6, under the default 1e-3 that suits real deployments, so
    the check that trips is the fp32 training loop's own criterion, max |Δ| < 1e-4 (issue 14's CI bar)."""
    rows = capture(vllm_server, tokenizer, "audit-bf16-a") + capture(vllm_server, tokenizer, "audit-bf16-b")
    traces = write(tmp_path / "traces.jsonl", rows)
    code = audit_main(["--model", str(tiny_model_dir()), "--max-abs-diff", "1e-4", str(traces)])
    s = audited(tmp_path)
    assert code == 1 and not s["passed"]
    assert [f.split(" ")[0] for f in s["failures"]] == ["audit/logprob_abs_diff_max"]
    assert s["metrics"]["audit/logprob_abs_diff_max"] > 1e-3  # 50x the fp32 engine's gap, measured ~1e-6
    assert s["outliers"] == []  # no single token past the 0.1 outlier bar: a diffuse mismatch, not a bad token
    # recomputed in bf16 too: the report still runs (kernels differ, so bf16 is no exact reference either)
    out = tmp_path / "bf16"
    audit_main(["--model", str(tiny_model_dir()), "--dtype", "bfloat16", "--out", str(out), str(traces)])
    assert audited(out)["dtype"] == "bfloat16"
