"""polar_gym as a NeMo Gym agent (integration profile external-agent-loop): each row's ``polar_task`` runs as one
Polar session (a real, unmodified harness in a sandbox, behind the token-recording gateway); run() answers with the
session's prefix-merged chain as token-carrying output items and the Polar evaluator's reward, verified through the
polar_gym_resources server. responses() is not supported: the agent loop is the harness's own.

Runs in NeMo Gym's interpreter with cwd and PYTHONPATH = this folder; needs only nemo_gym, httpx, pydantic and the
two sibling modules (polar_convert: pure conversion, polar_client: HTTP and child processes). With
``deliver_tokens: token_sink`` it also delivers every chain of each session as TokenEntry records through a NeMo Gym
token sink (polar_gym's journal transport, ``polar_gym.env.nemo_transport``, imported from the polar_gym package this
folder sits in)."""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import Request, Response
from nemo_gym.base_resources_server import BaseRunRequest, BaseVerifyResponse
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, Body, SimpleResponsesAPIAgent
from nemo_gym.config_types import ResourcesServerRef
from nemo_gym.openai_utils import (
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
    NeMoGymResponseFunctionCallOutput,
    NeMoGymResponseFunctionToolCall,
    NeMoGymResponseOutputMessageForTraining,
)
from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body
from nemo_gym.server_utils import get_response_json, raise_for_status
from nemo_gym.token_id_capture.config import token_id_capture_config
from polar_client import PolarClient, PolarError, ServeProcess, to_task_requests
from polar_convert import backend_urls, rollout_parts, task_id_for
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

ITEM_CLASSES = {"message": NeMoGymResponseOutputMessageForTraining, "function_call": NeMoGymResponseFunctionToolCall,
                "function_call_output": NeMoGymResponseFunctionCallOutput}


def _nemo_transport() -> Any:
    """polar_gym's journal transport, from the polar_gym package this folder sits in (polar_gym/env/...): it needs
    only pydantic and orjson, which NeMo Gym has."""
    package_root = str(Path(__file__).resolve().parents[4])
    if package_root not in sys.path:
        sys.path.append(package_root)
    from polar_gym.env import nemo_transport

    return nemo_transport


class PolarGymAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    #: a running Polar rollout server (else $POLAR_SERVER_URL; else the agent starts `polar_gym.env serve`)
    polar_server_url: str | None = None
    #: its admin token (else $POLAR_ADMIN_TOKEN)
    polar_admin_token: str | None = None
    #: polar_gym's interpreter (else $POLAR_PYTHON): starts serve and converts dataset-row polar_tasks
    polar_python: str | None = None
    #: extra arguments of `python -m polar_gym.env serve` (e.g. [--engine, vllm, --tokenizer, DIR])
    serve_args: list[str] = Field(default_factory=list)
    #: where serve keeps its store, captures and sandboxes (null: a temporary directory removed at exit)
    serve_dir: str | None = None
    serve_start_timeout_seconds: float = 180.0
    #: harness / runtime / builder / evaluator for dataset-row polar_tasks (polar_gym.env.tasks.EnvTemplate)
    task_template: dict[str, Any] = Field(default_factory=dict)
    session_timeout_seconds: float = 1800.0
    #: chains beyond the trained one (sub-agents, post-compaction): counts in metadata (report) or their items too
    extra_chains: Literal["separate_rows", "report"] = "report"
    #: POST the policy model URL(s) to the Polar server's /backends before the first session
    register_policy_backend: bool = False
    #: the policy server(s); null: the global `policy_base_url` (what NeMo RL sets to its vLLM HTTP servers)
    policy_base_url: str | list[str] | None = None
    #: response: the main chain in response.output only; token_sink: also every chain (sub-agents, compaction,
    #: retries) as TokenEntry records with their parent links through a NeMo Gym token sink, under the rollout id
    #: NeMo Gym gives the row (a session that did not complete is marked incomplete there)
    deliver_tokens: Literal["response", "token_sink"] = "response"
    #: the sink: polar_gym's journal transport in this directory; null: the run's `token_id_capture.sink`
    token_sink_root: str | None = None

    @field_validator("serve_args", mode="before")
    @classmethod
    def _words(cls, value: Any) -> Any:
        """Hydra turns `[--max-tokens-cap, 24]` into a number: command-line words are strings either way."""
        return [str(v) for v in value] if isinstance(value, list | tuple) else value


class PolarGymRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")
    polar_task: dict[str, Any]


class PolarGymVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")


