"""Malformed tool calls, from the sampled tokens to what a trainer gets: the oracle engine (real Qwen tokenizer,
token-in prompts) samples a reply holding a ``<tool_call>`` block whose JSON does not parse, through the real proxy
and the official OpenAI SDK; the proxy answers it as text and records the block's tokens; every builder marks the
trace, and the run's policy decides its reward and mask (``reward_zero_keep``, ``mask``, ``ignore``)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.merge import MALFORMED_POLICIES, build_trajectory
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.parsers.base import malformed_call_spans, parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.schema import BuilderSpec, CompletionRecord, CompletionSession, OracleScript
from tests._serving import RunningProxy, serve
from tests.merge._malformed import check_policy

pytestmark = pytest.mark.sdk

BAD_BLOCK = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"\n</tool_call>'
FINAL = f"All done, one more look:\n{BAD_BLOCK}"
BASH = {"type": "function", "function": {"name": "bash", "description": "run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


@pytest.fixture(scope="module")
def tok() -> HFChatTokenizer:
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer is not built: run `bash scripts/setup.sh`")
    return HFChatTokenizer(tokenizer_dir())


@pytest.fixture(scope="module")
def proxy(tok: HFChatTokenizer) -> Iterator[RunningProxy]:
    engine = OracleEngine(tok, default_script=OracleScript(commands=["printf hi > out.txt"], final_answer=FINAL))
    yield from serve(ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True)))


def agent_session(proxy: RunningProxy, session_id: str) -> CompletionSession:
    """A two-call agent loop as a harness runs it: a tool call, its result, then the reply with the bad block."""
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=session_id, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "write hi to out.txt"}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=[BASH])
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": ""}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=[BASH])
    reply = second.choices[0].message
    assert not reply.tool_calls and BAD_BLOCK in (reply.content or ""), "the harness sees the block as text"
    records = [CompletionRecord.model_validate(r) for r in proxy.completions(session_id)]
    return CompletionSession(session_id=session_id, completions=records)


def test_the_record_holds_the_tokens_of_the_block_it_answered_as_text(proxy: RunningProxy,
                                                                     tok: HFChatTokenizer) -> None:
    session = agent_session(proxy, "malformed-record")
    good, bad = sorted(session.completions, key=lambda r: r.index)
    assert good.unparseable_tool_calls == 0 and good.malformed_tool_call_spans == []
    assert bad.unparseable_tool_calls == 1 and bad.prompt_mode == "token_in"
    (span,) = bad.malformed_tool_call_spans
    assert tok.decode(bad.response_ids[span["start"]:span["end"]]).strip() == BAD_BLOCK
    # the fewest tokens: one less on either side no longer holds the block
    assert BAD_BLOCK not in tok.decode(bad.response_ids[span["start"] + 1:span["end"]])
    assert BAD_BLOCK not in tok.decode(bad.response_ids[span["start"]:span["end"] - 1])


@pytest.mark.parametrize("builder", ["prefix_merging", "per_request"])
@pytest.mark.parametrize("policy", MALFORMED_POLICIES)
def test_each_policy_gives_the_reward_mask_and_flag_it_promises(proxy: RunningProxy, builder: str,
                                                               policy: str) -> None:
    session = agent_session(proxy, f"malformed-{builder}-{policy}")
    check_policy(session, max(session.completions, key=lambda r: r.index).completion_id, builder, policy)


def test_an_unknown_policy_is_refused_naming_the_choices(proxy: RunningProxy) -> None:
    session = agent_session(proxy, "malformed-unknown-policy")
    with pytest.raises(ValueError, match="reward_zero_keep, mask, ignore"):
        build_trajectory(session, BuilderSpec(config={"malformed_tool_calls": "drop"}))


def test_a_block_whose_text_the_tokens_do_not_show_gets_the_whole_reply(tok: HFChatTokenizer) -> None:
    parser = parser_for("qwen3")
    ids = tok.encode(FINAL)
    segments = parser.segment(FINAL, thinking=False)
    (exact,) = malformed_call_spans(segments, ids, tok.decode)
    assert tok.decode(ids[exact["start"]:exact["end"]]).strip() == BAD_BLOCK
    other = tok.encode("Something else entirely, as long as the reply was.")
    assert malformed_call_spans(segments, other, tok.decode) == [{"start": 0, "end": len(other)}]


@pytest.mark.parametrize("policy", ["reward_zero_keep", "mask"])
def test_the_reference_trainer_trains_on_them_as_the_policy_says(proxy: RunningProxy, policy: str) -> None:
    """GRPO's batch (polar_gym.trainer.grpo_sequences, what bench_learning.py trains) over a group of two solved
    sessions, one with a malformed call: under reward_zero_keep its trace is a negative example with every sampled
    token trained; under mask it keeps the group's reward and trains none of the malformed reply."""
    from polar_gym.merge import apply_rewards
    from polar_gym.schema import EvalResult, SessionResult, SessionStatus
    from polar_gym.trainer import collate, grpo_sequences

    spec = BuilderSpec(strategy="per_request", config={"malformed_tool_calls": policy})
    results = []
    for name, final in ((f"clean-{policy}", False), (f"bad-{policy}", True)):
        session = agent_session(proxy, name)
        if not final:  # the same session without the bad reply: its first call alone
            session = session.model_copy(update={"completions": session.completions[:1]})
        scored = apply_rewards(build_trajectory(session, spec), EvalResult(reward=1.0, passed=True))
        results.append(SessionResult(session_id=name, task_id="t", status=SessionStatus.COMPLETED,
                                     trajectory=scored, evaluation=EvalResult(reward=1.0, passed=True)))
    sequences = grpo_sequences(results)
    bad_trace = next(t for t in results[1].trajectory.traces if t.metadata["tool_call_parse"] == "malformed")
    (bad,) = [s for s in sequences if s.response_ids == bad_trace.response_ids]
    others = [s for s in sequences if s is not bad]
    if policy == "reward_zero_keep":
        assert bad.reward == 0.0 and bad.advantage < 0 < min(s.advantage for s in others)
        assert sum(bad.loss_mask) == len(bad.response_ids)  # every sampled token is trained
    else:
        assert bad.reward == 1.0 and sum(bad.loss_mask) == 0
    batch = collate(sequences)
    assert batch.has_old_logprobs  # the engine's logprobs travel with them
