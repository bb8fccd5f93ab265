"""vLLM's OpenAI server with ``return_token_ids``: prompt and sampled token IDs plus per-token logprobs.

New weights without a restart (:func:`reload_vllm_weights`, both vLLM engines): ``/collective_rpc`` runs
``reload_weights`` from a checkpoint directory in place, then the worker extension's ``polar_refresh_tied_weights``
(``polar_gym/vllm_plugin/polar_vllm_worker.py``: on the CPU build a tied output layer otherwise keeps the old
embedding),
``/reset_prefix_cache`` drops the KV blocks computed with the old weights (without it a cached prefix keeps
old-weight values), ``/update_weight_version`` tags the server. All are development routes: the server needs
``VLLM_SERVER_DEV_MODE=1`` (``polar_gym.assets.vllm_server_env(weight_updates=True)`` sets it and the extension).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.base import HttpEngine, StreamDelta, StreamPiece, StreamStart, WeightUpdateMode
from polar_gym.proxy.engines.openai import finish_reason_in, message_from_openai, token_ids_in, usage_in
from polar_gym.proxy.errors import WeightUpdateError, translate_upstream_errors

__all__ = ["ChatStreamAnswer", "VLLMEngine", "logprobs_in", "reload_vllm_weights"]

log = logging.getLogger(__name__)

DEV_MODE_HINT = "start vLLM with VLLM_SERVER_DEV_MODE=1 to load new weights without a restart"
#: how long a prefix-cache reset may be retried while blocks are still held (requests of other clients)
CACHE_RESET_SECONDS = 30.0


async def _refresh_tied_weights(engine: HttpEngine, server_url: str) -> None:
    """Re-process tied layers after a reload; a server without the worker extension is told of in the log (a GPU
    build does not need it, the CPU build serves a stale tied output layer without it)."""
    try:
        await engine.admin_post(server_url, "/collective_rpc", {"method": "polar_refresh_tied_weights"})
    except WeightUpdateError as exc:
        if "has no attribute 'polar_refresh_tied_weights'" not in exc.message:
            raise
        log.warning("%s has no polar_vllm_worker extension: a tied output layer may keep its old weights on "
                    "vLLM's CPU build (start it with --worker-extension-cls polar_vllm_worker.WeightReload)",
                    server_url)


async def reload_vllm_weights(engine: HttpEngine, server_url: str, checkpoint: str,
                              version: int | str) -> dict[str, float]:
    """Reload ``checkpoint`` into the vLLM server at ``server_url``, reset its prefix cache and tag it
    ``version``; the seconds of each step. A build without ``/update_weight_version`` is only not tagged."""
    started = time.perf_counter()
    await engine.admin_post(server_url, "/collective_rpc",
                            {"method": "reload_weights", "kwargs": {"weights_path": checkpoint}},
                            missing=DEV_MODE_HINT)
    try:
        await _refresh_tied_weights(engine, server_url)
        loaded = time.perf_counter()
        delay, deadline = 0.02, loaded + CACHE_RESET_SECONDS
        while not (await engine.admin_post(server_url, "/reset_prefix_cache", {},
                                           missing=DEV_MODE_HINT)).get("success"):
            if time.perf_counter() > deadline:  # blocks still held: a request the proxy does not see is running
                raise WeightUpdateError(f"{server_url} did not reset its prefix cache within "
                                        f"{CACHE_RESET_SECONDS:.0f} s (requests from another client still running?)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        reset = time.perf_counter()
        try:
            await engine.admin_post(server_url, "/update_weight_version", {"new_version": str(version)})
        except WeightUpdateError as exc:
            if " answered 404" not in exc.message:
                raise
    except WeightUpdateError as exc:
        exc.weights_changed = True  # the reload went through: the server holds (some of) the new weights
        raise
    return {"reload_seconds": loaded - started, "cache_reset_seconds": reset - loaded,
            "version_tag_seconds": time.perf_counter() - reset}


def logprobs_in(choice: dict[str, Any], n_tokens: int) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    values = [float(item["logprob"]) for item in content]
    if len(values) != n_tokens:
        raise ValueError(f"engine returned {len(values)} logprobs for {n_tokens} sampled tokens")
    return values


class VLLMEngine(HttpEngine):
    name = "vllm"
    weight_updates: ClassVar[WeightUpdateMode | None] = "reload"

    async def update_weights(self, server_url: str, checkpoint: str, version: int | str) -> dict[str, float]:
        return await reload_vllm_weights(self, server_url, checkpoint, version)

    def build(self, request: ChatRequest) -> dict[str, Any]:
        body = request.to_openai()
        body["return_token_ids"] = True
        body["logprobs"] = True
        body["top_logprobs"] = 0
        # Special tokens are part of what was sampled; keep them out of the text only.
        body.setdefault("skip_special_tokens", True)
        return body

    def parse(self, body: dict[str, Any]) -> ChatResult:
        choice = body["choices"][0]
        prompt_ids = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
        response_ids = choice.get("token_ids")
        if prompt_ids is None or response_ids is None:
            raise ValueError("no prompt_token_ids / token_ids in the answer (is this vLLM >= 0.10.2?)")
        message = message_from_openai(choice["message"])
        return ChatResult(
            message=message,
            finish_reason=finish_reason_in(choice, bool(message.tool_calls)),
            prompt_ids=token_ids_in(prompt_ids),
            response_ids=token_ids_in(response_ids),
            response_logprobs=logprobs_in(choice, len(response_ids)),
            usage=usage_in(body, len(prompt_ids), len(response_ids)),
            engine=self.name,
        )

    can_stream: ClassVar[bool] = True

    async def stream(self, request: ChatRequest, session_id: str) -> AsyncGenerator[StreamPiece, None]:
        """The same call as :meth:`complete`, streamed (vLLM's chat stream with ``return_token_ids``): it opens when
        vLLM has taken the call, and the prompt's IDs come with vLLM's first chunk (vLLM renders the prompt); its
        reasoning and content deltas pass through as they come, tool calls are held to the end; the
        last piece is the result :meth:`complete` builds from the same answer."""
        body = await self.prepare(request)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if self.upstream_model is not None and "model" in body:
            body["model"] = self.upstream_model
        answer, whole = ChatStreamAnswer(), None
        async with self.pool.lease(session_id) as server:
            started = time.perf_counter()
            async for chunk in self.post_stream(server.url, self.path, body, session_id):
                if chunk is None:  # vLLM took the call; the prompt's IDs come with its first chunk
                    yield StreamStart(None)
                    continue
                with translate_upstream_errors(server.url):
                    if "message" in (chunk.get("choices") or [{}])[0]:  # a server that answered whole
                        whole = self.parse(chunk)
                        yield StreamStart(list(whole.prompt_ids))
                        continue
                    ids, logprobs, reasoning, content = answer.read(chunk)
                if answer.chunks == 1:
                    yield StreamStart(list(answer.prompt_ids or []))
                if ids or reasoning or content:
                    yield StreamDelta(ids, logprobs, reasoning, content)
            with translate_upstream_errors(server.url):
                result = whole if whole is not None else answer.result(self.name)
            result.server = server.url
            result.policy_version = self.pool.policy_version
            result.raw["upstream_seconds"] = time.perf_counter() - started
        result.raw.setdefault("prompt_mode", self.prompt_mode)
        yield result


@dataclass
class ChatStreamAnswer:
    """A vLLM chat stream read so far (``return_token_ids``, ``logprobs``): the prompt's IDs from the first chunk,
    then per chunk the sampled IDs, their logprobs and the message delta (reasoning, content, tool-call pieces)."""

    prompt_ids: list[int] | None = None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    chunks: int = 0

    def read(self, chunk: dict[str, Any]) -> tuple[list[int], list[float], str, str]:
        """Add one chunk; the token IDs, logprobs, reasoning and content it added."""
        self.chunks += 1
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if self.prompt_ids is None:
            prompt_ids = chunk.get("prompt_token_ids")
            if prompt_ids is None:
                raise ValueError("no prompt_token_ids in the first chunk (is this vLLM >= 0.10.2?)")
            self.prompt_ids = token_ids_in(prompt_ids)
        if not chunk.get("choices"):
            return [], [], "", ""
        choice = chunk["choices"][0]
        ids = token_ids_in(choice.get("token_ids") or [])
        logprobs = logprobs_in(choice, len(ids)) if ids else []
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        content = delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            call = self.calls.setdefault(int(piece.get("index", 0)), {"id": "", "name": "", "arguments": ""})
            function = piece.get("function") or {}
            call["id"] = piece.get("id") or call["id"]
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""
        self.response_ids += ids
        self.logprobs += logprobs
        self.reasoning.append(reasoning)
        self.content.append(content)
        if choice.get("finish_reason"):
            self.finish = str(choice["finish_reason"])
        return ids, logprobs, reasoning, content

    def result(self, engine: str) -> ChatResult:
        """The whole answer, as :meth:`VLLMEngine.parse` reads the same answer unstreamed."""
        if self.prompt_ids is None or self.finish is None:
            raise ValueError("the stream ended before its answer did")
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for _, c in sorted(self.calls.items())]
        message = message_from_openai({"content": "".join(self.content) or None,
                                       "reasoning": "".join(self.reasoning) or None, "tool_calls": calls})
        return ChatResult(
            message=message, finish_reason=finish_reason_in({"finish_reason": self.finish}, bool(calls)),
            prompt_ids=self.prompt_ids, response_ids=self.response_ids, response_logprobs=self.logprobs,
            usage=usage_in({"usage": self.usage}, len(self.prompt_ids), len(self.response_ids)), engine=engine)
