"""The NeMo Gym plugin's pure parts: /nemo payload → output items (contiguity holds), the extra-chains modes,
the policy backend registration and the Polar client against fakes, row → TaskRequest."""

from __future__ import annotations

import json

import httpx
import pytest

from polar_gym.env.tasks import EnvTemplate, task_request
from polar_gym.merge.nemo_payload import session_nemo_payload
from tests.env._env_kit import load_agent_module, nemo_rl_contiguity, two_chain_result

convert = load_agent_module("polar_convert")
client_mod = load_agent_module("polar_client")


def _payload() -> dict:
    return json.loads(json.dumps(session_nemo_payload(two_chain_result())))


def test_payload_has_cumulative_items_per_chain() -> None:
    payload = _payload()
    assert payload["status"] == "COMPLETED" and payload["reward"] == 1.0
    main, sub = payload["chains"]
    assert [i["prompt_token_ids"] for i in main["items"]] == [[1, 2, 3, 4], [1, 2, 3, 4, 10, 11, 12, 20, 21]]
    assert [i["generation_token_ids"] for i in main["items"]] == [[10, 11, 12], [13, 14]]
    assert main["items"][1]["generation_log_probs"] == pytest.approx([-0.5, -0.6])
    assert main["items"][0]["turn"]["tool_results"][0]["content"] == "calc.py"
    assert sub["chain_cause"] == "subagent" and main["contiguity_error"] is None


def test_report_mode_trains_main_chain_and_counts_the_rest() -> None:
    parts = convert.rollout_parts(_payload(), "report")
    assert [i["type"] for i in parts["output"]] == ["message", "function_call", "function_call_output", "message"]
    nemo_rl_contiguity(parts["output"])
    assert parts["output"][1]["name"] == "bash" and parts["output"][3]["content"][0]["text"] == "done"
    assert parts["metadata"]["polar_reward"] == "1.0"
    assert parts["metadata"]["polar_extra_chains"] == "1"
    assert parts["metadata"]["polar_extra_chain_generation_tokens"] == "1"
    assert all(isinstance(v, str) for v in parts["metadata"].values())  # OpenAI metadata: strings only
    assert "polar_extra_chains" not in parts["extras"] and parts["extras"]["polar"]["main_trace_index"] == 0


def test_separate_rows_mode_carries_every_chain_and_splits_offline() -> None:
    parts = convert.rollout_parts(_payload(), "separate_rows")
    (extra,) = parts["extras"]["polar_extra_chains"]
    assert extra["trace_index"] == 1 and extra["chain_cause"] == "subagent"
    nemo_rl_contiguity(extra["output"])
    line = {"reward": 1.0, "response": {"output": parts["output"], "metadata": parts["metadata"]}, **parts["extras"]}
    rows = convert.split_rollout(line)
    assert [r["polar_chain"] for r in rows] == ["main", 1]
    assert rows[1]["response"]["output"] == extra["output"] and rows[1]["reward"] == 1.0
    for row in rows:
        nemo_rl_contiguity(row["response"]["output"])
    with pytest.raises(ValueError, match="extra_chains"):
        convert.rollout_parts(_payload(), "drop")


def test_no_sampled_tokens_gives_empty_output() -> None:
    payload = {"session_id": "s", "status": "ERROR", "reason": "boom", "reward": None, "chains": []}
    parts = convert.rollout_parts(payload)
    assert parts["output"] == [] and parts["metadata"]["polar_reward"] == ""


def test_contiguity_reimplementation_rejects_a_dropped_history() -> None:
    output = convert.rollout_parts(_payload())["output"]
    output[3] = {**output[3], "prompt_token_ids": [1, 2, 3, 4, 20, 21]}  # the first generation is gone
    with pytest.raises(AssertionError, match="Non-contiguous"):
        nemo_rl_contiguity(output)


def test_backend_urls_normalize_policy_base_url() -> None:
    assert convert.backend_urls("http://h:8000/v1") == ["http://h:8000"]
    assert convert.backend_urls(["http://a:1/v1/", "http://b:2", "http://a:1"]) == ["http://a:1", "http://b:2"]
    assert convert.backend_urls("http://a:1/v1,http://b:2/v1") == ["http://a:1", "http://b:2"]
    assert convert.backend_urls(None) == [] and convert.backend_urls("") == []


async def test_register_backends_posts_each_url_with_the_admin_token() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers["x-admin-token"], json.loads(request.content)))
        return httpx.Response(200, json={"backends": [json.loads(request.content)["url"]], "gateways": {}})

    polar = client_mod.PolarClient("http://polar:9/", "T", httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    await polar.register_backends(convert.backend_urls(["http://vllm-0:8000/v1", "http://vllm-1:8000/v1"]))
    await polar.aclose()
    assert seen == [("POST", "/backends", "T", {"url": "http://vllm-0:8000"}),
                    ("POST", "/backends", "T", {"url": "http://vllm-1:8000"})]


async def test_submit_then_long_poll_until_the_session_is_done() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/tasks":
            body = json.loads(request.content)
            assert body["num_samples"] == 1
            return httpx.Response(201, json={"sessions": {"sid-1": "REGISTERED"}})
        if calls.count(request.url.path) == 1:
            return httpx.Response(202, json={"status": "RUNNING"})
        return httpx.Response(200, json=_payload())

    polar = client_mod.PolarClient("http://polar:9", "T", httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert await polar.submit({"task_id": "x", "num_samples": 1}) == "sid-1"
    assert (await polar.nemo("sid-1", timeout=10))["reward"] == 1.0
    await polar.aclose()
    assert calls == ["/tasks", "/sessions/sid-1/nemo", "/sessions/sid-1/nemo"]


async def test_server_errors_are_polar_errors() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(422, json={"error": "bad task"}))
    polar = client_mod.PolarClient("http://polar:9", "T", httpx.AsyncClient(transport=transport))
    with pytest.raises(client_mod.PolarError, match="HTTP 422"):
        await polar.submit({})
    await polar.aclose()


def test_rows_become_task_requests() -> None:
    demo = task_request({"demo": "demo-calc-add"})
    assert demo.task_id == "demo-calc-add" and demo.agent.harness == "pi"
    assert demo.metadata.oracle and demo.evaluator.strategy == "test_on_output"
    row = task_request({"instance_id": "i-1", "repo": "o/r", "demo": "demo-slugify"},
                       EnvTemplate(harness="codex", timeout_seconds=60))
    assert (row.task_id, row.agent.harness, row.timeout_seconds) == ("i-1", "codex", 60)
    assert task_request({"task_request": demo.model_dump(mode="json")}) == demo
    with pytest.raises(ValueError):
        task_request({"instruction": "no id"})


def test_task_ids_are_fresh_per_rollout() -> None:
    assert convert.task_id_for({"demo": "d"}, "u1") == "d-u1"
    assert convert.task_id_for({"task_request": {"task_id": "t"}}, "u2") == "t-u2"
