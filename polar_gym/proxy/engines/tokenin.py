"""Token-in engines: the proxy sends the engine exact prompt token IDs (``prompt_mode: token_in``).

The prompt of each call is a chain's exact IDs plus the chat template's rendering of the new suffix
(:mod:`polar_gym.proxy.prefix`); vLLM gets it on ``/v1/completions`` as a list of token IDs with
``return_token_ids``, SGLang on its native ``/generate`` as ``input_ids``. The sampled text is turned into the
protocol's message (reasoning, text, tool calls) by the configured output parser.

An upstream that serves only chat would refuse every such call (each a 502 to the harness), so processes find out at
start-up with one one-token call built like the real ones (:meth:`TokenInEngine.probe_token_prompt`; the bodies and
the launch's check: :mod:`polar_gym.proxy.engines.token_prompts`), whose refusal says to use ``prompt_mode chat``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import httpx
import orjson

from polar_gym.proxy.chat import ChatRequest, ChatResult, FinishReason, Usage
from polar_gym.proxy.engines.base import (
    HttpEngine,
    StreamDelta,
    StreamPiece,
    StreamStart,
    WeightUpdateMode,
    WholeAnswer,
    upstream_status_error,
)
from polar_gym.proxy.engines.openai import token_ids_in
from polar_gym.proxy.engines.sglang import generate_answer, update_sglang_weights
from polar_gym.proxy.engines.token_prompts import (
    COMPLETIONS_ROUTE,
    GENERATE_ROUTE,
    PROBE_PROMPT_IDS,
    completions_body,
    generate_body,
    served_model,
    token_probe_answer,
    token_probe_message,
)
from polar_gym.proxy.engines.vllm import reload_vllm_weights
from polar_gym.proxy.errors import RequestError, translate_upstream_errors
from polar_gym.proxy.images import has_images
from polar_gym.proxy.parsers.base import OutputParser, ParsedReply, call_id, malformed_call_spans
from polar_gym.proxy.prefix import PrefixRenderer, PromptPlan
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import Cut, UpstreamPool
from polar_gym.schema import VersionSpan

__all__ = ["Generation", "SGLangTokenInEngine", "StreamedAnswer", "TokenInEngine", "VLLMTokenInEngine",
           "keep_token_in_result", "parse_reply", "plan_prompt", "sent_prompt", "spend_budgets", "take_choice",
           "token_in_result"]

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "stop", "tool_calls": "tool_calls"}


#: why a token-in engine refuses an image (its prompt would silently lose it)
IMAGES_NEED_CHAT = ("this token_in engine renders text prompts and would lose the image: give vLLM a "
                    "vision-language model's tokenizer directory (its image token and preprocessor_config.json), or "
                    "use prompt_mode chat (--prompt-mode chat / inference.prompt_mode=chat)")


async def plan_prompt(renderer: PrefixRenderer, request: ChatRequest, session_id: str) -> PromptPlan:
    """The call's prompt plan: inline when it extends a chain with a few messages, else rendered whole (CPU work) in
    a thread, off the event loop every session shares."""
    plan = renderer.plan_cheap(request, session_id)
    if plan is None:
        plan = await asyncio.to_thread(renderer.plan, request, session_id)
    return plan


def parse_reply(parser: OutputParser, text: str, request: ChatRequest, plan: PromptPlan) -> ParsedReply:
    """The sampled text as the protocol's message. Tool-call ids come from the prompt's length and the text: a call
    sampled again later in the conversation (a command run twice) must not repeat an id the harness holds (Claude
    Code interrupts such a tool_use), and a replay of the same prompt and sample keeps them."""
    parsed = parser.parse(text, request.tools, thinking=plan.thinking)
    if parsed.message.tool_calls:
        parsed.message.tool_calls = [c.model_copy(update={"id": call_id(f"{len(plan.prompt_ids)}:{text}", i)})
                                     for i, c in enumerate(parsed.message.tool_calls)]
    return parsed


def keep_token_in_result(renderer: PrefixRenderer, session_id: str, plan: PromptPlan, parsed: ParsedReply,
                         result: ChatResult, decode: Callable[[list[int]], str]) -> None:
    """After a token-in call: keep what it sent and sampled as a chain node later calls extend, and tell the record
    (``result.raw``) the prompt mode, how many prompt tokens were reused, why a new chain started (if it did) and
    which tool-call blocks did not parse, with the tokens each was sampled as (``decode``: the tokenizer's)."""
    renderer.remember(session_id, plan, parsed.message, result.response_ids)
    result.raw["prompt_mode"] = "token_in"
    result.raw["reused_prompt_tokens"] = plan.reused
    if plan.new_chain is not None:
        result.raw["new_chain"] = plan.new_chain
    if parsed.unparseable_tool_calls:
        result.raw["unparseable_tool_calls"] = parsed.unparseable_tool_calls
        result.raw["malformed_tool_call_spans"] = malformed_call_spans(parsed.segments, result.response_ids, decode)


def token_in_result(engine: str, parser: OutputParser, request: ChatRequest, plan: PromptPlan,
                    answer: tuple[list[int], list[int], list[float], str, str, dict[str, Any]],
                    ) -> tuple[ChatResult, ParsedReply]:
    """The result of a token-in answer (prompt IDs, sampled IDs, logprobs, text, finish reason, extra raw data), as
    :meth:`TokenInEngine.complete` builds it, and the parsed reply behind its message."""
    prompt_ids, response_ids, logprobs, text, finish, extra = answer
    if prompt_ids != plan.prompt_ids:
        raise ValueError("the engine reports other prompt token IDs than the ones sent")
    parsed = parse_reply(parser, text, request, plan)
    reason: FinishReason = _FINISH.get(finish, "stop")
    if parsed.message.tool_calls and reason == "stop":
        reason = "tool_calls"
    result = ChatResult(message=parsed.message, finish_reason=reason, prompt_ids=prompt_ids,
                        response_ids=response_ids, response_logprobs=logprobs,
                        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(response_ids)),
                        engine=engine)
    result.raw.update(extra)
    return result, parsed