class PolarGymAgent(SimpleResponsesAPIAgent):
    config: PolarGymAgentConfig
    ray_enabled = False
    _lock: asyncio.Lock = PrivateAttr(default_factory=asyncio.Lock)
    _polar: PolarClient | None = PrivateAttr(default=None)
    _serve: ServeProcess | None = PrivateAttr(default=None)
    _backends_registered: bool = PrivateAttr(default=False)
    _sink: Any = PrivateAttr(default=None)

    async def responses(self, request: Request, response: Response,
                        body: NeMoGymResponseCreateParamsNonStreaming = Body()) -> NeMoGymResponse:  # noqa: B008
        raise NotImplementedError("polar_gym_agent is an external agent loop: the harness talks to the policy "
                                  "through Polar's gateway; use /run")

    def _python(self) -> str | None:
        return self.config.polar_python or os.environ.get("POLAR_PYTHON")

    def _policy_urls(self) -> list[str]:
        value = self.config.policy_base_url or self.server_client.global_config_dict.get("policy_base_url")
        urls: list[str] = backend_urls(value)
        if not urls:
            raise PolarError("register_policy_backend is set but no policy_base_url is known")
        return urls

    async def _client(self) -> PolarClient:
        """The Polar server (configured, or a `serve` child started now) with the policy backend registered."""
        async with self._lock:
            register = self.config.register_policy_backend
            if self._polar is None:
                url = self.config.polar_server_url or os.environ.get("POLAR_SERVER_URL")
                token = self.config.polar_admin_token or os.environ.get("POLAR_ADMIN_TOKEN") or ""
                if not url:
                    python = self._python()
                    if not python:
                        raise PolarError("no Polar server: set polar_server_url (or $POLAR_SERVER_URL), or "
                                         "polar_python (or $POLAR_PYTHON) so the agent can start one")
                    args = list(self.config.serve_args)
                    if register:  # an engine like vllm needs its upstream from the start
                        args += [a for u in self._policy_urls() for a in ("--upstream", u)]
                    self._serve = ServeProcess(python, args, self.config.serve_dir)
                    atexit.register(self._serve.stop)
                    url, token = await asyncio.to_thread(self._serve.start, self.config.serve_start_timeout_seconds)
                    self._backends_registered = register
                self._polar = PolarClient(url, token)
            if register and not self._backends_registered:
                await self._polar.register_backends(self._policy_urls())
                self._backends_registered = True
            return self._polar

    async def _task_request(self, polar_task: dict[str, Any]) -> dict[str, Any]:
        if "task_request" in polar_task:
            request = dict(polar_task["task_request"])
        else:
            python = self._python()
            if not python:
                raise PolarError("a dataset-row polar_task needs polar_python (or $POLAR_PYTHON) to become a "
                                 "TaskRequest; or give a whole {\"task_request\": {...}}")
            request = (await to_task_requests(python, [polar_task], self.config.task_template))[0]
        metadata = dict(request.get("metadata") or {})
        metadata.setdefault("group_id", request.get("task_id"))
        return {**request, "task_id": task_id_for(polar_task, uuid.uuid4().hex[:12]), "num_samples": 1,
                "metadata": metadata}

    def _token_sink(self) -> Any:
        """The configured token sink, built once: polar_gym's journal transport at ``token_sink_root``, else the one
        the run configures (``token_id_capture.sink``, what NeMo RL sets)."""
        if self._sink is None:
            if self.config.token_sink_root:
                self._sink = _nemo_transport().PolarTokenSink(self.config.token_sink_root)
            else:
                self._sink = token_id_capture_config(self.server_client.global_config_dict).build_sink()
                if self._sink is None:
                    raise PolarError("deliver_tokens: token_sink needs token_sink_root or an enabled "
                                     "token_id_capture.sink")
        return self._sink

    async def _deliver_tokens(self, body: PolarGymRunRequest, payload: dict[str, Any]) -> dict[str, str]:
        """Put every chain's calls through the sink (the same bytes on a retry: idempotent); metadata saying
        where they went."""
        try:
            rollout_id = maybe_rollout_id_from_run_body(body)
        except ValueError:
            rollout_id = None
        delivered: dict[str, str] = await _nemo_transport().deliver_session(
            self._token_sink(), rollout_id or f"polar-{payload.get('session_id')}", payload)
        return delivered

    async def run(self, request: Request, body: PolarGymRunRequest) -> PolarGymVerifyResponse:
        polar = await self._client()
        task = await self._task_request(body.polar_task)
        session_id = await polar.submit(task)
        try:
            payload = await polar.nemo(session_id, self.config.session_timeout_seconds)
        except (PolarError, asyncio.CancelledError):
            await asyncio.shield(polar.cancel(session_id))
            raise
        parts = rollout_parts(payload, self.config.extra_chains)
        if self.config.deliver_tokens == "token_sink":
            parts["metadata"].update(await self._deliver_tokens(body, payload))
        output = [ITEM_CLASSES[item["type"]].model_validate(item) for item in parts["output"]]
        model = (task.get("agent") or {}).get("model_name") or "polar"
        response = NeMoGymResponse(id=f"resp_{session_id}", created_at=0, model=model, object="response",
                                   output=output, parallel_tool_calls=False, tool_choice="auto", tools=[],
                                   metadata=parts["metadata"])
        verify = await self.server_client.post(
            server_name=self.config.resources_server.name, url_path="/verify",
            json=body.model_dump() | {"response": response.model_dump(mode="json")}, cookies=request.cookies)
        await raise_for_status(verify)
        result = await get_response_json(verify)
        status = payload.get("status")
        if status != "COMPLETED":  # Polar trains only completed sessions (merge.exports.sample_status)
            result.update(mask_sample=True, failure_kind=f"polar_{str(status).lower()}",
                          failure_reason=payload.get("reason") or f"Polar session ended {status}")
        elif not output:
            result.update(mask_sample=True, failure_kind="polar_no_tokens",
                          failure_reason="the session sampled no tokens")
        verified: PolarGymVerifyResponse = PolarGymVerifyResponse.model_validate({**result, **parts["extras"]})
        return verified


if __name__ == "__main__":
    PolarGymAgent.run_webserver()
