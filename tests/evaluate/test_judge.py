"""The judge's pure parts and its batching, against an in-memory judge (unit tier; tests/engine/
test_rubric_judge_vllm.py asks a real one): scores read from what judges write, a regular expression that admits
exactly the answer asked for, concurrent evaluations sharing calls of at most batch_size traces, and every failure a
JudgeError with its cause."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from polar_gym.evaluate.judge import JudgeBatcher, JudgeEndpoint, JudgeError, JudgeItem, read_scores, scores_regex


@pytest.mark.parametrize("answer", ['{"scores": [3, 0, 5]}', '```json\n{"scores": [3, 0, 5]}\n```',
                                    '<think>hmm {"scores": [1]}</think>{"scores": [3, 0, 5]}',
                                    '{"scores": [{"trace": 2, "score": 5}, {"trace": 0, "score": 3}, '
                                    '{"trace": 1, "score": 0}]}'])
def test_scores_are_read_from_what_judges_write(answer: str) -> None:
    assert read_scores(answer, 3, 5) == [3.0, 0.0, 5.0]


@pytest.mark.parametrize("answer", ["", "I think it is good", '{"scores": [3, 0]}', '{"scores": [3, 0, 6]}',
                                    '{"scores": [3, true, 1]}', '{"scores": "3,0,5"}', '{"scores": [3, 0, 5'])
def test_anything_but_one_score_in_range_per_trace_is_garbage(answer: str) -> None:
    with pytest.raises(JudgeError) as caught:
        read_scores(answer, 3, 5)
    assert caught.value.cause == "judge_garbage"


def test_the_regex_admits_exactly_the_answer_asked_for() -> None:
    pattern = scores_regex(3, 10)
    assert re.fullmatch(pattern, '{"scores": [10, 0, 7]}')
    for wrong in ('{"scores": [10, 0]}', '{"scores": [11, 0, 7]}', '{"scores":[1, 0, 7]}', '{"scores": [1, 0, 7]} '):
        assert not re.fullmatch(pattern, wrong)


def judge_transport(calls: list[dict], answer=None) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append(body)
        n = body["messages"][1]["content"].count("### Trace ")
        content = answer if answer is not None else json.dumps({"scores": [i % 6 for i in range(n)]})
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": content}}]})
    return httpx.MockTransport(handler)


async def test_concurrent_evaluations_share_calls_of_at_most_batch_size_traces() -> None:
    calls: list[dict] = []
    endpoint = JudgeEndpoint(url="http://judge/v1", model="j", batch_size=4, batch_window_seconds=0.05)
    judge = JudgeBatcher(endpoint, httpx.AsyncClient(transport=judge_transport(calls)))
    sessions = [[JudgeItem("rubric", f"session {s} trace {t}", 5) for t in range(3)] for s in range(3)]
    scores = await asyncio.gather(*(judge.score(items) for items in sessions))
    assert [len(c["messages"][1]["content"].split("### Trace ")) - 1 for c in calls] == [4, 4, 1]
    assert all(c["structured_outputs"]["regex"] and c["chat_template_kwargs"] == {"enable_thinking": False}
               for c in calls)
    assert [len(s) for s in scores] == [3, 3, 3]  # each session gets its own traces' scores back, in order
    assert scores[0] == [0.0, 1.0, 2.0] and scores[1][0] == 3.0


async def test_a_judge_that_fails_fails_every_session_of_its_call_with_the_cause() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    endpoint = JudgeEndpoint(url="http://judge/v1", model="j", batch_window_seconds=0)
    for transport, cause in ((httpx.MockTransport(down), "judge_unreachable"),
                             (httpx.MockTransport(lambda r: httpx.Response(503, text="busy")), "judge_unreachable"),
                             (judge_transport([], answer="no idea"), "judge_garbage")):
        judge = JudgeBatcher(endpoint, httpx.AsyncClient(transport=transport))
        outcomes = await asyncio.gather(judge.score([JudgeItem("r", "a", 5)]), judge.score([JudgeItem("r", "b", 5)]),
                                        return_exceptions=True)
        assert all(isinstance(o, JudgeError) and o.cause == cause for o in outcomes), outcomes


async def test_an_evaluation_cancelled_while_it_waits_does_not_stop_the_others() -> None:
    """A session cancelled while its traces wait for the judge: the next call still answers every other one."""
    calls: list[dict] = []
    endpoint = JudgeEndpoint(url="http://judge/v1", model="j", batch_size=2, batch_window_seconds=0.05)
    judge = JudgeBatcher(endpoint, httpx.AsyncClient(transport=judge_transport(calls)))
    cancelled = asyncio.create_task(judge.score([JudgeItem("r", "gone", 5), JudgeItem("r", "gone too", 5)]))
    kept = asyncio.create_task(judge.score([JudgeItem("r", "kept", 5)]))
    await asyncio.sleep(0)
    cancelled.cancel()
    assert await asyncio.wait_for(kept, 10) == [0.0]
    with pytest.raises(asyncio.CancelledError):
        await cancelled