def spend_budgets(params: dict[str, Any], budgets: tuple[str, str], sampled: int) -> bool:
    """Reduce a continuation's token budgets (maximum, minimum) by the ``sampled`` tokens; False when the maximum
    is spent."""
    most, least = budgets
    if isinstance(params.get(most), int):
        params[most] -= sampled
        if params[most] <= 0:
            return False
    if isinstance(params.get(least), int):
        params[least] = max(params[least] - sampled, 0)
    return True


def take_choice(answer: StreamedAnswer, choice: dict[str, Any], values: list[Any]) -> tuple[list[int], list[float]]:
    """Add one chunk's choice to ``answer``: its sampled token IDs with their logprobs (``values``, one number per
    ID), its text and its finish reason; the IDs and logprobs it added."""
    ids = token_ids_in(choice.get("token_ids") or [])
    if len(values) != len(ids) or any(not isinstance(v, int | float) for v in values):
        raise ValueError(f"engine streamed {len(values)} logprobs for {len(ids)} sampled tokens")
    logprobs = [float(v) for v in values]
    answer.response_ids += ids
    answer.logprobs += logprobs
    answer.text += choice.get("text") or ""
    if choice.get("finish_reason"):
        answer.finish = str(choice["finish_reason"])
    return ids, logprobs


@dataclass
class StreamedAnswer:
    """A streamed answer read so far: what the chunks carried, added up (the engine's chunk reader fills it)."""

    prompt_ids: list[int] | None = None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: False once a sampled token came without its logprob (the record then has none, as a non-streamed one)
    logprobs_whole: bool = True
    text: str = ""
    finish: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def sent_prompt(plan: PromptPlan, answer: StreamedAnswer, sampled: int) -> list[int]:
    """The prompt of a generation's segment that starts after ``sampled`` tokens: the plan's and those tokens."""
    return list(plan.prompt_ids) + answer.response_ids[:sampled] if sampled else plan.prompt_ids


@dataclass
class Generation:
    """A token-in generation across weight updates (:meth:`TokenInEngine.generate`): the tokens every segment (one
    upstream call, cut by an update or run to its end) sampled, added up; which version sampled which; the cuts."""

    plan: PromptPlan
    answer: StreamedAnswer = field(default_factory=StreamedAnswer)
    spans: list[VersionSpan] = field(default_factory=list)
    cuts: int = 0
    server: str | None = None
    upstream_seconds: float = 0.0
    #: after a cut, the text is decoded here: ``text`` of ``response_ids[:decoded]`` (a clean character boundary)
    decoded: int = 0
    text: str = ""

    def stamp(self, start: int, end: int, version: int | str | None) -> None:
        """``response_ids[start:end]`` were sampled under ``version`` (joined to the last span when it is the same)."""
        if end <= start:
            return
        if self.spans and self.spans[-1]["policy_version"] == version:
            self.spans[-1]["end"] = end
        else:
            self.spans.append(VersionSpan(start=start, end=end, policy_version=version))

    def cut(self, tokenizer: HFChatTokenizer) -> None:
        """A weight update cut the generation: from now on its text is decoded from its IDs, starting at the last
        clean character boundary (a multi-byte character may straddle the cut)."""
        self.cuts += 1
        if self.cuts > 1:
            return
        ids = self.answer.response_ids
        for upto in range(len(ids), max(len(ids) - 4, 0) - 1, -1):
            text = tokenizer.decode(ids[:upto]) if upto else ""
            if not text.endswith("\ufffd"):
                self.decoded, self.text = upto, text
                break
        self.answer.text = self.text

    def decode_more(self, tokenizer: HFChatTokenizer) -> str:
        """The text of every token so far, decoding only those past the last clean boundary (one token of context
        before them, so a tokenizer that drops a leading space decodes them as in the whole)."""
        ids, at = self.answer.response_ids, self.decoded
        context = tokenizer.decode(ids[at - 1:at]) if at else ""
        whole = tokenizer.decode(ids[max(at - 1, 0):])
        piece = whole[len(context):] if whole.startswith(context) else tokenizer.decode(ids[at:])
        if piece.endswith("\ufffd"):  # a character still arriving: shown once whole
            return self.text + piece.rstrip("\ufffd")
        self.text += piece
        self.decoded = len(ids)
        return self.text


class TokenInEngine(HttpEngine):
    """An engine fed exact token IDs: subclasses supply the upstream body and read the answer back."""

    prompt_mode: ClassVar[str] = "token_in"
    can_stream: ClassVar[bool] = True
    #: read a non-streamed call's answer as a stream too, so a weight update can cut it instead of waiting for it
    cut_non_streamed: bool = True

    def __init__(self, tokenizer: HFChatTokenizer, parser: OutputParser, pool: UpstreamPool | None = None,
                 client: httpx.AsyncClient | None = None, timeout: float = 600.0,
                 upstream_model: str | None = None, *, renderer: PrefixRenderer | None = None) -> None:
        super().__init__(pool, client, timeout, upstream_model=upstream_model)
        self.tokenizer = tokenizer
        self.parser = parser
        self.renderer = renderer if renderer is not None else PrefixRenderer(tokenizer)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.end_of_turn_ids)

    async def plan(self, request: ChatRequest, session_id: str) -> PromptPlan:
        """The call's prompt plan (:func:`plan_prompt`). A request with images is refused: this engine renders
        text, and the image would be lost silently (:class:`~polar_gym.proxy.engines.vision.VLLMVisionTokenInEngine`
        takes them)."""
        if has_images(request):
            raise RequestError(IMAGES_NEED_CHAT)
        return await plan_prompt(self.renderer, request, session_id)

    def ids_body(self, request: ChatRequest, prompt_ids: list[int]) -> dict[str, Any]:
        """The upstream body sending ``prompt_ids`` with ``request``'s sampling parameters."""
        raise NotImplementedError

    def token_body(self, request: ChatRequest, plan: PromptPlan) -> dict[str, Any]:
        return self.ids_body(request, plan.prompt_ids)

    async def probe_token_prompt(self, server_url: str, *, client: httpx.AsyncClient | None = None) -> str | None:
        """Send ``server_url`` one minimal token prompt (a few of the tokenizer's IDs, one new token) through the
        route and body builder real calls use: None when it took it, else a message naming the URL, the route, what
        it answered and what to do instead. Raises UpstreamUnavailable / UpstreamTimeout when the server did not
        answer (or was busy): it may start later. ``client``: the one to post with (default: the engine's)."""
        http = client or self.client
        request = ChatRequest(model=self.upstream_model or "", messages=[], max_tokens=1, temperature=0.0)
        body = self.ids_body(request, self.tokenizer.encode("Hi")[:4] or list(PROBE_PROMPT_IDS))
        with translate_upstream_errors(server_url):
            if "model" in body and self.upstream_model is None:  # vLLM refuses a name it does not serve
                served = await http.get(server_url + "/v1/models", timeout=30.0)
                model = served_model(served.content) if served.status_code == 200 else None
                if model is not None:
                    body["model"] = model
                else:  # the server's own model (vLLM takes a body without one)
                    del body["model"]
            resp = await http.post(server_url + self.path, content=orjson.dumps(body),
                                   headers={"content-type": "application/json"})
        if resp.status_code in (429, 503):
            raise upstream_status_error(server_url, resp.status_code, resp.text)
        answer = token_probe_answer(resp.status_code, resp.content)
        return None if answer is None else token_probe_message(server_url, self.path, answer)

    def read_answer(self, body: dict[str, Any],
                    plan: PromptPlan) -> tuple[list[int], list[int], list[float], str, str, dict[str, Any]]:
        """(prompt IDs, sampled IDs, logprobs, sampled text, finish reason, extra raw data) of an answer."""
        raise NotImplementedError

    def read_chunk(self, answer: StreamedAnswer, chunk: dict[str, Any]) -> tuple[list[int], list[float]]:
        """Add one stream chunk to ``answer``; the token IDs and logprobs it added."""
        raise NotImplementedError

    def build(self, request: ChatRequest) -> dict[str, Any]:
        raise NotImplementedError("token-in engines build their body from a prompt plan")

    def parse(self, body: dict[str, Any]) -> ChatResult:
        raise NotImplementedError("token-in engines parse through read_answer")

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        """One call answered whole. With ``cut_non_streamed`` (the default) the upstream answer is read as a stream
        all the same, so a weight update can cut it (see :meth:`generate`); else as one JSON answer, which a
        weight update waits for."""
        plan = await self.plan(request, session_id)
        if self.cut_non_streamed:
            gen = Generation(plan)
            async with contextlib.aclosing(self.generate(request, session_id, gen)) as pieces:
                async for _ in pieces:
                    pass
            result, parsed = self.generation_result(request, gen)
        else:
            result, parsed = await self._complete_whole(request, session_id, plan)
        keep_token_in_result(self.renderer, session_id, plan, parsed, result, self.tokenizer.decode)
        return result

    async def _complete_whole(self, request: ChatRequest, session_id: str,
                              plan: PromptPlan) -> tuple[ChatResult, ParsedReply]:
        parsed: list[ParsedReply] = []

        def read(data: dict[str, Any]) -> ChatResult:
            result, reply = token_in_result(self.name, self.parser, request, plan, self.read_answer(data, plan))
            parsed.append(reply)
            return result

        result = await self.exchange(session_id, self.token_body(request, plan), read)
        return result, parsed[0]

    async def stream(self, request: ChatRequest, session_id: str) -> AsyncGenerator[StreamPiece, None]:
        """The same call as :meth:`complete`, streamed: each chunk yields the tokens it added and the text the
        parser can already tell is plain reasoning or content; the last piece is the result :meth:`complete` builds
        from the same tokens. A weight update's cut only pauses the stream (see :meth:`generate`)."""
        plan = await self.plan(request, session_id)
        gen = Generation(plan)
        reasoning, content = "", ""
        async with contextlib.aclosing(self.generate(request, session_id, gen)) as pieces:
            async for piece in pieces:
                if piece is None:  # the server took the call: the stream opens (its prompt is the plan's)
                    yield StreamStart(list(plan.prompt_ids))
                    continue
                ids, logprobs = piece
                r, c = self.parser.stream_prefix(gen.answer.text, thinking=plan.thinking)
                if ids or len(r) > len(reasoning) or len(c) > len(content):
                    yield StreamDelta(ids, logprobs, r[len(reasoning):], c[len(content):])
                    reasoning, content = max(r, reasoning, key=len), max(c, content, key=len)
        result, parsed = self.generation_result(request, gen)
        keep_token_in_result(self.renderer, session_id, plan, parsed, result, self.tokenizer.decode)
        yield result

    def continuation_body(self, body: dict[str, Any], prompt_ids: list[int], sampled: int) -> dict[str, Any] | None:
        """The body that continues ``body``'s generation after ``sampled`` tokens: ``prompt_ids`` (the plan's prompt
        and the tokens so far) as the prompt, the token budgets reduced by ``sampled``, everything else the same;
        None when the budget is spent."""
        raise NotImplementedError

    async def generate(self, request: ChatRequest, session_id: str,
                       gen: Generation) -> AsyncGenerator[tuple[list[int], list[float]] | None, None]:
        """Sample ``gen.plan``'s answer as a stream into ``gen``: None once the server took the call, then the tokens
        and logprobs of each chunk. A cutting pause (a weight update) cancels the upstream read (the stream
        closes: the server aborts the request); the tokens read so far are kept, and once the pool resumes the
        generation continues from them (:meth:`continuation_body`) on a server of the new version; it may be cut
        again. Which version sampled which tokens goes to ``gen.spans``."""
        body = self.token_body(request, gen.plan)
        body["stream"] = True
        if self.upstream_model is not None and "model" in body:
            body["model"] = self.upstream_model
        answer, sent, accepted = gen.answer, body, False
        while True:
            segment, cut, start = StreamedAnswer(), Cut(), len(answer.response_ids)
            async with self.pool.lease(session_id, cut) as server:
                started = time.perf_counter()
                chunks = 0
                upstream = self.post_stream(server.url, self.route_of(sent), sent, session_id)
                task = asyncio.current_task()
                try:
                    while not cut.requested:
                        cut.task = task  # a cutting pause cancels this read, and only this read (see Cut)
                        try:
                            chunk = await upstream.__anext__()
                        except StopAsyncIteration:
                            break
                        except asyncio.CancelledError:
                            if not cut.cancelled_by_cut():
                                raise
                            break
                        finally:
                            cut.task = None
                        if chunk is None:
                            if not accepted:
                                accepted = True
                                yield None
                            continue
                        chunks += 1
                        with translate_upstream_errors(server.url):
                            ids, logprobs = (self.read_chunk(segment, chunk) if not isinstance(chunk, WholeAnswer)
                                             else self._read_whole(segment, chunk, gen, start))
                        self._take(gen, segment, ids, logprobs)
                        yield ids, logprobs
                finally:
                    await upstream.aclose()
                gen.server = server.url
                gen.upstream_seconds += time.perf_counter() - started
                version = self.pool.policy_version
                cut_here = cut.requested and segment.finish is None
                with translate_upstream_errors(server.url):
                    if segment.prompt_ids is not None and segment.prompt_ids != sent_prompt(gen.plan, answer, start):
                        raise ValueError("the engine reports other prompt token IDs than the ones sent")
                    if not cut_here and not chunks:
                        raise ValueError("the stream carried no chunk")
                    if not cut_here and segment.finish is None:
                        raise ValueError("the stream ended without a finish reason")
            gen.stamp(start, len(answer.response_ids), version)
            answer.finish = segment.finish
            answer.extra.update(segment.extra)
            if not cut_here:
                return
            cut.done = True
            gen.cut(self.tokenizer)
            following = self.continuation_body(body, sent_prompt(gen.plan, answer, len(answer.response_ids)),
                                               len(answer.response_ids))
            if following is None:  # cut after its last token, before the finish came: nothing left to sample
                answer.finish = "length"
                return
            sent = following

    def _read_whole(self, segment: StreamedAnswer, body: dict[str, Any], gen: Generation,
                    start: int) -> tuple[list[int], list[float]]:
        """A segment answered whole (a server that ignored ``stream``): read as a non-streamed answer."""
        plan = gen.plan if not start else replace(gen.plan, prompt_ids=sent_prompt(gen.plan, gen.answer, start))
        prompt_ids, ids, logprobs, text, finish, extra = self.read_answer(body, plan)
        segment.prompt_ids, segment.response_ids, segment.logprobs = prompt_ids, ids, logprobs
        segment.text, segment.finish, segment.extra = text, finish, extra
        return ids, logprobs

    def _take(self, gen: Generation, segment: StreamedAnswer, ids: list[int], logprobs: list[float]) -> None:
        """A chunk's tokens join the generation's; its text is the upstream's until a cut, decoded from the IDs
        after one (each segment's upstream text starts afresh, and a character may straddle the cut)."""
        answer = gen.answer
        answer.response_ids += ids
        answer.logprobs += logprobs
        answer.logprobs_whole = answer.logprobs_whole and segment.logprobs_whole
        answer.text = segment.text if not gen.cuts else gen.decode_more(self.tokenizer)

    def generation_result(self, request: ChatRequest, gen: Generation) -> tuple[ChatResult, ParsedReply]:
        """The ChatResult of a finished generation: the plan's prompt, every sampled token and logprob, the text of
        them all, the last segment's finish reason; the version of the last token, and per version its tokens when
        several sampled them."""
        answer = gen.answer
        text = answer.text if not gen.cuts else self.tokenizer.decode(answer.response_ids)
        result, parsed = token_in_result(
            self.name, self.parser, request, gen.plan,
            (list(gen.plan.prompt_ids), answer.response_ids, answer.logprobs if answer.logprobs_whole else [], text,
             answer.finish or "stop", answer.extra))
        result.server = gen.server
        result.policy_version = gen.spans[-1]["policy_version"] if gen.spans else self.pool.policy_version
        if len(gen.spans) > 1:
            result.version_spans = gen.spans
        result.raw["upstream_seconds"] = gen.upstream_seconds
        if gen.cuts:
            result.raw["cuts"] = gen.cuts
        return result, parsed

    async def count_tokens(self, request: ChatRequest, session_id: str) -> int:
        plan = await asyncio.to_thread(self.renderer.plan, request, session_id)
        return len(plan.prompt_ids)

    def close_session(self, session_id: str) -> None:
        super().close_session(session_id)
        self.renderer.forget(session_id)


class VLLMTokenInEngine(TokenInEngine):
    """vLLM's ``/v1/completions`` with the prompt as token IDs."""

    name = "vllm"
    path: ClassVar[str] = COMPLETIONS_ROUTE
    weight_updates: ClassVar[WeightUpdateMode | None] = "reload"

    async def update_weights(self, server_url: str, checkpoint: str, version: int | str) -> dict[str, float]:
        return await reload_vllm_weights(self, server_url, checkpoint, version)

    def ids_body(self, request: ChatRequest, prompt_ids: list[int]) -> dict[str, Any]:
        return completions_body(request, prompt_ids, self.tokenizer.end_of_turn_ids)

    def continuation_body(self, body: dict[str, Any], prompt_ids: list[int], sampled: int) -> dict[str, Any] | None:
        following = {**body, "prompt": prompt_ids}
        return following if spend_budgets(following, ("max_tokens", "min_tokens"), sampled) else None

    def read_answer(self, body: dict[str, Any],
                    plan: PromptPlan) -> tuple[list[int], list[int], list[float], str, str, dict[str, Any]]:
        choice = body["choices"][0]
        prompt_ids = choice.get("prompt_token_ids") or body.get("prompt_token_ids")
        response_ids = choice.get("token_ids")
        if prompt_ids is None or response_ids is None:
            raise ValueError("no prompt_token_ids / token_ids in the answer (is this vLLM >= 0.10.2?)")
        values = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(values) != len(response_ids) or any(v is None for v in values):
            raise ValueError(f"engine returned {len(values)} logprobs for {len(response_ids)} sampled tokens")
        text = choice.get("text")
        if not isinstance(text, str):
            text = self.tokenizer.decode(token_ids_in(response_ids))
        return (token_ids_in(prompt_ids), token_ids_in(response_ids), [float(v) for v in values], text,
                str(choice.get("finish_reason") or "stop"), {})


    def read_chunk(self, answer: StreamedAnswer, chunk: dict[str, Any]) -> tuple[list[int], list[float]]:
        """vLLM's completion chunks carry the new tokens' IDs, logprobs and text; the first also the prompt IDs (a
        usage-only chunk, with no choices, adds nothing)."""
        if not chunk.get("choices") and "usage" in chunk:
            return [], []
        choice = chunk["choices"][0]
        if answer.prompt_ids is None:
            prompt_ids = choice.get("prompt_token_ids") or chunk.get("prompt_token_ids")
            if prompt_ids is None:
                raise ValueError("no prompt_token_ids in the first chunk (is this vLLM >= 0.10.2?)")
            answer.prompt_ids = token_ids_in(prompt_ids)
        return take_choice(answer, choice, (choice.get("logprobs") or {}).get("token_logprobs") or [])


class SGLangTokenInEngine(TokenInEngine):
    """SGLang's native ``/generate`` with ``input_ids``."""

    name = "sglang"
    path: ClassVar[str] = GENERATE_ROUTE
    weight_updates: ClassVar[WeightUpdateMode | None] = "reload"

    async def update_weights(self, server_url: str, checkpoint: str, version: int | str) -> dict[str, float]:
        return await update_sglang_weights(self, server_url, checkpoint, version)

    def ids_body(self, request: ChatRequest, prompt_ids: list[int]) -> dict[str, Any]:
        return generate_body(request, prompt_ids, self.tokenizer.end_of_turn_ids)

    def continuation_body(self, body: dict[str, Any], prompt_ids: list[int], sampled: int) -> dict[str, Any] | None:
        params = dict(body["sampling_params"])
        if not spend_budgets(params, ("max_new_tokens", "min_new_tokens"), sampled):
            return None
        return {**body, "input_ids": prompt_ids, "sampling_params": params}

    def read_answer(self, body: dict[str, Any],
                    plan: PromptPlan) -> tuple[list[int], list[int], list[float], str, str, dict[str, Any]]:
        answer = generate_answer(body, self.tokenizer.decode)
        extra: dict[str, Any] = {}
        if answer.weight_version is not None:
            extra["weight_version"] = answer.weight_version
        response_ids, logprobs, text, finish = answer.response_ids, answer.logprobs, answer.text, answer.finish
        return list(plan.prompt_ids), response_ids, logprobs, text, finish, extra

    def read_chunk(self, answer: StreamedAnswer, chunk: dict[str, Any]) -> tuple[list[int], list[float]]:
        """SGLang's ``/generate`` stream: each chunk's ``meta_info.completion_tokens`` counts every token so far,
        so the new ones are the last entries of ``output_token_logprobs`` (cumulative by default, only the new
        ones with ``--incremental-streaming-output``); ``text`` is cumulative unless it does not extend the text
        so far (then it is the new piece). A finished chunk carries ``meta_info.finish_reason``."""
        meta = chunk["meta_info"]
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise ValueError("no meta_info.output_token_logprobs in the chunk (was return_logprob set?)")
        new = int(meta.get("completion_tokens", len(answer.response_ids) + len(triples))) - len(answer.response_ids)
        if new < 0 or new > len(triples):
            raise ValueError(f"stream chunk claims {new} new tokens but lists {len(triples)}")
        fresh = triples[len(triples) - new:]
        ids = [int(t[1]) for t in fresh]
        if any(t[0] is None for t in fresh):
            answer.logprobs_whole = False
        logprobs = [float(t[0]) for t in fresh if t[0] is not None]
        answer.response_ids += ids
        answer.logprobs += logprobs
        text = chunk.get("text")
        if isinstance(text, str):
            answer.text = text if text.startswith(answer.text) else answer.text + text
        else:
            answer.text = self.tokenizer.decode(answer.response_ids)
        finish = meta.get("finish_reason")
        if finish:
            answer.finish = str(finish.get("type") or "stop") if isinstance(finish, dict) else str(finish)
        version = meta.get("weight_version")
        if version is not None:
            answer.extra["weight_version"] = version
        return ids, logprobs
